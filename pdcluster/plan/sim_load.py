"""What a simulated worker measures and tells the router, as a real worker does: its step cost, budget and load.

A real worker fits its step cost after every step (`LinearCost` in cluster/worker.py `_on_step`), hands the fit to its
engine's step budget (engine/step_budget.py: the ITL budget for prompt chunks beside a decode batch, the TTFT bound
of `shortest_first`) and publishes it with its queue in each heartbeat (`WorkerLoad`); the router predicts from those
(router/policy.py: the SLO rule that places a prompt on the decode pool, "stay" on the prefill worker). The simulated
worker runs the same classes on its simulated steps, so the placements and the engine's caps follow the same
formulas. Approximation: the router reads the load exact, where the real heartbeat is up to ~0.75 s old.
"""

from __future__ import annotations

from cluster.messages import WorkerLoad
from cluster.worker_metrics import PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S, LinearCost
from engine.step_budget import StepBudget


class SimLoad:
    """One simulated worker's measured step cost, its engine's `StepBudget` and its heartbeat `WorkerLoad`."""

    def __init__(self, num_blocks: int, max_num_batched_tokens: int, shortest_first: bool,
                 budget: StepBudget) -> None:
        self.cost = LinearCost(PRIOR_STEP_BASE_S, PRIOR_STEP_TOKEN_S)
        self.budget = budget
        self._fixed = {"num_blocks": num_blocks, "max_num_batched_tokens": max_num_batched_tokens,
                       "shortest_first": int(shortest_first)}
        self._queues = (0, 0, 0, 0)  # running, waiting, reserved, pending prefill tokens
        self.load = self._build()
        self.stale = False  # `load` lags the numbers above until `refresh`

    def stepped(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` took `seconds`: refit, and pass the fit on as the worker does (cluster/worker.py)."""
        self.cost.observe(tokens, seconds)
        self.budget.set_cost(self.cost.base_s, self.cost.per_token_s)
        self.stale = True

    def queues(self, running: int, waiting: int, reserved: int, pending_tokens: int) -> None:
        """The heartbeat's queue numbers, as the worker's engine would report them now."""
        queues = (running, waiting, reserved, pending_tokens)
        if queues != self._queues:
            self._queues, self.stale = queues, True

    def refresh(self) -> WorkerLoad:
        """The heartbeat as of now (rebuilt only after a change: a WorkerLoad is frozen)."""
        if self.stale:
            self.load, self.stale = self._build(), False
        return self.load

    def _build(self) -> WorkerLoad:
        running, waiting, reserved, pending = self._queues
        return WorkerLoad(running=running, waiting=waiting, reserved=reserved, pending_prefill_tokens=pending,
                          free_blocks=0, **self.cost.heartbeat(), **self._fixed)
