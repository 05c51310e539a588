"""What a rollout is: the sampled groups a GRPO step trains on, and where they come from.

A :class:`RolloutSource` turns prompts into :class:`Group` s of ``group_size`` samples each:
:class:`gridrl.trainer.pool.NodePool` over rollout nodes, or the in-process ``LocalRollout``.
Every sample carries the policy version (adapter version) of the weights that produced it, so
the loop can measure staleness (trainer version - sample version) and drop what is too old.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gridrl.engine import rng
from gridrl.v1 import common_pb2

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


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
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    policy_version: int
    node: str


@dataclass
class Group:
    """The ``group_size`` samples of one prompt (a GRPO group), all from one node.

    Attributes:
        prompt_index: index of the prompt in the ``prompts`` passed to ``generate_groups``.
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


class RolloutSource(Protocol):
    """Something that samples groups: the node pool or the local sampler."""

    def generate_groups(self, prompts: Sequence[Sequence[int]], *, group_size: int,
                        max_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                        seed: int = 0, stop_token_ids: Sequence[int] = ()) -> list[Group]:
        """Sample ``group_size`` completions of at most ``max_tokens`` tokens for every prompt.

        Returns one :class:`Group` per prompt, in the order of ``prompts``. Group ``i`` is
        sampled with seed :func:`group_seed` ``(seed, i)``.

        Raises:
            RuntimeError: when no node can serve (every node dead or out of rotation).
        """
        ...

    def close(self) -> None:
        """Release threads and connections. Idempotent."""
        ...


def group_seed(seed: int, prompt_index: int) -> int:
    """Sampler seed of group ``prompt_index`` of a call made with ``seed``: the engine's one
    seed derivation (:func:`gridrl.engine.rng.sequence_seed`), so neighbouring groups and
    neighbouring steps get unrelated streams, and a group retried on another node asks for the
    same samples. Returns an int in [0, 2**63)."""
    return rng.sequence_seed(seed, prompt_index) >> 1


def sample_from_proto(sample: common_pb2.Sample, node: str) -> RolloutSample:
    """Convert a wire ``Sample`` sampled by ``node``.

    Raises:
        ValueError: naming the field, when ``logprobs`` and ``token_ids`` differ in length or
            ``finish_reason`` is unspecified.
    """
    if len(sample.logprobs) != len(sample.token_ids):
        raise ValueError(f"samples[].logprobs: {len(sample.logprobs)} logprobs for "
                         f"{len(sample.token_ids)} tokens")
    finish = _FINISH.get(sample.finish_reason)
    if finish is None:
        raise ValueError(f"samples[].finish_reason: {sample.finish_reason} is not STOP or LENGTH")
    return RolloutSample(token_ids=list(sample.token_ids), logprobs=list(sample.logprobs),
                         text=sample.text, finish_reason=finish,
                         policy_version=int(sample.adapter_version), node=node)
