"""The node's resident adapters (``gridrl.rollout.residency``): one per name, least recently
used dropped first past the count or byte bound; pure bookkeeping, no backend."""

from __future__ import annotations

import pytest

from gridrl.common.errors import Kind, StatusError
from gridrl.rollout.jobs import ServingAdapter
from gridrl.rollout.residency import ResidentAdapters


def _a(name: str, version: int = 1, nbytes: int = 10) -> ServingAdapter:
    return ServingAdapter(name, version, handle=f"{name}-v{version}", nbytes=nbytes)


def test_least_recently_used_names_go_first() -> None:
    held = ResidentAdapters(max_resident=2)
    assert held.put(_a("x")) == [] and held.put(_a("y")) == []
    assert held.use("x").name == "x"  # y is now the least recently used
    assert held.put(_a("z")) == ["y-v1"]
    assert [a.name for a in held.listing()] == ["x", "z"] and "y" not in held
    assert held.use("y") is None
    # a new version replaces its name's old one, which is given back to unload
    assert held.put(_a("x", 2)) == ["x-v1"]
    assert [(a.name, a.version) for a in held.listing()] == [("z", 1), ("x", 2)]


def test_protected_and_byte_bound() -> None:
    held = ResidentAdapters(max_resident=3, max_bytes=100)
    held.put(_a("serving", nbytes=40))
    held.put(_a("b", nbytes=40))
    # 150 bytes: b goes (serving is protected even though it is older)
    assert held.put(_a("c", nbytes=70), protect="serving") == ["b-v1"]
    assert [a.name for a in held.listing()] == ["serving", "c"]
    with pytest.raises(StatusError) as e:
        held.check_fits("huge", 101)
    assert e.value.kind == Kind.RESOURCE_EXHAUSTED and "--adapter-memory-mb" in str(e.value)
    held.check_fits("fits", 100)
    err = held.not_resident("gone")
    assert err.kind == Kind.NOT_FOUND and "'gone'" in str(err) and "serving, c" in str(err)
    with pytest.raises(ValueError, match="max_resident"):
        ResidentAdapters(0)
