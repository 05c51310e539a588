"""Batches whose rows decode with different adapters (issue 46 item 1):
``Backend.generate_mixed``. On the torch lean forward every decode step is one base product for
the batch plus one product over the adapters' LoRA factors stacked along the rank, each row
reading its own (S-LoRA / Punica batching, ``LeanLlama.activate_rows``); elsewhere one adapter
group after the other. Either way each row's tokens and behaviour logprobs are those it gets in
a one-adapter batch, at float32 rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_peft_adapter
from float_bounds import ROUNDING_REL, assert_close_to_largest

from gridrl.engine.backends.torch.llama import LeanLlama
from gridrl.engine.contract import SamplingConfig, SequenceRequest

PROMPTS = [[5, 11, 12, 6], [5, 30, 31, 32, 33, 6], [5, 11, 12, 6], [7, 8, 9], [5, 40, 6],
           [5, 11, 12, 6], [9, 21, 22, 23, 24, 25, 6]]
#: the adapter of each row: "a" (all linear layers, r 4), "b" (q/v only, r 8), None (base).
ROW_ADAPTERS = ["a", None, "b", "a", "b", "b", None]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixed-adapters")
    return {"a": make_peft_adapter(tiny_llama_dir, root / "a", seed=3, std=0.05),
            "b": make_peft_adapter(tiny_llama_dir, root / "b", seed=4, std=0.05,
                                   targets=["q_proj", "v_proj"], rank=8, alpha=16)}


def _rows(sampling: SamplingConfig) -> list[SequenceRequest]:
    # different max_tokens, so rows leave the batch at different steps
    return [SequenceRequest(p, SamplingConfig(**{**sampling.__dict__,
                                                 "max_tokens": sampling.max_tokens - i % 3}),
                            seed=100 + i) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("forward", ["lean-kernels", "lean-onednn", "transformers"])
@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_tokens=9, temperature=0.0),
    SamplingConfig(max_tokens=9, temperature=0.9, top_k=30, top_logprobs=3)],
    ids=["greedy", "T0.9-top-k"])
def test_each_row_of_a_mixed_batch_decodes_as_in_a_one_adapter_batch(
        tiny_llama_dir: Path, adapter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        forward: str, sampling: SamplingConfig) -> None:
    from gridrl.engine.backends.torch import cpu_kernels
    from gridrl.engine.backends.torch.backend import TorchBackend

    monkeypatch.setenv("GRIDRL_CPU_KERNELS", "0" if forward == "lean-onednn" else "1")
    cpu_kernels.clear_cache()
    try:
        backend = TorchBackend.from_pretrained(tiny_llama_dir, lean=forward != "transformers")
    finally:
        cpu_kernels.clear_cache()
    if forward != "transformers":
        lean, _ = backend.adapters.lean_factors([])
        assert lean.head.kind == ("kernel" if forward == "lean-kernels" else "onednn")
    handles = {name: backend.load_adapter(d, name) for name, d in adapter_dirs.items()}
    adapters = [None if a is None else handles[a] for a in ROW_ADAPTERS]
    rows = _rows(sampling)

    mixed_calls: list[int] = []
    real = LeanLlama.activate_rows

    def spy(self, per_row):
        mixed_calls.append(len(per_row))
        return real(self, per_row)

    monkeypatch.setattr(LeanLlama, "activate_rows", spy)
    seen: dict[int, list[int]] = {}

    class Observer:
        def on_tokens(self, rows_, tokens, logprobs, top=None):
            for r, t in zip(rows_, tokens, strict=True):
                seen.setdefault(r, []).append(t)

        def interrupted(self):
            return False

    got = backend.generate_mixed(rows, adapters, Observer())
    if forward == "transformers":
        assert not backend.mixes_adapters and mixed_calls == []
    else:
        assert backend.mixes_adapters and mixed_calls == [len(rows)]  # one batch, all rows
    # the reference: each adapter's rows in a batch of their own
    want: dict[int, object] = {}
    for name in ("a", "b", None):
        idx = [i for i, a in enumerate(ROW_ADAPTERS) if a == name]
        alone = backend.generate([rows[i] for i in idx], None if name is None else handles[name])
        want.update(zip(idx, alone, strict=True))
    for i, result in enumerate(got):
        ref = want[i]
        assert result.token_ids == ref.token_ids, f"row {i} ({ROW_ADAPTERS[i]})"
        assert result.finish_reason == ref.finish_reason
        assert_close_to_largest(result.logprobs, ref.logprobs, ROUNDING_REL,
                                f"row {i} behaviour logprobs")
        if sampling.top_logprobs:
            assert [[t for t, _ in step] for step in result.top_logprobs] == \
                [[t for t, _ in step] for step in ref.top_logprobs]
            assert_close_to_largest([[lp for _, lp in step] for step in result.top_logprobs],
                                    [[lp for _, lp in step] for step in ref.top_logprobs],
                                    ROUNDING_REL, f"row {i} processed logprobs")
        assert seen[i] == result.token_ids  # the observer got the batch's own row indices
    # the adapters matter: the same prompt under a, b and the base model differs
    same_prompt = [got[0].logprobs, got[2].logprobs]
    assert same_prompt[0] != same_prompt[1]
    base_alone = backend.generate([rows[0]], None)[0]
    assert base_alone.logprobs != got[0].logprobs


def test_row_ranks_add_exact_zeros_for_foreign_adapters() -> None:
    """The torch path of a stacked LoRA: a row's product equals its own adapter's product
    (the foreign ranks are masked to exact zeros), and keep() follows the live rows."""
    from gridrl.engine.backends.torch.projection import Projection, RowLora, RowRanks

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=gen)
    proj = Projection(w)
    a1, b1 = torch.randn(4, 16, generator=gen), torch.randn(4, 24, generator=gen)
    a2, b2 = torch.randn(8, 16, generator=gen), torch.randn(8, 24, generator=gen)
    a, b = Projection.stack_lora([(a1, b1), (a2, b2)])
    x = torch.randn(3, 16, generator=gen)
    ranks = RowRanks(torch.tensor([[0, 4], [4, 12], [0, 0]]), 12)
    proj.lora = RowLora(a, b, ranks)
    got = proj(x)
    for row, lora in enumerate([(a1, b1), (a2, b2), None]):
        proj.lora = lora
        want = proj(x[row:row + 1])
        assert_close_to_largest(got[row:row + 1], want, ROUNDING_REL, f"row {row}")
    ranks.keep(torch.tensor([2, 0]))
    assert ranks.segments.tolist() == [[0, 0], [0, 4]]
    assert ranks.mask.sum(1).tolist() == [0.0, 4.0]


def test_mixed_batch_refuses_misaligned_adapters(tiny_llama_dir: Path) -> None:
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_llama_dir)
    with pytest.raises(ValueError, match="2 adapters for 1 sequences"):
        backend.generate_mixed([SequenceRequest([5, 6], SamplingConfig(max_tokens=2), 0)],
                               [None, None])
