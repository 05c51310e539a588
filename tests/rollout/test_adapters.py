"""PushAdapter and ReloadAdapter over real channels on the tiny llama: a pushed peft (or mlx-lm)
adapter makes the node produce exactly what peft gives locally; failed pushes change nothing
and leave nothing half-written; a push interrupts the generate in flight, which decodes again
on the new adapter (tests/rollout/test_push_preemption.py: long generations); reloads by
version, by path (never outside the root) and back to the base model."""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
from pathlib import Path

import grpc
import pytest
from engine_helpers import PROMPT, make_peft_adapter, peft_reference, reference_greedy
from prometheus_client import REGISTRY
from rollout_helpers import GatedBackend, push_dir, push_files, rpc_error, tree
from waiting import wait_for

from gridrl.adapters import build_manifest, convert_files, read_dir, write_dir
from gridrl.common.transport import push_requests
from gridrl.rollout import adapter_manager
from gridrl.v1 import rollout_pb2


def _greedy(node, steps: int = 8):
    return node.generate(max_tokens=steps, temperature=0).samples[0]


def _assert_serves_like_peft(node, base_dir: Path, adapter_dir: Path | None, version: int,
                             name: str = "a") -> None:
    ref_tokens, ref_lps = reference_greedy(peft_reference(base_dir, adapter_dir), PROMPT, 8)
    sample = _greedy(node)
    assert list(sample.token_ids) == ref_tokens
    assert list(sample.logprobs) == pytest.approx(ref_lps, abs=1e-4)
    assert sample.adapter_version == version
    assert sample.adapter_name == (name if version else "")


def test_push_serves_exactly_what_peft_gives(live_node, tiny_llama_dir, tiny_adapters) -> None:
    node = live_node()
    base = _greedy(node)
    response = push_dir(node.stub, tiny_adapters["a"], "a", 1)
    assert (response.serving.name, response.serving.version) == ("a", 1)
    assert not response.converted
    size = sum(len(b) for b in read_dir(tiny_adapters["a"]).values())
    assert response.bytes_received == size
    t = response.timings
    assert t.receive_s >= 0 and t.verify_s > 0 and t.convert_s == 0 and t.apply_s > 0
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 1)
    assert list(_greedy(node).token_ids) != list(base.token_ids)
    # a second adapter replaces the first
    push_dir(node.stub, tiny_adapters["b"], "a", 2)
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["b"], 2)
    info = node.info()
    assert (info.adapter.name, info.adapter.version) == ("a", 2)
    assert [(r.name, r.version) for r in info.stored_adapters] == [("a", 1), ("a", 2)]
    root = node.node.adapters.store.pushed_root
    assert node.node.adapters.flush(timeout=30)  # the push is stored after its reply
    assert tree(root) == ["a", "a/v1", *[f"a/v1/{p}" for p in sorted(
        [".gridrl-adapter.json", *read_dir(tiny_adapters["a"])])], "a/v2", *[
        f"a/v2/{p}" for p in sorted([".gridrl-adapter.json", *read_dir(tiny_adapters["b"])])]]
    assert REGISTRY.get_sample_value("gridrl_rollout_adapter_version") == 2


def test_mlx_push_is_converted(live_node, tiny_llama_dir, tiny_adapters) -> None:
    node = live_node()
    mlx_files = convert_files(read_dir(tiny_adapters["a"]), "mlx", num_layers=2)
    manifest = build_manifest(mlx_files, name="m", version=3)
    assert manifest.format == "mlx"
    response = push_files(node.stub, mlx_files, manifest.to_dict())
    assert response.converted and response.timings.convert_s > 0
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 3, name="m")


