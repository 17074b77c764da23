"""gRPC clients of a running cluster: `pdcluster generate --addr`, `chat`, `status`, and the demo's requests."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import grpc

from kv_transfer.auth import AddMetadata
from router.v1 import inference_pb2 as pb
from router.v1 import inference_pb2_grpc as pb_grpc


def stub(addr: str, api_key: str | None = None, tls_ca: str | None = None) -> pb_grpc.InferenceStub:
    """A client of the router at `addr`; TLS when `tls_ca` (the CA or self-signed certificate) is given."""
    if tls_ca:
        with open(tls_ca, "rb") as f:
            channel = grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        channel = grpc.insecure_channel(addr)
    if api_key:
        channel = grpc.intercept_channel(channel, AddMetadata(("authorization", f"Bearer {api_key}")))
    return pb_grpc.InferenceStub(channel)


def stub_from_args(args: Any) -> pb_grpc.InferenceStub:
    return stub(args.addr, args.api_key or os.environ.get("PDCLUSTER_API_KEY"), args.tls_ca)


def sampling_from_args(args: Any) -> pb.SamplingParams:
    s = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.seed is not None:
        s.seed = args.seed
    return s


def timeline_line(t: pb.Timeline, usage: pb.Usage) -> str:
    """One line a person can read: who served the request and where its time went."""
    where = f"decode={t.decode_worker}" if t.prefill_skipped else f"prefill={t.prefill_worker} decode={t.decode_worker}"
    return (f"[{where} | queue {t.queue_ms:.0f} ms, prefill {t.prefill_ms:.0f} ms, transfer {t.transfer_ms:.0f} ms "
            f"({t.kv_bytes_sent / 1e6:.1f} MB), first token {t.first_token_ms:.0f} ms, decode {t.decode_ms:.0f} ms, "
            f"total {t.total_ms:.0f} ms | {usage.prompt_tokens} prompt tokens ({usage.cached_prompt_tokens} cached), "
            f"{usage.completion_tokens} generated]")


def print_stream(chunks: Iterator[pb.GenerateChunk], out: TextIO = sys.stdout) -> tuple[str, pb.GenerateChunk]:
    """Print text as it streams; returns the whole text and the last chunk (finish reason, usage, timeline)."""
    last, text = pb.GenerateChunk(), []
    for chunk in chunks:
        out.write(chunk.text)
        out.flush()
        text.append(chunk.text)
        last = chunk
    out.write("\n")
    return "".join(text), last


def generate(args: Any) -> int:
    """`pdcluster generate --addr`: one request per prompt, streamed (--stream) or not."""
    s = stub_from_args(args)
    sampling = sampling_from_args(args)
    try:
        for prompt in args.prompts:
            if args.chat:
                creq = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=prompt)], sampling=sampling)
                call_stream, call_unary, req = s.ChatStream, s.Chat, creq
            else:
                call_stream, call_unary, req = s.GenerateStream, s.Generate, pb.GenerateRequest(prompt=prompt,
                                                                                                   sampling=sampling)
            if args.stream and not args.json:
                _, last = print_stream(call_stream(req))
                print(timeline_line(last.timeline, last.usage), file=sys.stderr)
                continue
            resp = call_unary(req)
            if args.json:
                print(json.dumps({"prompt": prompt, "request_id": resp.request_id, "text": resp.text,
                                  "token_ids": list(resp.token_ids), "finish_reason": resp.finish_reason,
                                  "usage": {"prompt_tokens": resp.usage.prompt_tokens,
                                            "completion_tokens": resp.usage.completion_tokens,
                                            "cached_prompt_tokens": resp.usage.cached_prompt_tokens},
                                  "timeline": {f.name: v for f, v in resp.timeline.ListFields()}}))
            else:
                print(resp.text)
                print(timeline_line(resp.timeline, resp.usage), file=sys.stderr)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    return 0


def chat(args: Any) -> int:
    """`pdcluster chat --addr`: a conversation on the terminal (or one turn per MESSAGE argument)."""
    s = stub_from_args(args)
    history = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    turns = iter(args.messages) if args.messages else _read_turns()
    failed = False  # NOTE: a failed turn is said and the conversation goes on; the exit status still tells
    for text in turns:
        history.append(pb.ChatMessage(role="user", content=text))
        try:
            reply, last = print_stream(s.ChatStream(pb.ChatRequest(messages=history,
                                                                   sampling=sampling_from_args(args))))
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            history.pop()
            failed = True
            continue
        history.append(pb.ChatMessage(role="assistant", content=reply))
        print(timeline_line(last.timeline, last.usage), file=sys.stderr)
    return 2 if failed else 0


def _read_turns() -> Iterator[str]:
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            return
        if line:
            yield line


def status(args: Any) -> int:
    """`pdcluster status --addr`: the workers, their load and KV blocks, prefix hits."""
    try:
        st = stub_from_args(args).GetClusterStatus(pb.ClusterStatusRequest())
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    print(format_status(st))
    return 0


def format_status(st: pb.ClusterStatus) -> str:
    lines = [f"model {st.model}, {st.mode}; redis {'ok' if st.redis_ok else 'UNREACHABLE'}; "
             f"prefix hits {st.cached_prompt_tokens}/{st.requested_prompt_tokens} prompt tokens "
             f"({st.prefix_hit_rate:.0%}); {st.router_inflight} requests in flight here",
             f"{'worker':<12} {'role':<10} {'alive':<5} {'epoch':>5} {'run':>4} {'wait':>4} {'free/blocks':>12} "
             f"{'cached':>6} {'hits':>14}"]
    for w in st.workers:
        lines.append(f"{w.name:<12} {w.role:<10} {'yes' if w.alive else 'NO':<5} {w.epoch:>5} {w.running:>4} "
                     f"{w.waiting:>4} {f'{w.free_blocks}/{w.num_blocks}':>12} {w.cached_blocks:>6} "
                     f"{f'{w.cached_prompt_tokens}/{w.requested_prompt_tokens}':>14}")
    return "\n".join(lines)


DEMO_SYSTEM = ("You are a concise assistant for a weather service. Answer in one or two sentences, plainly, without "
               "lists. If a question is not about weather or climate, say so politely and suggest asking about the "
               "weather instead. Prefer metric units, mention the season where it matters, and never invent "
               "measurements you were not given. Keep a friendly, calm tone.")
DEMO_QUESTIONS = ["Why is the sky blue?", "What causes thunder?", "Why does it get colder at night?"]


def demo(addr: str, out: TextIO = sys.stdout) -> None:
    """The README's main job: a few chats through the gRPC API, streamed, each with its timeline; then the status."""
    s = stub(addr)
    sampling = pb.SamplingParams(max_tokens=48, temperature=0)
    out.write(f"pdcluster demo: gRPC API at {addr}; every question shares one system prompt, so after the first "
              "its blocks come from the prefix cache\n")
    for q in DEMO_QUESTIONS:
        out.write(f"\n>>> {q}\n")
        messages = [pb.ChatMessage(role="system", content=DEMO_SYSTEM), pb.ChatMessage(role="user", content=q)]
        _, last = print_stream(s.ChatStream(pb.ChatRequest(messages=messages, sampling=sampling)), out)
        out.write(timeline_line(last.timeline, last.usage) + "\n")
    out.write("\n" + format_status(s.GetClusterStatus(pb.ClusterStatusRequest())) + "\n")
