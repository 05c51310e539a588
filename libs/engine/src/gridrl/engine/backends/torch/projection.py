"""One fused projection of the lean forward on the path that needs no compiled kernels: a
weight prepacked for oneDNN on x86 CPUs (float32, or bfloat16 where oneDNN has a bf16 path),
a plain tensor elsewhere; RMSNorm, bias, a LoRA, a residual and SwiGLU folded around the
product. The fused C kernels (:mod:`.cpu_kernels`) replace it where they win the race against
it (:func:`.cpu_kernels.race`)."""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class RowRanks:
    """Which LoRA ranks each row of a batch reads, when several adapters' factors are stacked
    along the rank (a batch whose rows decode with different adapters: one base product for
    the whole batch, one small product over the stacked factors in which each row sees only
    its own adapter's ranks -- the batching of S-LoRA, Sheng et al., arXiv:2311.03285, and
    Punica's segmented products, Chen et al., arXiv:2310.18547; here a row's foreign ranks
    count zero, which adds exact zeros to its sum).

    Attributes:
        segments: int32 (M, 2), row m reads ranks ``[segments[m, 0], segments[m, 1])``
            (an empty range: the base model).
        mask: float32 (M, R): 1 on each row's ranks, 0 elsewhere (the torch path).
    """

    def __init__(self, segments: torch.Tensor, total_rank: int) -> None:
        self.total_rank = total_rank
        self.segments = segments.to(torch.int32).contiguous()
        self.mask = self._mask()

    def _mask(self) -> torch.Tensor:
        ranks = torch.arange(self.total_rank, device=self.segments.device)[None, :]
        lo, hi = self.segments[:, :1], self.segments[:, 1:]
        return ((ranks >= lo) & (ranks < hi)).to(torch.float32)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices of the live rows), in that order."""
        self.segments = self.segments.index_select(0, rows.to(self.segments.device)).contiguous()
        self.mask = self.mask.index_select(0, rows.to(self.mask.device))


@dataclass
class RowLora:
    """A projection's LoRA for a batch of rows with different adapters: the adapters'
    factors stacked along the rank, ``a`` (R, in) and ``b`` (what ``prepare_lora`` makes of
    the stacked Bs), and which ranks each row reads (:class:`RowRanks`, shared by every
    projection whose stacking is the same)."""

    a: torch.Tensor
    b: torch.Tensor
    ranks: RowRanks


def cpu_has_bf16_compute() -> bool:
    """Whether oneDNN has a bfloat16 path on this CPU (AVX-512 BW/VL/DQ, with native dot
    products where AVX-512-bf16 or AMX is present, or AVX-NE-CONVERT). Without one, torch's
    bfloat16 products run far slower than float32's (21x for the demo's update on an
    AVX2-only AMD EPYC, docs/benchmarks.md) and oneDNN refuses to prepack bfloat16 weights."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packable(weight: torch.Tensor) -> bool:
    """oneDNN prepacking: x86 CPUs (where it was measured), float32 weights, and bfloat16
    weights where oneDNN has a bf16 path (:func:`cpu_has_bf16_compute`)."""
    if not (weight.device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available()):
        return False
    if weight.dtype == torch.bfloat16:
        return cpu_has_bf16_compute()
    return weight.dtype == torch.float32


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' LlamaRMSNorm computes it (float32 inside for 16-bit x)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class Projection:
    """One fused projection of a layer, for 2-D ``x`` (N, in):

        h = RMSNorm(x) if ``norm`` is given else x
        y = h W^T (+ b) (+ (h A^T) Bs^T) (+ residual)
        y = silu(y[:, :out/2]) * y[:, out/2:] if ``swiglu``

    in the model dtype. ``W`` is prepacked for oneDNN on CPU (float32 / bfloat16), a plain
    tensor elsewhere (``kind``: "onednn" / "plain"). ``lora`` is None or what
    :meth:`prepare_lora` made: ``(A, Bs_t)``, A (R, in), Bs_t (R, out) = (scale * B)^T; or a
    :class:`RowLora` (each row its own adapter's ranks of stacked factors).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 norm: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
                 batch_hint: int = 8) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.norm, self.eps, self.swiglu = norm, eps, swiglu
        self.dtype = weight.dtype
        self.kind = "onednn" if _packable(weight) else "plain"
        weight = weight.detach().contiguous()
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
                       if self.kind == "onednn" else weight)
        self.lora: tuple[torch.Tensor, torch.Tensor] | RowLora | None = None

    def prepare_lora(self, a: torch.Tensor, bs_t: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's factors for this projection: A (R, in), Bs_t (R, out), float32."""
        return a.to(self.dtype), bs_t.to(self.dtype)

    @staticmethod
    def stack_lora(parts: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several adapters' :meth:`prepare_lora` factors stacked along the rank, in order."""
        return (torch.cat([a for a, _ in parts]).contiguous(),
                torch.cat([b for _, b in parts]).contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``y`` as above; ``residual`` (N, out) is added inside the product's kernel when
        prepacked (one memory pass fewer a residual connection)."""
        h = x if self.norm is None else _rms(x, self.norm, self.eps)
        if self.kind == "onednn":
            if residual is None:
                y = torch.ops.mkldnn._linear_pointwise(h, self.weight, self.bias, "none", [], "")
            else:
                y = torch.ops.mkldnn._linear_pointwise.binary(h, residual, self.weight,
                                                              self.bias, "add")
        elif residual is not None and self.bias is None:
            y = torch.addmm(residual, h, self.weight.t())
        else:
            y = F.linear(h, self.weight, self.bias)
            if residual is not None:
                y += residual
        if isinstance(self.lora, RowLora):
            u = h @ self.lora.a.t()
            u.mul_(self.lora.ranks.mask.to(u.dtype))
            y.addmm_(u, self.lora.b)
        elif self.lora is not None:
            a, bs_t = self.lora
            y.addmm_(h @ a.t(), bs_t)
        if self.swiglu:
            half = y.shape[-1] // 2
            y = F.silu(y[:, :half]) * y[:, half:]
        return y
