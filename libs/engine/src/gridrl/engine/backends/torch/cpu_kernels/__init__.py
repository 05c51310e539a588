"""Fused decode kernels for CPUs (float32 arithmetic; float32 or bfloat16 weights), compiled
from ``decode.c`` on first use.

:meth:`DecodeKernels.linear` -- a projection with the elementwise work around it. At a decode batch of a few rows, a product is a pass over its weight bound by memory
bandwidth. oneDNN's kernels stream a prepacked weight at 13-25 GB/s on the reference 2-core
machine (small matrices lower: a fixed ~40 us a call); the kernel here streams at 27-33 GB/s
and also does, in the same pass, the RMSNorm before a product (its weight folded into the
packed weight), the residual add after one, SwiGLU's ``silu(gate) * up``, and an unmerged LoRA
adapter's ``(x A^T) B^T`` term. See ``decode.c`` for the exact formula and layouts. A weight
packed in bfloat16 is widened to float32 in registers as it is read: half the bytes a step,
the same float32 arithmetic, no bfloat16 instruction needed (it runs on AVX2).

:meth:`DecodeKernels.attention` -- one decode token's attention in a layer: rotary on q and k,
the cache write, scores, softmax and the weighted sum of values in one call, instead of ~10
small torch ops (each ~5-40 us here, most of it dispatch and cache misses, for ~1 us of
arithmetic).

The library is built with the system C compiler (``$CC``, else ``cc``) with ``-O3
-march=native -fopenmp`` into ``<cache_root>/kernels/`` (one file per source, compiler and
CPU) and loaded with ctypes; it shares torch's OpenMP runtime (libgomp is loaded once per
process), so it runs on torch's threads. :func:`load` returns None, with the reason in
:func:`unavailable_reason`, where that cannot be done (not Linux, no compiler, build failed,
``GRIDRL_CPU_KERNELS=0``), where the build computes wrong on this CPU (:func:`verify`: every
process checks the kernels against float64 torch before using them, so code compiled for an
instruction set no test ran on can only lose, never corrupt), or where they lose to oneDNN on
this CPU; callers then keep their oneDNN path.

Whether they win depends on the CPU. Written for AVX-512 (27-33 GB/s against oneDNN's 13-25
there); on AVX2 they use 8-lane vectors and 6-row tiles (see ``decode.c``), and on a 2-core
AVX2 AMD EPYC (Zen 3) run every decode-shaped product 0.5-0.98x oneDNN's time
(docs/benchmarks.md). Because that is a property of the CPU, by default
(``GRIDRL_CPU_KERNELS`` unset or ``auto``) :func:`load` times both on two decode-shaped
products once per process and weight dtype (:func:`race`, ~0.13 s on that EPYC; for bfloat16
weights against oneDNN's bfloat16 products where it has them, else torch's bfloat16 matmul)
and uses the kernels only where they are the faster; ``GRIDRL_CPU_KERNELS=1`` uses them
without the race, ``0`` never.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# the library's interface, for the callers of the package
from gridrl.engine.backends.torch.cpu_kernels.kernels import DTYPES as DTYPES
from gridrl.engine.backends.torch.cpu_kernels.kernels import NB as NB
from gridrl.engine.backends.torch.cpu_kernels.kernels import DecodeKernels as DecodeKernels
from gridrl.engine.backends.torch.cpu_kernels.kernels import pack_weight as pack_weight
from gridrl.engine.backends.torch.projection import Projection
from gridrl.models import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")

_reason: str | None = None


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when it did not, or was not called)."""
    return _reason


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS),
                                    platform.machine(), _cpu_signature()]).encode()).hexdigest()
    target = cache_root() / "kernels" / f"decode-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each publish a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(dtype: torch.dtype = torch.float32) -> DecodeKernels | None:
    """The compiled kernels for weights of ``dtype`` (float32, or bfloat16: bfloat16 weights,
    float32 arithmetic), or None (see :func:`unavailable_reason`). Cached per process, per
    dtype and per ``GRIDRL_CPU_KERNELS`` mode ("auto" when unset: used only where
    :func:`race` says they beat the path the lean forward has without them; "1": always where
    they build; "0": never). In every mode they are used only once :func:`verify` found
    their results equal to a float64 reference's up to float32 rounding on this CPU, so a
    build for an instruction set no test ran on can be slower, never wrong."""
    global _reason
    mode = os.environ.get("GRIDRL_CPU_KERNELS", "auto").strip().lower() or "auto"
    kernels, _reason = _load(mode, str(dtype).removeprefix("torch."))
    return kernels




