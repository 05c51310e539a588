"""gridrl-adapters convert / inspect, and the import contract (no torch, no mlx)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from adapters_testlib import make_peft_adapter
from click.testing import CliRunner

from gridrl.adapters import build_manifest, read_dir
from gridrl.adapters.cli import main


@pytest.fixture(scope="module")
def peft_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("cli") / "peft",
                             layers_to_transform=[1])


def test_convert_and_inspect(peft_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    mlx_dir, back = tmp_path / "mlx", tmp_path / "back"
    res = runner.invoke(main, ["convert", str(peft_dir), str(mlx_dir), "--num-layers", "2"])
    assert res.exit_code == 0, res.output
    assert f"{peft_dir} (peft) -> {mlx_dir} (mlx)" in res.output
    res = runner.invoke(main, ["convert", str(peft_dir), str(mlx_dir)])
    assert res.exit_code == 1 and "exists; pass --force" in res.output
    res = runner.invoke(main, ["convert", str(mlx_dir), str(back)])  # default --to: the other
    assert res.exit_code == 0, res.output
    assert read_dir(back) == read_dir(peft_dir)

    res = runner.invoke(main, ["inspect", str(mlx_dir), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == build_manifest(mlx_dir).to_dict()
    res = runner.invoke(main, ["inspect", str(mlx_dir)])
    lines = res.output.splitlines()
    assert "format          mlx" in lines and "layers          1" in lines
    assert "target_modules  self_attn.q_proj, self_attn.v_proj" in lines
    assert any(line.endswith("  adapters.safetensors") for line in lines)


def test_flags_from_environment_and_errors(peft_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["convert", str(peft_dir), str(tmp_path / "x")],
                        env={"GRIDRL_ADAPTERS_NUM_LAYERS": "4"})
    assert res.exit_code == 1
    assert "Error: cannot convert to mlx: the adapter adapts blocks [1] of 4" in res.output
    assert not (tmp_path / "x").exists()
    res = runner.invoke(main, ["convert", str(peft_dir), str(tmp_path / "y"), "--to", "peft"],
                        env={"GRIDRL_ADAPTERS_DTYPE": "bfloat16"})
    assert res.exit_code == 0, res.output
    assert b'"BF16"' in (tmp_path / "y" / "adapter_model.safetensors").read_bytes()[:2000]
    res = runner.invoke(main, ["inspect", str(tmp_path)])
    assert res.exit_code == 1 and "Error: not a peft or mlx-lm adapter" in res.output
    assert "GRIDRL_ADAPTERS_TO" in runner.invoke(main, ["convert", "--help"]).output


def test_import_pulls_neither_torch_nor_mlx() -> None:
    code = ("import sys, gridrl.adapters, gridrl.adapters.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'mlx', 'mlx_lm', 'transformers', 'peft')); print(bad); "
            "sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exe = Path(sys.executable).parent / "gridrl-adapters"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    assert "convert" in out.stdout and "inspect" in out.stdout


def test_convert_only_adapter_leaves_checkpoint_state_behind(peft_dir: Path,
                                                            tmp_path: Path) -> None:
    """A gridrl checkpoint directory holds the peft files next to the trainer's state."""
    ckpt = tmp_path / "step-000010"
    ckpt.mkdir()
    for name, data in read_dir(peft_dir).items():
        (ckpt / name).write_bytes(data)
    for name in ("optimizer.pt", "rng.pt", "state.json", "config.json"):
        (ckpt / name).write_bytes(b"trainer state")
    runner = CliRunner()
    res = runner.invoke(main, ["convert", str(ckpt), str(tmp_path / "mlx"), "--to", "mlx",
                               "--num-layers", "2", "--only-adapter"])
    assert res.exit_code == 0, res.output
    assert sorted(read_dir(tmp_path / "mlx")) == ["adapter_config.json", "adapters.safetensors"]
    res = runner.invoke(main, ["convert", str(ckpt), str(tmp_path / "all"), "--to", "mlx",
                               "--num-layers", "2"])
    assert res.exit_code == 0, res.output
    assert "optimizer.pt" in read_dir(tmp_path / "all")  # by default other files travel along
