"""The sampling contract, and the Backend every inference framework (torch, mlx) implements.

The engine (``gridrl.rollout.scheduler``) owns queuing, batching, validation and adapter
bookkeeping; a backend only knows how to run a batch of sequences on its framework, and how to
load an adapter directory of its own format next to the weights already serving.

Sampling semantics, identical in every backend (this is what makes behaviour logprobs exact):

1. ``logits`` of the next token in float32, shape (vocab,).
2. ``temperature == 0`` (greedy): the token is ``argmax(logits)``; its logprob is
   ``log_softmax(logits)[token]`` (temperature 1, no truncation).
3. Otherwise ``z = logits / temperature``; then top-k (keep the k largest of ``z``, ties at the
   k-th value kept, when ``0 < top_k < vocab``); then top-p (sort descending, keep the smallest
   prefix whose softmax mass is >= top_p, always at least one token, when ``top_p < 1``);
   removed entries become ``-inf``. ``logprobs = log_softmax(z)`` over what is kept.
4. The token is drawn from ``exp(logprobs)`` with the sequence's own RNG, and its logprob is
   ``logprobs[token]``: the log-probability under the distribution it was actually drawn from.

A sequence stops after a token in ``eos_token_ids | stop_token_ids`` (included in the output,
``finish_reason="stop"``) or after ``max_tokens`` tokens (``"length"``).

Alternatives (``top_logprobs`` N > 0, at most :data:`MAX_TOP_LOGPROBS`): beside each sampled
token, the N most likely tokens of the distribution it was drawn from (step 3's ``logprobs``,
after temperature, top-k and top-p: what vLLM's ``processed_logprobs`` shows), most likely
first, ``-inf`` for entries outside the kept support when N exceeds it. :meth:`Backend.score_top`
gives the same for teacher-forced tokens.

Seeds: each sequence carries its own ``seed``; the same seed, weights and prompt give the same
tokens regardless of what else is in the batch (up to float rounding changing an argmax).

Decode hooks: ``generate`` takes an optional :class:`DecodeObserver`. Every backend calls its
``on_tokens`` once per decode step with the tokens just drawn (the first call right after the
prefill, with each row's first token), in the order they are drawn, so a caller can stream
tokens or act on them before the batch ends; the lists it received for a row, concatenated,
equal that row's final ``SequenceResult``. Between two decode steps (and between prefills) it
asks ``interrupted()``; on True the backend stops at once and raises
:class:`DecodeInterrupted`, keeping nothing of the batch: the same requests resubmitted on
the same weights sample the same tokens again (their seeds fix every draw).
"""

from __future__ import annotations

import abc
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args, runtime_checkable

from gridrl.models import ModelIdentity

if TYPE_CHECKING:  # the adapters' layouts; not imported at run time (the contract stays light)
    from gridrl.adapters.adapter import Format

FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)
#: the framework a :class:`Backend` runs on (``gridrl.v1.Backend``'s words, :mod:`gridrl.v1.enums`)
BackendName = Literal["torch", "mlx", "vllm"]
#: ``(token id, logprob)`` pairs of one position, most likely first (natural log).
TopLogprobs = list[tuple[int, float]]
#: Most alternatives per position a request may ask for (OpenAI's chat ``top_logprobs`` bound,
#: vLLM's default ``--max-logprobs``).
MAX_TOP_LOGPROBS = 20
#: Smallest positive temperature every backend samples at: below it ``logits / T`` overflows
#: float32 (0 is greedy).
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingConfig:
    """Validated sampling parameters (see the module docstring for their meaning)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    #: alternatives returned per sampled token (module docstring), 0..MAX_TOP_LOGPROBS
    top_logprobs: int = 0


@dataclass
class SequenceRequest:
    """One sequence to decode.

    Attributes:
        prompt_ids: prompt token ids, length >= 1.
        sampling: how to pick each token.
        seed: seed of this sequence's RNG (the engine derives it from the request seed and the
            sample index).
        keep_cache: keep this sequence's keys and values (prompt and sampled tokens) for a
            later request whose prompt continues it (a multi-turn episode's next turn), where
            the backend has a prefix cache (the torch backend's lean forward); a hint: results
            are the same either way up to float rounding.
    """

    prompt_ids: list[int]
    sampling: SamplingConfig
    seed: int
    keep_cache: bool = False


@dataclass
class SequenceResult:
    """What a backend sampled for one :class:`SequenceRequest`.

    Attributes:
        token_ids: sampled ids, stop token included when ``finish_reason == "stop"``.
        logprobs: one float per token, natural log, under the distribution it was drawn from.
        finish_reason: ``"stop"`` or ``"length"``.
        top_logprobs: with ``sampling.top_logprobs`` N > 0, one :data:`TopLogprobs` of N
            pairs per token (module docstring, "Alternatives"); else empty.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    top_logprobs: list[TopLogprobs] = field(default_factory=list)


@runtime_checkable
class DecodeObserver(Protocol):
    """Watches a :meth:`Backend.generate` call step by step, and may stop it.

    Both methods run on the thread that called ``generate``, between the backend's device
    work, so they should return quickly (hand tokens to a queue rather than sending them).
    """

    def on_tokens(self, rows: Sequence[int], token_ids: Sequence[int],
                  logprobs: Sequence[float], top: Sequence[TopLogprobs] | None = None) -> None:
        """The tokens of one decode step, one per row still decoding.

        Args:
            rows: indices into the ``batch`` given to ``generate``, ascending; a row that has
                finished (stop token or ``max_tokens``) is absent from later calls.
            token_ids: the token drawn for each row, aligned with ``rows``.
            logprobs: each token's behaviour logprob (natural log, the value the row's
                ``SequenceResult`` will hold), aligned with ``rows``.
            top: each row's alternatives (empty for a row that asked none), aligned with
                ``rows``; passed only when a row of the batch asked for them
                (``sampling.top_logprobs``), so observers that never ask may omit it.
        """

    def interrupted(self) -> bool:
        """True to stop the call: the backend raises :class:`DecodeInterrupted` before its
        next decode step."""


class _RowMap:
    """An observer of one adapter group of :meth:`Backend.generate_mixed`'s default: tells the
    batch's observer the batch's own row indices."""

    def __init__(self, observer: DecodeObserver, rows: list[int]) -> None:
        self._observer, self._rows = observer, rows

    def on_tokens(self, rows: Sequence[int], token_ids: Sequence[int],
                  logprobs: Sequence[float], top: Sequence[TopLogprobs] | None = None) -> None:
        extra = {} if top is None else {"top": top}
        self._observer.on_tokens([self._rows[r] for r in rows], token_ids, logprobs, **extra)

    def interrupted(self) -> bool:
        return self._observer.interrupted()


class DecodeInterrupted(Exception):
    """:meth:`Backend.generate` stopped because its observer's ``interrupted()`` returned True.

    Nothing of the batch is kept and nothing else changed (adapters, caches of other calls):
    resubmitting the same requests gives the tokens an uninterrupted call would have given.

    Args:
        steps: decode steps completed (tokens drawn per live row) before it stopped (0 when
            the backend does not see its steps, e.g. vLLM's).
        how: how it stopped, added to the message (e.g. ``"its vLLM requests were
            cancelled"``).
    """

    def __init__(self, steps: int, how: str = "") -> None:
        super().__init__(f"decoding interrupted after {steps} step(s)"
                         + (f": {how}" if how else ""))
        self.steps = steps


def check_batch(batch: list[SequenceRequest], max_context: int | None = None) -> None:
    """The preconditions of :meth:`Backend.generate` shared by every backend.

    Args:
        max_context: the backend's context limit (``identity.max_context``), or None.
    Raises:
        ValueError: ``batch[i].prompt_ids`` is empty, ``batch[i].sampling.max_tokens < 1``,
            or prompt + ``max_tokens`` exceeds ``max_context``.
    """
    for i, req in enumerate(batch):
        if not req.prompt_ids:
            raise ValueError(f"batch[{i}].prompt_ids is empty")
        if req.sampling.max_tokens < 1:
            raise ValueError(f"batch[{i}].sampling.max_tokens must be >= 1")
        if max_context is not None and len(req.prompt_ids) + req.sampling.max_tokens > max_context:
            raise ValueError(f"batch[{i}]: prompt ({len(req.prompt_ids)} tokens) + max_tokens "
                             f"({req.sampling.max_tokens}) exceeds the model's context of "
                             f"{max_context} tokens")


class AdapterLoadError(ValueError):
    """An adapter directory does not fit this backend's base model (shapes, modules, layers).
    The message names what does not fit; nothing was changed."""


class Backend(abc.ABC):
    """A model on one framework and device, able to decode batches and hold adapters.

    Attributes set by implementations:
        name: ``"torch"``, ``"mlx"`` or ``"vllm"``.
        adapter_format: the adapter layout loaded natively, ``"peft"`` or ``"mlx"``.
        device: e.g. ``"cpu"``, ``"cuda:0"``, ``"mps"``, ``"mlx-cpu"``, ``"mlx-gpu"``.
        dtype: compute dtype name, e.g. ``"float32"``, ``"bfloat16"``.
        identity: the base model's identity (architecture, sizes) from config.json;
            ``max_context`` is the context served (capped at a sliding window,
            :mod:`gridrl.engine.families`).
        tokenizer: a ``transformers`` tokenizer for the model directory.
        eos_token_ids: ids that end a sequence besides per-request stop ids
            (:func:`gridrl.engine.tokens.eos_token_ids`: the one derivation every backend uses,
            so their samples stop at the same tokens).

    Capabilities, declared here with their defaults (a backend overrides what differs):
    :attr:`interrupt_is_synchronous`, :attr:`temperature_range`, :attr:`vocab_size`,
    :attr:`last_first_token_s`.

    Threading: the engine calls every method from its single scheduler thread, so no two calls
    overlap and an adapter is never swapped during a batch; a batch in progress is stopped
    through its :class:`DecodeObserver`.
    """

    name: BackendName
    adapter_format: Format
    device: str
    dtype: str
    identity: ModelIdentity
    tokenizer: Any
    eos_token_ids: frozenset[int]
    #: Whether a ``generate`` stopped by its observer has stopped every decode when
    #: :class:`DecodeInterrupted` is raised (in-process backends). A backend fronting a server
    #: that aborts cancelled requests in its own time (vLLM) says False, and the rollout node
    #: then swaps adapters between batches instead of interrupting one.
    interrupt_is_synchronous: bool = True
    #: Memory one token of one sequence's KV cache takes, bytes (every layer's keys and
    #: values); 0 where the backend does not manage its own cache memory (vLLM) or cannot say.
    kv_bytes_per_token: int = 0
    #: Memory one decoding sequence takes besides its KV cache (logits and sampling buffers
    #: over the vocabulary), bytes; 0: unknown.
    sequence_bytes: int = 0
    #: Temperatures a sampled request may ask for, ``(low, high)`` inclusive (0, greedy, is
    #: always allowed). A backend fronting a server with its own bounds (vLLM: [0.01, 2])
    #: narrows it; the node refuses requests outside it.
    temperature_range: tuple[float, float] = (MIN_TEMPERATURE, math.inf)
    #: Seconds from the start of the last :meth:`generate` to its first sampled token (the
    #: prefill), or None when the backend does not measure it (the node then counts the
    #: whole batch as time to first token).
    last_first_token_s: float | None = None
    _vocab_size: int | None = None

    @property
    def vocab_size(self) -> int:
        """Token ids the model can sample: rows of its output layer, which may exceed the
        tokenizer's vocabulary (padding rows); default ``identity.vocab_size``."""
        return self._vocab_size if self._vocab_size is not None else self.identity.vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int) -> None:
        self._vocab_size = value

    @abc.abstractmethod
    def generate(self, batch: list[SequenceRequest], adapter: Any | None,
                 observer: DecodeObserver | None = None) -> list[SequenceResult]:
        """Decode every sequence of ``batch`` together with a KV cache.

        Args:
            batch: sequences, possibly of different prompt lengths and sampling configs.
            adapter: a handle from :meth:`load_adapter`, or None for the base model.
            observer: told each decode step's tokens, and asked between steps whether to stop
                (module docstring, "Decode hooks"); None: neither.
        Returns:
            one result per request, in order.
        Raises:
            DecodeInterrupted: ``observer.interrupted()`` returned True before the last step.
            ValueError: an empty prompt, ``max_tokens < 1`` (:func:`check_batch`), or an
                adapter handle that is not loaded.
        """

    #: Whether :meth:`generate_mixed` decodes rows of different adapters in one batch (True),
    #: or one adapter group after the other (the default implementation).
    mixes_adapters: bool = False
    #: Whether :meth:`generate` stops single rows between two decode steps when its observer
    #: has a ``rows_to_stop()`` method (called right after ``interrupted()`` returned False;
    #: the batch indices it returns end there, their results are cut short and meaningless),
    #: and loads adapters between two decode steps without disturbing the batch in progress.
    #: The rollout node then replaces one run's adapter without stopping other runs' rows.
    stops_rows: bool = False

    def generate_mixed(self, batch: list[SequenceRequest], adapters: Sequence[Any | None],
                       observer: DecodeObserver | None = None) -> list[SequenceResult]:
        """Decode ``batch`` where row ``i`` uses ``adapters[i]`` (a handle from
        :meth:`load_adapter`, or None: the base model); each row's tokens and logprobs are
        those it gets in a :meth:`generate` call with its adapter alone (up to float32
        rounding). Backends that batch adapters together (:attr:`mixes_adapters`: the torch
        lean forward's stacked factors, vLLM's per-request LoRA) override this; this default
        runs one :meth:`generate` per adapter group, in order of first appearance, with the
        observer told the batch's own row indices.

        Raises:
            as :meth:`generate`; ValueError when ``adapters`` and ``batch`` differ in length.
        """
        if len(adapters) != len(batch):
            raise ValueError(f"{len(adapters)} adapters for {len(batch)} sequences")
        groups: list[tuple[Any, list[int]]] = []
        for i, adapter in enumerate(adapters):
            group = next((g for g in groups if g[0] is adapter), None)
            if group is None:
                groups.append((adapter, [i]))
            else:
                group[1].append(i)
        results: list[SequenceResult | None] = [None] * len(batch)
        first: float | None = None
        for adapter, rows in groups:
            mapped = None if observer is None else _RowMap(observer, rows)
            out = self.generate([batch[i] for i in rows], adapter, mapped)
            if first is None and isinstance(self.last_first_token_s, float):
                first = self.last_first_token_s  # the first group's prefill
            for i, result in zip(rows, out, strict=True):
                results[i] = result
        self.last_first_token_s = first
        return [r if r is not None else SequenceResult() for r in results]

    @abc.abstractmethod
    def load_adapter(self, directory: Path, key: str) -> Any:
        """Load the adapter in ``directory`` (this backend's format) next to the weights already
        serving, under ``key``, and return a handle for :meth:`generate`. The serving adapter is
        untouched. Raises :class:`AdapterLoadError` when it does not fit the base model."""

    def load_adapter_files(self, files: Mapping[str, bytes], key: str) -> Any:
        """:meth:`load_adapter` from files in memory (relative path -> bytes, this backend's
        format), as a push delivers them. This default writes them into a temporary directory
        (removed afterwards: :meth:`load_adapter` must read everything it keeps); backends that
        parse bytes directly override it. Raises :class:`AdapterLoadError` like
        :meth:`load_adapter`."""
        with tempfile.TemporaryDirectory(prefix="gridrl-adapter-") as tmp:
            for rel, data in files.items():
                target = Path(tmp) / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            return self.load_adapter(Path(tmp), key)

    @abc.abstractmethod
    def unload_adapter(self, adapter: Any) -> None:
        """Free an adapter handle that no batch will use again."""

    @abc.abstractmethod
    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingConfig,
              adapter: Any | None) -> list[float]:
        """Teacher-forced logprobs of ``completion_ids`` after ``prompt_ids`` under the same
        sampling transform as :meth:`generate` (module docstring, steps 1-3), one per token.
        Tokens outside the top-k/top-p support get ``-inf``. Used to check the logprob invariant.
        """

    def score_top(self, prompt_ids: list[int], completion_ids: list[int],
                  sampling: SamplingConfig, adapter: Any | None, top_n: int
                  ) -> tuple[list[float], list[TopLogprobs]]:
        """:meth:`score`, and at each completion position the ``top_n`` most likely tokens
        under the same transform (module docstring, "Alternatives"). A prompt's own logprobs
        (OpenAI's ``echo``) are ``score_top(prompt[:1], prompt[1:], greedy, ...)``: the
        model's distribution before any transform, as vLLM's ``prompt_logprobs``.

        Returns:
            ``(logprobs, top)``: one float and one list of ``top_n`` pairs per completion token.
        Raises:
            NotImplementedError: the backend cannot (the default); ValueError as :meth:`score`.
        """
        raise NotImplementedError(f"the {self.name} backend does not score alternatives")
