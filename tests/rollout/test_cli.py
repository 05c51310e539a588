"""``gridrl-rollout``: a real ``serve`` subprocess driven by the client commands."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from engine_helpers import PROMPT
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.models import weights_fingerprint
from gridrl.rollout.cli import main
from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


def test_cli_import_is_light() -> None:
    code = ("import sys, gridrl.rollout.cli; "
            "heavy = [m for m in ('torch', 'transformers', 'mlx', 'peft') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_flag_has_an_env_var() -> None:
    runner = CliRunner()
    for command in ("serve", "generate", "push-adapter", "reload-adapter", "info"):
        cmd = main.commands[command]
        for param in cmd.params:
            if param.param_type_name == "option" and param.name != "help":
                assert param.envvar and param.envvar.startswith("GRIDRL_"), (command, param.name)
        result = runner.invoke(main, [command, "--help"])
        assert result.exit_code == 0 and "GRIDRL_" in result.output


@pytest.fixture
def served(service_factory, tiny_llama_dir: Path, tmp_path: Path):
    root = tmp_path / "adapters"
    node = service_factory(["gridrl-rollout", "serve", "--model", str(tiny_llama_dir),
                            "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--threads", "1",
                            "--adapter-root", str(root), "--max-n", "8"], "rollout")
    return node, root


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_client_commands(served, tiny_adapters, tiny_llama_dir) -> None:
    node, root = served
    address = ["--address", node.address]
    code, out = _run("info", *address)
    assert code == 0 and "torch" in out and "the base model" in out, out
    fingerprint = weights_fingerprint(tiny_llama_dir)
    assert fingerprint.startswith("wfp1:") and fingerprint in out
    code, out = _run("info", *address, "--json")
    info = json.loads(out)["info"]
    assert info["backend"] == "BACKEND_TORCH" and info["capacity"] == 64
    assert info["base_model"]["weights_fingerprint"] == fingerprint

    ids = ",".join(map(str, PROMPT))
    code, out = _run("generate", *address, "--prompt-ids", ids, "--n", "2", "--max-tokens", "4",
                     "--temperature", "0.8", "--top-k", "10", "--top-p", "0.9", "--seed", "3",
                     "--json")
    assert code == 0, out
    response = json.loads(out)
    assert [int(i) for i in response["prompt_token_ids"]] == PROMPT
    assert len(response["samples"]) == 2
    assert all(len(s["logprobs"]) == len(s["token_ids"]) == 4 for s in response["samples"])
    code, again = _run("generate", *address, "--prompt-ids", ids, "--n", "2", "--max-tokens",
                       "4", "--temperature", "0.8", "--top-k", "10", "--top-p", "0.9", "--seed",
                       "3", "--json")
    assert json.loads(again)["samples"] == response["samples"]
    code, out = _run("generate", *address, "--prompt", "the cat", "--max-tokens", "3")
    assert code == 0 and "--- sample 0 (3 tokens, length" in out, out

    code, out = _run("push-adapter", *address, str(tiny_adapters["a"]), "--name", "run")
    assert code == 0 and "pushed run v1" in out and "serving run v1" in out, out
    code, out = _run("push-adapter", *address, str(tiny_adapters["b"]), "--name", "run",
                     "--stage-only")
    assert code == 0 and "pushed run v2" in out and "serving run v1" in out, out
    code, out = _run("reload-adapter", *address, "--version", "2")
    assert code == 0 and "serving run v2" in out, out
    code, out = _run("reload-adapter", *address, "--base")
    assert code == 0 and "serving the base model" in out, out
    code, out = _run("reload-adapter", *address, "--path", "pushed/run/v1", "--json")
    assert code == 0 and json.loads(out)["serving"] == {"name": "run", "version": "1"}
    code, out = _run("info", *address)
    assert "run v1" in out and "run v1, run v2" in out, out
    assert sorted(p.name for p in (root / "pushed" / "run").iterdir()) == ["v1", "v2"]

    # errors: the status and the field, exit 1; usage errors exit 2
    code, out = _run("generate", *address, "--prompt-ids", ids, "--n", "9")
    assert code == 1 and "error: INVALID_ARGUMENT: sampling.n: must be in [1, 8]" in out, out
    code, out = _run("reload-adapter", *address, "--path", "../x")
    assert code == 1 and "error: INVALID_ARGUMENT: path: " in out, out
    code, out = _run("reload-adapter", *address)
    assert code == 2 and "exactly one of --version, --path and --base" in out
    code, out = _run("generate", *address)
    assert code == 2

    assert node.stop(signal.SIGTERM) == 0
    assert "serving gridrl.v1.RolloutService" in node.log()
    # one start-up line says which forward and which adapter strategy run, and why
    start_up = [line for line in node.log().splitlines() if "torch backend:" in line]
    assert len(start_up) == 1, start_up
    assert "forward: lean (llama model, " in start_up[0], start_up
    assert "adapters: lean LoRA factors (the node runs the lean forward)" in start_up[0], \
        start_up


def _active_sequences(metrics_port: int) -> float:
    """``gridrl_rollout_active_sequences`` scraped from a node's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("gridrl_rollout_active_sequences "):
                return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize(("backend", "busy"), [
    ("torch", True),
    pytest.param("mlx", False, marks=pytest.mark.mlx),
    pytest.param("mlx", True, marks=pytest.mark.mlx),
], ids=["torch-decoding", "mlx-idle", "mlx-decoding"])
def test_sigterm_exits_zero(service_factory, tiny_llama_dir: Path, tmp_path: Path, backend: str,
                            busy: bool) -> None:
    """SIGTERM ends a node with exit 0, idle or while it decodes a batch with more queued
    (calls in flight get the grace period, then the rest are cancelled and the batch
    stopped): no thread is left inside torch or MLX as the interpreter exits, and every
    caller gets an answer. (The torch node's idle SIGTERM is in test_client_commands.)"""
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        pytest.importorskip("mlx_lm")
    node = service_factory(["gridrl-rollout", "serve", "--backend", backend, "--model",
                            str(tiny_llama_dir), "--listen", "127.0.0.1:0", "--metrics-port",
                            "0", "--adapter-root", str(tmp_path / "adapters"), "--max-n", "8"],
                           f"rollout-{backend}")
    channel = dial(node.address)
    calls = []
    try:
        if busy:
            # Eight requests of one batch each: the node decodes one and queues the rest, so
            # the SIGTERM finds work in flight however fast the tiny model decodes.
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            calls = [stub.Generate.future(rollout_pb2.GenerateRequest(
                prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(
                    n=8, max_tokens=480, temperature=1.0, seed=i)), timeout=300)
                for i in range(8)]
            wait_for(lambda: _active_sequences(node.metrics_port) > 0, 120)
            assert not all(call.done() for call in calls)
        code = node.stop(signal.SIGTERM, timeout=120)
        unfinished = [call.exception(timeout=60) for call in calls]
    finally:
        channel.close()
    log = node.log()
    assert code == 0, log[-3000:]
    assert "terminate called" not in log and "Traceback" not in log, log[-3000:]
    # Every request the SIGTERM found got its answer: its samples when it finished within
    # the grace period, else a cancellation; none was left hanging or failed otherwise.
    codes = {e.code() for e in unfinished if e is not None}
    assert codes <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}, codes


