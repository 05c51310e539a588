"""The run on the terminal: one line per step, and a line for each thing an operator must see
(a node flagged or skipped, a wait for nodes, a resume, a stop, the end).

    reporter.subscribe(ConsoleLines(Console(), total_steps=60, remote=True))

:class:`ConsoleLines` is a subscriber of the run's reporter
(:mod:`gridrl.trainer.report.reporter`): it formats records and events with ``rich`` markup and
knows nothing else of the run. A wait for rollout nodes prints a line when it begins and
every ``wait_every_s`` seconds after (what it waits for, how long is left) and one when it
ends (``GetRunStatusResponse.node_wait`` is the status subscriber's; the
``gridrl_trainer_node_wait_*`` gauges are the pool's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from rich.markup import escape

from gridrl.trainer.fleet.pool import NodeWait
from gridrl.trainer.report.events import (
    BENCHED,
    BaselineEvaluated,
    EvalProgressed,
    FailedRunCheckpointed,
    LearningWarning,
    NodeFlagged,
    NodeReviewed,
    NodesReady,
    NodeWaitChanged,
    NoUpdate,
    ResumedWeightsPushed,
    RunEvent,
    RunFinished,
    RunResumed,
    RunStopped,
    SyncSkipped,
)
from gridrl.trainer.report.records import StepRecord

#: what each field of the step line means, in the line's order (printed before the first step)
LEGEND_FIELDS = (
    ("step n/N", "the step and --steps"),
    ("reward", "mean±std of the step's samples (with several reward functions: each one's "
               "mean in brackets)"),
    ("eval", "held-out score±stderr@policy version, exact: its completions with full marks "
             "(then the environment's eval figures)"),
    ("reward errors", "groups left out because a reward function failed"),
    ("stale", "mean policy versions the samples were behind; dropped: samples too stale"),
    ("kl", "behaviour vs trainer logprobs"),
    ("loss", "the GRPO surrogate, ≈0 on-policy (advantages are centred in each group); "
             "gnorm: the update's size"),
    ("is", "importance weights: mean/max and the fraction capped"),
    ("v", "policy version after the step"),
    ("sync", "seconds to push the adapter, nodes that took it/all"),
    ("roll", "seconds sampling; train: seconds updating; tok/s: sampled tokens per second"),
    ("FLAGGED", "nodes whose samples are kept out"),
)
#: the fields of the step line's episode part (printed before the first step that has one)
EPISODE_LEGEND_FIELDS = (
    ("turns", "model turns per episode, mean"),
    ("env a/b tok", "tokens the environment's turns added (a, not trained on) of all tokens "
                    "after the prompts (b)"),
    ("trunc", "episodes cut by --max-turns or --max-episode-tokens"),
    ("drop", "episodes not trained on, by reason (env_error: the environment raised; "
             "template, sampler, mixed_version, mixed_node)"),
    ("tools", "tool calls, errors (err) and timeouts; then the environment's own counters"),
)


def _legend(fields: tuple[tuple[str, str], ...]) -> str:
    return "[dim]" + "; ".join(f"{name}: {meaning}" for name, meaning in fields) + "[/]"


LEGEND = _legend(LEGEND_FIELDS)
EPISODE_LEGEND = _legend(EPISODE_LEGEND_FIELDS)


class Printer(Protocol):
    """A ``rich.console.Console``, or anything with its ``print``."""

    def print(self, *objects: object) -> None: ...


class ConsoleLines:
    """Prints the run's steps and events (see the module docstring).

    Args:
        console: where the lines go (a ``rich`` console: the markup is rendered).
        total_steps: the run's ``--steps`` (``step 3/60``).
        remote: the run syncs rollout nodes (the step line has a sync column).
        wait_every_s: seconds between lines while a wait for nodes lasts.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, console: Printer, *, total_steps: int, remote: bool,
                 wait_every_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.total_steps = total_steps
        self.remote = remote
        self.wait_every_s = wait_every_s
        self._clock = clock
        self._legend_printed = False
        self._episode_legend_printed = False
        self._wait_printed_at: float | None = None
        self._last_wait: NodeWait | None = None
        self._expected_printed = False

    def on_step(self, r: StepRecord) -> None:
        if not self._legend_printed:
            self._legend_printed = True
            self.console.print(LEGEND)
        parts = [f"step {r.step:>4}/{self.total_steps}",
                 f"reward {r.reward_mean:.3f}±{r.reward_std:.2f}"]
        if len(r.reward_funcs or {}) > 1:
            parts[-1] += " (" + " ".join(f"{name} {_mean(v)}"
                                         for name, v in r.reward_funcs.items()) + ")"
        if r.eval_score is not None:
            parts.append(f"[bold green]eval {r.eval_score:.3f}±{r.eval_stderr or 0:.3f}"
                         f"@v{r.eval_policy_version}[/]"
                         + (f" exact {r.eval_exact:.2f}" if r.eval_exact is not None else "")
                         + _eval_metrics(r.eval_metrics))
        if r.reward_error_groups:
            parts.append(f"[red]reward errors: {r.reward_error_groups} group(s) left out[/]")
        if episodes := _episodes(r):
            if not self._episode_legend_printed:
                self._episode_legend_printed = True
                self.console.print(EPISODE_LEGEND)
            parts.append(episodes)
        stale = f"stale {r.staleness_mean:.1f}"
        if r.dropped_samples:
            stale += f" [red]dropped {r.dropped_samples}[/]"
        parts += [stale, f"kl {r.mismatch_kl:.1e}", f"loss {r.loss:+.4f}"
                  + (f" gnorm {r.grad_norm:.2f}" if r.grad_norm is not None else ""),
                  f"v{r.policy_version}"]
        if r.is_weight_mean is not None:
            parts.insert(-1, f"is {r.is_weight_mean:.2f}/max {r.is_weight_max:.2f} "
                             f"capped {r.is_limited_fraction:.0%}")
        if self.remote:
            if r.synced_nodes is not None:
                n_all = r.nodes_synced + r.nodes_skipped
                color = "red" if r.nodes_skipped else "default"
                parts.append(f"[{color}]sync {r.sync_s:.2f}s {r.nodes_synced}/{n_all} nodes[/]")
            else:
                parts.append("sync -")
        parts.append(f"roll {r.rollout_s:.1f}s train {r.train_s:.1f}s "
                     f"{r.tokens_per_s:.0f} tok/s"
                     + (f" mem {r.peak_rss_mb / 1024:.1f}G" if r.peak_rss_mb else ""))
        if r.flagged_nodes:
            parts.append(f"[bold red]FLAGGED: {', '.join(sorted(r.flagged_nodes))}[/]")
        self.console.print(" │ ".join(parts))

    def on_event(self, event: RunEvent) -> None:
        match event:
            case RunResumed():
                self.console.print(f"[bold]resumed[/] at step {event.step} from "
                                   f"{event.checkpoint} (policy version {event.policy_version})")
            case NodesReady():
                self.console.print("rollout nodes: " + ", ".join(
                    f"{n.address} ({n.backend or '?'}, capacity {n.capacity})"
                    for n in event.nodes if n.in_rotation))
            case ResumedWeightsPushed():
                self.console.print(f"pushed resumed weights as policy version "
                                   f"{event.policy_version} to {event.nodes} node(s)")
            case BaselineEvaluated(record=b):
                self.console.print(f"baseline eval {b.eval_score:.3f}±{b.eval_stderr or 0:.3f} "
                                   f"(exact {b.eval_exact:.2f}, policy version 0, "
                                   f"{b.eval_n} tasks)" + _eval_metrics(b.eval_metrics)
                                   + (f"; scored by {b.eval_scorer}" if b.eval_scorer else ""))
            case EvalProgressed(step=0, progress=p) if (
                    p is not None and p.expected_s is not None and p.done < p.total
                    and not self._expected_printed):
                self._expected_printed = True
                self.console.print(f"baseline eval: {p.total} prompts, about "
                                   f"{_duration(p.expected_s)} expected (the first {p.done} "
                                   f"took {_duration(p.elapsed_s)}; --eval-tasks sets how many)")
            case NoUpdate(why=why) if why:
                self.console.print(f"[bold red]step {event.step}: {escape(why)}; no update[/]")
            case NoUpdate():
                self.console.print(f"[bold red]step {event.step}: no sample survived the "
                                   f"staleness filter ({event.dropped} dropped); no update[/]")
            case LearningWarning():
                where = "at start-up" if event.step == 0 else f"at step {event.step}"
                self.console.print(f"[bold yellow]nothing can be learned? ({where})[/] "
                                   + escape(event.message))
            case NodeFlagged():
                benched = f"; {BENCHED}" if event.benched else ""
                self.console.print(f"[bold white on red] NODE FLAGGED [/] [bold red]{event.node}"
                                   f"[/] at step {event.step}: {event.reason}{benched}")
            case NodeReviewed(review=review):
                color, verb = ("green", "") if review.passed else ("red", "stays benched: ")
                self.console.print(f"[bold {color}]node {review.node}[/] {verb}{review.message}")
            case SyncSkipped():
                self.console.print(
                    f"[bold red]SYNC of policy version {event.policy_version}: "
                    f"{len(event.skipped)} node(s) skipped[/] " + "; ".join(
                        f"{a}: {why}" for a, why in sorted(event.skipped.items()))
                    + (f" [red]lagging: {', '.join(event.lagging)}[/]" if event.lagging else ""))
            case NodeWaitChanged():
                self._node_wait(event.wait, event.stopping)
            case FailedRunCheckpointed() | RunStopped():
                self.console.print(f"[bold yellow]{event.message}[/]")
            case RunFinished(summary=s, run_dir=run_dir):
                final = (f"{s.final_eval:.3f}" + (f"±{s.final_eval_stderr:.3f}"
                                                  if s.final_eval_stderr is not None else "")
                         + _exact(s.final_eval_exact)
                         + f" (policy version {s.final_eval_policy_version})"
                         if s.final_eval is not None else "n/a")
                baseline = (f"{s.baseline_eval:.3f}{_exact(s.baseline_eval_exact)}"
                            if s.baseline_eval is not None else "n/a")
                scorer = f" (scored by {s.eval_scorer})" if s.eval_scorer else ""
                self.console.print(f"[bold]done[/]: {s.steps} steps, eval {baseline} -> "
                                   f"{final}{scorer}, run directory {run_dir}")
                if s.flagged_nodes:
                    self.console.print("[bold red]nodes flagged during the run: " + "; ".join(
                        f"{n}: {w}" for n, w in sorted(s.flagged_nodes.items())) + "[/]")

    def close(self) -> None:
        pass

    def _node_wait(self, wait: NodeWait | None, stopping: bool) -> None:
        """A line when a wait begins, every ``wait_every_s`` while it lasts, one when it ends
        (a second end says nothing)."""
        if wait is None:
            last = self._last_wait
            if last is not None and stopping:
                self.console.print(f"[bold yellow]stopped waiting for rollout nodes[/] after "
                                   f"{last.waited_s:.0f}s: the run was asked to stop")
            elif last is not None and last.starting:
                self.console.print(f"[bold green]rollout node(s) ready[/] after waiting "
                                   f"{last.waited_s:.0f}s")
            elif last is not None:
                self.console.print(f"[bold green]a rollout node is back[/] after waiting "
                                   f"{last.waited_s:.0f}s; going on")
            self._last_wait = self._wait_printed_at = None
            return
        if wait.gave_up:  # its time ran out: the run fails, and says why
            what = (f"{wait.needed} rollout node(s) ({wait.in_rotation} ready)" if wait.starting
                    else "a rollout node")
            flag = "--start-wait-s" if wait.starting else "--outage-wait-s"
            self.console.print(f"[bold red]gave up waiting for {what}[/] after "
                               f"{wait.waited_s:.0f}s ({flag}): {wait.waiting_for}")
            self._last_wait = self._wait_printed_at = None
            return
        self._last_wait = wait
        now = self._clock()
        if self._wait_printed_at is not None and now - self._wait_printed_at < self.wait_every_s:
            return
        self._wait_printed_at = now
        if wait.starting:
            self.console.print(
                f"[bold yellow]waiting for {wait.needed} rollout node(s)[/] "
                f"({wait.in_rotation} ready) for {wait.waited_s:.0f}s, {wait.left_s:.0f}s "
                f"left (--start-wait-s): {wait.waiting_for}")
        else:
            self.console.print(
                f"[bold yellow]waiting for a rollout node[/] (none in rotation) for "
                f"{wait.waited_s:.0f}s, {wait.left_s:.0f}s left (--outage-wait-s): "
                f"{wait.waiting_for}")


