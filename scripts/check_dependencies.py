#!/usr/bin/env python3
"""Each package declares exactly what it imports (`make lint`).

For every ``libs/*/pyproject.toml`` and ``services/*/pyproject.toml``:

1. ``deptry`` (requirements-dev.txt) on the package: every third-party module its ``src/``
   imports is declared in its ``dependencies`` or an extra (not only reached through another
   gridrl package), and every declared distribution is imported. Exceptions live in the
   package's own ``[tool.deptry]`` table, each with the reason beside it.
2. The ``gridrl`` namespace, which deptry cannot check (every gridrl distribution installs
   into the one namespace package ``gridrl``): each ``gridrl.<x>`` the package imports names
   the distribution that owns it (``gridrl.v1`` is gridrl-proto, ``gridrl.<x>`` is
   gridrl-<x>) among its declared dependencies, and each declared gridrl distribution is
   imported.

Exit status 1 with one line per finding; 0 and a summary line when every package is exact.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: deptry brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DEPTRY = Path(sys.executable).parent / "deptry"


def packages() -> list[Path]:
    """The package directories, libraries first."""
    return sorted((ROOT / "libs").glob("*/pyproject.toml")) + sorted(
        (ROOT / "services").glob("*/pyproject.toml"))


def distribution_of(module: str) -> str:
    """The gridrl distribution that installs ``gridrl.<module>``."""
    return "gridrl-proto" if module == "v1" else f"gridrl-{module}"


def declared_gridrl(project: dict) -> set[str]:
    """The gridrl distributions the project's dependencies and extras name (itself excluded)."""
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    names = {re.sub(r"[-_.]+", "-", Requirement(s).name).lower() for s in specs}
    return {n for n in names if n.startswith("gridrl-") and n != project["name"]}


def imported_gridrl(src: Path) -> dict[str, str]:
    """Each gridrl distribution the sources import -> the first ``file:line`` that does."""
    found: dict[str, str] = {}
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "gridrl" and len(parts) > 1:
                    dist = distribution_of(parts[1])
                    found.setdefault(dist, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def check_gridrl(pkg: Path, project: dict) -> list[str]:
    own = project["name"]
    imported = {d: where for d, where in imported_gridrl(pkg / "src").items() if d != own}
    declared = declared_gridrl(project)
    rel = pkg.relative_to(ROOT)
    problems = [f"{where}: imports {d}, which {rel}/pyproject.toml does not declare"
                for d, where in sorted(imported.items()) if d not in declared]
    problems += [f"{rel}/pyproject.toml: declares {d}, which its code never imports"
                 for d in sorted(declared - imported.keys())]
    return problems


def check_deptry(pkg: Path) -> list[str]:
    run = subprocess.run(
        [str(DEPTRY), ".", "--known-first-party", "gridrl", "--no-ansi"],
        cwd=pkg, capture_output=True, text=True)
    if run.returncode == 0:
        return []
    rel = pkg.relative_to(ROOT)
    lines = [ln for ln in run.stdout.splitlines() + run.stderr.splitlines()
             if re.search(r"\bDEP\d{3}\b", ln)]
    return [f"{rel}/{ln}" for ln in lines] or [f"{rel}: deptry failed:\n{run.stderr}"]


def main() -> int:
    problems: list[str] = []
    pkgs = packages()
    for pyproject in pkgs:
        pkg = pyproject.parent
        project = tomllib.loads(pyproject.read_text())["project"]
        problems += check_deptry(pkg)
        problems += check_gridrl(pkg, project)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} dependency declaration(s) to fix", file=sys.stderr)
        return 1
    print(f"dependencies: the {len(pkgs)} packages each declare exactly what they import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
