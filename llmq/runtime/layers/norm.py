"""RMSNorm, computed in float32 like the reference implementation (on CPU by llmq's kernel, in one pass)."""

from __future__ import annotations

import torch
from torch import nn

from . import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.usable(x):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        return self.eager(x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """PyTorch's operations: the reference the kernel is tested against, and the path off the CPU."""
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
