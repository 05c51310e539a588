"""The fused float32 decode kernel (backends/cpu_kernels) against float64 torch: every part
of its formula (RMSNorm prologue, LoRA term, bias, residual add in place, SwiGLU), row counts
around its 8-row tile, output widths that are not a multiple of its 16-column blocks; its
refusals; and the fallback when it cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gridrl.rollout.backends import cpu_kernels


@pytest.fixture(scope="module")
def kernels() -> cpu_kernels.DecodeKernels:
    k = cpu_kernels.load()
    assert k is not None, cpu_kernels.unavailable_reason()  # gcc is part of the CI image
    return k


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])
@pytest.mark.parametrize("n,k", [(832, 576), (50, 40), (3000, 100)])
def test_every_term_matches_float64(kernels, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * 7 + n)
    x = torch.randn(rows, k)
    w, g = torch.randn(n, k) * 0.05, torch.rand(k) + 0.5
    a, b = torch.randn(16, k) * 0.1, torch.randn(n, 16) * 0.1
    bias, add = torch.randn(n), torch.randn(rows, n)
    h = F.rms_norm(x.double(), (k,), g.double(), 1e-5)
    pre = h @ w.double().t() + (h @ a.double().t()) @ b.double().t()
    a_folded = (a * g).contiguous()  # the LoRA input is the raw x: norm weight folded into A

    plain = kernels.linear(x, cpu_kernels.pack_weight(w), n)
    assert _rel(plain, x.double() @ w.double().t()) < 1e-5

    full = kernels.linear(x, cpu_kernels.pack_weight(w, in_scale=g), n,
                          lora=(a_folded, cpu_kernels.pack_weight(b)), eps=1e-5, bias=bias, add=add)
    assert full.shape == (rows, n)
    assert _rel(full, pre + bias.double() + add.double()) < 1e-5

    if n % 2 == 0:
        act = kernels.linear(x, cpu_kernels.pack_weight(w, swiglu=True, in_scale=g), n,
                             lora=(a_folded, cpu_kernels.pack_weight(b, swiglu=True)), eps=1e-5,
                             swiglu=True)
        assert act.shape == (rows, n // 2)
        assert _rel(act, F.silu(pre[:, :n // 2]) * pre[:, n // 2:]) < 1e-5


def test_residual_is_updated_in_place(kernels) -> None:
    torch.manual_seed(0)
    x, w, residual = torch.randn(8, 64), torch.randn(48, 64) * 0.1, torch.randn(8, 48)
    want = x.double() @ w.double().t() + residual.double()
    out = kernels.linear(x, cpu_kernels.pack_weight(w), 48, add=residual, out=residual)
    assert out is residual
    assert _rel(residual, want) < 1e-5


def test_pack_weight_layout() -> None:
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # 20 rows: 2 blocks, 12 padded
    p = cpu_kernels.pack_weight(w)
    assert p.shape == (2, 3, cpu_kernels.NB)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 3], w[19])
    assert not p[1, :, 4:].any()
    s = cpu_kernels.pack_weight(w, swiglu=True)  # gate rows 0-9, up rows 10-19
    assert s.shape == (1, 3, 2 * cpu_kernels.NB)
    assert torch.equal(s[0, :, 2], w[2]) and torch.equal(s[0, :, cpu_kernels.NB + 2], w[12])
    with pytest.raises(ValueError, match="odd number of rows"):
        cpu_kernels.pack_weight(w[:3], swiglu=True)


def test_refusals_name_the_argument(kernels) -> None:
    x, packed = torch.randn(4, 32), cpu_kernels.pack_weight(torch.randn(16, 32))
    with pytest.raises(ValueError, match="x must be contiguous float32"):
        kernels.linear(x.double(), packed, 16)
    with pytest.raises(ValueError, match="K=32, x has 31"):
        kernels.linear(torch.randn(4, 31), packed, 16)
    with pytest.raises(ValueError, match=r"add must be contiguous \(4, 16\)"):
        kernels.linear(x, packed, 16, add=torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"out must be contiguous \(4, 16\)"):
        kernels.linear(x, packed, 16, out=torch.randn(16, 4).t())
    with pytest.raises(ValueError, match="LoRA A"):
        kernels.linear(x, packed, 16, lora=(torch.randn(2, 31), torch.randn(1, 2, 16)))
    with pytest.raises(ValueError, match="refused its arguments"):  # the C side's own check
        kernels.linear(x, cpu_kernels.pack_weight(torch.randn(16, 32), swiglu=True), 15,
                       swiglu=True)


def test_unavailable_kernels_say_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GRIDRL_CACHE_DIR", str(tmp_path))
    try:
        cpu_kernels.load.cache_clear()
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "0")
        assert cpu_kernels.load() is None
        assert "GRIDRL_CPU_KERNELS=0" in cpu_kernels.unavailable_reason()

        cpu_kernels.load.cache_clear()
        monkeypatch.delenv("GRIDRL_CPU_KERNELS")
        monkeypatch.setenv("CC", "false")  # a "compiler" that fails
        assert cpu_kernels.load() is None
        assert "build failed" in cpu_kernels.unavailable_reason()
        assert not list(tmp_path.glob("kernels/*"))  # no half-written library left behind

        cpu_kernels.load.cache_clear()
        monkeypatch.delenv("CC")
        assert cpu_kernels.load() is not None  # builds into the new cache directory
        assert cpu_kernels.unavailable_reason() is None
        assert len(list(tmp_path.glob("kernels/decode-*.so"))) == 1
    finally:
        cpu_kernels.load.cache_clear()


def test_lean_forward_without_kernels_names_the_reason(monkeypatch) -> None:
    from test_torch_llama import _tiny

    from gridrl.rollout.backends.torch_llama import LeanLlama

    try:
        cpu_kernels.load.cache_clear()
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "0")
        lean = LeanLlama(_tiny())
        assert lean.products.endswith("(fused C kernels unavailable: disabled by "
                                      "GRIDRL_CPU_KERNELS=0)")
        assert {layer.down.kind for layer in lean.layers} != {"kernel"}
    finally:
        monkeypatch.delenv("GRIDRL_CPU_KERNELS")
        cpu_kernels.load.cache_clear()
    assert LeanLlama(_tiny()).products == "fused C kernel"
