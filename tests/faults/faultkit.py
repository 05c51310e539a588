"""Helpers of the fault tests: real master / rollout / trainer processes on the tiny llama,
killed with SIGKILL at points the processes announce (``gridrl.common.faults``), and waits on
observable conditions (ready files, pause files, log.jsonl, GetRunStatus, master listings,
metrics) with deadlines — never sleeps as synchronisation."""

from __future__ import annotations

import json
import signal
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_runs import BIN, ONE_THREAD, records  # the trainer tests' helpers
from waiting import wait_for

__all__ = ["BIN", "ONE_THREAD", "wait_for"]

T = TypeVar("T")



class Cluster:
    """Starts the processes of one fault test (through ``service_factory``: stopped at
    teardown) in ``tmp_path``."""

    def __init__(self, service_factory: Callable[..., Any], tmp_path: Path,
                 model_dir: Path) -> None:
        self._start = service_factory
        self.tmp = tmp_path
        self.model_dir = model_dir

    def pause_env(self, name: str, point: str, nth: int) -> dict[str, str]:
        """Environment arming ``point`` (its ``nth`` hit) in process ``name``."""
        return {"GRIDRL_TEST_PAUSE_AT": f"{point}:{nth}",
                "GRIDRL_TEST_PAUSE_FILE": str(self.pause_file(name))}

    def pause_file(self, name: str) -> Path:
        return self.tmp / f"{name}.paused.json"

    def wait_paused(self, service: Any, name: str, timeout_s: float = 240) -> dict:
        """Wait until process ``name`` announces it paused; returns the pause file."""
        path = self.pause_file(name)
        wait_for(path.exists, timeout_s, f"{name} to reach its pause point", alive=service)
        return json.loads(path.read_text())

    def master(self, name: str = "master", port: int = 0, store: str = "",
               heartbeat_s: float = 1.0) -> Any:
        return self._start(["gridrl-master", "serve", "--listen", f"127.0.0.1:{port}",
                            "--metrics-port", "-1", "--store", store,
                            "--heartbeat-interval", str(heartbeat_s),
                            "--unhealthy-after", str(3 * heartbeat_s),
                            "--expire-after", str(30 * heartbeat_s)], name, env=ONE_THREAD)

    def node(self, name: str, port: int = 0, master: str | None = None,
             env: dict[str, str] | None = None, adapters: str | None = None) -> Any:
        """A torch node on the tiny llama holding one group of 4 at a time (so the groups of
        a step spread over the nodes); ``adapters``: its adapter root's name (a restarted
        node passes its first incarnation's)."""
        argv = ["gridrl-rollout", "serve", "--backend", "torch", "--model", str(self.model_dir),
                "--listen", f"127.0.0.1:{port}", "--metrics-port", "-1", "--threads", "1",
                "--capacity", "4",
                "--adapter-root", str(self.tmp / f"{adapters or name}-adapters")]
        if master:
            argv += ["--master", master]
        return self._start(argv, name, env={**ONE_THREAD, **(env or {})})

    def trainer_argv(self, run_dir: Path, steps: int, nodes: list[str] = (),
                     master: str | None = None, **extra: Any) -> list[str]:
        args = ["gridrl-trainer", "run", "--model", str(self.model_dir), "--steps", str(steps),
                "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8",
                "--eval-every", "1000", "--eval-tasks", "4", "--checkpoint-every", "1000",
                "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2",
                "--run-dir", str(run_dir), "--run-name", "fault-run",
                "--listen", "127.0.0.1:0", "--metrics-port", "0", "--node-wait-s", "120",
                "--request-timeout-s", "60", "--wait-for-nodes-s", "240"]
        for node in nodes:
            args += ["--rollout", node]
        if master:
            args += ["--master", master]
        for k, v in extra.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        return args

    def trainer(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Any:
        """Start ``gridrl-trainer run``; returns once its TrainerService is bound."""
        return self._start(argv, name, env={**ONE_THREAD, **(env or {})})


def port_of(service: Any) -> int:
    return int(service.address.rsplit(":", 1)[1])


def kill(service: Any) -> None:
    """SIGKILL a service and reap it."""
    service.proc.send_signal(signal.SIGKILL)
    service.proc.wait(30)


def finish(service: Any, timeout_s: float = 600) -> int:
    """Wait for a service to exit; its exit status."""
    try:
        return service.proc.wait(timeout_s)
    except Exception:
        raise AssertionError(f"{service.log_path.name} still running after {timeout_s}s:\n"
                             f"{service.log()[-4000:]}") from None


def step_records(run_dir: Path) -> list[dict]:
    """The step records of ``run_dir/log.jsonl`` (a line torn by a kill is skipped)."""
    return [r for r in records(run_dir) if r.get("step")]


def records_after(run_dir: Path, step: int, n: int = 1) -> Callable[[], list[dict]]:
    """A probe: the step records after ``step`` once there are at least ``n`` of them."""
    def probe() -> list[dict]:
        later = [r for r in step_records(run_dir) if r["step"] > step]
        return later if len(later) >= n else []

    return probe


def run_status(address: str):
    """The trainer's GetRunStatus, or None when it does not answer."""
    import grpc

    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import trainer_pb2, trainer_pb2_grpc

    with dial(address) as channel:
        try:
            return trainer_pb2_grpc.TrainerServiceStub(channel).GetRunStatus(
                trainer_pb2.GetRunStatusRequest(), timeout=10)
        except grpc.RpcError:
            return None


def node_adapter(address: str):
    """The adapter a rollout node reports serving (GetNodeInfo)."""
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

    with dial(address) as channel:
        return rollout_pb2_grpc.RolloutServiceStub(channel).GetNodeInfo(
            rollout_pb2.GetNodeInfoRequest(), timeout=10).info.adapter


def healthy_at_master(master: str) -> set[str]:
    """Addresses of the rollout nodes the master lists HEALTHY (empty when it does not
    answer)."""
    import grpc

    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

    with dial(master) as channel:
        try:
            nodes = registry_pb2_grpc.RegistryServiceStub(channel).ListNodes(
                registry_pb2.ListNodesRequest(role=common_pb2.NODE_ROLE_ROLLOUT), timeout=5).nodes
        except grpc.RpcError:
            return set()
    return {n.info.address for n in nodes if n.status == common_pb2.NODE_STATUS_HEALTHY}


def heard_since(master: str, since: float) -> dict[str, float]:
    """Rollout nodes the master heard from (registration or heartbeat) after ``since`` (POSIX
    seconds): address -> when (``last_seen``), by the master's clock."""
    import grpc

    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

    with dial(master) as channel:
        try:
            nodes = registry_pb2_grpc.RegistryServiceStub(channel).ListNodes(
                registry_pb2.ListNodesRequest(role=common_pb2.NODE_ROLE_ROLLOUT), timeout=5).nodes
        except grpc.RpcError:
            return {}
    seen = {n.info.address: n.last_seen.ToNanoseconds() / 1e9 for n in nodes}
    return {a: t for a, t in seen.items() if t > since}


def metric(metrics_port: int, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample of a service's Prometheus endpoint, or None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in (labels or {}).items()):
                return sample.value
    return None


def check_on_current_weights(records: list[dict]) -> None:
    """Every step of a run: nothing dropped, nothing flagged, every node's samples drawn with
    the version pushed at the end of the step before (so a restarted node served the current
    adapter before it sampled)."""
    for r in records:
        assert r["dropped_samples"] == 0 and r["flagged_nodes"] == {}, r
        for node, stats in r["nodes"].items():
            assert stats["versions"] == [r["policy_version"] - 1], (r["step"], node, stats)


def check_steps_once(records: list[dict], last: int) -> None:
    """Steps 1..last, each exactly once (none lost, none repeated)."""
    assert [r["step"] for r in records] == list(range(1, last + 1)), [r["step"] for r in records]
