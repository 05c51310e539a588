"""``gridrl-trainer run`` against real ``gridrl-rollout serve`` nodes on the tiny llama: a torch
and an mlx node both take every sync and sample with the new version; a node killed mid-run
leaves the run to the other; kill -9 of the trainer and ``--resume`` continue the same steps
with the nodes on the resumed weights; ``--async-steps`` stays within the staleness bound; a
failed start leaves no run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from trainer_runs import BIN, ENV, ONE_THREAD, records, wait_for_step

pytestmark = pytest.mark.slow


def serve_node(service_factory, model_dir: Path, tmp_path: Path, name: str,
               backend: str = "torch", master: str | None = None, extra: tuple[str, ...] = ()):
    argv = ["gridrl-rollout", "serve", "--backend", backend, "--model", str(model_dir),
            "--listen", "127.0.0.1:0", "--metrics-port", "-1",
            "--adapter-root", str(tmp_path / f"{name}-adapters"), *extra]
    if master:
        argv += ["--master", master]
    return service_factory(argv, name, env=ONE_THREAD)


def trainer_args(model_dir: Path, run_dir: Path, nodes: list[str], steps: int,
                 **extra) -> list[str]:
    args = [str(BIN / "gridrl-trainer"), "run", "--model", str(model_dir), "--steps", str(steps),
            "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8",
            "--eval-every", "100", "--eval-tasks", "4", "--checkpoint-every", "100",
            "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--run-dir", str(run_dir),
            "--run-name", "nodes-run", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
            "--node-wait-s", "60", "--request-timeout-s", "60"]
    for node in nodes:
        args += ["--rollout", node]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def step_records(run_dir: Path) -> list[dict]:
    """The step records of ``run_dir/log.jsonl`` (torn lines skipped)."""
    return [r for r in records(run_dir) if r.get("step")]


def node_adapter(address: str):
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

    with dial(address) as channel:
        return rollout_pb2_grpc.RolloutServiceStub(channel).GetNodeInfo(
            rollout_pb2.GetNodeInfoRequest(), timeout=10).info.adapter


def warm_up(address: str) -> None:
    """One group through ``address`` (compiles the node's kernels), so the pool's latency
    estimates in the run are steady-state ones, not a cold start's."""
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    with dial(address) as channel:
        rollout_pb2_grpc.RolloutServiceStub(channel).Generate(rollout_pb2.GenerateRequest(
            prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(
                n=4, max_tokens=8, temperature=1.0)), timeout=120)


def run_trainer(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


@pytest.mark.mlx
@pytest.mark.parametrize("trainer", ["torch", "mlx"])
def test_torch_and_mlx_nodes_take_every_sync(tiny_llama_dir, tmp_path, service_factory, trainer):
    """With either trainer backend (``--backend mlx``: the all-Mac shop's trainer; its adapter
    reaches the torch node as peft and the mlx node in mlx-lm's layout)."""
    # The torch node is the faster one (~5x a group on the tiny model). Both hold one group at
    # a time (--capacity 4 = the group size), so each group's measured latency is one group's,
    # and with 16 groups a step the pool, giving each group to the node expected to finish it
    # first, sends some to the mlx node rather than queueing them all on torch (it would take
    # a >16x slower mlx node to starve it).
    torch_node = serve_node(service_factory, tiny_llama_dir, tmp_path, "node-torch",
                            extra=("--capacity", "4"))
    mlx_node = serve_node(service_factory, tiny_llama_dir, tmp_path, "node-mlx", backend="mlx",
                          extra=("--capacity", "4"))
    run_dir = tmp_path / "run"
    nodes = [torch_node.address, mlx_node.address]
    for node in nodes:  # a cold first group (the mlx node compiles) must not starve it later
        warm_up(node)
    run_trainer(trainer_args(tiny_llama_dir, run_dir, nodes, steps=4, min_nodes=2,
                             sync_every=1, eval_every=4, prompts_per_step=16, backend=trainer))
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    sampled_by = {n: 0 for n in nodes}
    for r in steps:
        assert r["nodes_synced"] == 2 and r["nodes_skipped"] == 0, r
        assert sorted(r["synced_nodes"]) == sorted(nodes) and r["lagging_nodes"] == []
        assert r["dropped_samples"] == 0 and r["staleness_mean"] == 0
        assert r["flagged_nodes"] == {}
        for node, stats in r["nodes"].items():
            sampled_by[node] += stats["samples"]
            # every sample was drawn with the version pushed at the end of the previous step
            assert stats["versions"] == [r["policy_version"] - 1], (r["step"], node, stats)
            # the node holds the trainer's weights: fp32 everywhere, so float rounding only
            assert stats["fresh_mismatch_kl"] < 1e-5, (node, stats)
    assert all(sampled_by.values()), sampled_by  # both nodes sampled
    mlx_steps = [r["step"] for r in steps if mlx_node.address in r["nodes"]]
    assert any(s >= 2 for s in mlx_steps), mlx_steps  # the mlx node sampled a pushed adapter
    for node in nodes:  # both serve the final adapter
        ref = node_adapter(node)
        assert (ref.name, ref.version) == ("nodes-run", 4)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_policy_version"] == 4 and summary["flagged_nodes"] == {}


def test_node_killed_mid_run_finishes_on_the_other(tiny_llama_dir, tmp_path, service_factory):
    a = serve_node(service_factory, tiny_llama_dir, tmp_path, "node-a")
    b = serve_node(service_factory, tiny_llama_dir, tmp_path, "node-b")
    run_dir = tmp_path / "run"
    log = (tmp_path / "trainer.log").open("w")
    proc = subprocess.Popen(trainer_args(tiny_llama_dir, run_dir, [a.address, b.address],
                                         steps=8, min_nodes=2),
                            stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_for_step(run_dir, 2, proc, timeout=120)
        b.stop(signal.SIGKILL)
        killed_after = max(r["step"] for r in step_records(run_dir))
        assert proc.wait(240) == 0, (tmp_path / "trainer.log").read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 9))
    later = [r for r in steps if r["step"] > killed_after + 1]
    assert later, "the kill came too late to test anything"
    for r in later:  # the survivor alone samples, on the current version, and takes the syncs
        assert list(r["nodes"]) == [a.address], r["nodes"]
        assert r["nodes"][a.address]["versions"] == [r["policy_version"] - 1]
        assert r["nodes"][a.address]["samples"] == 16 and r["dropped_samples"] == 0
        assert a.address in r["synced_nodes"]
    assert any(b.address in r.get("skipped_nodes", {}) for r in steps), \
        "the dead node's sync failure must be reported"
    assert (node_adapter(a.address).version) == 8


def test_trainer_kill_9_and_resume_with_a_node(tiny_llama_dir, tmp_path, service_factory):
    node = serve_node(service_factory, tiny_llama_dir, tmp_path, "node")
    run_dir = tmp_path / "run"
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(trainer_args(tiny_llama_dir, run_dir, [node.address], steps=40,
                                         checkpoint_every=3),
                            stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_for_step(run_dir, 4, proc, timeout=120)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = {r["step"]: r for r in step_records(run_dir)}
    ckpt_step = int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])
    assert 3 <= ckpt_step < max(before)
    held = node_adapter(node.address)  # the node holds a version of the killed run
    assert held.name == "nodes-run" and held.version == max(before)

    done = run_trainer([str(BIN / "gridrl-trainer"), "run", "--resume", str(run_dir),
                        "--steps", "10", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                        "--rollout", node.address])
    assert f"resumed at step {ckpt_step}" in done.stdout
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 11))  # same numbering, none twice
    first = next(r for r in steps if r["step"] == ckpt_step + 1)
    resumed_version = first["policy_version"] - 1
    assert resumed_version > held.version  # never a number the killed run pushed
    # the node was given the resumed weights before the first resumed step
    assert first["nodes"][node.address]["versions"] == [resumed_version]
    assert first["dropped_samples"] == 0 and first["flagged_nodes"] == {}
    # same weights and sampler seeds as before the kill: the same samples and rewards
    assert first["reward_mean"] == pytest.approx(before[ckpt_step + 1]["reward_mean"], abs=1e-9)
    assert first["sampled_tokens"] == before[ckpt_step + 1]["sampled_tokens"]
    assert node_adapter(node.address).version == steps[-1]["policy_version"]


