"""Builders shared by the tests: engines over the loaded models, transformers references, run loops."""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.llm_engine import RequestOutput
from engine.loader import LoadedModel
from pdcluster.bench.reference import hf_model_from  # noqa: F401  (re-exported for tests)


@dataclasses.dataclass
class Row:
    """A sampler row (engine.sampler.SamplingRow) made by hand: params and the token history (prompt + output)."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int = 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def import_triton_module(name: str) -> ModuleType:
    """Module `name` (Triton kernels with an INTERPRETED flag) as the tests run it: compiled on CUDA, else under
    Triton's interpreter, which decides when the module is imported (reloaded if this process imported it without);
    TRITON_INTERPRET is restored afterwards, so the rest of the suite never sees it.
    NOTE: the interpreter also needs triton itself first imported with TRITON_INTERPRET=1: call this before anything
    imports triton (tests/test_triton_compile.py imports it only in its own subprocess)."""
    if torch.cuda.is_available():
        return importlib.import_module(name)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(name)
        return module if module.INTERPRETED else importlib.reload(module)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def make_engine(loaded: LoadedModel, **overrides: object) -> LLMEngine:
    """An engine over already-loaded weights (loading is done once per session by the fixtures)."""
    cfg: dict[str, object] = dict(num_blocks=512, max_num_batched_tokens=1024, num_threads=2)
    cfg.update(overrides)
    return LLMEngine(loaded, EngineConfig(**cfg))  # type: ignore[arg-type]


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until no request is left; the final output of each request, by id."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"engine did not finish within {max_steps} steps: {engine.stats()}")


def generate_ids(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY,
                 prefix: str = "r") -> list[list[int]]:
    """Token ids generated for each prompt, all submitted together (one continuous batch)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, dataclasses.replace(params))
    final = run_to_completion(engine)
    return [final[f"{prefix}{i}"].token_ids for i in range(len(prompts))]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS does not stop it)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_alone(loaded: LoadedModel, prompt: list[int], params: SamplingParams = GREEDY,
              **overrides: object) -> list[int]:
    """Token ids a fresh engine generates for this prompt on its own: the reference for batched/cached/moved runs."""
    return generate_ids(make_engine(loaded, **overrides), [prompt], params, prefix="alone")[0]


def assert_idle(engine: LLMEngine) -> None:
    """Nothing queued, running or reserved, and every KV block back in the free pool (cached blocks count as free)."""
    s = engine.stats()
    assert not engine.has_unfinished_requests(), s
    assert (s.num_waiting, s.num_running, s.num_reserved) == (0, 0, 0), s
    assert s.num_free_blocks == s.num_blocks, s


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation of one prompt (up to n tokens, ending early at EOS) and its logits."""
    # NOTE: no min_new_tokens: it masks EOS, which changes the argmax; our ignore_eos only keeps going past it.
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.logits]


def random_prompts(n: int, lengths: list[int], vocab: int = 49152, seed: int = 0) -> list[list[int]]:
    """`n` prompts of token ids (lengths cycled), reproducible; ids avoid the special tokens below 100."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


# ---- KV transfer ---------------------------------------------------------------------------------------------------
def open_kv_sender(transport: str, address: str, engine: LLMEngine, request_id: str, prompt: list[int],
                   sender_cls: type | None = None, **config: Any) -> Any:
    """A sender of `engine`'s KV of `prompt` to `address` (not started: `prefill_layerwise` drives it)."""
    from engine.block_hash import hash_prompt_blocks
    from kv_transfer import TransferConfig, open_sender
    from kv_transfer.pool import KVPool

    tc = TransferConfig(transport=transport, **config)
    hashes = hash_prompt_blocks(prompt, engine.config.block_size, engine.scope)
    sender = open_sender(tc, address, request_id, engine.kv_layout, prompt, len(prompt), hashes,
                         sender_id=f"test-{id(engine)}", pool=KVPool(engine))
    if sender_cls is None:
        return sender
    custom = sender_cls(sender.control, tc, request_id, engine.kv_layout, prompt, len(prompt), hashes,
                        sender_id=f"test-{id(engine)}")
    custom.pool = sender.pool  # NOTE: as open_sender gives it: nixl writes from the sending engine's pool
    return custom


def prefill_layerwise(engine: LLMEngine, sender: Any, prompt: list[int], params: SamplingParams | None = None, *,
                      layers: Any = None, prepare: bool = True) -> list[int]:
    """What a prefill worker does: handshake, prefill `prompt` handing each layer to `sender` as soon as the forward
    pass wrote it, commit the first token, and release the request (its blocks stay in the prefix cache).

    `layers(layer)` may stand in for the hand-over (a test that sends only some layers, or stops between two);
    `prepare=False` when the test made the handshake itself. Returns the token ids up to the first token.
    """
    rid = sender.request_id
    if prepare:
        sender.prepare()
    engine.add_request(rid, prompt, params or SamplingParams(max_tokens=1, temperature=0.0))
    engine.watch_layers(rid, layers or layer_sender(engine, sender, prompt))
    out = next(o for _ in range(10_000) for o in engine.step() if o.request_id == rid)
    sender.commit(out.new_token_ids, out.num_cached_tokens)
    engine.abort_request(rid)  # NOTE: the prefill worker's `loop.release`: decoding goes on elsewhere
    return out.token_ids


