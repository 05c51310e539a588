"""Helpers of the partition tests (tests/faults/test_partitions.py) over the network fleet
harness (tests/netfleet.py): a master, rollout nodes and a trainer, each in its own namespace,
with the short deadlines and keepalives that keep each test short, and a watch of the run's
steps that notes when each step record appeared (what a stall is measured on)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from netfleet import Fleet, Proc

# The bounds these tests run under (each one setting; docs/reliability.md lists them).
MASTER_FLAGS = ("--heartbeat-interval", "0.5", "--unhealthy-after", "2",
                "--expire-after", "60")
KEEPALIVE_FLAGS = ("--keepalive-s", "1", "--keepalive-timeout-s", "2")
# The same on the nodes' own channels (to the master, to relay sources).
NODE_KEEPALIVE_FLAGS = ("--keepalive-s", "1", "--keepalive-timeout-s", "2")


def trainer_flags(steps: int, **extra: object) -> list[str]:
    """A short run on the tiny llama: 4 prompts a step, groups of 4, 8 tokens."""
    args = ["--steps", str(steps), "--prompts-per-step", "4", "--group-size", "4",
            "--max-tokens", "8", "--eval-every", "1000", "--eval-tasks", "4",
            "--checkpoint-every", "1000", "--lora-rank", "4", "--lora-alpha", "8",
            "--lr", "1e-2", "--run-name", "partition-run", "--start-wait-s", "120",
            *KEEPALIVE_FLAGS]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


class StepWatch:
    """Follows ``run_dir/log.jsonl`` from a thread; ``seen[step]`` is the monotonic time its
    record appeared (within the poll period, 50 ms)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "log.jsonl"
        self.seen: dict[int, float] = {}
        self.records: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.poll()

    def poll(self) -> None:
        if not self.path.exists():
            return
        for line in self.path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = r.get("step")
            if step and step not in self.records:
                self.records[step] = r
                self.seen[step] = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def last(self) -> int:
        return max(self.records, default=0)

    def steps_after(self, t: float) -> list[int]:
        """Steps whose record appeared after monotonic time ``t``."""
        return sorted(s for s, at in self.seen.items() if at > t)

    def ordered(self) -> list[dict]:
        return [self.records[s] for s in sorted(self.records)]


def pause_env(fleet: Fleet, name: str, point: str, nth: int) -> dict[str, str]:
    """Arm a test pause point (gridrl.common.faults) in process ``name``."""
    return {"GRIDRL_TEST_PAUSE_AT": f"{point}:{nth}",
            "GRIDRL_TEST_PAUSE_FILE": str(pause_file(fleet, name))}


def pause_file(fleet: Fleet, name: str) -> Path:
    return fleet.workdir / f"{name}.paused.json"


def node_samples(record: dict, node: Proc) -> dict | None:
    """``record["nodes"][node.address]`` (what the node sampled for the step), or None."""
    return record.get("nodes", {}).get(node.address)


def check_versions(records: list[dict], max_staleness: int) -> None:
    """No step trained on samples more than ``max_staleness`` versions behind the policy
    it updated; nothing dropped or flagged."""
    for r in records:
        assert r["flagged_nodes"] == {}, r
        for node, stats in r["nodes"].items():
            for v in stats["versions"]:
                assert r["policy_version"] - 1 - v <= max_staleness, (r["step"], node, stats)
