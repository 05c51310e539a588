"""The sampling transform of :mod:`gridrl.engine.contract` in MLX, batched over rows.

One function turns float32 logits into the logprobs a token is drawn from
(:func:`transform_logits`); ``generate`` draws from them and ``score`` reads them, so the
behaviour logprob of a sampled token and its teacher-forced score come from the same code.
Each row carries its own temperature / top-k / top-p, so one decode step serves sequences
with different sampling configs.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from gridrl.engine.contract import SamplingConfig, TopLogprobs

_SEED_MASK = (1 << 64) - 1


def transform_logits(logits: mx.array, configs: Sequence[SamplingConfig]) -> mx.array:
    """Logprobs of the distribution each row's next token is drawn from (contract.py steps 1-3).

    Greedy rows (``temperature == 0``) get ``log_softmax(logits)`` (temperature 1, nothing
    removed). Other rows: ``z = logits / temperature``; top-k keeps ``z >=`` the k-th largest
    value when ``0 < top_k < vocab`` (ties kept); top-p sorts the kept ``z`` descending and keeps
    the smallest prefix whose softmax mass is ``>= top_p`` (at least one token) when
    ``top_p < 1`` -- as a threshold on ``z``, so a token tied with the last one kept is kept
    too; removed entries are ``-inf``; the result is ``log_softmax`` of what is kept.

    Args:
        logits: float32, shape (N, V), natural-log-space scores of the next token.
        configs: N sampling configs, one per row.
    Returns:
        float32 array (N, V) of natural-log probabilities, ``-inf`` outside the support.
    Raises:
        ValueError: ``len(configs)`` differs from N, or logits are not 2-D.
    """
    if logits.ndim != 2 or logits.shape[0] != len(configs):
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match "
                         f"{len(configs)} sampling configs")
    logits = logits.astype(mx.float32)
    vocab = logits.shape[-1]
    greedy = [c.temperature == 0 for c in configs]
    temps = [1.0 if g else float(c.temperature) for g, c in zip(greedy, configs, strict=True)]
    top_k = [c.top_k if (not g and 0 < c.top_k < vocab) else vocab
             for g, c in zip(greedy, configs, strict=True)]
    top_p = [float(c.top_p) if (not g and c.top_p < 1) else 2.0  # 2.0: keeps every token
             for g, c in zip(greedy, configs, strict=True)]

    z = logits if all(t == 1.0 for t in temps) else logits / mx.array(temps, mx.float32)[:, None]
    neg_inf = mx.array(-float("inf"), mx.float32)
    if any(k < vocab for k in top_k):
        desc = -mx.sort(-z, axis=-1)
        kth = mx.take_along_axis(desc, mx.array(top_k, mx.int32)[:, None] - 1, axis=-1)
        z = mx.where(z >= kth, z, neg_inf)
    if any(p < 1.0 for p in top_p):
        desc = -mx.sort(-z, axis=-1)
        probs = mx.softmax(desc, axis=-1)
        mass_before = mx.cumsum(probs, axis=-1, inclusive=False)
        count = mx.sum(mass_before < mx.array(top_p, mx.float32)[:, None], axis=-1)
        count = mx.maximum(count, 1).astype(mx.int32)
        cut = mx.take_along_axis(desc, count[:, None] - 1, axis=-1)
        z = mx.where(z >= cut, z, neg_inf)
    return z - mx.logsumexp(z, axis=-1, keepdims=True)


def sequence_keys(seed: int, steps: int) -> mx.array:
    """The per-step PRNG keys of one sequence: ``mx.random.split(mx.random.key(seed), steps)``.

    Args:
        seed: the sequence's seed; reduced modulo 2**64.
        steps: number of keys (the sequence's ``max_tokens``), >= 1.
    Returns:
        uint32 array (steps, 2); row t draws the sequence's t-th token.
    """
    return mx.random.split(mx.random.key(int(seed) & _SEED_MASK), max(int(steps), 1))


def draw_tokens(logits: mx.array, logprobs: mx.array, configs: Sequence[SamplingConfig],
                keys: Sequence[mx.array]) -> tuple[mx.array, mx.array]:
    """Pick each row's token (contract.py step 4) and its logprob under ``logprobs``.

    Greedy rows take ``argmax(logits)``; other rows draw from ``exp(logprobs)`` by Gumbel-max
    (``argmax(logprobs + g)``, ``g`` standard Gumbel from the row's own key), so a row's draw
    depends only on its key and its logprobs, never on the other rows.

    Args:
        logits: float32 (N, V), the raw logits (used by greedy rows).
        logprobs: float32 (N, V) from :func:`transform_logits` with the same ``configs``.
        configs: N sampling configs.
        keys: N PRNG keys (uint32, shape (2,)), one per row for this step.
    Returns:
        ``(tokens, token_logprobs)``: int32 (N,) token ids and float32 (N,) natural-log
        probabilities ``logprobs[row, token]``.
    """
    vocab = logits.shape[-1]
    greedy = [c.temperature == 0 for c in configs]
    if all(greedy):
        picked = logits
    else:
        noise = mx.stack([mx.zeros((vocab,), mx.float32) if g
                          else mx.random.gumbel((vocab,), mx.float32, key=k)
                          for g, k in zip(greedy, keys, strict=True)])
        picked = mx.where(mx.array(greedy)[:, None], logits, logprobs + noise)
    tokens = mx.argmax(picked, axis=-1).astype(mx.int32)
    token_logprobs = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, token_logprobs


def alternatives(logprobs: mx.array, top_n: Sequence[int]) -> list[TopLogprobs] | None:
    """Each row's ``top_n[row]`` most likely ``(token id, logprob)`` of ``logprobs`` (N, V),
    most likely first (contract.py, "Alternatives"); None when no row asks any."""
    k = max(top_n, default=0)
    if k == 0:
        return None
    order = mx.argsort(-logprobs, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, order, axis=-1)
    ids, vals = order.tolist(), values.tolist()
    return [list(zip(ids[r][:n], vals[r][:n], strict=True)) for r, n in enumerate(top_n)]
