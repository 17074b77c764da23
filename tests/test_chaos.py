"""`pdcluster bench chaos`: its fault schedule and its invariant checker, on hand-made records (no cluster)."""

from __future__ import annotations

import pytest

from pdcluster.bench.chaos_check import FinalState, Record, Reference, check, windows
from pdcluster.bench.chaos_faults import KINDS, schedule

REF: Reference = {((1, 2, 3), 4): ([10, 11, 12, 13], " a b c d")}
IDLE = FinalState([{"name": "decode-0", "alive": True, "running": 0, "free_blocks": 8, "num_blocks": 8}],
                  {"serve": 0.0, "extra": 0.0})
RSS = {"serve": [300.0, 320.0, 310.0]}


def rec(status: str = "OK", ids: list[int] | None = None, text: str = "", proto: str = "grpc",
        usage: int = -1) -> Record:
    return Record(0, 1.0, proto, True, "serve", [1, 2, 3], 4, status=status, token_ids=ids, text=text,
                  usage_tokens=usage)


def verdict(records: list[Record], final: FinalState = IDLE, rss: dict[str, list[float]] = RSS) -> dict[str, bool]:
    return {i.name: i.passed for i in check(records, REF, final, rss, rss_limit_mb=64)}


def test_schedule_spreads_every_fault_over_the_middle_of_the_run() -> None:
    plan = schedule(10)
    assert [k for _, k in plan] == list(KINDS)
    times = [t for t, _ in plan]
    assert times == sorted(times) and times[0] == 60.0 and times[-1] < 540.0
    with pytest.raises(ValueError, match="--minutes"):
        schedule(0)


def test_a_clean_run_passes_every_invariant() -> None:
    ok = [rec(ids=[10, 11, 12, 13]), rec(proto="http", text=" a b c d", usage=4), rec("UNAVAILABLE"),
          rec("HTTP_503"), rec("STREAM_ERROR"),
          rec("REFUSED"), rec("DISCONNECTED")]
    assert verdict(ok) == dict.fromkeys(["outcome", "text", "tokens", "no_leak", "router_memory"], True)


@pytest.mark.parametrize("records, failing", [
    ([rec("CUT")], ["outcome"]),                                          # ended with no finish and no error
    ([rec("HANG")], ["outcome"]),                                         # the client gave up past the deadline
    ([rec(ids=[10, 11, 99, 13])], ["text"]),                              # a wrong token
    ([rec(proto="http", text=" a b x d", usage=4)], ["text"]),            # wrong text over HTTP
    ([rec(ids=[10, 11, 12])], ["text", "tokens"]),                        # a token lost
    ([rec(ids=[10, 11, 12, 13, 13])], ["text", "tokens"]),                # a token repeated
    ([rec(proto="http", text=" a b c d", usage=5)], ["tokens"]),          # usage says one more than asked
])
def test_each_broken_invariant_fails(records: list[Record], failing: list[str]) -> None:
    assert [name for name, ok in verdict(records).items() if not ok] == failing


def test_leaked_blocks_a_busy_router_and_memory_growth_fail() -> None:
    ok = [rec(ids=[10, 11, 12, 13])]
    held = FinalState([{"name": "decode-0", "alive": True, "running": 1, "free_blocks": 6, "num_blocks": 8}],
                      {"serve": 0.0})
    busy = FinalState(IDLE.workers, {"serve": 0.0, "extra": 2.0})
    dead = FinalState([{"name": "decode-0", "alive": False, "running": 1, "free_blocks": 0, "num_blocks": 8}],
                      {"serve": 0.0})
    assert verdict(ok, held)["no_leak"] is False
    assert verdict(ok, busy)["no_leak"] is False
    assert verdict(ok, dead)["no_leak"] is False  # NOTE: no heartbeat (Redis gone): its blocks are unchecked
    assert verdict(ok, rss={"serve": [100.0] * 5 + [300.0, 400.0]})["router_memory"] is False


