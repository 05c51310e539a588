"""The trainer's side of the rollout wire: protobuf messages in, domain types out (enum values
become words by :func:`gridrl.v1.enums.enum_word`: ``FINISH_REASON_STOP`` -> ``"stop"``).

- :func:`sample_from_proto` / :func:`samples_of`: a ``Generate`` answer's samples as
  :class:`~gridrl.trainer.rollouts.RolloutSample` s, checked;
- :func:`base_model_problem`: how a node's ``BaseModel`` differs from the trainer's
  :class:`gridrl.models.ModelIdentity`.
"""

from __future__ import annotations

from collections.abc import Sequence

from gridrl.engine.contract import FINISH_REASONS
from gridrl.models import ModelIdentity
from gridrl.trainer.rollouts import RolloutSample
from gridrl.v1 import common_pb2, rollout_pb2
from gridrl.v1.enums import enum_word


def sample_from_proto(sample: common_pb2.Sample, node: str, seconds: float = 0.0
                      ) -> RolloutSample:
    """Convert a wire ``Sample`` sampled by ``node`` in a request of ``seconds``.

    Raises:
        ValueError: naming the field, when ``logprobs`` and ``token_ids`` differ in length or
            ``finish_reason`` is unspecified.
    """
    if len(sample.logprobs) != len(sample.token_ids):
        raise ValueError(f"samples[].logprobs: {len(sample.logprobs)} logprobs for "
                         f"{len(sample.token_ids)} tokens")
    finish = enum_word(common_pb2.FinishReason, sample.finish_reason)
    if finish not in FINISH_REASONS:
        raise ValueError(f"samples[].finish_reason: {sample.finish_reason} is not STOP or LENGTH")
    return RolloutSample(token_ids=list(sample.token_ids), logprobs=list(sample.logprobs),
                         text=sample.text, finish_reason=finish,
                         policy_version=int(sample.adapter_version), node=node,
                         seconds=seconds)


def samples_of(response: rollout_pb2.GenerateResponse, prompt: Sequence[int], group_size: int,
               address: str, seconds: float = 0.0) -> list[RolloutSample]:
    """The samples of a Generate answer for ``prompt`` (``seconds``: the call's).

    Raises:
        ValueError: naming the field, when the answer has the wrong number of samples, echoes
            another prompt, or a sample is malformed.
    """
    if len(response.samples) != group_size:
        raise ValueError(f"samples: {len(response.samples)} samples for sampling.n={group_size}")
    if response.prompt_token_ids and list(response.prompt_token_ids) != list(prompt):
        raise ValueError("prompt_token_ids: differ from the prompt sent")
    return [sample_from_proto(s, address, seconds) for s in response.samples]


def base_model_problem(theirs: common_pb2.BaseModel, mine: ModelIdentity) -> str:
    """How a node's base model differs from the trainer's, in words ("" when it matches):
    architecture, hidden size, layers and vocabulary, and the weights' fingerprint when both
    sides know it (another fine-tune of the same architecture)."""
    problems = [f"{name} {got!r} != {want!r}" for name, got, want in (
        ("architecture", theirs.architecture, mine.architecture),
        ("hidden_size", theirs.hidden_size, mine.hidden_size),
        ("num_layers", theirs.num_layers, mine.num_layers),
        ("vocab_size", theirs.vocab_size, mine.vocab_size)) if got != want]
    if mine.weights_fingerprint and theirs.weights_fingerprint \
            and mine.weights_fingerprint != theirs.weights_fingerprint:
        problems.append(f"weights_fingerprint {theirs.weights_fingerprint!r} != the trainer's "
                        f"{mine.weights_fingerprint!r} (another checkpoint of this "
                        "architecture: start the node on the trainer's --model)")
    return ", ".join(problems)
