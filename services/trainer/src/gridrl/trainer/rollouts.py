"""What a rollout is: the sampled groups a GRPO step trains on.

An :class:`~gridrl.trainer.envs.source.EpisodeSource` runs ``group_size`` episodes of each item
over a turn sampler (:class:`gridrl.trainer.fleet.pool.NodePool` over rollout nodes, or the
in-process :class:`gridrl.trainer.local.LocalRollout`) and hands the step :class:`Group` s of
their samples. Every sample carries the policy version (adapter version) of the weights that produced it, so
the loop can measure staleness (trainer version - sample version) and drop what is too old.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gridrl.engine import rng

if TYPE_CHECKING:
    from gridrl.engine.contract import FinishReason


@dataclass
class RolloutSample:
    """One completion exactly as a rollout engine sampled it.

    Attributes:
        token_ids: sampled token ids; include the stop token when ``finish_reason == "stop"``.
        logprobs: behaviour logprobs, one per token (natural log, under the distribution the
            token was drawn from).
        text: ``token_ids`` decoded with special tokens skipped.
        finish_reason: ``"stop"`` or ``"length"``.
        policy_version: adapter version of the weights that produced every token (0 = base).
        node: address of the node that sampled it, or ``"local"``.
        loss_mask: for a multi-turn episode, one entry per id of ``token_ids``: 1 on the
            model's tokens, 0 on the environment's (their ``logprobs`` are 0); None: every
            token is the model's (a single-turn sample).
        episode: the :class:`gridrl.trainer.envs.episode.Episode` it came from, or None.
        seconds: wall-clock seconds of the request that sampled it (a node's ``Generate``,
            or the local sampler's call); for an episode, of its turns' requests together.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    policy_version: int
    node: str
    loss_mask: list[int] | None = None
    episode: Any = None
    seconds: float = 0.0


@dataclass
class Group:
    """The ``group_size`` samples of one prompt (a GRPO group), all from one node.

    Attributes:
        prompt_index: index of the item (prompt) in the step's items.
        prompt_ids: the prompt's token ids.
        samples: the samples, in sample-index order.
        node: address of the node that sampled the group, or ``"local"``.
        seconds: wall-clock seconds of the request that produced the group (the successful one).
    """

    prompt_index: int
    prompt_ids: list[int]
    samples: list[RolloutSample]
    node: str
    seconds: float


class DropReason(str, enum.Enum):
    """Why an episode was dropped (``Episode.dropped``): not trained on, counted per step.

    The value is the word in logs, ``log.jsonl`` (``dropped_<reason>``), trackers, Prometheus
    (``reason`` label) and the dashboard; :attr:`words` says it in a sentence, the error
    message following."""

    ENV_ERROR = "env_error"
    TEMPLATE = "template"
    SAMPLER = "sampler"
    MIXED_VERSION = "mixed_version"
    MIXED_NODE = "mixed_node"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def words(self) -> str:
        """The reason in words, e.g. ``the environment raised``."""
        return _DROP_WORDS[self]


_DROP_WORDS = {DropReason.ENV_ERROR: "the environment raised",
               DropReason.TEMPLATE: "the chat template failed:",
               DropReason.SAMPLER: "sampling failed:",
               DropReason.MIXED_VERSION: "a turn's policy version changed:",
               DropReason.MIXED_NODE: "a turn went to another node:"}


@dataclass
class EpisodeStats:
    """A step's episodes in figures (console, ``log.jsonl``, trackers, Prometheus).

    Attributes:
        episodes: episodes run; ``turns``: model turns over all of them.
        model_tokens, env_tokens: tokens sampled by the model / appended by the environment.
        truncated: episodes cut by a limit; ``dropped``: reason (a :class:`DropReason`) ->
            episodes not trained on.
        counts: the environments' counters summed (``tool_calls``, ``tool_errors``...).
        errors: ``(reason, message)`` -> dropped episodes with that error (e.g.
            ``("env_error", "RuntimeError: boom")``), in the order first seen.
    """

    episodes: int = 0
    turns: int = 0
    model_tokens: int = 0
    env_tokens: int = 0
    truncated: int = 0
    dropped: dict[DropReason, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    errors: dict[tuple[DropReason, str], int] = field(default_factory=dict)

    @classmethod
    def of(cls, episodes: Sequence[Any]) -> EpisodeStats:
        """The figures of ``episodes`` (:class:`gridrl.trainer.envs.episode.Episode` s,
        dropped ones included)."""
        out = cls()
        for ep in episodes:
            out.episodes += 1
            out.turns += ep.turns
            out.model_tokens += ep.model_tokens
            out.env_tokens += ep.env_tokens
            out.truncated += ep.truncated is not None
            if ep.dropped:
                out.dropped[ep.dropped] = out.dropped.get(ep.dropped, 0) + 1
                key = (ep.dropped, ep.error or "")
                out.errors[key] = out.errors.get(key, 0) + 1
            for k, v in ep.counts.items():
                out.counts[k] = out.counts.get(k, 0) + v
        return out

    @property
    def all_dropped(self) -> bool:
        """Every episode (at least one) was dropped: nothing of them can be trained on."""
        return self.episodes > 0 and sum(self.dropped.values()) == self.episodes

    def all_dropped_why(self) -> str:
        """When :attr:`all_dropped`, that in one line with the cause, e.g. ``every episode
        was dropped (16 of 16): the environment raised RuntimeError: boom``; else ""."""
        if not self.all_dropped:
            return ""
        causes = sorted(self.errors.items(), key=lambda kv: -kv[1])
        (reason, message), n = causes[0]
        cause = f"{reason.words} {message}".strip()
        if n < self.episodes:
            cause += f" ({n} of them; {len(causes) - 1} other cause(s) for the rest)"
        return f"every episode was dropped ({self.episodes} of {self.episodes}): {cause}"

    @property
    def turns_mean(self) -> float:
        """Model turns per episode."""
        return self.turns / self.episodes if self.episodes else 0.0

    def record(self) -> dict[str, Any]:
        """Flat JSON fields (``log.jsonl`` names)."""
        return {"episodes": self.episodes, "turns_mean": self.turns_mean,
                "model_tokens": self.model_tokens, "env_tokens": self.env_tokens,
                "truncated_episodes": self.truncated,
                "dropped_episodes": sum(self.dropped.values()),
                **{f"dropped_{k.value}": v for k, v in sorted(self.dropped.items())},
                **dict(sorted(self.counts.items()))}


@dataclass
class StepRollouts:
    """The rollouts of one step.

    Attributes:
        step: the step they are for.
        groups: one :class:`Group` per prompt, in prompt order.
        generate_s: wall-clock seconds the source took to produce them.
        wait_s: seconds the training loop waited for them (0 when prefetched in time).
        episodes: the figures of the episodes behind the groups (dropped ones included).
    """

    step: int
    groups: list[Group]
    generate_s: float
    wait_s: float = 0.0
    episodes: EpisodeStats = field(default_factory=EpisodeStats)


def group_seed(seed: int, prompt_index: int) -> int:
    """Sampler seed of group ``prompt_index`` of a call made with ``seed``: the engine's one
    seed derivation (:func:`gridrl.engine.rng.sequence_seed`), so neighbouring groups and
    neighbouring steps get unrelated streams, and a group retried on another node asks for the
    same samples. Returns an int in [0, 2**63)."""
    return rng.sequence_seed(seed, prompt_index) >> 1
