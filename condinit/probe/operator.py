"""The Jacobian of one attention layer as a matrix-free linear operator.

Derivations: ``docs/design.md``, "The attention Jacobian".

For an attention layer with input ``X`` ``[B, N, D]`` and, per head ``h`` (key/value head ``g(h)``
under grouped-query attention)::

    Q_h = X W_Q,h^T + b_Q,h      K_g = X W_K,g^T + b_K,g      V_g = X W_V,g^T + b_V,g
    O_h = softmax(s Q_h K_g^T [+ causal mask]) V_g                       (the paper's A(X) per head)

(weights in ``nn.Linear``'s ``[out, in]`` layout, ``s`` the layer's own scale), the operator is the
Jacobian of ``O = [O_1, ..., O_H]`` (``[B, H, N, d]``, flattened in that order) -- *before* the
output projection ``W_O`` -- or, with ``include_output_proj=True``, of ``concat_h(O_h) W_O^T``
(``[B, N, D_out]``). With ``transforms="module"`` (the default) ``Q_h`` and ``K_g`` then go through
what the module applies before the scores (its :class:`~condinit.models.spec.AttentionDetails`, read
from its attributes when it is described, Hugging Face naming; :mod:`condinit.probe.transforms`):
``q_norm`` / ``k_norm`` (per head, or on the whole projection before the head split as in OLMo2;
tangents through the norm's JVP, cotangents through its VJP, by :mod:`torch.func` on a private copy),
RoPE in the rotate-half convention with the ``position_embeddings`` ``(cos, sin)`` the module was
called with (linear: the same rotation carries the tangents, its transpose the cotangents), a
sliding window (``sliding_window``; the fused kernels' ``window``), logit soft-capping
``c tanh(s / c)`` (``attn_logit_softcapping``; not in the fused kernels, so such a layer's attention,
JVP and VJP run in plain torch on dense ``[B, H, N, N]`` blocks, :mod:`condinit.probe.dense`), and the
module's own ``scaling``.
:attr:`JacobianOperator.description` names what is modelled and what is not (padding masks,
position biases, dropout, RoPE without ``position_embeddings``); ``transforms="none"`` is the
paper's bare ``A(X)``.

``wrt`` picks the variables:

* ``"weights"``: ``t = (dW_Q, dW_K, dW_V)`` flattened (``[H d, D]``, ``[Hkv d, D]``,
  ``[Hkv d, D]``), ``Q' = X dW_Q^T`` etc.; the paper's ``J = [dA/dW_Q, dA/dW_K, dA/dW_V]``.
* ``"input"``: ``t = dX`` ``[B, N, D]``.
* ``"qkv"``: ``t = (dQ, dK, dV)`` flattened (``[B, H, N, d]``, ``[B, Hkv, N, d]`` x 2; for a
  module, of its projections' outputs, before QK-norm and RoPE); also the only choice for a bare
  ``(q, k, v)`` triple.

``mv`` is one fused JVP (:func:`condinit.attention_jvp`), ``matmat`` one multi-probe launch of it
(``P`` tangents share the primal tiles), ``rmv`` / ``rmatmat`` the flash VJP (the backward of
:func:`condinit.attention`, called on the saved log-sum-exp; probes are folded into the batch) and
then ``X^T dQ`` (weights) or ``dQ W_Q`` (input); they live in :mod:`condinit.probe.products`. Where ``J``
is block diagonal over the key/value groups, :meth:`JacobianOperator.kv_blocks` gives the blocks.

Known null directions (:mod:`condinit.probe.nulls`) are exposed as orthogonal projectors
(``project_input``, ``project_output``, ``null_dims``, ``null_description``), so the estimators can
work on their orthogonal complement.

The operator never modifies the layer (weights and ``x`` are copied, detached, at construction,
so later optimizer steps do not change it), keeps no autograd graph, and draws no random numbers.
It computes in its own ``dtype`` whatever the caller's autocast state (autocast is switched off
inside its methods), and it is built only from finite data: NaN or Inf in ``x``, in ``q, k, v``
or in the layer's weights, biases or ``W_O`` (in the compute dtype) raises
:class:`NonFiniteError` at construction, so a diverged layer fails there with a clear message
rather than as NaN from ``mv`` or an SVD failure inside an estimator.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch
from torch import Tensor, nn

from condinit._backends import BACKENDS
from condinit._validate import (check_bool, check_choice, check_dtype, check_finite, check_int, check_real,
                                check_tensor)

from .autocast import no_autocast
from .nulls import KnownNulls
from .products import OperatorProducts
from .transforms import QKNorm, rope_tables

__all__ = ["JacobianOperator", "WRT", "TRANSFORMS", "DENSE_MAX_ENTRIES"]

WRT = ("weights", "input", "qkv")
TRANSFORMS = ("module", "none")
DENSE_MAX_ENTRIES = 4_000_000   # .dense(): 32 MB of float64


def _spec_of(module: nn.Module):
    """The layer's layout, found the way ``condinit.apply`` finds it (adapters, then structure)."""
    from condinit.models import spec_of

    try:
        return spec_of(module)
    except ValueError as exc:
        raise ValueError(f"layer: {exc}, or pass a (q, k, v) triple with wrt='qkv'") from None


