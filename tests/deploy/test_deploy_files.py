"""Static checks of deploy/: systemd units, launchd plists, Prometheus config and alert rules,
and the Grafana dashboard's metric names, against the real tools and the real CLIs.

- units pass ``systemd-analyze verify`` (copies whose ExecStart points at this venv);
- units take their secrets with ``LoadCredential=`` and point the flags at the credentials
  directory (``%d``); started as systemd would (credentials copied, ``%d`` expanded), they
  serve mutual TLS with scoped credentials;
- every ``GRIDRL_*`` variable a unit or plist sets is read by the command it starts (a click
  flag of that very command, or a process-wide variable the code reads), and its value is
  valid for the flag's type;
- plists parse and start an installed console script's existing subcommand;
- ``promtool check config`` / ``check rules`` / ``test rules`` pass;
- metrics ports agree between units, plists, CLI defaults and the scrape config;
- every metric the alerts and the dashboard query is exported by some gridrl service.
"""

from __future__ import annotations

import json
import os
import plistlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import click
import pytest
import yaml
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
PLISTS = sorted((DEPLOY / "launchd").glob("*.plist"))
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS_YML = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = Path(__file__).with_name("alerts_test.yml")
DASHBOARD = DEPLOY / "grafana" / "gridrl.json"
DEPLOYED_VENV_BIN = "/opt/gridrl/.venv/bin/"
SCRIPTS = ("gridrl-master", "gridrl-rollout", "gridrl-trainer", "gridrl-adapters", "gridrl-auth")
# job name in prometheus.yml -> the console script whose `serve`/`run` it scrapes
JOBS = {"gridrl-master": "gridrl-master", "gridrl-rollout": "gridrl-rollout",
        "gridrl-trainer": "gridrl-trainer"}
# Service metrics modules: every series the dashboard and alerts use comes from one of them.
METRICS_MODULES = ("gridrl.common.rpc.metrics", "gridrl.master.metrics", "gridrl.rollout.metrics",
                   "gridrl.trainer.report.metrics", "gridrl.trainer.fleet.metrics")
PROMQL_BUILTINS = {"up"}  # series Prometheus itself adds to every target


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(BIN))
    assert path, f"{name} is not installed (make tools)"
    return path


# ----------------------------------------------------------------------------- parsing


def _unit_sections(path: Path) -> dict[str, list[tuple[str, str]]]:
    """``{section: [(key, value), ...]}`` of a unit file (comments and blanks dropped,
    backslash continuations joined)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path.name}: {line!r} outside a section"
        current.append((key.strip(), value.strip()))
    return sections


def _unit_environment(path: Path) -> dict[str, str]:
    """Every ``Environment=`` assignment of the unit's [Service] section, in order."""
    env: dict[str, str] = {}
    for key, value in _unit_sections(path)["Service"]:
        if key == "Environment":
            for assignment in shlex.split(value):
                name, sep, val = assignment.partition("=")
                assert sep, f"{path.name}: Environment={value!r} is not NAME=VALUE"
                env[name] = val
    return env


def _unit_credentials(path: Path) -> dict[str, str]:
    """``{name: source}`` of the unit's ``LoadCredential=name:source`` lines."""
    out = {}
    for key, value in _unit_sections(path)["Service"]:
        if key == "LoadCredential":
            name, sep, source = value.partition(":")
            assert sep and source.startswith("/"), f"{path.name}: LoadCredential={value!r}"
            out[name] = source
    return out


def _install_etc(etc: Path, pki, creds) -> None:
    """What an operator puts in /etc/gridrl (deploy/README.md): the machine's certificate
    and key (for 127.0.0.1 here), the CA, the authorized tokens, each service's token."""
    (etc / "tls").mkdir(parents=True, exist_ok=True)
    for src, dst in ((pki.crt("server"), "tls/host.crt"), (pki.key("server"), "tls/host.key"),
                     (pki.ca, "tls/ca.crt"), (creds.authorized, "authorized_tokens"),
                     (creds.files["node"], "rollout.token"),
                     (creds.files["trainer"], "trainer.token")):
        shutil.copyfile(src, etc / dst)
    for secret in ("tls/host.key", "rollout.token", "trainer.token"):
        (etc / secret).chmod(0o600)