def test_stage_only_and_idempotent_retry(live_node, tiny_llama_dir, tiny_adapters) -> None:
    node = live_node()
    response = push_dir(node.stub, tiny_adapters["a"], "a", 1, stage_only=True)
    assert response.serving.version == 0
    _assert_serves_like_peft(node, tiny_llama_dir, None, 0)
    assert [r.version for r in node.info().stored_adapters] == [1]
    # pushing the same version again serves what is stored
    response = push_dir(node.stub, tiny_adapters["a"], "a", 1)
    assert response.serving.version == 1
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 1)
    # ... but other files under a stored version are refused
    e = rpc_error(lambda: push_dir(node.stub, tiny_adapters["b"], "a", 1))
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS
    assert e.details().startswith("header.manifest.version: ")
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 1)


def test_digests_in_the_trailer(live_node, tiny_llama_dir, tiny_adapters) -> None:
    """The trainer's push: a manifest without digests, the sha256 of each file after its bytes.
    The node serves it, stores the digests (a retry with them in the header is the same push),
    and refuses a trailer that does not match the bytes, keeping the previous adapter."""
    node = live_node()
    files = read_dir(tiny_adapters["a"])
    undigested = build_manifest(files, name="a", version=1, hash_files=False).to_dict()
    assert all(f["sha256"] == "" for f in undigested["files"])
    assert push_files(node.stub, files, undigested).serving.version == 1
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 1)
    assert push_dir(node.stub, tiny_adapters["a"], "a", 1).serving.version == 1
    other = read_dir(tiny_adapters["b"])
    e = rpc_error(lambda: push_files(node.stub, other, build_manifest(
        other, name="a", version=1, hash_files=False).to_dict()))
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS
    requests = list(push_requests(build_manifest(other, name="a", version=2,
                                                 hash_files=False).to_dict(), other))
    requests[-1].trailer.file_sha256[0] = "0" * 64
    e = rpc_error(lambda: node.stub.PushAdapter(iter(requests), timeout=30))
    assert e.code() == grpc.StatusCode.DATA_LOSS and "trailer's" in e.details()
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 1)
    assert [r.version for r in node.info().stored_adapters] == [1]


