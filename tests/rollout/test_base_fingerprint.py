"""A node refuses an adapter trained on another checkpoint of its architecture (issue 13): the
weights' fingerprint in its BaseModel, compared with the one a push's manifest (or a stored
adapter's record) names; FAILED_PRECONDITION naming both, nothing changed."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from rollout_helpers import push_files, rpc_error, tree

from gridrl.adapters import build_manifest, read_dir
from gridrl.models import model_identity, weights_fingerprint
from gridrl.models.testing import make_tiny_llama
from gridrl.v1 import rollout_pb2


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-seed1"), seed=1)


def _push(node, adapter: Path, base_dir: Path, version: int):
    files = read_dir(adapter)
    manifest = build_manifest(files, name="a", version=version, base_model=model_identity(
        base_dir), infer_local=False).to_dict()
    return push_files(node.stub, files, manifest)


def test_push_for_another_checkpoint_is_refused(live_node, tiny_llama_dir, other_seed,
                                                tiny_adapters) -> None:
    node = live_node()
    mine, theirs = weights_fingerprint(tiny_llama_dir), weights_fingerprint(other_seed)
    assert node.info().base_model.weights_fingerprint == mine
    e = rpc_error(lambda: _push(node, tiny_adapters["a"], other_seed, 1))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert e.details().startswith("header.manifest.base_model: adapter does not fit the base "
                                  "model: weights_fingerprint: ")
    assert repr(theirs) in e.details() and repr(mine) in e.details()
    assert str(other_seed) in e.details() and str(tiny_llama_dir) in e.details()
    info = node.info()
    assert info.adapter.version == 0 and not info.stored_adapters
    assert tree(node.node.adapters.store.pushed_root) == []
    # the same adapter recorded for this node's checkpoint is served
    assert _push(node, tiny_adapters["a"], tiny_llama_dir, 1).serving.version == 1


def test_stored_adapter_of_another_checkpoint_is_not_reloaded(
        live_node, tiny_llama_dir, other_seed, tiny_adapters, tmp_path) -> None:
    from gridrl.engine.backends.torch.backend import TorchBackend

    root = tmp_path / "shared-adapters"
    first = live_node(adapter_root=root)
    assert _push(first, tiny_adapters["a"], tiny_llama_dir, 1).serving.version == 1
    first.node.adapters.flush(30)
    other = live_node(TorchBackend.from_pretrained(other_seed), adapter_root=root)
    assert [r.version for r in other.info().stored_adapters] == [1]
    e = rpc_error(lambda: other.stub.ReloadAdapter(
        rollout_pb2.ReloadAdapterRequest(version=1), timeout=30))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert e.details().startswith("adapter: adapter does not fit the base model: "
                                  "weights_fingerprint: ")
    assert other.info().adapter.version == 0