def test_serve_refuses_bad_flags(tmp_path: Path) -> None:
    code, out = _run("serve", "--model", str(tmp_path / "missing"), "--listen", "127.0.0.1:0")
    assert code == 2 and "--model" in out
    code, out = _run("serve", "--device", "tpu")
    assert code == 2 and "--device" in out
    code, out = _run("serve", "--backend", "mlx", "--dtype", "bfloat16")
    assert code == 2 and "--dtype" in out
    code, out = _run("serve", "--master", "nohost")
    assert code == 2 and "--master" in out


def test_generate_with_a_system_message_names_the_adapter(served, tiny_adapters) -> None:
    """``generate --system`` reproduces a task's prompt (a system turn before the user's) and
    each sample's header names the adapter; the node's reports are ordered (a push's answer
    after the info read before it, before the info read after it: NodeInfo.sequence)."""
    node, _ = served
    address = ["--address", node.address]

    def info_sequence() -> int:
        with dial(node.address) as channel:
            return rollout_pb2_grpc.RolloutServiceStub(channel).GetNodeInfo(
                rollout_pb2.GetNodeInfoRequest(), timeout=10).info.sequence

    before = info_sequence()
    code, out = _run("push-adapter", *address, str(tiny_adapters["a"]), "--name", "run",
                     "--json")
    assert code == 0, out
    pushed = int(json.loads(out)["sequence"])
    assert 0 < before < pushed < info_sequence()

    code, plain = _run("generate", *address, "--prompt", "the cat", "--max-tokens", "2",
                       "--json")
    code, system = _run("generate", *address, "--prompt", "the cat", "--max-tokens", "2",
                        "--system", "the dog", "--json")
    assert code == 0, system
    ids = [json.loads(o)["prompt_token_ids"] for o in (plain, system)]
    assert len(ids[1]) > len(ids[0])  # the system turn is in the prompt
    code, out = _run("generate", *address, "--prompt", "the cat", "--max-tokens", "2",
                     "--timeout", "30")  # the former flag name still works
    assert code == 0 and "--- sample 0 (2 tokens, length" in out, out
    assert "adapter run v1)" in out.splitlines()[0], out
    code, out = _run("generate", *address, "--prompt", "the cat", "--no-chat", "--system", "x")
    assert code == 2 and "--system" in out and "needs --prompt with --chat" in out, out
    code, out = _run("generate", "--help")
    assert "--timeout-s" in out and "--timeout " not in out  # the old name is hidden


def test_port_zero_node_removes_its_directory_and_cache_prunes(service_factory, tiny_llama_dir,
                                                               tmp_path, monkeypatch) -> None:
    """A port-0 node without --name or --adapter-root keeps its adapters in
    <cache>/rollout/<host>-pid<pid>, never reused: it removes that directory when it stops.
    ``gridrl-rollout cache --prune`` removes those of killed ones, and keeps named ones."""
    cache = tmp_path / "cache"
    node = service_factory(["gridrl-rollout", "serve", "--model", str(tiny_llama_dir),
                            "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--threads",
                            "1"], "rollout", env={"GRIDRL_CACHE_DIR": str(cache)})
    (own,) = (cache / "rollout").iterdir()
    assert own.name.endswith(f"-pid{node.proc.pid}") and (own / "adapters").is_dir()
    assert node.stop(signal.SIGTERM) == 0
    assert not own.exists()

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process id no longer alive
    killed = cache / "rollout" / f"host-pid{gone.pid}"
    named = cache / "rollout" / "host-50051"
    for d in (killed, named):
        (d / "adapters").mkdir(parents=True)
        (d / "adapters" / "weights").write_bytes(b"x" * 2_000_000)
    monkeypatch.setenv("GRIDRL_CACHE_DIR", str(cache))
    code, out = _run("cache")
    assert code == 0, out
    assert out.splitlines()[0] == f"{cache / 'rollout'}: 2 node directories"
    assert f"process {gone.pid} gone: --prune removes it" in out
    assert "named: kept for the node's next start" in out
    code, out = _run("cache", "--prune")
    assert code == 0 and out.splitlines()[-1] == "pruned 1 directory, 2.0 MB", out
    assert not killed.exists() and named.exists()
