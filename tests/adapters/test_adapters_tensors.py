"""The safetensors codec reproduces the real writers byte for byte and transposes/casts exactly."""

from __future__ import annotations

import numpy as np
import pytest

from gridrl.adapters import tensors as st
from gridrl.adapters.errors import AdapterError


def _torch_tensors():
    import torch

    g = torch.Generator().manual_seed(0)
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn,
              torch.int16, torch.uint16, torch.float16, torch.bfloat16, torch.int32,
              torch.uint32, torch.float32, torch.float64, torch.int64, torch.uint64]
    out = {}
    for i, dt in enumerate(dtypes):
        x = torch.randn(3, 2, generator=g) * 10
        out[f"t{i:02d}.{str(dt).split('.')[-1]}"] = x.to(dt)
    out["a.bf16"] = torch.randn(5, generator=g).to(torch.bfloat16)
    return out


def test_rust_writer_is_reproduced_for_every_dtype() -> None:
    from safetensors.torch import save

    tensors = _torch_tensors()
    for metadata in (None, {"format": "pt"}):
        data = save(tensors, metadata=metadata)
        parsed = st.load(data)
        assert parsed.metadata == metadata
        assert st.dump(parsed.tensors, parsed.metadata) == data
        assert st.detect_writer(data, parsed) == {"writer": "safetensors"}
        for name, t in tensors.items():
            assert parsed.tensors[name].data == t.contiguous().view(-1).view(
                __import__("torch").uint8).numpy().tobytes()


def test_numpy_writer_and_errors() -> None:
    from safetensors.numpy import save

    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "h": np.ones(4, np.float16)}
    data = save(arrays)
    parsed = st.load(data, "x.safetensors")
    assert parsed.tensors["w"] == st.Tensor("F32", (2, 3), arrays["w"].tobytes())
    assert st.dump(parsed.tensors) == data
    with pytest.raises(AdapterError, match=r"x\.safetensors: .* too short"):
        st.load(b"abc", "x.safetensors")
    with pytest.raises(AdapterError, match="header length"):
        st.load(data[:20], "x.safetensors")
    with pytest.raises(AdapterError, match="not a permutation"):
        st.dump(parsed.tensors, order=["w"])


@pytest.mark.mlx
def test_mlx_writer_is_reproduced(tmp_path) -> None:
    import mlx.core as mx

    weights = {f"model.layers.{i}.self_attn.q_proj.lora_a": mx.random.normal((8, 2))
               for i in range(6)}
    weights["x.m"] = mx.ones((3,), dtype=mx.bfloat16)
    for metadata in (None, {"format": "mlx", "k": "v"}):
        path = tmp_path / "a.safetensors"
        if metadata is None:
            mx.save_safetensors(str(path), weights)
        else:
            mx.save_safetensors(str(path), weights, metadata=metadata)
        data = path.read_bytes()
        parsed = st.load(data)
        layout = st.detect_writer(data, parsed)
        assert layout is not None and layout["writer"] == "mlx"
        assert st.dump_like(parsed.tensors, parsed.metadata, layout) == data
        loaded = mx.load(str(path))
        np.testing.assert_array_equal(
            np.frombuffer(parsed.tensors["model.layers.3.self_attn.q_proj.lora_a"].data,
                          "<f4").reshape(8, 2),
            np.array(loaded["model.layers.3.self_attn.q_proj.lora_a"]))


def test_transpose_is_bitwise_for_every_width() -> None:
    rng = np.random.default_rng(0)
    for dtype, width in (("F32", "<u4"), ("BF16", "<u2"), ("F64", "<u8"), ("U8", "u1")):
        raw = rng.integers(0, 255, size=(3, 5, np.dtype(width).itemsize), dtype=np.uint8)
        t = st.Tensor(dtype, (3, 5), raw.tobytes())
        tt = st.transpose(t)
        assert tt.shape == (5, 3)
        ref = np.frombuffer(t.data, width).reshape(3, 5).T
        assert tt.data == np.ascontiguousarray(ref).tobytes()
        assert st.transpose(tt) == t
    with pytest.raises(AdapterError, match="3-D"):
        st.transpose(st.Tensor("F32", (1, 1, 1), b"\0" * 4))


def test_cast_matches_torch() -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 7, generator=g) * torch.logspace(-8, 8, 7)
    x[0, 0], x[0, 1], x[0, 2] = float("nan"), float("inf"), -0.0
    src = st.Tensor("F32", tuple(x.shape), x.numpy().tobytes())
    finite = ~torch.isnan(x).numpy().reshape(-1)
    for code, dt in (("BF16", torch.bfloat16), ("F16", torch.float16), ("F64", torch.float64)):
        ours = st.cast(src, code)
        width = f"<u{ours.itemsize}"
        ref = x.to(dt).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        # Bit for bit, except the payload of NaN, which torch's kernels do not fix.
        mine, theirs = np.frombuffer(ours.data, width), np.frombuffer(ref, width)
        np.testing.assert_array_equal(mine[finite], theirs[finite], err_msg=code)
        back = st.to_float64(ours).reshape(-1)
        assert np.isnan(back[~finite]).all()
        np.testing.assert_array_equal(back[finite],
                                      x.to(dt).double().numpy().reshape(-1)[finite])
    with pytest.raises(AdapterError, match="cannot decode dtype I32"):
        st.cast(st.Tensor("I32", (1,), b"\0" * 4), "F32")
