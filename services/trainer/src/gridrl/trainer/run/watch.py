"""Runs that cannot learn, caught early: pure logic the step loop asks once per step.

    watch = LearningWatch(max_dropped_steps=3, no_signal_steps=3, group_size=8)
    verdict = watch.observe(step, episodes, groups_with_signal)
    verdict.no_update_why     # every episode dropped: why, in one line ("" otherwise)
    verdict.warning           # K steps in a row without a group with signal: what to change
    verdict.stop              # N steps in a row with every episode dropped: the run's error

    baseline_warning(scores, group_size)   # the baseline eval's samples all scored the same

GRPO learns only from groups whose rewards differ (a group of equal rewards has zero
advantages: ``groups_with_signal`` counts the others). A reward that is 0 (or 1) for every
sample the model can draw teaches nothing however long the run; so does an environment whose
every episode is dropped (``respond`` raising). The first is a warning (the model may still
draw a rewarded sample), the second stops the run, checkpointed, naming the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gridrl.trainer.rollouts import EpisodeStats


def what_to_change(group_size: int) -> str:
    """The advice of a run without signal, in words."""
    return (f"give partial credit in the reward (a score between 0 and 1 for a reply that is "
            f"nearly right), use an easier task, or sample more per group (--group-size, "
            f"{group_size} now)")


def baseline_warning(scores: Sequence[float], group_size: int) -> str:
    """A warning when every one of the baseline eval's ``scores`` (two or more) is the same,
    else "": the model as it starts gets one score whatever it replies, so its training
    groups will likely have no signal either."""
    if len(scores) < 2 or max(scores) != min(scores):
        return ""
    return (f"the baseline eval's {len(scores)} samples all scored {scores[0]:.3f}: if the "
            f"training samples score alike too, no group has signal and nothing can be "
            f"learned; {what_to_change(group_size)}")


@dataclass(frozen=True)
class Verdict:
    """What :meth:`LearningWatch.observe` saw in one step (empty strings: nothing to say)."""

    no_update_why: str = ""
    warning: str = ""
    stop: str = ""


@dataclass
class LearningWatch:
    """Counts the steps in a row where every episode was dropped, and where no group had
    signal (pure: no clock, no I/O).

    Args:
        max_dropped_steps: stop after this many steps in a row with every episode dropped
            (``--max-dropped-steps``; 0: never).
        no_signal_steps: warn once this many steps in a row had no group with signal
            (``--no-signal-warn-steps``; 0: never); once per such streak.
        group_size: ``--group-size`` (named in the advice).
    """

    max_dropped_steps: int
    no_signal_steps: int
    group_size: int
    dropped_since: int = 0  # first step of the current all-dropped streak (0: none)
    dropped_streak: int = 0
    no_signal_since: int = 0
    no_signal_streak: int = 0

    def observe(self, step: int, episodes: EpisodeStats, groups_with_signal: int) -> Verdict:
        """The verdict of ``step`` (its episodes, dropped ones included, and how many of its
        groups had signal)."""
        why = episodes.all_dropped_why()
        stop = warning = ""
        if why:
            self.dropped_since = self.dropped_since or step
            self.dropped_streak += 1
            if self.max_dropped_steps and self.dropped_streak >= self.max_dropped_steps:
                stop = (f"{self._steps(self.dropped_since, step)}: {why}; stopped after "
                        f"{self.dropped_streak} such step(s) in a row (--max-dropped-steps "
                        f"{self.max_dropped_steps})")
        else:
            self.dropped_since = self.dropped_streak = 0
        if groups_with_signal == 0 and not why:  # (a step with nothing to train says why)
            self.no_signal_since = self.no_signal_since or step
            self.no_signal_streak += 1
            if self.no_signal_steps and self.no_signal_streak == self.no_signal_steps:
                warning = (f"no group had signal in {self._steps(self.no_signal_since, step)} "
                           f"(every sample of each group got the same reward, so the update "
                           f"is zero): nothing is being learned; "
                           f"{what_to_change(self.group_size)}")
        elif groups_with_signal:
            self.no_signal_since = self.no_signal_streak = 0
        return Verdict(no_update_why=why, warning=warning, stop=stop)

    @staticmethod
    def _steps(first: int, last: int) -> str:
        return f"step {last}" if first == last else f"steps {first}-{last}"
