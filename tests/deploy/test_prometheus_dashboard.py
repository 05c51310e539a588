"""The Grafana dashboard and the alert rules against a real Prometheus scraping a real cluster.

A master, a rollout node on the tiny llama (registered with the master) and a trainer run on
the tiny llama (finding the node through the master) run on port 0 with metrics ports 0, with
mutual TLS and scoped credentials as deployed; a few ``gridrl-rollout generate`` calls (one of
them refused) add client traffic. A real ``prometheus`` scrapes them every second over HTTPS
with a client certificate, with the job names, scheme and TLS settings of
``deploy/prometheus/prometheus.yml`` (its discovery replaced by file_sd files this test
writes, its certificate paths by the test's) and loads ``deploy/prometheus/alerts.yml``. Then every PromQL expression of every
panel of ``deploy/grafana/gridrl.json`` (dashboard variables substituted) must return at
least one series with a number, its legend's labels must exist, every variable's query must
find values, and every alert rule must load and evaluate without error.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "gridrl.json"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS_YML = DEPLOY / "prometheus" / "alerts.yml"
BIN = Path(sys.executable).parent
JOB_OF_SERVICE = {"master": "gridrl-master", "rollout": "gridrl-rollout",
                  "trainer": "gridrl-trainer"}

# ----------------------------------------------------------------------------- Prometheus


# Prometheus's web listener logs the address it bound (exporter-toolkit, at info level).
_LISTENING = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')


class Prometheus:
    """A real ``prometheus`` on port 0 (the bound port read back from its log) with a tmp
    storage dir; targets via file_sd."""

    def __init__(self, tmp: Path, pki) -> None:
        self.tmp = tmp
        self.pki = pki
        self.targets = tmp / "targets"
        self.targets.mkdir(parents=True)
        self.url = ""  # once started
        self.log_path = tmp / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def write_config(self) -> Path:
        """The deployed config with 1 s intervals, the repo's alert rules, each job's
        discovery replaced by a file_sd file of this test and its TLS files by the test's CA
        and client certificate (job names, scheme and every other job setting kept)."""
        text = PROMETHEUS_YML.read_text()
        for deployed, ours in (("/etc/prometheus/gridrl/ca.crt", self.pki.ca),
                               ("/etc/prometheus/gridrl/prometheus.crt", self.pki.crt("client")),
                               ("/etc/prometheus/gridrl/prometheus.key", self.pki.key("client"))):
            assert deployed in text, deployed
            text = text.replace(deployed, ours)
        config = yaml.safe_load(text)
        config["global"].update(scrape_interval="1s", scrape_timeout="1s",
                                evaluation_interval="1s")
        config["rule_files"] = [str(PROMETHEUS_YML.parent / f) for f in config["rule_files"]]
        config.pop("alerting", None)
        for job in config["scrape_configs"]:
            for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
                del job[key]
            job["file_sd_configs"] = [{"files": [str(self.targets / f"{job['job_name']}.json")],
                                       "refresh_interval": "1s"}]
            self.set_targets(job["job_name"], [])
        path = self.tmp / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        return path

    def set_targets(self, job: str, targets: list[str]) -> None:
        path = self.targets / f"{job}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": targets}] if targets else []))
        os.replace(tmp, path)

    def start(self) -> None:
        config = self.write_config()
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.tmp / 'data'}",
             "--web.listen-address=127.0.0.1:0", "--log.level=info"],
            stdout=self.log_path.open("w"), stderr=subprocess.STDOUT)
        start = time.monotonic()
        bound = wait_for(lambda: _LISTENING.search(self.log()), timeout_s=60,
                         what="prometheus to bind", alive=self, every_s=0.1)
        self.url = f"http://127.0.0.1:{bound.group(1)}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(ready, timeout_s=max(0.0, 60 - (time.monotonic() - start)),
                 what="prometheus to be ready", alive=self, every_s=0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def api(self, path: str, **params: str) -> dict | list:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def wait_for(self, expr: str, what: str, timeout: float, services: list) -> None:
        """Until the instant query ``expr`` returns a series."""

        def answered() -> bool:
            if self.query(expr):
                return True
            for svc in services:
                assert svc.proc.poll() is None, f"{svc.log_path.name} exited:\n{svc.log()}"
            return False

        try:
            wait_for(answered, timeout_s=timeout, what=f"{what}: {expr!r}", every_s=0.5)
        except AssertionError as e:
            if not str(e).startswith("timed out"):
                raise  # a service exited: the message has its log
            logs = "\n".join(f"--- {s.log_path.name}\n{s.log()[-3000:]}" for s in services)
            raise AssertionError(f"{what}: {expr!r} still empty after {timeout} s\n{logs}") \
                from None

    def wait_for_rule_evaluation(self, timeout: float = 30) -> None:
        """Until every rule group has been evaluated after this call: rules run on their own
        1 s clock, so alerts read right after a scrape may still describe older samples."""
        since = time.time()

        def evaluated() -> bool:
            groups = self.api("rules")["groups"]
            stamps = [datetime.fromisoformat(g["lastEvaluation"][:26].rstrip("Z") + "+00:00")
                      .timestamp() for g in groups]
            return bool(groups) and min(stamps) > since

        wait_for(evaluated, timeout_s=timeout, what="every rule group's next evaluation",
                 every_s=0.2)

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# ----------------------------------------------------------------------------- dashboard


def _panels() -> list[dict]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return [p for p in out if p.get("type") != "row"]


def substitute(expr: str, rate_interval: str) -> str:
    """Grafana's substitutions for a whole-cluster view: ``$node`` = All (the variable's
    allValue ``.*``), ``$__rate_interval`` = ``rate_interval``. Any other variable fails."""
    out = re.sub(r"\$\{?__rate_interval\}?", rate_interval, expr)
    out = re.sub(r"\$\{?node\}?", ".*", out)
    assert "$" not in out, f"unknown dashboard variable in {expr!r}"
    return out


def test_substitute() -> None:
    assert substitute('rate(x{instance=~"$node"}[$__rate_interval]) + y{i=~"${node}"}', "42s") \
        == 'rate(x{instance=~".*"}[42s]) + y{i=~".*"}'
    with pytest.raises(AssertionError):
        substitute("x{job=~\"$job\"}", "1m")


def test_dashboard_model() -> None:
    """A Grafana dashboard JSON model with a Prometheus datasource variable that every
    panel and query uses, unique panel ids, and the panels the operators asked for."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["node"]["allValue"] == ".*" and variables["node"]["includeAll"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    panels = _panels()
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
        assert p["gridPos"]["w"] > 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    all_exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in [
        "gridrl_trainer_reward_mean", "gridrl_trainer_eval_score", "gridrl_trainer_loss",
        "gridrl_trainer_mismatch_kl", "gridrl_trainer_staleness_mean",
        "gridrl_trainer_dropped_samples_total", "gridrl_trainer_rollout_seconds",
        "gridrl_trainer_train_seconds", "gridrl_trainer_sync_seconds",
        "gridrl_trainer_tokens_per_second", "gridrl_trainer_nodes_synced",
        "gridrl_trainer_nodes_skipped", "gridrl_rollout_completion_tokens_total",
        "gridrl_trainer_node_group_seconds",
        "gridrl_rpc_requests_total", "gridrl_rpc_duration_seconds_bucket",
        "gridrl_rollout_time_to_first_token_seconds_bucket", "gridrl_rollout_batch_size",
        "gridrl_rollout_queue_depth", "gridrl_rollout_adapter_version",
        "gridrl_trainer_policy_version", "gridrl_rollout_push_bytes_total",
        "gridrl_rollout_push_duration_seconds", "gridrl_master_nodes",
    ]:
        assert metric in all_exprs, f"no panel queries {metric}"


