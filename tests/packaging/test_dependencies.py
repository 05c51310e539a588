"""The packages' dependency declarations: each external package's version range is written in
one pyproject only (the lowest gridrl package that needs it), so two packages can never pin
the same library differently; packages above name the extra or the bare package name."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PYPROJECTS = sorted([*REPO.glob("libs/*/pyproject.toml"), *REPO.glob("services/*/pyproject.toml")])


def _requirements() -> list[tuple[str, Requirement]]:
    out = []
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs.extend(extra)
        out.extend((path.parent.name, Requirement(r)) for r in reqs)
    return out


def test_every_package_is_found() -> None:
    names = {p.parent.name for p in PYPROJECTS}
    assert {"proto", "common", "models", "adapters", "engine", "master", "rollout",
            "trainer"} <= names


def test_each_external_dependency_is_pinned_in_one_place() -> None:
    pinned: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for package, req in _requirements():
        if req.name.startswith("gridrl-"):
            assert not req.specifier, f"{package}: {req} (gridrl packages are unversioned)"
        elif req.specifier:
            pinned[req.name.lower()][package].add(str(req.specifier))
    twice = {name: {pkg: sorted(specs) for pkg, specs in where.items()}
             for name, where in pinned.items()
             if len(where) > 1 or any(len(specs) > 1 for specs in where.values())}
    assert not twice, f"version ranges written more than once: {twice}"


def test_torch_2_13_satisfies_every_torch_range() -> None:
    """The CPU build on disk (torch 2.13.0) must satisfy the declared range."""
    ranges = [req.specifier for _, req in _requirements() if req.name == "torch"]
    assert ranges and all(r.contains("2.13.0") for r in ranges)
