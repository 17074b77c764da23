"""Mutual TLS on the KV gRPC plane (issue 19 item 11): members with the cluster's certificate move KV; a caller in
plain text, without a client certificate, or with one the cluster's CA did not sign is refused before any block is
reserved. Real gRPC over sockets, certificates made at test time (the `cryptography` package).

The cluster-level check (a cluster with `transfer.tls` serves across the handoff) is in test_kv_tls_cluster.py.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferError, TransferState
from kv_transfer.tls import KVTls
from kv_transfer.v1 import kv_transfer_pb2 as pb
from kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc
from tests.helpers import greedy, open_kv_sender, prefill_layerwise, random_prompts, run_alone, run_to_completion

FIRST = SamplingParams(max_tokens=1, temperature=0)
PROMPT = random_prompts(1, [90], vocab=1000, seed=11)[0]


def make_cert(name: str, issuer: tuple | None = None) -> tuple[bytes, bytes, tuple]:  # type: ignore[type-arg]
    """A certificate for `name` (PEM) and its key, signed by `issuer` (cert, key) or self-signed as a CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = (issuer[0].subject, issuer[1]) if issuer else (subject, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), False)
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), True)
            .sign(issuer_key, hashes.SHA256()))
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), pem_key, (cert, key)


@pytest.fixture(scope="module")
def pki() -> dict[str, KVTls]:
    """The cluster's CA and a member certificate it signed; an outsider CA and a certificate of its own."""
    ca_pem, _, ca = make_cert("pdcluster-ca")
    member_pem, member_key, _ = make_cert("kv.pdcluster.internal", ca)
    rogue_ca_pem, _, rogue_ca = make_cert("rogue-ca")
    rogue_pem, rogue_key, _ = make_cert("kv.pdcluster.internal", rogue_ca)
    return {"member": KVTls(member_pem, member_key, ca_pem, "kv.pdcluster.internal"),
            # NOTE: the outsider trusts the cluster's CA (it can check the receiver) but holds no certificate it signed
            "outsider": KVTls(rogue_pem, rogue_key, ca_pem, "kv.pdcluster.internal"),
            "rogue_ca": KVTls(rogue_pem, rogue_key, rogue_ca_pem, "kv.pdcluster.internal")}


@pytest.fixture
def tls_endpoint(tiny, pki):
    ep = ReceiverEndpoint(LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1)),
                          TransferConfig(transport="grpc", tls=pki["member"], cluster_token="tok"))
    yield ep
    ep.close()


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_members_move_kv_over_mutual_tls(tiny, pki, transport):
    ep = ReceiverEndpoint(LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1)),
                          TransferConfig(transport=transport, tls=pki["member"], cluster_token="tok"))  # type: ignore[arg-type]
    try:
        a = LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1))
        sender = open_kv_sender(transport, ep.address, a, "tls", PROMPT, tls=pki["member"], cluster_token="tok")
        first = prefill_layerwise(a, sender, PROMPT, FIRST)
        assert sender.wait(10) is TransferState.DONE, sender.error
        ep.receiver.take("tls", greedy(6))
        with ep.receiver.engine_lock:
            tokens = run_to_completion(ep.receiver.engine)["tls"].token_ids
        assert first + tokens[1:] == run_alone(tiny, PROMPT, greedy(6))
    finally:
        ep.close()


@pytest.mark.parametrize("who", ["plaintext", "outsider", "rogue_ca"])
def test_a_caller_without_the_clusters_certificate_is_refused(tiny, pki, tls_endpoint, who):
    """Plain text, a client certificate the cluster's CA did not sign, or a client that does not trust the
    receiver: the handshake fails before the receiver reserves a block (the cluster token alone is not enough)."""
    a = LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1))
    decode = tls_endpoint.receiver.engine
    before = decode.stats()
    sender = open_kv_sender("grpc", tls_endpoint.address, a, f"x-{who}", PROMPT, cluster_token="tok",
                            tls=None if who == "plaintext" else pki[who], deadline_s=3.0)
    with pytest.raises(TransferError, match="UNAVAILABLE"):
        sender.prepare()
    assert decode.stats() == before and tls_endpoint.receiver.num_inflight == 0


def test_a_tls_client_presenting_no_certificate_is_refused(tls_endpoint, pki):
    """TLS that checks the receiver but shows no certificate of its own (grpc's plain ssl_channel_credentials)."""
    creds = grpc.ssl_channel_credentials(pki["member"].root_certs)
    with grpc.secure_channel(tls_endpoint.address, creds,
                             options=[("grpc.ssl_target_name_override", "kv.pdcluster.internal")]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KVTransferStub(ch).Abort(pb.AbortRequest(transfer_id="x", reason="probe"), timeout=5,
                                             metadata=(("x-pdcluster-cluster-token", "tok"),))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_kv_tls_from_the_config_reads_the_clusters_certificate(tmp_path: Path, pki):
    """`transfer.tls` with security's certificate settings; the name checked is the certificate's own."""
    from pdcluster import security
    from pdcluster.config import ClusterConfig
    from tests.helpers import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    config = ClusterConfig.model_validate({"security": {"tls_cert_file": cert, "tls_key_file": key},
                                           "transfer": {"tls": True}})
    kv = security.kv_tls(config)
    assert kv is not None and kv.server_name == "localhost" and kv.root_certs == Path(cert).read_bytes()
    assert "BEGIN" not in repr(kv)  # the key never shows in a repr
    ca = tmp_path / "ca.pem"
    ca.write_bytes(pki["member"].root_certs)
    config.security.tls_ca_file = str(ca)
    kv = security.kv_tls(config)
    assert kv is not None and kv.root_certs == pki["member"].root_certs
    with pytest.raises(ValueError, match="KV TLS uses the cluster.s certificate"):
        ClusterConfig.model_validate({"transfer": {"tls": True}})
    assert security.kv_tls(ClusterConfig()) is None