class JacobianOperator(OperatorProducts):
    """Matrix-free Jacobian of one attention layer (see the module docstring for the math).

    Args:
        layer_or_qkv: an attention module that :func:`condinit.models.describe` recognises (any
            registered class: ``nn.MultiheadAttention``, HF Llama/Mistral/Qwen2/GPT-2/BERT/ViT, timm,
            custom), or a ``(q, k, v)`` triple ``[B, H, N, d]`` / ``[B, Hkv, N, d]`` x 2 (then
            ``wrt="qkv"`` and ``x`` is None).
        x: the layer's input ``[B, N, D]`` (batch first, whatever the module's own layout), or
            ``[N, D]`` for one sequence. Copied; must be finite, as must the layer's weights and
            biases (else :class:`NonFiniteError`, a ``ValueError``).
        wrt: ``"weights"``, ``"input"`` or ``"qkv"``.
        causal: causal mask (query ``i`` attends keys ``j <= i``).
        include_output_proj: apply the module's ``W_O`` (``out_proj`` / ``o_proj`` / ``c_proj`` /
            ``proj``) to the output; ValueError if it has none.
        dtype: compute dtype (default: the layer's dtype, float32 for half types). Use float64 for
            exact small-scale checks.
        scale: score scale (default: the module's own, else ``1/sqrt(d)``).
        backend: the attention backend (as for :func:`condinit.attention_jvp`: ``"cuda"``,
            ``"triton"``, ``"cpp-cpu"``, ``"torch"``, or None / ``"auto"``), chosen once here for
            the forward, the JVP and the VJP; a forced backend that cannot run this layer raises
            :class:`condinit.BackendUnavailableError`.
        position_embeddings: the ``(cos, sin)`` pair the module's forward receives (Hugging Face
            ``position_embeddings``, ``[B or 1, N, r]``, ``r <= head_dim``): RoPE on q and k.
        transforms: ``"module"`` (the module's QK-norm, RoPE, window, soft-capping; see the module
            docstring) or ``"none"`` (the bare ``A(X)``).
        spec: the module's :class:`~condinit.models.AttentionSpec` as already described
            (:func:`condinit.models.find_attention`'s ``layer.spec``); default: described here.

    ``shape = (m, n)``: ``m`` outputs (``B H N d``, or ``B N D_out``), ``n`` inputs.
    Vectors are 1-D tensors (``[n]`` / ``[m]``); ``matmat`` takes ``[n, P]`` and returns ``[m, P]``.

    Examples:
        >>> layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> x = torch.randn(1, 8, 16)
        >>> op = condinit.JacobianOperator(layer, x, wrt="weights")
        >>> op.shape
        (128, 768)
        >>> y = op.mv(torch.randn(op.n))          # J t, one fused JVP
        >>> g = op.rmv(torch.randn(op.m))         # J^T u, one flash VJP
        >>> attn = llama.model.layers[0].self_attn  # a Hugging Face layer, (cos, sin) from its call
        >>> op = condinit.JacobianOperator(attn, x, causal=True, position_embeddings=(cos, sin))
        >>> op.description                        # "modelled: ..., RoPE ..., Not modelled: ..."
    """

    def __init__(self, layer_or_qkv, x: Optional[Tensor] = None, wrt: str = "weights", *,
                 causal: bool = False, include_output_proj: bool = False,
                 dtype: Optional[torch.dtype] = None, scale: Optional[float] = None,
                 backend: Optional[str] = None, position_embeddings=None, transforms: str = "module",
                 spec=None):
        check_choice("wrt", wrt, WRT)
        check_bool("causal", causal)
        check_bool("include_output_proj", include_output_proj)
        check_dtype("dtype", dtype)
        scale = check_real("scale", scale, min=0.0, min_open=True, allow_none=True)
        check_choice("backend", backend, BACKENDS + ("auto",), allow_none=True)
        check_choice("transforms", transforms, TRANSFORMS)
        self.wrt, self.causal, self.backend = wrt, causal, backend
        self.include_output_proj = include_output_proj
        self.transforms = transforms
        self._wo = None
        self._rope_cs = None
        self.q_norm = self.k_norm = None
        self.softcap = None
        self.window = None            # (left, right) key offsets allowed around the query, -1 = unbounded
        self.window_size = None
        self.excluded: list = []      # what the module computes and this operator does not
        if isinstance(layer_or_qkv, nn.Module):
            self._init_module(layer_or_qkv, x, dtype, scale, spec)
            if transforms == "module":
                self._init_transforms(layer_or_qkv, position_embeddings)
            elif position_embeddings is not None:
                raise ValueError("position_embeddings needs transforms='module' (transforms='none' is the bare A(X))")
        elif isinstance(layer_or_qkv, (tuple, list)) and len(layer_or_qkv) == 3:
            if position_embeddings is not None:
                raise ValueError("position_embeddings needs a module (a (q, k, v) triple is already rotated)")
            self._init_qkv(layer_or_qkv, x, dtype, scale)
        else:
            raise TypeError(f"layer_or_qkv must be an attention nn.Module or a (q, k, v) tuple of tensors, "
                            f"got {type(layer_or_qkv).__name__}")
        G = self.H // self.Hkv
        self.G = G
        B, N, d = self.B, self.N, self.d
        self._m_heads = B * self.H * N * d
        self.m = B * N * self._wo.shape[0] if self._wo is not None else self._m_heads
        if wrt == "weights":
            self._in_shapes = ((self.H * d, self.D), (self.Hkv * d, self.D), (self.Hkv * d, self.D))
        elif wrt == "input":
            self._in_shapes = ((B, N, self.D),)
        else:
            self._in_shapes = ((B, self.H, N, d), (B, self.Hkv, N, d), (B, self.Hkv, N, d))
        self._in_sizes = tuple(math.prod(s) for s in self._in_shapes)
        self.n = sum(self._in_sizes)
        self._primals = None
        self._floor = None            # the certified floor under sigma_min (condinit.probe.floor), once
        self._nulls = None
        self._x_cache: dict = {}      # X's factors for the known nulls, shared with the key/value blocks
        self._impls = self._choose_backends()

    # -- construction ---------------------------------------------------------------------------

    def _init_module(self, module, x, dtype, scale, spec):
        from condinit.models.discovery import read_details

        spec = _spec_of(module) if spec is None else spec
        self._details = spec.details if spec.details is not None else read_details(module, spec.head_dim)
        wq = spec.q.view()
        src_dtype = wq.dtype
        cdt = dtype or (torch.float32 if src_dtype in (torch.float16, torch.bfloat16) else src_dtype)
        self.dtype, self.device = cdt, wq.device
        self.H, self.Hkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if self.H % self.Hkv:
            raise ValueError(f"layer: num_heads={self.H} is not a multiple of num_kv_heads={self.Hkv}")
        self.D = spec.q.in_features
        for name, p in (("k", spec.k), ("v", spec.v)):
            if p.in_features != self.D:
                raise ValueError(f"layer: {name} projection reads {p.in_features} features but q reads {self.D} "
                                 f"(cross-attention with kdim/vdim != embed_dim is not a self-attention A(X))")
        # own copies: the operator must not follow later in-place updates of the layer
        self.Wq, self.Wk, self.Wv = (p.view().to(self.device, cdt).clone() for p in (spec.q, spec.k, spec.v))
        self.bq, self.bk, self.bv = (None if p.read_bias() is None else p.read_bias().to(self.device, cdt).clone()
                                     for p in (spec.q, spec.k, spec.v))
        for name, w, b in (("q", self.Wq, self.bq), ("k", self.Wk, self.bk), ("v", self.Wv, self.bv)):
            check_finite(f"layer: the {name} projection's weight", w)
            if b is not None:
                check_finite(f"layer: the {name} projection's bias", b)
        self.scale = float(scale) if scale is not None else self._details.scale
        if self.include_output_proj:
            wo = None if self._details.output is None else self._details.output.matrix()
            if wo is None:
                raise ValueError(f"include_output_proj=True: {type(module).__name__} holds no output projection "
                                 f"(looked for out_proj, o_proj, c_proj, proj)")
            if wo.shape[1] != self.H * self.d:
                raise ValueError(f"include_output_proj=True: output projection is {tuple(wo.shape)}, expected "
                                 f"[*, {self.H * self.d}] (num_heads * head_dim)")
            self._wo = wo.to(self.device, cdt).clone()
            check_finite("layer: the output projection's weight", self._wo)
        check_tensor("x", x, floating=True)
        if x.dim() == 2:
            x = x.unsqueeze(0)
        if x.dim() != 3 or x.shape[-1] != self.D or x.shape[0] < 1 or x.shape[1] < 1:
            raise ValueError(f"x must be [B, N, D] (or [N, D]) with D = {self.D}, the layer's input width; got "
                             f"shape {tuple(x.shape)}")
        self.X = x.detach().to(self.device, cdt).clone()
        check_finite("x", self.X)
        self.B, self.N = x.shape[0], x.shape[1]
        self._qkv_given = None

    def _init_transforms(self, module: nn.Module, position_embeddings) -> None:
        """What the module computes between its projections and the softmax (its details, read from its
        attributes when it was described, HF naming): RoPE from ``position_embeddings``, ``q_norm`` /
        ``k_norm``, ``sliding_window``, ``attn_logit_softcapping``; attention dropout in training mode."""
        details = self._details
        for ref, rows, heads, slot in ((details.q_norm, self.H * self.d, self.H, "q_norm"),
                                       (details.k_norm, self.Hkv * self.d, self.Hkv, "k_norm")):
            if ref is not None:
                setattr(self, slot, QKNorm(ref.name, ref.get(), rows, heads, self.d, self.device, self.dtype))
        if position_embeddings is not None:
            self._rope_cs = rope_tables(position_embeddings, self.B, self.N, self.d, self.device, self.dtype)
        elif details.position_embeddings_arg is not None:
            self.excluded.append("RoPE (the module takes position_embeddings; none were given)")
        window = details.sliding_window
        if window is not None:
            # HF: causal sliding_window_overlay (key j allowed iff i - j < W); bidirectional |i - j| <= W
            self.window = (window - 1, -1) if self.causal else (window, window)
            self.window_size = window
        self.softcap = details.softcap
        if details.dropout > 0 and module.training:
            self.excluded.append(f"attention dropout (p = {details.dropout:g}; the operator is the deterministic map)")

    @property
    def rounding_dtype(self) -> torch.dtype:
        """The coarsest precision the products compute in: the compute dtype, or float32 where a QK-norm
        computes in float32 whatever its input (Hugging Face's RMSNorms), so that the estimates' brackets
        allow for that rounding."""
        coarse = [n.computes_in for n in (getattr(self, "q_norm", None), getattr(self, "k_norm", None))
                  if n is not None]
        return max([self.dtype, *coarse], key=lambda t: torch.finfo(t).eps)

    @property
    def dense_path(self) -> bool:
        """Whether attention runs in plain torch here: the fused kernels have no logit soft-capping
        (the layer's probe-sized input keeps the ``[B, H, N, N]`` blocks small)."""
        return self.softcap is not None

    @property
    def description(self) -> str:
        """What this operator models of the layer, on which path, and what it leaves out."""
        parts = [f"scale {self.scale:.6g}", "causal mask" if self.causal else "no mask"]
        if self.H != self.Hkv:
            parts.append(f"GQA ({self.H} query heads, {self.Hkv} key/value heads)")
        if self.q_norm is not None:
            parts.append("QK-norm " + self.q_norm.describe())
        if self.k_norm is not None:
            parts.append(("" if self.q_norm is not None else "QK-norm ") + self.k_norm.describe())
        if self._rope_cs is not None:
            r = self._rope_cs[0].shape[-1]
            parts.append(f"RoPE on q and k and their tangents (rotate-half, cos/sin as the module received them, "
                         f"{r} of {self.d} channels)")
        if self.window is not None:
            parts.append(f"sliding window {self.window_size} (window_left={self.window[0]}, "
                         f"window_right={self.window[1]})")
        if self.softcap is not None:
            parts.append(f"logit soft-capping c tanh(s / c), c = {self.softcap:g}")
        text = "modelled: " + ", ".join(parts)
        if self.dense_path:
            text += (f"; attention computed in plain torch ({self.dtype}) with dense [B, H, N, N] blocks: the fused "
                     f"kernels have no soft-capping")
        else:
            text += f"; attention by the fused kernels ({self._impls['attention_jvp']})"
        left = list(self.excluded)
        if self.transforms == "none" and self.D is not None:
            left.append("whatever the module applies between its projections and the softmax (transforms='none')")
        left.append("padding / attention masks beyond causal and sliding window, position biases (ALiBi, "
                    "relative), dropout")
        return text + ". Not modelled: " + "; ".join(left) + "."

    def _init_qkv(self, qkv, x, dtype, scale):
        if self.wrt != "qkv":
            raise ValueError(f"a (q, k, v) triple has no weights or input: use wrt='qkv', got wrt={self.wrt!r}")
        if x is not None:
            raise ValueError("x must be None when layer_or_qkv is a (q, k, v) triple")
        if self.include_output_proj:
            raise ValueError("include_output_proj=True needs a module (a (q, k, v) triple has no W_O)")
        q, k, v = qkv
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, floating=True, dim=4)
        if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:] or q.shape[1] % k.shape[1]:
            raise ValueError(f"expected q [B, H, N, d], k and v [B, Hkv, N, d] with Hkv | H, got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        cdt = dtype or (torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)
        self.dtype, self.device = cdt, q.device
        self.B, self.H, self.N, self.d = q.shape
        self.Hkv, self.D = k.shape[1], None
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(self.d)
        self._qkv_given = tuple(t.detach().to(self.device, cdt).clone() for t in (q, k, v))
        for name, t in zip("qkv", self._qkv_given):
            check_finite(name, t)
        self.X = None

    # -- properties -----------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        return (self.m, self.n)

    def __repr__(self):
        what = f"B={self.B}, N={self.N}, H={self.H}, Hkv={self.Hkv}, d={self.d}" + (f", D={self.D}" if self.D else "")
        return (f"JacobianOperator(wrt={self.wrt!r}, shape={self.shape}, {what}, causal={self.causal}, "
                f"output_proj={self._wo is not None}, dtype={self.dtype})")

    def _choose_backends(self) -> dict:
        """The backend of each attention op for this operator's calls (one choice, here)."""
        from condinit.ops.attention.op import ATTENTION_BWD, ATTENTION_FWD, ATTENTION_JVP

        left, right = self.window if self.window is not None else (-1, -1)
        self._mask = (left, right, None, None)          # window_left, window_right, q_lens, kv_lens
        masks = tuple(kind for kind, on in (("causal", self.causal), ("window", self.window is not None)) if on)
        return {op.name: op.choose(self.device, self.backend, dtype=self.dtype, head_dim=self.d, masks=masks)
                for op in (ATTENTION_FWD, ATTENTION_BWD, ATTENTION_JVP)}

    # -- key/value groups: J is block diagonal over them ----------------------------------------

    @property
    def kv_blocks_exact(self) -> Optional[str]:
        """Why ``J`` is not block diagonal over the key/value groups here, or None when it is.

        For ``wrt="weights"`` or ``"qkv"`` without ``W_O``, group ``g``'s outputs (its ``G`` query
        heads) read only its own variables (those heads' rows of ``W_Q`` / ``Q``, its ``W_K``, ``W_V``
        rows / ``K``, ``V``), and no other output reads them: ``J = diag(J_1, ..., J_Hkv)`` up to a
        permutation, and its singular values are the union of the blocks'. ``W_O``, ``wrt="input"``
        and a norm over the whole projection (OLMo2) couple the groups; a QK-norm with a weight per
        head is not split."""
        if self.Hkv == 1:
            return "one key/value group"
        if self.wrt == "input":
            return "wrt='input': every output reads all of dX"
        if self._wo is not None:
            return "include_output_proj: W_O mixes the heads"
        for norm in (self.q_norm, self.k_norm):
            if norm is not None and (norm.whole or norm.heads_differ):
                return f"{norm.name} normalizes the whole projection" if norm.whole else \
                    f"{norm.name} has a weight per head"
        return None

    def kv_blocks(self) -> list:
        """The operators ``J_1, ..., J_Hkv`` of the key/value groups (one query-head group and its key/value
        head each, the same input, transforms and backends; copies sharing this operator's tensors), when
        :attr:`kv_blocks_exact` is None; else ``[self]``."""
        if self.kv_blocks_exact is not None:
            return [self]
        if getattr(self, "_blocks", None) is None:     # built once: each block keeps its own known nulls
            self._blocks = [self._kv_block(g) for g in range(self.Hkv)]
        return list(self._blocks)

    def _kv_block(self, g: int) -> "JacobianOperator":
        blk = copy.copy(self)
        G, d = self.G, self.d
        qs, ks = slice(g * G * d, (g + 1) * G * d), slice(g * d, (g + 1) * d)
        if self._qkv_given is not None:
            q, k, v = self._qkv_given
            blk._qkv_given = (q[:, g * G:(g + 1) * G], k[:, g:g + 1], v[:, g:g + 1])
        else:
            blk.Wq, blk.Wk, blk.Wv = self.Wq[qs], self.Wk[ks], self.Wv[ks]
            blk.bq, blk.bk, blk.bv = (None if b is None else b[s] for b, s in
                                      ((self.bq, qs), (self.bk, ks), (self.bv, ks)))
        blk.q_norm = None if self.q_norm is None else self.q_norm.for_heads(G)
        blk.k_norm = None if self.k_norm is None else self.k_norm.for_heads(1)
        blk.H, blk.Hkv = G, 1
        blk._m_heads = blk.m = self.B * G * self.N * d
        if self.wrt == "weights":
            blk._in_shapes = ((G * d, self.D), (d, self.D), (d, self.D))
        else:
            blk._in_shapes = ((self.B, G, self.N, d), (self.B, 1, self.N, d), (self.B, 1, self.N, d))
        blk._in_sizes = tuple(math.prod(s) for s in blk._in_shapes)
        blk.n = sum(blk._in_sizes)
        blk._primals, blk._nulls, blk._blocks, blk._floor = None, None, None, None
        blk.kv_group = g
        return blk

    # -- exports --------------------------------------------------------------------------------

    def to_scipy(self):
        """A ``scipy.sparse.linalg.LinearOperator`` (float64 numpy in and out)."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator

        def call(fn, a, size):
            a = np.asarray(a, dtype=np.float64)
            t = torch.from_numpy(np.ascontiguousarray(a.reshape(size, -1)))
            r = fn(t).detach().to("cpu", torch.float64).numpy()
            return r.reshape(-1) if a.ndim == 1 else r

        return LinearOperator(self.shape, dtype=np.float64,
                              matvec=lambda a: call(self.matmat, a, self.n),
                              rmatvec=lambda a: call(self.rmatmat, a, self.m),
                              matmat=lambda a: call(self.matmat, a, self.n),
                              rmatmat=lambda a: call(self.rmatmat, a, self.m))

    def dense(self, max_entries: int = DENSE_MAX_ENTRIES, chunk: int = 64) -> Tensor:
        """The full ``[m, n]`` Jacobian (tiny cases only), ``chunk`` probes per launch.

        Built from the identity along the shorter side: its columns by multi-probe JVPs when
        ``n <= m``, its rows by flash VJPs when ``J`` is wide (``m < n``), so at most
        ``min(m, n)`` probes.
        """
        max_entries = check_int("max_entries", max_entries, min=1)
        chunk = check_int("chunk", chunk, min=1)
        if self.m * self.n > max_entries:
            raise ValueError(f"dense(): J is {self.m} x {self.n} = {self.m * self.n} entries, above the limit "
                             f"max_entries={max_entries}; use the matrix-free mv/rmv/matmat or the estimators "
                             f"(lanczos_svd, power_sigma_max, frobenius_hutchinson)")
        J = torch.empty(self.m, self.n, device=self.device, dtype=self.dtype)
        by_rows = self.m < self.n
        size = self.m if by_rows else self.n
        for i in range(0, size, chunk):
            c = min(chunk, size - i)
            probes = torch.zeros(c, size, device=self.device, dtype=self.dtype)   # rows i..i+c of I
            probes[:, i:i + c].diagonal().fill_(1)
            if by_rows:
                J[i:i + c] = self._rmatmat_rows(probes)
            else:
                J[:, i:i + c] = self._matmat_rows(probes).t()
        return J

    # -- known null directions (condinit.probe.nulls) -------------------------------------------

    @no_autocast
    def _known_nulls(self) -> KnownNulls:
        if self._nulls is None:
            self._nulls = KnownNulls(self)
        return self._nulls

    @property
    def null_dims(self) -> tuple[int, int]:
        """(input-side, output-side) dimensions of the known null spaces."""
        nulls = self._known_nulls()
        return nulls.right_dims, nulls.left_dims

    @property
    def null_description(self) -> str:
        return self._known_nulls().description()

    @no_autocast
    def project_input(self, T: Tensor) -> Tensor:
        """Orthogonal projection of ``[..., n]`` onto the complement of the known input-side nulls."""
        nulls = self._known_nulls()
        self._check_real(torch.as_tensor(T), "T")
        return nulls.project_input(T.to(self.device, self.dtype))

    @no_autocast
    def project_output(self, U: Tensor) -> Tensor:
        """Orthogonal projection of ``[..., m]`` onto the complement of the known output-side nulls."""
        self._check_real(torch.as_tensor(U), "U")
        U = U.to(self.device, self.dtype)
        return self._known_nulls().project_output(U)
