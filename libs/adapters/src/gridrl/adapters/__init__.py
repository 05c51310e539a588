"""Exact LoRA adapter conversion between peft and mlx-lm, and the adapter manifest.

numpy + safetensors-format only: importing this package imports neither torch nor mlx.

    files = read_dir("runs/a/adapter")                       # {"adapter_config.json": b"...", ...}
    mlx_files = convert_files(files, "mlx", num_layers=30)    # peft -> mlx-lm, in memory
    manifest = build_manifest(mlx_files, name="run-a", version=3)
    verify_files(manifest, mlx_files); check_fits(mlx_files, {"hidden_size": 576, ...})
    merge_dir("models/base", "runs/a/adapter", "models/merged")  # W' = W + scale * B @ A
"""

from gridrl.adapters.adapter import LoraAdapter, LoraModule
from gridrl.adapters.convert import (
    PROVENANCE_KEY,
    convert_dir,
    convert_files,
    detect_format,
    read_adapter,
)
from gridrl.adapters.errors import AdapterError
from gridrl.adapters.io import check_relpath, read_dir, write_dir
from gridrl.adapters.manifest import (
    AdapterFile,
    AdapterManifest,
    build_manifest,
    check_fits,
    verify_files,
)
from gridrl.adapters.merge import MergeResult, check_mergeable, merge_dir

__version__ = "0.1.0"

__all__ = [
    "PROVENANCE_KEY",
    "AdapterError",
    "AdapterFile",
    "AdapterManifest",
    "LoraAdapter",
    "LoraModule",
    "MergeResult",
    "build_manifest",
    "check_fits",
    "check_mergeable",
    "check_relpath",
    "convert_dir",
    "convert_files",
    "detect_format",
    "merge_dir",
    "read_adapter",
    "read_dir",
    "verify_files",
    "write_dir",
]
