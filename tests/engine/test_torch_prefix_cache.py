"""The torch backend's prefix cache (backends/torch/prefix_cache.py): a request with
``keep_cache`` leaves its samples' keys/values, the next turn's prompt (which continues one)
prefills only its new tokens and decodes what a backend without the cache decodes (same tokens,
behaviour logprobs within 1e-5: decode-step and prefill keys/values differ by float rounding
only); entries are per adapter, bounded in bytes, and an interrupted call keeps nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_peft_adapter

from gridrl.engine.backends.torch.prefix_cache import PrefixCache
from gridrl.engine.backends.torch.steps import LeanSteps
from gridrl.engine.contract import DecodeInterrupted, SamplingConfig, SequenceRequest

PROMPT = [5, 11, 12, 13, 14, 15, 16, 17]
ENV = [4, 30, 31, 32, 6]  # the environment's turn (any ids)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter"), std=0.05)


def _turns(backend, adapter, sampling):
    first = backend.generate([SequenceRequest(PROMPT, sampling, seed=s, keep_cache=True)
                              for s in (1, 2, 3)], adapter)
    second = [SequenceRequest(PROMPT + r.token_ids + ENV, sampling, seed=10 + i)
              for i, r in enumerate(first)]
    return first, second


@pytest.mark.parametrize("with_adapter", [False, True])
@pytest.mark.parametrize("sampling", [SamplingConfig(max_tokens=8, temperature=0.0),
                                      SamplingConfig(max_tokens=8, temperature=0.9)],
                         ids=["greedy", "T0.9"])
def test_a_second_turn_reuses_the_first_turns_keys_and_values(
        tiny_llama_dir, adapter_dir, monkeypatch, sampling, with_adapter):
    from gridrl.engine.backends.torch.backend import TorchBackend

    plain = TorchBackend.from_pretrained(tiny_llama_dir)
    cached = TorchBackend.from_pretrained(tiny_llama_dir, prefix_cache_bytes=64 << 20)
    assert plain.prefix_cache is None and cached.prefix_cache is not None
    adapters = [b.load_adapter(adapter_dir, "a") if with_adapter else None
                for b in (plain, cached)]
    first, second = _turns(cached, adapters[1], sampling)
    distinct = {tuple(PROMPT + r.token_ids[:-1]): r for r in first}  # greedy: one sample, 3x
    assert len(cached.prefix_cache) == cached.prefix_cache.stats.stored == len(distinct)
    fed: list[int] = []
    real = LeanSteps.prefill_batch

    def spy(self, prompts, prefix=None, **kw):
        fed.extend(len(p) - (0 if prefix is None else prefix[0][0].shape[2]) for p in prompts)
        return real(self, prompts, prefix, **kw)

    monkeypatch.setattr(LeanSteps, "prefill_batch", spy)
    got = cached.generate(second, adapters[1])
    # each second turn prefilled only its first turn's last token and the environment's
    assert fed == [1 + len(ENV)] * len(distinct)
    stats = cached.prefix_cache.stats
    assert stats.hits == len(distinct) and stats.reused_tokens == sum(
        len(PROMPT) + len(r.token_ids) - 1 for r in distinct.values())
    want = plain.generate(second, adapters[0])
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_entries_are_per_adapter_bounded_and_never_kept_by_an_interrupted_call(
        tiny_llama_dir, adapter_dir):
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_llama_dir, prefix_cache_bytes=64 << 20)
    cache = backend.prefix_cache
    sampling = SamplingConfig(max_tokens=6, temperature=0.0)
    _, second = _turns(backend, None, sampling)
    adapter = backend.load_adapter(adapter_dir, "a")
    backend.generate(second[:1], adapter)  # another adapter: no hit
    assert cache.stats.hits == 0 and cache.stats.misses >= 1
    backend.generate(second[:1], None)
    assert cache.stats.hits == 1

    class Stop:
        def on_tokens(self, rows, token_ids, logprobs):
            pass

        def interrupted(self):
            return True

    before = len(cache)
    with pytest.raises(DecodeInterrupted):
        backend.generate([SequenceRequest([*PROMPT, 40], sampling, 1, keep_cache=True)],
                         None, Stop())
    assert len(cache) == before
    kept = backend.generate([SequenceRequest([*PROMPT, 41], sampling, 1, keep_cache=True)],
                            adapter)
    assert len(cache) == before + 1
    backend.unload_adapter(adapter)  # its entries go with it
    assert len(cache) == before and kept


def test_the_cache_evicts_the_least_recently_used_entry_first():
    def kv(n):
        return [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))]

    size = 2 * 2 * 3 * 4 * 4  # keys and values of 3 tokens, float32
    cache = PrefixCache(max_bytes=2 * size)
    cache.store("", [1, 2, 3], kv(3))
    cache.store("", [4, 5, 6], kv(3))
    assert cache.lookup("", [1, 2, 3, 9])[0] == 3  # touches [1, 2, 3]
    cache.store("", [7, 8, 9], kv(3))  # evicts [4, 5, 6], the least recently used
    assert cache.lookup("", [4, 5, 6, 1]) is None
    assert cache.lookup("", [1, 2, 3, 1]) is not None and cache.lookup("", [7, 8, 9, 1])
    assert cache.stats.evicted == 1 and cache.stats.bytes == 2 * size
    assert cache.lookup("", [1, 2, 3]) is None  # a whole prompt leaves nothing to prefill
    cache.store("", list(range(100)), kv(100))  # larger than the budget: not kept
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.stats.bytes == 0
