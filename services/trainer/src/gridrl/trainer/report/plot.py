"""The run's PNG: reward and held-out eval (with its exact-match rate) against step, and where
each step's time went (matplotlib, Agg)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from gridrl.trainer.report.records import StepRecord


def plot_run(records: Sequence[StepRecord], path: Path, *, baseline: float | None = None,
             baseline_stderr: float | None = None, baseline_exact: float | None = None,
             title: str = "", scorer: str = "") -> Path:
    """Draw ``records`` (the run's step records, in step order) into ``path``.

    Top: mean reward per step with a +-std band, the eval score (markers, at the steps it
    was measured; the baseline at step 0) with its standard error as error bars
    (:func:`eval_points`), and the eval's exact-match rate (the fraction of completions with
    full marks) beside it. Bottom: each step's time split into rollout, update, sync and eval
    (stacked), with the samples dropped for staleness on a second axis when any were.

    Args:
        records: the steps' records (reward, eval, timings, drops).
        path: the PNG to write (atomically).
        baseline: eval score of the base model, drawn at step 0, with ``baseline_stderr``
            and ``baseline_exact``.
        title: the plot's title; scorer: what scored the eval (a second title line).
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
    exact = ([(0, baseline_exact)] if baseline is not None and baseline_exact is not None
             else []) + [(r.step, r.eval_exact) for r in records
                         if r.eval_score is not None and r.eval_exact is not None]
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
    if exact:
        ax1.plot([e[0] for e in exact], [e[1] for e in exact], "s--", color="tab:purple",
                 ms=4, lw=1, label="eval exact match (full marks)")
    ax1.set_ylabel("score")
    ax1.set_ylim(bottom=min(0.0, *reward) if reward else 0.0)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    heading = "\n".join(filter(None, [title, f"eval scored by {scorer}" if scorer else ""]))
    if heading:
        ax1.set_title(heading, fontsize=10)
    bottom = [0.0] * len(records)
    for label, color, values in step_times(records):
        ax2.bar(x, values, bottom=bottom, color=color, width=0.8, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.grid(alpha=0.3)
    if any(dropped):  # staleness drops: only when there were some
        ax3 = ax2.twinx()
        ax3.plot(x, dropped, "o-", color="tab:red", ms=3, lw=1, label="samples dropped")
        ax3.set_ylabel("samples dropped")
        ax3.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def step_times(records: Sequence[StepRecord]) -> list[tuple[str, str, list[float]]]:
    """Where each step's time went, as ``(label, color, seconds per step)``: rollout (the
    loop's wait for its rollouts, ``collect_s``), update (``train_s``), sync (``sync_s``) and
    eval (``eval_s``, 0 at steps without one)."""
    return [("rollout", "tab:blue", [r.collect_s for r in records]),
            ("update", "tab:orange", [r.train_s for r in records]),
            ("sync", "tab:green", [r.sync_s for r in records]),
            ("eval", "tab:red", [r.eval_s or 0.0 for r in records])]


def eval_points(records: Sequence[StepRecord], baseline: float | None = None,
                baseline_stderr: float | None = None) -> list[tuple[int, float, float]]:
    """The run's eval points as (step, score, standard error): the baseline at step 0, then
    every step record with an eval. A missing standard error is 0 (no bar)."""
    points = [(0, baseline, baseline_stderr or 0.0)] if baseline is not None else []
    return points + [(r.step, r.eval_score, r.eval_stderr or 0.0)
                     for r in records if r.eval_score is not None]
