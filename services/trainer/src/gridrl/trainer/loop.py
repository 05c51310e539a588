"""The training run: baseline eval, then per step rollouts -> rewards -> advantages ->
GRPO update -> sync every N -> eval every N -> checkpoint every K -> log and report.

Policy versions: the trainer's weights after each update get a new version, never reused in the
run directory (``versions.jsonl``), and the *lineage* maps every version of the current
weights' history to the step that produced it. A sample's staleness is the trainer's step minus
the step of the sample's version; samples older than the bound, or of a version outside the
lineage (a killed run's last pushes, another run's adapter), are dropped and their node is
flagged when it keeps happening (``monitor.py``). A flagged node is benched: no new groups, its
samples kept out of the update (``batch.build_batch(flagged=...)``), until the ``probation``
thread (``probation.py``) has re-pushed the current adapter and passed a fresh mismatch check
of it, scored with the backend under ``_backend_lock``.

The model side (weights, gradients, optimizer, local sampling, checkpoint state) is the
``--backend``'s (:class:`gridrl.trainer.backend.TrainerBackend`); this module imports no tensor
framework. Under data parallelism (``torchrun``) every rank runs :meth:`Trainer.run`; rank 0
alone samples, scores, syncs, evaluates, checkpoints and writes, and broadcasts each step's
sequences to the other ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gridrl.trainer import trackers
from gridrl.trainer.backend import TrainerBackend, TrainSequence, UpdateStats
from gridrl.trainer.batch import StepBatch
from gridrl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.evaluation import EvalResult
from gridrl.trainer.monitor import NodeMonitor
from gridrl.trainer.records import (
    StepRecord,
    SyncOutcome,
    baseline_record,
    step_report,
)
from gridrl.trainer.rundir import RunDir

log = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """What a checkpoint restores besides tensors.

    Attributes:
        step: last finished step.
        version: the trainer's current policy version.
        lineage: version -> step whose weights it names, for every version of the current
            weights' history (version 0 = the base model = step 0).
        data_position: index of the next training prompt.
        baseline: eval score of the base model.
        elapsed_s: training seconds so far (model loading excluded).
        dropped_total: samples dropped for staleness so far.
        resumed_at: steps this run was resumed from.
    """

    step: int = 0
    version: int = 0
    lineage: dict[int, int] = field(default_factory=lambda: {0: 0})
    data_position: int = 0
    baseline: float | None = None
    elapsed_s: float = 0.0
    dropped_total: int = 0
    resumed_at: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version,
                "lineage": {str(k): v for k, v in sorted(self.lineage.items())},
                "data_position": self.data_position, "baseline": self.baseline,
                "elapsed_s": self.elapsed_s, "dropped_total": self.dropped_total,
                "resumed_at": self.resumed_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainerState:
        return cls(step=int(d["step"]), version=int(d["version"]),
                   lineage={int(k): int(v) for k, v in d["lineage"].items()},
                   data_position=int(d["data_position"]), baseline=d.get("baseline"),
                   elapsed_s=float(d.get("elapsed_s", 0.0)),
                   dropped_total=int(d.get("dropped_total", 0)),
                   resumed_at=list(d.get("resumed_at", [])))


@dataclass(frozen=True)
class RankMessage:
    """What rank 0 broadcasts to the other ranks once per step (data parallelism).

    Attributes:
        step: the step to train.
        version: the policy version the update will produce.
        sequences: the step's training sequences (every rank gets all; each trains its share).
        stop: the run is over (finished or stopped): return.
        error: rank 0 failed with this message: fail too.
    """

    step: int = 0
    version: int = 0
    sequences: tuple[TrainSequence, ...] = ()
    stop: bool = False
    error: str | None = None


def step_seed(seed: int, step: int) -> int:
    """Sampler seed of a step's rollout request (deterministic, distinct per step)."""
    from gridrl.trainer.rollouts import group_seed

    return group_seed(seed, 1_000_000 + step)


