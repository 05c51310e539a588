"""``gridrl-adapters``: convert adapters between peft and mlx-lm, inspect them, and fold one
into its base model.

    gridrl-adapters convert SRC DST [--to mlx|peft] [--num-layers N] [--dtype D] [--force]
                            [--only-adapter]
    gridrl-adapters inspect DIR [--json]
    gridrl-adapters merge --base MODEL_DIR|ALIAS --adapter ADAPTER_DIR --out OUT_DIR [--force]

Every flag also reads ``GRIDRL_ADAPTERS_<FLAG>``. Exit status 1 with ``Error: <reason>`` when
an adapter cannot be read or converted.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from gridrl.adapters.convert import convert_dir, detect_format
from gridrl.adapters.errors import AdapterError
from gridrl.adapters.manifest import AdapterManifest, build_manifest
from gridrl.adapters.merge import merge_dir


def _option(*decls: str, env: str, **kwargs):
    return click.option(*decls, envvar=f"GRIDRL_ADAPTERS_{env}", show_envvar=True, **kwargs)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Exact LoRA adapter conversion between peft and mlx-lm, adapter manifests, and merges."""


@main.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@_option("--to", "to", env="TO", type=click.Choice(["mlx", "peft"]), default=None,
         help="Target format (default: the other one).")
@_option("--num-layers", env="NUM_LAYERS", type=click.IntRange(min=1), default=None,
         help="Number of transformer blocks of the BASE model (peft -> mlx, when the adapter "
              "does not adapt every block; default: read from a local base model directory).")
@_option("--dtype", env="DTYPE", type=click.Choice(["float32", "float16", "bfloat16"]),
         default=None, help="Cast the tensors (default: keep each tensor's dtype).")
@_option("--force", env="FORCE", is_flag=True, default=False,
         help="Replace DST if it exists.")
@_option("--only-adapter", env="ONLY_ADAPTER", is_flag=True, default=False,
         help="Write only the adapter's config and weights, not SRC's other files (e.g. the "
              "optimizer state of a gridrl checkpoint directory).")
def convert(src: Path, dst: Path, to: str | None, num_layers: int | None, dtype: str | None,
            force: bool, only_adapter: bool) -> None:
    """Convert the adapter directory SRC into DST (written atomically). Other files of SRC
    (README.md...) are copied unchanged unless --only-adapter."""
    if dst.exists() and not force:
        raise click.ClickException(f"{dst} exists; pass --force to replace it")
    try:
        names = [p.name for p in src.iterdir()]
        fmt = detect_format(names)
        target = to or ("mlx" if fmt == "peft" else "peft")
        convert_dir(src, dst, target, num_layers, dtype=dtype,  # type: ignore[arg-type]
                    only_adapter=only_adapter)
    except AdapterError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"{src} ({fmt}) -> {dst} ({target})")


@main.command()
@_option("--base", env="BASE", required=True,
         help="The base model: a local Hugging Face directory with safetensors weights, or "
              "the alias of the bundled model (smollm2-135m-instruct), as --model takes it.")
@_option("--adapter", env="ADAPTER", required=True,
         type=click.Path(exists=True, file_okay=False, path_type=Path),
         help="The LoRA adapter directory, peft or mlx-lm layout (e.g. RUN_DIR/adapter).")
@_option("--out", env="OUT", required=True, type=click.Path(path_type=Path),
         help="The merged model directory to write.")
@_option("--force", env="FORCE", is_flag=True, default=False,
         help="Replace OUT if it exists.")
def merge(base: str, adapter: Path, out: Path, force: bool) -> None:
    """Write OUT: the base model with the adapter folded into its weights
    (W' = W + scale * B @ A), loadable by transformers, vLLM, TGI or mlx-lm without peft.

    The fold is computed in float32 and rounded once to each weight's stored dtype; config,
    tokenizer and generation files are copied. DoRA and other adapters that are not a pure
    LoRA product are refused."""
    if out.exists() and not force:
        raise click.ClickException(f"{out} exists; pass --force to replace it")
    base_dir = _local_model(base)
    try:
        result = merge_dir(base_dir, adapter, out)
    except AdapterError as e:
        raise click.ClickException(str(e)) from e
    dtypes = ", ".join(result.dtypes)
    click.echo(f"{adapter} ({result.adapter_format}) + {base_dir} -> {out}: folded "
               f"{len(result.modules)} LoRA modules into {len(result.weight_files)} weight "
               f"file(s), computed in {result.compute_dtype}, stored as {dtypes}")
    if result.skipped:
        click.echo(f"left out (unmerged weights in other files): {', '.join(result.skipped)}")


def _local_model(base: str) -> Path:
    """``--base`` as a local directory: an alias resolves as ``--model`` does (converted once
    into the gridrl cache); a hub id is its copy in the local Hugging Face cache, or refused
    (the merge reads local safetensors; nothing is downloaded).

    Raises:
        click.BadParameter: naming ``--base``: not an alias, an existing directory or a hub id
            with a local copy.
    """
    from gridrl.models import ALIASES, ModelNameError, hub, resolve_model

    is_dir = Path(base).expanduser().is_dir()
    if base not in ALIASES and not is_dir and base.count("/") == 1 and all(base.split("/")) \
            and not base.startswith((".", "~")):
        cached = hub.local_copy(base)
        if cached is not None:
            return cached
        raise click.BadParameter(
            f"{base!r} is not a local directory: download it first (e.g. `hf download "
            f"{base} --local-dir DIR`), or use an alias ({', '.join(sorted(ALIASES))})",
            param_hint="'--base'")
    try:
        return Path(resolve_model(base, progress=False))
    except ModelNameError as e:
        raise click.BadParameter(e.problem, param_hint="'--base'") from e
    except FileNotFoundError as e:
        raise click.BadParameter(str(e), param_hint="'--base'") from e


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@_option("--json", "as_json", env="JSON", is_flag=True, default=False,
         help="Print the manifest as JSON (the gridrl.v1.AdapterManifest fields).")
def inspect(directory: Path, as_json: bool) -> None:
    """Print the manifest of the adapter in DIRECTORY."""
    try:
        manifest = build_manifest(directory)
    except AdapterError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
    else:
        click.echo(format_table(manifest))


def format_table(m: AdapterManifest) -> str:
    """A plain two-column rendering of a manifest, then its files."""
    b = m.base_model
    rows = [
        ("format", m.format),
        ("rank", str(m.rank)),
        ("scale", repr(m.scale)),
        ("target_modules", ", ".join(m.target_modules) or "-"),
        ("layers", _ranges(m.layers) or "-"),
        ("base_model", b.model_id or "-"),
        ("architecture", b.architecture or "-"),
        ("hidden_size", str(b.hidden_size or "-")),
        ("num_layers", str(b.num_layers or "-")),
        ("vocab_size", str(b.vocab_size or "-")),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    size_w = max((len(str(f.size_bytes)) for f in m.files), default=1)
    lines += [f"{str(f.size_bytes).rjust(size_w)}  {f.sha256}  {f.path}" for f in m.files]
    return "\n".join(lines)


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for v in values:
        if out and v == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)
