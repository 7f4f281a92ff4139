"""Kernels, each beside its plain-torch reference. Importable without triton.

`kernels.verify` is the dispatcher function below (it shadows the submodule of the same name as a
package attribute; `from kernels.verify import verify_reference` still works). The kernel itself is
`from kernels.verify_triton import verify_triton`.
"""

from __future__ import annotations

import torch

from kernels import verify_triton as _verify_triton
from kernels.verify import verify_greedy, verify_reference

HAS_TRITON: bool = _verify_triton.HAS_TRITON

__all__ = ["HAS_TRITON", "verify", "verify_greedy", "verify_reference"]


def verify(
    target_probs: torch.Tensor,  # [B, k+1, V] float32
    draft_probs: torch.Tensor,  # [B, k, V] float32
    draft_tokens: torch.Tensor,  # [B, k] int64
    num_draft: torch.Tensor,  # [B] int64
    uniforms: torch.Tensor,  # [B, k+1] float64
) -> tuple[torch.Tensor, torch.Tensor]:  # out_tokens [B, k+1] int64, num_accepted [B] int64
    """Speculative verification: the Triton kernel on CUDA tensors, else the torch reference.

    Both return identical tokens for identical inputs (tests/test_verify.py).
    """
    if HAS_TRITON and target_probs.is_cuda:
        return _verify_triton.verify_triton(target_probs, draft_probs, draft_tokens, num_draft, uniforms)
    return verify_reference(target_probs, draft_probs, draft_tokens, num_draft, uniforms)
