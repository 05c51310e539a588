"""The training run: baseline eval, then per step rollouts -> rewards -> advantages ->
GRPO update -> sync every N -> eval every N -> checkpoint every K -> log and report.

Policy versions: the trainer's weights after each update get a new version, never reused in the
run directory (``versions.jsonl``), and the *lineage* maps every version of the current
weights' history to the step that produced it. A sample's staleness is the trainer's step minus
the step of the sample's version; samples older than the bound, or of a version outside the
lineage (a killed run's last pushes, another run's adapter), are dropped and their node is
flagged when it keeps happening (``monitor.py``).

Under ``torchrun`` every rank runs :meth:`Trainer.run`; rank 0 alone samples, scores, syncs,
evaluates, checkpoints and writes, and broadcasts each step's sequences to the other ranks.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gridrl.trainer import grpo, trackers
from gridrl.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.monitor import NodeMonitor, NodeStepStats
from gridrl.trainer.rundir import RunDir
from gridrl.trainer.update import TrainSequence, UpdateConfig, UpdateStats, grpo_update

log = logging.getLogger(__name__)

STEP_REPORT_FIELDS = ("step", "policy_version", "reward_mean", "reward_std", "loss",
                      "eval_score", "eval_policy_version", "mismatch_kl", "staleness_mean",
                      "dropped_samples", "rollout_s", "train_s", "sync_s", "nodes_synced",
                      "nodes_skipped", "tokens_per_s", "elapsed_s")


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


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


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
            configured ones, built from the policy once loaded: ``source(policy, version_fn)``
            (embedding the trainer in another program; nothing is pushed to it).
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
        self.parallel: Any = None
        self.run_dir: RunDir | None = None
        self.trackers: Any = None  # --report-to (rank 0)
        self._last_eval: dict[str, Any] | None = None
        self._flagged_ever: dict[str, str] = {}
        self._stop_reason: str | None = None
        self.stopped_at: int | None = None

    def request_stop(self, reason: str) -> None:
        """Stop after the step in progress: checkpoint it and return (safe from a signal
        handler). The run can be continued with ``--resume``."""
        self._stop_reason = reason

    # ================================================================== setup

    def _setup(self) -> None:
        from gridrl.trainer.distributed import (
            init_process_group,
            launched_by_torchrun,
            make_parallel,
        )
        from gridrl.trainer.policy import LoraSettings, load_policy, pick_device
        from gridrl.trainer.rewards import build_reward_set
        from gridrl.trainer.tasks import make_task
        from gridrl.trainer.update import make_optimizer, make_scheduler

        cfg = self.cfg
        trackers.require(cfg.report_to)  # a missing package fails before the model loads
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if launched_by_torchrun():
            init_process_group(pick_device(cfg.device))
        seed_everything(cfg.seed)
        lora = LoraSettings(rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                            target_modules=cfg.lora_target_modules, rslora=cfg.rslora)
        self.policy = load_policy(cfg.model, lora=lora, device=cfg.device, dtype=cfg.dtype,
                                  seed=cfg.seed)
        self.task = make_task(cfg.task, seed=cfg.seed, eval_size=cfg.eval_tasks,
                              min_words=cfg.min_words, max_words=cfg.max_words,
                              prompt_column=cfg.prompt_column, answer_column=cfg.answer_column,
                              system_prompt=cfg.system_prompt, eval_file=cfg.eval_file)
        self.rewards = build_reward_set(self.task, cfg.reward_files, cfg.reward_weights)
        self.optimizer = make_optimizer(self.policy.trainable_parameters(), lr=cfg.lr,
                                        weight_decay=cfg.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, schedule=cfg.lr_schedule,
                                        warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        self.update_cfg = UpdateConfig(
            temperature=cfg.temperature, eps_low=cfg.clip_eps, eps_high=cfg.clip_eps_high,
            beta=cfg.kl_beta, aggregation=cfg.loss_aggregation, max_tokens=cfg.max_tokens,
            micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
            top_p=cfg.top_p, top_k=cfg.top_k)
        import torch.distributed as dist

        self.is_main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if self.is_main:
            self.run_dir = RunDir(cfg.run_dir or ".")
        ckpt = self._load_resume_checkpoint()
        # DDP (when under torchrun) wraps the model after the checkpoint is in: its
        # construction broadcasts rank 0's parameters.
        self.parallel = make_parallel(self.policy.model, self.policy.device)
        if self.parallel.world_size > cfg.prompts_per_step:
            from gridrl.common.errors import invalid_argument

            raise invalid_argument("--prompts-per-step", f"{cfg.prompts_per_step} groups cannot "
                                   f"be shared by {self.parallel.world_size} ranks")
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
        """Rank 0 reads the latest checkpoint and broadcasts it; every rank loads it."""
        if not self.resume:
            return None
        import torch.distributed as dist

        ckpt = None
        if self.is_main:
            assert self.run_dir is not None
            path = latest_checkpoint(self.run_dir.checkpoints)
            if path is None:
                from gridrl.common.errors import invalid_argument

                raise invalid_argument("--resume", f"{self.run_dir.path} has no checkpoint")
            ckpt = load_checkpoint(path)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [ckpt]
            dist.broadcast_object_list(box, src=0)
            ckpt = box[0]
        assert ckpt is not None
        self.policy.load_adapter_files(ckpt.adapter_files)
        self.optimizer.load_state_dict(ckpt.optimizer)
        if ckpt.scheduler is not None:
            self.scheduler.load_state_dict(ckpt.scheduler)
        set_rng_state(ckpt.rng)
        self.state = TrainerState.from_json(ckpt.state)
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
        new_version = self.parallel.broadcast(new_version)
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
        local = LocalRollout(self.policy, lambda: self.state.version)
        self.evaluator = Evaluator(local, self.policy.tokenizer, self.task,
                                   max_tokens=cfg.max_tokens, rewards=self.rewards)
        if self._source_factory is not None:
            self.source = self._source_factory(self.policy, lambda: self.state.version)
        elif cfg.local:
            self.source = local
        else:
            from gridrl.trainer.pool import NodePool
            from gridrl.trainer.sync import AdapterSync

            self.pool = NodePool(master=cfg.master, addresses=[a for a in cfg.rollout],
                                 model_identity=self.policy.identity, security=cfg.security,
                                 request_timeout_s=cfg.request_timeout_s)
            self.pool.start()
            self.sync = AdapterSync(self.pool, name=cfg.run_name or "gridrl",
                                    num_layers=self.policy.identity.num_layers,
                                    deadline_s=cfg.sync_deadline_s,
                                    known_versions=lambda: self.state.lineage)
            nodes = self.pool.wait_for_nodes(cfg.min_nodes, cfg.node_wait_s)
            self.console.print("rollout nodes: " + ", ".join(
                f"{n.address} ({n.backend or '?'}, capacity {n.capacity})"
                for n in nodes if n.in_rotation))
            self.source = self.pool
        self._prompt_cache: dict[int, tuple[list[Any], list[list[int]]]] = {}
        self._prompt_lock = threading.Lock()
        self.prefetcher = Prefetcher(self._generate_step, depth=cfg.async_steps,
                                     last_step=cfg.steps)

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
                ids = [encode_chat(self.policy.tokenizer, it.messages) for it in items]
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

    def _collect(self, step: int) -> dict[str, Any]:
        """Rank 0: rollouts of ``step``, staleness filter, rewards, advantages."""
        cfg = self.cfg
        items, prompt_ids = self._step_prompts(step)
        rollouts = self.prefetcher.get(step)
        trainer_step = step - 1  # the weights being trained are those after step - 1
        bound = cfg.staleness_bound
        per_node: dict[str, NodeStepStats] = {}
        kept: list[tuple[int, int, Any]] = []  # (group index, sample index, sample)
        staleness: list[int] = []
        sampled_tokens = 0
        for b, group in enumerate(rollouts.groups):
            for j, s in enumerate(group.samples):
                sampled_tokens += len(s.token_ids)
                ns = per_node.setdefault(s.node, NodeStepStats(versions=set()))
                ns.samples += 1
                assert ns.versions is not None
                ns.versions.add(s.policy_version)
                origin = self.state.lineage.get(s.policy_version)
                if origin is None:
                    ns.dropped += 1
                    ns.unknown_version += 1
                    continue
                age = trainer_step - origin
                if age > bound:
                    ns.dropped += 1
                    continue
                ns.staleness_sum += age
                kept.append((b, j, s))
                staleness.append(age)
        dropped = sum(ns.dropped for ns in per_node.values())

        rewards_flat: list[float] = []
        per_func: dict[str, list[float]] = {}
        if kept:
            prompts = [items[b].prompt for b, _, _ in kept]
            completions = [s.text for _, _, s in kept]
            columns: dict[str, list[Any]] = {}
            for key in items[0].columns:
                columns[key] = [items[b].columns.get(key) for b, _, _ in kept]
            columns["completion_ids"] = [list(s.token_ids) for _, _, s in kept]
            rewards_flat, per_func = self.rewards(prompts, completions, columns)
        g_max = max((len(g.samples) for g in rollouts.groups), default=0)
        reward_t = torch.zeros(len(rollouts.groups), max(g_max, 1))
        mask_t = torch.zeros_like(reward_t)
        for (b, j, _), r in zip(kept, rewards_flat, strict=True):
            reward_t[b, j] = r
            mask_t[b, j] = 1.0
        adv = grpo.group_advantages(reward_t, scale_std=cfg.scale_rewards,
                                    eps=cfg.advantage_eps, mask=mask_t)
        seqs = [TrainSequence(prompt_ids=tuple(prompt_ids[b]), completion_ids=tuple(s.token_ids),
                              behaviour_logprobs=tuple(s.logprobs), advantage=float(adv[b, j]),
                              group=b)
                for b, j, s in kept]
        r = torch.tensor(rewards_flat, dtype=torch.float64)
        return {
            "seqs": seqs, "kept": kept, "staleness": staleness, "per_node": per_node,
            "dropped": dropped, "rollouts": rollouts, "sampled_tokens": sampled_tokens,
            "reward_mean": float(r.mean()) if len(r) else 0.0,
            "reward_std": float(r.std(unbiased=False)) if len(r) else 0.0,
            "reward_funcs": {k: float(np.nanmean(v)) if v and not np.all(np.isnan(v)) else None
                             for k, v in per_func.items()},
            "solved": float(sum(x >= 1.0 for x in rewards_flat) / len(r)) if len(r) else 0.0,
            "groups_with_signal": int(sum(bool((adv[b].abs() > 0).any())
                                          for b in range(adv.shape[0]))),
        }

    def _train(self, seqs: Sequence[TrainSequence]) -> UpdateStats | None:
        if not seqs:
            return None
        return grpo_update(self.policy, self.optimizer, self.scheduler, seqs, self.update_cfg,
                           self.parallel)

    def _sync(self, step: int, *, force: bool = False) -> dict[str, Any]:
        """Push the adapter to every node (rank 0, remote nodes, every --sync-every steps, or
        now when ``force``)."""
        if (self.sync is None or (step % self.cfg.sync_every and not force)
                or self.state.version == 0):  # nothing trained yet: the nodes serve the base
            return {"sync_s": 0.0, "nodes_synced": 0, "nodes_skipped": 0, "synced": False}
        from gridrl.adapters import build_manifest

        start = time.perf_counter()
        files = self.policy.adapter_files()
        # No digests in the header: each push hashes its bytes while they stream (trailer).
        manifest = build_manifest(files, name=self.sync.name, version=self.state.version,
                                  base_model=self.policy.identity, hash_files=False).to_dict()
        report = self.sync.push(self.state.version, files, manifest)
        lagging = self.sync.lagging_nodes(self.state.version)
        if report.skipped or lagging:
            self.console.print(
                f"[bold red]SYNC of policy version {self.state.version}: "
                f"{len(report.skipped)} node(s) skipped[/] " + "; ".join(
                    f"{a}: {why}" for a, why in sorted(report.skipped.items()))
                + (f" [red]lagging: {', '.join(lagging)}[/]" if lagging else ""))
        return {"sync_s": time.perf_counter() - start, "nodes_synced": len(report.synced),
                "nodes_skipped": len(report.skipped), "synced": True,
                "synced_nodes": report.synced, "skipped_nodes": report.skipped,
                "lagging_nodes": lagging}

    def _evaluate(self) -> dict[str, Any]:
        result = self.evaluator.run(self.state.version)
        self._last_eval = {"eval_score": result.score, "eval_exact": result.exact,
                           "eval_policy_version": result.policy_version,
                           "eval_s": result.seconds, "eval_examples": result.examples}
        return self._last_eval

    def _checkpoint(self, step: int) -> Path:
        assert self.run_dir is not None
        return save_checkpoint(self.run_dir.checkpoints, step=step,
                               adapter_files=self.policy.adapter_files(),
                               optimizer=self.optimizer, scheduler=self.scheduler,
                               state=self.state.to_json(),
                               config=self.cfg.to_dict(), keep=self.cfg.keep_checkpoints)

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
            if self.status is not None:
                self.status.fail(f"{type(e).__name__}: {e}")
            if self.parallel is not None and self.is_main and self.parallel.world_size > 1:
                try:  # release the other ranks from their broadcast
                    self.parallel.broadcast({"error": f"{type(e).__name__}: {e}"})
                except Exception:
                    pass
            raise
        finally:
            self._close(ended)

    def _close(self, ended: bool) -> None:
        """Release the run's resources. ``ended``: no collective can be in flight, so the
        process group's threads are ended too (``DataParallel.close``)."""
        for closer in (self.prefetcher, self.sync, self.source, self.trackers):
            if closer is not None:
                try:
                    closer.close()
                except Exception:
                    log.exception("closing %r failed", closer)
        if self.parallel is not None:
            self.parallel.close(wait=ended)

    def _run_worker(self) -> None:
        """Ranks > 0: train on the broadcast sequences until rank 0 says stop."""
        while True:
            msg = self.parallel.broadcast(None)
            if "error" in msg:
                raise RuntimeError(f"rank 0 failed: {msg['error']}")
            if msg.get("stop"):
                return
            stats = self._train(msg["seqs"])
            if stats is not None:
                self.state.version = msg["version"]
                self.state.lineage[msg["version"]] = msg["step"]
            self.state.step = msg["step"]

    def _run_main(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        assert self.run_dir is not None
        if self.status is not None:
            for rec in self.run_dir.read_log():  # a resumed run's earlier steps
                if rec.get("step"):
                    self._report(rec, publish_metrics=False)
        if self.resume and self.sync is not None:  # nodes must serve the resumed weights
            sync = self._sync(st.step, force=True)
            self.console.print(f"pushed resumed weights as policy version {st.version} to "
                               f"{sync['nodes_synced']} node(s)")
        if st.baseline is None:
            base = self._evaluate()
            st.baseline = base["eval_score"]
            self.run_dir.append_log({"event": "baseline", "eval_score": st.baseline,
                                     "eval_exact": base["eval_exact"],
                                     "eval_policy_version": base["eval_policy_version"],
                                     "eval_examples": base["eval_examples"]})
            self.console.print(f"baseline eval {st.baseline:.3f} (exact "
                               f"{base['eval_exact']:.2f}, policy version 0, "
                               f"{len(self.evaluator.items)} tasks)")
        if self.status is not None:
            self.status.set_baseline(st.baseline)
        t_start = time.perf_counter() - st.elapsed_s
        for step in range(st.step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            collected = self._collect(step)
            rollout_wall = time.perf_counter() - t0
            next_version = max(st.version, max(st.lineage)) + 1
            msg = {"seqs": collected["seqs"], "step": step, "version": next_version}
            if self.parallel.world_size > 1:
                self.parallel.broadcast(msg)
            t1 = time.perf_counter()
            stats = self._train(collected["seqs"])
            train_s = time.perf_counter() - t1
            if stats is not None:
                st.version = next_version
                st.lineage[next_version] = step
                self.run_dir.record_version(next_version, step)
            else:
                self.console.print(f"[bold red]step {step}: no sample survived the staleness "
                                   f"filter ({collected['dropped']} dropped); no update[/]")
            st.step = step
            st.data_position = step * cfg.prompts_per_step
            st.dropped_total += collected["dropped"]
            sync = self._sync(step)
            evaluation = (self._evaluate() if step % cfg.eval_every == 0 or step == cfg.steps
                          else None)
            st.elapsed_s = time.perf_counter() - t_start
            flags = self._account_nodes(step, collected, stats)
            record = self._record(step, collected, stats, sync, evaluation, flags,
                                  rollout_wall=rollout_wall, train_s=train_s)
            self.run_dir.append_log(record)
            self._report(record)
            self._print_step(record)
            stopping = self._stop_reason is not None and step < cfg.steps
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
                self._checkpoint(step)
                self._plot()
            if stopping:
                return self._stop(step)
        if self.parallel.world_size > 1:
            self.parallel.broadcast({"stop": True})
        return self._finish()

    def _stop(self, step: int) -> dict[str, Any]:
        """End a run asked to stop: the checkpoint of ``step`` is written."""
        assert self.run_dir is not None
        if self.parallel.world_size > 1:
            self.parallel.broadcast({"stop": True})
        self.stopped_at = step
        message = (f"stopped after step {step} of {self.cfg.steps} ({self._stop_reason}); "
                   f"continue with: gridrl-trainer run --resume {self.run_dir.path}")
        log.warning("%s", message)
        self.console.print(f"[bold yellow]{message}[/]")
        if self.status is not None:
            self.status.fail(message)
        return {"stopped_at": step, "run_dir": str(self.run_dir.path)}

    def _account_nodes(self, step: int, collected: dict[str, Any],
                       stats: UpdateStats | None) -> dict[str, str]:
        per_node: dict[str, NodeStepStats] = collected["per_node"]
        if stats is not None:
            for (_, _, s), kl, age in zip(collected["kept"], stats.per_sequence_mismatch_kl,
                                          collected["staleness"], strict=True):
                if age == 0:
                    ns = per_node[s.node]
                    ns.fresh_kl_sum += kl * len(s.token_ids)
                    ns.fresh_tokens += len(s.token_ids)
        for node, ns in per_node.items():
            ns.low_precision = self._low_precision(node)
        if self.status is not None:  # a served run: Prometheus shows the bound beside the KL
            from gridrl.trainer import metrics

            metrics.MISMATCH_KL_BOUND.set(self.monitor.bound(per_node))
        newly = self.monitor.observe(step, per_node)
        for node, why in newly.items():
            self._flagged_ever[node] = why
            log.warning("NODE FLAGGED %s at step %d: %s", node, step, why)
            self.console.print(f"[bold white on red] NODE FLAGGED [/] [bold red]{node}[/] at step "
                               f"{step}: {why}")
        return dict(self.monitor.flagged)

    def _low_precision(self, node: str) -> bool:
        """Whether the trainer or rollout node ``node`` computes in a 16-bit float dtype."""
        if self.policy.dtype in (torch.bfloat16, torch.float16):
            return True
        state = self.pool.node(node) if self.pool is not None else None
        return state is not None and state.dtype in ("bfloat16", "float16")

    def _record(self, step: int, c: dict[str, Any], stats: UpdateStats | None,
                sync: dict[str, Any], evaluation: dict[str, Any] | None,
                flags: dict[str, str], *, rollout_wall: float, train_s: float) -> dict[str, Any]:
        ro = c["rollouts"]
        nodes = {}
        for node, ns in c["per_node"].items():
            kept = ns.samples - ns.dropped
            nodes[node] = {"samples": ns.samples, "dropped": ns.dropped,
                           "versions": sorted(ns.versions or ()),
                           "staleness_mean": ns.staleness_sum / kept if kept else None,
                           "fresh_mismatch_kl": ns.fresh_kl}
        staleness = c["staleness"]
        record: dict[str, Any] = {
            "step": step, "policy_version": self.state.version,
            "reward_mean": c["reward_mean"], "reward_std": c["reward_std"],
            "loss": stats.loss if stats else 0.0,
            "eval_score": evaluation["eval_score"] if evaluation else None,
            "eval_policy_version": evaluation["eval_policy_version"] if evaluation else 0,
            "mismatch_kl": stats.mismatch_kl if stats else 0.0,
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "dropped_samples": c["dropped"],
            "rollout_s": ro.generate_s, "train_s": train_s, "sync_s": sync["sync_s"],
            "nodes_synced": sync["nodes_synced"], "nodes_skipped": sync["nodes_skipped"],
            "tokens_per_s": c["sampled_tokens"] / ro.generate_s if ro.generate_s > 0 else 0.0,
            "elapsed_s": self.state.elapsed_s,
            # beyond StepReport
            "rollout_wait_s": ro.wait_s, "collect_s": rollout_wall,
            "staleness_max": max(staleness) if staleness else 0,
            "samples_used": len(c["seqs"]), "sampled_tokens": c["sampled_tokens"],
            "solved_fraction": c["solved"], "groups_with_signal": c["groups_with_signal"],
            "reward_funcs": c["reward_funcs"], "nodes": nodes, "flagged_nodes": flags,
            "updated": stats is not None, "data_position": self.state.data_position,
        }
        if stats is not None:
            record.update(clip_fraction=stats.clip_fraction, grad_norm=stats.grad_norm,
                          lr=stats.lr, ref_kl=stats.ref_kl, train_tokens=stats.tokens)
        if sync.get("synced"):
            record.update(synced_nodes=sync["synced_nodes"], skipped_nodes=sync["skipped_nodes"],
                          lagging_nodes=sync["lagging_nodes"])
        if evaluation:
            record.update(eval_exact=evaluation["eval_exact"], eval_s=evaluation["eval_s"],
                          eval_examples=evaluation["eval_examples"])
        return record

    def _report(self, record: dict[str, Any], publish_metrics: bool = True) -> None:
        report = {k: record.get(k) for k in STEP_REPORT_FIELDS}
        if self.status is not None:
            self.status.report(report)
        if publish_metrics:
            from gridrl.trainer import metrics

            metrics.record_step(report)

    def _print_step(self, r: dict[str, Any]) -> None:
        cfg = self.cfg
        parts = [f"step {r['step']:>4}/{cfg.steps}",
                 f"reward {r['reward_mean']:.3f}±{r['reward_std']:.2f}"]
        if r["eval_score"] is not None:
            parts.append(f"[bold green]eval {r['eval_score']:.3f}@v{r['eval_policy_version']}[/]")
        stale = f"stale {r['staleness_mean']:.1f}"
        if r["dropped_samples"]:
            stale += f" [red]dropped {r['dropped_samples']}[/]"
        parts += [stale, f"kl {r['mismatch_kl']:.1e}", f"loss {r['loss']:+.4f}"
                  + (f" gnorm {r['grad_norm']:.2f}" if r.get("grad_norm") is not None else ""),
                  f"v{r['policy_version']}"]
        if not cfg.local:
            if r.get("synced_nodes") is not None:
                n_all = r["nodes_synced"] + r["nodes_skipped"]
                color = "red" if r["nodes_skipped"] else "default"
                parts.append(f"[{color}]sync {r['sync_s']:.2f}s {r['nodes_synced']}/{n_all} "
                             f"nodes[/]")
            else:
                parts.append("sync -")
        parts.append(f"roll {r['rollout_s']:.1f}s train {r['train_s']:.1f}s "
                     f"{r['tokens_per_s']:.0f} tok/s")
        if r["flagged_nodes"]:
            parts.append(f"[bold red]FLAGGED: {', '.join(sorted(r['flagged_nodes']))}[/]")
        self.console.print(" │ ".join(parts))

    def _plot(self) -> None:
        from gridrl.trainer.plot import plot_run

        assert self.run_dir is not None
        try:
            plot_run(self.run_dir.read_log(), self.run_dir.plot, baseline=self.state.baseline,
                     title=f"{self.cfg.run_name}: {self.cfg.task} on {self.cfg.model}")
        except Exception:  # a plot must never stop training
            log.exception("plot failed")

    def _finish(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        assert self.run_dir is not None
        files = self.policy.adapter_files()
        mlx_error = None
        try:
            self.run_dir.write_final_adapter(files, self.policy.identity.num_layers)
        except Exception as e:  # the peft adapter is written first; the conversion may not apply
            mlx_error = f"{type(e).__name__}: {e}"
            log.warning("final adapter: MLX conversion failed: %s", mlx_error)
        self._plot()
        records = [r for r in self.run_dir.read_log() if r.get("step")]
        rewards = [r["reward_mean"] for r in records]
        evals = [(r["step"], r["eval_score"], r["eval_policy_version"]) for r in records
                 if r.get("eval_score") is not None]
        final = evals[-1] if evals else None
        summary = {
            "run_name": cfg.run_name, "model": cfg.model, "task": cfg.task,
            "steps": st.step, "total_steps": cfg.steps, "policy_version": st.version,
            "baseline_eval": st.baseline,
            "final_eval": final[1] if final else None,
            "final_eval_policy_version": final[2] if final else None,
            "best_eval": max((e[1] for e in evals), default=None),
            "evals": [{"step": s, "score": v, "policy_version": pv} for s, v, pv in evals],
            "reward_mean_first10": float(np.mean(rewards[:10])) if rewards else None,
            "reward_mean_last10": float(np.mean(rewards[-10:])) if rewards else None,
            "elapsed_s": st.elapsed_s,
            "seconds_per_step": st.elapsed_s / max(len(records), 1),
            "dropped_samples": st.dropped_total,
            "flagged_nodes": self._flagged_ever,
            "resumed_at": st.resumed_at,
            "rollout": "local" if cfg.local else (cfg.master or cfg.rollout),
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
            + (f"{final[1]:.3f} (policy version {final[2]})" if final else "n/a")
            + f", run directory {self.run_dir.path}")
        if self._flagged_ever:
            self.console.print("[bold red]nodes flagged during the run: " + "; ".join(
                f"{n}: {w}" for n, w in sorted(self._flagged_ever.items())) + "[/]")
        return summary
