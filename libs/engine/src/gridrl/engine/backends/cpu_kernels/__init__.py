"""Fused float32 decode kernels for CPUs, compiled from ``decode.c`` on first use.

:meth:`DecodeKernels.linear` -- a projection with the elementwise work around it. At a decode batch of a few rows, a product is a pass over its weight bound by memory
bandwidth. oneDNN's kernels stream a prepacked weight at 13-25 GB/s on the reference 2-core
machine (small matrices lower: a fixed ~40 us a call); the kernel here streams at 27-33 GB/s
and also does, in the same pass, the RMSNorm before a product (its weight folded into the
packed weight), the residual add after one, SwiGLU's ``silu(gate) * up``, and an unmerged LoRA
adapter's ``(x A^T) B^T`` term. See ``decode.c`` for the exact formula and layouts.

:meth:`DecodeKernels.attention` -- one decode token's attention in a layer: rotary on q and k,
the cache write, scores, softmax and the weighted sum of values in one call, instead of ~10
small torch ops (each ~5-40 us here, most of it dispatch and cache misses, for ~1 us of
arithmetic).

The library is built with the system C compiler (``$CC``, else ``cc``) with ``-O3
-march=native -fopenmp`` into ``<cache_root>/kernels/`` (one file per source, compiler and
CPU) and loaded with ctypes; it shares torch's OpenMP runtime (libgomp is loaded once per
process), so it runs on torch's threads. :func:`load` returns None, with the reason in
:func:`unavailable_reason`, where that cannot be done (not Linux, no compiler, build failed,
``GRIDRL_CPU_KERNELS=0``) or where they lose to oneDNN on this CPU; callers then keep their
oneDNN path.

Whether they win depends on the CPU. Written for AVX-512 (27-33 GB/s against oneDNN's 13-25
there); on AVX2 they use 8-lane vectors and 6-row tiles (see ``decode.c``), and on a 2-core
AVX2 AMD EPYC (Zen 3) run every decode-shaped product 0.5-0.98x oneDNN's time
(docs/benchmarks.md). Because that is a property of the CPU, by default
(``GRIDRL_CPU_KERNELS`` unset or ``auto``) :func:`load` times both on two decode-shaped
products once per process (:func:`race`, ~0.13 s on that EPYC) and uses the kernels only where they are
the faster; ``GRIDRL_CPU_KERNELS=1`` uses them without the race, ``0`` never.
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

from gridrl.engine.backends.torch_memory import drop_mapped_pages
from gridrl.models import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
NB = 16  # output columns per packed block (decode.c's NB)

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


def load() -> DecodeKernels | None:
    """The compiled kernels, or None (see :func:`unavailable_reason`). Cached per process and
    per ``GRIDRL_CPU_KERNELS`` mode ("auto" when unset: used only where :func:`race` says they
    beat oneDNN; "1": always where they build; "0": never)."""
    global _reason
    mode = os.environ.get("GRIDRL_CPU_KERNELS", "auto").strip().lower() or "auto"
    kernels, _reason = _load(mode)
    return kernels


@functools.cache
def _load(mode: str) -> tuple[DecodeKernels | None, str | None]:
    if mode == "0":
        return None, "disabled by GRIDRL_CPU_KERNELS=0"
    if mode not in ("1", "auto"):
        return None, f"GRIDRL_CPU_KERNELS={mode!r} is not one of auto, 1, 0"
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
    if mode == "1":
        return kernels, None
    kernel_s, onednn_s = race(kernels)
    verdict = (f"{kernel_s * 1e3:.2f} ms against oneDNN's {onednn_s * 1e3:.2f} ms on this "
               f"CPU's decode-shaped products; GRIDRL_CPU_KERNELS=1 forces them")
    if kernel_s > KERNEL_HANDICAP * onednn_s:  # bench/decode_kernels.py decides the same
        log.info("cpu kernels slower than oneDNN here, using oneDNN: %s", verdict)
        return None, f"slower than oneDNN here: {verdict}"
    log.info("cpu kernels faster than oneDNN here: %s", verdict)
    return kernels, None


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


def race(kernels: DecodeKernels, repeats: int = 5) -> tuple[float, float]:
    """Seconds the kernels and the path the lean forward falls back to without them
    (:class:`~gridrl.engine.backends.torch_llama.Projection`: oneDNN-prepacked on x86, else
    plain) take for :data:`RACE_SHAPES`, each the best of ``repeats`` interleaved rounds, on
    torch's current threads. Random weights, float32."""
    from gridrl.engine.backends.torch_llama import Projection  # it imports this module

    gen = torch.Generator().manual_seed(0)
    calls = []
    for rows, n, k, swiglu in RACE_SHAPES:
        w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
        packed = pack_weight(w, swiglu=swiglu)
        calls.append((lambda x=x, packed=packed, n=n, swiglu=swiglu:
                      kernels.linear(x, packed, n, swiglu=swiglu),
                      functools.partial(Projection(w, swiglu=swiglu), x)))
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms both paths up
            for side in (0, 1):
                t0 = time.perf_counter()
                for pair in calls:
                    pair[side]()
                best[side] = min(best[side], time.perf_counter() - t0)
    return best[0], best[1]