def _deployed_environment(unit: Path, tmp_path: Path, pki, creds) -> dict[str, str]:
    """The unit's ``Environment=`` as systemd would run it with /etc/gridrl, /var/lib/gridrl
    and /var/cache/gridrl mapped into ``tmp_path``: /etc/gridrl installed, every
    ``LoadCredential=`` copied into a credentials directory (mode 0400), ``%d`` expanded."""
    etc = tmp_path / "etc"
    _install_etc(etc, pki, creds)
    credentials = tmp_path / "credentials" / unit.stem
    credentials.mkdir(parents=True)
    for name, source in _unit_credentials(unit).items():
        shutil.copyfile(source.replace("/etc/gridrl", str(etc)), credentials / name)
        (credentials / name).chmod(0o400)
    return {k: v.replace("%d", str(credentials)).replace("/etc/gridrl", str(etc))
            .replace("/var/lib/gridrl", str(tmp_path / "state"))
            .replace("/var/cache/gridrl", str(tmp_path / "cache"))
            for k, v in _unit_environment(unit).items()}


def _unit_exec_start(path: Path) -> str:
    starts = [v for k, v in _unit_sections(path)["Service"] if k == "ExecStart"]
    assert len(starts) == 1, f"{path.name}: expected one ExecStart, got {starts}"
    return starts[0]


def _command_of(command_line: str, where: str) -> tuple[str, str]:
    """``(console script, subcommand)`` started by a unit's ExecStart or a plist's
    ProgramArguments (also inside a ``/bin/sh -c '...'`` wrapper)."""
    m = re.search(r"/\.venv/bin/(gridrl-[a-z]+)\s+([a-z][a-z-]*)", command_line)
    assert m, f"{where}: {command_line!r} starts no <venv>/bin/gridrl-* <command>"
    return m.group(1), m.group(2)


def _plist(path: Path) -> dict:
    with path.open("rb") as f:
        return plistlib.load(f)


def _click_command(script: str, sub: str) -> click.Command:
    eps = {ep.name: ep for ep in entry_points(group="console_scripts")}
    assert script in eps, f"{script} is not an installed console script"
    group = eps[script].load()
    assert isinstance(group, click.Group), f"{script} is not a click group"
    assert sub in group.commands, f"{script} has no command {sub!r} ({sorted(group.commands)})"
    return group.commands[sub]


def _process_env_readers() -> dict[str, object]:
    """Variables read by the code itself rather than by a flag, each with a check that the
    code really reads it: name -> callable(value) returning what the code made of it."""
    from gridrl.models.resolve import cache_root

    return {"GRIDRL_CACHE_DIR": lambda value: str(cache_root())}


# ----------------------------------------------------------------------------- systemd


def test_deploy_files_exist() -> None:
    names = {p.name for p in UNITS}
    assert names == {"gridrl-master.service", "gridrl-rollout.service",
                     "gridrl-trainer.service"}, names
    assert {p.name for p in PLISTS} == {"com.gridrl.master.plist", "com.gridrl.rollout.plist"}


