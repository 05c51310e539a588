"""``gridrl-trainer sweep``: several runs that differ in one or more flags, on one fleet at once.

    gridrl-trainer sweep --lr 1e-4,3e-4,1e-3 --steps 30 --master 127.0.0.1:50050

Every ``run`` flag is accepted; a numeric flag given a comma-separated list (``--lr 1e-4,3e-4``,
``--seed 0,1``) is swept, several such flags in every combination. Each variant is one
``gridrl-trainer run`` process with its own run name and directory
(``runs/<sweep-name>/<run-name>``), its own adapter on the nodes (named after the run), on its
own free port; all use the same fleet (``--master`` or ``--rollout``; with neither, the sweep
starts one local rollout node, ``gridrl-rollout serve``, and every run samples from it). The
nodes decode the runs' requests in shared batches with a fair share per run
(:mod:`gridrl.rollout.fair_share`, ``--share-weight``). When all have ended the sweep prints one
table: each run's swept values, final eval (and exact-match rate), wall time, exit status and
directory. ``--one-after-another`` runs them in turn instead (the baseline of
``docs/benchmarks.md``'s sweep figure).

The expansion and the table are pure functions (tested without processes); :func:`run_sweep`
starts the processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Variant:
    """One run of a sweep.

    Attributes:
        name: its run name (``<sweep>-<flag><value>...``, filesystem- and adapter-safe).
        values: flag -> the value this run gets, for each swept flag.
        argv: the ``gridrl-trainer run`` arguments (without the program name).
        run_dir: where it writes.
    """

    name: str
    values: dict[str, str]
    argv: list[str]
    run_dir: str


@dataclass
class Outcome:
    """How a variant's run ended: exit status, wall seconds, and its last eval."""

    variant: Variant
    returncode: int
    seconds: float
    eval_score: float | None = None
    eval_exact: float | None = None
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def numeric_flags(config_type: type) -> set[str]:
    """The ``--flags`` of a settings dataclass whose values are numbers (int / float, or
    optional ones): the flags a sweep splits on commas."""
    hints = typing.get_type_hints(config_type)
    flags = set()
    for f in dataclasses.fields(config_type):
        hint = hints.get(f.name)
        args = set(typing.get_args(hint)) - {type(None)} or {hint}
        if args and args <= {int, float} and bool not in args:
            flags.add("--" + f.name.replace("_", "-"))
    return flags


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).strip("._-") or "x"


def expand(args: Sequence[str], sweepable: set[str], sweep_name: str,
           root: str = "runs") -> list[Variant]:
    """The variants of ``args`` (``run`` flags; ``--flag value`` or ``--flag=value``): every
    flag of ``sweepable`` whose value holds commas is split, the variants being every
    combination, in the order given (the first flag varying slowest).

    Raises:
        ValueError: ``--run-name`` / ``--run-dir`` given (the sweep names each run), a swept
            value that is empty, or a swept flag given twice.
    """
    tokens: list[list[str]] = []  # ["--flag", "value"] or ["--flag"] or ["positional"]
    i = 0
    args = list(args)
    while i < len(args):
        a = args[i]
        if a.startswith("--") and "=" in a:
            flag, value = a.split("=", 1)
            tokens.append([flag, value])
        elif a.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            tokens.append([a, args[i + 1]])
            i += 1
        else:
            tokens.append([a])
        i += 1
    swept: dict[str, list[str]] = {}
    for token in tokens:
        if token[0] in ("--run-name", "--run-dir", "--resume"):
            raise ValueError(f"{token[0]}: the sweep names each run itself "
                             "(--sweep-name, runs/<sweep-name>/<run-name>)")
        if len(token) == 2 and token[0] in sweepable and "," in token[1]:
            if token[0] in swept:
                raise ValueError(f"{token[0]}: given twice")
            values = [v.strip() for v in token[1].split(",")]
            if any(not v for v in values):
                raise ValueError(f"{token[0]}: empty value in {token[1]!r}")
            swept[token[0]] = values
    combos = list(itertools.product(*swept.values())) if swept else [()]
    variants = []
    for combo in combos:
        chosen = dict(zip(swept, combo, strict=True))
        argv: list[str] = []
        for token in tokens:
            if token[0] in chosen:
                argv += [token[0], chosen[token[0]]]
            else:
                argv += token
        label = "-".join(f"{flag.removeprefix('--')}{value}" for flag, value in chosen.items())
        name = _safe(f"{sweep_name}-{label}" if label else sweep_name)
        run_dir = str(Path(root) / _safe(sweep_name) / name)
        argv += ["--run-name", name, "--run-dir", run_dir]
        variants.append(Variant(name, chosen, argv, run_dir))
    return variants


