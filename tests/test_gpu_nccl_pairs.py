"""NCCL cannot pair two ranks on one GPU (issue 38): the torch transport refuses such a pair before it makes the NCCL
group, naming the field, on both ranks; ranks on different GPUs pass. The GPU identity exchange runs on the CPU."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from kv_transfer.state import TransferError
from kv_transfer.transports.torch_pairs import RECEIVER, SENDER, refuse_one_gpu


def _pair(gpus: tuple[str, str]) -> list[BaseException | None]:
    """Both ranks of a pair run refuse_one_gpu over one TCPStore, rank i on GPU gpus[i]; what each raised."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    stores = {RECEIVER: master, SENDER: dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                                      timeout=timedelta(seconds=10))}
    raised: list[BaseException | None] = [None, None]

    def run(rank: int) -> None:
        try:
            refuse_one_gpu(dist.PrefixStore("pdcluster/kv/pair", stores[rank]), rank, gpus[rank], 10)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in (SENDER, RECEIVER)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return raised


def test_two_ranks_on_one_gpu_are_refused_on_both_sides_naming_the_field():
    raised = _pair(("GPU-0e8a", "GPU-0e8a"))
    for err in raised:
        assert isinstance(err, TransferError)
        assert "transfer.torch_backend" in str(err) and "one GPU" in str(err) and "nixl" in str(err)


def test_ranks_on_different_gpus_pair():
    assert _pair(("GPU-0e8a", "GPU-77c1")) == [None, None]


def test_a_missing_peer_times_out_rather_than_passing():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        refuse_one_gpu(store, SENDER, "GPU-0e8a", 1)
