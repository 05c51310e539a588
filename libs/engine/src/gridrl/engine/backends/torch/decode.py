"""The torch backend's decode loop: a batch of requests in, one :class:`SequenceResult` each out.

:func:`decode` is what :meth:`TorchBackend.generate` and :meth:`TorchBackend.generate_mixed`
run once they hold a forward (:mod:`~gridrl.engine.backends.torch.steps` owns the forward and
its KV cache).

Decoding (``generate``), a lean loop over the model's forward (no ``model.generate``):

1. Every distinct prompt is prefilled alone (batch 1, last-position logits only), so a
   prompt's cache and first-token logits never depend on the rest of the batch; the ``n``
   samples of a GRPO group share one prefill. (With ``share_prefix``, for many prompts that
   begin alike such as an eval set under one system prompt, their common token prefix is
   prefilled once and the prompts' remaining tokens attend to it, many prompts a forward:
   ``LeanSteps.prefill_batch``.)
2. The prefills are assembled into one left-padded, preallocated KV cache
   (:class:`~gridrl.engine.backends.torch.cache.SlabCache`) with per-row positions and an
   additive padding mask.
3. One forward per step for all live rows; each step applies
   :func:`~gridrl.engine.backends.torch.sampling.transform_logits` to float32 logits and draws
   with each row's counter-based uniform (:mod:`gridrl.engine.rng`). Finished rows are
   dropped from the cache once enough of them have finished.
4. Rows also leave when the observer asks (``rows_to_stop``); the loop ends when none is
   left, or raises when the observer interrupts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gridrl.engine import rng
from gridrl.engine.backends.torch.cores import ThreadGovernor
from gridrl.engine.backends.torch.llama import LeanLlama, LoraFactors
from gridrl.engine.backends.torch.prefix_cache import PrefixCache
from gridrl.engine.backends.torch.sampling import RowSampling, draw_tokens, transform_logits
from gridrl.engine.backends.torch.steps import LeanSteps, ModelSteps
from gridrl.engine.contract import (
    DecodeInterrupted,
    DecodeObserver,
    SequenceRequest,
    SequenceResult,
    TopLogprobs,
)

#: shortest shared prefix (tokens) that :attr:`TorchBackend.share_prefix` prefills once
MIN_SHARED_PREFIX = 8


def make_steps(forward: Any, device: torch.device) -> LeanSteps | ModelSteps:
    """The steps object that drives ``forward``: :class:`LeanSteps` for a :class:`LeanLlama`,
    :class:`ModelSteps` for a transformers model."""
    if isinstance(forward, LeanLlama):
        return LeanSteps(forward, device, forward.compute_dtype)
    return ModelSteps(forward, device)


def decode(batch: list[SequenceRequest], steps: LeanSteps | ModelSteps, forward: Any,
           observer: DecodeObserver | None,
           adapter_key: str | list[str] = "", factors: Mapping[str, LoraFactors] | None = None,
           *, device: torch.device, eos_token_ids: set[int], prefix_cache: PrefixCache | None,
           share_prefix: bool, governor: ThreadGovernor | None,
           on_first_token: Callable[[float | None], None]) -> list[SequenceResult]:
    """The decode loop (module docstring) over ``forward`` (a :class:`LeanLlama` or a
    transformers model, already running under the call's adapter and inference mode), driven
    through ``steps`` (:func:`make_steps`).

    Args:
        adapter_key: the adapter's key (the prefix cache's), or one per row with ``factors``
            (their :class:`LoraFactors` by key; "" the base model): rows of several adapters on
            the lean forward (``TorchBackend.generate_mixed``).
        device: where the forward runs.
        eos_token_ids: the model's end-of-sequence ids (each row adds its ``stop_token_ids``).
        prefix_cache: keys/values kept for continuations (lean forward only), or None.
        share_prefix: prefill the batch's shared token prefix once (lean forward only).
        governor: decoding threads that follow the load on the cores, or None.
        on_first_token: called with None once the prefills are done, then with the seconds
            from the call's start to its first sampled tokens.
    Returns:
        one :class:`SequenceResult` per request, in order.
    Raises:
        DecodeInterrupted: ``observer.interrupted()`` returned True (nothing is kept).
    """
    keys = adapter_key if isinstance(adapter_key, list) else [adapter_key] * len(batch)
    mixed = factors is not None
    cache = prefix_cache if isinstance(steps, LeanSteps) else None
    kept: list[tuple[str, list[int], Any]] = []  # stored once the call returns (never when
    # it is interrupted: an interrupted call keeps nothing)
    start = time.perf_counter()
    if governor is not None:
        governor.begin()
    dev = device
    n = len(batch)
    # 1. prefill each distinct prompt alone (after a shared prefix: batched).
    prompt_index: dict[tuple[str, tuple[int, ...]], int] = {}
    row_prefill = [prompt_index.setdefault((key, tuple(r.prompt_ids)), len(prompt_index))
                   for key, r in zip(keys, batch, strict=True)]
    prefills, first_logits = [], []
    prefix = None if mixed else _shared_prefix(steps, [p for _, p in prompt_index], share_prefix)
    if prefix is not None:  # the prompts' rest after the prefix, many rows a forward
        assert isinstance(steps, LeanSteps)
        if observer is not None and observer.interrupted():
            raise DecodeInterrupted(0)
        prefills, first_logits = steps.prefill_batch([list(p) for _, p in prompt_index],
                                                     prefix)
    else:
        for key, prompt in prompt_index:
            if observer is not None and observer.interrupted():
                raise DecodeInterrupted(0)
            if mixed:
                assert factors is not None
                forward.activate(factors.get(key))
            hit = cache.lookup(key, prompt) if cache is not None else None
            if hit is not None:
                assert isinstance(steps, LeanSteps)
                kv, logits = steps.prefill(list(prompt), hit[1])
            else:
                kv, logits = steps.prefill(list(prompt))
            prefills.append(kv)
            first_logits.append(logits)
    logits = torch.stack(first_logits).index_select(
        0, torch.tensor(row_prefill, dtype=torch.int64, device=dev))
    max_tokens = [r.sampling.max_tokens for r in batch]
    steps.start(prefills, [len(p) for _, p in prompt_index], row_prefill, max(max_tokens))
    del prefills, first_logits
    if mixed:
        assert factors is not None
        forward.activate_rows([factors.get(key) for key in keys])

    # 2. per-row state; `active` maps cache rows to batch indices.
    sampling = RowSampling.from_configs([r.sampling for r in batch], logits.shape[-1], dev)
    seeds = rng.seeds_array([r.seed for r in batch])
    stops = [eos_token_ids | set(r.sampling.stop_token_ids) for r in batch]
    stop_table = _stop_table(stops, dev)
    limit = torch.tensor(max_tokens, dtype=torch.int64, device=dev)
    out_tokens = torch.zeros((n, max(max_tokens)), dtype=torch.int64, device=dev)
    out_logprobs = torch.zeros((n, max(max_tokens)), dtype=torch.float32, device=dev)
    top_n = [r.sampling.top_logprobs for r in batch]
    out_top: list[list[TopLogprobs]] = [[] for _ in range(n)]
    length = [0] * n
    reason: list[str] = ["length"] * n
    active = torch.arange(n, device=dev)
    active_list = list(range(n))
    rows = sampling
    step = 0
    first_token_s = None
    on_first_token(None)
    while True:
        logprobs = transform_logits(logits, rows)
        u = torch.from_numpy(rng.step_uniforms(seeds[active_list], step)) \
            if not rows.all_greedy else None
        tokens, token_logprobs = draw_tokens(logits, logprobs, rows, u)
        out_tokens[active, step] = tokens
        out_logprobs[active, step] = token_logprobs
        top = alternatives(logprobs, [top_n[i] for i in active_list])
        if top is not None:
            for i, pairs in zip(active_list, top, strict=True):
                out_top[i].append(pairs)
        if observer is not None:
            observer.on_tokens(list(active_list), tokens.tolist(), token_logprobs.tolist(),
                               **({} if top is None else {"top": top}))
        if first_token_s is None:
            first_token_s = time.perf_counter() - start
            on_first_token(first_token_s)
        hit_stop = (stop_table.index_select(0, active) == tokens[:, None]).any(dim=-1)
        hit_len = limit.index_select(0, active) <= step + 1
        done = hit_stop | hit_len
        done_list = done.tolist()
        if any(done_list):
            stop_list = hit_stop.tolist()
            for row, i in enumerate(active_list):
                if done_list[row]:
                    length[i] = step + 1
                    reason[i] = "stop" if stop_list[row] else "length"
                    if cache is not None and batch[i].keep_cache:
                        assert isinstance(steps, LeanSteps)
                        fed = out_tokens[i, :step].tolist()
                        kept.append((keys[i], list(batch[i].prompt_ids) + fed,
                                     steps.row_prefill(row)))
            if all(done_list):
                break
            keep = [row for row, d in enumerate(done_list) if not d]
            keep_t = torch.tensor(keep, dtype=torch.int64, device=dev)
            steps.keep(keep_t)
            if mixed:
                forward.keep_rows(keep_t)
            active = active.index_select(0, keep_t)
            active_list = [active_list[row] for row in keep]
            tokens = tokens.index_select(0, keep_t)
            rows = rows.select(keep_t)
        step += 1
        if observer is not None and observer.interrupted():
            raise DecodeInterrupted(step)
        stop = _rows_to_stop(observer, active_list)
        if stop:  # rows the caller no longer wants (contract: "Stopping rows")
            for row in stop:
                length[active_list[row]] = step
            keep = [row for row in range(len(active_list)) if row not in stop]
            if not keep:
                break
            keep_t = torch.tensor(keep, dtype=torch.int64, device=dev)
            steps.keep(keep_t)
            if mixed:
                forward.keep_rows(keep_t)
            active = active.index_select(0, keep_t)
            active_list = [active_list[row] for row in keep]
            tokens = tokens.index_select(0, keep_t)
            rows = rows.select(keep_t)
        logits = steps.step(tokens)
        if governor is not None:
            governor.step()
    for key, ids, kv in kept:
        assert cache is not None
        cache.store(key, ids, kv)
    tokens_cpu = out_tokens.cpu()
    logprobs_cpu = out_logprobs.cpu()
    return [SequenceResult(token_ids=tokens_cpu[i, :length[i]].tolist(),
                           logprobs=logprobs_cpu[i, :length[i]].tolist(),
                           finish_reason=reason[i],  # type: ignore[arg-type]
                           top_logprobs=out_top[i][:length[i]] if top_n[i] else [])
            for i in range(n)]


def _shared_prefix(steps: LeanSteps | ModelSteps, prompts: list[tuple[int, ...]],
                   share_prefix: bool) -> Any | None:
    """With ``share_prefix`` on the lean forward: the prefill of the longest token
    prefix that every distinct prompt of the batch starts with (each keeps at least its
    last token), when it is at least :data:`MIN_SHARED_PREFIX` tokens; else None."""
    if not share_prefix or len(prompts) < 2 or not isinstance(steps, LeanSteps):
        return None
    length = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        length = next((j for j in range(length) if p[j] != first[j]), length)
    if length < MIN_SHARED_PREFIX:
        return None
    return steps.shared_prefix(list(first[:length]))


def alternatives(logprobs: torch.Tensor, top_n: list[int]) -> list[TopLogprobs] | None:
    """Each row's ``top_n[row]`` most likely ``(token id, logprob)`` of ``logprobs`` (N, V),
    most likely first; None when no row asks any (nothing computed)."""
    k = max(top_n, default=0)
    if k == 0:
        return None
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    values, ids = values.cpu().tolist(), ids.cpu().tolist()
    return [list(zip(ids[r][:n], values[r][:n], strict=True)) for r, n in enumerate(top_n)]



def _stop_table(stops: list[set[int]], device: torch.device) -> torch.Tensor:
    """(N, S) int64 table of each row's stop ids, padded with -1 (never a token id)."""
    width = max(1, max(len(s) for s in stops))
    table = torch.full((len(stops), width), -1, dtype=torch.int64)
    for i, s in enumerate(stops):
        if s:
            table[i, :len(s)] = torch.tensor(sorted(s), dtype=torch.int64)
    return table.to(device)


def _rows_to_stop(observer: DecodeObserver | None, active_list: list[int]) -> set[int]:
    """Positions in ``active_list`` (the live rows' batch indices) of the rows the observer
    asks to stop (``rows_to_stop``, an optional observer method; see
    :attr:`gridrl.engine.contract.Backend.stops_rows`)."""
    ask = getattr(observer, "rows_to_stop", None)
    if ask is None:
        return set()
    wanted = set(ask())
    return {row for row, i in enumerate(active_list) if i in wanted}