def last_eval(run_dir: str | Path) -> tuple[float | None, float | None, int]:
    """The last eval of a run directory's ``log.jsonl`` (score, exact-match rate) and the
    last step recorded; Nones and 0 when it has none."""
    score = exact = None
    step = 0
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        return None, None, 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        step = max(step, int(record.get("step") or 0))
        if record.get("eval_score") is not None:
            score = float(record["eval_score"])
            exact = record.get("eval_exact")
            exact = None if exact is None else float(exact)
    return score, exact, step


def table(outcomes: Sequence[Outcome], total_s: float, mode: str) -> str:
    """The sweep's closing table (plain text): one line per run."""
    swept = list(dict.fromkeys(k for o in outcomes for k in o.variant.values))
    head = [*(f.removeprefix("--") for f in swept), "final eval", "exact", "steps", "time",
            "exit", "run dir"]
    rows = []
    for o in outcomes:
        rows.append([*(o.variant.values.get(f, "") for f in swept),
                     "-" if o.eval_score is None else f"{o.eval_score:.3f}",
                     "-" if o.eval_exact is None else f"{o.eval_exact:.2f}",
                     str(o.steps), f"{o.seconds:.0f}s", str(o.returncode), o.variant.run_dir])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(f"{len(outcomes)} runs {mode}, wall time {total_s:.0f}s")
    return "\n".join(lines)


def _has_fleet(args: Sequence[str]) -> bool:
    return any(a in ("--master", "--rollout") or a.startswith(("--master=", "--rollout="))
               for a in args) or bool(os.environ.get("GRIDRL_TRAINER_MASTER"))


def _flag_value(args: Sequence[str], flag: str, default: str) -> str:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def start_local_node(model: str, echo: Callable[[str], None], timeout_s: float = 600.0
                     ) -> tuple[subprocess.Popen, str]:
    """Start ``gridrl-rollout serve`` on a free loopback port for the sweep's runs; returns
    the process and its address.

    Raises:
        RuntimeError: the command is not installed, exits, or is not ready in time.
    """
    exe = shutil.which("gridrl-rollout") or str(Path(sys.executable).with_name("gridrl-rollout"))
    if not Path(exe).exists():
        raise RuntimeError("no --master or --rollout given and gridrl-rollout is not installed "
                           "here to start a local node: give the fleet's --master")
    ready = Path(tempfile.mkdtemp(prefix="gridrl-sweep-")) / "node.json"
    proc = subprocess.Popen([exe, "serve", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                             "--model", model, "--ready-file", str(ready)])
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the local rollout node exited with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"the local rollout node was not ready in {timeout_s:.0f}s")
        time.sleep(0.2)
    address = json.loads(ready.read_text())["address"]
    echo(f"sweep: started a local rollout node on {address} (every run samples from it)")
    return proc, address


def run_sweep(args: Sequence[str], sweepable: set[str], sweep_name: str, *,
              one_after_another: bool = False, root: str = "runs",
              echo: Callable[[str], None] = print,
              env: Mapping[str, str] | None = None) -> tuple[list[Outcome], float]:
    """Start every variant (:func:`expand`) as a ``gridrl-trainer run`` process, all at once
    (or one after another), on one fleet; wait for all. Returns their outcomes and the
    sweep's wall seconds (the local node's start included when the sweep starts one).

    Raises:
        ValueError: as :func:`expand`. RuntimeError: as :func:`start_local_node`.
    """
    variants = expand(args, sweepable, sweep_name, root)
    start = time.monotonic()
    node = None
    extra: list[str] = []
    if not _has_fleet(args):
        node, address = start_local_node(_flag_value(args, "--model",
                                                     "smollm2-135m-instruct"), echo)
        extra = ["--rollout", address]
    exe = [shutil.which("gridrl-trainer")
           or str(Path(sys.executable).with_name("gridrl-trainer")), "run"]
    base_env = {**os.environ, **(env or {})}
    outcomes: list[Outcome] = []
    running: list[tuple[Variant, subprocess.Popen, float]] = []
    ended: dict[int, float] = {}  # pid -> when that run's process was seen to end
    try:
        for variant in variants:
            argv = [*exe, *variant.argv, *extra, "--listen", "127.0.0.1:0",
                    "--metrics-port", "-1"]
            echo(f"sweep: {variant.name}: {' '.join(variant.argv)}")
            Path(variant.run_dir).parent.mkdir(parents=True, exist_ok=True)
            t = time.monotonic()
            proc = subprocess.Popen(argv, env=base_env)
            running.append((variant, proc, t))
            if one_after_another:
                proc.wait()
                ended[proc.pid] = time.monotonic()
        for variant, proc, t in running:
            code = proc.wait()
            seconds = ended.setdefault(proc.pid, time.monotonic()) - t
            score, exact, steps = last_eval(variant.run_dir)
            outcomes.append(Outcome(variant, code, seconds, score, exact, steps))
    finally:
        for _, proc, _ in running:
            if proc.poll() is None:
                proc.terminate()
        if node is not None:
            node.terminate()
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                node.kill()
    return outcomes, time.monotonic() - start
