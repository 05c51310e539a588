"""A rollout node with the vllm backend, against the stand-in vLLM server: Generate through gRPC
with behaviour logprobs of the contract, PushAdapter (landed under the adapter root, loaded under
a new name, the previous one unloaded), a failed load keeping the previous version serving,
loads never overlapping a batch; ``gridrl-rollout serve --backend vllm`` as a process with an
API key, registered with a real master; its refusals; one short trainer run against it."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import httpx
import pytest
from rollout_helpers import PROMPT, push_dir, rpc_error
from vllm_standin import StandInVllm
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.engine.backends.vllm.backend import VllmBackend
from gridrl.engine.contract import SamplingConfig
from gridrl.master.config import Liveness
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc, rollout_pb2, rollout_pb2_grpc

TOL = 1e-4
BIN = Path(sys.executable).parent
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture
def standin(tiny_llama_dir: Path):
    servers: list[StandInVllm] = []

    def start(**modes) -> StandInVllm:
        servers.append(StandInVllm(tiny_llama_dir, **modes).start())
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def vllm_node(live_node, tiny_llama_dir: Path, tmp_path: Path):
    """``vllm_node(server, **config)``: an in-process node whose backend fronts ``server``."""
    count = itertools.count()

    def start(server: StandInVllm, **config):
        root = tmp_path / f"vllm-node-{next(count)}" / "adapters"
        backend = VllmBackend.connect(server.url, tiny_llama_dir, root / ".vllm")
        return live_node(backend, adapter_root=root, **config)

    return start


@pytest.fixture
def reference(tiny_llama_dir: Path):
    from gridrl.engine.backends.torch.backend import TorchBackend

    return TorchBackend.from_pretrained(tiny_llama_dir)


def _check_samples(reference, response, sampling: SamplingConfig, handle=None) -> None:
    for s in response.samples:
        scored = reference.score(list(PROMPT), list(s.token_ids), sampling, handle)
        assert max(abs(a - b) for a, b in zip(scored, s.logprobs, strict=True)) < TOL


def _landed(node) -> list[str]:
    landing = node.node.adapters.store.root / ".vllm"
    return sorted(p.name for p in landing.iterdir())


def test_generate_and_push_through_vllm(standin, vllm_node, reference, tiny_adapters) -> None:
    server = standin(max_lora_rank=4)
    node = vllm_node(server)
    info = node.info()
    assert info.backend == common_pb2.BACKEND_VLLM and info.device == "vllm-0.33.0"
    assert info.adapter_format == common_pb2.ADAPTER_FORMAT_PEFT
    assert (info.adapter.name, info.adapter.version) == ("", 0)

    sampling = SamplingConfig(max_tokens=8, temperature=0.8, top_k=30)
    response = node.generate(n=4, max_tokens=8, temperature=0.8, top_k=30, seed=5)
    assert len(response.samples) == 4
    _check_samples(reference, response, sampling)

    pushed = push_dir(node.stub, tiny_adapters["a"], "run", 1)
    assert (pushed.serving.name, pushed.serving.version) == ("run", 1)
    assert node.info().adapter.version == 1
    first = set(server.loras)
    assert len(first) == 1 and _landed(node) == sorted(first)
    ref_a = reference.load_adapter(tiny_adapters["a"], "a")
    response = node.generate(n=4, max_tokens=8, temperature=0.8, top_k=30, seed=5)
    assert {(s.adapter_name, s.adapter_version) for s in response.samples} == {("run", 1)}
    _check_samples(reference, response, sampling, ref_a)

    # a load vLLM refuses (rank 8 > --max-lora-rank 4): v1 keeps serving, nothing is left
    err = rpc_error(lambda: push_dir(node.stub, tiny_adapters["b"], "run", 2))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--max-lora-rank" in err.details()
    assert node.info().adapter.version == 1 and set(server.loras) == first
    assert _landed(node) == sorted(first)
    again = node.generate(n=4, max_tokens=8, temperature=0.8, top_k=30, seed=5)
    assert again.samples == response.samples

    push_dir(node.stub, tiny_adapters["a"], "run", 3)  # served under a new name, v1's unloaded
    assert node.info().adapter.version == 3
    assert len(server.loras) == 1 and not set(server.loras) & first
    assert _landed(node) == sorted(server.loras)
    staged = push_dir(node.stub, tiny_adapters["a"], "run", 4, stage_only=True)
    assert staged.serving.version == 3 and len(server.loras) == 1  # loaded, then unloaded

    reloaded = node.stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(version=1), timeout=30)
    assert reloaded.serving.version == 1 and len(server.loras) == 1
    node.stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(base_model=True), timeout=30)
    # the base model serves by default; "run" stays resident for requests that name it
    # (issue 46: several runs' adapters on one node, --max-resident-adapters)
    assert node.info().adapter.version == 0
    assert len(server.loras) == 1 and _landed(node) == sorted(server.loras)
    named = node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_token_ids=[5, 6, 7], adapter_name="run",
        sampling=common_pb2.SamplingParams(max_tokens=3)), timeout=30)
    assert {(s.adapter_name, s.adapter_version) for s in named.samples} == {("run", 1)}
    assert len(server.loads) == len(set(server.loads))  # no name ever loaded twice

    for t in (3.0, 0.005):  # vLLM samples at 0 or in [0.01, 2]
        err = rpc_error(lambda t=t: node.generate(temperature=t))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("sampling.temperature")
    assert not server.violations


def test_loads_never_overlap_a_batch(standin, vllm_node, tiny_adapters) -> None:
    server = standin()
    server.step_delay = 0.005
    node = vllm_node(server, capacity=8)
    errors: list[Exception] = []
    versions: list[set[int]] = []

    def sample() -> None:
        try:
            for seed in range(3):
                r = node.generate(n=4, max_tokens=12, temperature=1.0, seed=seed)
                versions.append({s.adapter_version for s in r.samples})
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=sample) for _ in range(3)]
    for t in threads:
        t.start()
    for version in range(1, 4):
        push_dir(node.stub, tiny_adapters["a"], "run", version)
    for t in threads:
        t.join(120)
    assert not errors and len(versions) == 9
    assert all(len(v) == 1 for v in versions)  # every request sampled by one version
    assert server.violations == []  # vLLM never saw a load while completions ran


def test_an_unreachable_vllm_is_unavailable(standin, vllm_node, tiny_adapters) -> None:
    server = standin()
    node = vllm_node(server)
    push_dir(node.stub, tiny_adapters["a"], "run", 1)
    server.stop()
    assert rpc_error(lambda: node.generate()).code() == grpc.StatusCode.UNAVAILABLE
    err = rpc_error(lambda: push_dir(node.stub, tiny_adapters["a"], "run", 2))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert node.info().adapter.version == 1


# -- the process --------------------------------------------------------------------------------


def _serve_argv(server: StandInVllm, model: Path, root: Path, *extra: str,
                metrics_port: int = -1) -> list[str]:
    return ["gridrl-rollout", "serve", "--backend", "vllm", "--vllm-url", server.url,
            "--model", str(model), "--listen", "127.0.0.1:0",
            "--metrics-port", str(metrics_port), "--adapter-root", str(root), *extra]


def _records(master_address: str) -> list[registry_pb2.NodeRecord]:
    with dial(master_address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return list(stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5).nodes)


def test_serve_process_registers_generates_and_takes_pushes(standin, service_factory,
                                                            tiny_llama_dir, tmp_path, reference,
                                                            tiny_adapters) -> None:
    from gridrl.master.server import Master

    server = standin(api_key="s3cret", max_lora_rank=4)
    key_file = tmp_path / "vllm.key"
    key_file.write_text("s3cret\n")
    # the stand-in's model shares this process (and its GIL) with the master: lenient timings
    master = Master("127.0.0.1:0", liveness=Liveness(0.2, 10, 60), grace_s=0.5).start()
    try:
        node = service_factory(_serve_argv(server, tiny_llama_dir, tmp_path / "adapters",
                                           "--vllm-api-key-file", str(key_file),
                                           "--master", master.address, metrics_port=0),
                               "vllm-node")
        wait_for(lambda: len(_records(master.address)) == 1)
        info = _records(master.address)[0].info
        assert info.backend == common_pb2.BACKEND_VLLM
        assert info.adapter_format == common_pb2.ADAPTER_FORMAT_PEFT
        assert info.address == node.address

        with dial(node.address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            sampling = common_pb2.SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=1)
            response = stub.Generate(rollout_pb2.GenerateRequest(
                prompt_token_ids=PROMPT, sampling=sampling), timeout=60)
            _check_samples(reference, response, SamplingConfig(max_tokens=6, temperature=0.9))
            text = stub.Generate(rollout_pb2.GenerateRequest(
                prompt_text="the cat", apply_chat_template=True,
                sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=60)
            assert list(text.prompt_token_ids) == PROMPT  # tokenized by the node, not vLLM
            assert server.completions[-1]["prompt"] == PROMPT and text.samples[0].text

            push_dir(stub, tiny_adapters["a"], "run", 1)
            wait_for(lambda: _records(master.address)[0].info.adapter.version == 1)
            err = rpc_error(lambda: push_dir(stub, tiny_adapters["b"], "run", 2))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(),
                                    timeout=10).info.adapter.version == 1
            assert _records(master.address)[0].info.adapter.version == 1
        metrics = httpx.get(f"http://127.0.0.1:{node.metrics_port}/metrics").text
        assert "gridrl_rollout_adapter_version 1.0" in metrics  # the same metrics as any node
        tokens = [line for line in metrics.splitlines()
                  if line.startswith("gridrl_rollout_completion_tokens_total ")]
        assert tokens and float(tokens[0].split()[1]) >= 3
        assert node.stop(signal.SIGTERM) == 0
        wait_for(lambda: not _records(master.address))
        assert "processed logprobs" in node.log()
    finally:
        master.stop(0)


def test_serve_refuses_a_misconfigured_vllm(standin, tiny_llama_dir, tmp_path) -> None:
    def serve(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "gridrl-rollout"), *argv], capture_output=True,
                              text=True, timeout=120)

    raw = standin(logprobs_mode="raw_logprobs")
    done = serve(*_serve_argv(raw, tiny_llama_dir, tmp_path / "a")[1:])
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--logprobs-mode processed_logprobs" in done.stderr
    no_lora = standin(enable_lora=False)
    done = serve(*_serve_argv(no_lora, tiny_llama_dir, tmp_path / "b")[1:])
    assert done.returncode == 1 and "--enable-lora" in done.stderr
    done = serve("serve", "--backend", "torch", "--vllm-url", raw.url)
    assert done.returncode == 2 and "only with --backend vllm" in done.stderr
    done = serve("serve", "--backend", "vllm", "--model", str(tiny_llama_dir))
    assert done.returncode == 2 and "--vllm-url" in done.stderr
    done = serve("serve", "--backend", "vllm", "--vllm-url", "localhost:8000",
                 "--model", str(tiny_llama_dir))
    assert done.returncode == 2 and "base URL" in done.stderr


@pytest.mark.slow
def test_a_trainer_run_against_a_vllm_node(standin, service_factory, tiny_llama_dir,
                                           tmp_path) -> None:
    server = standin()
    node = service_factory(_serve_argv(server, tiny_llama_dir, tmp_path / "adapters",
                                       "--capacity", "16"), "vllm-node", env=ONE_THREAD)
    run_dir = tmp_path / "run"
    args = [str(BIN / "gridrl-trainer"), "run",
            "--model", str(tiny_llama_dir), "--steps", "3", "--prompts-per-step", "4",
            "--group-size", "4", "--max-tokens", "8", "--eval-every", "100", "--eval-tasks", "4",
            "--checkpoint-every", "100", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2",
            "--run-dir", str(run_dir), "--run-name", "vllm-run", "--listen", "127.0.0.1:0",
            "--metrics-port", "-1", "--node-wait-s", "60", "--request-timeout-s", "60",
            "--rollout", node.address, "--sync-every", "1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **ONE_THREAD})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    steps = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r.get("step")]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        stats = r["nodes"][node.address]
        assert r["nodes_synced"] == 1 and r["dropped_samples"] == 0, r
        assert stats["versions"] == [r["policy_version"] - 1], r  # sampled the pushed version
        assert stats["fresh_mismatch_kl"] < 1e-3, stats  # behaviour logprobs = the policy's
    with dial(node.address) as channel:
        adapter = rollout_pb2_grpc.RolloutServiceStub(channel).GetNodeInfo(
            rollout_pb2.GetNodeInfoRequest(), timeout=10).info.adapter
    assert (adapter.name, adapter.version) == ("vllm-run", 3)
    assert len(server.loras) == 1 and server.violations == []
