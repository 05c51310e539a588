"""The step loop (rank 0): before step 1 the baseline eval, then per step

    rollouts -> batch -> update -> sync -> eval -> nodes judged -> one StepRecord -> checkpoint

and nothing else: its collaborators are built by :func:`gridrl.trainer.run.build.build_run`,
everything it reports goes through the reporter (one :class:`StepRecord` per step, typed
events), and the run's start and end (summary, stop, failure) are
:mod:`gridrl.trainer.run.driver`'s. It imports no tensor framework: the model side is the
backend's (:class:`gridrl.trainer.backends.base.TrainerBackend`).

Step ``s`` trains the weights after step ``s - 1``:

1. **Rollouts.** :meth:`StepSampler.get` (:mod:`gridrl.trainer.run.steps`) returns the step's
   prompts and groups (sampled ahead with ``--async-steps``: the request to the node pool or the
   local sampler).
2. **Batch.** :func:`gridrl.trainer.grpo.batch.build_batch`: admission (staleness, lineage,
   flagged nodes), rewards, group advantages -> :class:`StepBatch`.
3. **Update.** The other ranks get the step's sequences (:mod:`gridrl.trainer.run.ranks`);
   ``backend.update`` trains; the weights become a new policy version (``versions.jsonl``).
4. **Sync.** Every ``--sync-every`` steps the adapter goes to every node
   (:meth:`AdapterSync.push`).
5. **Eval.** Every ``--eval-every`` steps, the held-out greedy eval on the trainer's weights.
6. **Nodes.** Each node's fresh samples' mismatch KL is added to its counts, the monitor
   judges them (:class:`NodeMonitor`), flags go to probation.
7. **Record.** :meth:`StepRecord.of_step` -> ``reporter.step`` (``log.jsonl``, trackers,
   TrainerService, Prometheus, history, console).
8. **Checkpoint.** Every ``--checkpoint-every`` steps, at the last step and at a stop.

A flagged node is benched in the pool (no new groups), its samples kept out of the update,
until the probation thread readmits it; probation scores with the backend under
``Run.backend_lock``, which the loop holds around its own backend calls.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gridrl.trainer.backends.base import UpdateStats
from gridrl.trainer.evaluation import EvalProgress, EvalResult
from gridrl.trainer.grpo.batch import StepBatch, build_batch
from gridrl.trainer.report.events import (
    BENCHED,
    BaselineEvaluated,
    Checkpointed,
    EvalProgressed,
    History,
    LearningWarning,
    NodeFlagged,
    NoUpdate,
    ResumedWeightsPushed,
    SyncSkipped,
)
from gridrl.trainer.report.records import BaselineRecord, StepRecord, SyncOutcome
from gridrl.trainer.rewards import RewardError
from gridrl.trainer.run.build import Main, Run
from gridrl.trainer.run.checkpoint import save_checkpoint
from gridrl.trainer.run.ranks import send_step
from gridrl.trainer.run.watch import LearningWatch, Verdict, baseline_warning

log = logging.getLogger(__name__)


class StepLoop:
    """Steps one run on rank 0 (see the module docstring).

    Args:
        run: the wired run (``run.main`` set: rank 0).
    """

    def __init__(self, run: Run) -> None:
        if run.main is None:
            raise ValueError("run: the step loop runs on rank 0 (run.main is None)")
        self.run = run
        self.main: Main = run.main
        self.updating = False  # inside the update: the weights are not those of state.step
        cfg = run.cfg
        self.watch = LearningWatch(max_dropped_steps=cfg.max_dropped_steps,
                                   no_signal_steps=cfg.no_signal_warn_steps,
                                   group_size=cfg.group_size)
        self.verdict = Verdict()

    def steps(self) -> int | None:
        """Run the baseline eval and every step left.

        Returns:
            the last finished step when a stop was asked (its checkpoint is written), None
            when every step is done.
        Raises:
            whatever a step raised (e.g. RuntimeError: no rollout node can serve).
        """
        run, cfg, st, control = self.run, self.run.cfg, self.run.state, self.run.control
        if run.resumed is not None:  # GetRunStatus, the plot and the summary: earlier steps
            baseline, records = self.main.run_dir.read_history()
            run.reporter.event(History(tuple(records), baseline, st.baseline))
        if control.stop_requested:  # asked while setting up: before any work
            return st.step
        if run.resumed is not None and self.main.fleet is not None:  # nodes: resumed weights
            sync = self.sync(st.step, force=True)
            run.reporter.event(ResumedWeightsPushed(st.version, len(sync.synced_nodes)))
        if st.baseline is None:
            base = self.evaluate(0)
            st.baseline = base.score
            run.reporter.event(BaselineEvaluated(BaselineRecord.of(base)))
            warning = baseline_warning(base.scores, cfg.group_size)
            if warning:
                log.warning("%s", warning)
                run.reporter.event(LearningWarning(0, warning))
        t_start = time.perf_counter() - st.elapsed_s
        control.stepping = True
        for step in range(st.step + 1, cfg.steps + 1):
            if control.stop_requested:  # asked during the setup or the baseline eval
                if st.step > control.checkpointed:
                    self.checkpoint(st.step)
                return st.step
            run.reporter.step(self.step(step, t_start))
            if self.verdict.warning:
                log.warning("%s", self.verdict.warning)
                run.reporter.event(LearningWarning(step, self.verdict.warning))
            if self.verdict.stop:  # the driver checkpoints the step and reports the failure
                raise RuntimeError(self.verdict.stop)
            stopping = control.stop_requested and step < cfg.steps
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
                self.checkpoint(step)
            if stopping:
                return step
        return None

    def step(self, step: int, t_start: float) -> StepRecord:
        """One step (see the module docstring); returns its record."""
        cfg, st, backend = self.run.cfg, self.run.state, self.run.backend
        t0 = time.perf_counter()
        batch = self.collect(step)
        collect_s = time.perf_counter() - t0
        next_version = st.next_version
        send_step(backend, step, next_version, batch.sequences)
        t1 = time.perf_counter()
        self.updating = True
        stats = self.train(batch)
        train_s = time.perf_counter() - t1
        self.verdict = self.watch.observe(step, batch.rollouts.episodes,
                                          batch.groups_with_signal)
        if stats is not None:
            st.adopt(next_version, step)
            self.main.run_dir.record_version(next_version, step)
        else:
            self.run.reporter.event(NoUpdate(step, batch.dropped, self.verdict.no_update_why))
        st.step = step
        self.updating = False
        st.data_position = step * cfg.prompts_per_step
        st.dropped_total += batch.dropped
        sync = self.sync(step)
        evaluation = (self.evaluate(step) if step % cfg.eval_every == 0 or step == cfg.steps
                      else None)
        st.elapsed_s = time.perf_counter() - t_start
        flagged, bound = self.judge_nodes(step, batch, stats)
        return StepRecord.of_step(batch, stats, sync, evaluation, flagged,
                                  policy_version=st.version, data_position=st.data_position,
                                  elapsed_s=st.elapsed_s, collect_s=collect_s, train_s=train_s,
                                  mismatch_kl_bound=bound)

    def collect(self, step: int) -> StepBatch:
        """The rollouts of ``step``, admitted, scored and weighed."""
        cfg, main = self.run.cfg, self.main
        sampled = main.sampler.get(step)
        batch = build_batch(step, sampled.rollouts, sampled.items, sampled.prompt_ids,
                            lineage=self.run.state.lineage, bound=cfg.staleness_bound,
                            rewards=main.rewards, scale_rewards=cfg.scale_rewards,
                            advantage_eps=cfg.advantage_eps, flagged=main.flags.benched_flags(),
                            on_reward_error=cfg.on_reward_error)
        if batch.reward_error_groups:
            log.warning("%s; %d group(s) left out of step %d (--on-reward-error drop)",
                        batch.reward_error, batch.reward_error_groups, step)
        for node, n in batch.excluded.items():
            log.warning("step %d: %d sample(s) of flagged node %s kept out of the update",
                        step, n, node)
        return batch

    def train(self, batch: StepBatch) -> UpdateStats | None:
        """The update on the batch's sequences (None when no sample survived admission)."""
        if not batch.samples:
            return None
        with self.run.backend_lock:  # a flagged node's check scores with the weights
            return self.run.backend.update(batch.sequences)

    def sync(self, step: int, *, force: bool = False) -> SyncOutcome:
        """Push the adapter to every node (remote nodes, every ``--sync-every`` steps, or now
        when ``force``)."""
        fleet, st, backend = self.main.fleet, self.run.state, self.run.backend
        if (fleet is None or (step % self.run.cfg.sync_every and not force)
                or st.version == 0):  # nothing trained yet: the nodes serve the base
            return SyncOutcome()
        start = time.perf_counter()
        with self.run.backend_lock:
            files = backend.adapter_files()
        report = fleet.sync.push(st.version, files)
        lagging = fleet.sync.lagging_nodes(st.version)
        if report.skipped or lagging:
            self.run.reporter.event(SyncSkipped(st.version, report.skipped, tuple(lagging)))
        return SyncOutcome(pushed=True, seconds=time.perf_counter() - start,
                           synced_nodes=report.synced, skipped_nodes=report.skipped,
                           lagging_nodes=lagging)

    def evaluate(self, step: int) -> EvalResult:
        """The held-out eval of the current weights at ``step`` (0: the baseline), its
        progress reported (:class:`~gridrl.trainer.report.events.EvalProgressed`).

        Raises:
            RewardError: a function of the eval's scorer failed, naming ``step``.
        """
        reporter = self.run.reporter

        def progress(p: EvalProgress) -> None:
            reporter.event(EvalProgressed(step, p))

        try:
            with self.run.backend_lock:
                return self.main.evaluator.run(self.run.state.version, on_progress=progress)
        except RewardError as e:
            raise e.at_step(step) from e
        finally:
            reporter.event(EvalProgressed(step, None))

    def judge_nodes(self, step: int, batch: StepBatch,
                    stats: UpdateStats | None) -> tuple[dict[str, str], float]:
        """Give the node monitor the step's per-node counts (its flags go to the flags' owner,
        probation reviews the newly flagged); returns every flagged node (-> why) and the
        loosest mismatch bound applied to the step's nodes."""
        run, main = self.run, self.main
        if stats is not None:
            batch.account_mismatch(stats.per_sequence_mismatch_kl)
        for node, ns in batch.per_node.items():
            ns.low_precision = run.low_precision(node)
        benched = main.fleet is not None
        for node, why in main.monitor.observe(step, batch.per_node, main.flags).items():
            if main.fleet is not None:
                main.fleet.probation.review(node)
            log.warning("NODE FLAGGED %s at step %d: %s%s", node, step, why,
                        f"; {BENCHED}" if benched else "")
            run.reporter.event(NodeFlagged(node, step, why, benched=benched))
        return main.flags.flags(), main.monitor.bound(batch.per_node)

    def checkpoint(self, step: int) -> Path:
        """Write the checkpoint of ``step`` (the backend's files, the state, the config)."""
        run = self.run
        start = time.perf_counter()
        with run.backend_lock:
            files = run.backend.checkpoint_files()
        path = save_checkpoint(self.main.run_dir.checkpoints, step=step, files=files,
                               state=run.state.to_json(), config=run.cfg.to_dict(),
                               keep=run.cfg.keep_checkpoints)
        run.control.checkpointed = step
        run.reporter.event(Checkpointed(step, path, time.perf_counter() - start))
        return path
