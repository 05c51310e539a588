"""What a caller hands the node's scheduler and what it gets back: the adapter serving
(ServingAdapter, BASE_MODEL), a validated Generate request (GenerateJob), its samples and timings
(GenerateOutcome), where streamed tokens go (TokenSink), and the record of one backend call
(BatchRecord). Plain types; the scheduler (scheduler.py) runs them."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from gridrl.engine.contract import (
    SamplingConfig,
    SequenceResult,
    TopLogprobs,
)


@dataclass(frozen=True)
class ServingAdapter:
    """The adapter the engine decodes with: ``handle`` from ``Backend.load_adapter``, or None
    with name "" and version 0 for the base model."""

    name: str = ""
    version: int = 0
    handle: Any = None
    #: bytes its weights take on the node (what was pushed); 0: not counted.
    nbytes: int = 0


BASE_MODEL = ServingAdapter()


class TokenSink(Protocol):
    """Where the engine sends one request's tokens as they are decoded.

    Every method runs on the scheduler thread between the backend's decode steps: it must
    return at once (hand the tokens to a queue or an event loop) and should not raise (an
    exception is logged and the sink gets nothing more; the batch goes on).
    """

    def started(self, adapter: ServingAdapter) -> None:
        """The request's first batch is about to decode with ``adapter`` (called once)."""

    def on_tokens(self, samples: Sequence[int], token_ids: Sequence[int],
                  logprobs: Sequence[float], top: Sequence[TopLogprobs] | None = None) -> None:
        """One decode step's tokens of this request: ``token_ids[j]`` (behaviour logprob
        ``logprobs[j]``, natural log) was drawn for sample index ``samples[j]``. A sample's
        tokens, concatenated over the calls, equal its final ``SequenceResult.token_ids``.
        ``top[j]``: its alternatives, passed only when the request asked for them
        (``sampling.top_logprobs``)."""

    def abandoned(self) -> bool:
        """True once the caller wants no more tokens of this request (it went away, or it has
        all it needs): see the module docstring, "Streams"."""


@dataclass(frozen=True)
class GenerateJob:
    """A validated Generate request.

    Attributes:
        prompt_ids: prompt token ids (length >= 1).
        sampling: how to sample each of the ``n`` sequences.
        n: number of samples (>= 1).
        seed: request seed; sample ``i`` uses ``rng.sequence_seed(seed, i)``.
        request_id: caller's id, for logs.
        keep_cache: keep the samples' keys/values for a continuation
            (``SequenceRequest.keep_cache``).
        prompt_logprobs: None, or N >= 0: score the prompt with N alternatives per token
            (module docstring, "Prompt logprobs"); ``sampling.max_tokens`` may then be 0.
        adapter: the name of an adapter resident on the node to decode with (a run's
            adapter: its newest version pushed); "" follows the node's serving adapter (the
            last pushed or reloaded).
        share_weight: the weight of this request's run in the node's fair share (> 0;
            :mod:`gridrl.rollout.fair_share`); a run's latest request sets it.
    """

    prompt_ids: list[int]
    sampling: SamplingConfig
    n: int = 1
    seed: int = 0
    request_id: str = ""
    keep_cache: bool = False
    prompt_logprobs: int | None = None
    adapter: str = ""
    share_weight: float = 1.0


@dataclass
class GenerateOutcome:
    """The samples of one job and how long it took.

    Attributes:
        samples: ``n`` results in sample-index order.
        adapter: the adapter that produced every sample.
        queued_s: seconds from arrival to the start of its first batch.
        first_token_s: seconds from arrival to its first sampled token (end of its first
            batch when the backend does not report prefill timing).
        duration_s: seconds from arrival to the end of its last batch.
        batches: indices of the batches that decoded it.
        prompt_logprobs: with ``job.prompt_logprobs``: the logprob of each prompt token after
            the first (``len(prompt_ids) - 1`` floats), else None.
        prompt_top_logprobs: with ``job.prompt_logprobs`` N: N alternatives for each of them.
    """

    samples: list[SequenceResult]
    adapter: ServingAdapter
    queued_s: float
    first_token_s: float
    duration_s: float
    batches: list[int]
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True)
class BatchRecord:
    """One backend call: its index, sequences decoded, the requests they came from (internal
    ids, in order), the adapter version, wall-clock seconds, and whether a preempting command
    interrupted it (its requests were then decoded again in a later batch), and the runs whose
    sequences it held."""

    index: int
    sequences: int
    requests: tuple[int, ...]
    adapter_version: int
    seconds: float
    interrupted: bool = False
    #: sequences per run in the batch, ``(run, sequences)``, in order of first row.
    runs: tuple[tuple[str, int], ...] = ()
    #: sequences stopped before their end because their run's adapter was replaced (they
    #: decode again, whole, on the new version); the batch's other rows went on.
    cut: int = 0


#: The run of requests that decode with the base model.
BASE_RUN = ""


@dataclass(eq=False)
class QueuedRequest:
    """One Generate job in the scheduler: its samples scheduled and done, its run, its
    adapter once resolved, and its timings (owned by the scheduler's thread)."""

    id: int
    job: GenerateJob
    future: Future
    arrival: float
    next_sample: int = 0  # samples [0, next_sample) are scheduled
    done_samples: int = 0
    results: list[SequenceResult | None] = field(default_factory=list)
    adapter: ServingAdapter | None = None
    sink: TokenSink | None = None
    base_model: bool = False
    run: str = BASE_RUN  # whose share it counts in (module docstring, "Runs")
    started: float = 0.0
    first_token: float | None = None
    batches: list[int] = field(default_factory=list)
