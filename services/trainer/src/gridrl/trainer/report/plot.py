"""The run's PNG: reward, held-out eval and staleness against step (matplotlib, Agg)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from gridrl.trainer.report.records import StepRecord


def plot_run(records: Sequence[StepRecord], path: Path, *, baseline: float | None = None,
             baseline_stderr: float | None = None, title: str = "") -> Path:
    """Draw ``records`` (the run's step records, in step order) into ``path``.

    Top: mean reward per step with a +-std band, and the eval score (markers, at the steps it
    was measured; the baseline at step 0) with its standard error as error bars
    (:func:`eval_points`). Bottom: mean staleness and samples dropped per step.

    Args:
        records: the steps' records (reward mean and std, eval score, staleness, drops).
        path: the PNG to write (atomically).
        baseline: eval score of the base model, drawn at step 0, with ``baseline_stderr``.
    Returns:
        ``path``.
    """
    import matplotlib

    # Its first use in an account builds a font cache and says so at INFO, between step lines.
    logging.getLogger("matplotlib").setLevel(max(logging.WARNING,
                                                 logging.getLogger("matplotlib").level))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.step for r in records]
    reward = [r.reward_mean for r in records]
    std = [r.reward_std for r in records]
    evals = eval_points(records, baseline, baseline_stderr)
    stale = [r.staleness_mean for r in records]
    dropped = [r.dropped_samples for r in records]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    ax1.plot(x, reward, color="tab:blue", lw=1.2, label="reward (mean)")
    ax1.fill_between(x, [m - s for m, s in zip(reward, std, strict=True)],
                     [m + s for m, s in zip(reward, std, strict=True)], color="tab:blue",
                     alpha=0.15, lw=0)
    if evals:
        ax1.errorbar([e[0] for e in evals], [e[1] for e in evals],
                     yerr=[e[2] for e in evals], fmt="o-", color="tab:red", capsize=3,
                     label="held-out eval (greedy) ± standard error")
    ax1.set_ylabel("score")
    ax1.set_ylim(bottom=min(0.0, *reward) if reward else 0.0)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    if title:
        ax1.set_title(title)
    ax2.plot(x, stale, color="tab:green", label="staleness (mean)")
    ax2.bar(x, dropped, color="tab:orange", alpha=0.5, label="samples dropped")
    ax2.set_xlabel("step")
    ax2.set_ylabel("versions / samples")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def eval_points(records: Sequence[StepRecord], baseline: float | None = None,
                baseline_stderr: float | None = None) -> list[tuple[int, float, float]]:
    """The run's eval points as (step, score, standard error): the baseline at step 0, then
    every step record with an eval. A missing standard error is 0 (no bar)."""
    points = [(0, baseline, baseline_stderr or 0.0)] if baseline is not None else []
    return points + [(r.step, r.eval_score, r.eval_stderr or 0.0)
                     for r in records if r.eval_score is not None]
