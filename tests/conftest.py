"""Session-wide fixtures: each model is loaded once per test session."""

from __future__ import annotations

import os

import pytest

# NOTE: `make test` runs the suite in two processes (pytest-xdist, one per core): each computes on one torch thread
# whose idle OpenMP threads sleep; two processes of two spinning threads each on two cores ran the CPU-bound tests
# up to several times slower. Set before torch is imported (OpenMP reads it once).
IN_XDIST = "PYTEST_XDIST_WORKER" in os.environ
if IN_XDIST:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from engine.loader import LoadedModel, load_model  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # NOTE: gRPC core logs every GOAWAY at INFO otherwise
torch.set_num_threads(1 if IN_XDIST else 2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In `make test`'s two processes, the modules with slow tests (clusters, killed processes) come first.

    NOTE: `make test` hands out whole modules in this order (`--dist loadfile --no-loadscope-reorder`): by default
    xdist hands out the modules with the most tests first, which left the slow modules of one or two cluster tests
    each to the end, one after the other on one process while the other idled. Now the many quick modules fill in.
    """
    if not IN_XDIST:
        return
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)  # NOTE: stable: each module keeps its order


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture(scope="session")
def hf_smollm2() -> torch.nn.Module:
    """transformers' own load of the same GGUF (its loader, not ours): the correctness reference."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    from engine.loader import SMOLLM2_FILE, SMOLLM2_PACKAGE

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    directory = list(spec.submodule_search_locations)[0]
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2_FILE, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (starting one costs ~8 s); clusters share it, each its namespace."""
    import ray

    # NOTE: logical CPUs beyond the cores let several small test clusters be placed at once; they idle mostly.
    for attempt in range(3):
        try:
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "GRPC_VERBOSITY": "ERROR"}})
            break
        except Exception:  # noqa: BLE001 - on a loaded 2-core machine the local node sometimes misses its start
            ray.shutdown()  # NOTE: timeout; a second start has always worked here
            if attempt == 2:
                raise
    yield ray
    ray.shutdown()
