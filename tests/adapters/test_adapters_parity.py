"""Numerical parity: the same adapter in transformers+peft and, converted, in mlx-lm gives the
same next-token log-probabilities (fp32, within 1e-4) at every prompt position.

"Next-token log-probabilities" are log p(x[t+1] | x[:t+1]) for every position t of the prompt.
On the tiny llama the whole next-token distribution (every vocabulary entry) must agree too.
On SmolLM2-135M the whole distribution is at the two engines' fp32 noise floor: the base
model alone (no adapter) differs by ~7e-5 over 49k entries (torch fp32 is 6e-5 from a float64
reference, mlx fp32 6e-5), so there the adapted models must disagree no more than twice as
much as the base models do; a wrong scale or layout moves them by several nats.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from adapters_testlib import (
    ALL_LINEAR,
    make_mlx_adapter,
    make_peft_adapter,
    mlx_logprobs,
    torch_logprobs,
)

from gridrl.adapters import convert_files, read_dir, write_dir

pytestmark = pytest.mark.mlx
TOL = 1e-4
# Far above the tolerance: the adapter really changes the model.
MIN_EFFECT = 1e-2

TINY_CASES = {
    "all_linear": ({"target_modules": ALL_LINEAR}, None),
    "last_block": ({"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                    "layers_to_transform": [1]}, 2),
    "rslora": ({"r": 8, "lora_alpha": 16, "use_rslora": True,
                "target_modules": ["gate_proj", "up_proj", "down_proj"]}, None),
    "dora": ({"use_dora": True, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]},
             None),
    # Tinker's train_unembed: LoRA on the output head too (mlx-lm key "lm_head")
    "output_head": ({"target_modules": ["q_proj", "v_proj", "lm_head"]}, None),
}


def _prompt(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


@pytest.fixture(scope="module")
def tiny_prompt(tiny_llama_dir: Path) -> list[int]:
    ids = _prompt(tiny_llama_dir, "the red cat run : reverse the words , the blue sea .")
    assert len(ids) >= 12
    return ids


@pytest.fixture(scope="module")
def tiny_base_logprobs(tiny_llama_dir: Path, tiny_prompt: list[int]) -> np.ndarray:
    return torch_logprobs(tiny_llama_dir, None, tiny_prompt)


def _next_token(lp: np.ndarray, ids: list[int]) -> np.ndarray:
    """log p(ids[t + 1] | ids[:t + 1]) for t = 0 .. len(ids) - 2."""
    return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def _check(ids: list[int], torch_lp: np.ndarray, mlx_lp: np.ndarray,
           base_lp: np.ndarray) -> float:
    """Assert next-token parity and a real adapter effect; return the whole-distribution error."""
    assert torch_lp.shape == mlx_lp.shape == base_lp.shape == (len(ids), torch_lp.shape[1])
    err = np.abs(_next_token(torch_lp, ids) - _next_token(mlx_lp, ids)).max()
    effect = np.abs(torch_lp - base_lp).max()
    assert err < TOL, f"next-token max |peft - mlx| = {err:.3g}"
    assert effect > MIN_EFFECT, f"adapter effect {effect:.3g} is too small to test anything"
    return float(np.abs(torch_lp - mlx_lp).max())


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_peft_adapter_converted_to_mlx(case: str, tiny_llama_dir: Path, tiny_prompt: list[int],
                                       tiny_base_logprobs: np.ndarray, tmp_path: Path) -> None:
    lora_kwargs, num_layers = TINY_CASES[case]
    peft_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "peft", seed=3, **lora_kwargs)
    mlx_dir = write_dir(convert_files(read_dir(peft_dir), "mlx", num_layers), tmp_path / "mlx")
    full = _check(tiny_prompt, torch_logprobs(tiny_llama_dir, peft_dir, tiny_prompt),
                  mlx_logprobs(tiny_llama_dir, mlx_dir, tiny_prompt), tiny_base_logprobs)
    assert full < TOL, f"whole-distribution max |peft - mlx| = {full:.3g}"


@pytest.mark.parametrize("dora, head", [(False, False), (True, False), (False, True)],
                         ids=["lora", "dora", "output_head"])
def test_mlx_adapter_converted_to_peft(dora: bool, head: bool, tiny_llama_dir: Path,
                                       tiny_prompt: list[int], tiny_base_logprobs: np.ndarray,
                                       tmp_path: Path) -> None:
    keys = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"] + ["lm_head"] * head
    mlx_dir = make_mlx_adapter(tiny_llama_dir, tmp_path / "mlx", num_layers=2 if head else 1,
                               dora=dora, keys=keys)
    peft_dir = write_dir(convert_files(read_dir(mlx_dir), "peft"), tmp_path / "peft")
    full = _check(tiny_prompt, torch_logprobs(tiny_llama_dir, peft_dir, tiny_prompt),
                  mlx_logprobs(tiny_llama_dir, mlx_dir, tiny_prompt), tiny_base_logprobs)
    assert full < TOL, f"whole-distribution max |peft - mlx| = {full:.3g}"


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_peft_adapter_converted_to_mlx(smollm2_dir: Path, tmp_path: Path) -> None:
    from gridrl.models import model_identity

    ident = model_identity(smollm2_dir)
    ids = _prompt(smollm2_dir, "<|im_start|>user\nReverse the words: red cat blue sky."
                               "<|im_end|>\n<|im_start|>assistant\n")
    last = list(range(ident.num_layers - 12, ident.num_layers))
    peft_dir = make_peft_adapter(smollm2_dir, tmp_path / "peft", seed=5, r=8, lora_alpha=16,
                                 use_rslora=True, target_modules=ALL_LINEAR,
                                 layers_to_transform=last)
    mlx_dir = write_dir(convert_files(read_dir(peft_dir), "mlx", ident.num_layers),
                        tmp_path / "mlx")
    base_torch, base_mlx = torch_logprobs(smollm2_dir, None, ids), mlx_logprobs(smollm2_dir,
                                                                                None, ids)
    full = _check(ids, torch_logprobs(smollm2_dir, peft_dir, ids),
                  mlx_logprobs(smollm2_dir, mlx_dir, ids), base_torch)
    noise = float(np.abs(base_torch - base_mlx).max())
    assert full <= 2 * noise, f"whole distribution: adapted {full:.3g}, base models {noise:.3g}"
