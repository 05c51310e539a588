"""Small helpers shared by the two format modules."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from gridrl.adapters.adapter import HEAD_MODULE, LoraAdapter, split_module_path
from gridrl.adapters.errors import AdapterError

CONFIG = "adapter_config.json"


def parse_config(files: Mapping[str, bytes], fmt: str) -> tuple[dict, bytes]:
    """``adapter_config.json`` of a ``fmt`` adapter: (parsed object, exact bytes).

    Raises:
        AdapterError: missing, not UTF-8 JSON, or not an object.
    """
    if CONFIG not in files:
        raise AdapterError(f"{fmt} adapter: {CONFIG} is missing")
    raw = bytes(files[CONFIG])
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{CONFIG}: not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG}: must be a JSON object, got {type(cfg).__name__}")
    return cfg, raw


def refuse_unsupported(adapter: LoraAdapter, to: str) -> None:
    """Raise when ``adapter`` holds something ``to`` cannot express (its ``unsupported``).

    Raises:
        AdapterError: ``"cannot convert this peft adapter to mlx: <reason>; <reason>"``.
    """
    if adapter.unsupported:
        raise AdapterError(f"cannot convert this {adapter.format} adapter to {to}: "
                           + "; ".join(adapter.unsupported))


def block_grid(adapter: LoraAdapter, to: str) -> tuple[list[int], list[str]]:
    """(adapted blocks ascending, keys sorted) when every adapted block adapts the same keys
    in one block container, which is all either format's config can express.

    Raises:
        AdapterError: no LoRA modules, modules in several containers, or blocks adapting
            different keys.
    """
    inside = adapter.block_modules()
    if not inside:
        raise AdapterError(f"cannot convert to {to}: the adapter holds no LoRA modules "
                           "inside the transformer blocks")
    containers = sorted({c for c, _, _ in inside.values()})
    if len(containers) > 1:
        raise AdapterError(f"cannot convert to {to}: LoRA modules sit in several block "
                           f"containers {containers}; one config can address only one")
    per_block: dict[int, set[str]] = {}
    for _, idx, key in inside.values():
        per_block.setdefault(idx, set()).add(key)
    layers = sorted(per_block)
    keys = sorted(set().union(*per_block.values()))
    uneven = {i: sorted(k) for i, k in per_block.items() if k != set(keys)}
    if uneven:
        detail = ", ".join(f"block {i} adapts {k}" for i, k in sorted(uneven.items())[:3])
        raise AdapterError(f"cannot convert to {to}: the config applies the same modules {keys} "
                           f"to every adapted block, but {detail}")
    return layers, keys


def uniform_rank_and_scale(adapter: LoraAdapter, to: str) -> tuple[int, float]:
    """The one rank and one scale of every module.

    Raises:
        AdapterError: ranks or scales differ (peft ``rank_pattern`` / ``alpha_pattern``),
            naming a few modules of each value.
    """
    rank, scale = adapter.uniform_rank(), adapter.uniform_scale()
    if rank is None:
        raise AdapterError(f"cannot convert to {to}: non-uniform ranks "
                           f"({_by_value((p, m.rank) for p, m in adapter.modules.items())}; "
                           f"peft rank_pattern={adapter.config.get('rank_pattern')}); "
                           f"the {to} config has one rank for all modules")
    if scale is None:
        raise AdapterError(f"cannot convert to {to}: non-uniform scales "
                           f"({_by_value((p, m.scale) for p, m in adapter.modules.items())}; "
                           f"peft alpha_pattern={adapter.config.get('alpha_pattern')}); "
                           f"the {to} config has one scale for all modules")
    return rank, scale


def _by_value(items: Iterable[tuple[str, object]]) -> str:
    groups: dict[object, list[str]] = {}
    for path, value in items:
        groups.setdefault(value, []).append(path)
    return ", ".join(f"{v}: {ps[0]}" + (f" and {len(ps) - 1} more" if len(ps) > 1 else "")
                     for v, ps in groups.items())


def uniform_dora(adapter: LoraAdapter, to: str) -> bool:
    """Whether every module carries a DoRA magnitude (False when none does).

    Raises:
        AdapterError: only some modules carry one; the target applies DoRA to all or none.
    """
    with_m = [p for p, m in adapter.modules.items() if m.magnitude is not None]
    if with_m and len(with_m) != len(adapter.modules):
        without = [p for p in adapter.modules if p not in with_m]
        raise AdapterError(f"cannot convert to {to}: DoRA magnitudes on {len(with_m)} modules "
                           f"(e.g. {with_m[0]}) but not on {len(without)} (e.g. {without[0]}); "
                           f"the {to} config applies DoRA to every module or none")
    return bool(with_m)


def embedding_message(path: str) -> str:
    """Refusal for LoRA on an embedding."""
    return (f"embedding LoRA on {path} is not supported: mlx-lm's LoRAEmbedding also adapts the "
            f"output projection when embeddings are tied (as_linear), which peft does not")


def outside_blocks_message(path: str) -> str:
    """Refusal for LoRA on a module outside the transformer blocks."""
    if "embed" in path or "wte" in path:
        return embedding_message(path)
    return (f"LoRA on {path}, outside the transformer blocks, is not supported: mlx-lm keys "
            f"and the manifest address modules inside a block")


def is_block_module(path: str) -> bool:
    return split_module_path(path) is not None


def is_adaptable(path: str) -> bool:
    """A module either format adapts: a linear layer inside the blocks, or the output head."""
    return path == HEAD_MODULE or is_block_module(path)


def config_keys(adapter: LoraAdapter, keys: list[str]) -> list[str]:
    """The block ``keys`` a config names, plus the output head when the adapter adapts it."""
    return [*keys, HEAD_MODULE] if adapter.head() is not None else keys
