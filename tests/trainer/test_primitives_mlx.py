"""The training primitives on MLX (``serve-api --backend mlx``, an all-Mac team's Tinker) on
the tiny llama: with the same adapter, its logprobs, every loss and the loss's LoRA gradients
are torch's at float32 rounding; an optimizer step learns; saved states load back with and
without the optimizer; top-k prompt logprobs and sampling work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from float_bounds import ROUNDING_REL, assert_close_to_largest, assert_tensors_close_to_largest

pytest.importorskip("mlx_lm")

from gridrl.trainer.backends.base import LoraSettings
from gridrl.trainer.primitives.mlx_model import MlxTrainableModel
from gridrl.trainer.primitives.torch_model import TorchTrainableModel
from gridrl.trainer.primitives.types import AdamSettings, Datum, LossSpec

pytestmark = pytest.mark.mlx
SEQS = [([5, 9, 12, 7, 30], [9, 12, 7, 30, 2]), ([3, 4, 8], [4, 8, 2])]
LORA = LoraSettings(rank=4, alpha=8)


@pytest.fixture(scope="module")
def pair(tiny_llama_dir: Path) -> Iterator[tuple[TorchTrainableModel, MlxTrainableModel]]:
    """A torch model with B != 0 and an MLX model holding the same adapter."""
    t = TorchTrainableModel.load(str(tiny_llama_dir), LORA, seed=3, device="cpu")
    with torch.no_grad():
        for p in t.policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    m = MlxTrainableModel.load(str(tiny_llama_dir), LORA, seed=3, device="cpu")
    m.load_adapter_files(t.adapter_files())
    yield t, m
    t.close()
    m.close()


def _data() -> list[Datum]:
    rng = np.random.default_rng(0)
    return [Datum.of(ids, tg, weights=rng.uniform(0, 1, len(ids)),
                     advantages=rng.normal(size=len(ids)),
                     sampling_logprobs=-rng.uniform(0, 8, len(ids))) for ids, tg in SEQS]


def _mlx_grads(m: MlxTrainableModel) -> list[np.ndarray]:
    from mlx.utils import tree_flatten

    return [np.array(g) for _, g in sorted(tree_flatten(m._grads))]


def _torch_grads(t: TorchTrainableModel) -> list[np.ndarray]:
    named = sorted((n, p) for n, p in t.policy.model.named_parameters() if p.requires_grad)
    return [p.grad.detach().numpy().T for _, p in named]  # mlx-lm arrays are peft's transposed


def test_logprobs_losses_and_gradients_are_torchs(pair) -> None:
    t, m = pair
    data = _data()
    for loss in (LossSpec("cross_entropy"), LossSpec("importance_sampling"),
                 LossSpec("ppo", 0.9, 1.1), LossSpec("cispo", 0.9, 1.1),
                 LossSpec("dro", beta=0.3)):
        want = t.forward(data, loss, backward=True)
        got = m.forward(data, loss, backward=True)
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            assert_close_to_largest(g, w, ROUNDING_REL, f"{loss.name} logprobs")
        assert_close_to_largest([got.loss], [want.loss], ROUNDING_REL, f"{loss.name} loss")
        assert_tensors_close_to_largest(_mlx_grads(m), _torch_grads(t), ROUNDING_REL,
                                        f"{loss.name} LoRA gradients")
        t.backend.optimizer.zero_grad(set_to_none=True)
        t.pending_datums = 0
        m._grads, m.pending_datums = None, 0


def test_a_step_learns_and_states_load_back_with_and_without_the_optimizer(pair) -> None:
    _, m = pair
    data = [Datum.of(ids, tg) for ids, tg in SEQS]
    saved = m.state_files()
    before = m.forward(data, LossSpec("cross_entropy"), backward=False).loss
    for _ in range(3):
        m.forward(data, LossSpec("cross_entropy"), backward=True)
        result = m.optim_step(AdamSettings(lr=5e-2))
    assert result.steps == 3 and result.datums == 2 and result.grad_norm > 0
    after = m.forward(data, LossSpec("cross_entropy"), backward=False).loss
    assert after < before
    trained = m.state_files()
    m.load_state_files(saved, with_optimizer=False)
    assert m.steps == 0
    assert m.forward(data, LossSpec("cross_entropy"), backward=False).loss == pytest.approx(
        before, rel=1e-6)
    m.load_state_files(trained, with_optimizer=True)
    assert m.steps == 3
    assert m.forward(data, LossSpec("cross_entropy"), backward=False).loss == pytest.approx(
        after, rel=1e-6)


def test_topk_prompt_logprobs_and_sampling(pair) -> None:
    from gridrl.engine.contract import SamplingConfig

    t, m = pair
    m.load_adapter_files(t.adapter_files())  # the same weights again (a test above trained)
    prompt = [5, 9, 12, 7, 30]
    (t_ids, t_lp), (m_ids, m_lp) = t.prompt_topk(prompt, 3), m.prompt_topk(prompt, 3)
    assert m_ids.shape == (4, 3) and (m_ids == t_ids).all()
    assert_close_to_largest(m_lp, t_lp, ROUNDING_REL, "top-k prompt logprobs")
    out = m.generate([prompt], SamplingConfig(max_tokens=3, temperature=0.0), [1])
    assert len(out[0].token_ids) == 3 and len(out[0].logprobs) == 3
