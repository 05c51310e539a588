"""Where a torch model runs: --device (pick_device, shared by the node and the trainer; DeviceError
names the flag and the problem) and --dtype (pick_dtype)."""

from __future__ import annotations

import os

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(ValueError):
    """A ``--device`` this torch build cannot use: ``device`` (the value given) and
    ``problem`` (why), apart; the message is ``"--device <device>: <problem>"``."""

    def __init__(self, device: str, problem: str) -> None:
        super().__init__(f"--device {device}: {problem}")
        self.device = device
        self.problem = problem


def pick_device(device: str = "auto", *, mps: bool = True) -> torch.device:
    """The torch device of ``--device`` (the node's and the trainer's).

    ``"auto"``: ``cuda:$LOCAL_RANK`` if CUDA is available (each ``torchrun`` process on its own
    GPU; ``cuda:0`` alone), else MPS if available and ``mps`` (the trainer passes False: its
    torch update runs on CUDA or the CPU, an Apple GPU trains with ``--backend mlx``), else CPU.
    Otherwise the named device, which must exist in this build.

    Raises:
        DeviceError: a name torch does not know, or a device this torch build cannot use.
    """
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if mps and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise DeviceError(device, str(e)) from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(device, "CUDA is not available in this torch build")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(device, "MPS is not available")
    return dev


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 elsewhere; otherwise the named dtype.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]