def test_async_steps_stay_within_the_staleness_bound(tiny_llama_dir, tmp_path,
                                                     service_factory):
    node = serve_node(service_factory, tiny_llama_dir, tmp_path, "node")
    run_dir = tmp_path / "run"
    run_trainer(trainer_args(tiny_llama_dir, run_dir, [node.address], steps=6, async_steps=1,
                             sync_every=2))
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 7))
    bound = (2 - 1) + 1  # (sync_every - 1) + async_steps
    for r in steps:
        assert r["dropped_samples"] == 0 and r["flagged_nodes"] == {}
        assert r["staleness_max"] <= bound
        assert (r["nodes_synced"] == 1) == (r["step"] % 2 == 0)
    assert max(r["staleness_max"] for r in steps) >= 1  # samples really were older
    assert any(r["mismatch_kl"] > 1e-9 for r in steps if r["staleness_max"] > 0)


def test_nodes_from_the_master(tiny_llama_dir, tmp_path, service_factory):
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", "",
                              "--heartbeat-interval", "0.5"], "master", env=ONE_THREAD)
    node = serve_node(service_factory, tiny_llama_dir, tmp_path, "node-m", master=master.address)
    run_dir = tmp_path / "run"
    run_trainer(trainer_args(tiny_llama_dir, run_dir, [], steps=2, master=master.address))
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert list(r["nodes"]) == [node.address] and r["nodes_synced"] == 1
        assert r["nodes"][node.address]["versions"] == [r["policy_version"] - 1]
    assert node_adapter(node.address).version == 2