def _bad_shape_files(adapter: Path) -> dict[str, bytes]:
    """The adapter with one lora_B one row too tall (hidden size unchanged)."""
    import torch
    from safetensors.torch import load, save

    files = read_dir(adapter)
    tensors = load(files["adapter_model.safetensors"])
    key = next(k for k in sorted(tensors) if k.endswith("mlp.up_proj.lora_B.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    files["adapter_model.safetensors"] = save(tensors, metadata={"format": "pt"})
    return files


def _other_model_adapter(tmp_path: Path) -> Path:
    from gridrl.models.testing import make_tiny_llama

    other = make_tiny_llama(tmp_path / "tiny96", hidden_size=96)
    return make_peft_adapter(other, tmp_path / "a96")


def test_failed_pushes_change_nothing(live_node, tiny_llama_dir, tiny_adapters, tmp_path) -> None:
    node = live_node(max_adapter_bytes=200_000)
    push_dir(node.stub, tiny_adapters["a"], "a", 1)
    root = node.node.adapters.store.pushed_root
    assert node.node.adapters.flush(timeout=30)  # the push is stored after its reply
    stored = tree(root)
    assert "a/v1/adapter_model.safetensors" in stored
    files = read_dir(tiny_adapters["b"])
    good = build_manifest(files, name="a", version=2).to_dict()

    def check(code: grpc.StatusCode, starts: str, call) -> None:
        e = rpc_error(call)
        assert e.code() == code, e.details()
        assert e.details().startswith(starts), e.details()
        assert tree(root) == stored  # nothing new, nothing half-written
        _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 1)

    # bad digest
    bad = {**good, "files": [dict(f) for f in good["files"]]}
    bad["files"][-1]["sha256"] = hashlib.sha256(b"other").hexdigest()
    check(grpc.StatusCode.DATA_LOSS, "adapter_model.safetensors: sha256",
          lambda: push_files(node.stub, files, bad))
    # truncated stream: the last chunk never comes
    requests = list(push_requests(good, files, chunk_size=4096))
    check(grpc.StatusCode.DATA_LOSS, "adapter_model.safetensors: received",
          lambda: node.stub.PushAdapter(iter(requests[:-1]), timeout=30))
    # made for another base model (refused from the header)
    other = build_manifest(files, name="a", version=2, base_model={"hidden_size": 96}).to_dict()
    check(grpc.StatusCode.FAILED_PRECONDITION, "header.manifest.base_model: adapter does not "
          "fit the base model: hidden_size: adapter 96, base model 64",
          lambda: push_files(node.stub, files, other))
    # tensors of another model under a manifest that claims this one
    foreign = read_dir(_other_model_adapter(tmp_path))
    claims = build_manifest(foreign, name="a", version=2,
                            base_model=node.node.adapters.identity).to_dict()
    check(grpc.StatusCode.FAILED_PRECONDITION, "adapter: adapter does not fit the base model",
          lambda: push_files(node.stub, foreign, claims))
    # shapes that do not fit one module
    wrong = _bad_shape_files(tiny_adapters["a"])
    check(grpc.StatusCode.FAILED_PRECONDITION, "adapter: adapter_model.safetensors: "
          "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight: shape [129, 4] does not fit",
          lambda: push_files(node.stub, wrong, build_manifest(wrong, name="a", version=2)
                             .to_dict()))
    # files that do not parse (digests right): the caller's error
    garbled = {**files, "adapter_model.safetensors": b"\x10" * 64}
    garbled_manifest = {**good, "files": [
        {"path": p, "size_bytes": len(garbled[p]), "sha256": ""} for p in sorted(garbled)]}
    check(grpc.StatusCode.INVALID_ARGUMENT, "adapter: adapter_model.safetensors",
          lambda: push_files(node.stub, garbled, garbled_manifest))
    # over the size limit
    big = {**files, "README.md": b"x" * 200_000}
    check(grpc.StatusCode.RESOURCE_EXHAUSTED, "header.manifest.files: adapter is",
          lambda: push_files(node.stub, big, build_manifest(big, name="a", version=2).to_dict()))
    # the format the files are not
    fake = {**good, "format": "mlx"}
    check(grpc.StatusCode.INVALID_ARGUMENT, "header.manifest.format: says mlx",
          lambda: push_files(node.stub, files, fake))
    # the next good push works
    push_files(node.stub, files, good)
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["b"], 2)


def test_cancelled_push_changes_nothing(live_node, tiny_llama_dir, tiny_adapters,
                                       monkeypatch) -> None:
    node = live_node()
    read = threading.Event()  # the node has read the first chunks
    receive = adapter_manager.receive_push

    def counting(requests, max_bytes, **kwargs):
        def counted():
            for i, request in enumerate(requests):
                yield request
                if i == 2:  # the third message read: the node asks for the next
                    read.set()

        return receive(counted(), max_bytes, **kwargs)

    monkeypatch.setattr(adapter_manager, "receive_push", counting)
    push_dir(node.stub, tiny_adapters["a"], "a", 1)
    root = node.node.adapters.store.pushed_root
    assert node.node.adapters.flush(timeout=30)  # the push is stored after its reply
    stored = tree(root)
    assert "a/v1/adapter_model.safetensors" in stored
    files = read_dir(tiny_adapters["b"])
    requests = list(push_requests(build_manifest(files, name="a", version=2), files,
                                  chunk_size=4096))
    release = threading.Event()
    sent = threading.Event()

    def stream():
        yield from requests[:3]
        sent.set()
        release.wait(30)

    def push_calls() -> dict[str, float]:
        """PushAdapter calls handled so far, by status code."""
        return {s.labels["code"]: s.value for metric in REGISTRY.collect()
                if metric.name == "gridrl_rpc_requests"
                for s in metric.samples if s.name == "gridrl_rpc_requests_total"
                and s.labels["method"] == "PushAdapter"}

    before = push_calls()
    call = node.stub.PushAdapter.future(stream(), timeout=30)
    assert sent.wait(10)
    assert read.wait(10)
    call.cancel()
    release.set()
    wait_for(lambda: sum(push_calls().values()) > sum(before.values()))  # handler returned
    after = push_calls()
    ended = {code for code in after if after[code] > before.get(code, 0)}
    # grpc ends the node's request iterator with an error (CANCELLED) or, when the call is
    # already torn down, as a short stream (DATA_LOSS: received fewer bytes than declared)
    assert ended <= {"CANCELLED", "DATA_LOSS"}, ended
    assert tree(root) == stored
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 1)


