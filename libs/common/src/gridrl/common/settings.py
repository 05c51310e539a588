"""Settings declared once: each is one dataclass field made with :func:`setting`, and from that
one declaration come its command-line flag, its environment variable, its check and its help.

    @dataclass
    class NodeSettings:
        capacity: int = setting(64, "Most sequences decoded together in one batch.",
                                check=POSITIVE)

    @click.command()
    @click_options(NodeSettings, env_prefix="GRIDRL_ROLLOUT_")   # --capacity, GRIDRL_ROLLOUT_CAPACITY
    def serve(**params): settings = from_params(NodeSettings, params)   # validated

From a field's declaration:

- the click option (:func:`click_options`): the flag ``--<field-name>`` (``--x/--no-x`` for a
  boolean; ``flag=`` overrides, and ``aliases=`` adds former names), its type from the
  annotation (``int``, ``float``, ``str``, ``bool``; ``list[str]``: repeatable; ``choices``: a
  choice; ``click_type``: any click type, e.g. ``click.Path``), its default, its help and its
  environment variable ``<env_prefix><FLAG>`` (``env=`` overrides);
- the validation (:func:`validate`): ``choices`` and ``check`` raise INVALID_ARGUMENT naming the
  flag (:class:`gridrl.common.errors.StatusError`, whose ``field`` a command line shows as the
  parameter at fault); rules that tie several settings together are written out by the class
  (a ``validate`` method that calls this one first);
- defaults and flags for messages and tools (:func:`default_of`, :func:`flag_of`).

A setting whose flag a shared decorator declares (``--listen``, ``--metrics-port`` of
:func:`gridrl.common.cli.server_options`) is declared with ``cli=False``: it is validated and
has one default, without a second option.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gridrl.common.errors import invalid_argument

_SETTING = "gridrl.setting"

Check = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Setting:
    """How one settings field is exposed and checked (see the module docstring).

    Attributes:
        help: the flag's help text.
        flag: the flag's declaration when it is not ``--<field-name>`` (e.g. ``--reward-file``
            for ``reward_files``; ``--x/--no-x`` for a boolean).
        choices: the allowed values (a click choice, checked by :func:`validate`).
        check: ``check(value) -> problem or None``, for values that are not None.
        cli: False when a shared decorator declares the flag.
        on_resume: a resumed run takes this setting from the new command line (the trainer).
        env: the environment variable when it is not ``<prefix><FLAG>``.
        aliases: former flag names that keep working (shown in ``--help`` too).
        click_type: the click type when the annotation does not say it (``click.Path``).
        show_default: show the default in ``--help`` (default: when it is not None).
    """

    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    check: Check | None = None
    cli: bool = True
    on_resume: bool = False
    env: str | None = None
    aliases: tuple[str, ...] = ()
    click_type: Any = None
    show_default: bool | None = None


def setting(default: Any, help: str, **how: Any) -> Any:
    """A settings dataclass field with its :class:`Setting` (keyword arguments ``how``)."""
    meta = {_SETTING: Setting(help=help, **how)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ---------------------------------------------------------------------------------- checks


def at_least(low: float, why: str = "") -> Check:
    """``value >= low``; ``why`` is added to the message in parentheses."""
    note = f" ({why})" if why else ""
    return lambda v: None if v >= low else f"must be >= {low}{note}, got {v}"


def above(low: float, why: str = "") -> Check:
    """``value > low``."""
    note = f" ({why})" if why else ""
    return lambda v: None if v > low else f"must be > {low}{note}, got {v}"


def within(low: float, high: float, *, low_open: bool = False,
           high_open: bool = False) -> Check:
    """``low <= value <= high`` (either end open when asked)."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def check(v: Any) -> str | None:
        ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        return None if ok else f"must be in {interval}, got {v}"

    return check


POSITIVE = at_least(1)
NON_NEGATIVE = at_least(0)


# ----------------------------------------------------------------------------- reflection


def settings_of(cls: type) -> list[tuple[dataclasses.Field, Setting]]:
    """Every field of the dataclass ``cls`` declared with :func:`setting`, in order."""
    return [(f, f.metadata[_SETTING]) for f in dataclasses.fields(cls)
            if _SETTING in f.metadata]


def flag_of(cls: type, name: str) -> str:
    """The flag of setting ``name`` as error messages name it (``--group-size``)."""
    s = cls.__dataclass_fields__[name].metadata[_SETTING]
    return (s.flag or "--" + name.replace("_", "-")).split("/")[0]


def default_of(cls: type, name: str) -> Any:
    """The declared default of setting ``name``."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def env_of(cls: type, name: str, env_prefix: str) -> str:
    """The environment variable of setting ``name``: ``<env_prefix><FLAG>`` unless declared."""
    s = cls.__dataclass_fields__[name].metadata[_SETTING]
    return s.env or env_prefix + flag_of(cls, name).removeprefix("--").replace("-", "_").upper()


def validate(settings: Any) -> None:
    """Raise INVALID_ARGUMENT naming the flag of the first setting of ``settings`` (a settings
    dataclass instance) whose value is not among its ``choices`` or fails its ``check``, in
    declaration order. None values are not checked.

    Raises:
        StatusError: INVALID_ARGUMENT, ``field`` the flag (``--max-queue``).
    """
    cls = type(settings)
    for f, s in settings_of(cls):
        value = getattr(settings, f.name)
        if value is None:
            continue
        if s.choices is not None and value not in s.choices:
            allowed = " or ".join(filter(None, (", ".join(s.choices[:-1]), s.choices[-1])))
            raise invalid_argument(flag_of(cls, f.name), f"must be {allowed}, got {value!r}")
        problem = s.check(value) if s.check is not None else None
        if problem:
            raise invalid_argument(flag_of(cls, f.name), problem)


def from_params(cls: type, params: Mapping[str, Any], **values: Any) -> Any:
    """``cls`` built from a command's parameters (those named like its fields; ``values`` win)
    and validated: its own ``validate`` method when it has one, else :func:`validate`.

    Raises:
        StatusError: INVALID_ARGUMENT naming the flag.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    settings = cls(**{k: v for k, v in {**params, **values}.items() if k in names})
    getattr(settings, "validate", lambda: validate(settings))()
    return settings


def click_options(cls: type, env_prefix: str) -> Callable[[Any], Any]:
    """A decorator adding one click option per setting of ``cls`` declared with ``cli=True``,
    in declaration order (module docstring). The option's parameter is the field's name."""
    import click

    from gridrl.common.cli import env_option

    hints = typing.get_type_hints(cls)

    def decorate(f: Any) -> Any:
        for field, s in reversed(settings_of(cls)):
            if not s.cli:
                continue
            flag = s.flag or "--" + field.name.replace("_", "-")
            kind = hints[field.name]
            kw: dict[str, Any] = {"help": s.help}
            if typing.get_origin(kind) is list:
                kw["multiple"] = True
            else:
                default = default_of(cls, field.name)
                kw["default"] = default
                kw["show_default"] = (default is not None if s.show_default is None
                                      else s.show_default)
                base = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
                if s.click_type is not None:
                    kw["type"] = s.click_type
                elif s.choices is not None:
                    kw["type"] = click.Choice(list(s.choices))
                elif base is not bool:
                    kw["type"] = base
            f = env_option(flag, *s.aliases, field.name, env=env_of(cls, field.name, env_prefix),
                           **kw)(f)
        return f

    return decorate
