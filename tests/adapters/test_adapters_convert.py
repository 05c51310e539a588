"""peft <-> mlx-lm conversion: layouts, scale, layers, dtypes, and bitwise round trips."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from adapters_testlib import ALL_LINEAR, make_mlx_adapter, make_peft_adapter
from safetensors.numpy import load as np_load
from safetensors.numpy import save as np_save

from gridrl.adapters import (
    AdapterError,
    convert_dir,
    convert_files,
    detect_format,
    read_dir,
)
from gridrl.adapters import tensors as st
from gridrl.adapters.peft_format import alpha_for_scale

P = "base_model.model."
PEFT_CASES = {
    "plain": ({}, None),
    "rslora_all_linear": ({"r": 8, "lora_alpha": 16, "use_rslora": True,
                           "target_modules": ALL_LINEAR, "lora_dropout": 0.05}, None),
    "dora": ({"use_dora": True, "target_modules": ["q_proj", "o_proj", "down_proj"]}, None),
    "last_block": ({"layers_to_transform": [1], "target_modules": ["k_proj", "up_proj"]}, 2),
    "bfloat16": ({"target_modules": ["v_proj", "gate_proj"], "dtype": "bfloat16"}, None),
}


@pytest.fixture(scope="module")
def peft_dirs(tiny_llama_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {name: make_peft_adapter(tiny_llama_dir, root / name, seed=i, **kw)
            for i, (name, (kw, _)) in enumerate(PEFT_CASES.items())}


def _u(t: st.Tensor) -> np.ndarray:
    return np.frombuffer(t.data, f"<u{t.itemsize}").reshape(t.shape)


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_to_mlx_layout_and_back_bitwise(case: str, peft_dirs: dict[str, Path],
                                             tmp_path: Path) -> None:
    _, num_layers = PEFT_CASES[case]
    files = read_dir(peft_dirs[case])
    assert detect_format(files) == "peft"
    cfg = json.loads(files["adapter_config.json"])
    mlx_files = convert_files(files, "mlx", num_layers=num_layers)
    assert detect_format(mlx_files) == "mlx"
    assert mlx_files["README.md"] == files["README.md"]  # other files travel unchanged

    # Layout: lora_a = lora_A.T, lora_b = lora_B.T, m = magnitude, bit for bit, same dtype.
    src = st.load(files["adapter_model.safetensors"]).tensors
    dst = st.load(mlx_files["adapters.safetensors"]).tensors
    assert len(dst) == len(src)
    for name, t in src.items():
        path = name.removeprefix(P)
        if name.endswith("lora_A.weight"):
            out = dst[path.replace(".lora_A.weight", ".lora_a")]
            assert out.dtype == t.dtype and out.shape == t.shape[::-1]
            np.testing.assert_array_equal(_u(out), _u(t).T)
        elif name.endswith("lora_B.weight"):
            out = dst[path.replace(".lora_B.weight", ".lora_b")]
            np.testing.assert_array_equal(_u(out), _u(t).T)
        else:
            assert name.endswith(".lora_magnitude_vector")
            assert dst[path.replace(".lora_magnitude_vector", ".m")] == t

    # Config: scale = alpha / r (or / sqrt(r)), keys inside a block, the last N blocks.
    mcfg = json.loads(mlx_files["adapter_config.json"])
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg["use_rslora"] else alpha / r
    assert mcfg["lora_parameters"]["scale"] == scale
    assert mcfg["lora_parameters"]["rank"] == r
    assert mcfg["lora_parameters"]["dropout"] == cfg["lora_dropout"]
    prefix = {"q_proj": "self_attn.", "k_proj": "self_attn.", "v_proj": "self_attn.",
              "o_proj": "self_attn."}
    assert mcfg["lora_parameters"]["keys"] == sorted(
        prefix.get(m, "mlp.") + m for m in cfg["target_modules"])
    assert mcfg["num_layers"] == (1 if case == "last_block" else 2)
    assert mcfg["fine_tune_type"] == ("dora" if cfg["use_dora"] else "lora")
    assert mcfg["model"] == cfg["base_model_name_or_path"]

    # Back: the very bytes, configs included; also through directories.
    assert convert_files(mlx_files, "peft") == files
    convert_dir(peft_dirs[case], tmp_path / "mlx", num_layers=num_layers)
    assert read_dir(tmp_path / "mlx") == mlx_files
    convert_dir(tmp_path / "mlx", tmp_path / "peft")
    assert read_dir(tmp_path / "peft") == files


def _synthetic_mlx(num_layers_cfg: int, blocks: list[int], keys: list[str], rank: int = 2,
                   scale: float = 0.3, dtype=np.float16) -> dict[str, bytes]:
    """An mlx-lm adapter written without mlx (safetensors.numpy, metadata as mlx-lm leaves it)."""
    rng = np.random.default_rng(7)
    weights = {}
    for b in blocks:
        for k in keys:
            out_dim = 32 if k.endswith(("k_proj", "v_proj")) else 64
            weights[f"model.layers.{b}.{k}.lora_a"] = rng.normal(size=(64, rank)).astype(dtype)
            weights[f"model.layers.{b}.{k}.lora_b"] = rng.normal(size=(rank, out_dim)).astype(dtype)
    cfg = {"fine_tune_type": "lora", "num_layers": num_layers_cfg, "model": "some/hub-model",
           "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys},
           "iters": 10, "learning_rate": 1e-5}
    return {"adapter_config.json": json.dumps(cfg, indent=4).encode(),
            "adapters.safetensors": np_save(weights)}


def test_mlx_to_peft_layout_and_back_bitwise() -> None:
    keys = ["mlp.down_proj", "self_attn.q_proj"]
    files = _synthetic_mlx(2, [28, 29], keys)  # the last 2 blocks of a 30-block model
    peft_files = convert_files(files, "peft")
    cfg = json.loads(peft_files["adapter_config.json"])
    assert cfg["r"] == 2 and cfg["lora_alpha"] / cfg["r"] == 0.3 and not cfg["use_rslora"]
    assert cfg["target_modules"] == keys and cfg["layers_to_transform"] == [28, 29]
    assert cfg["base_model_name_or_path"] == "some/hub-model" and cfg["peft_type"] == "LORA"
    src = np_load(files["adapters.safetensors"])
    dst = np_load(peft_files["adapter_model.safetensors"])
    assert len(dst) == len(src)
    for name, a in src.items():
        path = name.rsplit(".", 1)[0]
        leaf = "lora_A.weight" if name.endswith("lora_a") else "lora_B.weight"
        np.testing.assert_array_equal(dst[f"{P}{path}.{leaf}"], a.T)
        assert dst[f"{P}{path}.{leaf}"].dtype == np.float16
    assert convert_files(peft_files, "mlx") == files
    # Without the recorded source, the conversion is fresh and needs the block count.
    parsed = st.load(peft_files["adapter_model.safetensors"])
    assert parsed.metadata is not None and parsed.metadata["format"] == "pt"
    bare = {**peft_files, "adapter_model.safetensors": st.dump(parsed.tensors, {"format": "pt"})}
    with pytest.raises(AdapterError, match="base model's number of blocks is needed"):
        convert_files(bare, "mlx")
    fresh = convert_files(bare, "mlx", num_layers=30)
    fcfg = json.loads(fresh["adapter_config.json"])
    assert (fcfg["num_layers"], fcfg["lora_parameters"]["keys"]) == (2, keys)
    assert fcfg["lora_parameters"]["scale"] == 0.3
    assert st.load(fresh["adapters.safetensors"]).tensors == st.load(
        files["adapters.safetensors"]).tensors


@pytest.mark.mlx
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_mlx_lm_written_adapter_round_trips_bitwise(dora: bool, tiny_llama_dir: Path,
                                                    tmp_path: Path) -> None:
    src = make_mlx_adapter(tiny_llama_dir, tmp_path / "mlx", num_layers=1,
                           keys=["self_attn.v_proj", "mlp.up_proj"], dora=dora)
    files = read_dir(src)
    assert st.detect_writer(files["adapters.safetensors"],
                            st.load(files["adapters.safetensors"]))["writer"] == "mlx"
    peft_files = convert_files(files, "peft")
    cfg = json.loads(peft_files["adapter_config.json"])
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_dora"]) == (4, 12, dora)
    assert cfg["layers_to_transform"] == [1]
    assert cfg["target_modules"] == ["mlp.up_proj", "self_attn.v_proj"]
    assert convert_files(peft_files, "mlx") == files
    convert_dir(src, tmp_path / "peft")
    convert_dir(tmp_path / "peft", tmp_path / "mlx2")
    assert read_dir(tmp_path / "mlx2") == files


def test_same_format_is_unchanged_and_dtype_casts(peft_dirs: dict[str, Path]) -> None:
    files = read_dir(peft_dirs["plain"])
    assert convert_files(files, "peft") == files
    cast = convert_files(files, "peft", dtype="bfloat16")
    assert cast["adapter_config.json"] == files["adapter_config.json"]
    before = st.load(files["adapter_model.safetensors"])
    after = st.load(cast["adapter_model.safetensors"])
    assert after.metadata == before.metadata
    assert {k: st.cast(t, "BF16") for k, t in before.tensors.items()} == after.tensors
    mlx_bf16 = st.load(convert_files(files, "mlx", dtype="bfloat16")["adapters.safetensors"])
    assert {t.dtype for t in mlx_bf16.tensors.values()} == {"BF16"}
    name = "model.layers.0.self_attn.q_proj"
    assert mlx_bf16.tensors[f"{name}.lora_a"] == st.transpose(
        st.cast(before.tensors[f"{P}{name}.lora_A.weight"], "BF16"))
    with pytest.raises(AdapterError, match="dtype 'int8' is not one of"):
        convert_files(files, "mlx", dtype="int8")


def test_num_layers_is_asked_for_when_needed(peft_dirs: dict[str, Path]) -> None:
    files = read_dir(peft_dirs["last_block"])
    with pytest.raises(AdapterError, match="base model's number of blocks is needed"):
        convert_files(files, "mlx")
    with pytest.raises(AdapterError, match=r"block 1 is out of range .* num_layers=1"):
        convert_files(files, "mlx", num_layers=1)
    plain = read_dir(peft_dirs["plain"])  # every block: the count is implied, and checked
    with pytest.raises(AdapterError, match="num_layers=3 does not match"):
        convert_files(plain, "mlx", num_layers=3)
    assert convert_files(plain, "mlx", num_layers=2) == convert_files(plain, "mlx")


def test_edited_config_is_not_replaced_by_the_recorded_one(peft_dirs: dict[str, Path]) -> None:
    files = read_dir(peft_dirs["rslora_all_linear"])
    mlx_files = convert_files(files, "mlx")
    cfg = json.loads(mlx_files["adapter_config.json"])
    cfg["lora_parameters"]["scale"] = 0.75
    edited = {**mlx_files, "adapter_config.json": json.dumps(cfg).encode()}
    back = convert_files(edited, "peft")
    pcfg = json.loads(back["adapter_config.json"])
    assert back["adapter_config.json"] != files["adapter_config.json"]
    assert pcfg["lora_alpha"] / pcfg["r"] == 0.75 and pcfg["use_rslora"] is False
    before = st.load(files["adapter_model.safetensors"]).tensors
    assert st.load(back["adapter_model.safetensors"]).tensors == before


def test_alpha_for_scale_is_exact() -> None:
    # Exact in float32, the precision torch and mlx multiply by the scale in; exact in float64
    # whenever some float64 alpha divides back to the scale (not always possible: r * ulp(s)
    # can be smaller than ulp(r * s)).
    rng = np.random.default_rng(0)
    exact64 = 0
    for _ in range(2000):
        r = int(rng.integers(1, 257))
        scale = float(rng.choice([rng.uniform(1e-3, 64), round(rng.uniform(0, 8), 2)]))
        alpha = alpha_for_scale(scale, r)
        assert np.float32(alpha / r) == np.float32(scale), (scale, r, alpha)
        assert abs(alpha / r - scale) <= math.ulp(scale), (scale, r, alpha)
        exact64 += alpha / r == scale
    assert exact64 > 1700
    for scale, r in ((2.0, 8), (20.0, 16), (0.5, 64), (1.0, 3), (0.25, 12)):
        alpha = alpha_for_scale(scale, r)
        assert isinstance(alpha, int) and alpha / r == scale


def test_detect_format_errors() -> None:
    with pytest.raises(AdapterError, match=r"not a peft or mlx-lm adapter.*\['x.json'\]"):
        detect_format(["x.json"])
    with pytest.raises(AdapterError, match="ambiguous"):
        detect_format(["adapters.safetensors", "adapter_model.safetensors"])
    with pytest.raises(AdapterError, match="pickled"):
        detect_format(["adapter_config.json", "adapter_model.bin"])


def test_peft_names_without_the_peft_model_prefix(peft_dirs: dict[str, Path]) -> None:
    # transformers' own PEFT integration saves "model.layers..." without "base_model.model.".
    files = read_dir(peft_dirs["dora"])
    parsed = st.load(files["adapter_model.safetensors"])
    bare = {k.removeprefix(P): t for k, t in parsed.tensors.items()}
    bare_files = {**files, "adapter_model.safetensors": st.dump(bare, parsed.metadata)}
    mlx_files = convert_files(bare_files, "mlx")
    assert st.load(mlx_files["adapters.safetensors"]).tensors == st.load(
        convert_files(files, "mlx")["adapters.safetensors"]).tensors
    assert convert_files(mlx_files, "peft") == bare_files