def test_push_interrupts_the_generate_in_flight(live_node, tiny_llama_dir, tiny_backend,
                                                tiny_adapters) -> None:
    """A push does not wait for the batch in flight: the batch stops at its first step, the
    push is applied, and the request is decoded again, whole, on the new adapter."""
    gated = GatedBackend(tiny_backend)
    node = live_node(gated, batch_window_s=0.0)
    gated.gate.set()
    push_dir(node.stub, tiny_adapters["a"], "a", 1)
    new_tokens, _ = reference_greedy(peft_reference(tiny_llama_dir, tiny_adapters["b"]), PROMPT,
                                     8)
    gated.gate.clear()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    in_flight = pool.submit(node.generate, max_tokens=8, temperature=0)
    wait_for(lambda: gated.entered == 1)
    # the held batch stops at its first step for the push; the gate holds its second run
    assert push_dir(node.stub, tiny_adapters["b"], "a", 2).serving.version == 2
    assert not in_flight.done()
    gated.gate.set()
    sample = in_flight.result(30).samples[0]
    assert sample.adapter_version == 2 and list(sample.token_ids) == new_tokens
    stopped, redone = node.engine.recent_batches()[-2:]
    assert stopped.interrupted and stopped.adapter_version == 1
    assert not redone.interrupted and redone.adapter_version == 2
    assert stopped.requests == redone.requests
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["b"], 2)


def test_reload_adapter(live_node, tiny_llama_dir, tiny_adapters, tmp_path) -> None:
    node = live_node()
    push_dir(node.stub, tiny_adapters["a"], "a", 1)
    push_dir(node.stub, tiny_adapters["b"], "a", 2)
    root = node.node.adapters.store.root

    def reload(**target) -> rollout_pb2.ReloadAdapterResponse:
        return node.stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(**target), timeout=30)

    response = reload(version=1)
    assert (response.serving.name, response.serving.version) == ("a", 1)
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["a"], 1)
    assert reload(base_model=True).serving.version == 0
    _assert_serves_like_peft(node, tiny_llama_dir, None, 0)
    # a directory an operator put under the root, in either format
    write_dir(read_dir(tiny_adapters["b"]), root / "ops" / "b")
    response = reload(path="ops/b")
    assert (response.serving.name, response.serving.version) == ("ops/b", 0)
    sample = _greedy(node)
    ref_tokens, _ = reference_greedy(peft_reference(tiny_llama_dir, tiny_adapters["b"]), PROMPT, 8)
    assert list(sample.token_ids) == ref_tokens and sample.adapter_name == "ops/b"
    write_dir(convert_files(read_dir(tiny_adapters["a"]), "mlx", num_layers=2), root / "ops" / "m")
    reload(path="ops/m")
    assert list(_greedy(node).token_ids) == reference_greedy(
        peft_reference(tiny_llama_dir, tiny_adapters["a"]), PROMPT, 8)[0]
    assert reload(path="pushed/a/v2").serving.version == 2  # metadata names the push
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["b"], 2)

    # refused: escaping the root (directly or through a symlink), missing, unknown version
    outside = tmp_path / "outside"
    write_dir(read_dir(tiny_adapters["a"]), outside)
    (root / "link").symlink_to(outside)
    # a directory inside the root whose weights file is a symlink to the adapter outside
    write_dir(read_dir(tiny_adapters["b"]), root / "ops" / "trap")
    weights = next(p for p in (root / "ops" / "trap").iterdir() if p.suffix == ".safetensors")
    weights.unlink()
    weights.symlink_to(outside / weights.name)
    for target, code, starts in (
            ({"path": "../outside"}, grpc.StatusCode.INVALID_ARGUMENT, "path: "),
            ({"path": "ops/../../outside"}, grpc.StatusCode.INVALID_ARGUMENT, "path: "),
            ({"path": str(outside)}, grpc.StatusCode.INVALID_ARGUMENT, "path: "),
            ({"path": "link"}, grpc.StatusCode.INVALID_ARGUMENT, "path: "),
            ({"path": "ops/trap"}, grpc.StatusCode.INVALID_ARGUMENT, "path: 'ops/trap': "),
            ({"path": "nope"}, grpc.StatusCode.NOT_FOUND, "path: "),
            ({"path": "pushed"}, grpc.StatusCode.FAILED_PRECONDITION, "path: "),
            ({"version": 9}, grpc.StatusCode.NOT_FOUND, "version: "),
            ({}, grpc.StatusCode.INVALID_ARGUMENT, "target: ")):
        e = rpc_error(lambda t=target: reload(**t))
        assert e.code() == code, (target, e.details())
        assert e.details().startswith(starts), e.details()
    _assert_serves_like_peft(node, tiny_llama_dir, tiny_adapters["b"], 2)