@functools.cache
def _library() -> tuple[DecodeKernels | None, str | None]:
    if not sys.platform.startswith("linux"):
        return None, f"built only on Linux (this is {sys.platform})"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler (set CC or install gcc)"
    try:
        path = _build(compiler)
        kernels = DecodeKernels(ctypes.CDLL(str(path)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("cpu kernels unavailable, using oneDNN products: %s", e)
        return None, f"build failed: {e}"
    wrong = verify(kernels)
    if wrong is not None:
        log.error("cpu kernels give wrong results on this CPU, not used: %s", wrong)
        return None, f"wrong results on this CPU: {wrong}"
    return kernels, None


@functools.cache
def _load(mode: str, dtype: str = "float32") -> tuple[DecodeKernels | None, str | None]:
    if mode == "0":
        return None, "disabled by GRIDRL_CPU_KERNELS=0"
    if mode not in ("1", "auto"):
        return None, f"GRIDRL_CPU_KERNELS={mode!r} is not one of auto, 1, 0"
    if dtype not in DTYPES:
        return None, f"no kernels for {dtype} weights (only {', '.join(DTYPES)})"
    kernels, reason = _library()
    if kernels is None or mode == "1":
        return kernels, reason
    kernel_s, other_s = race(kernels, dtype=DTYPES[dtype])
    other = fallback_name(DTYPES[dtype])
    verdict = (f"{kernel_s * 1e3:.2f} ms against {other}'s {other_s * 1e3:.2f} ms on this "
               f"CPU's decode-shaped products; GRIDRL_CPU_KERNELS=1 forces them")
    if kernel_s > KERNEL_HANDICAP * other_s:  # bench/decode_kernels.py decides the same
        log.info("cpu kernels (%s weights) slower than %s here, using %s: %s", dtype, other,
                 other, verdict)
        return None, f"slower than {other} here: {verdict}"
    log.info("cpu kernels (%s weights) faster than %s here: %s", dtype, other, verdict)
    return kernels, None


def race_again(dtype: torch.dtype, using_kernels: bool) -> str | None:
    """Run :func:`race` again for ``dtype`` on torch's current threads (a process whose thread
    count changed with the machine's load) and say how it came out: None where the kernels
    are not built, verified and enabled here. The forward keeps the path it packed its weights
    for; the message says when the other one now wins by more than :data:`KERNEL_HANDICAP`
    (restarting the process then packs for it)."""
    mode = os.environ.get("GRIDRL_CPU_KERNELS", "auto").strip().lower() or "auto"
    kernels, _ = _library()
    if kernels is None or mode != "auto" or dtype not in DTYPES.values():
        return None
    kernel_s, other_s = race(kernels, dtype=dtype)
    other = fallback_name(dtype)
    kernels_win = kernel_s <= KERNEL_HANDICAP * other_s
    verdict = (f"kernels {kernel_s * 1e3:.2f} ms, {other} {other_s * 1e3:.2f} ms at "
               f"{torch.get_num_threads()} threads")
    if kernels_win != using_kernels:
        return (f"{verdict}: {'the kernels' if kernels_win else other} would now win; the "
                f"forward keeps {other if kernels_win else 'the kernels'} until it restarts")
    return f"{verdict}: the forward's path still wins"


def clear_cache() -> None:
    """Forget every decision :func:`load` took (the next call builds, verifies and races
    again): for tests, and for a process that wants to re-decide under another load."""
    _library.cache_clear()
    _load.cache_clear()


def fallback_name(dtype: torch.dtype) -> str:
    """What the lean forward multiplies with where the kernels do not run, for weights of
    ``dtype``: "oneDNN" (prepacked), or "torch's bfloat16 matmul" on a CPU where oneDNN has no
    bfloat16 path."""
    probe = torch.zeros(16, 16, dtype=dtype)
    return "oneDNN" if Projection(probe).kind == "onednn" else f"torch's {str(dtype)[6:]} matmul"


#: The kernels run unless their products take more than this times oneDNN's: they also do the
#: work around each product (RMSNorm, residual add, SwiGLU, and the attention) that the race
#: does not time. Break-even from docs/benchmarks.md section 1's decode step: ~26 ms of
#: products and ~10 ms around them through oneDNN, ~3.8 ms around them fused, so
#: (26 + 10 - 3.8) / 26 = 1.24. The margin also keeps one machine's processes on one path
#: where the two are close (a path chosen by timing noise would differ from run to run).
KERNEL_HANDICAP = 1.25

#: The products :func:`race` times: (rows, out, in, swiglu) -- a decode batch through
#: SmolLM2-135M's MLP gate/up and its q/k/v.
RACE_SHAPES = ((8, 3072, 576, True), (16, 960, 576, False))


def race(kernels: DecodeKernels, repeats: int = 5, dtype: torch.dtype = torch.float32
         ) -> tuple[float, float]:
    """Seconds the kernels and the path the lean forward falls back to without them
    (:class:`~gridrl.engine.backends.torch.projection.Projection`: oneDNN-prepacked on x86, else
    plain) take for :data:`RACE_SHAPES`, each the best of ``repeats`` interleaved rounds, on
    torch's current threads. Random weights of ``dtype``; the kernels take float32 inputs
    (their arithmetic is float32 for bfloat16 weights too), the fallback inputs of ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    calls = []
    for rows, n, k, swiglu in RACE_SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(rows, k, generator=gen)
        packed = pack_weight(w, swiglu=swiglu, dtype=dtype)
        calls.append((lambda x=x, packed=packed, n=n, swiglu=swiglu:
                      kernels.linear(x, packed, n, swiglu=swiglu),
                      functools.partial(Projection(w, swiglu=swiglu), x.to(dtype))))
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms both paths up
            for side in (0, 1):
                t0 = time.perf_counter()
                for pair in calls:
                    pair[side]()
                best[side] = min(best[side], time.perf_counter() - t0)
    return best[0], best[1]


#: worst-case relative error of a float32 dot product of length k is about k u (u = 2^-24,
#: Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5); :func:`verify`
#: allows this many times that, relative to the largest output, for the norm, SiLU and the
#: LoRA term around the sum. A kernel that reads a wrong weight or row is off by O(1).
VERIFY_SLACK = 8

#: (rows, out, in, swiglu) :func:`verify` checks: every tile size (AVX-512: 8 rows, AVX2: 6),
#: an output width that is not a multiple of the 16-column blocks, SwiGLU.
VERIFY_SHAPES = ((1, 40, 72, False), (5, 96, 64, True), (8, 200, 48, False),
                 (13, 64, 80, True))


def verify(kernels: DecodeKernels) -> str | None:
    """Check the compiled kernels against float64 torch on this CPU: every part of the
    product's formula (RMSNorm, LoRA, bias, residual, SwiGLU) for float32 and bfloat16
    weights, statically and dynamically scheduled, and the decode attention.

    Returns:
        None when every result is within float32 rounding (:data:`VERIFY_SLACK`), else what
        differed and by how much.
    """
    gen = torch.Generator().manual_seed(1)
    u = 2.0 ** -24
    checks: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
    with torch.inference_mode():
        for rows, n, k, swiglu in VERIFY_SHAPES:
            x, g = torch.randn(rows, k, generator=gen), torch.rand(k, generator=gen) + 0.5
            a = torch.randn(4, k, generator=gen) * 0.1
            b = torch.randn(n, 4, generator=gen) * 0.1
            bias = None if swiglu else torch.randn(n, generator=gen)
            add = None if swiglu else torch.randn(rows, n, generator=gen)
            for dtype in DTYPES.values():
                w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
                packed = pack_weight(w, swiglu=swiglu, in_scale=g, dtype=dtype)
                # the reference reads the weights the kernel reads: norm folded, then rounded
                w_ref = (w.float() * g).to(dtype).double()
                r = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
                want = (x.double() @ w_ref.t() + (x.double() @ (a * g).double().t())
                        @ b.double().t()) * r
                if bias is not None:
                    want = want + bias.double() + add.double()
                if swiglu:
                    want = F.silu(want[:, :n // 2]) * want[:, n // 2:]
                for dynamic in (False, True):
                    kernels.set_dynamic_blocks(dynamic)
                    got = kernels.linear(x, packed, n, lora=((a * g).contiguous(),
                                                             pack_weight(b, swiglu=swiglu)),
                                         eps=1e-5, bias=bias,
                                         add=None if add is None else add.clone(),
                                         swiglu=swiglu)
                    label = (f"linear {rows}x{k}->{n}{' swiglu' if swiglu else ''} "
                             f"{str(dtype)[6:]} weights, {'dynamic' if dynamic else 'static'}")
                    checks.append((label, got, want, k))
        kernels.set_dynamic_blocks(False)
        for d, column in ((64, 21), (24, 5)):
            b_, hq, hkv, width = 3, 6, 2, 32
            qkv = torch.randn(b_, (hq + 2 * hkv) * d, generator=gen)
            angles = torch.rand(b_, d // 2, generator=gen) * 6
            cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
            keys = torch.randn(b_, hkv, width, d, generator=gen)
            values = torch.randn(b_, hkv, width, d, generator=gen)
            mask = torch.zeros(b_, 1, 1, width)
            mask[1, ..., :3] = torch.finfo(torch.float32).min
            want, _ = attention_reference(qkv, hq, hkv, cos, sin, keys, values, column, mask,
                                          0.125)
            got = kernels.attention(qkv, hq, hkv, cos, sin, keys, values, column,
                                    mask[..., :column + 1], 0.125)
            checks.append((f"attention D={d} column {column}", got, want, max(d, column + 1)))
    for label, got, want, k in checks:
        err = float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if not err <= VERIFY_SLACK * k * u:  # NaN fails too
            return f"{label}: relative error {err:.2e} > {VERIFY_SLACK * k * u:.2e}"
    return None


def attention_reference(qkv: torch.Tensor, hq: int, hkv: int, cos: torch.Tensor,
                        sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        column: int, mask: torch.Tensor | None, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`DecodeKernels.attention` in float64 torch, reading nothing it writes: rotate
    pairs (2j, 2j+1) by angle j, append at ``column``, GQA softmax attention. Returns the
    output (B, Hq D) and the rotated new keys (B, Hkv, D)."""
    b, d = qkv.shape[0], keys.shape[3]
    heads = qkv.double().view(b, hq + 2 * hkv, d)

    def rotate(x: torch.Tensor) -> torch.Tensor:  # (b, h, d)
        pairs = x.unflatten(-1, (d // 2, 2))
        c, s = cos.double()[:, None, :], sin.double()[:, None, :]
        return torch.stack((pairs[..., 0] * c - pairs[..., 1] * s,
                            pairs[..., 0] * s + pairs[..., 1] * c), dim=-1).flatten(-2)

    q, k, v = rotate(heads[:, :hq]), rotate(heads[:, hq:hq + hkv]), heads[:, hq + hkv:]
    keys, values = keys.double().clone(), values.double().clone()
    keys[:, :, column], values[:, :, column] = k, v
    keys, values = keys[:, :, :column + 1], values[:, :, :column + 1]
    group = hq // hkv
    scores = torch.einsum("bhd,bhtd->bht", q, keys.repeat_interleave(group, dim=1)) * scale
    if mask is not None:
        scores = scores + mask.double().reshape(b, -1)[:, None, :column + 1]
    attn = torch.einsum("bht,bhtd->bhd", scores.softmax(-1), values.repeat_interleave(group, 1))
    return attn.reshape(b, hq * d), k


