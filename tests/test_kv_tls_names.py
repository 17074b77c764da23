"""The KV plane's mutual TLS checks the peer's name both ways (issue 27 item 6): a certificate the cluster's CA
issued to something else admits neither a sender nor a receiver. Real gRPC over sockets, certificates made here."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferError
from kv_transfer.tls import KVTls
from tests.helpers import open_kv_sender, random_prompts
from tests.test_kv_tls import make_cert

NAME = "kv.pdcluster.internal"
PROMPT = random_prompts(1, [40], vocab=1000, seed=12)[0]


@pytest.fixture(scope="module")
def pki() -> dict[str, KVTls]:
    """The cluster's CA signs a member certificate and one for another service (same CA, another name)."""
    ca_pem, _, ca = make_cert("pdcluster-ca")
    member_pem, member_key, _ = make_cert(NAME, ca)
    other_pem, other_key, _ = make_cert("billing.example.internal", ca)
    return {"member": KVTls(member_pem, member_key, ca_pem, NAME),
            # NOTE: it expects the cluster's name of the receiver; it presents its own
            "other": KVTls(other_pem, other_key, ca_pem, NAME)}


def _receiver(tiny, tls: KVTls) -> ReceiverEndpoint:
    return ReceiverEndpoint(LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1)),
                            TransferConfig(transport="grpc", tls=tls, cluster_token="tok"))


def test_a_sender_whose_certificate_names_another_service_is_refused(tiny, pki) -> None:
    ep = _receiver(tiny, pki["member"])
    try:
        before = ep.receiver.engine.stats()
        a = LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1))
        sender = open_kv_sender("grpc", ep.address, a, "x-other", PROMPT, cluster_token="tok", tls=pki["other"],
                                deadline_s=3.0)
        with pytest.raises(TransferError, match="PERMISSION_DENIED"):
            sender.prepare()
        assert ep.receiver.engine.stats() == before and ep.receiver.num_inflight == 0
    finally:
        ep.close()


def test_a_receiver_whose_certificate_names_another_service_gets_nothing(tiny, pki) -> None:
    impostor = KVTls(pki["other"].cert_chain, pki["other"].private_key, pki["other"].root_certs,
                     "billing.example.internal")
    ep = _receiver(tiny, impostor)
    try:
        a = LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1))
        sender = open_kv_sender("grpc", ep.address, a, "x-impostor", PROMPT, cluster_token="tok",
                                tls=pki["member"], deadline_s=3.0)
        with pytest.raises(TransferError, match="UNAVAILABLE"):  # the handshake fails: no token, no prompt sent
            sender.prepare()
        assert ep.receiver.num_inflight == 0
    finally:
        ep.close()
