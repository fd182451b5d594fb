"""A running model's budget that follows what the machine can give: the server's `--memory-budget auto`.

Every `every` seconds (between passes) the machine is asked again (io/available.py). What it could give this process
is what is free now plus what the model's plan holds; of that, `budget_of` (the server's: budget.auto_budget). When
it moves by more than MIN_CHANGE, the unit caches are resized to it (budget.Plan.resized, Engine.resize): they give
memory back, or take more. Below the plan's floor (resident weights, KV caches, buffers) the caches hold nothing and
`short` says why: the server then refuses new requests until the machine gives more. A model's outputs do not
depend on its caches, so answers stay what they were.
"""

import time
from typing import Callable, Optional

import mlx.core as mx

from ..io.available import Available, available
from ..io.memory import give_back

CHECK_SECONDS = 5.0
MIN_CHANGE = 0.05  # of the budget: smaller moves are left alone (no resizing back and forth)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


class ElasticBudget:
    def __init__(
        self,
        engine,
        budget_of: Callable[[int], int],
        probe: Callable[[], Available] = available,
        every: float = CHECK_SECONDS,
    ):
        """budget_of(bytes the machine could give): the budget to plan in."""
        self.engine, self.budget_of, self.probe, self.every = engine, budget_of, probe, every
        self.resizes = 0
        self.short: Optional[str] = None  # why new requests are refused: the machine gives less than the floor
        self._last = time.monotonic()

    def _strides(self):
        return self.engine.fd.strides

    def held(self) -> int:
        """What the model's plan holds now."""
        return self.engine.plan.nbytes(self._strides())

    def check(self, force: bool = False) -> bool:
        """Resize the unit caches if the machine's answer moved (and `every` seconds have passed, unless `force`);
        whether they were resized."""
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return False
        self._last = now
        machine = self.probe()
        if machine.bytes is None:
            return False
        plan = self.engine.plan
        held, floor = self.held(), plan.floor(self._strides())
        budget = self.budget_of(machine.bytes + held)
        self.short = None
        if budget < floor:
            self.short = (
                f"this machine can give the model {_mib(budget)} now ({machine.describe()}), less than the "
                f"{_mib(floor)} it holds besides its unit caches"
            )
            budget = floor
        current = plan.budget if plan.budget is not None else held
        if abs(budget - current) <= MIN_CHANGE * current:
            return False
        new = plan.resized(self.engine.fd, budget)
        self.engine.plan = new
        if new.capacity == plan.capacity:
            return False
        self.engine.resize(new.capacity)
        mx.set_cache_limit(new.mlx_cache_limit())  # (as load's, under a budget)
        give_back()  # (the freed rows to the system)
        self.resizes += 1
        return True

    def metrics(self) -> dict:
        plan = self.engine.plan
        return {
            "memory_budget": plan.budget,
            "unit_caches": plan.cache_bytes(self._strides()),
            "budget_resizes": self.resizes,
            "memory_short": self.short,
        }
