"""Each trainer setting is declared once (``config.py``) and ``gridrl-trainer run`` is generated
from it: the same flags as before with the same names, environment variables, defaults, types
and help (``data/trainer_run_flags.json`` recorded them before the declarations were merged, so
none silently disappears), validation naming the flag, and nothing framework-heavy imported."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import click
import pytest
from flag_records import option_records

from gridrl.common.errors import StatusError, invalid_argument
from gridrl.trainer.cli import main
from gridrl.trainer.config import RESUME_OVERRIDABLE, TrainConfig, default_of, flag_of

BIN = Path(sys.executable).parent
RECORDED = json.loads((Path(__file__).parent / "data" / "trainer_run_flags.json").read_text())
# run's options that are not run settings: where to resume from, and the ready file
# --resume, --ready-file and the security flags of gridrl.common.cli.server_options (every
# start's own; never saved with the run: TrainConfig.security)
NOT_SETTINGS = {"resume", "ready_file", "tls_cert", "tls_key", "tls_ca", "authorized_tokens",
                "insecure", "auth_token_file", "auth_token",
                # the former --node-wait-s and --wait-for-nodes-s (hidden; they set
                # --start-wait-s and --outage-wait-s)
                "_renamed_node_wait_s", "_renamed_wait_for_nodes_s"}
# what --resume took from the new command line before the settings were declared once (with
# the node pool branch's --wait-for-nodes-s and the exports branch's --report-to; the auth
# token is no setting since the security work: every start takes its credentials from its flags)
RESUME_OVERRIDABLE_BEFORE = {
    "steps", "master", "rollout", "report_to", "listen", "metrics_port", "request_timeout_s",
    "sync_deadline_s", "min_nodes", "node_wait_s", "wait_for_nodes_s", "eval_every",
    "checkpoint_every", "keep_checkpoints", "device", "threads", "log_level",
    # the network's deadlines, like request_timeout_s (issue 44)
    "keepalive_s", "keepalive_timeout_s", "hedge_after", "hedge_min_s"}


def test_every_recorded_flag_is_still_there_unchanged():
    now = {r["name"]: r for r in option_records(main.commands["run"])}
    missing = [r["name"] for r in RECORDED if r["name"] not in now]
    assert not missing, f"flags gone from gridrl-trainer run: {missing}"
    changed = {r["name"]: {k: (v, now[r["name"]][k]) for k, v in r.items()
                           if now[r["name"]][k] != v}
               for r in RECORDED}
    assert not {k: v for k, v in changed.items() if v}, changed
    assert now["backend"]["choices"] == ["torch", "mlx"] and now["backend"]["default"] == "torch"
    assert now["backend"]["envvar"] == "GRIDRL_TRAINER_BACKEND"


def test_every_option_is_a_declared_setting_and_every_setting_an_option():
    """One declaration: the run command's options are the config's fields (plus --resume and
    --ready-file), with the field's default; generated flags are --<field-name> and read
    GRIDRL_TRAINER_<FLAG>."""
    options = {p.name: p for p in main.commands["run"].params if isinstance(p, click.Option)}
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"security"}  # no setting
    assert set(options) == fields | NOT_SETTINGS
    hints = typing.get_type_hints(TrainConfig)
    for name in fields:
        option = options[name]
        if typing.get_origin(hints[name]) is not list:
            assert option.default == default_of(name), name
        flag = flag_of(name)
        assert flag in option.opts, (name, option.opts)
        assert option.envvar in ("GRIDRL_AUTH_TOKEN",
                                 "GRIDRL_TRAINER_" + flag[2:].replace("-", "_").upper()), name
    assert TrainConfig().to_dict().keys() == fields


def test_the_demo_changes_only_the_defaults_the_readme_names():
    """``make demo`` runs ``gridrl-trainer run``'s defaults plus ``DEMO_FLAGS`` (and its
    wiring): each of them changes a default, and README.md names each as the demo's addition,
    so the same run by hand learns the same way."""
    from gridrl.trainer.demo import DEMO_FLAGS

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert DEMO_FLAGS
    for flag, value in zip(DEMO_FLAGS[::2], DEMO_FLAGS[1::2], strict=True):
        name = flag.removeprefix("--").replace("-", "_")
        assert str(default_of(name)) != value, f"{flag} {value} is already the default"
        assert f"`{flag} {value}`" in readme, f"README.md does not name the demo's {flag}"


def test_resume_takes_the_same_settings_from_the_command_line_as_before():
    assert set(RESUME_OVERRIDABLE) == RESUME_OVERRIDABLE_BEFORE


@pytest.mark.parametrize(("settings", "message"), [
    (dict(steps=0), "--steps: must be >= 1, got 0"),
    (dict(group_size=1), "--group-size: must be >= 2 (GRPO compares samples within a group)"),
    (dict(temperature=0.0), "--temperature: must be > 0 (GRPO needs sampled, not greedy"),
    (dict(top_p=0.0), "--top-p: must be in (0, 1], got 0.0"),
    (dict(top_k=-1), "--top-k: must be >= 0, got -1"),
    (dict(lr=0.0), "--lr: must be > 0, got 0.0"),
    (dict(clip_eps_high=-0.1), "--clip-eps-high: must be > 0, got -0.1"),
    (dict(kl_beta=-1.0), "--kl-beta: must be >= 0"),
    (dict(loss_aggregation="mean"), "--loss-aggregation: must be sequence, token or constant"),
    (dict(lr_schedule="step"), "--lr-schedule: must be constant, linear or cosine"),
    (dict(lora_dropout=1.0), "--lora-dropout: must be in [0, 1), got 1.0"),
    (dict(warmup_steps=-1), "--warmup-steps: must be >= 0"),
    (dict(threads=-2), "--threads: must be >= 0, got -2"),
    (dict(wait_for_nodes_s=-1.0), "--outage-wait-s: must be >= 0, got -1.0"),
    (dict(backend="jax"), "--backend: must be"),
    (dict(run_name="my run/1"), "--run-name: 'my run/1' must be 1-128 characters of "
                                "[A-Za-z0-9._-], starting with a letter or digit"),
    (dict(run_name=".hidden"), "--run-name: '.hidden' must be 1-128 characters"),
    (dict(run_name="x" * 129), "--run-name: '" + "x" * 129 + "' must be 1-128 characters"),
    (dict(rollout=["local", "h:1"]), "--rollout: 'local' cannot be mixed"),
    (dict(async_steps=1), "--async-steps: needs remote nodes"),
    (dict(rollout=["h:1"], sync_every=3, max_staleness=1), "--max-staleness: 1 is below 2"),
])
def test_validation_names_the_flag(settings, message):
    with pytest.raises(StatusError) as err:
        TrainConfig(**settings).finalize()
    assert err.value.message.startswith(message), err.value.message


def test_cli_and_environment_reach_the_same_validation(tmp_path):
    """A bad flag or environment variable is a usage error naming the flag, before any model
    is loaded, and no run directory is left behind."""
    base = [str(BIN / "gridrl-trainer"), "run", "--run-dir", str(tmp_path / "run")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRIDRL_TRAINER_")}
    flag = subprocess.run([*base, "--group-size", "1"], capture_output=True, text=True,
                          timeout=120, env=env)
    from_env = subprocess.run(base, capture_output=True, text=True, timeout=120,
                              env={**env, "GRIDRL_TRAINER_GROUP_SIZE": "1"})
    for done in (flag, from_env):
        assert done.returncode == 2, done.stderr
        assert "--group-size: must be >= 2" in done.stderr
    assert not (tmp_path / "run").exists()
    choice = subprocess.run([*base, "--loss-aggregation", "mean"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert choice.returncode == 2 and "--loss-aggregation" in choice.stderr


def test_help_lists_every_recorded_flag_with_its_env_var():
    done = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--help"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for r in RECORDED:
        for flag in r["flags"]:
            assert flag in text, flag
        assert f"[env var: {r['envvar']}" in text, r["envvar"]


def test_the_two_node_waits_have_distinct_names_and_the_former_ones_still_work(monkeypatch):
    """``--start-wait-s`` (before step 1, for --min-nodes) and ``--outage-wait-s`` (once
    started, none in rotation) replace the look-alike ``--node-wait-s`` and
    ``--wait-for-nodes-s``, which keep working (flag and environment variable) but are hidden
    from ``--help``; the new names win when both are given."""
    from click.testing import CliRunner

    from gridrl.trainer import cli

    seen = {}

    def fake_build(ctx, params):
        seen.update(params, source=ctx.get_parameter_source("node_wait_s").name)
        raise invalid_argument("--x", "stop here")

    monkeypatch.setattr(cli, "build_config", fake_build)
    runner = CliRunner()
    # (the source: --resume takes a wait given under either name over the saved one)
    for args, env, want in (
            (["--node-wait-s", "7", "--wait-for-nodes-s", "9"], {}, (7.0, 9.0, "COMMANDLINE")),
            ([], {"GRIDRL_TRAINER_NODE_WAIT_S": "5", "GRIDRL_TRAINER_WAIT_FOR_NODES_S": "6"},
             (5.0, 6.0, "ENVIRONMENT")),
            (["--start-wait-s", "1", "--node-wait-s", "7", "--outage-wait-s", "2"], {},
             (1.0, 2.0, "COMMANDLINE")),
            ([], {}, (120.0, 300.0, "DEFAULT"))):
        seen.clear()
        runner.invoke(cli.main, ["run", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                                 *args], env=env)
        assert (seen["node_wait_s"], seen["wait_for_nodes_s"], seen["source"]) == want, (
            args, env)
    text = runner.invoke(cli.main, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert "--start-wait-s" in text and "--outage-wait-s" in text
    assert "--node-wait-s" not in text and "--wait-for-nodes-s" not in text
