"""A cluster with `transfer.tls` (issue 19 item 11): the KV plane between its Ray actors speaks mutual TLS with the
cluster's certificate (security.tls_cert_file / tls_key_file, made at test time), requests are served across the
prefill → decode handoff, and a caller in plain text or without a client certificate is refused even with the
cluster token.
"""

from __future__ import annotations

import grpc
import pytest

from engine import SamplingParams
from engine.block_hash import hash_prompt_blocks
from kv_transfer.messages import PrepareRequest
from kv_transfer.state import TransferError
from kv_transfer.transports.grpc_control import GrpcControl
from kv_transfer.v1 import kv_transfer_pb2 as pb
from kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc
from router.v1 import inference_pb2 as pb_router
from tests.helpers import make_engine, run_to_completion, self_signed_cert, start_test_cluster

pytestmark = pytest.mark.slow
NS = "test-kv-tls"
PROMPT = ("Every spring the orchard keeper counted the blossoms on the oldest apple tree and wrote the number on the "
          "barn door, beneath the numbers of all the springs before. ") * 4 + "What did the keeper write?"


@pytest.fixture(scope="module")
def cluster(ray_session, tmp_path_factory):
    cert, key = self_signed_cert(tmp_path_factory.mktemp("kv-tls"))

    def edit(config):
        config.security.tls_cert_file, config.security.tls_key_file = cert, key
        config.transfer.tls = True
        config.transfer.transport = "grpc"  # NOTE: TLS is the gRPC KV plane's; NIXL (local.yaml's) does not encrypt

    # NOTE: slo_itl_ms None: the request must cross the handoff, which the SLO placement rule may skip on busy cores
    c, server = start_test_cluster("deploy/local.yaml", NS, edit=edit, port=0, slo_itl_ms=None)
    yield c, server, cert
    server.close()
    c.stop()


def test_a_cluster_with_kv_tls_serves_across_the_handoff(cluster, smollm2):
    c, server, _ = cluster
    r = server.stub().Generate(pb_router.GenerateRequest(
        request_id="kv-tls", prompt=PROMPT,
        sampling=pb_router.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
        timeout=300)
    # the KV crossed the TLS plane and the decode worker went on from it (ignore_eos: not ended at the first token)
    assert not r.timeline.prefill_skipped and r.timeline.kv_blocks_sent > 0 and r.timeline.decode_worker == "decode-0"
    engine = make_engine(smollm2)
    engine.add_request("ref", PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert list(r.token_ids) == run_to_completion(engine)["ref"].token_ids


def test_the_decode_workers_kv_port_refuses_plaintext_and_certificate_less_callers(cluster, smollm2):
    c, _, cert = cluster
    address = c.infos["decode-0"].kv_address
    engine = make_engine(smollm2, num_blocks=16)
    tokens = list(range(100, 180))
    hashes = list(hash_prompt_blocks(tokens, engine.config.block_size, engine.scope))
    req = PrepareRequest("outsider", engine.kv_layout, tokens, len(tokens), hashes, "grpc", 5000)
    with pytest.raises(TransferError, match="UNAVAILABLE"):  # plain text, with the right cluster token
        GrpcControl(address, c.cluster_token).prepare(req, 5)
    with open(cert, "rb") as f:  # TLS that trusts the cluster's certificate but shows none of its own
        creds = grpc.ssl_channel_credentials(f.read())
    with grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KVTransferStub(ch).Abort(pb.AbortRequest(transfer_id="x", reason="probe"), timeout=5,
                                             metadata=(("x-pdcluster-cluster-token", c.cluster_token),))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