# the environment's counters shown on the step line, and their short names
_COUNTS = (("tool_calls", "calls"), ("tool_errors", "err"), ("tool_timeouts", "timeouts"))


def _exact(value: float | None) -> str:
    """`` exact 0.06`` (the fraction with full marks), or "" when not known."""
    return "" if value is None else f" exact {value:.2f}"


def _duration(seconds: float) -> str:
    """``"45s"``, ``"3.2 min"``."""
    return f"{seconds:.0f}s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _mean(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _eval_metrics(metrics: dict[str, float] | None) -> str:
    """The environment's eval figures, e.g. `` (first_attempt_success 0.31
    second_attempt_success 0.12 turns_mean 1.7)``; "" without any."""
    if not metrics:
        return ""
    return " (" + " ".join(f"{k} {v:.2f}" for k, v in metrics.items()) + ")"


def _episodes(r: StepRecord) -> str:
    """The step's episodes when there is more to them than one model turn: ``turns 1.62 env
    96/310 tok trunc 2 drop 1 (sampler 1) tools calls 5 err 1 timeouts 0``; "" for a
    single-turn step."""
    if not (r.turns_mean > 1 or r.env_tokens or r.truncated_episodes or r.dropped_episodes
            or r.env_counts):
        return ""
    out = f"turns {r.turns_mean:.2f} env {r.env_tokens}/{r.env_tokens + r.model_tokens} tok"
    if r.truncated_episodes:
        out += f" trunc {r.truncated_episodes}"
    if r.dropped_episodes:
        out += (f" [red]drop {sum(r.dropped_episodes.values())} ("
                + " ".join(f"{k} {v}" for k, v in r.dropped_episodes.items()) + ")[/]")
    shown = [(short, r.env_counts[k]) for k, short in _COUNTS if k in r.env_counts]
    others = [(k, v) for k, v in r.env_counts.items() if k not in dict(_COUNTS)]
    if shown:
        out += " tools " + " ".join(f"{k} {v}" for k, v in shown)
    if others:
        out += " " + " ".join(f"{k} {v}" for k, v in others)
    return out
