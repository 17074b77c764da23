"""`bench serve --backend openai`: the same workloads and records against any OpenAI-compatible server.

Each turn is one streamed `POST {base_url}/completions` (aiohttp, one session, no connection limit so the load
stays open-loop) with the workload's token ids as the prompt, greedy, `ignore_eos` and exact `max_tokens` (vLLM's
and SGLang's extensions; pdcluster's HTTP front takes them too), `stream_options.include_usage`, and vLLM's
`return_token_ids` so a chunk says how many tokens it carries.

How a chunk is counted (the same rule as the gRPC path, see runner.itl_of): `choices[0].token_ids` when the server
sends them, else one token per chunk with text (vLLM's own benchmark counts chunks the same way); the output length
is `usage.completion_tokens`. A server that merges tokens into one chunk without saying so shows fewer, longer gaps.
A follow-up turn resends the answer's token ids when the server returned them, else the same number of filler ids
(the answer's text cannot be turned back into the ids the server generated).
Errors are per request: an HTTP status (`HTTP_429: ...`), an error event in the stream (`STREAM: ...`), a dropped
connection (`CONNECTION: ...`), a timeout (`TIMEOUT: ...`) or a wrong answer length (`LENGTH: ...`); the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from pdcluster.bench.runner import itl_of, run_sessions
from pdcluster.bench.stats import RequestRecord
from pdcluster.bench.workloads import Workload

FILLER_TOKEN = 1000  # an ordinary token of SmolLM2's vocabulary, for answers whose ids the server did not return

# NOTE: a client's idle connections go before the server's keep-alive timeout (5 s, as uvicorn's, vLLM's and the
# router's: router/http_limits.py): one reused just as the server closes it fails its request (ServerDisconnected;
# aiohttp does not retry a POST)
KEEPALIVE_S = 2.0


def completions_url(base_url: str) -> str:
    """`http://HOST:PORT/v1` (or with a trailing slash, or the full endpoint) → the completions endpoint."""
    url = base_url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url: expected http(s)://HOST:PORT/v1, got {base_url!r}")
    return url if url.endswith("/completions") else url + "/completions"


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id of `GET {base_url}/models` (what to send as `model` when none was given)."""
    url = completions_url(base_url).removesuffix("/completions") + "/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(url, headers=_headers(api_key)) as resp:
                if resp.status != 200:
                    raise ValueError(f"--base-url: GET {url} answered HTTP {resp.status}: "
                                     f"{(await resp.text())[:200]}")
                models = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ValueError(f"--base-url: GET {url} failed ({type(e).__name__}: {e}); is the server up?") from None
    if not models:
        raise ValueError(f"--base-url: GET {url} lists no model; pass --model")
    return str(models[0]["id"])


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON objects of a server-sent event stream; None for `[DONE]`."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        # NOTE: events end with a blank line; "\r\n" line ends are allowed by the SSE spec.
        buf = buf.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    yield None if payload == b"[DONE]" else json.loads(payload)


def _body(rec: RequestRecord, prompt: list[int], model: str) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": rec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}


async def _one(http: aiohttp.ClientSession, url: str, model: str, rec: RequestRecord, prompt: list[int],
               t_run: float, headers: dict[str, str]) -> list[int]:
    """Send one turn; fill `rec`; return the answer's token ids (filler ids when the server sends none)."""
    t0 = time.perf_counter()
    rec.sent_s = t0 - t_run
    ids: list[int] = []
    counted, last_t, completion_tokens = 0, t0, None
    try:
        async with http.post(url, json=_body(rec, prompt, model), headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP_{resp.status}: {(await resp.text())[:300]}"
                return ids
            async for ev in _events(resp):
                now = time.perf_counter()
                if ev is None:
                    break
                if "error" in ev:
                    err = ev["error"]
                    rec.error = f"STREAM: {err.get('message', err) if isinstance(err, dict) else err}"
                    return ids
                if ev.get("usage"):
                    u = ev["usage"]
                    completion_tokens = u.get("completion_tokens")
                    rec.cached_tokens = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                if extra := ev.get("pdcluster"):
                    _timeline(rec, extra.get("timeline") or {})
                for choice in ev.get("choices") or []:
                    token_ids = choice.get("token_ids")
                    n = len(token_ids) if token_ids is not None else int(bool(choice.get("text")))
                    if n:
                        itl_of(rec, n, now, last_t, t0, first=not counted)
                        last_t, counted = now, counted + n
                        ids += token_ids or []
    except asyncio.TimeoutError:
        rec.error = f"TIMEOUT: no full answer within {http.timeout.total} s"
        return ids
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        rec.error = f"CONNECTION: {type(e).__name__}: {e}"
        return ids
    rec.e2e_ms = (time.perf_counter() - t0) * 1e3
    rec.output_len = completion_tokens if completion_tokens is not None else counted
    if rec.output_len != rec.max_tokens:
        rec.error = f"LENGTH: {rec.output_len} tokens, asked for exactly {rec.max_tokens}"
    return ids if len(ids) == rec.output_len else [FILLER_TOKEN] * rec.output_len


def _timeline(rec: RequestRecord, t: dict[str, Any]) -> None:
    """pdcluster's own fields of a last chunk: the KV transfer and which workers served the request."""
    rec.transfer_ms = float(t.get("transfer_ms", 0.0))
    rec.prefill_worker = str(t.get("prefill_worker", ""))
    rec.decode_worker = str(t.get("decode_worker", ""))
    rec.prefill_skipped = bool(t.get("prefill_skipped", False))


async def run_workload_openai(base_url: str, workload: Workload,
                              on_done: Callable[[RequestRecord], None] = lambda r: None, *, model: str | None = None,
                              api_key: str | None = None,
                              timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send every session of `workload` to the OpenAI-compatible server at `base_url`; records and seconds."""
    url = completions_url(base_url)
    model = model or await served_model(base_url, api_key)
    headers = _headers(api_key)
    # NOTE: limit=0: no cap on open connections (aiohttp's default 100 would queue requests in the client).
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:

        async def send(rec: RequestRecord, prompt: list[int], t_run: float) -> list[int]:
            return await _one(http, url, model, rec, prompt, t_run, headers)

        return await run_sessions(workload, send, on_done)
