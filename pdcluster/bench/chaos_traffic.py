"""The clients of `pdcluster bench chaos`: gRPC and OpenAI HTTP, streamed and unary, each request with a deadline.

Every request is a fresh prompt of random token ids (so it crosses the prefill → decode handoff), greedy, with
`ignore_eos` and an exact `max_tokens`. What the client saw goes into a `chaos_check.Record`: "OK" only when the
request finished; otherwise the status it got (gRPC code, `HTTP_<status>`, `STREAM_ERROR` for an SSE error event),
`REFUSED` / `DISCONNECTED` when the router's process is not there or went away (what gRPC calls UNAVAILABLE),
`CUT` for a response that ended with neither a finish nor an error, `HANG` when the client gave up past the deadline.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc

from pdcluster.bench.chaos_check import Record
from router.v1 import inference_pb2 as pb


def new_record(i: int, rng: random.Random, start_s: float, args: Any) -> Record:
    """The i-th request: protocol, streaming and router by `rng`; a fresh prompt of random ids."""
    n_prompt = rng.randint(args.min_prompt, args.max_prompt)
    prompt = [rng.randrange(100, 49000) for _ in range(n_prompt)]
    return Record(i, start_s, rng.choice(("grpc", "http")), rng.random() < 0.5, rng.choice(("serve", "extra")),
                  prompt, rng.randint(args.min_tokens, args.max_tokens))


def send_grpc(stub: Any, r: Record, deadline_s: float) -> None:
    """Send `r` over gRPC; fill its outcome."""
    req = pb.GenerateRequest(prompt_token_ids=r.prompt, sampling=pb.SamplingParams(
        max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    ids: list[int] = []
    try:
        if r.streamed:
            finish = ""
            for chunk in stub.GenerateStream(req, timeout=deadline_s):
                ids += chunk.token_ids
                r.text += chunk.text
                finish = chunk.finish_reason or finish
            r.status = "OK" if finish else "CUT"
        else:
            resp = stub.Generate(req, timeout=deadline_s)
            ids, r.text, r.status = list(resp.token_ids), resp.text, "OK"
    except grpc.RpcError as e:
        r.status, r.detail = e.code().name, (e.details() or "")[:200]  # type: ignore[attr-defined]
    r.token_ids = ids


def send_http(addr: str, model: str, r: Record, deadline_s: float) -> None:
    """Send `r` to the OpenAI completions endpoint; fill its outcome."""
    host, port = addr.rsplit(":", 1)
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": r.streamed}
    if r.streamed:
        body["stream_options"] = {"include_usage": True}
    end = time.monotonic() + deadline_s
    conn = http.client.HTTPConnection(host, int(port), timeout=deadline_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json",
                                                                  "x-request-timeout": str(deadline_s)})
        resp = conn.getresponse()
        if resp.status != 200:
            r.status, r.detail = f"HTTP_{resp.status}", resp.read()[:200].decode(errors="replace")
            return
        if not r.streamed:
            out = json.loads(resp.read())
            r.text = out["choices"][0]["text"]
            r.usage_tokens = int(out.get("usage", {}).get("completion_tokens", -1))
            r.status = "OK"
            return
        _read_sse(resp, r, end)
    except TimeoutError:
        r.status, r.detail = "HANG", f"nothing within the {deadline_s:.0f} s deadline"
    except ConnectionRefusedError as e:
        r.status, r.detail = "REFUSED", str(e)[:200]
    except (ConnectionResetError, http.client.RemoteDisconnected, http.client.IncompleteRead) as e:
        r.status, r.detail = "DISCONNECTED", f"{type(e).__name__}: {e}"[:200]
    except (OSError, http.client.HTTPException, json.JSONDecodeError, KeyError) as e:
        r.status, r.detail = "CUT", f"{type(e).__name__}: {e}"[:200]
    finally:
        conn.close()


def _read_sse(resp: http.client.HTTPResponse, r: Record, end: float) -> None:
    finish = ""
    for raw in resp:
        if time.monotonic() > end:
            r.status, r.detail = "HANG", "the stream ran past its deadline"
            return
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            r.status, r.detail = "STREAM_ERROR", str(ev["error"])[:200]
            return
        if ev.get("usage"):
            r.usage_tokens = int(ev["usage"].get("completion_tokens", -1))
        for choice in ev.get("choices") or []:
            r.text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    r.status = "OK" if finish else "CUT"


def stalled_stream(addr: str, model: str, max_tokens: int, hold_s: float, cut: Callable[[], bool]) -> str:
    """Open a streamed completion, read its first bytes, then read nothing until the router says it cut a stream
    off (`cut()`, its stall counter) or `hold_s` passed; what became of it ("cut off ..." when it was)."""
    host, port = addr.rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": [random.randrange(100, 49000) for _ in range(32)],
                       "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True})
    with socket.socket() as sock:
        # NOTE: a small receive buffer, so the server's writes block soon after the client stops reading; set before
        # connecting (the window the client offers is fixed then): set after, a whole generation fits in the buffers
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect((host, int(port)))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        first = sock.recv(512)
        if not first.startswith(b"HTTP/1.1 200"):
            status_line = first.split(b"\r\n", 1)[0].decode(errors="replace")
            return f"refused: {status_line}"
        # NOTE: the router's limit runs from when its writes block (the socket buffers full), not from the last read
        held = time.monotonic()
        while time.monotonic() - held < hold_s and not cut():
            time.sleep(1.0)
        hold_s = time.monotonic() - held
        # NOTE: after the pause, drain: a router that cut the stream off has closed it (EOF comes quickly)
        sock.settimeout(5)
        data, t = bytearray(first), time.monotonic()
        try:
            while chunk := sock.recv(65536):
                data += chunk
                if time.monotonic() - t > 30:
                    return f"still streaming {hold_s:.0f} s after the client stopped reading (not cut off)"
        except TimeoutError:
            if b"data: [DONE]" in data:  # NOTE: the whole response fit in the socket buffers: nothing stalled
                return f"finished: the whole response ({len(data)} bytes) fit in the socket buffers"
            return f"held open, silent, {hold_s:.0f} s after the client stopped reading (not cut off)"
        except OSError as e:
            return f"cut off: the router closed it ({type(e).__name__}) {hold_s:.0f} s after the client's last read"
        if b"data: [DONE]" in data:
            return f"finished ({len(data)} bytes) while the client did not read for {hold_s:.0f} s"
        return f"cut off: the router ended it ({len(data)} bytes buffered) {hold_s:.0f} s after the client's last read"
