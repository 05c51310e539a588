"""``TorchBackend.share_prefix`` (backends/torch.py, torch_steps.py, torch_llama.py ``past``):
prompts that begin alike (an eval set under one system prompt) get their common token prefix
prefilled once, each prompt's other tokens attending to it -- the same greedy completions,
the same sampled ones, and the behaviour logprobs of a plain prefill up to float rounding,
on the lean forward with and without a LoRA adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_peft_adapter

from gridrl.engine.backends.torch.steps import LeanSteps
from gridrl.engine.contract import SamplingConfig, SequenceRequest

PREFIX = [5, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 14 shared tokens
SUFFIXES = [[30, 31, 6], [40, 41, 42, 43, 6], [30, 32, 6], [50, 6], [30, 31, 6]]


def _batch(sampling: SamplingConfig) -> list[SequenceRequest]:
    return [SequenceRequest(PREFIX + s, sampling, seed=i) for i, s in enumerate(SUFFIXES)]


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter"), std=0.05)


@pytest.mark.parametrize("with_adapter", [False, True])
@pytest.mark.parametrize("sampling", [SamplingConfig(max_tokens=10, temperature=0.0),
                                      SamplingConfig(max_tokens=10, temperature=0.7, top_k=20)],
                         ids=["greedy", "T0.7-top-k"])
def test_a_shared_prefix_decodes_as_whole_prompts_do(tiny_llama_dir: Path, adapter_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     sampling: SamplingConfig,
                                                     with_adapter: bool) -> None:
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_llama_dir)
    assert backend.forward_kind == "lean" and not backend.share_prefix
    adapter = backend.load_adapter(adapter_dir, "a") if with_adapter else None
    plain = backend.generate(_batch(sampling), adapter)

    shared: list[int] = []
    real = LeanSteps.shared_prefix

    def spy(self, prefix):
        shared.append(len(prefix))
        return real(self, prefix)

    monkeypatch.setattr(LeanSteps, "shared_prefix", spy)
    backend.share_prefix = True
    got = backend.generate(_batch(sampling), adapter)
    assert shared == [len(PREFIX)]  # the prefix went through the forward once
    for a, b in zip(got, plain, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # and the logprobs are still those of the teacher-forced score
    for req, res in zip(_batch(sampling), got, strict=True):
        assert backend.score(req.prompt_ids, res.token_ids, sampling, adapter) == pytest.approx(
            res.logprobs, abs=1e-4)


def test_prompts_with_too_short_a_common_prefix_are_prefilled_whole(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.engine.backends.torch.decode import MIN_SHARED_PREFIX

    backend = TorchBackend.from_pretrained(tiny_llama_dir)
    backend.share_prefix = True
    monkeypatch.setattr(LeanSteps, "shared_prefix", lambda self, prefix: pytest.fail(
        "prefilled a shared prefix"))
    greedy = SamplingConfig(max_tokens=4, temperature=0.0)
    short = PREFIX[:MIN_SHARED_PREFIX - 1]
    backend.generate([SequenceRequest([*short, 30, 6], greedy, 0),
                      SequenceRequest([*short, 40, 6], greedy, 0)], None)
    # one distinct prompt (a GRPO group): nothing to share
    backend.generate([SequenceRequest([*PREFIX, 30, 6], greedy, i) for i in range(3)], None)
    # a prompt that is the whole common prefix keeps its last token to prefill
    monkeypatch.undo()
    batch = [SequenceRequest(PREFIX, greedy, 0), SequenceRequest([*PREFIX, 30], greedy, 0)]
    shared = backend.generate(batch, None)
    backend.share_prefix = False
    assert [r.token_ids for r in shared] == [r.token_ids for r in backend.generate(batch, None)]


def test_a_prefix_prefill_continues_a_whole_prefill(tiny_llama_dir: Path) -> None:
    """The keys/values and last logits of prefix-then-rest equal a whole prompt's prefill."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_llama_dir)
    prompt = PREFIX + SUFFIXES[1]
    with backend._using(None) as forward:
        steps = LeanSteps(forward, backend._device, backend._dtype)
        whole_kv, whole_logits = steps.prefill(prompt)
        kv, logits = steps.prefill(prompt, steps.shared_prefix(PREFIX))
    torch.testing.assert_close(logits, whole_logits, rtol=0, atol=1e-5)
    assert len(kv) == len(whole_kv)
    for (k, v), (wk, wv) in zip(kv, whole_kv, strict=True):
        assert k.shape == wk.shape == (1, wk.shape[1], len(prompt), wk.shape[3])
        torch.testing.assert_close(k, wk, rtol=0, atol=1e-5)
        torch.testing.assert_close(v, wv, rtol=0, atol=1e-5)


@pytest.mark.parametrize("max_tokens", [6, 2048], ids=["chunked", "one-forward"])
def test_the_batched_prefill_after_a_prefix_is_each_prompts_own(tiny_llama_dir: Path,
                                                                max_tokens: int) -> None:
    """``LeanSteps.prefill_batch``: the suffixes right-padded into few forwards (with a budget
    of 6 tokens: the 3- and 2-token suffixes together, the 5-token one alone) give each prompt the keys/values
    and next-token logits of its own prefill after the prefix."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_llama_dir)
    prompts = [PREFIX + s for s in SUFFIXES]
    with backend._using(None) as forward:
        steps = backend._steps(forward)
        assert isinstance(steps, LeanSteps)
        prefix = steps.shared_prefix(PREFIX)
        kv, logits = steps.prefill_batch(prompts, prefix, max_tokens=max_tokens)
        assert len(kv) == len(logits) == len(prompts)
        for p, layers, got in zip(prompts, kv, logits, strict=True):
            alone, want = steps.prefill(p, prefix)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            for (k, v), (k1, v1) in zip(layers, alone, strict=True):
                assert k.shape == k1.shape == (1, k1.shape[1], len(p), k1.shape[3])
                torch.testing.assert_close(k, k1, rtol=0, atol=1e-5)
                torch.testing.assert_close(v, v1, rtol=0, atol=1e-5)
