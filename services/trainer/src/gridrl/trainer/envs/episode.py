"""Running episodes: model turns from a sampler, environment turns from the environment, one
token-exact sequence per episode.

    groups = run_episodes(env, items, prompt_ids, sample, delta, limits,
                          group_size=8, seed=step_seed, decode=tokenizer.decode)

Turn 1 of the ``G`` episodes of item ``i`` is one request of ``G`` samples with seed
:func:`~gridrl.trainer.rollouts.group_seed` ``(seed, i)``, exactly the single-turn GRPO group
(a one-turn environment samples what the task sampled before). Each later turn of episode ``j``
is its own request of one sample, seed :func:`turn_seed`, whose prompt is the episode so far
(prompt, every model turn's sampled ids, every environment turn's template delta): the node that
sampled the previous turn holds its KV cache (``keep_cache``). Each round sends every live
episode's next turn in one sampler call, so the turns of many episodes batch together.

An episode ends when the environment says done; is cut (``truncated``) at ``max_turns`` model
turns or when the next turn would pass ``max_episode_tokens`` tokens after the prompt; is
dropped (``dropped`` names why, counted per step) when the environment raised, the chat template
cannot extend it token-exactly, its sampler request failed (a node died mid-episode), or a
later turn came from another policy version than its first (a push landed between turns: an
episode is never trained across policy versions) or from another node (a sampler that broke
the pin of :attr:`TurnRequest.node`: never trained either).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gridrl.engine import rng
from gridrl.trainer.envs.base import Environment, Message, TaskItem
from gridrl.trainer.envs.chat import ChatDelta, TemplateDeltaError
from gridrl.trainer.rollouts import DropReason, RolloutSample, group_seed

if TYPE_CHECKING:
    from gridrl.engine.contract import FinishReason

log = logging.getLogger(__name__)

TRUNCATED_TURNS = "max_turns"
TRUNCATED_TOKENS = "max_episode_tokens"


@dataclass(frozen=True)
class TurnRequest:
    """One sampler request: ``n`` samples of ``max_tokens`` new tokens at most after
    ``prompt_ids``, sample ``k`` seeded ``sequence_seed(seed, k)`` (a node's ``Generate``).

    Attributes:
        keep_cache: the sampler's node should keep the KV cache of each sample for a
            continuation (another turn of the episode follows).
        group: the item (group) this request belongs to, so a pool keeps a group's requests
            on one node.
        node: the node that sampled the episode's earlier turns ("" on turn 1): a pool sends
            the request there (it holds the episode's keys and values), and fails it rather
            than mix nodes when that node is gone (the episode is then dropped and counted).
    """

    prompt_ids: tuple[int, ...]
    seed: int
    n: int
    max_tokens: int
    keep_cache: bool = False
    group: int = 0
    node: str = ""


#: ``sample(requests) -> per request: its n samples, or the exception that failed it``
Sampler = Callable[[list[TurnRequest]], list["list[RolloutSample] | BaseException"]]


@dataclass(frozen=True)
class EpisodeLimits:
    """Limits of an episode.

    Attributes:
        max_turns: model turns at most (``--max-turns``, >= 1).
        max_tokens: new tokens per model turn (``--max-tokens``).
        max_episode_tokens: tokens after the prompt at most, model and environment turns
            together (``--max-episode-tokens``; 0: ``max_turns * max_tokens`` plus whatever
            the environment appends, i.e. no limit of its own).
    """

    max_turns: int = 1
    max_tokens: int = 40
    max_episode_tokens: int = 0


@dataclass
class Episode:
    """One episode, token-exact.

    Attributes:
        item: the item it started from.
        group, index: its item's index in the call and its index in the group.
        prompt_ids: the first turn's prompt ids.
        token_ids: every id after the prompt: model turns as sampled, environment turns as
            template deltas.
        logprobs: one per id of ``token_ids``: the behaviour logprob on model tokens, 0.0 on
            environment tokens.
        loss_mask: one per id: 1 on model tokens, 0 on environment tokens.
        transcript: the messages after the prompt (assistant replies as decoded text,
            environment messages as appended).
        turns: model turns.
        state: the environment's state.
        counts: the environment turns' counters summed (tool calls, errors, timeouts...).
        done: the environment said done.
        truncated: None, :data:`TRUNCATED_TURNS` or :data:`TRUNCATED_TOKENS`.
        dropped: None, or why it is not trained on (a
            :class:`~gridrl.trainer.rollouts.DropReason`) with ``error`` the message.
        policy_version, node: of its model turns (all the same).
        turn_versions: the policy version of each model turn, in order (all equal to
            ``policy_version`` in an episode that was not dropped: the trained record shows
            every turn's).
        finish_reason: of the last model turn.
        seconds: wall-clock seconds of its turns' sampler requests, added up.
    """

    item: TaskItem
    group: int
    index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    transcript: list[Message] = field(default_factory=list)
    turns: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    done: bool = False
    truncated: str | None = None
    dropped: DropReason | None = None
    error: str | None = None
    policy_version: int | None = None
    turn_versions: list[int] = field(default_factory=list)
    node: str = ""
    finish_reason: FinishReason = "length"
    seconds: float = 0.0
    _history: list[Message] = field(default_factory=list, repr=False)
    _last_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled (trained on)."""
        return sum(self.loss_mask)

    @property
    def env_tokens(self) -> int:
        """Tokens the environment's turns added (no gradient)."""
        return len(self.loss_mask) - self.model_tokens

    @property
    def last_reply(self) -> str:
        """The model's last reply (what reward functions get as the completion)."""
        return next((m["content"] for m in reversed(self.transcript)
                     if m["role"] == "assistant"), "")

    @property
    def live(self) -> bool:
        return not (self.done or self.truncated or self.dropped)

    def drop(self, why: DropReason, error: str) -> None:
        self.dropped, self.error = why, error

    def sample(self) -> RolloutSample:
        """The episode as the training loop's sample: ``token_ids`` / ``logprobs`` over every
        id after the prompt, ``loss_mask`` over the model's (None when every id is the
        model's: a one-turn episode is exactly the single-turn sample), ``text`` the last
        reply."""
        mask = None if self.env_tokens == 0 else list(self.loss_mask)
        return RolloutSample(token_ids=list(self.token_ids), logprobs=list(self.logprobs),
                             text=self.last_reply, finish_reason=self.finish_reason,
                             policy_version=self.policy_version or 0, node=self.node,
                             loss_mask=mask, episode=self, seconds=self.seconds)

    def record(self) -> dict[str, Any]:
        """A JSON-able summary (no ids): turns, tokens, how it ended, counters."""
        return {"turns": self.turns, "turn_versions": list(self.turn_versions),
                "model_tokens": self.model_tokens,
                "env_tokens": self.env_tokens, "done": self.done, "truncated": self.truncated,
                "dropped": self.dropped.value if self.dropped else None, "error": self.error,
                **self.counts}


def turn_seed(seed: int, prompt_index: int, turn: int, index: int) -> int:
    """Request seed of turn ``turn`` (>= 2) of episode ``index`` of group ``prompt_index`` in
    a call made with ``seed``: the engine's seed derivation applied to the group's seed, the
    turn and the episode, so every turn of every episode draws its own stream and a retried
    request asks for the same tokens. Returns an int in [0, 2**63)."""
    g = group_seed(seed, prompt_index)
    return rng.sequence_seed(rng.sequence_seed(g, turn), index) >> 1


def run_episodes(env: Environment, items: Sequence[TaskItem],
                 prompt_ids: Sequence[Sequence[int]], sample: Sampler, delta: ChatDelta,
                 limits: EpisodeLimits, *, group_size: int, seed: int,
                 decode: Callable[[list[int]], str]) -> list[list[Episode]]:
    """Run ``group_size`` episodes of every item to their end.

    Args:
        env: the environment.
        items: the items (one group each).
        prompt_ids: their first prompts (the chat template of ``item.messages``, with the
            environment's tools).
        sample: the sampler (see :data:`Sampler`).
        delta: the chat-template delta of the run's tokenizer (and tools).
        limits: turns and tokens.
        group_size: episodes per item.
        seed: the call's seed (the step's).
        decode: ids -> text with special tokens skipped (a reply's text).
    Returns:
        per item, its episodes in index order, every one ended (done, truncated or dropped).
    """
    episodes = [[Episode(item=item, group=g, index=j, prompt_ids=list(prompt_ids[g]),
                         _history=[dict(m) for m in item.messages])
                 for j in range(group_size)] for g, item in enumerate(items)]
    for group in episodes:
        for ep in group:
            try:
                ep.state = env.start(ep.item)
            except Exception as e:
                _env_failed(env, ep, e)
    # turn 1: one request per group
    first = [TurnRequest(tuple(prompt_ids[g]), group_seed(seed, g), group_size,
                         _turn_budget(limits, 0), keep_cache=limits.max_turns > 1, group=g)
             for g in range(len(items))]
    results = sample(first)
    pending: list[Episode] = []
    for g, result in enumerate(results):
        for ep in episodes[g]:
            if isinstance(result, BaseException):
                ep.drop(DropReason.SAMPLER, f"{type(result).__name__}: {result}")
            elif ep.live:
                _model_turn(ep, result[ep.index], decode)
                pending.append(ep)
    turn = 1
    while pending:
        live = [ep for ep in pending if _environment_turn(env, ep, delta, limits)]
        turn += 1
        if not live:
            break
        requests = [TurnRequest(tuple(ep.prompt_ids + ep.token_ids),
                                turn_seed(seed, ep.group, turn, ep.index), 1,
                                _turn_budget(limits, len(ep.token_ids)),
                                keep_cache=turn < limits.max_turns, group=ep.group,
                                node=ep.node)
                    for ep in live]
        pending = []
        for ep, result in zip(live, sample(requests), strict=True):
            if isinstance(result, BaseException):
                ep.drop(DropReason.SAMPLER, f"{type(result).__name__}: {result}")
            elif result[0].policy_version != ep.policy_version:
                ep.drop(DropReason.MIXED_VERSION, f"turn {turn} sampled by policy version "
                                         f"{result[0].policy_version}, turn 1 by "
                                         f"{ep.policy_version}")
            elif result[0].node != ep.node:
                ep.drop(DropReason.MIXED_NODE, f"turn {turn} sampled by {result[0].node}, the earlier "
                                      f"turns by {ep.node}")
            else:
                _model_turn(ep, result[0], decode)
                pending.append(ep)
    _log_env_errors(env, [ep for group in episodes for ep in group])
    return episodes


def _log_env_errors(env: Environment, episodes: Sequence[Episode]) -> None:
    """One warning per distinct error the environment raised in ``episodes``, with how many
    episodes it dropped (not one line per episode)."""
    counts: dict[str, int] = {}
    for ep in episodes:
        if ep.dropped is DropReason.ENV_ERROR:
            counts[ep.error or ""] = counts.get(ep.error or "", 0) + 1
    for error, n in counts.items():
        log.warning("environment %s raised in %d of %d episode(s) (dropped): %s", env.name, n,
                    len(episodes), error)


def _turn_budget(limits: EpisodeLimits, used: int) -> int:
    """New tokens the next model turn may sample after ``used`` episode tokens."""
    if limits.max_episode_tokens <= 0:
        return limits.max_tokens
    return max(1, min(limits.max_tokens, limits.max_episode_tokens - used))


def _model_turn(ep: Episode, s: RolloutSample, decode: Callable[[list[int]], str]) -> None:
    ep.token_ids += s.token_ids
    ep.logprobs += s.logprobs
    ep.loss_mask += [1] * len(s.token_ids)
    ep.turns += 1
    ep.finish_reason = s.finish_reason
    ep.policy_version = s.policy_version if ep.policy_version is None else ep.policy_version
    ep.turn_versions.append(s.policy_version)
    ep.node = s.node
    ep.seconds += s.seconds
    ep._last_ids = list(s.token_ids)
    text = s.text if s.text or not s.token_ids else decode(s.token_ids)
    ep.transcript.append({"role": "assistant", "content": text})


def _environment_turn(env: Environment, ep: Episode, delta: ChatDelta,
                      limits: EpisodeLimits) -> bool:
    """Ask the environment for its turn after ``ep``'s last model turn and append it. True
    when the episode goes on to another model turn."""
    try:
        answer = env.respond(ep.item, list(ep.transcript), ep.state)
    except Exception as e:
        _env_failed(env, ep, e)
        return False
    for key, value in answer.counts.items():
        ep.counts[key] = ep.counts.get(key, 0) + int(value)
    if answer.done:
        ep.done = True
        return False
    if ep.turns >= limits.max_turns:
        ep.truncated = TRUNCATED_TURNS
        return False
    new = [dict(m) for m in answer.messages]
    history = [*ep._history, ep.transcript[-1]]
    try:
        ids = delta.append(ep._history, ep._last_ids, ep.finish_reason == "stop", new)
    except TemplateDeltaError as e:
        ep.drop(DropReason.TEMPLATE, str(e))
        log.warning("episode dropped: %s", e)
        return False
    if limits.max_episode_tokens > 0 and \
            len(ep.token_ids) + len(ids) + 1 > limits.max_episode_tokens:
        ep.truncated = TRUNCATED_TOKENS
        return False
    ep.token_ids += ids
    ep.logprobs += [0.0] * len(ids)
    ep.loss_mask += [0] * len(ids)
    ep.transcript += new
    ep._history = history + new
    return True


def _env_failed(env: Environment, ep: Episode, e: Exception) -> None:
    """Drop ``ep`` for the environment's exception (logged once per call with a count:
    :func:`_log_env_errors`)."""
    ep.drop(DropReason.ENV_ERROR, f"{type(e).__name__}: {e}")


def reward_columns(episodes: Sequence[Episode]) -> dict[str, list[Any]]:
    """The columns reward functions get for ``episodes`` (module docstring of
    :mod:`gridrl.trainer.envs.base`): the items' columns, ``completion_ids``, ``transcript``,
    ``turns``, ``truncated``, ``state``."""
    keys: dict[str, None] = {}
    for ep in episodes:
        keys.update(dict.fromkeys(ep.item.columns))
    columns: dict[str, list[Any]] = {k: [ep.item.columns.get(k) for ep in episodes] for k in keys}
    columns["completion_ids"] = [list(ep.token_ids) for ep in episodes]
    columns["transcript"] = [list(ep.transcript) for ep in episodes]
    columns["turns"] = [ep.turns for ep in episodes]
    columns["truncated"] = [ep.truncated for ep in episodes]
    columns["state"] = [ep.state for ep in episodes]
    return columns
