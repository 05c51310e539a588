"""The ``gridrl-trainer run`` flags as plain records (name, flags, env var, default, type,
choices, multiple, is_flag, help), for comparing the flag set with the one recorded in
``data/trainer_run_flags.json`` (the flags before settings were declared once)."""

from __future__ import annotations

from typing import Any

import click


def _type_name(t: click.ParamType) -> str:
    if isinstance(t, click.Choice):
        return "choice"
    for cls, name in ((click.types.BoolParamType, "boolean"), (click.types.IntParamType, "integer"),
                      (click.types.FloatParamType, "float"), (click.Path, "path")):
        if isinstance(t, cls):
            return name
    return "text"


def option_records(command: click.Command) -> list[dict[str, Any]]:
    """One record per option of ``command``, in declaration order; an unset default (click's
    sentinel, e.g. of a repeatable option) is None."""
    records = []
    for p in command.params:
        if not isinstance(p, click.Option):
            continue
        default = p.default
        if type(default).__name__ == "Sentinel" or (p.multiple and default in ((), [])):
            default = None
        records.append({
            "name": p.name, "flags": list(p.opts) + list(p.secondary_opts), "envvar": p.envvar,
            "default": default, "type": _type_name(p.type),
            "choices": list(p.type.choices) if isinstance(p.type, click.Choice) else None,
            "multiple": p.multiple, "is_flag": p.is_flag, "help": p.help,
        })
    return records
