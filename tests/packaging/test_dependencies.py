"""The packages' dependency declarations: each external package's version range is written in
one pyproject only (the lowest gridrl package that needs it), so two packages can never pin
the same library differently; packages above name the extra or the bare package name."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections import defaultdict
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def _extras() -> list[tuple[str, str, Requirement]]:
    """(package, extra, requirement) for every extra of every package whose marker holds here."""
    out = []
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        for extra, reqs in project.get("optional-dependencies", {}).items():
            for req in map(Requirement, reqs):
                if req.marker is None or req.marker.evaluate({"extra": extra}):
                    out.append((path.parent.name, extra, req))
    return out


def test_each_extras_imports_resolve() -> None:
    """`make install` installs every extra: each requirement of each extra is installed within
    its range, names only extras that exist, and the modules its distribution provides (the
    names gridrl imports, scripts/check_dependencies.py) are found."""
    provides: dict[str, set[str]] = defaultdict(set)
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides[canonicalize_name(dist)].add(module)
    extras_of = {
        canonicalize_name(tomllib.loads(p.read_text())["project"]["name"]):
            set(tomllib.loads(p.read_text())["project"].get("optional-dependencies", {}))
        for p in PYPROJECTS}
    problems = []
    for package, extra, req in _extras():
        where = f"{package}[{extra}]: {req}"
        name = canonicalize_name(req.name)
        if name in extras_of:
            missing = set(req.extras) - extras_of[name]
            if missing:
                problems.append(f"{where} names no such extra {sorted(missing)}")
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{where} is not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{where}: {version} installed")
        # (some wheels also ship a stray top-level ``tests``, never imported)
        modules = {m for m in provides[name]
                   if not m.startswith("_") and m not in {"tests", "test"}}
        if not modules or any(importlib.util.find_spec(m) is None for m in modules):
            problems.append(f"{where}: its modules {sorted(modules)} do not resolve")
    assert not problems, problems


# The gridrl modules that need an extra and import it at module level: each imports with it.
MODULES_BEHIND_EXTRAS = {
    ("rollout", "openai"): ["gridrl.rollout.openai_server"],
    ("trainer", "tinker"): ["gridrl.trainer.primitives.tinker_http"],
    ("engine", "vllm"): ["gridrl.engine.backends.vllm.backend"],
}


@pytest.mark.parametrize(("package", "extra"), sorted(MODULES_BEHIND_EXTRAS))
def test_modules_behind_an_extra_import(package: str, extra: str) -> None:
    assert extra in {e for p, e, _ in _extras() if p == package}
    for module in MODULES_BEHIND_EXTRAS[package, extra]:
        importlib.import_module(module)