def test_older_runs_are_pruned(live_node, tiny_adapters) -> None:
    """Across runs (adapter names) the store stays bounded: names other than the one pushed
    keep their newest version only, and at most --keep-runs names stay; the serving adapter
    is never deleted."""
    node = live_node(keep_adapters=3, keep_runs=2)

    def stored() -> list[tuple[str, int]]:
        return [(r.name, r.version) for r in node.info().stored_adapters]

    for name, versions in (("run-a", (1, 2)), ("run-b", (1, 2, 3))):
        for version in versions:
            push_dir(node.stub, tiny_adapters["a" if version % 2 else "b"], name, version)
    assert stored() == [("run-a", 2), ("run-b", 1), ("run-b", 2), ("run-b", 3)]
    node.stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(path="pushed/run-a/v2"),
                            timeout=30)  # serving run-a v2 now
    push_dir(node.stub, tiny_adapters["a"], "run-c", 1, stage_only=True)
    # run-b: the newest of the other names, trimmed to its newest version; run-a: beyond
    # --keep-runs 2, but serving
    assert stored() == [("run-a", 2), ("run-b", 3), ("run-c", 1)]
    push_dir(node.stub, tiny_adapters["b"], "run-c", 2)  # serving run-c v2: run-a goes
    assert stored() == [("run-b", 3), ("run-c", 1), ("run-c", 2)]
    assert node.node.adapters.flush(timeout=30)  # the last push is written after its reply
    assert not [p for p in tree(node.node.adapters.store.pushed_root) if p.startswith(".")]


def test_old_versions_are_pruned(live_node, tiny_adapters) -> None:
    node = live_node(keep_adapters=2)
    for version in (1, 2, 3):
        push_dir(node.stub, tiny_adapters["a" if version % 2 else "b"], "run", version)
    assert [r.version for r in node.info().stored_adapters] == [2, 3]
    node.stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(version=2), timeout=30)
    push_dir(node.stub, tiny_adapters["b"], "run", 4, stage_only=True)
    # the serving version is never deleted
    assert [r.version for r in node.info().stored_adapters] == [2, 3, 4]
    assert node.node.adapters.flush(timeout=30)  # the last push is written after its reply
    assert not [p for p in tree(node.node.adapters.store.pushed_root) if p.startswith(".")]