def layer_sender(engine: LLMEngine, sender: Any, prompt: list[int]) -> Any:
    """The hand-over `prefill_layerwise` makes by default, for a `layers` function that wraps it."""
    def send(layer: int) -> None:
        if sender.reads_pool:  # nixl: block ids of the pool, as the prefill worker hands them
            sender.send_blocks(layer, engine.kv_block_ids(sender.request_id, sender.cached_blocks, len(prompt)))
            return
        sender.send_layer(layer, *engine.read_kv_layer(sender.request_id, layer, sender.cached_blocks,
                                                       num_tokens=len(prompt)))
    return send


def describe(engine: LLMEngine, request_id: str, prompt: list[int]) -> Any:
    """The handshake a sender of `prompt` makes (what `KVSender.prepare` sends), on the local transport."""
    from engine.block_hash import hash_prompt_blocks
    from kv_transfer.messages import PrepareRequest

    return PrepareRequest(request_id, engine.kv_layout, prompt, len(prompt),
                          list(hash_prompt_blocks(prompt, engine.config.block_size, engine.scope)), "local", 10_000)


def free_blocks(engine: LLMEngine) -> int:
    return engine.stats().num_free_blocks


# ---- the cluster -----------------------------------------------------------------------------------------------
class RouterServer:
    """A Router's gRPC server on its own event loop thread in the test process (the way `serve` runs it)."""

    def __init__(self, router: Any, port: int = 0, **server_kwargs: Any) -> None:
        import asyncio
        import threading

        from router.service import start_server

        self.router = router
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="router-loop")
        self._thread.start()
        self.server, port = self.run(start_server(router, "127.0.0.1", port, **server_kwargs))
        self.address = f"127.0.0.1:{port}"

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the router's event loop (e.g. start another front next to gRPC) and wait for it."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stub(self, api_key: str | None = None, tls_ca: str | None = None) -> Any:
        from pdcluster.client import stub

        return stub(self.address, api_key, tls_ca)

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.server.stop(grace=1), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.router.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def start_test_cluster(yaml_path: str, namespace: str, *, edit: Any = None, server_kwargs: dict | None = None,
                       **router_overrides: Any) -> tuple[Any, RouterServer]:
    """A cluster from a deploy YAML inside the session's Ray (its own namespace and embedded Redis) and a router.

    `edit(config)` may change the loaded config first; `server_kwargs` go to the gRPC server (api_keys, credentials).
    """
    from pdcluster.config import ClusterConfig
    from pdcluster.launch import Cluster
    from pdcluster.serve import make_router

    config = ClusterConfig.from_yaml(yaml_path)
    config.ray.namespace = namespace
    for key, value in router_overrides.items():
        setattr(config.router, key, value)
    if edit is not None:
        edit(config)
    cluster = Cluster(config).start()
    return cluster, RouterServer(make_router(cluster), **(server_kwargs or {}))


def self_signed_cert(directory: Any) -> tuple[str, str]:
    """A fresh self-signed certificate for localhost / 127.0.0.1 and its key, as PEM files in `directory`."""
    import datetime
    import ipaddress
    import os

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def greedy_reference(loaded: LoadedModel, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of an undisturbed greedy run of each text prompt (one in-process engine, EOS ignored)."""
    return generate_ids(make_engine(loaded, num_blocks=1024), texts, greedy(max_tokens))  # type: ignore[arg-type]


def stream_greedy(server: Any, texts: list[str], max_tokens: int, tag: str,
                  started: threading.Event | None = None) -> list[tuple[list[int], Any]]:
    """Stream every text at once through the router's gRPC GenerateStream (greedy, EOS ignored, unique request ids);
    each stream's token ids and last chunk. `started` is set once any stream has 4 tokens."""
    from router.v1 import inference_pb2 as pb

    stub = server.stub()

    def one(i: int) -> tuple[list[int], Any]:
        ids: list[int] = []
        last = None
        req = pb.GenerateRequest(request_id=f"{tag}-{time.monotonic_ns()}-{i}", prompt=texts[i],
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        for chunk in stub.GenerateStream(req, timeout=300):
            ids += chunk.token_ids
            last = chunk
            if started is not None and len(ids) >= 4:
                started.set()
        return ids, last
    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(one, range(len(texts))))


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Whether `check()` holds within `timeout` seconds (polled every 50 ms; checked once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def first_then_rest(engine: LLMEngine, first: list[int], rest: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens (n each) of `first`, alone until its prompt is computed (so its blocks are cached), then of
    `rest` joining it: [first's, rest's in order]."""
    params = greedy(n)
    engine.add_request("first", first, dataclasses.replace(params))
    while engine.stats().computed_tokens < len(first):
        engine.step()
    for i, p in enumerate(rest):
        engine.add_request(f"r{i}", p, dataclasses.replace(params))
    final = run_to_completion(engine)
    return [final["first"].token_ids] + [final[f"r{i}"].token_ids for i in range(len(rest))]
