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


@pytest.mark.slow
def test_the_sdk_trains_and_samples_on_serve_api_backend_mlx(tiny_llama_dir: Path,
                                                             tmp_path: Path) -> None:
    """An all-Mac team's Tinker: the official SDK against ``serve-api --backend mlx``
    (loopback, no credentials): forward-backward with cispo, an optimizer step that learns,
    sampler weights in peft and mlx-lm layouts, samples of them."""
    tinker = pytest.importorskip("tinker")
    from service_procs import start_service

    server = start_service(
        ["gridrl-trainer", "serve-api", "--backend", "mlx", "--device", "cpu", "--model",
         str(tiny_llama_dir), "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
         "--api-dir", str(tmp_path / "api"), "--lora-alpha", "8"], tmp_path, "serve-api-mlx")
    try:
        types = tinker.types
        service = tinker.ServiceClient(base_url=server.info["tinker_base_url"],
                                       api_key="tml-local")
        training = service.create_lora_training_client(base_model=str(tiny_llama_dir),
                                                       rank=4).result(timeout=120)
        datum = types.Datum(model_input=types.ModelInput.from_ints([5, 9, 12, 7]),
                            loss_fn_inputs={"target_tokens": [9, 12, 7, 30]})
        before = training.forward([datum], "cross_entropy").result(timeout=120).metrics[
            "loss:sum"]
        rl = types.Datum(model_input=datum.model_input, loss_fn_inputs={
            "target_tokens": [9, 12, 7, 30], "advantages": [1.0] * 4, "logprobs": [-5.0] * 4})
        assert training.forward_backward([rl], "cispo").result(timeout=120)
        for _ in range(3):
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=120)
        after = training.forward([datum], "cross_entropy").result(timeout=120).metrics[
            "loss:sum"]
        assert after < before
        path = training.save_weights_for_sampler("mac").result(timeout=120).path
        folder = tmp_path / "api" / training.model_id.replace(":", "-") / "sampler_weights" / "mac"
        assert (folder / "peft" / "adapter_model.safetensors").is_file()
        assert (folder / "mlx" / "adapters.safetensors").is_file()
        sampler = service.create_sampling_client(model_path=path)
        out = sampler.sample(types.ModelInput.from_ints([5, 9, 12]), 2, types.SamplingParams(
            max_tokens=3, temperature=1.0, seed=1)).result(timeout=120)
        assert len(out.sequences) == 2 and all(len(s.tokens) <= 3 for s in out.sequences)
        service.close("success").result(timeout=60)
    finally:
        server.stop()


def test_a_head_tied_to_the_embeddings_gets_no_head_lora_in_mlx(tiny_llama_dir: Path,
                                                                 tmp_path: Path) -> None:
    """mlx-lm computes a tied head as embed_tokens.as_linear (no lm_head module): train_unembed
    is refused there by name, and a torch adapter with a head LoRA gets no mlx-lm copy (it
    would load and change nothing); the untied tiny llama gets one with key lm_head."""
    import json
    import shutil

    from gridrl.common.errors import Kind, StatusError
    from gridrl.trainer.primitives.snapshots import write_mlx

    tied = tmp_path / "tied"
    shutil.copytree(tiny_llama_dir, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    head = LoraSettings(rank=4, alpha=8, target_modules="q_proj,v_proj,lm_head")
    with pytest.raises(StatusError, match="train_unembed") as refused:
        MlxTrainableModel.load(str(tied), head, seed=0, device="cpu")
    assert refused.value.kind == Kind.FAILED_PRECONDITION
    model = TorchTrainableModel.load(str(tiny_llama_dir), head, seed=0, device="cpu")
    try:
        files = model.adapter_files()
    finally:
        model.close()
    assert write_mlx(files, tmp_path / "mlx-tied", "m", 2, str(tied)) is None
    untied = write_mlx(files, tmp_path / "mlx", "m", 2, str(tiny_llama_dir))
    assert untied is not None
    saved = json.loads((untied / "adapter_config.json").read_text())
    assert "lm_head" in saved["lora_parameters"]["keys"]
