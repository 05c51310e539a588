"""The compiled library's interface: DecodeKernels calls decode.c's fused linear and attention
through ctypes, and pack_weight lays a weight out in its blocked layout (NB columns a block;
bfloat16 or float32), in memory advised as transparent huge pages. Building, verifying and
racing the library (whether to use it) is the package's (__init__.py)."""

from __future__ import annotations

import ctypes
import functools

import torch

from gridrl.engine.backends.torch.memory import drop_mapped_pages

#: weight dtypes the kernels read
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NB = 16  # output columns per packed block (decode.c's NB)


def pack_weight(weight: torch.Tensor, *, swiglu: bool = False,
                in_scale: torch.Tensor | None = None, drop_source: bool = False,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A weight in the kernel's packed layout (a new CPU tensor of ``dtype``).

    Args:
        weight: (N, K) float, rows = output features (a ``nn.Linear`` weight); for ``swiglu``
            the gate rows ``[0, N/2)`` stacked over the up rows ``[N/2, N)``. A LoRA ``B``
            (N, R) packs the same way with R in place of K.
        swiglu: interleave gate and up blocks (decode.c's swiglu layout).
        in_scale: (K,) multiplies every input column (an RMSNorm weight folded in); the
            product is taken in float32 and rounded to ``dtype`` once.
        drop_source: ``weight`` is not read again: where it views a memory-mapped file, its
            pages are handed back as each chunk of rows is packed
            (:func:`~gridrl.engine.backends.torch.memory.drop_mapped_pages`), so packing never
            holds the source and the packed copy in full at once (an output head of a large
            vocabulary: ~100 MB less at the peak of loading for SmolLM2-135M). The values
            are the same either way.
        dtype: float32, or bfloat16 (rounded to nearest even: the kernels widen it back to
            float32 as they read it, half the bytes a step).
    Returns:
        ``dtype``, contiguous: (ceil(N/NB), K, NB), or (ceil(N/2/NB), K, 2 NB) for ``swiglu``;
        padded columns are zero.
    Raises:
        ValueError: an odd number of rows for ``swiglu``, or a ``dtype`` the kernels do not
            read.
    """
    if dtype not in DTYPES.values():
        raise ValueError(f"pack_weight: dtype {dtype} is not one of {', '.join(DTYPES)}")
    w = weight.detach().to("cpu")
    if w.dtype != dtype:
        w = w.float()
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
    out = _huge_page_empty((blocks, k, halves * NB), dtype)
    w_blocks = w.reshape(halves, blocks, NB, k)
    out_blocks = out.view(blocks, k, halves, NB)
    step = max(1, (8 << 20) // (4 * k * NB * halves))
    scale = None if in_scale is None else in_scale.detach().to("cpu", torch.float32)
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        chunk = out_blocks[b0:b1]
        rows = w_blocks[:, b0:b1].permute(1, 3, 0, 2)
        if scale is not None and dtype != torch.float32:  # one rounding of w * scale
            chunk.copy_(rows.float() * scale[None, :, None, None])
        else:
            chunk.copy_(rows)
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


def _huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MB pages are advised to the kernel
    as transparent huge pages (``madvise(MADV_HUGEPAGE)``; THP's default "madvise" mode backs
    only advised memory with them): a weight streamed once a step then costs ~500x fewer TLB
    misses. Only memory this process allocates is advised; the advice is best-effort."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * int(torch.Size(shape).numel())
    libc = _libc()
    if libc is None or nbytes < _HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = raw.data_ptr()
    offset = -start % _HUGE_PAGE
    libc.madvise(start + offset, nbytes // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


class DecodeKernels:
    """The loaded library: :meth:`linear` and :meth:`attention`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i, f = ctypes.c_int, ctypes.c_float
        fn = lib.gridrl_decode_linear
        fn.restype = i
        fn.argtypes = [_F, i, i, _F, i, i, _F, i, _F, _F, f, _F, _F, i, _F]
        self._fn = fn
        self._set_dynamic = lib.gridrl_set_dynamic_blocks
        self._set_dynamic.argtypes = [i]
        self._set_dynamic.restype = None
        att = lib.gridrl_decode_attention
        att.restype = i
        att.argtypes = [_F, i, i, i, i, _F, _F, _F, _F, i, i, _F, ctypes.c_long, f, _F]
        self._attention = att

    def set_dynamic_blocks(self, on: bool) -> None:
        """How :meth:`linear` hands column blocks to the OpenMP team, for the whole process:
        statically (False, the default: each thread one contiguous run) or dynamically (True:
        threads take the next block as they finish, so a thread slowed by another process on
        its core does less). The results are the same either way."""
        self._set_dynamic(int(on))

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, *,
               lora: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = -1.0,
               bias: torch.Tensor | None = None, add: torch.Tensor | None = None,
               swiglu: bool = False, out: torch.Tensor | None = None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        """``decode.c``'s ``gridrl_decode_linear`` (see there for the formula).

        Args:
            x: float32 (M, K), contiguous, CPU.
            packed: :func:`pack_weight` of the (N, K) weight (``swiglu`` likewise), float32 or
                bfloat16 (the arithmetic is float32 either way).
            n: N, the weight's output rows.
            lora: ``(a, b_packed)``: a float32 (R, K) contiguous, the adapter's A (with the
                same ``in_scale`` as the weight: the LoRA input is the raw ``x``);
                b_packed :func:`pack_weight` of the (N, R) scaled ``B``.
            eps: >= 0: RMSNorm ``x`` first with this epsilon (the norm weight must be folded
                into ``packed``); < 0: no norm.
            bias: float32 (N,) or None. add: float32 (M, N) contiguous or None (may be ``out``).
            swiglu: out = silu(gate) * up, (M, N/2).
            out: where to write (float32 contiguous, right shape); a new tensor if None.
            segments: with ``lora``: int32 (M, 2) contiguous, row m's LoRA ranks
                ``[segments[m, 0], segments[m, 1])`` (several adapters' factors stacked along
                R, each row using its own; an empty range: no LoRA on that row); None: every
                rank on every row.
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
        if packed.dtype not in (torch.float32, torch.bfloat16) or not packed.is_contiguous():
            raise ValueError(f"packed weight must be contiguous float32 or bfloat16, not "
                             f"{packed.dtype}")
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
            if (tuple(a.shape) != (r, k) or not a.is_contiguous() or b_packed.shape[1] != r
                    or a.dtype != torch.float32 or b_packed.dtype != torch.float32):
                raise ValueError(f"LoRA A {list(a.shape)} / B {list(b_packed.shape)} do not fit")
            a_ptr, b_ptr = a.data_ptr(), b_packed.data_ptr()
        seg_ptr = None
        if segments is not None and lora is not None:
            if (tuple(segments.shape) != (m, 2) or segments.dtype != torch.int32
                    or not segments.is_contiguous()):
                raise ValueError(f"LoRA segments {list(segments.shape)} {segments.dtype} do "
                                 f"not fit ({m}, 2) int32")
            seg_ptr = segments.data_ptr()
        rc = self._fn(x.data_ptr(), m, k, packed.data_ptr(), int(packed.dtype == torch.bfloat16),
                      n, a_ptr, r, b_ptr, seg_ptr, eps,
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