class Trainer:
    """One training run (see the module docstring).

    Args:
        cfg: the finalized config (``TrainConfig.finalize``).
        resume: continue from ``cfg.run_dir``'s latest checkpoint.
        status: the TrainerService's :class:`~gridrl.trainer.status.RunStatus` (rank 0), or
            None.
        console: a ``rich`` console for the progress lines (default: stdout).
        source: a :class:`~gridrl.trainer.rollouts.RolloutSource` to sample from instead of the
            configured ones, built from the backend once loaded: ``source(backend,
            version_fn)`` (embedding the trainer in another program; nothing is pushed to it).
        freeze_gc: ``gc.freeze()`` once set up (the CLI's choice for a whole process; see
            :func:`gridrl.common.server.freeze_long_lived`).
    """

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, status: Any | None = None,
                 console: Any | None = None, source: Any | None = None,
                 freeze_gc: bool = False) -> None:
        self.cfg = cfg
        self.freeze_gc = freeze_gc  # the CLI: gc.freeze() once the policy is loaded
        self.resume = resume
        self.status = status
        if console is None:
            from rich.console import Console

            console = Console(highlight=False, soft_wrap=True)
        self.console = console
        self.state = TrainerState()
        self._source_factory = source
        self.source: Any = None
        self.pool: Any = None
        self.sync: Any = None
        self.prefetcher: Any = None
        self.backend: TrainerBackend | None = None
        self.is_main = True  # rank 0 (set from the backend once loaded)
        self.probation: Any = None  # flagged nodes' way back (probation.py)
        # held around every backend call of the loop: the probation thread scores sequences
        # with the backend meanwhile (TrainerBackend: calls never overlap)
        self._backend_lock = threading.Lock()
        self.run_dir: RunDir | None = None
        self.trackers: Any = None  # --report-to (rank 0)
        self._flagged_ever: dict[str, str] = {}
        self._stop_reason: str | None = None
        self.stopped_at: int | None = None
        self.checkpointed_step = 0  # the step of the latest checkpoint (0: none yet)
        self._updating = False  # inside the update: the weights are not those of state.step
        self._stepping = False  # the step loop has begun
        self._legend_printed = False  # the step lines' legend, once per process

    def request_stop(self, reason: str) -> None:
        """Stop after the step in progress: checkpoint it and return (safe from a signal
        handler). ``reason`` is the signal's name (``SIGINT``, ``SIGTERM``) or another word.
        The run can be continued with ``--resume``."""
        self._stop_reason = reason

    def stop_notice(self) -> str:
        """What a stop asked now will do, in words (printed at once by the CLI)."""
        if self._stepping:
            return f"finishing step {self.state.step + 1}, then checkpointing"
        return (f"stopping before step {self.state.step + 1} once the setup in progress "
                "(model load, node wait, baseline eval) ends")

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` was called."""
        return self._stop_reason is not None

    @property
    def stop_signal(self) -> str | None:
        """The reason given to :meth:`request_stop` (the signal's name), or None."""
        return self._stop_reason

    def unsaved_steps(self) -> str:
        """What aborting now loses, in words: the finished steps since the last checkpoint and
        the step in progress, and where ``--resume`` would continue from."""
        done, saved = self.state.step, self.checkpointed_step
        lost = (f"steps {saved + 1}-{done}" if done > saved + 1
                else f"step {done}" if done == saved + 1 else "")
        lost = ", ".join(filter(None, [lost and f"finished {lost}",
                                       f"step {done + 1} in progress"]))
        if not saved:
            return f"no checkpoint yet: {lost} lost"
        return (f"{lost} lost; --resume {self.cfg.run_dir} continues from the checkpoint of "
                f"step {saved}")

    # ================================================================== setup

    def _setup(self) -> None:
        from gridrl.trainer.backend import create_backend
        from gridrl.trainer.rewards import build_reward_set
        from gridrl.trainer.tasks import make_task

        cfg = self.cfg
        trackers.require(cfg.report_to)  # a missing package fails before the model loads
        # seeds every RNG, loads the model + LoRA, builds the optimizer and the schedule, and
        # joins data parallelism (torch: DDP under torchrun)
        self.backend = backend = create_backend(cfg)
        self.is_main = backend.rank == 0
        self.task = make_task(cfg.task, seed=cfg.seed, eval_size=cfg.eval_tasks,
                              min_words=cfg.min_words, max_words=cfg.max_words,
                              prompt_column=cfg.prompt_column, answer_column=cfg.answer_column,
                              system_prompt=cfg.system_prompt, eval_file=cfg.eval_file)
        self.rewards = build_reward_set(self.task, cfg.reward_files, cfg.reward_weights)
        if self.is_main:
            self.run_dir = RunDir(cfg.run_dir or ".")
        ckpt = self._load_resume_checkpoint()
        if backend.world_size > cfg.prompts_per_step:
            from gridrl.common.errors import invalid_argument

            raise invalid_argument("--prompts-per-step", f"{cfg.prompts_per_step} groups cannot "
                                   f"be shared by {backend.world_size} ranks")
        self.monitor = NodeMonitor(
            max_staleness=cfg.staleness_bound, mismatch_kl_max=cfg.mismatch_kl_max,
            mismatch_kl_max_16bit=cfg.mismatch_kl_max_16bit,
            flag_after=cfg.flag_after)
        if ckpt is not None:
            self._begin_resumed(ckpt)
        if self.is_main:
            assert self.run_dir is not None
            cfg.save(self.run_dir.config)
            self.trackers = trackers.open_trackers(cfg, resumed_at=self.state.step
                                                   if self.resume else None)
            self.run_dir.listeners.append(self.trackers.log)  # every log.jsonl record
            self._setup_rollouts()
        if self.freeze_gc:
            from gridrl.common.server import freeze_long_lived

            freeze_long_lived()  # the policy lives as long as the run: no 200 ms collections

    def _load_resume_checkpoint(self) -> Any | None:
        """Rank 0 reads the latest checkpoint and broadcasts it; every rank restores it."""
        if not self.resume:
            return None
        assert self.backend is not None
        ckpt = None
        if self.is_main:
            assert self.run_dir is not None
            path = latest_checkpoint(self.run_dir.checkpoints)
            if path is None:
                from gridrl.common.errors import invalid_argument

                raise invalid_argument("--resume", f"{self.run_dir.path} has no checkpoint")
            ckpt = load_checkpoint(path)
        ckpt = self.backend.broadcast(ckpt)
        assert ckpt is not None
        self.backend.restore_checkpoint(ckpt.files)
        self.state = TrainerState.from_json(ckpt.state)
        self.checkpointed_step = self.state.step
        return ckpt

    def _begin_resumed(self, ckpt: Any) -> None:
        """Give the resumed weights a version never used in this run directory (a node may
        hold the killed run's later versions), and forget log records past the checkpoint."""
        st = self.state
        st.resumed_at.append(st.step)
        if self.is_main:
            assert self.run_dir is not None
            removed = self.run_dir.truncate_log(st.step)
            new_version = max(self.run_dir.max_version(), st.version) + 1
        else:
            new_version = 0
        new_version = self.backend.broadcast(new_version)
        st.version = new_version
        st.lineage[new_version] = st.step
        if self.is_main:
            assert self.run_dir is not None
            self.run_dir.record_version(new_version, st.step)
            log.info("resumed %s at step %d (checkpoint %s); %d later log record(s) dropped; "
                     "policy version %d", self.run_dir.path, st.step, ckpt.path.name, removed,
                     new_version)
            self.console.print(f"[bold]resumed[/] at step {st.step} from {ckpt.path} "
                               f"(policy version {new_version})")

    def _setup_rollouts(self) -> None:
        from gridrl.trainer.evaluation import Evaluator
        from gridrl.trainer.local import LocalRollout
        from gridrl.trainer.prefetch import Prefetcher

        cfg = self.cfg
        backend = self.backend
        self.evaluator = Evaluator(backend, self.task, max_tokens=cfg.max_tokens,
                                   rewards=self.rewards)
        if self._source_factory is not None:
            self.source = self._source_factory(backend, lambda: self.state.version)
        elif cfg.local:
            self.source = LocalRollout(backend, lambda: self.state.version)
        else:
            from gridrl.trainer.node_wait import NodeWaitReporter
            from gridrl.trainer.pool import NodePool
            from gridrl.trainer.sync import AdapterSync

            self.pool = NodePool(master=cfg.master, addresses=[a for a in cfg.rollout],
                                 model_identity=backend.identity, security=cfg.security,
                                 request_timeout_s=cfg.request_timeout_s,
                                 wait_for_nodes_s=cfg.wait_for_nodes_s,
                                 on_wait=NodeWaitReporter(
                                     self.console, self.status,
                                     stopping=lambda: self.stop_requested))
            self.pool.start()
            self.sync = AdapterSync(self.pool, name=cfg.run_name or "gridrl",
                                    num_layers=backend.identity.num_layers,
                                    deadline_s=cfg.sync_deadline_s,
                                    known_versions=lambda: self.state.lineage)
            nodes = self.pool.wait_for_nodes(cfg.min_nodes, cfg.node_wait_s,
                                             stop=lambda: self.stop_requested)
            if not self.stop_requested:  # else the wait ended because the run stops
                self.console.print("rollout nodes: " + ", ".join(
                    f"{n.address} ({n.backend or '?'}, capacity {n.capacity})"
                    for n in nodes if n.in_rotation))
            self.source = self.pool
        self._prompt_cache: dict[int, tuple[list[Any], list[list[int]]]] = {}
        self._prompt_lock = threading.Lock()
        self.prefetcher = Prefetcher(self._generate_step, depth=cfg.async_steps,
                                     last_step=cfg.steps)
        if self.pool is not None:
            self._start_probation()

    # ================================================================== steps

    def _step_prompts(self, step: int) -> tuple[list[Any], list[list[int]]]:
        """The task items and prompt token ids of ``step`` (tokenized once)."""
        from gridrl.trainer.tasks import encode_chat

        with self._prompt_lock:  # the prefetch thread and the loop both ask
            for s in [s for s in self._prompt_cache if s < step - self.cfg.async_steps - 1]:
                del self._prompt_cache[s]
            cached = self._prompt_cache.get(step)
            if cached is None:
                start = (step - 1) * self.cfg.prompts_per_step
                items = [self.task.train_item(i)
                         for i in range(start, start + self.cfg.prompts_per_step)]
                ids = [encode_chat(self.backend.tokenizer, it.messages) for it in items]
                cached = (items, ids)
                self._prompt_cache[step] = cached
            return cached

    def _generate_step(self, step: int) -> list[Any]:
        cfg = self.cfg
        _, prompt_ids = self._step_prompts(step)
        return self.source.generate_groups(
            prompt_ids, group_size=cfg.group_size, max_tokens=cfg.max_tokens,
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            seed=step_seed(cfg.seed, step))

    def _collect(self, step: int) -> StepBatch:
        """Rank 0: rollouts of ``step``, staleness admission, rewards, advantages."""
        from gridrl.trainer.batch import build_batch

        cfg = self.cfg
        items, prompt_ids = self._step_prompts(step)
        batch = build_batch(step, self.prefetcher.get(step), items, prompt_ids,
                            lineage=self.state.lineage, bound=cfg.staleness_bound,
                            rewards=self.rewards, scale_rewards=cfg.scale_rewards,
                            advantage_eps=cfg.advantage_eps, flagged=self._flagged_nodes())
        if batch.excluded:
            from gridrl.trainer import metrics

            for node, n in batch.excluded.items():
                metrics.EXCLUDED_SAMPLES.labels(node).inc(n)
                log.warning("step %d: %d sample(s) of flagged node %s kept out of the update",
                            step, n, node)
        return batch

    def _train(self, seqs: Sequence[TrainSequence]) -> UpdateStats | None:
        if not seqs:
            return None
        assert self.backend is not None
        with self._backend_lock:  # a flagged node's check scores with the weights (probation)
            return self.backend.update(seqs)

    def _sync(self, step: int, *, force: bool = False) -> SyncOutcome:
        """Push the adapter to every node (rank 0, remote nodes, every --sync-every steps, or
        now when ``force``)."""
        if (self.sync is None or (step % self.cfg.sync_every and not force)
                or self.state.version == 0):  # nothing trained yet: the nodes serve the base
            return SyncOutcome()
        from gridrl.adapters import build_manifest

        start = time.perf_counter()
        with self._backend_lock:
            files = self.backend.adapter_files()
        # No digests in the header: each push hashes its bytes while they stream (trailer).
        manifest = build_manifest(files, name=self.sync.name, version=self.state.version,
                                  base_model=self.backend.identity, hash_files=False).to_dict()
        report = self.sync.push(self.state.version, files, manifest)
        lagging = self.sync.lagging_nodes(self.state.version)
        if report.skipped or lagging:
            self.console.print(
                f"[bold red]SYNC of policy version {self.state.version}: "
                f"{len(report.skipped)} node(s) skipped[/] " + "; ".join(
                    f"{a}: {why}" for a, why in sorted(report.skipped.items()))
                + (f" [red]lagging: {', '.join(lagging)}[/]" if lagging else ""))
        return SyncOutcome(pushed=True, seconds=time.perf_counter() - start,
                           synced_nodes=report.synced, skipped_nodes=report.skipped,
                           lagging_nodes=lagging)

    def _evaluate(self) -> EvalResult:
        with self._backend_lock:
            return self.evaluator.run(self.state.version)

    def _checkpoint(self, step: int) -> Path:
        assert self.run_dir is not None
        with self._backend_lock:
            files = self.backend.checkpoint_files()
        path = save_checkpoint(self.run_dir.checkpoints, step=step, files=files,
                               state=self.state.to_json(),
                               config=self.cfg.to_dict(), keep=self.cfg.keep_checkpoints)
        self.checkpointed_step = step
        return path

    # ================================================================== the run

    def run(self) -> dict[str, Any] | None:
        """Run every step; returns the summary on rank 0 (None on other ranks).

        Raises:
            StatusError: bad configuration; RuntimeError: no rollout node can serve;
            TimeoutError: not enough nodes in time. The status is marked FAILED first.
        """
        ended = False  # every collective of the run done on this rank
        try:
            if self.status is not None:  # STARTING while the model loads
                self.status.begin(self.cfg.run_name or "", str(self.cfg.run_dir),
                                  self.cfg.steps, self.cfg.model)
            self._setup()
            summary = self._run_main() if self.is_main else self._run_worker()
            ended = True
            return summary
        except BaseException as e:
            if isinstance(e, (RuntimeError, TimeoutError)):
                self._checkpoint_failed_run(e)
            if self.status is not None:
                self.status.fail(f"{type(e).__name__}: {e}")
            if self.backend is not None and self.is_main and self.backend.world_size > 1:
                try:  # release the other ranks from their broadcast
                    self.backend.broadcast(RankMessage(error=f"{type(e).__name__}: {e}"))
                except Exception:
                    pass
            raise
        finally:
            self._close(ended)

    def _checkpoint_failed_run(self, error: BaseException) -> None:
        """A run failing between steps (no rollout node in time, a node error): checkpoint the
        steps it finished since the last checkpoint, so ``--resume`` loses none of them. Not
        inside an update (the weights are then neither the last step's nor the next's)."""
        st = self.state
        if (not self.is_main or self.run_dir is None or self.backend is None
                or self._updating or st.step <= self.checkpointed_step):
            return
        try:
            self._checkpoint(st.step)
        except Exception:
            log.exception("checkpoint of the failed run failed")
            return
        message = (f"run failed after step {st.step} ({type(error).__name__}); checkpointed "
                   f"it: continue with: {self._resume_command()}")
        log.warning("%s", message)
        self.console.print(f"[bold yellow]{message}[/]")

    def _close(self, ended: bool) -> None:
        """Release the run's resources. ``ended``: no collective can be in flight, so the
        process group's threads are ended too (``TrainerBackend.close``)."""
        for closer in (self.probation, self.prefetcher, self.sync, self.source, self.trackers):
            if closer is not None:
                try:
                    closer.close()
                except Exception:
                    log.exception("closing %r failed", closer)
        if self.backend is not None:
            self.backend.close(wait=ended)

    def _run_worker(self) -> None:
        """Ranks > 0: train on the broadcast sequences until rank 0 says stop."""
        while True:
            msg: RankMessage = self.backend.broadcast(None)
            if msg.error is not None:
                raise RuntimeError(f"rank 0 failed: {msg.error}")
            if msg.stop:
                return
            stats = self._train(msg.sequences)
            if stats is not None:
                self.state.version = msg.version
                self.state.lineage[msg.version] = msg.step
            self.state.step = msg.step

    def _run_main(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        assert self.run_dir is not None
        if self.status is not None:
            for rec in self.run_dir.read_log():  # a resumed run's earlier steps
                if rec.get("step"):
                    self._report(step_report(rec), publish_metrics=False)
        if self._stop_reason is not None:  # asked while setting up: before any work
            return self._stop(st.step)
        if self.resume and self.sync is not None:  # nodes must serve the resumed weights
            sync = self._sync(st.step, force=True)
            self.console.print(f"pushed resumed weights as policy version {st.version} to "
                               f"{len(sync.synced_nodes)} node(s)")
        if st.baseline is None:
            base = self._evaluate()
            st.baseline = base.score
            self.run_dir.append_log(baseline_record(base))
            self.console.print(f"baseline eval {st.baseline:.3f}±{base.stderr:.3f} (exact "
                               f"{base.exact:.2f}, policy version 0, "
                               f"{len(self.evaluator.items)} tasks)")
        if self.status is not None:
            self.status.set_baseline(st.baseline)
        t_start = time.perf_counter() - st.elapsed_s
        self._stepping = True
        for step in range(st.step + 1, cfg.steps + 1):
            if self._stop_reason is not None:  # asked during the setup or the baseline eval
                if st.step > self.checkpointed_step:
                    self._checkpoint(st.step)
                return self._stop(st.step)
            t0 = time.perf_counter()
            batch = self._collect(step)
            collect_s = time.perf_counter() - t0
            seqs = batch.sequences
            next_version = max(st.version, max(st.lineage)) + 1
            if self.backend.world_size > 1:
                self.backend.broadcast(RankMessage(step=step, version=next_version,
                                                   sequences=tuple(seqs)))
            t1 = time.perf_counter()
            self._updating = True
            stats = self._train(seqs)
            train_s = time.perf_counter() - t1
            if stats is not None:
                st.version = next_version
                st.lineage[next_version] = step
                self.run_dir.record_version(next_version, step)
            else:
                self.console.print(f"[bold red]step {step}: no sample survived the staleness "
                                   f"filter ({batch.dropped} dropped); no update[/]")
            st.step = step
            self._updating = False
            st.data_position = step * cfg.prompts_per_step
            st.dropped_total += batch.dropped
            sync = self._sync(step)
            evaluation = (self._evaluate() if step % cfg.eval_every == 0 or step == cfg.steps
                          else None)
            st.elapsed_s = time.perf_counter() - t_start
            flagged = self._account_nodes(step, batch, stats)
            record = StepRecord.of_step(batch, stats, sync, evaluation, flagged,
                                        policy_version=st.version,
                                        data_position=st.data_position,
                                        elapsed_s=st.elapsed_s, collect_s=collect_s,
                                        train_s=train_s)
            self.run_dir.append_log(record.to_json())
            self._report(record.report(), extra=record.importance())
            self._print_step(record)
            stopping = self._stop_reason is not None and step < cfg.steps
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
                self._checkpoint(step)
                self._plot()
            if stopping:
                return self._stop(step)
        if self.backend.world_size > 1:
            self.backend.broadcast(RankMessage(stop=True))
        return self._finish()

    def _resume_command(self) -> str:
        """The command that continues this run; the security flags are not saved with it."""
        assert self.run_dir is not None
        security = self.cfg.security
        secured = security is not None and bool(
            security.token or security.tls.cert or security.tls.ca or security.authorized)
        return (f"gridrl-trainer run --resume {self.run_dir.path}"
                + (" and this start's --tls-*, --authorized-tokens and --auth-token-file "
                   "flags (credentials are never saved with a run)" if secured else ""))

    def _stop(self, step: int) -> dict[str, Any]:
        """End a run asked to stop: the checkpoint of ``step`` is written."""
        assert self.run_dir is not None
        if self.backend.world_size > 1:
            self.backend.broadcast(RankMessage(stop=True))
        self.stopped_at = step
        if self.checkpointed_step:
            message = (f"stopped after step {step} of {self.cfg.steps} ({self._stop_reason}); "
                       f"continue with: {self._resume_command()}")
        else:
            message = (f"stopped before step 1 of {self.cfg.steps} ({self._stop_reason}); "
                       "no step to checkpoint")
        log.warning("%s", message)
        self.console.print(f"[bold yellow]{message}[/]")
        if self.status is not None:
            self.status.stop(message)
        return {"stopped_at": step, "run_dir": str(self.run_dir.path)}

    def _account_nodes(self, step: int, batch: StepBatch,
                       stats: UpdateStats | None) -> dict[str, str]:
        """Give the node monitor the step's per-node counts; returns every flagged node."""
        if stats is not None:
            batch.account_mismatch(stats.per_sequence_mismatch_kl)
        for node, ns in batch.per_node.items():
            ns.low_precision = self._low_precision(node)
        if self.status is not None:  # a served run: Prometheus shows the bound beside the KL
            from gridrl.trainer import metrics

            metrics.MISMATCH_KL_BOUND.set(self.monitor.bound(batch.per_node))
        if self.probation is not None:  # nodes that passed a fresh check since
            for node in self.probation.drain():
                self.monitor.clear(node)
        newly = self.monitor.observe(step, batch.per_node)
        for node, why in newly.items():
            self._flagged_ever[node] = why
            benched = ""
            if self.probation is not None:
                self.probation.flag(node, why)
                benched = ("; benched: no new groups, its samples kept out of the update until "
                           "it serves the current policy version and passes a fresh mismatch "
                           "check")
            log.warning("NODE FLAGGED %s at step %d: %s%s", node, step, why, benched)
            self.console.print(f"[bold white on red] NODE FLAGGED [/] [bold red]{node}[/] at step "
                               f"{step}: {why}{benched}")
        return dict(self.monitor.flagged)

    def _start_probation(self) -> None:
        """The thread that brings flagged nodes back (``probation.py``)."""
        from gridrl.trainer.probation import Probation, fresh_mismatch_kl

        cfg = self.cfg
        self.probation = Probation(
            self.pool, self.sync, console=self.console,
            check_kl=lambda prompt, samples: fresh_mismatch_kl(
                self.backend, prompt, samples, lock=self._backend_lock),
            current_version=lambda: self.state.version,
            bound=lambda node: self.monitor.bound_for(self._low_precision(node)),
            prompt=self._step_prompts(1)[1][0],
            sampling={"group_size": cfg.group_size, "max_tokens": cfg.max_tokens,
                      "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k})
        self.probation.start()

    def _flagged_nodes(self) -> dict[str, str]:
        """Nodes benched for their samples now (their samples stay out of the update)."""
        if self.pool is None:
            return {}
        return {n.address: n.flagged for n in self.pool.nodes() if n.flagged}

    def _low_precision(self, node: str) -> bool:
        """Whether the trainer or rollout node ``node`` computes in a 16-bit float dtype."""
        if self.backend.low_precision:
            return True
        state = self.pool.node(node) if self.pool is not None else None
        return state is not None and state.dtype in ("bfloat16", "float16")

    def _report(self, report: dict[str, Any], publish_metrics: bool = True,
                extra: dict[str, Any] | None = None) -> None:
        """Publish a step's ``StepReport`` fields to TrainerService and Prometheus (``extra``:
        more gauges for Prometheus only, e.g. the importance weights)."""
        if self.status is not None:
            self.status.report(report)
        if publish_metrics:
            from gridrl.trainer import metrics

            metrics.record_step({**report, **(extra or {})})

    def _print_step(self, r: StepRecord) -> None:
        cfg = self.cfg
        if not self._legend_printed:
            self._legend_printed = True
            self.console.print(
                "[dim]reward: mean±std of the step's samples; eval: held-out score±stderr"
                "@policy version; stale: mean versions behind; kl: behaviour vs trainer "
                "logprobs; loss: the GRPO surrogate, ≈0 on-policy (advantages are centred in "
                "each group), gnorm: the update's size; v: policy version[/]")
        parts = [f"step {r.step:>4}/{cfg.steps}", f"reward {r.reward_mean:.3f}±{r.reward_std:.2f}"]
        if r.eval_score is not None:
            parts.append(f"[bold green]eval {r.eval_score:.3f}±{r.eval_stderr or 0:.3f}"
                         f"@v{r.eval_policy_version}[/]")
        stale = f"stale {r.staleness_mean:.1f}"
        if r.dropped_samples:
            stale += f" [red]dropped {r.dropped_samples}[/]"
        parts += [stale, f"kl {r.mismatch_kl:.1e}", f"loss {r.loss:+.4f}"
                  + (f" gnorm {r.grad_norm:.2f}" if r.grad_norm is not None else ""),
                  f"v{r.policy_version}"]
        if r.is_weight_mean is not None:
            parts.insert(-1, f"is {r.is_weight_mean:.2f}/max {r.is_weight_max:.2f} "
                             f"capped {r.is_limited_fraction:.0%}")
        if not cfg.local:
            if r.synced_nodes is not None:
                n_all = r.nodes_synced + r.nodes_skipped
                color = "red" if r.nodes_skipped else "default"
                parts.append(f"[{color}]sync {r.sync_s:.2f}s {r.nodes_synced}/{n_all} nodes[/]")
            else:
                parts.append("sync -")
        parts.append(f"roll {r.rollout_s:.1f}s train {r.train_s:.1f}s "
                     f"{r.tokens_per_s:.0f} tok/s")
        if r.flagged_nodes:
            parts.append(f"[bold red]FLAGGED: {', '.join(sorted(r.flagged_nodes))}[/]")
        self.console.print(" │ ".join(parts))

    def _plot(self) -> None:
        from gridrl.trainer.plot import plot_run

        assert self.run_dir is not None
        try:
            plot_run(self.run_dir.read_log(), self.run_dir.plot, baseline=self.state.baseline,
                     title=f"{self.cfg.run_name}: {self.cfg.task} on {self.cfg.model}")
        except Exception:  # a plot must never stop training
            log.exception("plot failed")

    def _rollout_addresses(self) -> list[str]:
        """Every rollout node the run knew (--rollout and those the master listed), by
        address."""
        known = [n.address for n in self.pool.nodes()] if self.pool is not None else []
        return sorted({*known, *(a for a in self.cfg.rollout if a != "local")})

    def _finish(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        assert self.run_dir is not None
        with self._backend_lock:
            files = self.backend.adapter_files()
        mlx_error = None
        try:
            self.run_dir.write_final_adapter(files, self.backend.identity.num_layers)
        except Exception as e:  # the peft adapter is written first; the conversion may not apply
            mlx_error = f"{type(e).__name__}: {e}"
            log.warning("final adapter: MLX conversion failed: %s", mlx_error)
        self._plot()
        records = [r for r in self.run_dir.read_log() if r.get("step")]
        rewards = [r["reward_mean"] for r in records]
        evals = [(r["step"], r["eval_score"], r["eval_policy_version"], r.get("eval_stderr"),
                  r.get("elapsed_s"), r.get("eval_s"))
                 for r in records if r.get("eval_score") is not None]
        final = evals[-1] if evals else None
        baseline = next((r for r in self.run_dir.read_log() if r.get("event") == "baseline"), {})
        summary = {
            "run_name": cfg.run_name, "model": cfg.model, "task": cfg.task,
            "steps": st.step, "total_steps": cfg.steps, "policy_version": st.version,
            "baseline_eval": st.baseline,
            "baseline_eval_stderr": baseline.get("eval_stderr"),
            "final_eval": final[1] if final else None,
            "final_eval_stderr": final[3] if final else None,
            "final_eval_policy_version": final[2] if final else None,
            "best_eval": max((e[1] for e in evals), default=None),
            "eval_tasks": len(self.evaluator.items),
            "evals": [{"step": s, "score": v, "policy_version": pv, "stderr": se,
                       "elapsed_s": el, "eval_s": es} for s, v, pv, se, el, es in evals],
            "reward_mean_first10": float(np.mean(rewards[:10])) if rewards else None,
            "reward_mean_last10": float(np.mean(rewards[-10:])) if rewards else None,
            "elapsed_s": st.elapsed_s,
            "seconds_per_step": st.elapsed_s / max(len(records), 1),
            "dropped_samples": st.dropped_total,
            "flagged_nodes": self._flagged_ever,
            "resumed_at": st.resumed_at,
            # the nodes that served the run (a master only finds them)
            "rollout": "local" if cfg.local else self._rollout_addresses(),
            "master": cfg.master,
            "adapter": str(self.run_dir.adapter),
            "adapter_mlx": None if mlx_error else str(self.run_dir.adapter_mlx),
            "adapter_mlx_error": mlx_error,
            "plot": str(self.run_dir.plot),
        }
        self.run_dir.write_json(self.run_dir.summary, summary)
        if self.status is not None:
            self.status.finish()
        self.console.print(
            f"[bold]done[/]: {st.step} steps, eval {st.baseline:.3f} -> "
            + (f"{final[1]:.3f}" + (f"±{final[3]:.3f}" if final[3] is not None else "")
               + f" (policy version {final[2]})" if final else "n/a")
            + f", run directory {self.run_dir.path}")
        if self._flagged_ever:
            self.console.print("[bold red]nodes flagged during the run: " + "; ".join(
                f"{n}: {w}" for n, w in sorted(self._flagged_ever.items())) + "[/]")
        return summary
