"""`pdcluster bench path`'s floor: a bare gRPC or HTTP server, in a process of its own, streams every token it is
asked for at the given pace, and its CPU per token (and per short request) is what the bench prints beside the
router's."""

from __future__ import annotations

import time

import pytest

from pdcluster.bench.path_clients import grpc_stream, http_stream
from pdcluster.bench.path_floor import floor, floor_per_request


@pytest.mark.parametrize("front,every,loop", [("grpc", 1, "auto"), ("http", 1, "auto"), ("grpc", 3, "auto"),
                                             ("grpc", 1, "asyncio")])
def test_a_bare_server_streams_every_token_at_the_pace_and_costs_cpu(front, every, loop):
    stream = {"grpc": grpc_stream, "http": http_stream}[front]
    t = time.perf_counter()
    # NOTE: floor raises unless every stream got every token (with `every` 3: in messages of 3, the last one of 2)
    cpu_per_1k = floor(front, stream, streams=3, tokens=20, gap_s=0.01, every=every, loop=loop)
    # NOTE: 20 ticks of 10 ms at least, after the server's 1 s of idle measurement
    assert time.perf_counter() - t > 1.2
    assert cpu_per_1k > 0.0  # NOTE: the server's own clock: 60 messages cost more than its idle share


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_a_bare_server_answers_requests_one_by_one_and_costs_cpu_per_request(front):
    stream = {"grpc": grpc_stream, "http": http_stream}[front]
    # NOTE: raises unless every request got every token
    ms = floor_per_request(front, stream, requests=6, tokens=4)
    assert 0.0 < ms < 1000.0
