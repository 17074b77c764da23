"""LoRA adapters as the router serves them: a request's `model` names the base model or one adapter.

1. at start the router learns the adapters every worker loaded (`WorkerInfo.loras`: name → block-hash key);
2. a request's `model` resolves to an adapter's name (None: the base model) or is refused NOT_FOUND, as vLLM does
   (`ModelNotFound`: 404 on HTTP, NOT_FOUND on gRPC);
3. its prompt's blocks are looked up in the prefix index under its adapter's key (engine/block_hash.py, the same
   function and key the workers hash with), so no adapter's request is routed to another's cached prefix;
4. `load` and `unload` (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) change every worker, all or none;
5. a worker process that joins later (a scale-up, or Ray's restart of a dead one) loads the YAML's adapters by itself
   at start (a bad one fails its start); `restore` gives it the ones loaded at run time. Until it has one (or for
   good, if its load fails there) the worker is listed in `missing` (WorkerPools.missing), and requests of that
   adapter are routed to the workers that have it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from typing import Any

from engine.errors import InvalidRequestError
from router.errors import ModelNotFound

log = logging.getLogger(__name__)
# NOTE: a name is an OpenAI `model` id and a Prometheus label value: no spaces, no control characters
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"
LOAD_TIMEOUT_S = 60.0  # a worker's load of one adapter (reading its files) at most


class Adapters:
    """The adapters every worker has loaded: name → block-hash key (the key changes with the adapter's files)."""

    def __init__(self, keys: dict[str, str], missing: dict[str, set[str]] | None = None) -> None:
        self.keys = dict(keys)
        # NOTE: worker → the adapters of `keys` it lacks; shared with WorkerPools, which routes around them
        self.missing: dict[str, set[str]] = {} if missing is None else missing
        self.paths: dict[str, str] = {}  # adapters loaded at run time → their directory (`restore` reloads them)
        self.sources: dict[str, str] = {}  # the YAML's adapters → their directory (set by whoever knows the config)
        self.base_names: set[str] = set()  # other names of the base model (http.served_model_name for gRPC too)
        self._restoring: set[asyncio.Task[None]] = set()
        self._changing = asyncio.Lock()  # NOTE: one load or unload at a time: all-or-none needs a stable set

    def resolve(self, model: str | None, base: str, request_id: str | None = None) -> str | None:
        """The adapter `model` names (None: `model` is empty or `base`, the base model); ModelNotFound otherwise."""
        if not model or model == base or model in self.base_names:
            return None
        if model in self.keys:
            return model
        raise ModelNotFound(f"The model `{model}` does not exist (this server serves `{base}`"
                            f"{' and the LoRA adapters ' + ', '.join(sorted(self.keys)) if self.keys else ''}).",
                            request_id)

    def resolve_base_only(self, model: str, request_id: str | None = None) -> str | None:
        """`resolve` where only an empty `model` names the base model (a router front with no name for it)."""
        return self.resolve(model, "", request_id)

    def key(self, name: str | None) -> str:
        """The block-hash extra key of adapter `name` ("" for the base model or an adapter no longer loaded)."""
        return "" if name is None else self.keys.get(name, "")

    def cards(self, base: str, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models: the base model, then each adapter with the base as its `parent` (vLLM's shape)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "pdcluster", "root": name,
                 "parent": None if name == base else base, "max_model_len": max_model_len}
                for name in (base, *sorted(self.keys))]

    async def load(self, workers: Iterable[Any], name: str, path: str, base: str) -> None:
        """Load adapter `name` from `path` on every worker; on any refusal none keeps it (InvalidRequestError)."""
        if not re.fullmatch(ADAPTER_NAME, name) or name == base or name in self.base_names:
            raise InvalidRequestError("lora_name", f"must be a name matching {ADAPTER_NAME} other than the base "
                                                   f"model's ({base!r}), got {name!r}")
        if not path:
            raise InvalidRequestError("lora_path", "must be the adapter's directory (PEFT format)")
        async with self._changing:
            if name in self.keys:
                raise InvalidRequestError("lora_name", f"an adapter named {name!r} is already loaded")
            workers = list(workers)
            actors = [w.actor for w in workers]
            answers = await asyncio.gather(*(_call(a.load_lora, name, path) for a in actors))
            keys = {key for key, _ in answers if key}
            refused = sorted({why for _, why in answers if why})
            if refused or len(keys) != 1:
                # NOTE: all or none: a worker without the adapter would fail its requests, so the ones that took it
                # let it go again
                await asyncio.gather(*(_call(a.unload_lora, name) for a, (key, _) in zip(actors, answers) if key))
                raise InvalidRequestError("lora_path", "; ".join(refused) or "the workers loaded different files "
                                          f"for {name!r} (each worker reads {path} on its own node)")
            self.keys[name], self.paths[name] = keys.pop(), path
            self._holds(name, [w.name for w in workers])
            log.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(actors))

    async def unload(self, workers: Iterable[Any], name: str) -> None:
        """Unload adapter `name` from every worker (InvalidRequestError: unknown, or requests still use it)."""
        async with self._changing:
            if name not in self.keys:
                raise ModelNotFound(f"The model `{name}` does not exist (no LoRA adapter of that name is loaded).")
            # NOTE: new requests stop choosing it at once; a worker where requests still run with it refuses
            key, path = self.keys.pop(name), self.paths.pop(name, None)
            workers = list(workers)
            answers = await asyncio.gather(*(_call(w.actor.unload_lora, name) for w in workers))
            refused = sorted({why for _, why in answers if why and "no adapter named" not in why})
            if refused:
                # NOTE: all or none: still resident where requests use it, so the workers that let it go load it
                # again (from where it was loaded: run time or the YAML)
                self.keys[name] = key
                if path is not None:
                    self.paths[name] = path
                source = path or self.sources.get(name)
                let_go = [w for w, (_, why) in zip(workers, answers) if not why]
                again = [("", "no directory to load it from")] * len(let_go) if source is None else \
                    await asyncio.gather(*(_call(w.actor.load_lora, name, source) for w in let_go))
                for w, (got, why) in zip(let_go, again):
                    if got != key:  # NOTE: not resident there any more: routed around (WorkerPools.missing)
                        self.missing.setdefault(w.name, set()).add(name)
                        log.error("%s: LoRA adapter %s could not be loaded again: %s", w.name, name,
                                  why or "other files")
                raise InvalidRequestError("lora_name", "; ".join(refused))
            for lacking in self.missing.values():
                lacking.discard(name)
            log.info("LoRA adapter %s unloaded", name)

    def restore(self, worker: Any) -> None:
        """A fresh worker process (joined or restarted): load the adapters loaded at run time onto it, in the background
        (WorkerPools.on_new_process; called on the router's event loop)."""
        # NOTE: at once, before any request is routed to it: it lacks them until each load answers
        self.missing.pop(worker.name, None)
        if self.paths:
            self.missing[worker.name] = set(self.paths)
            task = asyncio.get_running_loop().create_task(self._restore(worker, dict(self.paths)))
            self._restoring.add(task)
            task.add_done_callback(self._restoring.discard)

    async def restored(self) -> None:
        """Wait for the restores under way."""
        await asyncio.gather(*self._restoring)

    async def _restore(self, worker: Any, paths: dict[str, str]) -> None:
        for name, path in paths.items():
            key, why = await _call(worker.actor.load_lora, name, path)
            if key and key != self.keys.get(name):
                log.error("%s: LoRA adapter %s from %s has other files there than on the other workers", worker.name,
                          name, path)
            elif why and "already loaded" not in why:  # NOTE: a new epoch of the same process already has it
                log.error("%s: cannot load LoRA adapter %s (loaded at run time) again: %s", worker.name, name, why)
            else:
                self.missing.get(worker.name, set()).discard(name)

    def _holds(self, name: str, workers: Iterable[str]) -> None:
        """`workers` have adapter `name` resident now."""
        for worker in workers:
            self.missing.get(worker, set()).discard(name)


async def _call(method: Any, *args: str) -> tuple[str, str]:
    """A worker's (key, why not) answer; a worker that does not answer counts as a refusal."""
    try:
        return tuple(await asyncio.wait_for(method.remote(*args), LOAD_TIMEOUT_S))  # type: ignore[return-value]
    except Exception as e:  # noqa: BLE001 - a dead or stuck worker: the change is refused, named
        return "", f"a worker did not answer ({type(e).__name__}: {e})"
