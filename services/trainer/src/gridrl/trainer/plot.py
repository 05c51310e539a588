"""The run's PNG: reward, held-out eval and staleness against step (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_run(records: Sequence[dict[str, Any]], path: Path, *, baseline: float | None = None,
             title: str = "") -> Path:
    """Draw ``records`` (``log.jsonl`` step records) into ``path``.

    Top: mean reward per step with a +-std band, and the eval score (markers, at the steps it
    was measured; the baseline at step 0). Bottom: mean staleness and samples dropped per step.

    Args:
        records: dicts with ``step``, ``reward_mean``, ``reward_std``, ``staleness_mean``,
            ``dropped_samples`` and optionally ``eval_score``; records without ``step`` are
            ignored.
        path: the PNG to write (atomically).
        baseline: eval score of the base model, drawn at step 0.
    Returns:
        ``path``.
    """
    import logging

    import matplotlib

    # Its first use in an account builds a font cache and says so at INFO, between step lines.
    logging.getLogger("matplotlib").setLevel(max(logging.WARNING,
                                                 logging.getLogger("matplotlib").level))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.get("step")]
    x = [r["step"] for r in steps]
    reward = [r.get("reward_mean", 0.0) for r in steps]
    std = [r.get("reward_std", 0.0) for r in steps]
    evals = [(r["step"], r["eval_score"]) for r in steps if r.get("eval_score") is not None]
    if baseline is not None:
        evals.insert(0, (0, baseline))
    stale = [r.get("staleness_mean", 0.0) for r in steps]
    dropped = [r.get("dropped_samples", 0) for r in steps]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    ax1.plot(x, reward, color="tab:blue", lw=1.2, label="reward (mean)")
    ax1.fill_between(x, [m - s for m, s in zip(reward, std, strict=True)],
                     [m + s for m, s in zip(reward, std, strict=True)], color="tab:blue",
                     alpha=0.15, lw=0)
    if evals:
        ax1.plot([e[0] for e in evals], [e[1] for e in evals], "o-", color="tab:red",
                 label="held-out eval (greedy)")
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
