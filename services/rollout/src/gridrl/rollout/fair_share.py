"""Which run's request a rollout node starts next: a fair share per run (issue 46 item 2).

Several trainers (runs) on one fleet send their requests to the same nodes; each node keeps
them in one queue and starts them in the order this module gives, so that over any stretch
where runs wait, each gets a share of the decoded work in proportion to its weight, whatever
the others ask for -- a run that sends a hundred requests cannot make another wait for all of
them. It is start-time fair queueing (Goyal, Vin and Cheng, "Start-time fair queueing",
SIGCOMM 1996): every run has a virtual clock, ``served / weight``, advanced by the work each of
its requests is charged when it starts (sequences x token budget); the next request is the
oldest of the run whose clock is lowest; a run that had nothing waiting comes back at the
lowest clock among the runs waiting (idle time is not banked, so a run that was quiet cannot
then take the node for as long as it was away).

Pure logic: no threads, no clocks; the scheduler (:mod:`gridrl.rollout.scheduler`) calls it
under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: The weight of a run that sets none.
DEFAULT_WEIGHT = 1.0


def check_weight(weight: float) -> float:
    """``weight`` if it is a usable share weight (finite, > 0), else :data:`DEFAULT_WEIGHT`
    for 0 (unset).

    Raises:
        ValueError: negative, infinite or NaN.
    """
    if weight == 0:
        return DEFAULT_WEIGHT
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"share weight {weight} must be a finite number > 0")
    return float(weight)


@dataclass
class FairShare:
    """Virtual clocks of the runs a node serves (module docstring).

    Attributes:
        clocks: run -> work charged so far divided by its weight (virtual time).
        charged: run -> work charged so far (token budget of its started sequences), for the
            node's share report.
    """

    clocks: dict[str, float] = field(default_factory=dict)
    charged: dict[str, float] = field(default_factory=dict)

    def wake(self, run: str, waiting: Iterable[str]) -> None:
        """``run`` has a request waiting again after it had none: its clock moves up to the
        lowest clock of the runs in ``waiting`` (the other runs with requests waiting), so it
        does not bank the time it was idle. A new run starts there too (or at 0 alone)."""
        others = [self.clocks.get(r, 0.0) for r in waiting if r != run]
        floor = min(others) if others else max(self.clocks.values(), default=0.0)
        self.clocks[run] = max(self.clocks.get(run, 0.0), floor)

    def next_run(self, waiting: Iterable[str]) -> str | None:
        """The run whose oldest waiting request starts next: lowest clock; on a tie the first
        in ``waiting`` (pass them in order of their oldest request's arrival). None when
        ``waiting`` is empty."""
        best, best_clock = None, math.inf
        for run in waiting:
            clock = self.clocks.get(run, 0.0)
            if clock < best_clock:
                best, best_clock = run, clock
        return best

    def charge(self, run: str, work: float, weight: float = DEFAULT_WEIGHT) -> None:
        """``run`` started ``work`` (sequences x token budget) at ``weight``."""
        self.clocks[run] = self.clocks.get(run, 0.0) + work / weight
        self.charged[run] = self.charged.get(run, 0.0) + work

    def shares(self) -> dict[str, float]:
        """Each run's fraction of the work charged so far (sums to 1; empty before any)."""
        total = sum(self.charged.values())
        return {r: w / total for r, w in self.charged.items()} if total else {}

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the clocks of runs not in ``keep`` (runs gone for good), keeping memory bounded;
        a run that comes back starts at the lowest clock, as a new one."""
        kept = set(keep)
        for table in (self.clocks, self.charged):
            for run in [r for r in table if r not in kept]:
                del table[run]


def within_share(run: str, waiting: Mapping[str, int], weights: Mapping[str, float],
                 bound: int) -> bool:
    """Whether ``run`` may queue one more request when ``bound`` requests already wait: it
    holds fewer than its weighted share of the bound among the runs waiting (itself
    included). The node refuses a request past its queue bound only when its run is at or
    above that share; a run within its share is never refused because another run filled the
    queue (it waits instead)."""
    runs = set(waiting) | {run}
    total = sum(weights.get(r, DEFAULT_WEIGHT) for r in runs)
    share = bound * weights.get(run, DEFAULT_WEIGHT) / total
    return waiting.get(run, 0) < share
