"""Wiring a run: :func:`build_run` turns a config into a :class:`Run` of typed collaborators.

    reporter = Reporter()                      # with the console and status subscribers
    run = build_run(cfg, reporter=reporter, control=StopControl(), resume=False)
    ...                                        # gridrl.trainer.run.loop steps it
    run.close(ended=True)

What it builds, in order (every rank: the backend, the resumed checkpoint and version, by
broadcasts; rank 0 alone the rest):

1. the backend (``--backend``: model + LoRA, optimizer, schedule, data parallelism);
2. with ``--resume``, the latest checkpoint (rank 0 reads it, every rank restores it) and a
   policy version never used in the run directory (a node may hold the killed run's later
   versions);
3. rank 0: the run directory
   (``config.json``), the reporter's ``log.jsonl``, tracker, Prometheus and history
   subscribers, the node monitor, the turn sampler: ``--rollout local``
   (:class:`~gridrl.trainer.local.LocalRollout`) or the node pool with its adapter sync
   (:class:`Fleet`), after waiting for ``--min-nodes``; the episode source over it
   (:class:`~gridrl.trainer.envs.source.EpisodeSource`: every task, single-turn included, is
   run as episodes), the evaluator, probation, and the step sampler (prompts and episodes,
   ``--async-steps`` ahead).

The environment (``--task``), the rewards (the environment's own, or ``--reward-file``) and
the eval's scorer (``--eval-reward-file``) are made first, before the model loads: a missing
extra, an unknown dataset, a broken file or a reward function that cannot run on the task's
rows fails in one line (:func:`gridrl.trainer.preflight.build_rewards`; the CLI's pre-flight
check makes them too, before its server binds).

A failure closes what was built and tells the other ranks (they fail too). The loop
(:mod:`gridrl.trainer.run.loop`) holds no collaborator this module did not build.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from gridrl.common.errors import invalid_argument
from gridrl.common.rpc.channel import Keepalive
from gridrl.common.rpc.server import freeze_long_lived
from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.backends.base import TrainerBackend, create_backend
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.envs.base import Environment
from gridrl.trainer.envs.source import EpisodeSource, TurnSampler
from gridrl.trainer.evaluation import Evaluator
from gridrl.trainer.fleet.hedging import HedgePolicy
from gridrl.trainer.fleet.membership import Membership
from gridrl.trainer.fleet.monitor import NodeMonitor
from gridrl.trainer.fleet.nodes import NodeFlags
from gridrl.trainer.fleet.pool import NodePool, NodeWait
from gridrl.trainer.fleet.probation import Probation, Review, fresh_mismatch_kl
from gridrl.trainer.fleet.sync import AdapterSync
from gridrl.trainer.local import LocalRollout
from gridrl.trainer.preflight import build_rewards
from gridrl.trainer.report import trackers
from gridrl.trainer.report.events import (
    NodeReviewed,
    NodesReady,
    NodeWaitChanged,
    RunResumed,
)
from gridrl.trainer.report.metrics import PrometheusSubscriber
from gridrl.trainer.report.reporter import HISTORY, LOG, METRICS, TRACKERS, Reporter
from gridrl.trainer.report.summary import RunHistory
from gridrl.trainer.rewards import EvalScorer, RewardSet
from gridrl.trainer.run.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint
from gridrl.trainer.run.control import StopControl
from gridrl.trainer.run.ranks import send_error
from gridrl.trainer.run.rundir import LogFile, RunDir
from gridrl.trainer.run.state import TrainerState
from gridrl.trainer.run.steps import StepPrompts, StepSampler

log = logging.getLogger(__name__)

# A turn sampler built from the loaded backend and the trainer's current policy version
# (embedding the trainer in another program, tests: nothing is pushed to it).
SourceFactory = Callable[[TrainerBackend, Callable[[], int]], TurnSampler]


@dataclass
class Fleet:
    """The remote rollout nodes of a run (rank 0, not ``--rollout local``).

    Attributes:
        pool: the nodes, their rotation and flags; the rollout source.
        sync: adapter pushes (every ``--sync-every`` steps, catch-ups).
        probation: the thread that brings flagged nodes back.
    """

    pool: NodePool
    sync: AdapterSync
    probation: Probation


@dataclass
class Main:
    """What rank 0 alone holds.

    Attributes:
        run_dir: the run directory.
        env, rewards: the environment (``--task``) and the run's reward functions.
        evaluator: the held-out eval on the trainer's own weights.
        monitor: judges each node's samples (staleness, mismatch) and flags nodes.
        flags: the flags' one owner: the pool's membership, or (no pool) a membership of no
            node, where flags are only recorded.
        sampler: each step's prompts and rollouts (sampled up to ``--async-steps`` ahead).
        history: the run's records in memory (plot, summary).
        fleet: the remote nodes, or None (``--rollout local`` or a given source).
    """

    run_dir: RunDir
    env: Environment
    rewards: RewardSet
    evaluator: Evaluator
    monitor: NodeMonitor
    flags: NodeFlags
    sampler: StepSampler
    history: RunHistory
    fleet: Fleet | None


@dataclass
class Run:
    """One training run, wired (see the module docstring).

    Attributes:
        cfg: the finalized settings.
        backend: the model side.
        state: step, policy version, lineage (what a checkpoint restores).
        control: the stop request.
        reporter: where records and events go (rank 0's subscribers).
        resumed: the checkpoint the run continues from, or None.
        main: rank 0's collaborators; None on the other ranks.
        backend_lock: held around every backend call the loop makes while other threads run
            (probation scores with the backend: :class:`TrainerBackend` calls never overlap).
        closing: closes what the run started (probation, sampler, sync, pool or source),
            the last started first.
    """

    cfg: TrainConfig
    backend: TrainerBackend
    state: TrainerState
    control: StopControl
    reporter: Reporter
    resumed: Checkpoint | None
    main: Main | None
    backend_lock: threading.Lock
    closing: contextlib.ExitStack

    @property
    def is_main(self) -> bool:
        """Rank 0 (samples, scores, syncs, evaluates, checkpoints, writes)."""
        return self.main is not None

    def low_precision(self, node: str) -> bool:
        """Whether the trainer or rollout node ``node`` computes in a 16-bit float dtype."""
        if self.backend.low_precision:
            return True
        fleet = self.main.fleet if self.main is not None else None
        state = fleet.pool.node(node) if fleet is not None else None
        return state is not None and state.dtype in ("bfloat16", "float16")

    def close(self, ended: bool) -> None:
        """Release the run's threads, connections and the backend. ``ended``: every rank is
        past its last collective, so the process group's threads end too
        (:meth:`TrainerBackend.close`)."""
        try:
            self.closing.close()
        finally:
            self.backend.close(wait=ended)


def build_run(cfg: TrainConfig, *, reporter: Reporter, control: StopControl,
              resume: bool = False, source: SourceFactory | None = None,
              freeze_gc: bool = False) -> Run:
    """Wire the run of ``cfg`` (see the module docstring); rank 0 adds its subscribers to
    ``reporter``.

    Args:
        cfg: the finalized config (``TrainConfig.finalize``).
        reporter: the run's reporter (the caller's console and status subscribers in it).
        control: the stop request (a stop during the node wait ends the wait).
        resume: continue from ``cfg.run_dir``'s latest checkpoint.
        source: a rollout source to sample from instead of the configured ones.
        freeze_gc: ``gc.freeze()`` once set up (the CLI's choice for a whole process).
    Raises:
        StatusError: bad configuration (``--prompts-per-step`` smaller than the ranks,
            ``--resume`` without a checkpoint, a tracker that cannot start);
        TimeoutError: fewer than ``--min-nodes`` nodes in rotation within ``--start-wait-s``.
    """
    trackers.require(cfg.report_to)  # a missing package fails before the model loads
    env = cfg.environment()  # so does a --task naming a missing extra or a broken file
    rewards, scorer = build_rewards(cfg, env)  # and a reward function that cannot run
    # seeds every RNG, loads the model + LoRA, builds the optimizer and the schedule, and
    # joins data parallelism (torch: DDP under torchrun)
    backend = create_backend(cfg)
    closing = contextlib.ExitStack()
    try:
        run_dir = RunDir(cfg.run_dir or ".") if backend.rank == 0 else None
        state, resumed = TrainerState(), None
        if resume:
            resumed = _restore(backend, run_dir)
            state = TrainerState.from_json(resumed.state)
            control.checkpointed = state.step
        control.state = state
        if backend.world_size > cfg.prompts_per_step:
            raise invalid_argument("--prompts-per-step", f"{cfg.prompts_per_step} groups cannot "
                                   f"be shared by {backend.world_size} ranks")
        if resumed is not None:
            _begin_resumed(backend, state, run_dir, resumed, reporter)
        run = Run(cfg=cfg, backend=backend, state=state, control=control, reporter=reporter,
                  resumed=resumed, main=None, backend_lock=threading.Lock(), closing=closing)
        if run_dir is not None:
            run.main = _build_main(run, run_dir, env, (rewards, scorer), source)
        if freeze_gc:
            freeze_long_lived()  # the policy lives as long as the run: no 200 ms collections
        return run
    except BaseException as e:
        send_error(backend, e)
        try:
            closing.close()
        finally:
            backend.close(wait=False)
        raise


def _restore(backend: TrainerBackend, run_dir: RunDir | None) -> Checkpoint:
    """Rank 0 reads the latest checkpoint and broadcasts it; every rank restores it."""
    ckpt = None
    if run_dir is not None:
        path = latest_checkpoint(run_dir.checkpoints)
        if path is None:
            raise invalid_argument("--resume", f"{run_dir.path} has no checkpoint")
        ckpt = load_checkpoint(path)
    ckpt = backend.broadcast(ckpt)
    assert ckpt is not None
    backend.restore_checkpoint(ckpt.files)
    return ckpt


def _begin_resumed(backend: TrainerBackend, state: TrainerState, run_dir: RunDir | None,
                   ckpt: Checkpoint, reporter: Reporter) -> None:
    """Give the resumed weights a version never used in this run directory (a node may hold
    the killed run's later versions), and forget log records past the checkpoint."""
    state.resumed_at.append(state.step)
    removed, new_version = 0, 0
    if run_dir is not None:
        removed = run_dir.truncate_log(state.step)
        new_version = max(run_dir.max_version(), state.version) + 1
    new_version = backend.broadcast(new_version)
    state.adopt(new_version, state.step)
    if run_dir is not None:
        run_dir.record_version(new_version, state.step)
        log.info("resumed %s at step %d (checkpoint %s); %d later log record(s) dropped; "
                 "policy version %d", run_dir.path, state.step, ckpt.path.name, removed,
                 new_version)
        reporter.event(RunResumed(step=state.step, checkpoint=ckpt.path,
                                  policy_version=new_version, dropped_records=removed))


def _build_main(run: Run, run_dir: RunDir, env: Environment,
                scoring: tuple[RewardSet, EvalScorer], source: SourceFactory | None) -> Main:
    """Rank 0's collaborators (see the module docstring)."""
    cfg, backend, reporter = run.cfg, run.backend, run.reporter
    rewards, scorer = scoring
    cfg.save(run_dir.config)
    history = RunHistory(run_dir.plot, title=f"{cfg.run_name}: {cfg.task} on {cfg.model}",
                         eval_scorer=scorer.name)
    opened = trackers.open_trackers(cfg, resumed_at=run.state.step if run.resumed else None)
    reporter.subscribe(LogFile(run_dir), essential=True, order=LOG)
    reporter.subscribe(trackers.TrackerSubscriber(opened), order=TRACKERS)
    reporter.subscribe(PrometheusSubscriber(), order=METRICS)
    reporter.subscribe(history, order=HISTORY)
    monitor = NodeMonitor(max_staleness=cfg.staleness_bound, mismatch_kl_max=cfg.mismatch_kl_max,
                          mismatch_kl_max_16bit=cfg.mismatch_kl_max_16bit,
                          flag_after=cfg.flag_after)

    def version() -> int:
        return run.state.version

    pool: tuple[NodePool, AdapterSync] | None = None
    flags: NodeFlags = Membership(backend.identity)  # no pool: flags are only recorded
    if source is not None:
        turns: TurnSampler = source(backend, version)
        run.closing.callback(turns.close)
    elif cfg.local:
        turns = LocalRollout(backend, version)
    else:
        pool = _build_pool(run)
        turns = flags = pool[0]
    limits = cfg.episode_limits(env)
    episodes = EpisodeSource(env, backend.tokenizer, turns, limits)  # env.prepare(tokenizer)
    # --eval-tasks: the built-in environments make that many held-out items (a JSONL
    # --eval-file: all its rows); a user's Python file makes its own set, cut to the flag
    evaluator = Evaluator(backend, env, max_tokens=limits.max_tokens, scorer=scorer,
                          limits=limits,
                          eval_tasks=cfg.eval_tasks if cfg.task.endswith(".py") else None)
    prompts = StepPrompts(cfg, episodes)
    fleet = None
    if pool is not None:
        fleet = Fleet(pool=pool[0], sync=pool[1],
                      probation=_build_probation(run, pool, monitor, prompts.of(1)[1][0]))
    sampler = StepSampler(cfg, prompts, episodes)
    run.closing.callback(sampler.close)
    return Main(run_dir=run_dir, env=env, rewards=rewards, evaluator=evaluator,
                monitor=monitor, flags=flags, sampler=sampler, history=history, fleet=fleet)


def _build_pool(run: Run) -> tuple[NodePool, AdapterSync]:
    """The node pool (started, ``--min-nodes`` waited for) and the adapter sync."""
    cfg, backend, reporter, control = run.cfg, run.backend, run.reporter, run.control

    def on_wait(wait: NodeWait | None) -> None:
        reporter.event(NodeWaitChanged(wait, stopping=control.stop_requested))

    pool = NodePool(master=cfg.master, addresses=list(cfg.rollout),
                    model_identity=backend.identity, security=cfg.security,
                    request_timeout_s=cfg.request_timeout_s,
                    wait_for_nodes_s=cfg.wait_for_nodes_s, on_wait=on_wait,
                    hedge=HedgePolicy(cfg.hedge_after, cfg.hedge_min_s),
                    keepalive=Keepalive(cfg.keepalive_s, cfg.keepalive_timeout_s))
    pool.share_weight = cfg.share_weight
    run.closing.callback(pool.close)
    pool.start()
    sync = AdapterSync(pool, name=cfg.run_name or "gridrl", base_model=backend.identity,
                       deadline_s=cfg.sync_deadline_s, known_versions=lambda: run.state.lineage,
                       relay=cfg.relay)
    run.closing.callback(sync.close)
    nodes = pool.wait_for_nodes(cfg.min_nodes, cfg.node_wait_s,
                                stop=lambda: control.stop_requested)
    if not control.stop_requested:  # else the wait ended because the run stops
        reporter.event(NodesReady(tuple(nodes)))
    return pool, sync


def _build_probation(run: Run, pool: tuple[NodePool, AdapterSync], monitor: NodeMonitor,
                     check_prompt: list[int]) -> Probation:
    """Probation of flagged nodes (started); its check group samples ``check_prompt``, the
    first training prompt."""
    cfg, backend, reporter = run.cfg, run.backend, run.reporter

    def on_review(review: Review) -> None:
        reporter.event(NodeReviewed(review))

    probation = Probation(
        pool[0], pool[1], on_review=on_review,
        check_kl=lambda prompt, samples: fresh_mismatch_kl(backend, prompt, samples,
                                                           lock=run.backend_lock),
        current_version=lambda: run.state.version,
        bound=lambda node: monitor.bound_for(run.low_precision(node)),
        prompt=check_prompt,
        sampling=SamplingConfig(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k),
        group_size=cfg.group_size)
    probation.start()
    run.closing.callback(probation.close)
    return probation
