"""The fused float32 decode kernels (backends/cpu_kernels) against float64 torch: every part
of the product's formula (RMSNorm prologue, LoRA term, bias, residual add in place, SwiGLU),
row counts around its 8-row tile, output widths that are not a multiple of its 16-column
blocks; the decode attention (rotary, cache write, GQA, padding mask); their refusals; and
the fallback when the library cannot be built."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from gridrl.engine.backends.torch import cpu_kernels


@pytest.fixture(scope="module")
def kernels() -> cpu_kernels.DecodeKernels:
    # these tests are of the kernels themselves, whether or not they are the faster path here
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRIDRL_CPU_KERNELS", "1")
        k = cpu_kernels.load()
    assert k is not None, cpu_kernels.unavailable_reason()  # gcc is part of the CI image
    return k


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 11, 13, 40])  # every tile size (AVX2: 6 rows)
@pytest.mark.parametrize("n,k", [(832, 576), (50, 40), (3000, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_term_matches_float64(kernels, rows: int, n: int, k: int,
                                    dtype: torch.dtype) -> None:
    """Both weight dtypes hold to float32 rounding: the reference reads the weights the kernel
    reads (bfloat16: the norm weight folded in float32 and rounded once, when packed)."""
    torch.manual_seed(rows * 7 + n)
    x = torch.randn(rows, k)
    w, g = (torch.randn(n, k) * 0.05).to(dtype), torch.rand(k) + 0.5
    a, b = torch.randn(16, k) * 0.1, torch.randn(n, 16) * 0.1
    bias, add = torch.randn(n), torch.randn(rows, n)
    # the packed weight with the norm weight taken back out
    w_eff = w.double() if dtype == torch.float32 else (
        (w.float() * g).to(dtype).double() / g.double())
    pack = functools.partial(cpu_kernels.pack_weight, dtype=dtype)
    h = F.rms_norm(x.double(), (k,), g.double(), 1e-5)
    pre = h @ w_eff.t() + (h @ a.double().t()) @ b.double().t()
    a_folded = (a * g).contiguous()  # the LoRA input is the raw x: norm weight folded into A

    plain = kernels.linear(x, pack(w), n)
    assert _rel(plain, x.double() @ w.double().t()) < 1e-5

    full = kernels.linear(x, pack(w, in_scale=g), n,
                          lora=(a_folded, cpu_kernels.pack_weight(b)), eps=1e-5, bias=bias, add=add)
    assert full.shape == (rows, n)
    assert _rel(full, pre + bias.double() + add.double()) < 1e-5

    if n % 2 == 0:
        act = kernels.linear(x, pack(w, swiglu=True, in_scale=g), n,
                             lora=(a_folded, cpu_kernels.pack_weight(b, swiglu=True)), eps=1e-5,
                             swiglu=True)
        assert act.shape == (rows, n // 2)
        assert _rel(act, F.silu(pre[:, :n // 2]) * pre[:, n // 2:]) < 1e-5


def test_dynamic_blocks_give_the_same_bits(kernels) -> None:
    """Handing column blocks out dynamically (a team that shares its cores) changes which
    thread computes a column, not how: bit-identical results."""
    torch.manual_seed(3)
    x, w = torch.randn(8, 576), torch.randn(3072, 576) * 0.05
    for dtype in (torch.float32, torch.bfloat16):
        for swiglu in (False, True):
            packed = cpu_kernels.pack_weight(w, swiglu=swiglu, dtype=dtype)
            kernels.set_dynamic_blocks(False)
            static = kernels.linear(x, packed, 3072, eps=1e-5, swiglu=swiglu)
            try:
                kernels.set_dynamic_blocks(True)
                dynamic = kernels.linear(x, packed, 3072, eps=1e-5, swiglu=swiglu)
            finally:
                kernels.set_dynamic_blocks(False)
            assert torch.equal(static, dynamic)


def test_pack_weight_rounds_bfloat16_once() -> None:
    w = torch.randn(32, 8)
    g = torch.rand(8) + 0.5
    p = cpu_kernels.pack_weight(w, in_scale=g, dtype=torch.bfloat16)
    assert p.dtype == torch.bfloat16
    assert torch.equal(p[0, :, 3], (w[3] * g).to(torch.bfloat16))
    assert torch.equal(p[1, :, 0], (w[16] * g).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"dtype torch\.float16 is not one of float32, bfloat16"):
        cpu_kernels.pack_weight(w, dtype=torch.float16)


def test_kernels_that_compute_wrong_are_never_used(kernels, monkeypatch) -> None:
    """The load-time check against float64 (run on every CPU before the race): a build whose
    products or attention are off by more than float32 rounding is refused, even when forced
    with GRIDRL_CPU_KERNELS=1, and says what differed."""
    assert cpu_kernels.verify(kernels) is None
    real = cpu_kernels.DecodeKernels.linear

    def off_by_a_little(self, x, packed, n, **kw):
        out = real(self, x, packed, n, **kw)
        out[0, -1] += 1e-3 * out.abs().max()
        return out

    monkeypatch.setattr(cpu_kernels.DecodeKernels, "linear", off_by_a_little)
    assert "linear 1x72->40 float32 weights, static: relative error" in cpu_kernels.verify(kernels)
    monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")
    try:
        cpu_kernels.clear_cache()
        assert cpu_kernels.load() is None
        assert cpu_kernels.unavailable_reason().startswith("wrong results on this CPU: linear")
        monkeypatch.setattr(cpu_kernels.DecodeKernels, "linear", real)
        real_attention = cpu_kernels.DecodeKernels.attention
        monkeypatch.setattr(cpu_kernels.DecodeKernels, "attention",
                            lambda self, *a: real_attention(self, *a) * (1 + 1e-4))
        assert "attention D=64" in cpu_kernels.verify(kernels)
    finally:
        cpu_kernels.clear_cache()


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
        cpu_kernels.clear_cache()
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "0")
        assert cpu_kernels.load() is None
        assert "GRIDRL_CPU_KERNELS=0" in cpu_kernels.unavailable_reason()

        cpu_kernels.clear_cache()
        monkeypatch.delenv("GRIDRL_CPU_KERNELS")
        monkeypatch.setenv("CC", "false")  # a "compiler" that fails
        assert cpu_kernels.load() is None
        assert "build failed" in cpu_kernels.unavailable_reason()
        assert not list(tmp_path.glob("kernels/*"))  # no half-written library left behind

        cpu_kernels.clear_cache()
        monkeypatch.delenv("CC")
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")  # built, whichever path is faster here
        assert cpu_kernels.load() is not None  # builds into the new cache directory
        assert cpu_kernels.unavailable_reason() is None
        assert len(list(tmp_path.glob("kernels/decode-*.so"))) == 1
    finally:
        cpu_kernels.clear_cache()


def test_lean_forward_without_kernels_names_the_reason(monkeypatch) -> None:
    from test_torch_llama import _tiny

    from gridrl.engine.backends.torch.llama import LeanLlama

    try:
        cpu_kernels.clear_cache()
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "0")
        lean = LeanLlama(_tiny())
        assert lean.products.endswith("(fused C kernels unavailable: disabled by "
                                      "GRIDRL_CPU_KERNELS=0)")
        assert {layer.down.kind for layer in lean.layers} != {"kernel"}
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")
        assert LeanLlama(_tiny()).products == "fused C kernel"
    finally:
        cpu_kernels.clear_cache()


def test_by_default_the_kernels_run_only_where_they_beat_onednn(monkeypatch) -> None:
    """Unset (or "auto"), the kernels race oneDNN once per process and run unless their
    products are more than KERNEL_HANDICAP (1.25) times slower (they also fuse the work around
    the products, which the race does not time); "1" skips the race."""
    from test_torch_llama import _tiny

    from gridrl.engine.backends.torch.llama import LeanLlama

    monkeypatch.delenv("GRIDRL_CPU_KERNELS", raising=False)
    try:
        cpu_kernels.clear_cache()
        monkeypatch.setattr(cpu_kernels, "race", lambda kernels, **kw: (0.004, 0.001))
        assert cpu_kernels.load() is None
        lean = LeanLlama(_tiny())
        assert lean.products == (
            "oneDNN prepacked (fused C kernels unavailable: slower than oneDNN here: 4.00 ms "
            "against oneDNN's 1.00 ms on this CPU's decode-shaped products; "
            "GRIDRL_CPU_KERNELS=1 forces them)")
        assert {layer.down.kind for layer in lean.layers} == {"onednn"}

        cpu_kernels.clear_cache()
        monkeypatch.setattr(cpu_kernels, "race", lambda kernels, **kw: (0.001, 0.004))
        assert cpu_kernels.load() is not None and cpu_kernels.unavailable_reason() is None
        assert LeanLlama(_tiny()).products == "fused C kernel"
        assert cpu_kernels.KERNEL_HANDICAP == 1.25
        for kernel_s, chosen in ((0.00124, True), (0.00126, False)):  # against 1 ms
            cpu_kernels.clear_cache()
            monkeypatch.setattr(cpu_kernels, "race", lambda kernels, s=kernel_s, **kw: (s, 0.001))
            assert (cpu_kernels.load() is not None) == chosen, kernel_s

        cpu_kernels.clear_cache()
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")
        monkeypatch.setattr(cpu_kernels, "race", None)  # not called
        assert cpu_kernels.load() is not None

        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "yes")
        assert cpu_kernels.load() is None
        assert cpu_kernels.unavailable_reason() == (
            "GRIDRL_CPU_KERNELS='yes' is not one of auto, 1, 0")
    finally:
        cpu_kernels.clear_cache()


def test_the_race_times_both_paths(kernels) -> None:
    kernel_s, onednn_s = cpu_kernels.race(kernels, repeats=1)
    assert 0 < kernel_s < 10 and 0 < onednn_s < 10


@pytest.mark.parametrize("d,column", [(64, 0), (64, 37), (24, 11)])
def test_decode_attention_matches_float64(kernels, d: int, column: int) -> None:
    """Rotary, cache write and GQA attention with a padding mask; D = 24 takes the
    non-vector path."""
    torch.manual_seed(d + column)
    b, hq, hkv, width = 5, 9, 3, 48
    qkv = torch.randn(b, (hq + 2 * hkv) * d)
    angles = torch.rand(b, d // 2) * 6
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    keys, values = torch.randn(b, hkv, width, d), torch.randn(b, hkv, width, d)
    mask = torch.zeros(b, 1, 1, width)
    mask[1, ..., :3] = torch.finfo(torch.float32).min  # row 1 is left-padded by 3
    want, rotated_k = cpu_kernels.attention_reference(qkv, hq, hkv, cos, sin, keys, values, column,
                                           mask, 0.125)
    got = kernels.attention(qkv, hq, hkv, cos, sin, keys, values, column,
                            mask[..., :column + 1], 0.125)
    assert (got.double() - want).abs().max() < 1e-5
    assert torch.allclose(keys[:, :, column].double(), rotated_k, atol=1e-6)  # written
    assert torch.equal(values[:, :, column], qkv.view(b, hq + 2 * hkv, d)[:, hq + hkv:])


def test_decode_attention_refusals_name_the_argument(kernels) -> None:
    b, hq, hkv, d = 2, 4, 2, 16
    qkv, cs = torch.randn(b, (hq + 2 * hkv) * d), torch.randn(b, d // 2)
    keys = torch.zeros(b, hkv, 8, d)
    with pytest.raises(ValueError, match="keys must be contiguous float32 on CPU"):
        kernels.attention(qkv, hq, hkv, cs, cs, keys.transpose(2, 3), keys, 0, None, 1.0)
    with pytest.raises(ValueError, match=r"attention shapes do not fit.*column 8"):
        kernels.attention(qkv, hq, hkv, cs, cs, keys, keys.clone(), 8, None, 1.0)
    with pytest.raises(ValueError, match="attention shapes do not fit"):
        kernels.attention(qkv, hq, hkv, cs[:1], cs, keys, keys.clone(), 0, None, 1.0)
    with pytest.raises(ValueError, match=r"mask \[2, 1, 1, 3\] does not fit 2 rows x 5"):
        kernels.attention(qkv, hq, hkv, cs, cs, keys, keys.clone(), 4, torch.zeros(b, 1, 1, 3),
                          1.0)
    with pytest.raises(ValueError, match="refused its arguments"):  # Hq not a multiple of Hkv
        kernels.attention(torch.randn(b, (3 + 2 * hkv) * d), 3, hkv, cs, cs, keys,
                          keys.clone(), 0, None, 1.0)
