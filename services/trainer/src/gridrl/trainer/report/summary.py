"""What a run did, from its typed records: the plot (redrawn at every checkpoint) and
``summary.json`` (once, at the end).

    history = RunHistory(run_dir.plot, title="run-1: reverse-words on smollm2-135m-instruct")
    reporter.subscribe(history)          # keeps every StepRecord and the baseline in memory
    ...
    summary = history.summary(cfg, steps=60, ...)    # RunSummary; .to_json() -> summary.json

:class:`RunHistory` is a subscriber of the run's reporter: it keeps the records of the steps
this process ran, after those a resumed run read back from ``log.jsonl``
(:class:`~gridrl.trainer.report.events.History`), so neither the plot nor the summary reads the
log again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gridrl.trainer.config import TrainConfig
from gridrl.trainer.report.events import BaselineEvaluated, Checkpointed, History, RunEvent
from gridrl.trainer.report.plot import plot_run
from gridrl.trainer.report.records import BaselineRecord, EvalPoint, RunSummary, StepRecord

log = logging.getLogger(__name__)


@dataclass
class RunHistory:
    """Keeps a run's records (a reporter subscriber); draws the plot, builds the summary.

    Args:
        plot_path: the PNG redrawn at each checkpoint (``<run_dir>/plot.png``).
        title: the plot's title.
        eval_scorer: what scores the held-out eval (in the plot's title and the summary).
    """

    plot_path: Path
    title: str = ""
    eval_scorer: str = ""
    records: list[StepRecord] = field(default_factory=list)
    baseline: BaselineRecord | None = None
    baseline_score: float | None = None

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)

    def on_event(self, event: RunEvent) -> None:
        match event:
            case History():
                self.records = [*event.records, *self.records]
                self.baseline, self.baseline_score = event.baseline, event.baseline_score
            case BaselineEvaluated(record=baseline):
                self.baseline, self.baseline_score = baseline, baseline.eval_score
            case Checkpointed():
                self.plot()

    def close(self) -> None:
        pass

    def plot(self) -> None:
        """Draw the records so far into :attr:`plot_path` (a failure is logged: a plot must
        never stop training)."""
        try:
            plot_run(self.records, self.plot_path, baseline=self.baseline_score,
                     baseline_stderr=self.baseline.eval_stderr if self.baseline else None,
                     baseline_exact=self.baseline.eval_exact if self.baseline else None,
                     title=self.title, scorer=self.eval_scorer)
        except Exception:
            log.exception("plot failed")

    def evals(self) -> list[EvalPoint]:
        """Every held-out eval of the run's steps, in step order."""
        return [EvalPoint(step=r.step, score=r.eval_score, policy_version=r.eval_policy_version,
                          stderr=r.eval_stderr, elapsed_s=r.elapsed_s, eval_s=r.eval_s,
                          metrics=dict(r.eval_metrics or {}), exact=r.eval_exact,
                          scorer=r.eval_scorer)
                for r in self.records if r.eval_score is not None]

    def summary(self, cfg: TrainConfig, *, steps: int, policy_version: int, elapsed_s: float,
                dropped_samples: int, resumed_at: list[int], eval_tasks: int,
                flagged_nodes: dict[str, str], rollout: str | list[str], adapter: Path,
                adapter_mlx: Path | None, adapter_mlx_error: str | None) -> RunSummary:
        """The run's :class:`RunSummary` from the records kept and the run's totals.

        Args:
            cfg: the run's settings (name, model, task, ``--steps``, ``--master``).
            steps: the last finished step; policy_version: the trainer's version after it.
            elapsed_s: training seconds (model loading excluded); dropped_samples: samples
                dropped for staleness over the run; resumed_at: steps it was resumed from.
            eval_tasks: held-out eval prompts.
            flagged_nodes: every node flagged during the run -> why.
            rollout: the nodes that served the run (sorted addresses) or ``"local"``.
            adapter, adapter_mlx: the final adapter's directories (``adapter_mlx`` None when
                the conversion failed, ``adapter_mlx_error`` saying why).
        """
        evals = self.evals()
        final = evals[-1] if evals else None
        rewards = [r.reward_mean for r in self.records]
        episodes = sum(r.episodes for r in self.records)
        turns = sum(r.turns_mean * r.episodes for r in self.records)
        dropped: dict[str, int] = {}
        counts: dict[str, int] = {}
        for r in self.records:
            for total, part in ((dropped, r.dropped_episodes), (counts, r.env_counts)):
                for k, v in part.items():
                    total[k] = total.get(k, 0) + v
        return RunSummary(
            run_name=cfg.run_name, model=cfg.model, task=cfg.task, steps=steps,
            total_steps=cfg.steps, policy_version=policy_version,
            baseline_eval=self.baseline_score,
            baseline_eval_stderr=self.baseline.eval_stderr if self.baseline else None,
            final_eval=final.score if final else None,
            final_eval_stderr=final.stderr if final else None,
            final_eval_policy_version=final.policy_version if final else None,
            best_eval=max((e.score for e in evals), default=None),
            baseline_eval_exact=self.baseline.eval_exact if self.baseline else None,
            final_eval_exact=final.exact if final else None,
            eval_scorer=self.eval_scorer or (final.scorer if final and final.scorer else ""),
            baseline_eval_metrics=dict(self.baseline.eval_metrics) if self.baseline else {},
            final_eval_metrics=dict(final.metrics) if final else {}, eval_tasks=eval_tasks,
            evals=evals,
            reward_mean_first10=float(np.mean(rewards[:10])) if rewards else None,
            reward_mean_last10=float(np.mean(rewards[-10:])) if rewards else None,
            elapsed_s=elapsed_s, seconds_per_step=elapsed_s / max(len(self.records), 1),
            dropped_samples=dropped_samples, episodes=episodes,
            turns_mean=turns / episodes if episodes else None,
            model_tokens=sum(r.model_tokens for r in self.records),
            env_tokens=sum(r.env_tokens for r in self.records),
            truncated_episodes=sum(r.truncated_episodes for r in self.records),
            dropped_episodes=dict(sorted(dropped.items())), env_counts=dict(sorted(counts.items())),
            reward_error_groups=sum(r.reward_error_groups for r in self.records),
            flagged_nodes=dict(flagged_nodes),
            resumed_at=list(resumed_at), rollout=rollout, master=cfg.master,
            adapter=str(adapter), adapter_mlx=str(adapter_mlx) if adapter_mlx else None,
            adapter_mlx_error=adapter_mlx_error, plot=str(self.plot_path),
            reward_funcs_first10=_function_means(self.records[:10]),
            reward_funcs_last10=_function_means(self.records[-10:]),
            baseline_eval_examples=list(self.baseline.eval_examples) if self.baseline else [],
            final_eval_examples=next((list(r.eval_examples) for r in reversed(self.records)
                                      if r.eval_score is not None and r.eval_examples), []))


def _function_means(records: list[StepRecord]) -> dict[str, float]:
    """Each reward function's mean over ``records`` (steps where it scored nothing skipped)."""
    values: dict[str, list[float]] = {}
    for r in records:
        for name, mean in (r.reward_funcs or {}).items():
            if mean is not None:
                values.setdefault(name, []).append(mean)
    return {name: float(np.mean(v)) for name, v in sorted(values.items())}
