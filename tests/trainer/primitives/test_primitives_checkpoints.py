"""The checkpoints on the trainer's disk as Tinker's RestClient sees them, on a fake clock:
runs and checkpoints listed newest first, a TTL honoured (an expired checkpoint is NOT_FOUND
at once and its files are deleted by the sweep), deletion, file URLs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridrl.common.errors import Kind, StatusError
from gridrl.trainer.primitives import paths
from gridrl.trainer.primitives.checkpoints import CheckpointStore, parse_checkpoint_id


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _save(root: Path, where: paths.WeightsPath) -> None:
    directory = where.directory(root)
    directory.mkdir(parents=True)
    meta = {"base_model": "m", "lora_rank": 4, "target_modules": ["q_proj"]}
    (directory / {paths.STATE: "state.json", paths.SAMPLER: "snapshot.json",
                  paths.EXTERNAL: "external.json"}[where.kind]).write_text(json.dumps(meta))
    (directory / "adapter_model.safetensors").write_bytes(b"x" * 10)


def test_a_ttl_is_honoured_and_deleted_checkpoints_are_not_found_by_path(tmp_path) -> None:
    clock = Clock()
    store = CheckpointStore(tmp_path, clock)
    store.record_run("s:train:0", {"base_model": "m", "lora_rank": 4})
    state = paths.WeightsPath("s:train:0", paths.STATE, "a")
    sampler = paths.WeightsPath("s:train:0", paths.SAMPLER, "b")
    _save(tmp_path, state)
    _save(tmp_path, sampler)
    assert {c.where for c in store.checkpoints("s:train:0")} == {state, sampler}
    assert [r["model_id"] for r in store.runs()] == ["s:train:0"]
    assert store.get(state).meta["lora_rank"] == 4
    assert store.get(state).size_bytes > 10

    store.set_ttl(state, 60)
    assert store.get(state).expires_at == clock.now + 60
    clock.now += 59
    assert store.sweep() == []
    clock.now += 2
    with pytest.raises(StatusError) as e:
        store.get(state)
    assert e.value.kind == Kind.NOT_FOUND and state.uri in e.value.message
    assert not state.directory(tmp_path).exists()  # the lookup removed it too

    store.set_ttl(sampler, 10)
    store.set_ttl(sampler, None)  # cleared: never expires
    clock.now += 100
    assert store.sweep() == [] and store.get(sampler)

    store.set_ttl(sampler, 5)
    clock.now += 6
    assert store.sweep() == [sampler.uri]  # the server's periodic sweep deletes the files
    assert not sampler.directory(tmp_path).exists()
    assert store.checkpoints("s:train:0") == []


def test_deletion_urls_and_refusals_name_what_they_refuse(tmp_path) -> None:
    store = CheckpointStore(tmp_path, Clock())
    external = paths.WeightsPath("s:train:1", paths.EXTERNAL, "export")
    _save(tmp_path, external)
    urls = store.file_urls(external)
    assert set(urls) == {"external.json", "adapter_model.safetensors"}
    assert all(u.startswith("file:///") and Path(u[7:]).is_file() for u in urls.values())
    store.delete(external)
    for call in (lambda: store.delete(external), lambda: store.set_ttl(external, 5),
                 lambda: store.file_urls(external)):
        with pytest.raises(StatusError) as e:
            call()
        assert e.value.kind == Kind.NOT_FOUND and external.uri in e.value.message
    with pytest.raises(StatusError, match="training run 'nope'"):
        store.run("nope")
    _save(tmp_path, paths.WeightsPath("s:train:1", paths.STATE, "a"))
    with pytest.raises(StatusError, match="ttl_seconds"):
        store.set_ttl(paths.WeightsPath("s:train:1", paths.STATE, "a"), 0)
    assert parse_checkpoint_id("s:train:1", "weights/a") == paths.WeightsPath(
        "s:train:1", paths.STATE, "a")
    with pytest.raises(StatusError, match="checkpoint_id"):
        parse_checkpoint_id("s:train:1", "nothing/a")