def test_systemd_units_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on copies whose binaries are this venv's: exit 0 and not a
    single warning (unknown keys and bad values are only warnings to systemd)."""
    analyze = _tool("systemd-analyze")
    rendered = []
    for unit in UNITS:
        text = unit.read_text()
        assert DEPLOYED_VENV_BIN in text, f"{unit.name}: ExecStart is not under {DEPLOYED_VENV_BIN}"
        copy = tmp_path / unit.name
        copy.write_text(text.replace(DEPLOYED_VENV_BIN, f"{BIN}/"))
        rendered.append(str(copy))
    proc = subprocess.run([analyze, "verify", *rendered], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and not proc.stderr.strip(), (
        f"systemd-analyze verify exited {proc.returncode}:\n{proc.stderr}{proc.stdout}")


def test_systemd_verify_catches_broken_units(tmp_path: Path) -> None:
    """The check above is not vacuous: a typo'd key or a missing binary is reported."""
    analyze = _tool("systemd-analyze")
    text = (DEPLOY / "systemd" / "gridrl-master.service").read_text()
    bad = tmp_path / "broken.service"
    bad.write_text(text.replace(DEPLOYED_VENV_BIN, "/nonexistent/bin/")
                   .replace("Restart=", "Restrt="))
    proc = subprocess.run([analyze, "verify", str(bad)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Restrt" in proc.stderr and "/nonexistent/bin/gridrl-master" in proc.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_takes_secrets_as_credentials_and_serves_tls_with_scoped_credentials(
        unit: Path) -> None:
    """Every unit serves TLS with its CA (mutual) and the authorized tokens; the private key
    and any token come through LoadCredential (read from %d), never from a path the service
    user could read directly or from the environment itself."""
    env = _unit_environment(unit)
    credentials = _unit_credentials(unit)
    for name in ("GRIDRL_TLS_CERT", "GRIDRL_TLS_KEY", "GRIDRL_TLS_CA",
                 "GRIDRL_AUTHORIZED_TOKENS"):
        assert env.get(name), f"{unit.name}: no {name}"
    assert "GRIDRL_AUTH_TOKEN" not in env and not [k for k in env if k.endswith("_INSECURE")]
    secrets = [v for k, v in env.items() if k in ("GRIDRL_TLS_KEY", "GRIDRL_AUTH_TOKEN_FILE")]
    assert secrets and all(v.startswith("%d/") for v in secrets), (unit.name, secrets)
    loaded = {v.removeprefix("%d/") for v in env.values() if v.startswith("%d/")}
    assert loaded == set(credentials), (unit.name, loaded, credentials)
    assert (unit.stem != "gridrl-master") == ("GRIDRL_AUTH_TOKEN_FILE" in env), unit.name


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_starts_a_real_command_with_env_vars_it_reads(unit: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    script, sub = _command_of(_unit_exec_start(unit), unit.name)
    assert unit.stem == script, f"{unit.name} starts {script}"
    _check_env(_unit_environment(unit), script, sub, unit.name, monkeypatch)


@pytest.mark.parametrize("plist", PLISTS, ids=lambda p: p.name)
def test_plist_parses_and_starts_a_real_command(plist: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    data = _plist(plist)
    assert data["Label"] == plist.stem, f"{plist.name}: Label {data['Label']!r}"
    args = data["ProgramArguments"]
    assert isinstance(args, list) and all(isinstance(a, str) for a in args)
    script, sub = _command_of(" ".join(args), plist.name)
    assert Path(args[0]).name == script and args[1] == sub, args
    assert script in SCRIPTS and os.access(BIN / script, os.X_OK)
    assert data.get("RunAtLoad") is True
    # Restart after a crash only: a clean SIGTERM exit stays down.
    assert data.get("KeepAlive") == {"SuccessfulExit": False}
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert Path(data[key]).is_absolute(), f"{plist.name}: {key} must be absolute"
    env = data.get("EnvironmentVariables", {})
    assert all(isinstance(v, str) for v in env.values()), "plist environment values are strings"
    _check_env(env, script, sub, plist.name, monkeypatch)
    for name in ("GRIDRL_TLS_CERT", "GRIDRL_TLS_KEY", "GRIDRL_TLS_CA",
                 "GRIDRL_AUTHORIZED_TOKENS"):  # it listens on 0.0.0.0: TLS and credentials
        assert Path(env.get(name, "")).is_absolute(), f"{plist.name}: {name}"
    assert "GRIDRL_AUTH_TOKEN" not in env, "tokens come from a file (GRIDRL_AUTH_TOKEN_FILE)"


def _check_env(env: dict[str, str], script: str, sub: str, where: str,
               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GRIDRL_* variable is read by ``script sub`` and its value converts."""
    cmd = _click_command(script, sub)
    by_env = {p.envvar: p for p in cmd.params if isinstance(p.envvar, str)}
    process_env = _process_env_readers()
    problems = []
    gridrl_vars = {k: v for k, v in env.items() if k.startswith("GRIDRL_")}
    assert gridrl_vars, f"{where}: sets no GRIDRL_* variable"
    for name, value in gridrl_vars.items():
        monkeypatch.setenv(name, value)
        if name in process_env:
            got = process_env[name](value)  # type: ignore[operator]
            if got != value:
                problems.append(f"{name}={value}: the code made {got!r} of it")
            continue
        param = by_env.get(name)
        if param is None:
            problems.append(f"{name}: no flag of `{script} {sub}` reads it")
            continue
        ctx = click.Context(cmd, info_name=sub)
        try:
            param.type_cast_value(ctx, param.value_from_envvar(ctx))
        except click.BadParameter as e:
            problems.append(f"{name}={value!r}: {e.format_message()}")
    assert not problems, f"{where}:\n" + "\n".join(problems)


def _all_cli_env_vars() -> set[str]:
    """Every environment variable any flag of any gridrl command reads."""
    names: set[str] = set()

    def walk(cmd: click.Command) -> None:
        names.update(p.envvar for p in cmd.params if isinstance(p.envvar, str))
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                walk(sub)

    eps = {ep.name: ep for ep in entry_points(group="console_scripts")}
    for script in SCRIPTS:
        walk(eps[script].load())
    return names


def test_every_gridrl_variable_named_in_deploy_exists() -> None:
    """Comments, README and examples in deploy/ name only variables the code reads
    (``GRIDRL_<SERVICE>_*`` wildcards and the ``GRIDRL_`` prefix itself aside)."""
    known = _all_cli_env_vars() | set(_process_env_readers())
    unknown = []
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        for name in set(re.findall(r"\bGRIDRL_[A-Z0-9_]*[A-Z0-9]\b(?!_?\*)", path.read_text())):
            if name not in known:
                unknown.append(f"{path.relative_to(REPO)}: {name}")
    assert not unknown, "not read by any gridrl command:\n" + "\n".join(unknown)


# ----------------------------------------------------------------------------- prometheus


def test_promtool_check_config_and_rules(tmp_path: Path, pki) -> None:
    """promtool checks the config fully, TLS files included: it runs on a copy whose
    /etc/prometheus/gridrl files (CA, Prometheus' client certificate and key) exist."""
    promtool = _tool("promtool")
    files = tmp_path / "gridrl"
    files.mkdir()
    for src, dst in ((pki.ca, "ca.crt"), (pki.crt("client"), "prometheus.crt"),
                     (pki.key("client"), "prometheus.key")):
        shutil.copyfile(src, files / dst)
    config = tmp_path / "prometheus.yml"
    config.write_text(PROMETHEUS_YML.read_text().replace("/etc/prometheus/gridrl", str(files)))
    for name in ("alerts.yml", "gridrl-rollout-nodes.yml"):
        shutil.copyfile(PROMETHEUS_YML.parent / name, tmp_path / name)
    for argv in (["check", "config", str(config)], ["check", "rules", str(ALERTS_YML)],
                 ["test", "rules", str(ALERTS_TEST)]):
        proc = subprocess.run([promtool, *argv], capture_output=True, text=True, timeout=120,
                              cwd=ALERTS_TEST.parent if argv[0] == "test" else None)
        assert proc.returncode == 0, f"promtool {' '.join(argv)}:\n{proc.stdout}{proc.stderr}"
        assert "SUCCESS" in proc.stdout + proc.stderr


def test_alert_rules_cover_the_failures_that_matter() -> None:
    rules = {r.get("alert") or r.get("record"): r
             for g in yaml.safe_load(ALERTS_YML.read_text())["groups"] for r in g["rules"]}
    for alert in ("GridrlRolloutNodeDown", "GridrlNodeStalePolicy", "GridrlTrainerStalled",
                  "GridrlHighRpcErrorRate"):
        assert alert in rules, f"alerts.yml has no {alert}"
        rule = rules[alert]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    tested = set(re.findall(r"alertname:\s*(\w+)", ALERTS_TEST.read_text()))
    untested = {name for name, r in rules.items() if "alert" in r} - tested
    assert not untested - {"GridrlNoRolloutNodeUp", "GridrlMasterDown",
                           "GridrlRegisteredNodeUnhealthy", "GridrlAdapterSyncFailing",
                           "GridrlMismatchKLHigh"}, f"alerts without a promtool test: {untested}"


def _scrape_jobs() -> dict[str, dict]:
    return {j["job_name"]: j for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]}


def _job_ports(job: dict) -> set[int]:
    targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
    for sd in job.get("file_sd_configs", []):
        for pattern in sd["files"]:
            for f in PROMETHEUS_YML.parent.glob(pattern):
                targets += [t for group in yaml.safe_load(f.read_text()) for t in group["targets"]]
    assert targets, f"job {job['job_name']} has no example target"
    return {int(t.rsplit(":", 1)[1]) for t in targets}


def test_every_job_scrapes_https_with_a_client_certificate() -> None:
    """/metrics of a TLS service is HTTPS and, under mutual TLS, wants a client certificate."""
    for name, job in _scrape_jobs().items():
        assert job.get("scheme") == "https", name
        tls = job.get("tls_config") or {}
        assert {"ca_file", "cert_file", "key_file"} <= set(tls), (name, tls)


def test_scrape_ports_match_units_plists_and_cli_defaults() -> None:
    jobs = _scrape_jobs()
    assert set(jobs) >= set(JOBS), f"prometheus.yml jobs {sorted(jobs)}"
    deployed: dict[str, set[int]] = {}
    for unit in UNITS:
        script, _ = _command_of(_unit_exec_start(unit), unit.name)
        env = _unit_environment(unit)
        deployed.setdefault(script, set()).update(
            int(v) for k, v in env.items() if k.endswith("_METRICS_PORT"))
    for plist in PLISTS:
        data = _plist(plist)
        script = Path(data["ProgramArguments"][0]).name
        deployed.setdefault(script, set()).update(
            int(v) for k, v in data.get("EnvironmentVariables", {}).items()
            if k.endswith("_METRICS_PORT"))
    for job, script in JOBS.items():
        sub = "run" if script == "gridrl-trainer" else "serve"
        cmd = _click_command(script, sub)
        default = next(p.default for p in cmd.params if p.name == "metrics_port")
        ports = _job_ports(jobs[job])
        assert ports == {default}, f"job {job} scrapes ports {ports}, {script} {sub} " \
                                   f"defaults to {default}"
        assert deployed.get(script) == {default}, \
            f"{script}: units/plists set metrics ports {deployed.get(script)}, not {default}"


# ----------------------------------------------------------------------------- metric names


def _exported_series_names() -> set[str]:
    """Every sample name the services' metrics modules can export (in a fresh interpreter)."""
    code = r"""
import importlib, json, sys
from prometheus_client import REGISTRY
for m in sys.argv[1:]:
    importlib.import_module(m)
suffixes = {"counter": ["_total", "_created"], "gauge": [""], "histogram":
            ["_bucket", "_sum", "_count", "_created"], "summary": ["", "_sum", "_count",
            "_created"], "info": ["_info"], "stateset": [""], "gaugehistogram": ["_bucket",
            "_gsum", "_gcount"], "unknown": [""]}
names = set()
for collector in list(REGISTRY._collector_to_names):
    for family in (collector.describe() if hasattr(collector, "describe") else []) or \
            collector.collect():
        names.update(family.name + s for s in suffixes[family.type])
print(json.dumps(sorted(names)))
"""
    proc = subprocess.run([sys.executable, "-c", code, *METRICS_MODULES], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout))


def _promql_metric_names(expr: str) -> set[str]:
    """gridrl_* series names, gridrl:* recording-rule names and Prometheus' own ``up`` in a
    PromQL expression (label values in quotes are skipped; no label name starts gridrl)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return set(re.findall(r"\b(gridrl[_:][a-z0-9_:]+|up)\b", expr))


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in _panels(dash):
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def _panels(dash: dict) -> list[dict]:
    panels = []
    for p in dash["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))  # collapsed rows
    return [p for p in panels if p.get("type") != "row"]


def test_every_queried_metric_is_exported_by_a_service() -> None:
    exported = _exported_series_names()
    assert "gridrl_rpc_requests_total" in exported and "gridrl_master_nodes" in exported
    rules = [r for g in yaml.safe_load(ALERTS_YML.read_text())["groups"] for r in g["rules"]]
    exported |= {r["record"] for r in rules if "record" in r}
    queries = [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for r in rules]
    queries += [(f"panel {title!r}", expr) for title, expr in _dashboard_exprs()]
    queries += [(f"variable {v['name']}", v["definition"])
                for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
                if v.get("type") == "query"]
    missing = []
    for where, expr in queries:
        names = _promql_metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        missing += [f"{where}: {n}" for n in sorted(names - exported - PROMQL_BUILTINS)]
    assert not missing, "queried but exported by no gridrl service:\n" + "\n".join(missing)


def test_metric_name_extraction() -> None:
    """The PromQL scan above finds names in the shapes the dashboard uses, and no label."""
    expr = ('histogram_quantile(0.95, sum by (le, method) (rate(gridrl_rpc_duration_seconds_bucket'
            '{job="gridrl-rollout", instance=~"$node"}[$__rate_interval])))'
            ' / on() group_left max(gridrl_trainer_policy_version) and up == 1'
            ' or gridrl:rpc_requests:rate5m{code!~"OK|gridrl_x"}')
    assert _promql_metric_names(expr) == {"gridrl_rpc_duration_seconds_bucket",
                                          "gridrl_trainer_policy_version", "up",
                                          "gridrl:rpc_requests:rate5m"}


# ----------------------------------------------------------------------------- trainer unit


def _systemd_command(exec_start: str) -> list[str]:
    """argv of an ExecStart as systemd runs it: ``$$`` is a literal ``$`` (the unit must not
    use systemd's own ``$VAR`` expansion, which this emulation does not do)."""
    assert not re.search(r"(?<!\$)\$(?!\$)", exec_start.replace("$$", "")), exec_start
    return shlex.split(exec_start.replace("$$", "$").replace(DEPLOYED_VENV_BIN, f"{BIN}/"))


@pytest.mark.slow
def test_trainer_unit_starts_a_fresh_run_then_resumes_it(tmp_path: Path, tiny_llama_dir: Path,
                                                         pki, creds) -> None:
    """What systemd does with gridrl-trainer.service: the first start (empty state directory)
    trains from scratch; a restart after that (crash, reboot) resumes from the checkpoint in
    the same run directory instead of starting over or refusing to start."""
    unit = DEPLOY / "systemd" / "gridrl-trainer.service"
    state = tmp_path / "state"
    env = _deployed_environment(unit, tmp_path, pki, creds)
    # /etc/gridrl/trainer.env (EnvironmentFile, read after Environment=): a tiny, quick run.
    env_file = {"GRIDRL_TRAINER_MODEL": str(tiny_llama_dir), "GRIDRL_TRAINER_ROLLOUT": "local",
                "GRIDRL_TRAINER_STEPS": "1", "GRIDRL_TRAINER_CHECKPOINT_EVERY": "1",
                "GRIDRL_TRAINER_GROUP_SIZE": "2", "GRIDRL_TRAINER_MAX_TOKENS": "4",
                "GRIDRL_TRAINER_EVAL_TASKS": "1", "GRIDRL_TRAINER_DEVICE": "cpu",
                "GRIDRL_TRAINER_LISTEN": "127.0.0.1:0", "GRIDRL_TRAINER_METRICS_PORT": "-1"}
    base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    base["OMP_NUM_THREADS"] = "1"  # tests share 2 cores: one torch thread is faster
    argv = _systemd_command(_unit_exec_start(unit))
    run_dir = Path(env["GRIDRL_TRAINER_RUN_DIR"])
    assert run_dir.is_relative_to(state), "the run directory must live in StateDirectory"

    first = subprocess.run(argv, env={**base, **env, **env_file}, capture_output=True,
                           text=True, timeout=600)
    assert first.returncode == 0, f"first start failed:\n{first.stdout}{first.stderr}"
    assert (run_dir / "checkpoints" / "latest").is_file(), sorted(run_dir.rglob("*"))

    env_file["GRIDRL_TRAINER_STEPS"] = "2"  # the operator extends the run; or a crash restart
    second = subprocess.run(argv, env={**base, **env, **env_file}, capture_output=True,
                            text=True, timeout=600)
    out = second.stdout + second.stderr
    assert second.returncode == 0, f"restart failed:\n{out}"
    assert "resumed" in out, out
    steps = [json.loads(line).get("step") for line in (run_dir / "log.jsonl").read_text()
             .splitlines()]
    assert [s for s in steps if s is not None] == [1, 2], steps


def _start_unit(unit: Path, tmp_path: Path, env_file: dict[str, str], name: str,
                pki, creds) -> tuple[subprocess.Popen, dict, Path]:
    """Run a unit's ExecStart with its Environment= as deployed (:func:`_deployed_environment`)
    plus ``env_file`` (as /etc/gridrl/<x>.env would), until its ready file."""
    env = _deployed_environment(unit, tmp_path / name, pki, creds)
    ready = tmp_path / f"{name}.ready.json"
    service = name.upper()
    base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen(_systemd_command(_unit_exec_start(unit)),
                            env={**base, **env, **env_file,
                                 f"GRIDRL_{service}_READY_FILE": str(ready)},
                            stdout=log.open("w"), stderr=subprocess.STDOUT)

    def is_ready() -> bool:
        assert proc.poll() is None, f"{unit.name} exited {proc.returncode}:\n{log.read_text()}"
        return ready.exists()

    wait_for(is_ready, timeout_s=120, what=f"{unit.name} to be ready", every_s=0.1)
    return proc, json.loads(ready.read_text()), log


def _sigterm(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def test_master_and_rollout_units_serve_with_their_environment(tmp_path: Path,
                                                              tiny_llama_dir: Path,
                                                              pki, creds) -> None:
    """The master and rollout units' own environment (store, adapter root, cache, backend)
    gives working services: the node registers with the master, state lands in the unit's
    StateDirectory, and SIGTERM (systemctl stop, launchctl bootout) exits 0, which is what
    Restart=on-failure and KeepAlive.SuccessfulExit=false count as a clean stop."""
    master, master_info, master_log = _start_unit(
        DEPLOY / "systemd" / "gridrl-master.service", tmp_path,
        {"GRIDRL_MASTER_LISTEN": "127.0.0.1:0", "GRIDRL_MASTER_METRICS_PORT": "0",
         "GRIDRL_MASTER_DASHBOARD_PORT": "0"}, "master",
        pki, creds)
    node = None
    try:
        assert (tmp_path / "master" / "state" / "master.sqlite").is_file(), \
            master_log.read_text()
        assert "mutual TLS; 3 authorized credential(s)" in master_log.read_text()
        node, node_info, node_log = _start_unit(
            DEPLOY / "systemd" / "gridrl-rollout.service", tmp_path,
            {"GRIDRL_ROLLOUT_MODEL": str(tiny_llama_dir), "GRIDRL_ROLLOUT_DEVICE": "cpu",
             "GRIDRL_ROLLOUT_THREADS": "1", "GRIDRL_ROLLOUT_LISTEN": "127.0.0.1:0",
             "GRIDRL_ROLLOUT_METRICS_PORT": "0",
             "GRIDRL_ROLLOUT_MASTER": master_info["address"]}, "rollout", pki, creds)

        def listed() -> list:
            out = subprocess.run([str(BIN / "gridrl-master"), "nodes", "--address",
                                  master_info["address"], "--json", *pki.flags("client"),
                                  "--auth-token-file", str(creds.files["read"])],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)["nodes"]

        nodes = wait_for(listed, timeout_s=30, what="the master to list the node", every_s=0.2)
        assert [n["info"]["address"] for n in nodes] == [node_info["address"]], nodes
        assert (tmp_path / "rollout" / "state" / "adapters").is_dir(), node_log.read_text()
        assert "credential 'node-1' holds" in master_log.read_text()
        assert _sigterm(node) == 0, node_log.read_text()
        node = None
    finally:
        if node is not None:
            node.kill()
        rc = _sigterm(master)
    assert rc == 0, master_log.read_text()


def test_trainer_unit_counts_its_stop_code_as_success() -> None:
    """systemd stops the trainer with SIGTERM; it checkpoints and exits 143, which the unit
    must list in SuccessExitStatus= or every stop reads as a failure."""
    from gridrl.trainer.cli import exit_code

    unit = (DEPLOY / "systemd" / "gridrl-trainer.service").read_text()
    kill = re.search(r"^KillSignal=(\S+)$", unit, re.M).group(1)
    success = re.search(r"^SuccessExitStatus=(.+)$", unit, re.M).group(1).split()
    assert str(exit_code(kill)) in success
