"""What an attention module applies to Q and K between its projections and the scores, for the probes:
QK-norm (a private copy of the norm, with its JVP and VJP) and RoPE (rotate-half, and its transpose).
"""
from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

from condinit._validate import check_finite

__all__ = ["QKNorm", "rope", "rope_tables"]


class QKNorm:
    """A private copy of a module's ``q_norm`` / ``k_norm`` (weights cast to the compute dtype), with
    its JVP / VJP by :mod:`torch.func` at the captured point.

    ``whole``: the norm reads the projection's ``[.., rows]`` output before the head split (OLMo2);
    otherwise it acts per head on ``[.., heads, head_dim]`` (Qwen3, Gemma-3; a ``[heads, head_dim]``
    weight as in Cohere is applied per head too). The copy's ``forward`` is called directly, so the
    user's module, its hooks and its parameters are never touched.
    """

    def __init__(self, name: str, norm: nn.Module, rows: int, heads: int, d: int, device, dtype):
        if not isinstance(norm, nn.Module) or norm._modules:
            raise ValueError(f"layer: {name} is not a leaf normalization module ({type(norm).__name__})")
        clone = copy.copy(norm)
        clone._parameters = {k: None if t is None else t.detach().to(device, dtype).clone()
                             for k, t in norm._parameters.items()}
        clone._buffers = {k: None if t is None else t.detach().to(device, dtype if t.is_floating_point() else t.dtype)
                          .clone() for k, t in norm._buffers.items()}
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            if hasattr(clone, attr):
                setattr(clone, attr, type(getattr(norm, attr))())
        for k, t in clone._parameters.items():
            if t is not None:
                check_finite(f"layer: {name}.{k}", t)
        w = clone._parameters.get("weight")
        shape = tuple(w.shape) if w is not None else tuple(getattr(norm, "normalized_shape", ()) or ())
        if shape and shape[-1] == d and math.prod(shape) in (d, heads * d):
            self.whole = False
        elif shape == (rows,):
            self.whole = True
        else:
            raise ValueError(f"layer: cannot tell how {name} ({type(norm).__name__}, weight shape {shape}) reads the "
                             f"projection: expected a weight over head_dim = {d} or over all {rows} rows")
        self.name, self.kind, self.heads, self.d = name, type(norm).__name__, heads, d
        self._module = clone
        self._vjp = None
        self.computes_in = self._precision(rows, device, dtype)

    def _precision(self, rows: int, device, dtype) -> torch.dtype:
        """The dtype the norm computes in: float32 where its output at a float64 point equals that at
        the point rounded to float32 (Hugging Face's RMSNorms cast to float32 whatever their input),
        else ``dtype``."""
        if dtype != torch.float64:
            return dtype
        gen = torch.Generator().manual_seed(0)
        y = torch.randn(2, rows, generator=gen, dtype=dtype).to(device)
        with torch.no_grad():
            same = torch.equal(self(y), self(y.float().to(dtype)))
        return torch.float32 if same else dtype

    @property
    def heads_differ(self) -> bool:
        """Whether the per-head norm has a weight per head (``[heads, head_dim]``, Cohere)."""
        w = self._module._parameters.get("weight")
        return not self.whole and w is not None and w.dim() > 1 and math.prod(w.shape) == self.heads * self.d \
            and self.heads > 1

    def for_heads(self, heads: int) -> "QKNorm":
        """The same per-head norm (one weight over ``head_dim``) on ``heads`` heads, its own linearization
        point (the operator of one key/value group)."""
        if self.whole or self.heads_differ:
            raise ValueError(f"{self.name} is not one norm per head")
        other = copy.copy(self)
        other.heads, other._vjp = heads, None
        return other

    def __call__(self, y: Tensor) -> Tensor:
        """``[.., rows]`` -> ``[.., rows]``."""
        if self.whole:
            return self._module.forward(y)
        return self._module.forward(y.unflatten(-1, (self.heads, self.d))).flatten(-2)

    def at(self, y0: Tensor) -> Tensor:
        """Set the linearization point ``y0`` ``[B, N, rows]``; returns the norm's output there."""
        out, self._vjp = torch.func.vjp(self, y0)
        self._y0 = y0
        return out

    def jvp(self, t: Tensor) -> Tensor:
        """``[P, B, N, rows]`` tangents through the norm's Jacobian at ``y0``."""
        return torch.func.vmap(lambda u: torch.func.jvp(self, (self._y0,), (u,))[1])(t)

    def vjp(self, g: Tensor) -> Tensor:
        """``[P, B, N, rows]`` cotangents through the transposed Jacobian."""
        return torch.func.vmap(lambda u: self._vjp(u)[0])(g)

    def describe(self) -> str:
        where = "the whole projection before the head split" if self.whole else "each head"
        return f"{self.name} ({self.kind}, over {where}) through its JVP/VJP"


def rope(y: Tensor, cos: Tensor, sin: Tensor, transpose: bool = False) -> Tensor:
    """Rotary embedding in the rotate-half convention (``y cos + rotate_half(y) sin`` on the first
    ``r = cos.shape[-1]`` channels, the rest passed through), or its transpose. Linear in ``y``, so
    the same map carries tangents; ``y`` ``[.., B, h, N, d]``, ``cos``/``sin`` ``[B, 1, N, r]``."""
    r = cos.shape[-1]
    half = r // 2
    yr = y[..., :r]
    if transpose:
        ys = yr * sin
        out = yr * cos + torch.cat([ys[..., half:], -ys[..., :half]], dim=-1)
    else:
        out = yr * cos + torch.cat([-yr[..., half:], yr[..., :half]], dim=-1) * sin
    return out if r == y.shape[-1] else torch.cat([out, y[..., r:]], dim=-1)


def rope_tables(pe, B: int, N: int, d: int, device, dtype):
    """``(cos, sin)`` as ``[B, 1, N, r]`` in the compute dtype, checked against the input's shape."""
    if not (isinstance(pe, (tuple, list)) and len(pe) == 2 and all(isinstance(t, Tensor) for t in pe)):
        raise TypeError(f"position_embeddings must be a (cos, sin) pair of tensors, got {type(pe).__name__}")
    out = []
    for name, t in zip(("cos", "sin"), pe):
        if t.dim() == 2:
            t = t.unsqueeze(0)
        if t.dim() != 3 or t.shape[0] not in (1, B) or t.shape[1] != N or t.shape[2] > d or t.shape[2] % 2:
            raise ValueError(f"position_embeddings: {name} must be [B or 1, N, r] with N = {N}, r even and "
                             f"<= head_dim = {d}; got shape {tuple(pe[0 if name == 'cos' else 1].shape)}")
        t = t.detach().to(device, dtype).expand(B, N, t.shape[2]).unsqueeze(1).clone()
        check_finite(f"position_embeddings {name}", t)
        out.append(t)
    if out[0].shape != out[1].shape:
        raise ValueError(f"position_embeddings: cos {tuple(out[0].shape)} and sin {tuple(out[1].shape)} differ")
    return tuple(out)

