"""Manifest: contents, dict/proto schema, verification, base-model fit; directory I/O."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from adapters_testlib import make_peft_adapter

from gridrl.adapters import (
    AdapterError,
    AdapterManifest,
    build_manifest,
    check_fits,
    check_relpath,
    convert_files,
    read_dir,
    verify_files,
    write_dir,
)


@pytest.fixture(scope="module")
def peft_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("m") / "a", r=8,
                             lora_alpha=16, use_rslora=True,
                             target_modules=["q_proj", "down_proj"], layers_to_transform=[1])


def test_manifest_fields(peft_dir: Path, tiny_llama_dir: Path) -> None:
    files = read_dir(peft_dir)
    m = build_manifest(files, name="run-a", version=3)
    assert (m.name, m.version, m.format, m.rank) == ("run-a", 3, "peft", 8)
    assert m.scale == 16 / 8 ** 0.5
    assert m.target_modules == ["mlp.down_proj", "self_attn.q_proj"]
    assert m.layers == [1]
    # base_model_name_or_path is a local directory: its config.json tells the rest.
    assert m.base_model.to_dict() == {"model_id": str(tiny_llama_dir), "architecture": "llama",
                                      "hidden_size": 64, "num_layers": 2, "vocab_size": 512,
                                      "weights_fingerprint": ""}
    assert [f.path for f in m.files] == sorted(files)
    for f in m.files:
        assert f.size_bytes == len(files[f.path])
        assert f.sha256 == hashlib.sha256(files[f.path]).hexdigest()
    assert build_manifest(peft_dir, name="run-a", version=3) == m

    # Converted to mlx, it describes the same adapter.
    mm = build_manifest(convert_files(files, "mlx", num_layers=2))
    assert (mm.format, mm.rank, mm.scale, mm.target_modules, mm.layers) == (
        "mlx", m.rank, m.scale, m.target_modules, m.layers)
    assert mm.base_model == m.base_model

    # Without a local config: what the tensors tell, given fields win, the rest stays zero.
    cfg = json.loads(files["adapter_config.json"])
    cfg["base_model_name_or_path"] = "org/not-local"
    hub = {**files, "adapter_config.json": json.dumps(cfg).encode()}
    assert build_manifest(hub).base_model.to_dict() == {
        "model_id": "org/not-local", "architecture": "", "hidden_size": 64, "num_layers": 0,
        "vocab_size": 0, "weights_fingerprint": ""}
    given = build_manifest(hub, base_model={"architecture": "llama", "vocab_size": 512})
    assert (given.base_model.architecture, given.base_model.vocab_size,
            given.base_model.hidden_size) == ("llama", 512, 64)
    # mlx-lm adapts the last N blocks, so the block count is known from an mlx adapter alone.
    assert build_manifest(convert_files(hub, "mlx", num_layers=2)).base_model.num_layers == 2


def test_dict_schema_and_protobuf(peft_dir: Path) -> None:
    m = build_manifest(peft_dir, name="run-a", version=7)
    d = m.to_dict()
    assert list(d) == ["name", "version", "format", "base_model", "rank", "scale",
                       "target_modules", "layers", "files"]
    assert list(d["base_model"]) == ["model_id", "architecture", "hidden_size", "num_layers",
                                     "vocab_size", "weights_fingerprint"]
    assert list(d["files"][0]) == ["path", "size_bytes", "sha256"]
    assert d["format"] == "peft" and AdapterManifest.from_dict(d) == m
    assert json.loads(json.dumps(d)) == d

    common_pb2 = pytest.importorskip("gridrl.v1.common_pb2")
    from google.protobuf import json_format

    msg = m.to_proto()
    assert msg.format == common_pb2.ADAPTER_FORMAT_PEFT
    assert (msg.version, msg.rank, list(msg.layers)) == (7, 8, [1])
    assert msg.files[0].sha256 == m.files[0].sha256
    assert AdapterManifest.from_proto(msg) == m
    for names in (True, False):
        back = json_format.MessageToDict(msg, preserving_proto_field_name=names)
        assert AdapterManifest.from_dict(back) == m
    with pytest.raises(AdapterError, match=r"manifest\.format: 'onnx' is not peft or mlx"):
        AdapterManifest.from_dict({**d, "format": "onnx"})
    # every JSON form of the format: the word, the enum's name and number (older files,
    # MessageToDict), and the unspecified value as ""
    forms = {"peft": "peft", "mlx": "mlx", "ADAPTER_FORMAT_PEFT": "peft",
             "ADAPTER_FORMAT_MLX": "mlx", 1: "peft", 2: "mlx", "ADAPTER_FORMAT_UNSPECIFIED": "",
             0: "", "": ""}
    for form, word in forms.items():
        assert AdapterManifest.from_dict({**d, "format": form}).format == word, form
    for bad in ("PEFT", "unspecified", "ADAPTER_FORMAT_ONNX", 7, [1]):
        with pytest.raises(AdapterError, match=r"^manifest\.format: .* is not peft or mlx"):
            AdapterManifest.from_dict({**d, "format": bad})


def test_verify_files(peft_dir: Path) -> None:
    files = read_dir(peft_dir)
    m = build_manifest(files)
    verify_files(m, files)
    with pytest.raises(AdapterError, match=r"^adapter_model\.safetensors: missing"):
        verify_files(m, {k: v for k, v in files.items() if k != "adapter_model.safetensors"})
    with pytest.raises(AdapterError, match=r"^extra\.bin: unexpected file"):
        verify_files(m, {**files, "extra.bin": b"x"})
    with pytest.raises(AdapterError, match=r"^adapter_config\.json: \d+ bytes, the manifest says"):
        verify_files(m, {**files, "adapter_config.json": files["adapter_config.json"] + b" "})
    flipped = bytearray(files["adapter_model.safetensors"])
    flipped[-1] ^= 1
    with pytest.raises(AdapterError, match=r"^adapter_model\.safetensors: sha256 [0-9a-f]{64} "
                       r"does not match the manifest's [0-9a-f]{64}"):
        verify_files(m, {**files, "adapter_model.safetensors": bytes(flipped)})


def test_check_fits(peft_dir: Path, tiny_llama_dir: Path) -> None:
    from gridrl.models import model_identity

    files = read_dir(peft_dir)
    me = model_identity(tiny_llama_dir)
    check_fits(files, me)  # a ModelIdentity is accepted as is
    check_fits(build_manifest(files), me.__dict__)
    smol = {"architecture": "llama", "hidden_size": 576, "num_layers": 30, "vocab_size": 49152}
    with pytest.raises(AdapterError, match=r"adapter does not fit the base model: hidden_size: "
                       r"adapter 64, base model 576; num_layers: adapter 2, base model 30; "
                       r"vocab_size: adapter 512, base model 49152"):
        check_fits(build_manifest(files), smol)
    with pytest.raises(AdapterError, match=r"architecture: adapter 'llama', base model 'qwen2'"):
        check_fits(build_manifest(files), {"architecture": "qwen2"})
    # From files, only the tensors speak: hidden size, and blocks beyond the base model.
    with pytest.raises(AdapterError, match=r"^adapter does not fit the base model: hidden_size: "
                       r"adapter 64, base model 576$"):
        check_fits(files, smol)
    with pytest.raises(AdapterError, match=r"layers: adapter adapts block 1, base model has 1 "
                       r"blocks"):
        check_fits(files, {"num_layers": 1})
    # another checkpoint of the same architecture: the weights' fingerprints differ
    theirs = build_manifest(files, base_model={**me.__dict__, "model_id": "other",
                                               "weights_fingerprint": "wfp1:" + "b" * 32})
    with pytest.raises(AdapterError, match=r"^adapter does not fit the base model: "
                       r"weights_fingerprint: adapter trained on 'wfp1:b{32}' \(other\), base "
                       r"model 'wfp1:[0-9a-f]{32}' \(.*\): another checkpoint of this "
                       r"architecture$"):
        check_fits(theirs, me)
    check_fits(theirs, {**me.__dict__, "weights_fingerprint": ""})  # unknown: not compared
    mlx_files = convert_files(files, "mlx", num_layers=2)
    with pytest.raises(AdapterError, match=r"num_layers: adapter 2, base model 4"):
        check_fits(mlx_files, {"hidden_size": 64, "num_layers": 4})


def test_read_write_dir(tmp_path: Path) -> None:
    files = {"adapter_config.json": b"{}", "sub/x.bin": b"\0\1"}
    out = write_dir(files, tmp_path / "a")
    assert read_dir(out) == files
    # the directory gets the permissions mkdir would give it (not mkdtemp's 0700)
    (tmp_path / "by-mkdir").mkdir()
    assert out.stat().st_mode == (tmp_path / "by-mkdir").stat().st_mode
    (tmp_path / "by-mkdir").rmdir()
    (out / ".hidden").write_bytes(b"skip")
    assert read_dir(out) == files
    write_dir({"only.json": b"1"}, out)  # replaces the directory as a whole
    assert read_dir(out) == {"only.json": b"1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporaries left
    for bad in ("../x", "/etc/x", "a//b", "a/./b", "", "a\\b"):
        with pytest.raises(AdapterError, match="must be relative"):
            check_relpath(bad)
        with pytest.raises(AdapterError, match="must be relative"):
            write_dir({bad: b"x"}, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    with pytest.raises(AdapterError, match="not a directory"):
        read_dir(tmp_path / "missing")
