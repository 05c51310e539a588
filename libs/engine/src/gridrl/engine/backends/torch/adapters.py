"""How the torch backend holds LoRA adapters: one :class:`AdapterStrategy`, chosen when the
backend is built (:func:`choose_strategy`), behind one protocol -- load an adapter (from a
directory or from files in memory), unload it, make one active for a call, describe itself.

The strategies:

- :class:`LeanFactors` -- a node running the lean forward: each adapter is held as low-rank
  factors of the fused products (:meth:`LeanLlama.lora_factors`); loading reads the factors,
  switching is a pointer swap, the base weights are never touched.
- :class:`MergedWeights` -- a node running the transformers forward: each adapter is folded
  into copies of the weights it adapts (:mod:`.torch_merge`), switching swaps the modules'
  weight tensors; zero cost per token.
- :class:`LivePeftFactors` -- an in-process peft model with frozen base weights (the trainer's
  local rollouts and evaluation) on the lean forward: the model's active LoRA is read as factors
  at every call, so an optimizer step in between is served.
- :class:`PeftAdapters` -- peft itself (``PeftModel.load_adapter`` / ``set_adapter``), the
  transformers forward with peft's layers: any LoRA peft loads (DoRA included), and every
  adapter of a model wrapped in-process that the others do not cover.

The first two hold plain LoRA only; :class:`WithPeftFallback` sends what they cannot hold
(DoRA) to a :class:`PeftAdapters` beside them. A strategy's :meth:`~AdapterStrategy.active`
yields the forward that serves the call: a :class:`LeanLlama`, or a transformers model. What
they load is a :class:`~gridrl.engine.backends.torch.lora_source.LoraSource`, read and checked
against the model before any strategy touches it.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from gridrl.engine.backends.torch.llama import LeanLlama, LoraFactors
from gridrl.engine.backends.torch.lora_source import LoraSource
from gridrl.engine.backends.torch.merge import (
    WeightSwitcher,
    merge_adapter,
    mergeable,
)
from gridrl.engine.contract import AdapterLoadError

log = logging.getLogger(__name__)

#: What serves a call: the lean forward, or a transformers model (maybe with peft's layers).
Forward = Any


class AdapterStrategy(abc.ABC):
    """How a backend holds adapters (module docstring). One per backend; all calls from the
    backend's one thread. Keys are unique among loaded adapters (the backend checks).

    Attributes:
        name: what it is called in logs, e.g. ``"lean LoRA factors"``.
        reason: why the backend chose it (for the start-up log line).
    """

    name: ClassVar[str]

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def describe(self) -> str:
        """One line for a log: the strategy and why it runs."""
        return f"{self.name} ({self.reason})"

    def accepts(self, config: Mapping[str, Any]) -> bool:
        """Whether :meth:`load` can hold an adapter with this ``adapter_config.json``."""
        return True

    def strategy_of(self, key: str) -> str:
        """The name of the strategy holding adapter ``key`` (for log lines)."""
        return self.name

    def lean_factors(self, keys: list[str]) -> tuple[LeanLlama, dict[str, LoraFactors]] | None:
        """The lean forward and the factors of adapters ``keys`` where this strategy holds
        every one of them as :class:`LoraFactors` (so that one batch can mix them:
        :meth:`LeanLlama.activate_rows`); None otherwise (the caller decodes one adapter
        group after the other)."""
        return None

    @abc.abstractmethod
    def load(self, key: str, source: LoraSource) -> int:
        """Hold ``source`` under ``key`` next to what is loaded; returns the bytes it holds.

        Raises:
            AdapterLoadError: it does not load (the message says why); nothing changed then.
        """

    @abc.abstractmethod
    def unload(self, key: str) -> None:
        """Forget adapter ``key`` (loaded by :meth:`load`)."""

    @abc.abstractmethod
    def active(self, key: str | None) -> contextlib.AbstractContextManager[Forward]:
        """A context serving adapter ``key`` (None: the base model for a node's own model, the
        model as it is for a model wrapped in-process); yields the forward to run."""


class _PlainLora(AdapterStrategy):
    """Plain LoRA adapters (no DoRA), each held as one object built at load time."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self._held: dict[str, Any] = {}

    def accepts(self, config: Mapping[str, Any]) -> bool:
        return mergeable(dict(config))

    def load(self, key: str, source: LoraSource) -> int:
        try:
            held = self._build(source.pairs())
        except (KeyError, ValueError, AttributeError) as e:
            raise AdapterLoadError(f"adapter does not load: {e}") from e
        self._held[key] = held
        return held.nbytes

    def unload(self, key: str) -> None:
        self._drop(self._held.pop(key))

    @contextlib.contextmanager
    def active(self, key: str | None) -> Iterator[Forward]:
        yield self._serve(None if key is None else self._held[key])

    @abc.abstractmethod
    def _build(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> Any:
        """What serves the adapter with these per-module factors (has ``nbytes``)."""

    @abc.abstractmethod
    def _drop(self, held: Any) -> None:
        """Free what :meth:`_build` made (serving the base model first if it serves)."""

    @abc.abstractmethod
    def _serve(self, held: Any | None) -> Forward:
        """Serve ``held`` (None: the base model); returns the forward to run."""


class LeanFactors(_PlainLora):
    """Plain LoRA adapters as low-rank factors of :class:`LeanLlama`'s fused products."""

    name = "lean LoRA factors"

    def __init__(self, lean: LeanLlama, reason: str) -> None:
        super().__init__(reason)
        self.lean = lean

    def lean_factors(self, keys: list[str]) -> tuple[LeanLlama, dict[str, LoraFactors]] | None:
        return self.lean, {key: self._held[key] for key in keys}

    def _build(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> Any:
        return self.lean.lora_factors(pairs)

    def _drop(self, held: Any) -> None:
        self.lean.release(held)

    def _serve(self, held: Any | None) -> Forward:
        self.lean.activate(held)
        return self.lean


class MergedWeights(_PlainLora):
    """Plain LoRA adapters folded into copies of the weights they adapt (transformers
    forward)."""

    name = "merged weights"

    def __init__(self, model: Any, reason: str) -> None:
        super().__init__(reason)
        self.model = model
        self._switcher = WeightSwitcher(model)

    def _build(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> Any:
        return merge_adapter(self.model, pairs, self._switcher.base)

    def _drop(self, held: Any) -> None:
        self._switcher.release(held)

    def _serve(self, held: Any | None) -> Forward:
        self._switcher.activate(held)
        return self.model


class PeftAdapters(AdapterStrategy):
    """peft's own adapters on a transformers model.

    Args:
        model: the transformers model (for a model wrapped in-process: the ``PeftModel``'s
            base model), or None to build one with ``load_model`` when the first adapter
            comes (a node whose own weights the lean forward holds), dropped again when the
            last goes.
        peft: the ``PeftModel`` wrapped in-process, if any.
        owns: the backend owns the model (a node): ``active(None)`` is the base model.
        load_model: builds the model when ``model`` is None.
    """

    name = "peft adapters"

    def __init__(self, model: Any | None, reason: str, *, peft: Any | None = None,
                 owns: bool = True, load_model: Callable[[], Any] | None = None) -> None:
        super().__init__(reason)
        self.model = model
        self.peft = peft
        self.owns = owns
        self._load_model = load_model

    def load(self, key: str, source: LoraSource) -> int:
        from peft import PeftModel

        if self.model is None:
            assert self._load_model is not None
            self.model = self._load_model()
            log.info("peft adapters: loaded a transformers copy of the model for them")
        try:
            with source.on_disk() as directory:
                if self.peft is None:
                    self.peft = PeftModel.from_pretrained(self.model, str(directory),
                                                          adapter_name=key, is_trainable=False)
                else:
                    self.peft.load_adapter(str(directory), adapter_name=key, is_trainable=False)
        except Exception as e:  # peft raises ValueError / RuntimeError / KeyError
            self.unload(key)
            raise AdapterLoadError(f"adapter does not load: {e}") from e
        if self.owns:
            self.model.requires_grad_(False)
        return sum(p.numel() * p.element_size() for n, p in self.model.named_parameters()
                   if f".{key}." in n or n.endswith(f".{key}"))

    def unload(self, key: str) -> None:
        """Remove every trace of adapter ``key`` (after an unload or a failed load)."""
        if self.model is None:
            return
        if self.peft is None:
            strip_lora(self.model)  # a failed first load may have injected layers
        elif key in self.peft.peft_config:
            with warnings.catch_warnings():  # "Adapter x was active which is now deleted"
                warnings.simplefilter("ignore", UserWarning)
                self.peft.delete_adapter(key)
        if self.owns and self.peft is not None and not self.peft.peft_config:
            # No adapter left: back to the plain model (peft's layers cost time per step).
            self.peft = None
            strip_lora(self.model)
        if self.owns and self.peft is None and self._load_model is not None:
            self.model = None  # built for the adapters: freed with the last of them

    @contextlib.contextmanager
    def active(self, key: str | None) -> Iterator[Forward]:
        if key is None:
            if self.owns and self.peft is not None:
                with self.peft.disable_adapter():
                    yield self.model
            else:
                yield self.model
            return
        assert self.peft is not None and key in self.peft.peft_config
        if self.peft.active_adapter != key:
            self.peft.set_adapter(key)
            if self.owns:
                self.model.requires_grad_(False)
        yield self.model


class LivePeftFactors(PeftAdapters):
    """An in-process peft model with frozen base weights on :class:`LeanLlama`: ``active(None)``
    reads the model's active LoRA as factors at every call (None when it is not expressible as
    factors: DoRA, ``modules_to_save``, embedding LoRA -- then peft's forward serves the call).
    Adapters loaded by key go through peft."""

    name = "live peft LoRA factors"

    def __init__(self, lean: LeanLlama, peft: Any, reason: str) -> None:
        super().__init__(peft.get_base_model(), reason, peft=peft, owns=False)
        self.lean: LeanLlama | None = lean

    @contextlib.contextmanager
    def active(self, key: str | None) -> Iterator[Forward]:
        live = self._live_lora() if key is None else None
        if live is None:
            with super().active(key) as forward:
                yield forward
            return
        assert self.lean is not None
        self.lean.activate(live)
        try:
            yield self.lean
        finally:
            self.lean.release(live)

    def _live_lora(self) -> LoraFactors | None:
        """The peft model's active LoRA as factors, read now (None: not expressible)."""
        from peft.tuners.lora import LoraLayer

        if self.lean is None:
            return None
        peft = self.peft
        active = list(getattr(peft, "active_adapters", [peft.active_adapter]))
        cfg = peft.peft_config.get(active[0]) if len(active) == 1 else None
        if cfg is None or getattr(cfg, "modules_to_save", None) or getattr(cfg, "lora_bias",
                                                                            False):
            return None
        name = active[0]
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for path, module in self.model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            if name in getattr(module, "lora_embedding_A", {}) or \
                    getattr(module, "use_dora", {}).get(name, False):
                return None
            if name in module.lora_A:
                pairs[path] = (module.lora_A[name].weight.detach(),
                               module.lora_B[name].weight.detach(), float(module.scaling[name]))
        try:
            return self.lean.lora_factors(pairs)
        except ValueError as e:
            log.info("torch backend: transformers forward from now on (lean forward: %s)", e)
            self.lean = None
            return None


class WithPeftFallback(AdapterStrategy):
    """``primary`` for the adapters it accepts, ``fallback`` (peft) for the others (DoRA).

    While a primary adapter (or the base model) serves, peft's layers are disabled; while a
    peft adapter serves, the primary serves the base model underneath.
    """

    def __init__(self, primary: AdapterStrategy, fallback: PeftAdapters) -> None:
        super().__init__(primary.reason)
        self.primary, self.fallback = primary, fallback
        self.name = primary.name  # type: ignore[misc]
        self._in_fallback: set[str] = set()

    def describe(self) -> str:
        return (f"{self.primary.describe()}; DoRA and other LoRA it cannot hold as "
                f"{self.fallback.describe()}")

    def load(self, key: str, source: LoraSource) -> int:
        if self.primary.accepts(source.config):
            return self.primary.load(key, source)
        nbytes = self.fallback.load(key, source)
        self._in_fallback.add(key)
        return nbytes

    def unload(self, key: str) -> None:
        if key in self._in_fallback:
            self._in_fallback.discard(key)
            self.fallback.unload(key)
        else:
            self.primary.unload(key)

    def strategy_of(self, key: str) -> str:
        return self.fallback.name if key in self._in_fallback else self.primary.name

    def lean_factors(self, keys: list[str]) -> tuple[LeanLlama, dict[str, LoraFactors]] | None:
        if any(key in self._in_fallback for key in keys):
            return None
        return self.primary.lean_factors(keys)

    @contextlib.contextmanager
    def active(self, key: str | None) -> Iterator[Forward]:
        if key is not None and key in self._in_fallback:
            with self.primary.active(None), self.fallback.active(key) as forward:
                yield forward
        else:
            with self.fallback.active(None), self.primary.active(key) as forward:
                yield forward


def choose_strategy(model: Any, peft: Any | None, lean: LeanLlama | None, *, owns: bool,
                    load_model: Callable[[], Any] | None = None) -> AdapterStrategy:
    """The strategy for a backend, chosen once.

    Args:
        model: the transformers model (the peft model's base model when wrapped).
        peft: the ``PeftModel`` wrapped in-process, or None.
        lean: the lean forward when it runs the model, else None.
        owns: the backend owns the model (a node).
        load_model: for a node on the lean forward whose transformers weights were released:
            builds a transformers model for peft adapters (DoRA).
    """
    if owns and peft is None and lean is not None:
        fallback = (PeftAdapters(None, "on a transformers copy of the model loaded for them",
                                 load_model=load_model) if load_model is not None
                    else PeftAdapters(model, "on the node's model"))
        return WithPeftFallback(LeanFactors(lean, "the node runs the lean forward"), fallback)
    if owns and peft is None:
        return WithPeftFallback(MergedWeights(model, "the node runs the transformers forward"),
                                PeftAdapters(model, "on the node's model"))
    if not owns and peft is not None and lean is not None:
        return LivePeftFactors(lean, peft, "a peft model wrapped in-process, base weights "
                                           "frozen, on the lean forward")
    why = ("a peft model" if peft is not None else "a model") + " wrapped in-process" + \
        ("" if owns else " on the transformers forward")
    return PeftAdapters(model, why, peft=peft, owns=owns)


def strip_lora(model: Any) -> None:
    """Replace every peft LoRA layer inside ``model`` by the layer it wraps."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer) and hasattr(module, "get_base_layer"):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    if "peft_config" in vars(model):  # set by peft on the model it injects into
        del model.peft_config