def _check_panels(prom: Prometheus, rate_interval: str) -> tuple[list[str], int]:
    """Run every panel query; the problems found and the number of queries run."""
    problems = []
    checked = 0
    for panel in _panels():
        for target in panel["targets"]:
            expr = substitute(target["expr"], rate_interval)
            result = prom.query(expr)
            checked += 1
            where = f"panel {panel['title']!r} {target['refId']}: {expr}"
            if not result:
                problems.append(f"{where}: no series")
                continue
            values = [float(r["value"][1]) for r in result]
            if not any(math.isfinite(v) for v in values):
                problems.append(f"{where}: only NaN/Inf {values}")
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                if not all(label in r["metric"] for r in result):
                    problems.append(f"{where}: legend label {label!r} missing in "
                                    f"{[r['metric'] for r in result]}")
    return problems, checked


# ----------------------------------------------------------------------------- live


@pytest.mark.slow
def test_every_panel_query_returns_series_from_a_real_cluster(
        service_factory, tiny_llama_dir: Path, tmp_path: Path, pki, creds) -> None:
    t0 = time.time()
    prom = Prometheus(tmp_path / "prom", pki)
    services = []
    secure = [*pki.flags("server"), "--authorized-tokens", str(creds.authorized)]
    try:
        master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                                  "--metrics-port", "0", "--store", "", *secure], "master")
        services.append(master)
        node = service_factory(["gridrl-rollout", "serve", "--backend", "torch",
                                "--model", str(tiny_llama_dir), "--device", "cpu",
                                "--listen", "127.0.0.1:0", "--metrics-port", "0",
                                "--threads", "1", "--master", master.address,
                                "--adapter-root", str(tmp_path / "adapters"), *secure,
                                "--auth-token-file", str(creds.files["node"])], "rollout")
        services.append(node)
        prom.start()
        prom.set_targets("gridrl-master", [f"127.0.0.1:{master.metrics_port}"])
        prom.set_targets("gridrl-rollout", [f"127.0.0.1:{node.metrics_port}"])

        # Client traffic: two Generate calls and one the node refuses (top_p out of range).
        generate = [str(BIN / "gridrl-rollout"), "generate", "--address", node.address,
                    "--prompt", "reverse: red green blue", "--n", "2", "--max-tokens", "4",
                    "--json", *pki.flags("client"), "--auth-token-file",
                    str(creds.files["trainer"])]
        for seed in ("1", "2"):
            out = subprocess.run([*generate, "--seed", seed], capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 0, out.stderr
            assert len(json.loads(out.stdout)["samples"]) == 2
        bad = subprocess.run([*generate, "--top-p", "1.5"], capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr, bad.stderr

        trainer = service_factory(
            ["gridrl-trainer", "run", "--model", str(tiny_llama_dir),
             "--master", master.address, "--min-nodes", "1", "--node-wait-s", "60",
             "--steps", "1000", "--group-size", "2", "--max-tokens", "4",
             "--eval-every", "2", "--eval-tasks", "2", "--checkpoint-every", "1000",
             "--run-dir", str(tmp_path / "run"), "--device", "cpu",
             "--listen", "127.0.0.1:0", "--metrics-port", "0", *secure,
             "--auth-token-file", str(creds.files["trainer"])], "trainer",
            env={"OMP_NUM_THREADS": "1"})  # 2 shared cores: one torch thread is faster
        services.append(trainer)
        prom.set_targets("gridrl-trainer", [f"127.0.0.1:{trainer.metrics_port}"])
        # A second refused call, after Prometheus has seen the first: the error counter now
        # moves inside the window, so the errors panel must show a rate above 0.
        prom.wait_for('gridrl_rpc_requests_total{job="gridrl-rollout", code="INVALID_ARGUMENT"}',
                      "first refused Generate scraped", 30, services)
        bad = subprocess.run([*generate, "--top-p", "1.5"], capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr, bad.stderr

        # Enough for every panel: steps with syncs, an eval, a node serving a pushed adapter.
        prom.wait_for('gridrl_trainer_step{job="gridrl-trainer"} >= 3', "trainer steps", 240,
                      services)
        prom.wait_for('time() - gridrl_trainer_last_progress_timestamp_seconds{job="gridrl-trainer"}'
                      ' < 30', "the stalled-trainer clock follows the steps", 30, services)
        prom.wait_for('gridrl_rollout_adapter_version{job="gridrl-rollout"} >= 1',
                      "adapter pushed to the node", 60, services)
        prom.wait_for('gridrl_master_nodes{job="gridrl-master", role="rollout", '
                      'status="healthy"} == 1', "node registered", 60, services)
        prom.wait_for('count_over_time(up{job="gridrl-trainer"}[1m]) >= 3 and '
                      'up{job="gridrl-trainer"} == 1', "trainer scraped", 60, services)
        for job in JOB_OF_SERVICE.values():
            assert prom.query(f'up{{job="{job}"}} == 1'), f"{job} is not up"

        # rate()/increase() need two samples of a series in the window, and a series is born
        # when its first event happens (the first push, the trainer's metrics module loading
        # after the model): retry for a few scrapes before calling a panel empty.
        deadline = time.monotonic() + 30
        while True:
            rate_interval = f"{int(time.time() - t0) + 10}s"  # since the first call
            problems, checked = _check_panels(prom, rate_interval)
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert checked >= 40, f"only {checked} queries in the dashboard"
        [errors_panel] = [p for p in _panels() if p["title"] == "Errors by method and code"]
        errors = prom.query(substitute(errors_panel["targets"][0]["expr"], rate_interval))
        assert any(r["metric"] == {"job": "gridrl-rollout", "method": "Generate",
                                   "code": "INVALID_ARGUMENT"} and float(r["value"][1]) > 0
                   for r in errors), errors

        for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
            if variable["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
            assert m, f"variable {variable['name']}: unsupported {variable['definition']!r}"
            values = prom.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
            if values != [f"127.0.0.1:{node.metrics_port}"]:
                problems.append(f"variable {variable['name']}: {values}")
        assert not problems, "\n".join(problems)

        # Alert rules: loaded, every one evaluated without error; nothing fires on a healthy
        # cluster and no availability/stale alert is even pending.
        prom.wait_for_rule_evaluation()
        groups = prom.api("rules")["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        expected = {r.get("alert") or r.get("record")
                    for g in yaml.safe_load(ALERTS_YML.read_text())["groups"] for r in g["rules"]}
        assert set(loaded) == expected, (sorted(loaded), sorted(expected))
        for name, rule in loaded.items():
            assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)
        recorded = prom.query('gridrl:rpc_requests:rate5m{job="gridrl-rollout", '
                              'method="Generate", code="INVALID_ARGUMENT"}')
        assert recorded, "the recording rule does not see the refused Generate"
        alerts = prom.api("alerts")["alerts"]
        firing = [a for a in alerts if a["state"] == "firing"]
        assert not firing, firing
        pending = {a["labels"]["alertname"] for a in alerts}
        assert not pending & {"GridrlRolloutNodeDown", "GridrlMasterDown", "GridrlNoRolloutNodeUp",
                              "GridrlNodeStalePolicy", "GridrlTrainerStalled",
                              "GridrlRegisteredNodeUnhealthy"}, alerts
    finally:
        for svc in reversed(services):
            svc.stop()
        rc = prom.stop()
    assert rc == 0, f"prometheus exited {rc}:\n{prom.log()}"
