"""Per-node health as the trainer sees it in the samples: staleness and logprob mismatch.

Two silent failures of distributed RL show up here and are flagged loudly:

- a node that never receives new weights keeps sampling an old policy: its samples arrive
  older than ``--max-staleness`` (or with a version that is not in this run's lineage) and are
  dropped, step after step;
- a node that claims the trainer's version but samples with other weights (a failed swap, a
  wrong conversion, a different base): its samples of staleness 0 disagree with the trainer's
  own logprobs. The k3 KL(behaviour || trainer) of such samples is ~1e-6 nats/token for a
  healthy fp32 node; above ``mismatch_kl_max`` the step counts as mismatched. When the node or
  the trainer computes in bfloat16/float16, rounding alone gives 4e-3 to 2e-2 (SmolLM2-135M,
  a bf16 CPU node against the fp32 trainer, 2026-12-01), so those steps are held to
  ``mismatch_kl_max_16bit`` instead: it still catches a wrong base or conversion, not
  a one-version slip.

A node is flagged after ``flag_after`` consecutive bad steps: the monitor sends the flag to its
one owner, the pool's membership (:meth:`gridrl.trainer.fleet.membership.Membership.flag`). A
flag acts: the node is benched (no new groups), its samples are kept out of the update
(``admission.py``) and it is unflagged only once it serves the current version again and
passes a fresh mismatch check (``probation.py``).
"""

from __future__ import annotations

import logging

from gridrl.trainer.fleet.nodes import NodeFlags
from gridrl.trainer.grpo.admission import NodeStepStats

log = logging.getLogger(__name__)


class NodeMonitor:
    """Counts each node's consecutive bad steps and sends the verdicts to the flags' owner
    (:class:`~gridrl.trainer.fleet.nodes.NodeFlags`: the membership of the node pool).

    Args:
        max_staleness: the staleness bound samples are dropped beyond.
        mismatch_kl_max: nats/token above which staleness-0 samples count as mismatched.
        mismatch_kl_max_16bit: the same bound for steps whose ``low_precision`` is
            set (default: ``mismatch_kl_max``).
        flag_after: consecutive bad steps that flag a node.
    """

    def __init__(self, *, max_staleness: int, mismatch_kl_max: float, flag_after: int,
                 mismatch_kl_max_16bit: float | None = None) -> None:
        self.max_staleness = max_staleness
        self.mismatch_kl_max = mismatch_kl_max
        self.mismatch_kl_max_16bit = (mismatch_kl_max if mismatch_kl_max_16bit is None
                                      else mismatch_kl_max_16bit)
        self.flag_after = flag_after
        self._bad_steps: dict[str, int] = {}

    def problem(self, stats: NodeStepStats) -> str:
        """Why this step of the node is bad, or "" when it is fine."""
        if stats.dropped:
            what = (f"{stats.unknown_version} with a version outside this run's lineage"
                    if stats.unknown_version else f"older than --max-staleness {self.max_staleness}")
            versions = ",".join(str(v) for v in sorted(stats.versions or ()))
            return (f"stale: {stats.dropped}/{stats.samples} samples dropped ({what}; sampled "
                    f"with policy version(s) {versions})")
        kl = stats.fresh_kl
        bound = self._bound_for(stats)
        if kl is not None and kl > bound:
            precision = ", 16-bit bound" if stats.low_precision else ""
            return (f"mismatched: KL(behaviour || trainer) {kl:.2e} nats/token on samples of the "
                    f"trainer's own version (> {bound:g}{precision}): the node samples with "
                    "other weights than it claims")
        return ""

    def _bound_for(self, stats: NodeStepStats) -> float:
        return self.bound_for(stats.low_precision)

    def bound_for(self, low_precision: bool) -> float:
        """The mismatch bound (nats/token) of a node: the 16-bit one when it or the trainer
        computes in bfloat16/float16."""
        return self.mismatch_kl_max_16bit if low_precision else self.mismatch_kl_max

    def bound(self, per_node: dict[str, NodeStepStats]) -> float:
        """The loosest mismatch bound applied to any of these nodes (nats/token)."""
        return max((self._bound_for(stats) for stats in per_node.values()),
                   default=self.mismatch_kl_max)

    def observe(self, step: int, per_node: dict[str, NodeStepStats],
                flags: NodeFlags) -> dict[str, str]:
        """Judge one step of each node in ``per_node``: ``flags.flag`` a node bad for
        ``flag_after`` steps in a row (its reason updated while it stays bad), ``flags.unflag``
        a flagged node whose step is fine (recovered). Returns the nodes newly flagged at this
        step (address -> reason).

        Nodes absent from ``per_node`` (no samples this step: a benched node's samples are not
        judged) keep their count and flag. A node whose flag was cleared by someone else
        (probation readmitted it) counts its bad steps afresh.
        """
        flagged = flags.flags()
        newly: dict[str, str] = {}
        for node, stats in per_node.items():
            if node not in flagged and self._bad_steps.get(node, 0) >= self.flag_after:
                self._bad_steps[node] = 0  # readmitted since it was flagged
            why = self.problem(stats)
            if not why:
                self._bad_steps[node] = 0
                if node in flagged:
                    log.warning("node %s recovered at step %d (was: %s)", node, step,
                                flagged[node])
                    flags.unflag(node)
                continue
            self._bad_steps[node] = self._bad_steps.get(node, 0) + 1
            if self._bad_steps[node] >= self.flag_after:
                if node not in flagged:
                    newly[node] = why
                flags.flag(node, why)
        return newly
