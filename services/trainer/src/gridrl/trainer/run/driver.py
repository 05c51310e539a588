"""One run from start to end: build it, step it (rank 0) or train what rank 0 sends (the other
ranks), then finish, stop or fail, and close.

    result = train(cfg, status=status, control=control)   # the CLI
    result.summary            # RunSummary (finished, or stopped after a step), or None
    result.stopped_at         # the last step of a run stopped on request, or None

The end of a run, on rank 0:

- **finished**: the final adapter goes to ``adapter/`` (peft) and ``adapter-mlx/`` (its mlx-lm
  conversion, when it applies), the plot is drawn, ``summary.json`` is written from the records
  kept in memory (:class:`~gridrl.trainer.report.summary.RunHistory`), and
  :class:`~gridrl.trainer.report.events.RunFinished` says so;
- **stopped** (SIGINT / SIGTERM, :class:`~gridrl.trainer.run.control.StopControl`): the step in
  progress was finished and checkpointed, and (after a first step) the adapter, the plot and
  ``summary.json`` of the steps done are written as a finished run's are;
  :class:`~gridrl.trainer.report.events.RunStopped` says how to continue;
- **failed** between steps (RuntimeError, TimeoutError: no rollout node in time, a node error):
  the steps finished since the last checkpoint are checkpointed first, so ``--resume`` loses
  none of them; :class:`~gridrl.trainer.report.events.RunFailed`, then the error propagates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rich.console import Console

from gridrl.trainer.config import TrainConfig
from gridrl.trainer.report.console import ConsoleLines, Printer
from gridrl.trainer.report.events import (
    FailedRunCheckpointed,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
)
from gridrl.trainer.report.reporter import CONSOLE, STATUS, Reporter
from gridrl.trainer.report.status import RunStatus, StatusSubscriber
from gridrl.trainer.report.summary import RunSummary
from gridrl.trainer.run.build import Run, SourceFactory, build_run
from gridrl.trainer.run.control import (
    StopControl,
    failed_run_message,
    resume_command,
    stopped_message,
)
from gridrl.trainer.run.dashboard import dashboard_reporter
from gridrl.trainer.run.loop import StepLoop
from gridrl.trainer.run.ranks import run_worker, send_error, send_stop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    """How a run ended on this process.

    Attributes:
        summary: the run's summary (rank 0): a finished run's, or a stopped run's up to its
            last step (None when it stopped before step 1, and on the other ranks).
        stopped_at: the last step of a run stopped on request (rank 0), else None.
    """

    summary: RunSummary | None = None
    stopped_at: int | None = None


def train(cfg: TrainConfig, *, resume: bool = False, status: RunStatus | None = None,
          address: str = "", console: Printer | None = None, control: StopControl | None = None,
          source: SourceFactory | None = None, freeze_gc: bool = False) -> RunResult:
    """Run every step of ``cfg`` (see the module docstring).

    Args:
        cfg: the finalized config (``TrainConfig.finalize``).
        resume: continue from ``cfg.run_dir``'s latest checkpoint.
        status: the TrainerService's :class:`RunStatus` (rank 0), or None.
        address: the TrainerService's host:port (the dashboard links to it).
        console: where the progress lines go (default: a ``rich`` console on stdout).
        control: the stop request (the CLI's signal handlers set it); default: a new one.
        source: a rollout source built from the loaded backend (embedding the trainer in
            another program; nothing is pushed to it).
        freeze_gc: ``gc.freeze()`` once set up (the CLI's choice for a whole process).
    Raises:
        StatusError: bad configuration; RuntimeError: no rollout node can serve;
        TimeoutError: not enough nodes in time. ``RunFailed`` is reported first.
    """
    if console is None:
        console = Console(highlight=False, soft_wrap=True)
    control = control or StopControl()
    reporter = Reporter()
    reporter.subscribe(ConsoleLines(console, total_steps=cfg.steps, remote=not cfg.local),
                       order=CONSOLE)
    if status is not None:
        reporter.subscribe(StatusSubscriber(status), order=STATUS)
    run: Run | None = None
    if status is not None and cfg.master:  # the master's dashboard, from the start
        reporter.subscribe(dashboard_reporter(cfg, status, address, lambda: run))
    reporter.event(RunStarted(cfg.run_name or "", str(cfg.run_dir), cfg.steps, cfg.model))
    loop: StepLoop | None = None
    ended = False  # every collective of the run done on this rank
    try:
        run = build_run(cfg, reporter=reporter, control=control, resume=resume, source=source,
                        freeze_gc=freeze_gc)
        if not run.is_main:
            run_worker(run.backend, run.state)
            ended = True
            return RunResult()
        loop = StepLoop(run)
        stopped_at = loop.steps()
        send_stop(run.backend)
        ended = True
        if stopped_at is not None:
            return _stop(run, stopped_at)
        return RunResult(summary=_finish(run))
    except BaseException as e:
        if loop is not None and isinstance(e, (RuntimeError, TimeoutError)):
            _checkpoint_failed_run(loop, e)
        reporter.event(RunFailed(f"{type(e).__name__}: {e}"))
        if run is not None:
            send_error(run.backend, e)
        raise
    finally:
        if run is not None:
            run.close(ended)
        reporter.close()


def _finish(run: Run) -> RunSummary:
    """The end of a run whose every step is done (rank 0): the final adapter, the plot,
    ``summary.json``."""
    summary = _write_results(run)
    assert run.main is not None
    run.reporter.event(RunFinished(summary, run.main.run_dir.path))
    return summary


def _write_results(run: Run) -> RunSummary:
    """The adapter of the last finished step (``adapter/``, ``adapter-mlx/``), the plot and
    ``summary.json`` (rank 0): a finished run's, and a stopped run's up to where it stopped
    (its ``steps`` below ``total_steps``; a resumed run overwrites them)."""
    main, cfg, st = run.main, run.cfg, run.state
    assert main is not None
    with run.backend_lock:
        files = run.backend.adapter_files()
    mlx_error = None
    try:
        main.run_dir.write_final_adapter(files, run.backend.identity.num_layers)
    except Exception as e:  # the peft adapter is written first; the conversion may not apply
        mlx_error = f"{type(e).__name__}: {e}"
        log.warning("final adapter: MLX conversion failed: %s", mlx_error)
    main.history.plot()
    # the nodes that served the run (a master only finds them)
    known = [n.address for n in main.fleet.pool.nodes()] if main.fleet is not None else []
    rollout = "local" if cfg.local else sorted({*known, *(a for a in cfg.rollout
                                                          if a != "local")})
    summary = main.history.summary(
        cfg, steps=st.step, policy_version=st.version, elapsed_s=st.elapsed_s,
        dropped_samples=st.dropped_total, resumed_at=st.resumed_at,
        eval_tasks=len(main.evaluator.items), flagged_nodes=main.flags.flagged_ever(),
        rollout=rollout,
        adapter=main.run_dir.adapter, adapter_mlx=None if mlx_error else main.run_dir.adapter_mlx,
        adapter_mlx_error=mlx_error)
    main.run_dir.write_json(main.run_dir.summary, summary.to_json())
    return summary


def _stop(run: Run, step: int) -> RunResult:
    """The end of a run asked to stop (rank 0): the checkpoint of ``step`` is written; after
    a first step, the adapter, the plot and ``summary.json`` of the steps done are written
    too (:func:`_write_results`), so a stopped run keeps what a finished one keeps."""
    assert run.main is not None
    run_dir = run.main.run_dir
    summary = None
    if run.control.checkpointed and step:
        try:
            summary = _write_results(run)
        except Exception:  # the checkpoint is what --resume needs; the rest is a courtesy
            log.exception("writing the stopped run's adapter, plot and summary failed")
    message = stopped_message(step, run.cfg.steps, run.control.reason,
                              bool(run.control.checkpointed),
                              resume_command(str(run_dir.path), run.cfg.security))
    log.warning("%s", message)
    run.reporter.event(RunStopped(step, message))
    return RunResult(summary=summary, stopped_at=step)


def _checkpoint_failed_run(loop: StepLoop, error: BaseException) -> None:
    """A run failing between steps (no rollout node in time, a node error): checkpoint the
    steps it finished since the last checkpoint, so ``--resume`` loses none of them. Not
    inside an update (the weights are then neither the last step's nor the next's), unless
    the update says its weights are untouched (an allocation failure before the optimizer
    step: :class:`~gridrl.trainer.backends.memory.UpdateOutOfMemory`)."""
    run = loop.run
    step = run.state.step
    untouched = bool(getattr(error, "weights_untouched", False))
    if (loop.updating and not untouched) or step <= run.control.checkpointed:
        return
    try:
        loop.checkpoint(step)
    except Exception:
        log.exception("checkpoint of the failed run failed")
        return
    assert run.main is not None
    message = failed_run_message(step, error,
                                 resume_command(str(run.main.run_dir.path), run.cfg.security))
    log.warning("%s", message)
    run.reporter.event(FailedRunCheckpointed(step, message))
