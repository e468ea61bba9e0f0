"""The space a Golub-Kahan-Lanczos run works in: the effective operator (``J`` or ``J^T``, possibly in
projection-output coordinates), its seeded random vectors, norms, and the growing orthonormal bases."""
from __future__ import annotations

import torch
from torch import Tensor

from .operator import JacobianOperator

_FLOOR = 64           # a new Krylov vector of norm below _FLOOR * eps * ||A|| * ||p|| is rounding


def _generator(op: JacobianOperator, seed: int) -> torch.Generator:
    # CPU generator for portability (same stream on any device); tensors are moved afterwards
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(op, size, gen, lead=()):
    return torch.randn(*lead, size, generator=gen, dtype=torch.float64).to(op.device, op.dtype)


class _Effective:
    """The operator ``A`` the bidiagonalization runs on: ``J``, or ``J^T`` when ``J`` is wide on the
    complement of its known nulls (``m' < n'``), so that ``A``'s input side ``E`` is the smaller one.

    ``fwd`` is ``A`` (``E -> F``), ``adj`` is ``A^T``. When ``A = J^T`` and the weights' side is
    cheaper in projection-output coordinates, vectors of ``F`` (the weights) are pairs ``[G; K G]``
    (:meth:`JacobianOperator.coord_rmv`). The known nulls only orient the run and bound its length
    (``rank(J) <= r = min(m', n')``): the Krylov space stays in ``range(A^T)`` by construction, so
    unknown nulls never enter it either."""

    def __init__(self, op: JacobianOperator):
        kin, kout = op.null_dims
        self.op = op
        self.n_c, self.m_c = op.n - kin, op.m - kout
        self.transposed = self.m_c < self.n_c
        self.coords = self.transposed and getattr(op, "projection_coordinates", False)
        if self.coords:
            self.fwd, self.adj = self._coord_fwd, lambda f: op.coord_mv(f[1])
        elif self.transposed:
            self.fwd, self.adj = op.rmv, op.mv
        else:
            self.fwd, self.adj = op.mv, op.rmv
        self.size_in = op.m if self.transposed else op.n
        self.r = min(self.n_c, self.m_c)

    def random_out(self, gen) -> Tensor:
        """A Gaussian vector of ``F`` (a pair ``[G; K G]`` with Gaussian ``G`` in coordinates)."""
        op = self.op
        if self.coords:
            g = _randn(op, op.B * op.N * sum(s[0] for s in op._in_shapes), gen)
            return torch.stack([g, op.coord_gram(g)])
        return _randn(op, op.n if self.transposed else op.m, gen)

    def _coord_fwd(self, e: Tensor) -> Tensor:
        g = self.op.coord_rmv(e)
        return torch.stack([g, self.op.coord_gram(g)])

    def subspace(self) -> str:
        op = self.op
        return (f"sigma_min = the smallest nonzero singular value of J (J on range(J^T)); the Krylov space is "
                f"kept in range(J^T) / range(J) by construction, so null directions of J (known or not: the "
                f"causal mask's early rows, windows, padding, GQA, N < head_dim) never enter it. rank(J) <= "
                f"r = min(m', n') = {self.r}, with n' = {self.n_c} (of n = {op.n}) and m' = {self.m_c} (of "
                f"m = {op.m}) the dimensions of the complements of the known null directions. Known nulls: "
                f"{op.null_description} Operator: {op.description}")


def _norm(w: Tensor) -> Tensor:
    """The norm of a vector, or of a coordinate pair ``[G; K G]`` (``sqrt(<G, K G>)``)."""
    if w.dim() == 2:
        return torch.dot(w[0], w[1]).clamp(min=0).sqrt()
    return torch.linalg.vector_norm(w)


class _Basis:
    """Orthonormal vectors in blocks that grow as needed (at most ``rows``; no per-step re-stacking).

    A vector may also be a coordinate pair ``[2, size]`` = ``[G; K G]`` (the weights' long side in
    projection-output coordinates, see :meth:`JacobianOperator.coord_rmv`), orthonormal in the
    inner product ``<G_1, K G_2>``. Of a pair only ``G`` is kept (half the memory of the run's
    largest store); ``gram`` (``G -> K G``) gives a reorthogonalized pair its second half again."""

    def __init__(self, rows: int, gram=None):
        self.rows, self.k = rows, 0
        self.gram = gram
        self.blocks: list = []
        self._free = 0

    def append(self, v: Tensor):
        if v.dim() == 2:
            v = v[0]
        if self._free == 0:      # the next block as large as all before it (at least 8 rows)
            size = min(max(8, self.k), self.rows - self.k)
            self.blocks.append(v.new_empty(size, *v.shape))
            self._free = size
        blk = self.blocks[-1]
        blk[blk.shape[0] - self._free] = v
        self._free -= 1
        self.k += 1

    def _filled(self):
        for i, blk in enumerate(self.blocks):
            yield blk if i < len(self.blocks) - 1 else blk[: blk.shape[0] - self._free]

    def _remove(self, w: Tensor) -> Tensor:
        # classical Gram-Schmidt over all blocks: every coefficient from the same w
        if w.dim() == 2:     # <Q_i, w> = Q_i . (K G_w); then K G_w of what is left
            g = w[0]
            cs = [(Q, Q @ w[1]) for Q in self._filled()]
            for Q, c in cs:
                g = g - Q.t() @ c
            return torch.stack([g, self.gram(g)])
        cs = [(Q, Q @ w) for Q in self._filled()]
        for Q, c in cs:
            w = w - Q.t() @ c
        return w

    def reorth(self, w: Tensor) -> Tensor:
        """Full reorthogonalization; a second pass only when the first removed most of ``w``
        (Kahan / Parlett: twice is enough, once is when the norm drops by less than 1/sqrt(2))."""
        if self.k:
            before = _norm(w)
            w = self._remove(w)
            if not bool(_norm(w) > 0.7071 * before):
                w = self._remove(w)
        return w

