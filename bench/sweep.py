"""Benchmark: a 3-run learning-rate sweep on one rollout node, at once against one after another
(issue 46: goal <= 0.6x the wall time).

Runs ``gridrl-trainer sweep --lr 1e-4,3e-4,1e-3`` twice with the same small settings, each
time with a fresh local rollout node the sweep starts (SmolLM2-135M, torch lean forward):
once with the three runs at once (their rollouts share the node's batches, rows of three
adapters decoded together, fair share per run), once ``--one-after-another``. Prints both
closing tables and the ratio of the wall times.

    python bench/sweep.py [--steps 4] [extra run flags ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from _common import cpu_flags, load_average, machine


def sweep(args: list[str], name: str, sequential: bool) -> tuple[float, str]:
    exe = str(Path(sys.executable).with_name("gridrl-trainer"))
    cmd = [exe, "sweep", "--sweep-name", name, *(["--one-after-another"] if sequential else []),
           *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    out = done.stdout
    found = re.search(r"wall time (\d+)s", out)
    if done.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{out}\n"
                         f"{done.stderr[-3000:]}")
    table = out[out.rindex("lr "):] if "lr " in out else out
    return float(found.group(1)), table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    known, extra = parser.parse_known_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args = ["--lr", "1e-4,3e-4,1e-3", "--steps", str(known.steps), "--eval-every",
            str(known.steps), *extra]
    print(f"# 3-run lr sweep on one node, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"machine: {machine()}; load before {load_average()}")
    print(f"cpu flags: {cpu_flags()}")
    print(f"gridrl-trainer sweep {' '.join(args)}")
    together, t1 = sweep(args, f"bench-at-once-{stamp}", sequential=False)
    apart, t2 = sweep(args, f"bench-in-turn-{stamp}", sequential=True)
    print("## at once on one node\n" + t1)
    print("## one after another\n" + t2)
    print(f"wall time at once {together:.0f}s, one after another {apart:.0f}s: "
          f"{together / apart:.2f}x (goal <= 0.6x); load after {load_average()}")


if __name__ == "__main__":
    main()
