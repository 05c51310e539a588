"""``gridrl-trainer``: ``run`` (GRPO training with TrainerService) and ``status`` (a client).

Each command imports its own machinery inside it (``run``: the input checks, the run, the
server; ``status``: its client and table), so ``--help`` and one command do not load the
other's.

The flags of ``run`` are generated from the settings declared in ``config.py``
(:func:`gridrl.trainer.config.click_options`; each with its ``GRIDRL_TRAINER_<FLAG>``
environment variable); the server flags come from ``gridrl.common.cli.server_options``. torch is
imported only inside ``run`` so ``--help`` is instant.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from gridrl.common.address import parse_listen
from gridrl.common.cli import (
    address_option,
    client_security_options,
    env_option,
    exit_on_rpc_error,
    print_json,
    renamed_option,
    server_options,
    setup_logging,
    write_ready_file,
)
from gridrl.common.errors import StatusError, invalid_argument
from gridrl.trainer.config import RESUME_OVERRIDABLE, TrainConfig, click_options, default_of
from gridrl.trainer.run.control import StopControl

log = logging.getLogger("gridrl.trainer")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """gridrl trainer: GRPO on a LoRA adapter with rollouts from a pool of nodes."""


def build_config(ctx: click.Context, params: dict[str, Any]) -> tuple[Any, bool]:
    """The run's :class:`TrainConfig` from the flags; with ``--resume`` the saved config, with
    the explicitly given operational flags (``RESUME_OVERRIDABLE``) applied over it."""
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()
              if k in TrainConfig.__dataclass_fields__}
    resume = params.get("resume")
    if not resume:
        return TrainConfig(**values).finalize(), False
    saved = Path(resume) / "config.json"
    if not saved.is_file():
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
@click_options
@renamed_option("--node-wait-s", "node_wait_s", env="GRIDRL_TRAINER_NODE_WAIT_S", type=float)
@renamed_option("--wait-for-nodes-s", "wait_for_nodes_s", env="GRIDRL_TRAINER_WAIT_FOR_NODES_S",
                type=float)
@env_option("--resume", env="GRIDRL_TRAINER_RESUME", default=None, show_default=False,
            type=click.Path(file_okay=False),
            help="Continue the run in this directory from its latest checkpoint.")
@server_options("trainer", listen=default_of("listen"), metrics_port=default_of("metrics_port"),
                client=True)
@click.pass_context
def run(ctx: click.Context, listen: str, metrics_port: int, security: Any,
        log_level: str, ready_file: str | None, **params: Any) -> None:
    """Train: rollouts -> rewards -> GRPO update -> adapter sync, with held-out evals,
    checkpoints and a run directory. Serves TrainerService (GetRunStatus, WatchRun) and
    Prometheus metrics while it runs. Ctrl-C / SIGTERM: finish the step, checkpoint it, exit
    130 / 143 (continue with --resume); a second one aborts at once, losing the steps since
    the last checkpoint. A run that fails checkpoints the steps it finished, then exits 1."""
    setup_logging(log_level)
    # Before torch loads OpenMP (as a node does, gridrl.rollout.launch): idle workers spin
    # ~10k iterations, then sleep, instead of holding a core another process could use.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    params.update(listen=listen, metrics_port=metrics_port, log_level=log_level)
    try:
        cfg, resume = build_config(ctx, params)
    except StatusError as e:
        raise click.UsageError(e.message) from None
    cfg.security = security  # from this start's flags; never saved with the run
    if not resume and cfg.run_dir:
        from gridrl.trainer.run.rundir import earlier_run

        held = earlier_run(cfg.run_dir)
        if held:  # a second run there would mix its log, checkpoints and versions with it
            raise click.UsageError(
                f"--run-dir: {cfg.run_dir} already holds a run ({held}); continue it with "
                f"--resume {cfg.run_dir}, or start a new one with another --run-name or "
                "--run-dir")
    from gridrl.trainer.preflight import check_inputs  # the model names, reflection probes

    try:  # a typo costs a line, not a model load (before the server binds, too)
        check_inputs(cfg)
    except StatusError as e:
        raise click.UsageError(e.message) from None

    # the run's machinery (node pool, reporter, gRPC server: grpc, numpy, prometheus): imported
    # by `run` only, so --help and `status` stay quick
    from gridrl.trainer.run.driver import train

    rank = int(os.environ.get("RANK", "0"))
    status = server = None
    if rank == 0:
        from gridrl.trainer.report.status import RunStatus
        from gridrl.trainer.server import serve_trainer

        status = RunStatus()
        try:
            server = serve_trainer(status, cfg.listen, cfg.metrics_port, security)
        except (OSError, ValueError) as e:  # port taken; a resumed run's saved --listen
            raise click.UsageError(str(e)) from None  # exposed without TLS and credentials
        write_ready_file(ready_file, server.address, server.port, server.metrics_port)
        metrics = (f"metrics port {server.metrics_port}" if server.metrics_port >= 0
                   else "metrics off")
        click.echo(f"TrainerService on {server.address} ({metrics}); "
                   f"run directory {cfg.run_dir}")
    listing = None
    if server is not None and cfg.master:  # gridrl-master nodes --role trainer lists it
        from gridrl.trainer.fleet.listing import register_trainer

        listing = register_trainer(cfg.master, server.address, status, cfg.model, security)
    control = StopControl()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: _on_stop_signal(control, cfg.run_dir, signum))
    try:
        result = train(cfg, resume=resume, status=status, control=control, freeze_gc=True,
                       address=server.address if server is not None else "")
        if result.stopped_at is not None:
            _discard_unstarted_run_dir(cfg.run_dir, resume)  # stopped before recording any
            sys.exit(exit_code(control.reason))
    except StatusError as e:
        click.echo(f"error: {e.message}", err=True)
        _discard_unstarted_run_dir(cfg.run_dir, resume)
        sys.exit(2)
    except (RuntimeError, TimeoutError) as e:
        log.error("run failed: %s", e)
        _discard_unstarted_run_dir(cfg.run_dir, resume)
        sys.exit(1)
    finally:
        if listing is not None:
            listing.stop(deregister=True)
        if server is not None:
            server.stop(grace_s=1.0)


@main.command("serve-api")
@env_option("--model", env="GRIDRL_TRAINER_MODEL", default=default_of("model"),
            help="Base model the rollout nodes serve (alias, directory or hub id); training "
                 "models may use others, sampled on the trainer.")
@address_option("--rollout", env="GRIDRL_TRAINER_ROLLOUT", multiple=True, default=(),
                help="Rollout node host:port (repeatable); none and no --master: the trainer "
                     "samples.")
@address_option("--master", env="GRIDRL_TRAINER_MASTER", default=None, show_default=False,
                help="Master host:port to find rollout nodes.")
@env_option("--http-listen", env="GRIDRL_TRAINER_HTTP_LISTEN", default="127.0.0.1:8100",
            help="host:port of the Tinker-compatible REST API (TINKER_BASE_URL); port 0: any.")
@env_option("--api-dir", env="GRIDRL_TRAINER_API_DIR", default="runs/api",
            type=click.Path(file_okay=False),
            help="Where saved states and sampler weights go (peft and mlx-lm directories).")
@env_option("--lora-alpha", env="GRIDRL_TRAINER_LORA_ALPHA", type=float, default=32.0,
            help="LoRA alpha of every training model (the update is scaled by alpha / rank).")
@env_option("--seed", env="GRIDRL_TRAINER_SEED", type=int, default=0,
            help="Seed of adapters created without one.")
@env_option("--max-models", env="GRIDRL_TRAINER_MAX_MODELS", type=int, default=4,
            help="Training models open at once (each holds a copy of its base model).")
@env_option("--backend", env="GRIDRL_TRAINER_BACKEND", default="torch",
            type=click.Choice(["torch", "mlx"]),
            help="Framework that holds the training models: torch (peft) or mlx (mlx-lm; "
                 "Apple Silicon, or Linux CPU through mlx[cpu]).")
@env_option("--device", env="GRIDRL_TRAINER_DEVICE", default="auto",
            help="auto, cpu, cuda, cuda:1, mps (torch); auto, cpu, gpu (mlx).")
@env_option("--dtype", env="GRIDRL_TRAINER_DTYPE", default="auto",
            type=click.Choice(["auto", "float32", "bfloat16"]),
            help="Base weights' dtype (auto: float32 on CPU, bfloat16 on CUDA).")
@env_option("--threads", env="GRIDRL_TRAINER_THREADS", type=int, default=0,
            help="CPU threads of torch (0: torch's default).")
@env_option("--session-timeout-s", env="GRIDRL_TRAINER_SESSION_TIMEOUT_S", type=float,
            default=600.0, help="Close a Tinker session (and free its models) after this long "
                                "without a heartbeat.")
@env_option("--sync-deadline-s", env="GRIDRL_TRAINER_SYNC_DEADLINE_S", type=float,
            default=30.0, help="Seconds one node's adapter push may take.")
@env_option("--outage-wait-s", "wait_for_nodes_s", env="GRIDRL_TRAINER_OUTAGE_WAIT_S",
            type=float, default=30.0, help="Seconds a sample waits for a node in rotation "
                                           "before the trainer samples it itself.")
@renamed_option("--wait-for-nodes-s", "wait_for_nodes_s", env="GRIDRL_TRAINER_WAIT_FOR_NODES_S",
                type=float)
@server_options("trainer", listen=default_of("listen"), metrics_port=-1, client=True)
def serve_api(listen: str, metrics_port: int, security: Any, log_level: str,
              ready_file: str | None, **params: Any) -> None:
    """Serve training primitives for a loop you write: gRPC TrainingService on --listen and
    a Tinker-compatible REST API on --http-listen (the official `tinker` SDK runs against
    it), on this machine's torch or MLX trainer, sampling on the rollout nodes. Ctrl-C / SIGTERM
    stops it (saved states and sampler weights stay in --api-dir)."""
    from gridrl.common.security.policy import ExposedError, check_exposure
    from gridrl.trainer.primitives.serve import ApiSettings, serve

    setup_logging(log_level)
    try:
        host, _ = parse_listen(params["http_listen"], "--http-listen")
        check_exposure(host, security, "--http-listen")
    except StatusError as e:
        raise click.BadParameter(e.message.removeprefix("--http-listen: "),
                                 param_hint="--http-listen") from None
    except ExposedError as e:
        raise click.UsageError(str(e)) from None
    try:
        import tinker  # noqa: F401
    except ImportError:
        raise click.UsageError("serve-api needs the Tinker SDK's wire definitions: pip install "
                               "'gridrl-trainer[tinker]'") from None
    settings = ApiSettings(**{**params, "rollout": list(params["rollout"])})
    try:
        serve(settings, listen=listen, metrics_port=metrics_port, security=security,
              ready_file=ready_file)
    except OSError as e:
        raise click.UsageError(str(e)) from None


def exit_code(signal_name: str | None) -> int:
    """The exit status of a run ended by a signal, by the shell's convention (128 + the
    signal's number): 130 for SIGINT (Ctrl-C), 143 for SIGTERM (systemd's stop; the unit
    lists it in ``SuccessExitStatus=``)."""
    return 130 if signal_name == "SIGINT" else 143


def _on_stop_signal(control: StopControl, run_dir: str | None, signum: int) -> None:
    """SIGINT / SIGTERM: the first asks the run to finish its step and checkpoint it, saying so
    at once; a second aborts at once (exit 130 / 143), saying which steps are lost."""
    name = signal.Signals(signum).name
    again = "Ctrl-C" if signum == signal.SIGINT else name
    if not control.stop_requested:
        control.request(name)
        click.echo(f"{name}: {control.notice()}; {again} again aborts", err=True)
        return
    click.echo(f"{name} again: aborting; {control.unsaved_steps(run_dir)}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter cleanup: the step in progress is inside torch on this or another thread
    os._exit(exit_code(name))


def _discard_unstarted_run_dir(run_dir: str | None, resume: bool) -> None:
    """Remove the directory of a new run that failed before recording anything (it holds only
    its config.json), so failed starts do not litter ``runs/``."""
    if resume or not run_dir:
        return
    path = Path(run_dir)
    if path.is_dir() and {p.name for p in path.iterdir()} <= {"config.json"}:
        (path / "config.json").unlink(missing_ok=True)
        path.rmdir()


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@env_option("--sweep-name", env="GRIDRL_TRAINER_SWEEP_NAME", default=None,
            show_default=False, help="Name of the sweep: runs go to runs/<sweep-name>/<run> "
            "[default: sweep-<time>].")
@env_option("--one-after-another", env="GRIDRL_TRAINER_ONE_AFTER_ANOTHER", is_flag=True,
            default=False, help="Run the variants in turn instead of at once (a baseline).")
@click.argument("run_args", nargs=-1, type=click.UNPROCESSED)
def sweep(sweep_name: str | None, one_after_another: bool, run_args: tuple[str, ...]) -> None:
    """Start N runs that differ in one or more flags on one fleet, then print one table.

    RUN_ARGS are `gridrl-trainer run` flags; a numeric flag given a comma-separated list is
    swept (`--lr 1e-4,3e-4,1e-3`; several such flags: every combination). Every run gets its
    own run name, directory (runs/<sweep-name>/<run>) and adapter on the nodes, and all use
    the same --master or --rollout fleet at once (with neither: one local rollout node the
    sweep starts); the nodes share their batches between the runs with a fair share per run
    (--share-weight). The table: swept values, final eval, exact, steps, time, exit status,
    run directory. Exits 1 when a run failed."""
    import time as _time

    from gridrl.trainer.sweep import numeric_flags, run_sweep, table

    name = sweep_name or _time.strftime("sweep-%Y%m%d-%H%M%S")
    try:
        outcomes, total = run_sweep(list(run_args), numeric_flags(TrainConfig), name,
                                    one_after_another=one_after_another, echo=click.echo)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except RuntimeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(table(outcomes, total, "one after another" if one_after_another
                     else "at once on one fleet"))
    if any(o.returncode != 0 for o in outcomes):
        sys.exit(1)


@main.command()
@address_option("--address", env="GRIDRL_TRAINER_ADDRESS", default="127.0.0.1:50052",
            help="TrainerService host:port.")
@env_option("--json", "as_json", env="GRIDRL_TRAINER_JSON", is_flag=True, default=False,
            help="Print the GetRunStatus response as JSON.")
@env_option("--timeout-s", env="GRIDRL_TRAINER_TIMEOUT_S", type=float, default=10.0,
            help="Call deadline.")
@client_security_options
@exit_on_rpc_error
def status(address: str, as_json: bool, timeout_s: float, security: Any) -> None:
    """Show a running trainer's state and its last step report."""
    from gridrl.common.rpc.channel import dial  # this command's own client
    from gridrl.v1 import trainer_pb2, trainer_pb2_grpc
    from gridrl.v1.enums import enum_word

    with dial(address, security) as channel:
        response = trainer_pb2_grpc.TrainerServiceStub(channel).GetRunStatus(
            trainer_pb2.GetRunStatusRequest(), timeout=timeout_s)
    if as_json:
        print_json(response)
        return
    from rich.console import Console
    from rich.table import Table

    state = enum_word(trainer_pb2.RunState, response.state, None)
    r = response.last_report
    progress = eval_progress_text(response)
    if progress and response.eval_progress.step == 0:
        state = progress  # "baseline eval, 16/128" rather than "starting"
    table = Table(show_header=False, box=None)
    rows = [
        ("run", f"{response.run_name} ({state})"), ("run dir", response.run_dir),
        ("model", response.model_id),
        ("step", f"{response.step}/{response.total_steps}"),
        ("policy version", str(response.policy_version)),
        ("baseline eval", f"{response.baseline_eval:.3f}"
         + (f" (exact {response.baseline_eval_exact:.2f})"
            if response.HasField("baseline_eval_exact") else "")
         if response.HasField("baseline_eval") else "-"),
    ]
    if response.eval_scorer:
        rows.append(("eval scorer", response.eval_scorer))
    if progress:
        rows.append(("evaluating", progress))
    if response.step:
        rows += [
            ("reward", f"{r.reward_mean:.3f} ± {r.reward_std:.3f}"),
            ("eval", f"{r.eval_score:.3f}" + (f" (exact {r.eval_exact:.2f})"
                                              if r.HasField("eval_exact") else "")
             + f" (policy version {r.eval_policy_version})"
             if r.HasField("eval_score") else "-"),
            ("loss", f"{r.loss:+.4f}"), ("mismatch KL", f"{r.mismatch_kl:.2e}"),
            ("staleness", f"{r.staleness_mean:.2f} (dropped {r.dropped_samples})"),
            ("sync", f"{r.sync_s:.2f}s, {r.nodes_synced} synced, {r.nodes_skipped} skipped"),
            ("time", f"rollout {r.rollout_s:.1f}s, train {r.train_s:.1f}s, "
                     f"{r.tokens_per_s:.0f} tok/s, elapsed {r.elapsed_s:.0f}s"),
        ]
    if response.HasField("node_wait"):
        w = response.node_wait
        rows.append(("waiting", f"for a rollout node {w.waited_s:.0f}s, {w.left_s:.0f}s left: "
                                f"{w.waiting_for}"))
    if response.error:
        rows.append(("error", response.error))
    for k, v in rows:
        table.add_row(f"[bold]{k}[/]", v)
    Console().print(table)


def eval_progress_text(response: Any) -> str:
    """A ``GetRunStatusResponse``'s eval in progress in words: ``"baseline eval, 16/128
    (12s, about 95s expected)"`` or ``"eval of step 10, 0/128 (2s)"``; "" when none runs."""
    if not response.HasField("eval_progress"):
        return ""
    p = response.eval_progress
    what = "baseline eval" if p.step == 0 else f"eval of step {p.step}"
    expected = (f", about {p.expected_s:.0f}s expected" if p.HasField("expected_s") else "")
    return f"{what}, {p.done}/{p.total} ({p.elapsed_s:.0f}s{expected})"


if __name__ == "__main__":
    main()
