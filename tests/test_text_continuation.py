"""An engine that takes a request over mid-way gives the client exactly the text of one undisturbed engine.

What a decode worker does after a failover (`add_request(..., output_token_ids=..., sent_chars=...)`): it is
given the tokens generated so far and how many characters of their text the client already has. (The handoff's own
path, after a KV transfer, is tested through the cluster in test_text_integrity.py and test_decode_handoff.py.)
For every split point of every answer — inside a multi-byte character, inside a stop string or the characters held
back for one — the text sent before the split plus the text the second engine streams must equal the undisturbed
text, with the same finish reason.
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.helpers import make_engine

pytestmark = pytest.mark.slow
MAX_TOKENS = 20
# (prompt, stop strings): output with accents, CJK, emoji, Hangul; stops that occur mid-answer and that never do
CASES = [
    ("Emoji story: 🐱🐶🐭", ["@@@"]),
    ("日本の首都は", ["アップ", "@@@@@@@@"]),
    ("中文：今天天气很好，我们", ["我们可"]),
    ("Voilà, les élèves français étudient", ["la tr", "@@"]),
    ("한국어로 인사하면", ["@@@@"]),
    ("The sea is a vast", ["ocean", "@@@@@"]),
]


def streamed(outputs) -> tuple[str, str | None]:
    """The concatenated `new_text` of a request's outputs and its finish reason."""
    return "".join(o.new_text for o in outputs), outputs[-1].finish_reason


def run_streaming(engine, requests: dict[str, tuple]) -> dict[str, list]:
    """Add every request (prompt, params, already generated ids, sent characters) and collect each one's outputs."""
    for rid, (prompt, params, ids, sent) in requests.items():
        engine.add_request(rid, prompt, params, output_token_ids=ids, sent_chars=sent)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


@pytest.mark.parametrize("prompt,stops", CASES, ids=[c[0][:12] for c in CASES])
def test_a_continuation_at_every_split_point_gives_the_undisturbed_text(smollm2, prompt, stops) -> None:
    engine = make_engine(smollm2, num_blocks=4096)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=stops)
    whole = run_streaming(engine, {"whole": (prompt, params, [], 0)})["whole"]
    want_text, want_reason = whole[-1].text, whole[-1].finish_reason
    assert streamed(whole) == (want_text, want_reason)
    ids = whole[-1].token_ids
    # what the client had after k tokens of the undisturbed run: the first k outputs' text
    sent = ["".join(o.new_text for o in whole[:k]) for k in range(len(ids) + 1)]
    splits = range(1, len(ids))
    outs = run_streaming(engine, {f"k{k}": (prompt, params, ids[:k], len(sent[k])) for k in splits})
    for k in splits:
        text, reason = streamed(outs[f"k{k}"])
        assert (sent[k] + text, reason) == (want_text, want_reason), f"split after {k} tokens"
        assert outs[f"k{k}"][-1].text == want_text
        assert outs[f"k{k}"][-1].token_ids == ids  # every generated token, those before the split included


def test_the_splits_cover_what_they_are_for(smollm2) -> None:
    """The cases above split inside a multi-byte character and inside held-back stop-string characters."""
    engine = make_engine(smollm2, num_blocks=1024)
    held, partial = 0, 0
    for prompt, stops in CASES:
        outs = run_streaming(engine, {"r": (prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                    stop=stops), [], 0)})["r"]
        sent = 0
        for o in outs[:-1]:
            sent += len(o.new_text)
            text = engine.tokenizer.decode(o.token_ids)
            partial += text.endswith("\ufffd")  # the split falls inside a multi-byte character
            held += len(text.rstrip("\ufffd")) > sent  # characters decoded but held back for a stop string
    assert partial >= 3 and held >= 10, (partial, held)
