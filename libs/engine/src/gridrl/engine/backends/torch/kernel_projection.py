"""One fused projection of the lean forward on the fused CPU kernels (:mod:`.cpu_kernels`):
:class:`KernelProjection`, the same function as :class:`~.projection.Projection` in one
kernel call, where the kernels built, verified and won the race.
"""

from __future__ import annotations

from typing import Any

import torch

from gridrl.engine.backends.torch import cpu_kernels
from gridrl.engine.backends.torch.projection import RowLora


class KernelProjection:
    """:class:`Projection`'s function in one call of the fused CPU kernel
    (``cpu_kernels/decode.c``): the RMSNorm weight is folded into the packed weight
    (and into LoRA's A), the row scale, bias, residual add, LoRA term and SwiGLU are done in
    the product's pass. The residual is updated in place (the result *is* ``residual``).
    Activations, LoRA factors and arithmetic are float32; the packed weight is ``dtype``
    (float32, or bfloat16: half the bytes a decode step reads).
    """

    kind = "kernel"

    def __init__(self, kernels: Any, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 *, norm: torch.Tensor | None = None, eps: float = 0.0,
                 swiglu: bool = False, drop_source: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        self._kernels = kernels
        self.out_features, self.in_features = weight.shape
        self.swiglu = swiglu
        self.norm = None if norm is None else norm.detach().float().clone()
        self.eps = float(eps) if norm is not None else -1.0
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.weight = cpu_kernels.pack_weight(weight, swiglu=swiglu, in_scale=self.norm,
                                              drop_source=drop_source, dtype=dtype)
        self.lora: tuple[torch.Tensor, torch.Tensor] | RowLora | None = None

    def prepare_lora(self, a: torch.Tensor, bs_t: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's factors for this kernel: ``(A' (R, in), packed Bs)``, A' = A with
        the norm weight folded into its columns (the kernel then needs only the raw x)."""
        if self.norm is not None:
            a = a * self.norm
        return a.contiguous(), cpu_kernels.pack_weight(bs_t.t(), swiglu=self.swiglu)

    @staticmethod
    def stack_lora(parts: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several adapters' :meth:`prepare_lora` factors stacked along the rank, in order
        (packed B: ``(blocks, R, NB)``, stacked on its middle axis)."""
        return (torch.cat([a for a, _ in parts]).contiguous(),
                torch.cat([b for _, b in parts], dim=1).contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        lora, segments = self.lora, None
        if isinstance(lora, RowLora):
            lora, segments = (lora.a, lora.b), lora.ranks.segments
        return self._kernels.linear(x.contiguous(), self.weight, self.out_features,
                                    lora=lora, eps=self.eps, bias=self.bias,
                                    add=residual, swiglu=self.swiglu, out=residual,
                                    segments=segments)