def pack_weight(weight: torch.Tensor, *, swiglu: bool = False,
                in_scale: torch.Tensor | None = None, drop_source: bool = False) -> torch.Tensor:
    """A weight in the kernel's packed layout (a new float32 tensor, CPU).

    Args:
        weight: (N, K) float, rows = output features (a ``nn.Linear`` weight); for ``swiglu``
            the gate rows ``[0, N/2)`` stacked over the up rows ``[N/2, N)``. A LoRA ``B``
            (N, R) packs the same way with R in place of K.
        swiglu: interleave gate and up blocks (decode.c's swiglu layout).
        in_scale: (K,) multiplies every input column (an RMSNorm weight folded in).
        drop_source: ``weight`` is not read again: where it views a memory-mapped file, its
            pages are handed back as each chunk of rows is packed
            (:func:`~gridrl.engine.backends.torch_memory.drop_mapped_pages`), so packing never
            holds the source and the packed copy in full at once (an output head of a large
            vocabulary: ~100 MB less at the peak of loading for SmolLM2-135M). The values
            are the same either way.
    Returns:
        float32, contiguous: (ceil(N/NB), K, NB), or (ceil(N/2/NB), K, 2 NB) for ``swiglu``;
        padded columns are zero.
    """
    w = weight.detach().to("cpu", torch.float32)
    n, k = w.shape
    halves = 2 if swiglu else 1
    if n % halves:
        raise ValueError(f"swiglu weight has an odd number of rows ({n})")
    width = n // halves
    blocks = -(-width // NB)
    source = w.view(halves, width, k)
    if blocks * NB != width:
        w = torch.cat([source, source.new_zeros(halves, blocks * NB - width, k)], dim=1)
    else:
        w = source
    # (halves, blocks, NB, K) -> (blocks, K, halves, NB), a chunk of ~8 MB of rows at a time
    out = _huge_page_empty((blocks, k, halves * NB))
    w_blocks = w.reshape(halves, blocks, NB, k)
    out_blocks = out.view(blocks, k, halves, NB)
    step = max(1, (8 << 20) // (4 * k * NB * halves))
    scale = None if in_scale is None else in_scale.detach().to("cpu", torch.float32)
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        chunk = out_blocks[b0:b1]
        chunk.copy_(w_blocks[:, b0:b1].permute(1, 3, 0, 2))
        if scale is not None:  # in place: no temporary the size of the weight
            chunk.mul_(scale[None, :, None, None])
        if drop_source:
            drop_mapped_pages(source[h, b0 * NB:b1 * NB] for h in range(halves))
    return out


_F = ctypes.c_void_p
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def _huge_page_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 CPU tensor whose whole 2 MB pages are advised to the kernel
    as transparent huge pages (``madvise(MADV_HUGEPAGE)``; THP's default "madvise" mode backs
    only advised memory with them): a weight streamed once a step then costs ~500x fewer TLB
    misses. Only memory this process allocates is advised; the advice is best-effort."""
    nbytes = 4 * int(torch.Size(shape).numel())
    libc = _libc()
    if libc is None or nbytes < _HUGE_PAGE:
        return torch.empty(shape, dtype=torch.float32)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = raw.data_ptr()
    offset = -start % _HUGE_PAGE
    libc.madvise(start + offset, nbytes // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[offset:offset + nbytes].view(torch.float32).view(shape)


class DecodeKernels:
    """The loaded library: :meth:`linear` and :meth:`attention`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i, f = ctypes.c_int, ctypes.c_float
        fn = lib.gridrl_decode_linear
        fn.restype = i
        fn.argtypes = [_F, i, i, _F, i, _F, i, _F, f, _F, _F, i, _F]
        self._fn = fn
        att = lib.gridrl_decode_attention
        att.restype = i
        att.argtypes = [_F, i, i, i, i, _F, _F, _F, _F, i, i, _F, ctypes.c_long, f, _F]
        self._attention = att

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, *,
               lora: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = -1.0,
               bias: torch.Tensor | None = None, add: torch.Tensor | None = None,
               swiglu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """``decode.c``'s ``gridrl_decode_linear`` (see there for the formula).

        Args:
            x: float32 (M, K), contiguous, CPU.
            packed: :func:`pack_weight` of the (N, K) weight (``swiglu`` likewise).
            n: N, the weight's output rows.
            lora: ``(a, b_packed)``: a float32 (R, K) contiguous, the adapter's A (with the
                same ``in_scale`` as the weight: the LoRA input is the raw ``x``);
                b_packed :func:`pack_weight` of the (N, R) scaled ``B``.
            eps: >= 0: RMSNorm ``x`` first with this epsilon (the norm weight must be folded
                into ``packed``); < 0: no norm.
            bias: float32 (N,) or None. add: float32 (M, N) contiguous or None (may be ``out``).
            swiglu: out = silu(gate) * up, (M, N/2).
            out: where to write (float32 contiguous, right shape); a new tensor if None.
        Returns:
            ``out``: float32 (M, N) or (M, N/2).
        Raises:
            ValueError: shapes or dtypes that do not fit (checked here; the C side re-checks
                its scalar arguments).
        """
        m, k = x.shape
        width = n // 2 if swiglu else n
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("x must be contiguous float32")
        if packed.shape[1] != k:
            raise ValueError(f"packed weight has K={packed.shape[1]}, x has {k}")
        if out is None:
            out = torch.empty((m, width), dtype=torch.float32)
        elif tuple(out.shape) != (m, width) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous ({m}, {width})")
        if add is not None and (tuple(add.shape) != (m, n) or not add.is_contiguous()):
            raise ValueError(f"add must be contiguous ({m}, {n})")
        a_ptr = b_ptr = None
        r = 0
        if lora is not None:
            a, b_packed = lora
            r = a.shape[0]
            if tuple(a.shape) != (r, k) or not a.is_contiguous() or b_packed.shape[1] != r:
                raise ValueError(f"LoRA A {list(a.shape)} / B {list(b_packed.shape)} do not fit")
            a_ptr, b_ptr = a.data_ptr(), b_packed.data_ptr()
        rc = self._fn(x.data_ptr(), m, k, packed.data_ptr(), n, a_ptr, r, b_ptr, eps,
                      None if bias is None else bias.data_ptr(),
                      None if add is None else add.data_ptr(), int(swiglu), out.data_ptr())
        if rc != 0:
            raise ValueError(f"decode_linear refused its arguments (M={m}, K={k}, N={n}, "
                             f"R={r}, swiglu={swiglu})")
        return out

    def attention(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                  cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  column: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """``decode.c``'s ``gridrl_decode_attention``: one decode token's attention.

        Args:
            qkv: float32 (B, (Hq + 2 Hkv) D) contiguous: q heads, k heads, v heads; q and k
                in interleaved-pair rotary order.
            num_heads, num_kv_heads: Hq and Hkv (Hq a multiple of Hkv).
            cos, sin: float32 (B, D/2) contiguous, each row's rotary angles.
            keys, values: the layer's cache, float32 (B, Hkv, W, D) contiguous; the new key
                (rotated) and value are written at ``column``, and the token attends to
                columns ``0..column``.
            mask: None, or float32 additive (B, ...) whose row ``b`` starts at
                ``mask[b]`` with unit stride over the columns (e.g. a (B, 1, 1, L) view).
            scale: multiplies q.k (1.0 when it is folded into the q weights).
        Returns:
            float32 (B, Hq D).
        Raises:
            ValueError: shapes, dtypes or layouts that do not fit.
        """
        b, width = qkv.shape
        hkv = num_kv_heads
        d = width // (num_heads + 2 * hkv)
        tensors = {"qkv": qkv, "cos": cos, "sin": sin, "keys": keys, "values": values}
        for name, t in tensors.items():
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be contiguous float32 on CPU")
        if (d * (num_heads + 2 * hkv) != width or tuple(cos.shape) != (b, d // 2)
                or tuple(sin.shape) != (b, d // 2) or keys.shape != values.shape
                or tuple(keys.shape[:2]) != (b, hkv) or keys.shape[3] != d
                or not 0 <= column < keys.shape[2]):
            raise ValueError(f"attention shapes do not fit: qkv {list(qkv.shape)}, cos "
                             f"{list(cos.shape)}, cache {list(keys.shape)}, column {column}")
        mask_ld = 0
        if mask is not None:
            if (mask.dtype != torch.float32 or mask.shape[0] != b or mask.stride(-1) != 1
                    or mask.shape[-1] < column + 1):
                raise ValueError(f"mask {list(mask.shape)} does not fit {b} rows x "
                                 f"{column + 1} columns")
            mask_ld = mask.stride(0)
        out = torch.empty((b, num_heads * d), dtype=torch.float32)
        rc = self._attention(qkv.data_ptr(), b, num_heads, hkv, d, cos.data_ptr(),
                             sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2],
                             column, None if mask is None else mask.data_ptr(), mask_ld, scale,
                             out.data_ptr())
        if rc != 0:
            raise ValueError(f"decode_attention refused its arguments (B={b}, Hq={num_heads}, "
                             f"Hkv={hkv}, D={d})")
        return out
