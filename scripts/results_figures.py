"""Draw the figures of docs/results.md from the recorded measurements (no run, no model):

- ``docs/results_vs_trl.png``: gridrl against TRL's GRPOTrainer, the eval curves of three
  paired seeds and the time to eval 0.61 of six (``docs/vs_trl.json``, transcribed from
  docs/benchmarks.md section 4);
- ``docs/results_envs.png``: held-out success on a multi-turn environment and a reasoning-gym
  dataset (``docs/env_learning.json``, written by ``bench/env_learning.py --record``), and the
  RL loop through the Tinker SDK against ``gridrl-trainer run`` (``docs/tinker_facade.json``,
  written by ``bench/tinker_facade.py --record``).

    .venv/bin/python scripts/results_figures.py [--docs docs]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

GRIDRL, TRL, SDK = "tab:blue", "tab:orange", "tab:green"


def vs_trl(docs: Path) -> Path:
    data = json.loads((docs / "vs_trl.json").read_text())
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.2))
    for side, color in (("gridrl", GRIDRL), ("trl", TRL)):
        for seed, points in sorted(data["curves"][side].items()):
            steps, evals = zip(*points, strict=True)
            curves.plot(steps, evals, color=color, marker="o", markersize=3, alpha=0.85,
                        label=f"{'gridrl' if side == 'gridrl' else 'TRL'} seed {seed}",
                        linestyle="-" if seed == "0" else ("--" if seed == "1" else ":"))
    curves.axhline(0.61, color="grey", linestyle="--", linewidth=0.8)
    curves.set(xlabel="step", ylabel="held-out eval (128 prompts)", ylim=(0, 1),
               title="eval by step, 3 paired seeds (2026-12-02)")
    curves.legend(fontsize=7, ncol=2, loc="lower right")
    curves.grid(alpha=0.3)

    paired = data["paired"]
    seeds = paired["seeds"]
    x = range(len(seeds))
    width = 0.4
    bars.bar([i - width / 2 for i in x], paired["gridrl"]["seconds_to_0.61"], width,
             color=GRIDRL, label="gridrl (make demo's settings)")
    bars.bar([i + width / 2 for i in x], paired["trl"]["seconds_to_0.61"], width,
             color=TRL, label="TRL GRPOTrainer")
    g = paired["gridrl"]["seconds_to_0.61"]
    t = paired["trl"]["seconds_to_0.61"]
    ratio = (sum(g) / len(g)) / (sum(t) / len(t))
    bars.set_xticks(list(x), [f"seed {s}" for s in seeds])
    bars.set(ylabel="training seconds to eval >= 0.61",
             title=f"time to 0.61, 6 paired seeds (2026-12-03): {ratio:.2f}x TRL's")
    bars.legend(fontsize=8)
    bars.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out = docs / "results_vs_trl.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def environments(docs: Path) -> Path:
    envs = json.loads((docs / "env_learning.json").read_text())
    tinker = json.loads((docs / "tinker_facade.json").read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"reverse-words-retry": GRIDRL, "reasoning-gym:chain_sum": "tab:purple"}
    for task, record in envs["tasks"].items():
        for run in record["runs"]:
            steps = [e["step"] for e in run["evals"]]
            success = [e["success"] for e in run["evals"]]
            left.plot(steps, success, color=colors.get(task), marker="o", markersize=3,
                      linestyle="-" if run["seed"] == 0 else "--",
                      label=f"{task} seed {run['seed']}")
    left.set(xlabel="step", ylabel="held-out success", ylim=(0, 1),
             title=f"environments ({envs['started'][:10]})")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    for side, color, label in (("run", GRIDRL, "gridrl-trainer run --rollout local"),
                               ("sdk", SDK, "the tinker SDK on gridrl-trainer serve-api")):
        steps, evals = zip(*tinker[side]["evals"], strict=True)
        right.plot(steps, evals, color=color, marker="o", markersize=3, label=label)
    right.set(xlabel="step", ylabel="held-out eval (128 prompts)", ylim=(0, 1),
              title=f"the Tinker SDK (2026-12-04): {tinker['ratio_median']:.2f}x run's step")
    right.legend(fontsize=8, loc="lower right")
    right.grid(alpha=0.3)
    fig.tight_layout()
    out = docs / "results_envs.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    args = ap.parse_args()
    for out in (vs_trl(args.docs), environments(args.docs)):
        print(out)


if __name__ == "__main__":
    main()
