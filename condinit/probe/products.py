"""The products of :class:`~condinit.probe.JacobianOperator`: ``J t`` (fused JVPs, several probes per
launch), ``J^T u`` (the flash VJP), the weights' side in projection-output coordinates, and the primal."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .autocast import no_autocast
from .dense import DenseAttention
from .transforms import rope


class OperatorProducts:
    """The products of :class:`~condinit.probe.JacobianOperator` (which sets the layout they read:
    ``B, N, H, Hkv, d, D``, ``X`` and the weights or ``_qkv_given``, the transforms, the backends)."""

    @no_autocast
    def _primal(self):
        """(q, k, v, out, lse) at the linearization point (q, k after QK-norm and RoPE); computed once,
        no graph."""
        if self._primals is None:
            with torch.no_grad():
                if self._qkv_given is not None:
                    q, k, v = self._qkv_given
                else:
                    q_lin, k_lin, v_lin = (self._lin(self.X, w, b) for w, b in
                                           ((self.Wq, self.bq), (self.Wk, self.bk), (self.Wv, self.bv)))
                    q = self._qk_primal(q_lin, self.q_norm, self.H)
                    k = self._qk_primal(k_lin, self.k_norm, self.Hkv)
                    v = self._heads(v_lin, self.Hkv)
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
                if self.dense_path:
                    self._dense = DenseAttention(self.scale, self.softcap, self.G, self.allowed_keys(0, self.N))
                    out, lse = self._dense.forward(q, k, v)
                else:
                    out, lse = torch.ops.condinit.attention_fwd(q, k, v, self.causal, self.scale, *self._mask,
                                                                self._impls["attention_fwd"])
            self._primals = (q, k, v, out, lse)
        return self._primals

    def _qk_primal(self, y: Tensor, norm, h: int) -> Tensor:
        if norm is not None:
            y = norm.at(y)
        y = self._heads(y, h)
        return y if self._rope_cs is None else rope(y, *self._rope_cs)

    def _qk_tangent(self, t: Tensor, norm, h: int) -> Tensor:
        """Projection tangents ``[P, B, N, rows]`` -> tangents of the rotated heads ``[P, B, h, N, d]``."""
        if norm is not None:
            t = norm.jvp(t)
        t = self._heads(t, h)
        return t if self._rope_cs is None else rope(t, *self._rope_cs)

    def _qk_cotangent(self, g: Tensor, norm) -> Tensor:
        """Cotangents of the rotated heads ``[P, B, h, N, d]`` -> of the projection ``[P, B, N, rows]``."""
        if self._rope_cs is not None:
            g = rope(g, *self._rope_cs, transpose=True)
        g = self._unheads(g)
        return g if norm is None else norm.vjp(g)

    # -- masks and the head layout --------------------------------------------------------------

    def allowed_keys(self, i0: int, i1: int) -> Optional[Tensor]:
        """``[i1 - i0, N]`` bool: the keys queries ``i0 .. i1 - 1`` attend (causal, window), or None for all."""
        if not self.causal and self.window is None:
            return None
        i = torch.arange(i0, i1, device=self.device).unsqueeze(1)
        j = torch.arange(self.N, device=self.device).unsqueeze(0)
        ok = torch.ones(i1 - i0, self.N, dtype=torch.bool, device=self.device)
        if self.causal:
            ok &= j <= i
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                ok &= j >= i - left
            if right >= 0:
                ok &= j <= i + right
        return ok

    @staticmethod
    def _lin(x, w, b):
        y = x @ w.t()
        return y if b is None else y + b

    def _heads(self, y: Tensor, h: int) -> Tensor:
        """[..., B, N, h d] -> [..., B, h, N, d]."""
        *lead, B, N, _ = y.shape
        return y.reshape(*lead, B, N, h, self.d).transpose(-2, -3)

    def _unheads(self, y: Tensor) -> Tensor:
        """[..., B, h, N, d] -> [..., B, N, h d]."""
        *lead, B, h, N, d = y.shape
        return y.transpose(-2, -3).reshape(*lead, B, N, h * d)

    # -- vector plumbing ------------------------------------------------------------------------

    @staticmethod
    def _check_real(t: Tensor, name: str) -> None:
        # J is real: casting a complex vector to the compute dtype would silently drop its imaginary part
        if t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be a real (floating-point or integer) tensor, got {t.dtype}")

    def _as_tensor(self, t, size: int, name: str) -> Tensor:
        if isinstance(t, (tuple, list)):
            t = torch.cat([torch.as_tensor(p).reshape(-1) for p in t])
        t = torch.as_tensor(t)
        self._check_real(t, name)
        if t.dim() != 1 or t.shape[0] != size:
            raise ValueError(f"{name} must be a vector of length {size}, got shape {tuple(t.shape)}")
        return t.to(self.device, self.dtype)

    def _as_block(self, T, size: int, name: str) -> Tensor:
        T = torch.as_tensor(T)
        self._check_real(T, name)
        if T.dim() != 2 or T.shape[0] != size:
            raise ValueError(f"{name} must be [{size}, P], got shape {tuple(T.shape)}")
        return T.to(self.device, self.dtype)

    def split_input(self, t: Tensor) -> tuple:
        """Flat ``[..., n]`` -> the structured pieces (``(dW_Q, dW_K, dW_V)``, ``(dX,)`` or ``(dQ, dK, dV)``)."""
        lead = t.shape[:-1]
        return tuple(p.reshape(*lead, *s) for p, s in zip(t.split(self._in_sizes, dim=-1), self._in_shapes))

    # -- forward mode ---------------------------------------------------------------------------

    def _tangents(self, T: Tensor):
        """[P, n] -> (tq, tk, tv), each [P, B, H or Hkv, N, d] (q, k after QK-norm and RoPE)."""
        parts = self.split_input(T)
        if self._qkv_given is not None:
            return parts
        if self.wrt == "qkv":
            lin = tuple(self._unheads(t) for t in parts)
        elif self.wrt == "input":
            (dX,) = parts
            lin = tuple(dX @ w.t() for w in (self.Wq, self.Wk, self.Wv))
        else:
            lin = tuple(torch.matmul(self.X, dw.transpose(-1, -2).unsqueeze(-3)) for dw in parts)
        return (self._qk_tangent(lin[0], self.q_norm, self.H), self._qk_tangent(lin[1], self.k_norm, self.Hkv),
                self._heads(lin[2], self.Hkv))

    def _outputs(self, tout: Tensor) -> Tensor:
        """[P, B, H, N, d] -> [P, m]."""
        P = tout.shape[0]
        if self._wo is not None:
            return (self._unheads(tout) @ self._wo.t()).reshape(P, -1)
        return tout.reshape(P, -1)

    @no_autocast
    def _matmat_rows(self, T: Tensor) -> Tensor:
        """[P, n] -> [P, m]: one fused multi-probe JVP launch."""
        return self._jvp_outputs(self._tangents(T))

    def _jvp_outputs(self, tangents) -> Tensor:
        q, k, v, _, _ = self._primal()
        with torch.no_grad():
            tq, tk, tv = (t.contiguous() for t in tangents)
            if self.dense_path:
                tout = self._dense.jvp(q, k, v, tq, tk, tv)
            else:
                _, tout, _ = torch.ops.condinit.attention_jvp(q, k, v, tq, tk, tv, self.causal, self.scale,
                                                              *self._mask, self._impls["attention_jvp"])
            return self._outputs(tout)

    def mv(self, t) -> Tensor:
        """``J t`` (one fused JVP). ``t``: ``[n]`` or the tuple of pieces (flattened in order)."""
        t = self._as_tensor(t, self.n, "t")
        return self._matmat_rows(t.unsqueeze(0))[0]

    def matmat(self, T) -> Tensor:
        """``J T`` for ``T`` ``[n, P]``: the ``P`` columns go through one multi-probe JVP launch."""
        T = self._as_block(T, self.n, "T")
        return self._matmat_rows(T.t()).t()

    # -- reverse mode ---------------------------------------------------------------------------

    # -- the weights' Jacobian in projection-output coordinates ----------------------------------
    # For wrt="weights", J^T u = (G_Q^T X, G_K^T X, G_V^T X) with G the cotangents of the projections'
    # outputs ([B N, rows]), and J applied to such a vector needs the tangents X dW^T = K G with
    # K = X X^T ([B N, B N]); <dW_1, dW_2> = <G_1, K G_2>. The estimators can run on the long side
    # in these coordinates: one K G product per step instead of X dW^T and G^T X.

    @property
    def projection_coordinates(self) -> bool:
        """Whether the projection-output coordinates are cheaper here (wrt="weights", B N < 2 D)."""
        return self.wrt == "weights" and self._qkv_given is None and self.B * self.N < 2 * self.D

    def _gram(self) -> Tensor:
        if getattr(self, "_K", None) is None:
            xf = self.X.reshape(-1, self.D)
            self._K = xf @ xf.t()
        return self._K

    @no_autocast
    def coord_rmv(self, u: Tensor) -> Tensor:
        """``G`` with ``J^T u = G^T X`` (flat ``[B N rows]``, rows = ``(H + 2 Hkv) d``)."""
        lin = self._cotangents(u.reshape(1, -1))
        return torch.cat(lin, dim=-1).reshape(-1)

    @no_autocast
    def coord_gram(self, g: Tensor) -> Tensor:
        """``K G`` (flat): the tangents ``X dW^T`` of ``dW = G^T X``, and ``<G', K G>`` its inner products."""
        with torch.no_grad():
            return (self._gram() @ g.reshape(self.B * self.N, -1)).reshape(-1)

    @no_autocast
    def coord_mv(self, h: Tensor) -> Tensor:
        """``J dW`` for ``dW = G^T X`` given ``h = K G`` (flat)."""
        with torch.no_grad():
            lin = h.reshape(1, self.B, self.N, -1).split(tuple(s[0] for s in self._in_shapes), dim=-1)
            tangents = (self._qk_tangent(lin[0], self.q_norm, self.H), self._qk_tangent(lin[1], self.k_norm, self.Hkv),
                        self._heads(lin[2], self.Hkv))
            return self._jvp_outputs(tangents)[0]

    def coord_to_input(self, g: Tensor) -> Tensor:
        """The weight vector ``G^T X`` (flat ``[n]``) of coordinates ``g``."""
        lin = g.reshape(1, self.B, self.N, -1).split(tuple(s[0] for s in self._in_shapes), dim=-1)
        return torch.cat([torch.einsum("pbnk,bnD->pkD", l, self.X).reshape(1, -1) for l in lin], dim=1)[0]

    def _head_cotangents(self, U: Tensor):
        """[P, m] -> the per-head cotangents (dq, dk, dv) of the attention's inputs, each
        [P, B, heads, N, d]: the flash VJP with the probes folded into the batch."""
        q, k, v, out, lse = self._primal()
        P = U.shape[0]
        with torch.no_grad():
            if self._wo is not None:
                dO = self._heads(U.reshape(P, self.B, self.N, -1) @ self._wo, self.H)
            else:
                dO = U.reshape(P, self.B, self.H, self.N, self.d)
            if self.dense_path:
                return self._dense.vjp(dO, q, k, v)
            rep = lambda t: t.expand(P, *t.shape).reshape(P * t.shape[0], *t.shape[1:])  # noqa: E731
            dq, dk, dv = torch.ops.condinit.attention_bwd(
                dO.reshape(P * self.B, self.H, self.N, self.d).contiguous(), rep(q), rep(k), rep(v), rep(out),
                rep(lse), self.causal, self.scale, *self._mask, self._impls["attention_bwd"])
            return tuple(t.reshape(P, self.B, *t.shape[1:]) for t in (dq, dk, dv))

    def _cotangents(self, U: Tensor):
        """[P, m] -> cotangents of the projections' outputs, each [P, B, N, rows] (back through
        RoPE and QK-norm)."""
        dq, dk, dv = self._head_cotangents(U)
        with torch.no_grad():
            return (self._qk_cotangent(dq, self.q_norm), self._qk_cotangent(dk, self.k_norm), self._unheads(dv))

    @no_autocast
    def _rmatmat_rows(self, U: Tensor) -> Tensor:
        """[P, m] -> [P, n]: the flash VJP with the probes folded into the batch."""
        P = U.shape[0]
        with torch.no_grad():
            if self._qkv_given is not None:
                parts = self._head_cotangents(U)
            else:
                lin = self._cotangents(U)      # [P, B, N, rows] per projection
                if self.wrt == "qkv":
                    parts = tuple(self._heads(g, h) for g, h in zip(lin, (self.H, self.Hkv, self.Hkv)))
                elif self.wrt == "input":
                    parts = (sum(g @ w for g, w in zip(lin, (self.Wq, self.Wk, self.Wv))),)
                else:   # dW = sum_b dQ_b^T X_b
                    parts = tuple(torch.einsum("pbnk,bnD->pkD", g, self.X) for g in lin)
            return torch.cat([p.reshape(P, -1) for p in parts], dim=1)

    def rmv(self, u) -> Tensor:
        """``J^T u`` (one flash VJP)."""
        u = self._as_tensor(u, self.m, "u")
        return self._rmatmat_rows(u.unsqueeze(0))[0]

    def rmatmat(self, U) -> Tensor:
        """``J^T U`` for ``U`` ``[m, P]`` (one VJP launch with the probes folded into the batch)."""
        U = self._as_block(U, self.m, "U")
        return self._rmatmat_rows(U.t()).t()
