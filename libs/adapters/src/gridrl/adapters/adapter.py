"""The format-neutral LoRA adapter both formats are read into and written from.

A LoRA module adds a low-rank update to a frozen linear layer ``W`` (out, in):

    y = W x + scale * B (A x)          A: (r, in), B: (out, r)      [Hu et al. 2021, eq. 3]

and under DoRA (Liu et al. 2024, eq. 5) rescales each output row by a learned magnitude ``m``:

    y = m / ||W + scale * B A||_row * (W x + scale * B A x) + bias      m: (out,)

Here tensors are kept in peft's orientation (A (r, in), B (out, r)); mlx-lm stores their
transposes. Module paths are the base model's ``named_modules`` paths, e.g.
``"model.layers.3.self_attn.q_proj"``: a block container (``model.layers``), a block index and a
path inside the block (``self_attn.q_proj``, what mlx-lm calls a key and the manifest a target
module).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, get_args

from gridrl.adapters.tensors import Tensor

#: an adapter layout: peft (``adapter_model.safetensors``) or mlx-lm (``adapters.safetensors``)
Format = Literal["peft", "mlx"]
FORMATS: tuple[Format, ...] = get_args(Format)
# Block-internal modules whose input is the hidden state, or whose output is, across common
# architectures: used to read the hidden size off adapter shapes.
_HIDDEN_IN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj",
              "query_key_value", "c_attn", "c_fc", "fc1", "w1", "w3", "Wqkv", "in_proj",
              "query", "key", "value", "wq", "wk", "wv"}
_HIDDEN_OUT = {"o_proj", "down_proj", "c_proj", "fc2", "w2", "out_proj", "wo"}
#: The output head's module path (llama-like models, peft and mlx-lm alike): the one module
#: outside the blocks both formats adapt as a plain linear layer (Tinker's ``train_unembed``).
#: peft names its tensors ``base_model.model.lm_head.lora_A.weight`` / ``lora_B.weight``
#: (``PeftModel.save_pretrained``), mlx-lm ``lm_head.lora_a`` / ``lora_b`` with ``"lm_head"``
#: in ``lora_parameters.keys`` (``tuner/utils.py`` ``linear_to_lora_layers`` matches the keys
#: against the model's top-level module paths too). A model whose head is tied to its
#: embeddings has no ``lm_head`` module in mlx-lm (``embed_tokens.as_linear``), so such an
#: adapter's mlx-lm copy would adapt nothing there: :func:`gridrl.adapters.convert_files`
#: cannot see the tie, its caller refuses (the trainer does).
HEAD_MODULE = "lm_head"


def split_module_path(path: str) -> tuple[str, int, str] | None:
    """``"model.layers.3.self_attn.q_proj"`` -> ``("model.layers", 3, "self_attn.q_proj")``.

    The block index is the first all-digit component after at least one other (peft's
    ``layers_to_transform`` rule); None for modules outside the blocks (``lm_head``,
    ``model.embed_tokens``).
    """
    parts = path.split(".")
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[:i]), int(parts[i]), ".".join(parts[i + 1:])
    return None


@dataclass
class LoraModule:
    """One adapted linear layer: ``a`` (r, in), ``b`` (out, r), effective ``scale`` and, under
    DoRA, ``magnitude`` (out,). Dtypes are whatever the file stores."""

    path: str
    a: Tensor
    b: Tensor
    scale: float
    magnitude: Tensor | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def in_features(self) -> int:
        return self.a.shape[1]

    @property
    def out_features(self) -> int:
        return self.b.shape[0]


@dataclass
class LoraAdapter:
    """An adapter read from one format, ready to be written in either.

    Attributes:
        format: the format it was read from, "peft" or "mlx".
        modules: module path -> :class:`LoraModule`, in the order of the file.
        rank: the config's rank (peft ``r``, mlx ``lora_parameters.rank``).
        scale: the config's scale (peft ``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA).
        dora: the config asks for DoRA.
        dropout: LoRA dropout probability (training only).
        base_model_path: peft ``base_model_name_or_path`` / mlx ``model``, "" when unknown.
        all_layers: the config itself says every block is adapted (peft: no
            ``layers_to_transform``, list targets, no ``exclude_modules``; mlx: ``num_layers``
            <= 0), so the block count is ``max(layers) + 1`` without asking the base model.
        mlx_num_layers: mlx ``num_layers`` as written (None for peft).
        unsupported: what the other format cannot express, one message each (extra tensors,
            biases, embedding LoRA, modules_to_save...). Conversion refuses when non-empty.
        other_modules: paths of LoRA modules kept out of ``modules`` because they are not
            linear layers inside the blocks or the output head :data:`HEAD_MODULE`
            (embeddings, convolutions, MoE experts).
        config: the parsed adapter_config.json; config_bytes: its exact bytes.
        metadata / layout: the weights file's ``__metadata__`` and how to rewrite it byte for
            byte (see :func:`gridrl.adapters.tensors.detect_writer`).
        key_prefix: peft tensor-name prefix ("base_model.model." or "").
        extra_files: other files of the adapter directory, carried over unchanged.
    """

    format: Format
    modules: dict[str, LoraModule]
    rank: int
    scale: float
    dora: bool
    dropout: float
    base_model_path: str
    all_layers: bool
    config: dict
    config_bytes: bytes
    metadata: dict[str, str] | None
    layout: dict | None
    mlx_num_layers: int | None = None
    key_prefix: str = ""
    unsupported: list[str] = field(default_factory=list)
    other_modules: list[str] = field(default_factory=list)
    extra_files: dict[str, bytes] = field(default_factory=dict)

    def block_modules(self) -> dict[str, tuple[str, int, str]]:
        """Module path -> (container, block index, key) for modules inside the blocks."""
        out = {}
        for path in self.modules:
            split = split_module_path(path)
            if split is not None:
                out[path] = split
        return out

    def layers(self) -> list[int]:
        """Indices of the adapted blocks, ascending."""
        return sorted({idx for _, idx, _ in self.block_modules().values()})

    def target_modules(self) -> list[str]:
        """Paths inside a block of the adapted modules, sorted; modules outside the blocks
        appear with their full path."""
        inside = self.block_modules()
        return sorted({inside[p][2] if p in inside else p for p in self.modules}
                      | set(self.other_modules))

    def head(self) -> LoraModule | None:
        """The LoRA on the output head (:data:`HEAD_MODULE`), None when it has none."""
        return self.modules.get(HEAD_MODULE)

    def uniform_rank(self) -> int | None:
        """The rank shared by every module, None when they differ or there are none."""
        ranks = {m.rank for m in self.modules.values()}
        return ranks.pop() if len(ranks) == 1 else None

    def uniform_scale(self) -> float | None:
        """The scale shared by every module, None when they differ or there are none."""
        scales = {m.scale for m in self.modules.values()}
        return scales.pop() if len(scales) == 1 else None

    def hidden_size(self) -> int:
        """The hidden size read off the shapes (input of q/k/v/gate/up-like modules, output of
        o/down-like modules); 0 when no known module tells or they disagree."""
        sizes: Counter[int] = Counter()
        for path, m in self.modules.items():
            leaf = path.rsplit(".", 1)[-1]
            if leaf in _HIDDEN_IN:
                sizes[m.in_features] += 1
            elif leaf in _HIDDEN_OUT:
                sizes[m.out_features] += 1
        return next(iter(sizes)) if len(sizes) == 1 else 0
