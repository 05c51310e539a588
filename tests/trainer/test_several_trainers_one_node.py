"""Several real trainer processes on one node (issue 46 items 1 and 2): a master, one rollout
node (tiny llama) and three ``gridrl-trainer run`` processes with their own run names and
learning rates, all at once on that node. Each run trains (its steps complete), every sample it
trained on was drawn with its own adapter at the version it had pushed (the node returns the
run's adapter name on its rows, the trainer keeps only samples of its own current version, and
the behaviour logprobs equal the trainer's own policy's: mismatch KL at float rounding), the node
holds each run's adapter, and the node's share per run shows on the master's dashboard data
(``/api/state``, from the node's heartbeats)."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest
from trainer_runs import BIN, ENV, ONE_THREAD, records, write_task_files
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.slow

RUNS = {"alpha": "1e-2", "beta": "2e-2", "gamma": "5e-3"}
STEPS = 3


def _state(url: str) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + "/api/state", timeout=10) as reply:
        return json.loads(reply.read())


def test_three_trainers_share_one_node(service_factory, tiny_llama_dir: Path,
                                       tmp_path: Path) -> None:
    data, reward = write_task_files(tmp_path)
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", "", "--heartbeat-interval",
                              "0.5", "--unhealthy-after", "5", "--expire-after", "300",
                              "--dashboard-port", "0"], "master", env=ONE_THREAD)
    node = service_factory(["gridrl-rollout", "serve", "--backend", "torch", "--model",
                            str(tiny_llama_dir), "--listen", "127.0.0.1:0", "--metrics-port",
                            "-1", "--adapter-root", str(tmp_path / "node-adapters"),
                            "--master", master.address], "node", env=ONE_THREAD)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, lr in RUNS.items():
            log = (tmp_path / f"{name}.log").open("w")
            procs[name] = subprocess.Popen(
                [str(BIN / "gridrl-trainer"), "run", "--model", str(tiny_llama_dir),
                 "--task", str(data), "--reward-file", str(reward), "--master", master.address,
                 "--steps", str(STEPS), "--prompts-per-step", "2", "--group-size", "4",
                 "--max-tokens", "6", "--lora-rank", "4", "--lora-alpha", "8", "--lr", lr,
                 "--eval-every", str(STEPS), "--eval-tasks", "4", "--checkpoint-every", "10", "--run-name", name,
                 "--run-dir", str(tmp_path / name), "--listen", "127.0.0.1:0",
                 "--metrics-port", "-1", "--node-wait-s", "300", "--request-timeout-s", "120"],
                stdout=log, stderr=subprocess.STDOUT, env=ENV)
        for name, proc in procs.items():
            assert proc.wait(900) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
        for name, lr in RUNS.items():
            logged = [r for r in records(tmp_path / name) if r.get("step")]
            assert sorted(r["step"] for r in logged) == list(range(1, STEPS + 1)), name
            for r in logged:
                assert r["updated"] and r["samples_used"] > 0, (name, r)
                # all from the one node; every sample on the version this run had pushed
                assert list(r["nodes"]) == [node.address], (name, r["nodes"])
                assert r["nodes"][node.address]["versions"] == [r["step"] - 1], (name, r)
                assert r["mismatch_kl"] < 1e-6, (name, r["step"], r["mismatch_kl"])
            assert float(json.loads((tmp_path / name / "config.json").read_text())["lr"]) \
                == float(lr)
        # the node holds each run's adapter (pushed STEPS times: version STEPS)
        with dial(node.address) as channel:
            info = rollout_pb2_grpc.RolloutServiceStub(channel).GetNodeInfo(
                rollout_pb2.GetNodeInfoRequest(), timeout=30).info
        resident = {a.name: a.version for a in info.resident_adapters}
        assert all(resident.get(name) == STEPS for name in RUNS), resident
        node_shares = {s.run: s.share for s in info.run_shares}
        assert set(RUNS) <= set(node_shares), node_shares
        assert all(node_shares[name] > 0 for name in RUNS)
        # and the master's dashboard data shows the node's share per run
        url = master.info["dashboard_url"]

        def shown() -> dict:
            rows = [row for row in _state(url)["fleet"] if row.get("address") == node.address]
            return rows[0].get("run_shares", {}) if rows else {}

        wait_for(lambda: set(RUNS) <= set(shown()), 30, "the node's shares on the dashboard")
        assert shown() == pytest.approx(node_shares)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
