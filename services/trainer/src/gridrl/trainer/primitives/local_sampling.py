"""The trainer's own sampler: the samples the rollout nodes do not serve (a version no node
holds, prompt logprobs, a model on another base) decode on the trainer, on the primitives'
model thread, with the seeds a node would use (so the samples are the same).

Requests queued within :data:`COALESCE_S` for the same weights and settings share one batched
decode, as a node batches concurrent requests. :class:`TrainerSampler` holds the queue (one
lock, held for microseconds); which model and adapter a :class:`SampleTarget` decodes on is
its ``resolve`` callable's (the service's model table).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridrl.common.errors import invalid_argument
from gridrl.trainer.primitives.model import TrainableModel
from gridrl.trainer.primitives.stops import cut_at_stop
from gridrl.trainer.primitives.types import (
    CROSS_ENTROPY,
    Datum,
    LossSpec,
    SampledSequence,
    SampleResult,
    SamplingSpec,
)

TRAINER = "trainer"  # SampleResult.sampled_by when the trainer sampled
# Seconds the trainer's sampler waits for more requests before a decode, so that requests a
# client sent together (one per prompt of a step) decode as one batch.
COALESCE_S = 0.02
# target -> (the model to decode on, the adapter files to swap in for it; None: its own)
Resolver = Callable[["SampleTarget"], tuple[TrainableModel, Mapping[str, bytes] | None]]


@dataclass(frozen=True)
class SampleTarget:
    """Which weights to sample.

    Attributes:
        base_model: the base model string.
        model_id: the training model, or None for the base model alone.
        version: the model's policy version (0: its base model).
        adapter_dir: a peft adapter directory to sample when the model is gone (a snapshot
            from disk), else None.
    """

    base_model: str
    model_id: str | None = None
    version: int = 0
    adapter_dir: Path | None = None


@dataclass
class LocalSample:
    """A sample request waiting for the trainer's sampler.

    Attributes:
        target: the weights to sample.
        prompt: its token ids.
        spec: the sampling settings.
        seed: the request's seed (its sequences' seeds derive from it as on a node).
        result: resolved with the :class:`SampleResult`.
        prompt_logprobs: also the prompt's logprobs.
        topk_prompt: also the top-k logprobs of every prompt position (0: no).
    """

    target: SampleTarget
    prompt: list[int]
    spec: SamplingSpec
    seed: int
    result: futures.Future
    prompt_logprobs: bool = False
    topk_prompt: int = 0


class TrainerSampler:
    """Queued sample requests, decoded in batches by :meth:`drain` (on the model thread).

    Args:
        resolve: the model and adapter files of a target (raises NOT_FOUND when gone).
    """

    def __init__(self, resolve: Resolver) -> None:
        self._resolve = resolve
        self._lock = threading.Lock()
        self._queue: list[LocalSample] = []

    def enqueue(self, request: LocalSample) -> None:
        """Queue ``request``; the caller then runs :meth:`drain` on the model thread."""
        with self._lock:
            self._queue.append(request)

    def drain(self) -> None:
        """Sample every request queued for the trainer (on the model thread): requests for
        the same weights and settings share one batched decode, as a node batches them."""
        from gridrl.engine.contract import SamplingConfig

        with self._lock:
            if not self._queue:  # an earlier drain took them
                return
        time.sleep(COALESCE_S)  # requests sent together (a step's groups) arrive ms apart
        with self._lock:
            queued, self._queue = self._queue, []
        batches: dict[tuple[SampleTarget, Any], list[LocalSample]] = {}
        for q in queued:
            s = q.spec
            config = SamplingConfig(max_tokens=s.max_tokens, temperature=s.temperature,
                                    top_p=s.top_p, top_k=s.top_k, stop_token_ids=s.stop_token_ids)
            batches.setdefault((q.target, config), []).append(q)
        for (target, config), requests in batches.items():
            try:
                self._sample_batch(target, config, requests)
            except Exception as e:
                for q in requests:
                    if not q.result.done():
                        q.result.set_exception(e)

    def _sample_batch(self, target: SampleTarget, config: Any,
                      requests: list[LocalSample]) -> None:
        from gridrl.engine.rng import sequence_seed
        from gridrl.trainer.rollouts import group_seed

        model, files = self._resolve(target)
        bound = model.identity.max_context
        fitting = []
        for q in requests:
            if bound and len(q.prompt) + config.max_tokens > bound:
                q.result.set_exception(invalid_argument(
                    "sampling_params.max_tokens", f"prompt ({len(q.prompt)} tokens) + "
                    f"max_tokens ({config.max_tokens}) exceeds the context ({bound})"))
            else:
                fitting.append(q)
        prompts, seeds = [], []
        for q in fitting:
            g_seed = group_seed(q.seed, 0)  # as a node seeds group 0 of a request: same samples
            prompts += [q.prompt] * q.spec.n
            seeds += [sequence_seed(g_seed, j) for j in range(q.spec.n)]
        with swapped(model, files):
            results = model.generate(prompts, config, seeds) if prompts else []
            plps = [prompt_logprobs(model, q.prompt) if q.prompt_logprobs else None
                    for q in fitting]
            topks = [model.prompt_topk(q.prompt, q.topk_prompt)
                     if q.topk_prompt and len(q.prompt) > 1 else None for q in fitting]
        at = 0
        for q, plp, topk in zip(fitting, plps, topks, strict=True):
            seqs = [SampledSequence(list(r.token_ids), list(r.logprobs), r.finish_reason,
                                    target.version) for r in results[at:at + q.spec.n]]
            at += q.spec.n
            q.result.set_result(SampleResult(
                apply_stops(seqs, q.spec, model.tokenizer), TRAINER, plp, topk))



def apply_stops(seqs: list[SampledSequence], spec: SamplingSpec,
                tokenizer: Any) -> list[SampledSequence]:
    """``seqs`` cut after the first of ``spec.stop_strings`` their text contains (finish
    reason ``"stop"``); unchanged without stop strings."""
    if not spec.stop_strings:
        return seqs
    out = []
    for s in seqs:
        keep = cut_at_stop(s.token_ids, spec.stop_strings,
                           lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        if keep is not None:
            s = SampledSequence(s.token_ids[:keep], s.logprobs[:keep], "stop", s.policy_version)
        out.append(s)
    return out


@contextlib.contextmanager
def swapped(model: TrainableModel, files: Mapping[str, bytes] | None) -> Iterator[None]:
    """Within the block, ``model`` holds the adapter ``files`` (None: unchanged); its own
    weights are back afterwards (the accumulated gradient is not touched)."""
    if files is None:
        yield
        return
    own = model.adapter_files()
    model.load_adapter_files(files)
    try:
        yield
    finally:
        model.load_adapter_files(own)


def prompt_logprobs(model: TrainableModel, prompt: list[int]) -> list[float | None]:
    """Per prompt position, the logprob of its token given the ones before (None at 0)."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    datum = Datum.of(prompt[:-1], prompt[1:])
    out = model.forward([datum], LossSpec(CROSS_ENTROPY), backward=False)
    return [None, *(float(x) for x in out.logprobs[0])]
