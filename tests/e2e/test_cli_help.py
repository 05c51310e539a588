"""Every console script and every subcommand: ``--help`` exits 0 at once, every option shows
its environment variable, and importing the CLI module pulls in neither torch nor mlx.

The commands are discovered from the click objects (in a subprocess, so that this process
does not import them), and each ``--help`` runs the installed console script for real.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

# console script -> (entry point, environment-variable prefixes its flags may use)
SCRIPTS = {
    "gridrl-master": ("gridrl.master.cli:main", ("GRIDRL_MASTER_",)),
    "gridrl-rollout": ("gridrl.rollout.cli:main", ("GRIDRL_ROLLOUT_",)),
    "gridrl-trainer": ("gridrl.trainer.cli:main", ("GRIDRL_TRAINER_",)),
    "gridrl-adapters": ("gridrl.adapters.cli:main", ("GRIDRL_ADAPTERS_",)),
    "gridrl-auth": ("gridrl.common.auth_cli:main", ("GRIDRL_AUTH_",)),
}
# One TLS identity and one credential per machine: every service and client reads these.
SHARED_ENV = {"GRIDRL_AUTH_TOKEN", "GRIDRL_AUTH_TOKEN_FILE", "GRIDRL_AUTHORIZED_TOKENS",
              "GRIDRL_TLS_CERT", "GRIDRL_TLS_KEY", "GRIDRL_TLS_CA"}
# Top-level modules a CLI module must not import before a command runs.
HEAVY = ("torch", "mlx", "mlx_lm")
HELP_SECONDS = 5.0  # --help of a light CLI takes ~0.2 s; importing torch alone takes longer

# Run in a fresh interpreter: import the CLI module, report heavy modules and the click tree.
_INSPECT = r"""
import importlib, json, sys
import click

module, attr = sys.argv[1].split(":")
main = getattr(importlib.import_module(module), attr)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[2].split(","))

def walk(cmd, path):
    opts = [{"name": p.name, "decls": list(p.opts) + list(p.secondary_opts),
             "envvar": p.envvar, "hidden": bool(getattr(p, "hidden", False))}
            for p in cmd.params if isinstance(p, click.Option)]
    out = [{"path": path, "group": isinstance(cmd, click.Group), "options": opts}]
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            out += walk(sub, [*path, name])
    return out

print(json.dumps({"heavy": heavy, "commands": walk(main, [])}))
"""


def _inspect(entry: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _INSPECT, entry, ",".join(HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"importing {entry} failed:\n{proc.stderr}"
    return json.loads(proc.stdout)


def _option_entries(help_text: str) -> dict[str, str]:
    """Split the Options section of click's help into ``{first flag: whitespace-normalised
    entry text}``; an entry is a line indented by two spaces starting with ``-``, plus its
    deeper-indented continuation lines."""
    entries: list[tuple[str, list[str]]] = []
    in_options = False
    for line in help_text.splitlines():
        if line.strip() == "Options:":
            in_options = True
        elif in_options and re.match(r"^  -", line):
            entries.append((line.split()[0].rstrip(","), [line]))
        elif in_options and line.startswith("   ") and entries:
            entries[-1][1].append(line)
        elif line.strip() and not line.startswith(" "):
            in_options = False  # the next section (Commands:)
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_is_installed(script: str) -> None:
    entry, _ = SCRIPTS[script]
    eps = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert eps.get(script) == entry, f"{script}: entry point is {eps.get(script)!r}"
    assert os.access(BIN / script, os.X_OK), f"{BIN / script} is not an executable"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_cli_module_does_not_import_torch_or_mlx(script: str) -> None:
    report = _inspect(SCRIPTS[script][0])
    assert report["heavy"] == [], (
        f"importing {SCRIPTS[script][0]} imports {report['heavy']}: move those imports into "
        "the command that needs them (--help must be instant)")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_command_help_exits_fast_and_shows_env_vars(script: str) -> None:
    entry, prefixes = SCRIPTS[script]
    commands = _inspect(entry)["commands"]
    assert any(not c["group"] for c in commands), f"{script} has no command"
    problems: list[str] = []
    for command in commands:
        argv = [str(BIN / script), *command["path"], "--help"]
        shown = " ".join([script, *command["path"]])
        start = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "COLUMNS": "80"})
        took = time.monotonic() - start
        if proc.returncode != 0:
            problems.append(f"`{shown} --help` exited {proc.returncode}: {proc.stderr.strip()}")
            continue
        if took > HELP_SECONDS:
            problems.append(f"`{shown} --help` took {took:.1f} s (> {HELP_SECONDS} s)")
        entries = _option_entries(proc.stdout)
        seen_env: dict[str, str] = {}
        for opt in command["options"]:
            flag = opt["decls"][0]
            env = opt["envvar"]
            if not isinstance(env, str) or not env:
                problems.append(f"{shown} {flag}: reads no environment variable")
                continue
            if env not in SHARED_ENV and not env.startswith(prefixes):
                problems.append(f"{shown} {flag}: {env} does not start with {prefixes}")
            if env in seen_env:
                problems.append(f"{shown} {flag}: {env} is also read by {seen_env[env]}")
            seen_env[env] = flag
            if opt["hidden"]:
                continue
            text = next((t for k, t in entries.items() if k in opt["decls"]), None)
            if text is None:
                problems.append(f"{shown} {flag}: not in --help")
            elif not re.search(rf"\[env var: {env}[;\]]", text):
                problems.append(f"{shown} {flag}: --help does not show [env var: {env}]: "
                                f"{text!r}")
    assert not problems, "\n".join(problems)
