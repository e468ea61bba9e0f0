"""The known null directions of an attention layer's Jacobian, and the projectors onto their complement.

:class:`KnownNulls` is computed once per :class:`condinit.probe.JacobianOperator` (on first use of
``null_dims``, ``null_description``, ``project_input`` or ``project_output``), so the estimators
can work on the orthogonal complement of directions that are null by construction.

The directions:

* input side (``t`` with ``J t = 0`` exactly):
  ``"qkv"``: the key shifts ``K'_{b,g} = 1 c^T`` (``B Hkv d`` directions; a row-constant shift of
  the scores leaves the softmax unchanged, also with the causal mask);
  ``"input"``: rows of ``dX`` in the null space of the stacked ``[W_Q; W_K; W_V]``, and the shifts
  ``dX_b = 1 u^T`` with ``u`` in ``null([W_Q; W_V])`` (they move every key of sequence ``b`` alike);
  ``"weights"``: rows of ``dW`` in ``null(X)`` (``X`` stacked over the batch, ``[B N, D]``), and the
  key shifts ``dW_K = c w^T`` when ``X w = 1`` is solvable (``1`` in ``range(X)``, e.g. a constant
  feature, LayerNorm with affine parameters) -- both detected numerically from ``X``'s SVD -- and
  the Q/K gauge ``dW_Q,h = E W_Q,h`` (every query head ``h`` of group ``g``), ``dW_K,g = -E^T W_K,g``
  for ``d x d`` matrices ``E`` with ``E b_Q,h = 0`` (any ``E``, with ``dW_Q,h = E (W_Q,h + b_Q,h w^T)``,
  when ``X w = 1``) (``Q K^T`` is invariant under ``Q -> Q A^T``,
  ``K -> K A^{-1}``; up to ``Hkv d^2`` directions). The gauge is projected out exactly by solving a
  ``d x d`` Sylvester equation per key/value head (eigendecompositions, no ``n x n`` matrix).
  (For ``"qkv"`` the same gauge ``dQ = Q E^T, dK = -K E`` exists; it is not projected, which
  changes nothing there since that Jacobian is wide: see :mod:`condinit.probe.estimators`.)
  With RoPE or a k_norm the key shifts are not nulls (each key is rotated / normalized on its
  own); under RoPE the gauge keeps only the ``E`` commuting with every captured rotation (per group
  of planes rotating alike, the complex-linear maps; any map on unrotated channels; with biases
  ``E b_Q,h = 0``, ``E^T b_K,g = 0`` unless ``X w = 1``), projected through its Gram system; with
  QK-norm no gauge is projected (``null_description`` says so).
* output side (``u`` with ``J^T u = 0``): with ``causal`` and ``H > Hkv``, the first query attends
  only the first key, so its output is ``v_0`` for every query head of a group; the differences
  between those heads (``B Hkv (G - 1) d`` directions) are never reached. (Not tracked with
  ``include_output_proj``; the estimators then report the rank deficiency instead.)
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["KnownNulls"]


class KnownNulls:
    """The known null directions of one operator's ``J`` (see the module doc): their dimensions
    (``right_dims`` input side, ``left_dims`` output side), what they are in words (``right``,
    ``left``), and the orthogonal projections onto their complement. Built from the operator's
    copies of ``X`` and the weights, read only."""

    def __init__(self, op):
        self.wrt, self.causal, self.dtype, self.device = op.wrt, op.causal, op.dtype, op.device
        self.B, self.N, self.H, self.Hkv, self.G, self.d, self.D = op.B, op.N, op.H, op.Hkv, op.G, op.d, op.D
        # the weights exist for a module (not for a (q, k, v) triple)
        self.X = op.X
        self._x_cache = op._x_cache
        self.Wq, self.Wk, self.Wv, self.bq, self.bk = (getattr(op, n, None) for n in ("Wq", "Wk", "Wv", "bq", "bk"))
        self._rope_cs, self._split_input = op._rope_cs, op.split_input
        self._has_qk_norm, self._has_k_norm = op.q_norm is not None or op.k_norm is not None, op.k_norm is not None
        self._has_wo = op._wo is not None
        self.right_dims, self.left_dims = 0, 0
        self.right: list = []          # what each input-side null is, in words
        self.left: list = []
        # the operator's J is that of its own copies (op.dtype), not of the source tensors: a singular value
        # of X at the source's rounding is still one of this J
        rtol = _null_rtol(op.dtype)
        f64 = torch.float64
        shifts = self._key_shifts_are_null
        if not shifts:
            self.right.append("(no key-shift nulls: " + ("RoPE rotates" if self._rope_cs is not None else
                                 "k_norm normalizes") + " a shift of all keys differently per key)")
        if self.wrt == "qkv":
            if shifts:
                self.right_dims = self.B * self.Hkv * self.d
                self.right.append(f"key shifts K'_(b,g) = 1 c^T per (batch, kv-head): B*Hkv*d = "
                                     f"{self.right_dims} dims")
        elif self.wrt == "input":
            wall = torch.cat([self.Wq, self.Wk, self.Wv]).to(f64)
            z0 = _null_basis(wall, rtol)                 # [D, z0]
            wqv = torch.cat([self.Wq, self.Wv]).to(f64)
            z1 = _null_basis(wqv, rtol) if shifts else wqv.new_zeros(self.D, 0)
            if z0.shape[1] and z1.shape[1]:
                z1 = _orth(z1 - z0 @ (z0.t() @ z1))
            self._z_row, self._z_shift = z0.to(self.dtype), z1.to(self.dtype)
            if z0.shape[1]:
                k = self.B * self.N * z0.shape[1]
                self.right_dims += k
                self.right.append(f"rows of dX in null([W_Q; W_K; W_V]) ({z0.shape[1]} per token): {k} dims")
            if z1.shape[1]:
                k = self.B * z1.shape[1]
                self.right_dims += k
                self.right.append(f"shifts dX_b = 1 u^T, u in null([W_Q; W_V]) (moves all keys alike): {k} dims")
        else:
            xa = self.X.reshape(-1, self.D).to(f64)
            # all of V is needed for null(X); U only thin (B N x min(B N, D))
            # X's factors are shared by the operators of one input (the key/value blocks of one operator)
            u_x, s, vh = self._cached("svd", lambda: torch.linalg.svd(xa, full_matrices=xa.shape[0] < self.D))
            smax = float(s.max()) if s.numel() else 0.0
            rank = int((s > rtol * smax).sum()) if smax > 0 else 0
            z = vh[rank:].t()                                  # [D, D - rank]
            self._z_row = z.to(self.dtype)
            self._w_shift = self._w_raw = None
            if z.shape[1]:
                k = (self.H + 2 * self.Hkv) * self.d * z.shape[1]
                self.right_dims += k
                self.right.append(f"rows of dW in null(X) (X is [B*N, D] = [{xa.shape[0]}, {self.D}] of rank "
                                     f"{rank}): {k} dims")
            self._w_ones = None
            if rank:
                u, sr, vr = u_x[:, :rank], s[:rank], vh[:rank]
                ones = torch.ones(xa.shape[0], dtype=f64, device=xa.device)
                w = vr.t() @ ((u.t() @ ones) / sr)             # min-norm solution of X w = 1
                res = float(torch.linalg.vector_norm(xa @ w - ones)) / math.sqrt(xa.shape[0])
                if res < max(rtol, 1e-14) * 100:
                    self._w_ones = w
                if res < max(rtol, 1e-14) * 100 and shifts:
                    self._w_shift = (w / torch.linalg.vector_norm(w)).to(self.dtype)
                    self._w_raw = w
                    k = self.Hkv * self.d
                    self.right_dims += k
                    self.right.append(f"key shifts dW_K = c w^T with X w = 1 (1 in range(X), residual "
                                      f"{res:.1e}): Hkv*d = {k} dims")
            self._gauge_mode = self._gauge_kind()
            if self._gauge_mode == "full":
                k = self._setup_gauge()
                what = "E b_Q,h = 0 unless X w = 1"
            elif self._gauge_mode == "rope":
                k = self._setup_gauge_rope()
                what = ("E commuting with every captured RoPE rotation: per frequency plane a I + b J; E b = 0 "
                        "for the Q and K biases unless X w = 1")
            else:
                k = 0
                self.right.append("(no Q/K gauge: QK-norm breaks it; near-null directions such as "
                                     "dW_Q,h = c W_Q,h, null but for the norm's eps, stay in the estimate)")
            if k:
                self.right_dims += k
                self.right.append(f"Q/K gauge dW_Q,h = E W_Q,h, dW_K,g = -E^T W_K,g ({what}): {k} dims")
        if self.causal and self.G > 1 and not self._has_wo:
            k = self.B * self.Hkv * (self.G - 1) * self.d
            self.left_dims = k
            self.left.append(f"causal GQA: the first query's output is v_0 for all {self.G} heads of a group; "
                                f"head differences there are unreachable: B*Hkv*(G-1)*d = {k} dims")
        elif self.causal and self.G > 1:
            self.left.append("causal GQA with W_O: the first query's unreachable directions are not tracked "
                                "(expect a rank-deficient report)")

    def _cached(self, key: str, make):
        """``make()``, computed once per input ``X`` (the cache is shared by the operators built on it)."""
        if key not in self._x_cache:
            self._x_cache[key] = make()
        return self._x_cache[key]

    def _row_projector(self) -> Tensor:
        """``I - Z Z^T`` (float64, ``[D, D]``): the projector onto the complement of ``null(X)``'s rows."""
        def make():
            z = self._z_row.to(torch.float64)
            return torch.eye(self.D, dtype=torch.float64, device=self.device) - z @ z.t()
        return self._cached("row_projector", make)

    @property
    def _key_shifts_are_null(self) -> bool:
        """A shift of all keys by one vector leaves each score row's softmax unchanged, unless RoPE
        (different rotation per key) or a k_norm sits between the projection and the scores."""
        return self._rope_cs is None and not self._has_k_norm

    def _gauge_kind(self) -> Optional[str]:
        if self._has_qk_norm:
            return None
        return "full" if self._rope_cs is None else "rope"

    def _rope_commutant(self) -> Tensor:
        """Basis ``[nb, d, d]`` (float64) of the ``E`` that commute with the RoPE rotation of every
        captured position: per group of planes that rotate alike at all positions, the complex-linear
        maps (``a I + b J`` for a single plane); an arbitrary block on the channels that are never
        rotated (pass-through channels, planes at angle 0 everywhere)."""
        cos, sin = (t.to(torch.float64).reshape(-1, t.shape[-1]) for t in self._rope_cs)   # [B N, r]
        d, r = self.d, cos.shape[-1]
        half = r // 2
        fixed = list(range(r, d))
        groups: list = []            # [(cos column, sin column, [plane indices])]
        for i in range(half):
            c, sn = cos[:, i], sin[:, i]
            if bool((c == 1).all()) and bool((sn == 0).all()):
                fixed += [i, i + half]
                continue
            for gc, gs, planes in groups:
                if torch.equal(gc, c) and torch.equal(gs, sn):
                    planes.append(i)
                    break
            else:
                groups.append((c, sn, [i]))
        basis = []
        for a in fixed:
            for b in fixed:
                e = torch.zeros(d, d, dtype=torch.float64)
                e[a, b] = 1
                basis.append(e)
        for _, _, planes in groups:
            for l in planes:
                for k in planes:
                    re = torch.zeros(d, d, dtype=torch.float64)
                    re[l, k] = re[l + half, k + half] = 1              # z_k -> z_l
                    im = torch.zeros(d, d, dtype=torch.float64)
                    im[l, k + half], im[l + half, k] = -1, 1           # z_k -> i z_l
                    basis += [re, im]
        return torch.stack(basis).to(self.device) if basis else torch.zeros(0, d, d, dtype=torch.float64,
                                                                            device=self.device)

    def _setup_gauge_rope(self) -> int:
        """The Q/K gauge under RoPE: ``E`` restricted to the rotations' commutant (and to ``E b_Q,h = 0``,
        ``E^T b_K,g = 0`` unless ``X w = 1`` folds the biases in). Per key/value head, the projection
        is ``t -= N (N^T N)^+ N^T t`` in the coordinates of that basis (Gram matrices from ``d x d``
        products only)."""
        f64 = torch.float64
        Hkv, G, d, D = self.Hkv, self.G, self.d, self.D
        basis = self._rope_commutant()                                # [nb, d, d]
        pi = self._row_projector()
        wq, wk = self.Wq.to(f64), self.Wk.to(f64)
        bq = None if self.bq is None else self.bq.to(f64)
        bk = None if self.bk is None else self.bk.to(f64)
        if self._w_ones is not None:
            # X w = 1: the biases are weight columns, E acts on them as on the weights
            if bq is not None:
                wq, bq = wq + torch.outer(bq, self._w_ones), None
            if bk is not None:
                wk, bk = wk + torch.outer(bk, self._w_ones), None
        amax = float(torch.maximum(wq.abs().max(), wk.abs().max()))
        if amax > 0:
            unit = math.ldexp(1.0, -max(-1000, min(1000, math.frexp(amax)[1])))
            wq, wk = wq * unit, wk * unit
        wq = (wq @ pi).reshape(Hkv, G, d, D)
        wk = (wk @ pi).reshape(Hkv, d, D)
        A = torch.einsum("gjdD,gjeD->gde", wq, wq)
        C = wk @ wk.transpose(-1, -2)
        nb = basis.shape[0]
        coords = []
        for g in range(Hkv):
            cons = []
            if bq is not None:
                cons.append(torch.einsum("aij,hj->hia", basis, bq.reshape(Hkv, G, d)[g]).reshape(-1, nb))
            if bk is not None:
                cons.append(torch.einsum("aji,j->ia", basis, bk.reshape(Hkv, d)[g]))
            if cons and nb:
                M = torch.cat(cons)
                _, sv, vh = torch.linalg.svd(M, full_matrices=True)
                rank = int((sv > 1e-12 * max(float(sv.max()), 1e-300)).sum()) if sv.numel() else 0
                coords.append(vh[rank:].t())                          # [nb, nc]: E b = 0
            else:
                coords.append(torch.eye(nb, dtype=f64, device=self.device))
        nc = max((c.shape[1] for c in coords), default=0)
        F = torch.zeros(Hkv, nc, d, d, dtype=f64, device=self.device)
        for g, c in enumerate(coords):
            F[g, :c.shape[1]] = torch.einsum("ac,aij->cij", c, basis)
        # gram[g, a, b] = <F_a, F_b A> + <F_a, C^T F_b> (Frobenius, per group), as batched matmuls: the
        # three-operand einsum would form a [Hkv, nc, d, d, d]-sized intermediate
        Ff = F.flatten(2)
        gram = Ff @ (F @ A.unsqueeze(1)).flatten(2).mT + Ff @ (C.mT.unsqueeze(1) @ F).flatten(2).mT
        lam, U = torch.linalg.eigh(gram)
        keep = lam > 1e-12 * max(float(lam.max()) if lam.numel() else 0.0, 1.0)
        inv = torch.where(keep, 1.0 / torch.where(keep, lam, torch.ones_like(lam)), torch.zeros_like(lam))
        Minv = U @ (inv.unsqueeze(-1) * U.transpose(-1, -2))
        cd = self.dtype
        self._gauge_rope = (wq.to(cd), wk.to(cd), F.to(cd), Minv.to(cd))
        return int(keep.sum())

    def _project_gauge_rope(self, tq: Tensor, tk: Tensor) -> tuple[Tensor, Tensor]:
        wq, wk, F, Minv = self._gauge_rope
        Hkv, G, d, D = self.Hkv, self.G, self.d, self.D
        lead = tq.shape[:-2]
        TQ = tq.reshape(*lead, Hkv, G, d, D)
        TK = tk.reshape(*lead, Hkv, d, D)
        R = torch.einsum("...gjdD,gjeD->...gde", TQ, wq) - torch.einsum("gdD,...geD->...gde", wk, TK)
        c = torch.einsum("gaij,...gij->...ga", F, R)
        c = torch.einsum("gab,...gb->...ga", Minv, c)
        E = torch.einsum("gaij,...ga->...gij", F, c)
        TQ = TQ - torch.einsum("...gde,gjeD->...gjdD", E, wq)
        TK = TK + torch.einsum("...ged,geD->...gdD", E, wk)
        return TQ.reshape(tq.shape), TK.reshape(tk.shape)

    def _setup_gauge(self) -> int:
        """Eigendecompositions for the gauge projection, on the weights as seen through the other
        (already projected) input-side nulls; returns the gauge's dimension."""
        f64 = torch.float64
        Hkv, G, d, D = self.Hkv, self.G, self.d, self.D
        pi_q = self._row_projector()
        pi_k = pi_q.clone()
        if self._w_shift is not None:
            w = self._w_shift.to(f64)
            pi_k = pi_k - torch.outer(w, w)
        wq = self.Wq.to(f64)
        if self._w_raw is not None and self.bq is not None:
            # X w = 1: the bias is a weight column, dW_Q = E (W_Q + b_Q w^T) gives Q' = Q E^T exactly
            wq = wq + torch.outer(self.bq.to(f64), self._w_raw)
        wk = self.Wk.to(f64)
        # one common power of two for W_Q and W_K (largest entry in [0.5, 1)) keeps the Gram matrices
        # below in range for any weight scale; the projection is invariant under it (E scales by its
        # inverse), and exact. Taken before projecting, so that a W~ that is rounding noise (X ~ 0)
        # stays small against the absolute floor of the zero test below.
        amax = float(torch.maximum(wq.abs().max(), wk.abs().max()))
        if amax > 0:
            unit = math.ldexp(1.0, -max(-1000, min(1000, math.frexp(amax)[1])))
            wq, wk = wq * unit, wk * unit
        wq = (wq @ pi_q).reshape(Hkv, G, d, D)                        # W~_Q per group
        wk = (wk @ pi_k).reshape(Hkv, d, D)
        A = torch.einsum("gjdD,gjeD->gde", wq, wq)                   # sum_h W~_Q,h W~_Q,h^T
        C = wk @ wk.transpose(-1, -2)
        # E restricted to E b_Q,h = 0: Pi = I - projector onto span{b_Q,h : h in g}
        pi = torch.eye(d, dtype=f64, device=self.device).expand(Hkv, d, d).clone()
        if self.bq is not None and self._w_raw is None:
            bq = self.bq.to(f64).reshape(Hkv, G, d).transpose(-1, -2)  # [Hkv, d, G]
            for g in range(Hkv):
                basis = _orth(bq[g]) if float(bq[g].abs().max()) > 0 else bq[g][:, :0]
                pi[g] -= basis @ basis.t()
        shift = 1.0 + float(A.abs().max()) + float(C.abs().max())
        # bias directions get eigenvalue -shift, separating them from A's own null directions
        la, ua = torch.linalg.eigh(pi @ A @ pi - shift * (torch.eye(d, dtype=f64, device=self.device) - pi))
        lc, uc = torch.linalg.eigh(C)
        den = lc.unsqueeze(-1) + la.unsqueeze(-2)                     # [Hkv, d, d]
        # zero test relative to the largest eigenvalue, but never below shift (> 1 and > |A|, |C| with
        # the scaled weights): the eigensolver's noise is ~ eps * shift (the bias term), so A = C = 0
        # (x = 0) gives no gauge at all, and a W~ of rounding noise none either
        keep = (la > -shift / 2).unsqueeze(-2) & (den > 1e-12 * max(float(la.max()), float(lc.max()), shift))
        inv = torch.where(keep, 1.0 / torch.where(keep, den, torch.ones_like(den)), torch.zeros_like(den))
        cd = self.dtype
        self._gauge = (wq.to(cd), wk.to(cd), pi.to(cd), ua.to(cd), uc.to(cd), inv.to(cd))
        return int(keep.sum())

    def _project_gauge(self, tq: Tensor, tk: Tensor) -> tuple[Tensor, Tensor]:
        """Remove the gauge component: t -= N (N^T N)^+ N^T t, N E = (E W~_Q,h, -E^T W~_K,g)."""
        wq, wk, pi, ua, uc, inv = self._gauge
        Hkv, G, d, D = self.Hkv, self.G, self.d, self.D
        lead = tq.shape[:-2]
        TQ = tq.reshape(*lead, Hkv, G, d, D)
        TK = tk.reshape(*lead, Hkv, d, D)
        R = torch.einsum("...gjdD,gjeD->...gde", TQ, wq) - torch.einsum("gdD,...geD->...gde", wk, TK)
        R = R @ pi
        F = uc @ ((uc.transpose(-1, -2) @ R @ ua) * inv) @ ua.transpose(-1, -2)
        E = F @ pi                                                      # solves E Pi A Pi + C E = R Pi
        TQ = TQ - torch.einsum("...gde,gjeD->...gjdD", E, wq)
        TK = TK + torch.einsum("...ged,geD->...gdD", E, wk)
        return TQ.reshape(tq.shape), TK.reshape(tk.shape)

    def description(self) -> str:
        r = "; ".join(self.right) or "none"
        l = "; ".join(self.left) or "none"
        return f"input side: {r}. output side: {l}."

    def project_input(self, T: Tensor) -> Tensor:
        """Orthogonal projection of ``[..., n]`` (in the compute dtype) onto the complement of the
        input-side nulls."""
        parts = list(self._split_input(T))
        if self.wrt == "qkv":
            if self._key_shifts_are_null:
                parts[1] = parts[1] - parts[1].mean(dim=-2, keepdim=True)
        elif self.wrt == "input":
            dX = parts[0]
            if self._z_row.shape[1]:
                dX = dX - (dX @ self._z_row) @ self._z_row.t()
            if self._z_shift.shape[1]:
                m = dX.mean(dim=-2, keepdim=True)
                dX = dX - (m @ self._z_shift) @ self._z_shift.t()
            parts[0] = dX
        else:
            if self._z_row.shape[1]:
                parts = [p - (p @ self._z_row) @ self._z_row.t() for p in parts]
            if self._w_shift is not None:
                w = self._w_shift
                parts[1] = parts[1] - (parts[1] @ w).unsqueeze(-1) * w
            if self._gauge_mode == "full":
                parts[0], parts[1] = self._project_gauge(parts[0], parts[1])
            elif self._gauge_mode == "rope":
                parts[0], parts[1] = self._project_gauge_rope(parts[0], parts[1])
        lead = T.shape[:-1]
        return torch.cat([p.reshape(*lead, -1) for p in parts], dim=-1)

    def project_output(self, U: Tensor) -> Tensor:
        """Orthogonal projection of ``[..., m]`` (in the compute dtype) onto the complement of the
        output-side nulls."""
        if not self.left_dims:
            return U
        lead = U.shape[:-1]
        y = U.reshape(*lead, self.B, self.Hkv, self.G, self.N, self.d)
        row0 = y[..., :1, :].mean(dim=-3, keepdim=True).expand_as(y[..., :1, :])
        y = torch.cat([row0, y[..., 1:, :]], dim=-2)
        return y.reshape(*lead, -1)


def _null_basis(w: Tensor, rtol: float) -> Tensor:
    """Orthonormal basis of null(w) for w [r, D] (float64)."""
    _, s, vh = torch.linalg.svd(w, full_matrices=True)
    smax = float(s.max()) if s.numel() else 0.0
    rank = int((s > rtol * smax).sum()) if smax > 0 else 0
    return vh[rank:].t()


def _null_rtol(dtype: torch.dtype) -> float:
    """Relative size below which a singular value of X / W counts as zero in ``dtype`` (the operator's)."""
    return 1e-12 if dtype == torch.float64 else (1e-6 if dtype == torch.float32 else 1e-3)


def _orth(a: Tensor) -> Tensor:
    """Orthonormal basis of the column span of ``a`` (float64, columns with tiny R dropped)."""
    if a.shape[1] == 0:
        return a
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    keep = s > s.max() * 1e-10 if s.numel() else s.bool()
    return u[:, keep]
