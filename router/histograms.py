"""The router's histograms (router/metrics.py): their buckets, the exemplar of a request's observation, and many
observations of one histogram at once: a request's inter-token gaps at its end.

`Histogram.observe` takes a lock twice per value (the sum and the bucket); a request's end observed each of its gaps
that way, two histograms each, on the event loop: a 4,096-token answer held every other stream for thousands of
locked increments. `observe_all` sorts the values, counts them per bucket and adds each count once (the same buckets
and sum as one `observe` per value: a value lands in the first bucket whose upper bound is >= it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from prometheus_client import Histogram

# NOTE: ITL is one decode step. TTFT and e2e take the workers' LATENCY_BUCKETS_S (cluster/worker_metrics.py: a cached
# short prompt, ~1 ms, to a long generation, ~1 min), so a dashboard sums the router's vllm:* and the workers' alike
TTFT_ERROR_BUCKETS_S = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, 0.0, 0.025, 0.05, 0.1, 0.25, 0.5,
                        1.0, 2.0, 5.0, 10.0)
ITL_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
KV_TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REDIS_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

MAX_EXEMPLAR_ID = 100  # NOTE: an exemplar's labels may hold at most 128 characters in all


def exemplar(request_id: str) -> dict[str, str] | None:
    """The exemplar labels of one request's observation (None without an id)."""
    return {"request_id": request_id[:MAX_EXEMPLAR_ID]} if request_id else None


def observe_all(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for each of `values` (no exemplars), one increment per bucket touched."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets, total = getattr(histogram, "_buckets", None), getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:  # NOTE: a prometheus_client without these: one by one
        for v in values:
            histogram.observe(v)
        return
    if not values:
        return
    histogram._raise_if_not_observable()  # NOTE: a histogram with labels must be observed through .labels()
    total.inc(sum(values))
    ordered, below = sorted(values), 0
    for bucket, bound in zip(buckets, bounds, strict=True):
        upto = bisect.bisect_right(ordered, bound)  # NOTE: the values <= this bound (the last one is +Inf: all)
        if upto > below:
            bucket.inc(upto - below)
        below = upto
