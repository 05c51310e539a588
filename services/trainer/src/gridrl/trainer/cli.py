"""``gridrl-trainer``: ``run`` (GRPO training with TrainerService) and ``status`` (a client).

Every flag has a ``GRIDRL_TRAINER_<FLAG>`` environment variable. torch is imported only inside
``run`` so ``--help`` is instant.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click

from gridrl.common.cli import (
    client_security_options,
    env_option,
    exit_on_rpc_error,
    print_json,
    server_options,
    setup_logging,
    write_ready_file,
)

log = logging.getLogger("gridrl.trainer")


def _opt(flag: str, *names: str, **kw: Any):
    """A flag with the environment variable ``GRIDRL_TRAINER_<FLAG>``."""
    env = "GRIDRL_TRAINER_" + flag.lstrip("-").split("/")[0].replace("-", "_").upper()
    return env_option(flag, *names, env=env, **kw)


_ALL_OPTIONS = [
    # model and task
    _opt("--model", default="smollm2-135m-instruct",
         help="Base model: alias, local Hugging Face directory or hub id (needs a chat "
              "template)."),
    _opt("--task", default="reverse-words",
         help="'reverse-words' or a JSONL file with prompt/answer columns."),
    _opt("--min-words", type=int, default=3, help="reverse-words: fewest words per phrase."),
    _opt("--max-words", type=int, default=6, help="reverse-words: most words per phrase."),
    _opt("--system-prompt", default=None, show_default=False,
         help="System message (default: the task's own; reverse-words has one with a worked "
              "example)."),
    _opt("--prompt-column", default="prompt", help="JSONL task: the prompt column."),
    _opt("--answer-column", default="answer", help="JSONL task: the answer column."),
    _opt("--eval-file", default=None, show_default=False,
         help="JSONL task: held-out eval rows (default: --eval-tasks rows held out of --task)."),
    _opt("--reward-file", "reward_files", multiple=True,
         help="Python file of TRL-signature reward functions f(prompts, completions, "
              "**columns) -> list[float] (repeatable; replaces the task's score)."),
    _opt("--reward-weights", default=None, show_default=False,
         help="Comma-separated weight per reward function (default: all 1)."),
    # GRPO
    _opt("--steps", type=int, default=60, help="GRPO steps (optimizer updates)."),
    _opt("--prompts-per-step", type=int, default=1, help="B: prompts (groups) per step."),
    _opt("--group-size", type=int, default=8, help="G: completions per prompt."),
    _opt("--max-tokens", type=int, default=40, help="New tokens per completion (and eval)."),
    _opt("--temperature", type=float, default=1.0,
         help="Sampling temperature; the trainer's logprobs use logits / temperature too."),
    _opt("--top-p", type=float, default=1.0, help="Nucleus sampling mass."),
    _opt("--top-k", type=int, default=0, help="Top-k sampling (0: off)."),
    _opt("--scale-rewards/--no-scale-rewards", default=True,
         help="Divide advantages by the group's reward std (GRPO) or not (Dr. GRPO)."),
    _opt("--advantage-eps", type=float, default=1e-4, help="Added to the std before dividing."),
    _opt("--clip-eps", type=float, default=0.2, help="PPO clip range (lower side)."),
    _opt("--clip-eps-high", type=float, default=None, show_default=False,
         help="Upper clip range (DAPO clip-higher; default: --clip-eps)."),
    _opt("--kl-beta", type=float, default=0.0,
         help="Coefficient of the k3 KL to the reference (base) policy; 0: off."),
    _opt("--loss-aggregation", type=click.Choice(["sequence", "token", "constant"]),
         default="sequence",
         help="sequence: mean per sequence then mean (GRPO); token: over all tokens (DAPO); "
              "constant: / (N * max_tokens) (Dr. GRPO)."),
    _opt("--micro-batch-size", type=int, default=0,
         help="Sequences per forward/backward (0: all of a step at once)."),
    # optimiser
    _opt("--lr", type=float, default=1e-4, help="AdamW learning rate."),
    _opt("--weight-decay", type=float, default=0.0, help="AdamW weight decay."),
    _opt("--lr-schedule", type=click.Choice(["constant", "linear", "cosine"]),
         default="constant", help="Learning-rate schedule after warmup."),
    _opt("--warmup-steps", type=int, default=0, help="Linear warmup steps."),
    _opt("--max-grad-norm", type=float, default=1.0, help="Gradient clipping (0: off)."),
    # LoRA
    _opt("--lora-rank", type=int, default=16, help="LoRA rank r."),
    _opt("--lora-alpha", type=float, default=32.0, help="LoRA alpha."),
    _opt("--lora-dropout", type=float, default=0.0, help="LoRA dropout."),
    _opt("--lora-target-modules", default="all-linear",
         help="'all-linear' or comma-separated module names (q_proj,v_proj)."),
    _opt("--rslora/--no-rslora", default=False, help="Rank-stabilised LoRA scaling."),
    # rollouts and sync
    _opt("--master", default=None, show_default=False,
         help="Master host:port: use the rollout nodes it registers (WatchNodes)."),
    _opt("--rollout", "rollout", multiple=True,
         help="Rollout node host:port (repeatable), or 'local' to sample in-process "
              "(default when no --master)."),
    _opt("--sync-every", type=int, default=1, help="Push the adapter to every node every N "
                                                   "steps."),
    _opt("--max-staleness", type=int, default=None, show_default=False,
         help="Drop samples more than this many versions behind the trainer (default: "
              "(sync-every - 1) + async-steps)."),
    _opt("--async-steps", type=int, default=0,
         help="Sample the next K steps' rollouts while the current step trains."),
    _opt("--mismatch-kl-max", type=float, default=0.01,
         help="Flag a node whose samples of the trainer's own version disagree with the "
              "trainer's logprobs by more than this KL (nats/token)."),
    _opt("--mismatch-kl-max-16bit", type=float, default=0.1,
         help="--mismatch-kl-max for a bf16/fp16 node or trainer (its rounding: ~1e-2)."),
    _opt("--flag-after", type=int, default=2,
         help="Consecutive stale or mismatched steps that flag a node."),
    _opt("--min-nodes", type=int, default=1, help="Rollout nodes to wait for before step 1."),
    _opt("--node-wait-s", type=float, default=120.0, help="Seconds to wait for them."),
    _opt("--request-timeout-s", type=float, default=120.0, help="Deadline of one Generate."),
    _opt("--sync-deadline-s", type=float, default=30.0, help="Deadline of one node's push."),
    # eval, checkpoints, run directory
    _opt("--eval-every", type=int, default=10, help="Held-out greedy eval every N steps."),
    _opt("--eval-tasks", type=int, default=16, help="Held-out eval prompts."),
    _opt("--checkpoint-every", type=int, default=10, help="Checkpoint every K steps."),
    _opt("--keep-checkpoints", type=int, default=2, help="Checkpoints kept."),
    _opt("--seed", type=int, default=0, help="Seed of data order, sampling and LoRA init."),
    _opt("--run-dir", default=None, show_default=False,
         help="Run directory (default: runs/<run-name>)."),
    _opt("--run-name", default=None, show_default=False,
         help="Run name, also the adapter name on nodes (default: grpo-<time>)."),
    _opt("--resume", default=None, show_default=False, type=click.Path(file_okay=False),
         help="Continue the run in this directory from its latest checkpoint."),
    _opt("--device", default="auto", help="auto, cpu, cuda, cuda:1..."),
    _opt("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, "
                                         "bfloat16."),
    _opt("--report-to", default="none",
         help="Experiment trackers for the per-step metrics, comma-separated: tensorboard, "
              "wandb, trackio (optional extras: pip install 'gridrl-trainer[wandb]'...), or "
              "none. TRL's metric names (train/reward, eval/reward...)."),
    _opt("--threads", type=click.IntRange(min=0), default=0,
         help="torch intra-op CPU threads (0: torch's default, one per core). On a machine "
              "shared with rollout nodes, give each process its share."),
]


def _options(f: Any) -> Any:
    for option in reversed(_ALL_OPTIONS):
        f = option(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """gridrl trainer: GRPO on a LoRA adapter with rollouts from a pool of nodes."""


def build_config(ctx: click.Context, params: dict[str, Any]) -> tuple[Any, bool]:
    """The run's :class:`TrainConfig` from the flags; with ``--resume`` the saved config, with
    the explicitly given operational flags (``RESUME_OVERRIDABLE``) applied over it."""
    from click.core import ParameterSource

    from gridrl.trainer.config import RESUME_OVERRIDABLE, TrainConfig

    values = {k: v for k, v in params.items() if k in TrainConfig.__dataclass_fields__}
    values["reward_files"] = list(params.get("reward_files") or [])
    values["rollout"] = list(params.get("rollout") or [])
    resume = params.get("resume")
    if not resume:
        return TrainConfig(**values).finalize(), False
    saved = Path(resume) / "config.json"
    if not saved.is_file():
        from gridrl.common.errors import invalid_argument

        raise invalid_argument("--resume", f"{resume} has no config.json")
    cfg = TrainConfig.load(saved)
    ignored = []
    for name, value in values.items():
        source = ctx.get_parameter_source(name)
        if source not in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            continue
        if name in RESUME_OVERRIDABLE:
            setattr(cfg, name, value)
        elif value != getattr(cfg, name):
            ignored.append(name)
    if ignored:
        click.echo(f"--resume: keeping the saved {', '.join(sorted(ignored))} (they shape the "
                   "learning); flags given for them are ignored", err=True)
    cfg.run_dir = str(resume)
    return cfg.finalize(), True


@main.command()
@_options
@server_options("trainer", listen="127.0.0.1:50052", metrics_port=9402, client=True)
@click.pass_context
def run(ctx: click.Context, listen: str, metrics_port: int, security: Any,
        log_level: str, ready_file: str | None, **params: Any) -> None:
    """Train: rollouts -> rewards -> GRPO update -> adapter sync, with held-out evals,
    checkpoints and a run directory. Serves TrainerService (GetRunStatus, WatchRun) and
    Prometheus metrics while it runs. SIGTERM / Ctrl-C: finish the step, checkpoint it, exit
    143 (continue with --resume); a second signal exits at once."""
    from gridrl.common.errors import StatusError

    setup_logging(log_level)
    params.update(listen=listen, metrics_port=metrics_port, log_level=log_level)
    try:
        cfg, resume = build_config(ctx, params)
    except StatusError as e:
        raise click.UsageError(e.message) from None
    cfg.security = security  # from this start's flags; never saved with the run

    import os

    from gridrl.trainer.loop import Trainer

    rank = int(os.environ.get("RANK", "0"))
    status = server = None
    if rank == 0:
        from gridrl.trainer.server import serve_trainer
        from gridrl.trainer.status import RunStatus

        status = RunStatus()
        try:
            server = serve_trainer(status, cfg.listen, cfg.metrics_port, security)
        except (OSError, ValueError) as e:  # port taken; a resumed run's saved --listen
            raise click.UsageError(str(e)) from None  # exposed without TLS and credentials
        write_ready_file(ready_file, server.address, server.port, server.metrics_port)
        click.echo(f"TrainerService on {server.address} (metrics port {server.metrics_port}); "
                   f"run directory {cfg.run_dir}")
    try:
        trainer = Trainer(cfg, resume=resume, status=status, freeze_gc=True)

        def stop(signum: int, _frame: Any) -> None:  # first signal: finish the step, checkpoint
            signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
            trainer.request_stop(signal.Signals(signum).name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        trainer.run()
        if trainer.stopped_at is not None:
            sys.exit(143)
    except StatusError as e:
        click.echo(f"error: {e.message}", err=True)
        _discard_unstarted_run_dir(cfg.run_dir, resume)
        sys.exit(2)
    except (RuntimeError, TimeoutError) as e:
        log.error("run failed: %s", e)
        _discard_unstarted_run_dir(cfg.run_dir, resume)
        sys.exit(1)
    finally:
        if server is not None:
            server.stop(grace_s=1.0)


def _discard_unstarted_run_dir(run_dir: str | None, resume: bool) -> None:
    """Remove the directory of a new run that failed before recording anything (it holds only
    its config.json), so failed starts do not litter ``runs/``."""
    if resume or not run_dir:
        return
    path = Path(run_dir)
    if path.is_dir() and {p.name for p in path.iterdir()} <= {"config.json"}:
        (path / "config.json").unlink(missing_ok=True)
        path.rmdir()


@main.command()
@env_option("--address", env="GRIDRL_TRAINER_ADDRESS", default="127.0.0.1:50052",
            help="TrainerService host:port.")
@env_option("--json", "as_json", env="GRIDRL_TRAINER_JSON", is_flag=True, default=False,
            help="Print the GetRunStatus response as JSON.")
@env_option("--timeout-s", env="GRIDRL_TRAINER_TIMEOUT_S", type=float, default=10.0,
            help="Call deadline.")
@client_security_options
@exit_on_rpc_error
def status(address: str, as_json: bool, timeout_s: float, security: Any) -> None:
    """Show a running trainer's state and its last step report."""
    from gridrl.common.channel import dial
    from gridrl.v1 import trainer_pb2, trainer_pb2_grpc

    with dial(address, security) as channel:
        response = trainer_pb2_grpc.TrainerServiceStub(channel).GetRunStatus(
            trainer_pb2.GetRunStatusRequest(), timeout=timeout_s)
    if as_json:
        print_json(response)
        return
    from rich.console import Console
    from rich.table import Table

    state = trainer_pb2.RunState.Name(response.state).removeprefix("RUN_STATE_").lower()
    r = response.last_report
    table = Table(show_header=False, box=None)
    rows = [
        ("run", f"{response.run_name} ({state})"), ("run dir", response.run_dir),
        ("model", response.model_id),
        ("step", f"{response.step}/{response.total_steps}"),
        ("policy version", str(response.policy_version)),
        ("baseline eval", f"{response.baseline_eval:.3f}"
         if response.HasField("baseline_eval") else "-"),
    ]
    if response.step:
        rows += [
            ("reward", f"{r.reward_mean:.3f} ± {r.reward_std:.3f}"),
            ("eval", f"{r.eval_score:.3f} (policy version {r.eval_policy_version})"
             if r.HasField("eval_score") else "-"),
            ("loss", f"{r.loss:+.4f}"), ("mismatch KL", f"{r.mismatch_kl:.2e}"),
            ("staleness", f"{r.staleness_mean:.2f} (dropped {r.dropped_samples})"),
            ("sync", f"{r.sync_s:.2f}s, {r.nodes_synced} synced, {r.nodes_skipped} skipped"),
            ("time", f"rollout {r.rollout_s:.1f}s, train {r.train_s:.1f}s, "
                     f"{r.tokens_per_s:.0f} tok/s, elapsed {r.elapsed_s:.0f}s"),
        ]
    if response.error:
        rows.append(("error", response.error))
    for k, v in rows:
        table.add_row(f"[bold]{k}[/]", v)
    Console().print(table)


if __name__ == "__main__":
    main()