def test_bfloat16_node_is_held_to_the_16_bit_mismatch_bound(tiny_llama_dir, tmp_path,
                                                             service_factory):
    """A healthy bf16 node disagrees with the fp32 trainer by its rounding: it is judged by
    --mismatch-kl-max-16bit, not by the fp32 bound (here set below any rounding). With a
    16-bit bound below its rounding too it is flagged, and the flag acts: benched from the
    next step on (the fp32 node samples alone), its fresh checks failing."""
    node = serve_node(service_factory, tiny_llama_dir, tmp_path, "node-bf16",
                      extra=("--dtype", "bfloat16"))
    helper = serve_node(service_factory, tiny_llama_dir, tmp_path, "node-fp32")
    for low_bound, flagged in ((0.1, False), (1e-9, True)):
        run_dir = tmp_path / f"run-{low_bound}"
        nodes = [node.address, helper.address] if flagged else [node.address]
        args = trainer_args(tiny_llama_dir, run_dir, nodes, steps=3, sync_every=1,
                            flag_after=1, min_nodes=len(nodes),
                            mismatch_kl_max=1e-2 if flagged else 1e-9,
                            mismatch_kl_max_16bit=low_bound)
        args[args.index("nodes-run")] = f"bf16-run-{int(flagged)}"  # another run: reset first
        done = run_trainer(args)
        steps = step_records(run_dir)
        assert [r["step"] for r in steps] == [1, 2, 3]
        kl = steps[0]["nodes"][node.address]["fresh_mismatch_kl"]
        assert 1e-9 < kl < 0.1, steps[0]["nodes"]  # bf16 rounding: visible, far below 0.1
        for r in steps:
            assert (node.address in r["flagged_nodes"]) == flagged, r["flagged_nodes"]
            assert helper.address not in r["flagged_nodes"]
            if not flagged:
                kl = r["nodes"][node.address]["fresh_mismatch_kl"]
                assert 1e-9 < kl < 0.1, r["nodes"]
            elif r["step"] > 1:  # benched: no group, the other node samples the step
                assert list(r["nodes"]) == [helper.address], r["nodes"]
                assert r["nodes"][helper.address]["samples"] == 16
        if flagged:
            assert "16-bit bound" in steps[0]["flagged_nodes"][node.address]
            assert "benched: no new groups" in done.stdout
            assert f"node {node.address} stays benched: failed its fresh check" in done.stdout


def test_failed_start_leaves_no_run_directory(tiny_llama_dir, tmp_path, reserved_port):
    """No node answers within --node-wait-s: a clear error, exit 1, and no half-made run
    directory; --resume of a directory without a checkpoint: exit 2 naming the flag."""
    nobody = f"127.0.0.1:{reserved_port}"
    run_dir = tmp_path / "run"
    args = trainer_args(tiny_llama_dir, run_dir, [nobody], steps=2)
    args[args.index("--node-wait-s") + 1] = "2"
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "run failed" in done.stderr and nobody in done.stderr
    assert not run_dir.exists()
    run_dir.mkdir()
    done = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--resume", str(run_dir)],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "--resume" in done.stderr
    assert run_dir.exists()  # a resumed directory is never removed
