"""Attention, its JVP and its VJP in plain torch on dense ``[B, H, N, N]`` blocks: the probes' path
for logit soft-capping ``c tanh(s / c)``, which the fused kernels do not have (a probe-sized input
keeps the blocks small)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["DenseAttention"]

# The dense path forms probability blocks of at most this many entries per launch
_BLOCK_ENTRIES = 1 << 24


class DenseAttention:
    """``softmax(c tanh(scale q k^T / c) [masked]) v`` for ``q`` ``[B, H, N, d]`` and ``k``, ``v``
    ``[B, H / groups, N, d]`` (query head ``h`` reads key/value head ``h // groups``), at one
    linearization point: :meth:`forward` keeps the probabilities that :meth:`jvp` and :meth:`vjp`
    reuse. ``allowed``: ``[N, N]`` bool, the keys each query attends (None: all); ``softcap`` None
    for none."""

    def __init__(self, scale: float, softcap: Optional[float], groups: int, allowed: Optional[Tensor]):
        self.scale, self.softcap, self.G, self.allowed = scale, softcap, groups, allowed
        self._probs = self._dcap = None

    def _rep(self, t: Tensor) -> Tensor:
        """Key/value heads repeated to the query heads (head ``h`` reads ``h // G``)."""
        return t if self.G == 1 else t.repeat_interleave(self.G, dim=-3)

    def _group_sum(self, t: Tensor) -> Tensor:
        """[.., H, N, d] -> [.., Hkv, N, d]: the transpose of :meth:`_rep`."""
        if self.G == 1:
            return t
        return t.unflatten(-3, (t.shape[-3] // self.G, self.G)).sum(dim=-3)

    def forward(self, q, k, v) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` at ``(q, k, v)``, which becomes the linearization point."""
        s = (q @ self._rep(k).transpose(-1, -2)) * self.scale
        self._dcap = None
        if self.softcap is not None:
            th = torch.tanh(s / self.softcap)
            s = th * self.softcap
            self._dcap = 1 - th * th                    # d(c tanh(s / c)) / ds
        if self.allowed is not None:
            s = s.masked_fill(~self.allowed, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        self._probs = torch.exp(s - lse.unsqueeze(-1))
        return self._probs @ self._rep(v), lse

    def _probe_chunks(self, P: int):
        per = max(1, _BLOCK_ENTRIES // max(1, self._probs.numel()))
        return [(i, min(P, i + per)) for i in range(0, P, per)]

    def jvp(self, q, k, v, tq, tk, tv) -> Tensor:
        """The output tangents ``[P, B, H, N, d]`` of ``P`` tangents ``(tq, tk, tv)``."""
        p, kk, vv = self._probs, self._rep(k), self._rep(v)
        outs = []
        for a, b in self._probe_chunks(tq.shape[0]):
            ds = (tq[a:b] @ kk.transpose(-1, -2) + q @ self._rep(tk[a:b]).transpose(-1, -2)) * self.scale
            if self._dcap is not None:
                ds = ds * self._dcap
            dp = p * (ds - (p * ds).sum(dim=-1, keepdim=True))
            outs.append(dp @ vv + p @ self._rep(tv[a:b]))
        return torch.cat(outs)

    def vjp(self, g, q, k, v) -> tuple[Tensor, Tensor, Tensor]:
        """The cotangents ``(dq, dk, dv)`` of ``P`` output cotangents ``g`` ``[P, B, H, N, d]``."""
        p, kk, vv = self._probs, self._rep(k), self._rep(v)
        dqs, dks, dvs = [], [], []
        for a, b in self._probe_chunks(g.shape[0]):
            ga = g[a:b]
            dvs.append(self._group_sum(p.transpose(-1, -2) @ ga))
            dp = ga @ vv.transpose(-1, -2)
            ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
            if self._dcap is not None:
                ds = ds * self._dcap
            dqs.append((ds @ kk) * self.scale)
            dks.append(self._group_sum(ds.transpose(-1, -2) @ q) * self.scale)
        return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)
