"""How often a decode worker's nixl notification thread polls (kv_transfer/transports/nixl_receiver.py).

A sender on this host writes with UCX's one-sided copies: between its notifications the thread polls slowly (it
took ~10 ms of the decode core per SmolLM2 hand-off at the fast rate), fast again when notifications come or the
sender commits. A sender on another host may move its bytes over UCX's TCP transport, which needs this side's
polls to move them: fast throughout, as before.
"""

from __future__ import annotations

import socket

import pytest

from kv_transfer.transports.nixl_receiver import (
    BACKOFF_S,
    BURST_S,
    FAST_POLL_S,
    HURRY_S,
    LOCAL_POLL_S,
    SLOW_POLL_S,
    NixlEndpoint,
    on_this_host,
)


@pytest.mark.parametrize("peer", ["ipv4:127.0.0.1:50051", "ipv6:[::1]:50051", "ipv6:%5B::1%5D:50051",
                                  "unix:/tmp/kv.sock"])
def test_a_peer_on_this_host_is_seen_as_local(peer: str) -> None:
    if peer.startswith("ipv6") and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    assert on_this_host(peer)


def test_this_hosts_own_address_is_local() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.1", 9))  # NOTE: no packet leaves: the kernel only picks the outgoing address
        ip = s.getsockname()[0]
    assert on_this_host(f"ipv4:{ip}:40000")


@pytest.mark.parametrize("peer", ["ipv4:192.0.2.7:50051", "ipv4:8.8.8.8:53", "", "ipv4:", "dns:host:1", "garbage"])
def test_another_or_an_unknown_peer_is_not_local(peer: str) -> None:
    assert not on_this_host(peer)


def test_local_senders_are_polled_slowly_between_bursts_and_fast_after_news_or_a_commit() -> None:
    interval = NixlEndpoint._interval
    now = 100.0
    quiet = now - 2 * BURST_S  # the last notification came a while ago (but within BACKOFF_S)
    assert interval(now, quiet, 0.0, local=True) == LOCAL_POLL_S
    assert interval(now, now - BURST_S / 2, 0.0, local=True) == FAST_POLL_S  # a burst of layers is landing
    assert interval(now, quiet, now - HURRY_S / 2, local=True) == FAST_POLL_S  # committed: the last ones are due
    assert interval(now, quiet, 0.0, local=False) == FAST_POLL_S  # TCP may need our polls to move the bytes
    assert interval(now, now - 2 * BACKOFF_S, 0.0, local=False) == SLOW_POLL_S  # nothing for long: backed off
    assert FAST_POLL_S < LOCAL_POLL_S < SLOW_POLL_S