def test_windows_count_outcomes_by_request_start() -> None:
    rs = [Record(i, s, "grpc", False, "serve", [1], 1, status=st)
          for i, (s, st) in enumerate([(1, "OK"), (2, "UNAVAILABLE"), (16, "OK"), (40, "OK")])]
    assert windows(rs, 15) == [{"from_s": 0, "OK": 1, "UNAVAILABLE": 1}, {"from_s": 15.0, "OK": 1},
                               {"from_s": 30.0, "OK": 1}]


def test_a_stream_cut_by_its_routers_kill_is_expected_but_not_one_cut_at_another_time() -> None:
    cut = Record(0, 10.0, "http", True, "extra", [1, 2, 3], 4, status="CUT", end_s=12.0)
    during = check([cut], REF, IDLE, RSS, 64, router_kills_s=(11.0,))
    later = check([cut], REF, IDLE, RSS, 64, router_kills_s=(30.0,))
    assert during[0].name == "outcome" and during[0].passed and "cut by their router's kill -9" in during[0].detail
    assert not later[0].passed


# NOTE: request 529 of a chaos run (seed 0): served beside other requests it went " ... World Cup was the first time",
# the reference batch went " ... was a sporting event": at token 15 the top two tokens (" the", " a") are a near tie
TIED_PROMPT = [1076, 37863, 39650, 39484, 19394, 7094, 22495, 45547, 6074, 10164, 25331, 30008, 17287, 22950, 18341,
               41042, 44992, 14616, 46605, 12097, 36221, 29875, 30670, 17077, 31279, 6259, 5541, 45127, 11403, 36327,
               3522, 16548, 23704, 21886, 23691, 3837, 25258]
HEAD = [  # " in the world.\n\nThe 2017 World Cup was"
    281, 260, 905, 30, 198, 198, 504, 216, 34, 32, 33, 39, 2260, 23278, 436]
THE = HEAD + [260, 808, 655, 338, 253, 1798, 553, 3763]  # " the first time that a country has won"
A = HEAD + [253, 25003, 2121, 338, 2637, 1379, 281, 216]  # " a sporting event that took place in "


@pytest.mark.slow
def test_an_output_that_leaves_the_reference_only_at_a_near_tie_passes_and_any_other_fails() -> None:
    from engine import LLM, SamplingParams
    from pdcluster.bench.chaos_reference import near_ties

    llm = LLM("smollm2")
    greedy = llm.generate([TIED_PROMPT], SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True))[0].token_ids
    tied = A if greedy == THE else THE  # the branch this machine's batch of one did not take
    assert greedy in (THE, A)
    wrong_token = tied[:15] + [tied[15] + 1] + tied[16:]  # another token where the tie was
    off_later = tied[:20] + [tied[20] + 7] + tied[21:]  # the tie, then a token that is not the greedy one
    text = llm.tokenizer.decode(tied)

    def r(i: int, ids: list[int] | None, proto: str = "grpc", text: str = "") -> Record:
        return Record(i, 1.0, proto, True, "serve", TIED_PROMPT, 23, status="OK", token_ids=ids, text=text,
                      usage_tokens=23)

    records = [r(0, tied), r(1, None, "http", text), r(2, wrong_token), r(3, off_later),
               r(4, None, "http", text.replace(" that", " which"))]  # NOTE: both branches say " that"
    ref = {(tuple(TIED_PROMPT), 23): (greedy, llm.tokenizer.decode(greedy))}
    ties = near_ties(llm, records, ref)
    assert set(ties) == {0, 1} and ties[0].startswith("token 15 (top-2 gap"), ties
    verdicts = check(records[:2], ref, IDLE, RSS, 64, ties=ties)
    assert verdicts[1].name == "text" and verdicts[1].passed and "2 after a near tie" in verdicts[1].detail
    assert not check(records, ref, IDLE, RSS, 64, ties=ties)[1].passed
