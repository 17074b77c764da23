"""Speculative decoding in the decode pool of a real cluster, turned on by the pool's YAML key alone.

One 1-prefill + 1-decode cluster (deploy/local.yaml plus `decode.speculative_config`) serves the module; the
reference is one in-process engine without speculation on the same weights.
"""

from __future__ import annotations

import pytest
import ray

from engine import SamplingParams
from router.v1 import inference_pb2 as pb
from tests.helpers import make_engine, run_to_completion, start_test_cluster

pytestmark = pytest.mark.slow

TEXT = ("The old lighthouse stood on the rocky cape for more than a century. Every evening the keeper climbed the "
        "narrow stairs and lit the great lamp, whose beam swept across the dark water.")
SPEC_YAML = """
  speculative_config:
    method: ngram
    num_speculative_tokens: 4
    prompt_lookup_max: 4
    prompt_lookup_min: 2
"""


@pytest.fixture(scope="module")
def cluster(ray_session, tmp_path_factory):
    text = open("deploy/local.yaml").read()
    assert text.rstrip().endswith("max_restarts: 3")  # the decode section is last: the key goes into it
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(text.rstrip() + "\n" + SPEC_YAML)
    c, server = start_test_cluster(str(path), "test-spec")
    assert c.config.decode.speculative_config is not None and c.config.prefill.speculative_config is None
    yield c, server
    server.close()
    c.stop()


@pytest.mark.parametrize("stop", [[], ["guardian"]])
def test_decode_pool_speculation_matches_plain_decoding(cluster, smollm2, stop):
    _, server = cluster
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Copy this text, changing 'keeper' to 'guardian':"
                                       f"\n\n{TEXT}"}])
    ref = make_engine(smollm2)
    ref.add_request("ref", prompt, SamplingParams(max_tokens=48, temperature=0, stop=stop))
    want = run_to_completion(ref)["ref"]
    req = pb.GenerateRequest(request_id=f"spec-{len(stop)}", prompt=prompt,
                             sampling=pb.SamplingParams(max_tokens=48, temperature=0, stop=stop))
    ids, text = [], ""
    for chunk in server.stub().GenerateStream(req, timeout=300):
        ids += chunk.token_ids
        text += chunk.text
        last = chunk
    assert ids == want.token_ids and text == want.text
    assert last.finish_reason == want.finish_reason
    decode = ray.get(cluster[0].actors["decode-0"].load.remote(), timeout=30)
    assert decode.spec_accepted_tokens > 0  # the decode pool's YAML key is what made it speculate
