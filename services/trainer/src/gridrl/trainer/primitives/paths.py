"""``tinker://`` paths and the directories behind them on the trainer's machine.

Tinker names saved weights ``tinker://<training run id>/weights/<name>`` (a training state:
adapter and optimizer) and ``tinker://<training run id>/sampler_weights/<name>`` (weights to
sample from); the SDK parses them so (``ParsedCheckpointTinkerPath``). Here the training run is
a training model and the files are plain directories under the server's root::

    <root>/<model id, ':' as '-'>/weights/<name>/            adapter_config.json,
                                                             adapter_model.safetensors,
                                                             optimizer.pt, state.json
    <root>/<model id>/sampler_weights/<name>/peft/           the adapter, peft layout
    <root>/<model id>/sampler_weights/<name>/mlx/            the same, mlx-lm layout
    <root>/<model id>/sampler_weights/<name>/snapshot.json   policy version, base model
    <root>/<model id>/external_weights/<name>/peft/, mlx/,   an export (save_weights_external)
                                              external.json

so what a run saves loads locally with ``PeftModel.from_pretrained`` or
``mlx_lm.load(..., adapter_path=...)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gridrl.common.errors import invalid_argument

SCHEME = "tinker://"
STATE, SAMPLER, EXTERNAL = "weights", "sampler_weights", "external_weights"
KINDS = (STATE, SAMPLER, EXTERNAL)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class WeightsPath:
    """A parsed ``tinker://`` path.

    Attributes:
        model_id: the training model that saved it.
        kind: :data:`STATE`, :data:`SAMPLER` or :data:`EXTERNAL`.
        name: the checkpoint's name.
    """

    model_id: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        """``tinker://<model_id>/<kind>/<name>``."""
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"

    def directory(self, root: Path) -> Path:
        """Where its files are under ``root``."""
        return root / model_dir_name(self.model_id) / self.kind / self.name


def model_dir_name(model_id: str) -> str:
    """The directory name of a model id (``:`` is not portable in file names)."""
    return model_id.replace(":", "-")


def check_name(name: str, field: str = "path") -> str:
    """``name`` when it is a valid checkpoint name (``[A-Za-z0-9][A-Za-z0-9._-]*``, at most
    128 characters); raises INVALID_ARGUMENT naming ``field`` otherwise."""
    if not _NAME.fullmatch(name or ""):
        raise invalid_argument(field, f"{name!r} is not a checkpoint name (letters, digits, "
                               "'.', '_', '-'; at most 128)")
    return name


def parse(uri: str, field: str = "path", kind: str | None = None) -> WeightsPath:
    """Parse ``tinker://<model id>/<weights|sampler_weights>/<name>``.

    Args:
        kind: the kind the caller needs (None: either).
    Raises:
        StatusError: INVALID_ARGUMENT naming ``field`` for anything else.
    """
    if not uri.startswith(SCHEME):
        raise invalid_argument(field, f"{uri!r} is not a tinker:// path")
    parts = uri[len(SCHEME):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not _MODEL_ID.fullmatch(parts[0]):
        raise invalid_argument(field, f"{uri!r}: expected tinker://<model id>/<kind>/<name> "
                               f"with kind {', '.join(KINDS)}")
    if kind is not None and parts[1] != kind:
        raise invalid_argument(field, f"{uri!r} is a {parts[1]} path; {kind} is needed here")
    return WeightsPath(parts[0], parts[1], check_name(parts[2], field))
