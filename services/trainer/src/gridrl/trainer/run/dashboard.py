"""With ``--master``: the run reported to the master's dashboard.

    reporter.subscribe(dashboard_reporter(cfg, status, address, lambda: run))

:func:`dashboard_reporter` builds the :class:`~gridrl.trainer.report.to_master.MasterReporter`
subscriber (rank 0, with a ``RunStatus``) and gives it what it sends besides the step records:
the run's info (from ``RunStatus`` and the config; the TrainerService's ``address``) and the
trainer's view of its rollout nodes (the pool, the node monitor's bounds, the last step's
per-node figures). It is subscribed before the run is built, so the dashboard shows the run
STARTING while the model loads; until then the node view is empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gridrl.trainer.config import TrainConfig
from gridrl.trainer.report.status import RunStatus
from gridrl.trainer.report.to_master import MasterReporter, NodeStats, run_id_for
from gridrl.trainer.run.build import Run
from gridrl.v1 import runs_pb2


def dashboard_reporter(cfg: TrainConfig, status: RunStatus, address: str,
                       current: Callable[[], Run | None]) -> MasterReporter:
    """The dashboard subscriber of the run of ``cfg`` (``cfg.master`` set).

    Args:
        cfg: the run's settings (master, security, name, model, task).
        status: the run's TrainerService status (its state, baseline, totals).
        address: the TrainerService's host:port ("" when not served).
        current: the built run, or None while it is being built.
    """
    run_id = run_id_for(cfg.run_dir or ".")
    started = time.time()

    def info() -> runs_pb2.RunInfo:
        snap = status.snapshot()
        out = runs_pb2.RunInfo(
            run_id=run_id, run_name=snap.run_name or cfg.run_name or "",
            trainer_address=address, state=snap.state, error=snap.error[:4096],
            total_steps=snap.total_steps, model_id=cfg.model[:256], task=str(cfg.task)[:256],
            importance_weighting=cfg.is_correction != "none")
        out.started_at.FromNanoseconds(int(started * 1e9))
        if snap.HasField("baseline_eval"):
            out.baseline_eval = snap.baseline_eval
        if snap.HasField("baseline_eval_exact"):
            out.baseline_eval_exact = snap.baseline_eval_exact
        out.eval_scorer = snap.eval_scorer[:256]
        return out

    def nodes(stats: dict[str, NodeStats]) -> list[runs_pb2.RunNode]:
        run = current()
        if run is None or run.main is None or run.main.fleet is None:
            return []
        version, monitor = run.state.version, run.main.monitor
        out = []
        for n in sorted(run.main.fleet.pool.nodes(), key=lambda n: n.address):
            s = stats.get(n.address)
            node = runs_pb2.RunNode(
                address=n.address, in_rotation=n.in_rotation,
                out_of_rotation="" if n.in_rotation else n.why_out()[:4096],
                flagged=n.flagged[:4096], benched=n.benched[:4096],
                policy_version=n.adapter_version,
                staleness=max(0, version - n.adapter_version),
                mismatch_kl_bound=monitor.bound_for(run.low_precision(n.address)),
                tokens_per_s=(s.tokens_per_s or 0.0) if s else 0.0, in_flight=n.in_flight,
                last_step=s.step if s else 0)
            if s is not None and s.mismatch_kl is not None:
                node.mismatch_kl = s.mismatch_kl
            out.append(node)
        return out

    return MasterReporter(cfg.master or "", cfg.security, info, nodes)
