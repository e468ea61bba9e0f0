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
what the module applies before the scores (read from its attributes, Hugging Face naming):
``q_norm`` / ``k_norm`` (per head, or on the whole projection before the head split as in OLMo2;
tangents through the norm's JVP, cotangents through its VJP, by :mod:`torch.func` on a private copy),
RoPE in the rotate-half convention with the ``position_embeddings`` ``(cos, sin)`` the module was
called with (linear: the same rotation carries the tangents, its transpose the cotangents), a
sliding window (``sliding_window``; the fused kernels' ``window``), logit soft-capping
``c tanh(s / c)`` (``attn_logit_softcapping``; not in the fused kernels, so such a layer's attention,
JVP and VJP run in plain torch on dense ``[B, H, N, N]`` blocks), and the module's own ``scaling``.
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
then ``X^T dQ`` (weights) or ``dQ W_Q`` (input).

Known null directions, exposed as orthogonal projectors so the estimators can work on their
orthogonal complement:

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

The operator never modifies the layer (weights and ``x`` are copied, detached, at construction,
so later optimizer steps do not change it), keeps no autograd graph, and draws no random numbers.
It computes in its own ``dtype`` whatever the caller's autocast state (autocast is switched off
inside its methods), and it is built only from finite data: NaN or Inf in ``x``, in ``q, k, v``
or in the layer's weights, biases or ``W_O`` (in the compute dtype) raises
:class:`NonFiniteError` at construction, so a diverged layer fails there with a clear message
rather than as NaN from ``mv`` or an SVD failure inside an estimator.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
from typing import Optional

import torch
from torch import Tensor, nn

from condinit import _backends
from condinit._validate import check_bool, check_choice, check_int, check_real, check_tensor

__all__ = ["JacobianOperator", "NonFiniteError", "WRT", "TRANSFORMS", "DENSE_MAX_ENTRIES"]

WRT = ("weights", "input", "qkv")
DENSE_MAX_ENTRIES = 4_000_000   # .dense(): 32 MB of float64


def check_dtype(name: str, dtype, *, allow_none: bool = True) -> Optional[torch.dtype]:
    """``dtype`` is a floating-point ``torch.dtype`` (or None)."""
    if dtype is None and allow_none:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        what = "a floating-point torch.dtype" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {what}, got {dtype!r}")
    return dtype


class NonFiniteError(ValueError):
    """A probe's input (``x``, ``q, k, v``, or a layer's weights) holds NaN or Inf."""


def _check_finite(what: str, t: Tensor) -> None:
    # max and min propagate NaN and are finite only when every entry is: two reductions, no mask
    if t.numel() and not bool(torch.isfinite(torch.stack([t.max(), t.min()])).all()):
        raise NonFiniteError(f"{what} must be finite, got NaN or Inf (in {t.dtype})")


def _autocast_disabled(device: torch.device):
    """A context with autocast off on ``device``'s type: the probes compute in their own dtype
    (their tangents must match the primal's dtype), whatever autocast region the caller is in."""
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is not None and available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _no_autocast(method):
    """Run an operator method with autocast off on the operator's device (see :func:`_autocast_disabled`)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with _autocast_disabled(self.device):
            return method(self, *args, **kwargs)
    return wrapper


def _null_rtol(dtype: torch.dtype) -> float:
    """Relative size below which a singular value of X / W counts as zero (source precision)."""
    return 1e-12 if dtype == torch.float64 else (1e-6 if dtype == torch.float32 else 1e-3)


# ------------------------------------------------------------------------------------------------
# reading a layer

def _layer_scale(module: nn.Module, head_dim: int) -> float:
    """The score scale the module itself uses (HF ``scaling``, timm ``scale``, GPT-2's flags)."""
    for attr in ("scaling", "scale"):
        val = getattr(module, attr, None)
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return float(val)
    if hasattr(module, "scale_attn_weights"):   # HF GPT-2
        s = 1.0 / math.sqrt(head_dim) if module.scale_attn_weights else 1.0
        if getattr(module, "scale_attn_by_inverse_layer_idx", False):
            s /= float(getattr(module, "layer_idx", 0) or 0) + 1.0
        return s
    return 1.0 / math.sqrt(head_dim)


def _output_proj(module: nn.Module) -> Optional[Tensor]:
    """W_O in ``[out, in]`` layout, or None when the module holds no output projection."""
    for attr in ("out_proj", "o_proj", "c_proj", "proj"):
        sub = getattr(module, attr, None)
        w = getattr(sub, "weight", None)
        if isinstance(w, Tensor) and w.dim() == 2:
            # GPT-2's Conv1D stores [in, out] and computes x @ W
            return w.detach().t() if type(sub).__name__ == "Conv1D" else w.detach()
    return None


def _proj_bias(p) -> Optional[Tensor]:
    """The projection's ``[rows]`` bias, read through its layout (fused interleaved layouts such as
    GPT-NeoX's ``[H, 3, d]`` hold a projection's entries in several runs)."""
    return p.read_bias()


def _spec_of(module: nn.Module):
    """The layer's layout, found the way ``condinit.apply`` finds it (adapters, then structure)."""
    from condinit.models import spec_of

    try:
        return spec_of(module)
    except ValueError as exc:
        raise ValueError(f"layer: {exc}, or pass a (q, k, v) triple with wrt='qkv'") from None


def _orth(a: Tensor) -> Tensor:
    """Orthonormal basis of the column span of ``a`` (float64, columns with tiny R dropped)."""
    if a.shape[1] == 0:
        return a
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    keep = s > s.max() * 1e-10 if s.numel() else s.bool()
    return u[:, keep]


TRANSFORMS = ("module", "none")
# The dense torch attention path forms probability blocks of at most this many entries per launch
_DENSE_BLOCK_ENTRIES = 1 << 24


class _QKNorm:
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
                _check_finite(f"layer: {name}.{k}", t)
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


def _rope(y: Tensor, cos: Tensor, sin: Tensor, transpose: bool = False) -> Tensor:
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


def _position_embeddings(pe, B: int, N: int, d: int, device, dtype):
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
        _check_finite(f"position_embeddings {name}", t)
        out.append(t)
    if out[0].shape != out[1].shape:
        raise ValueError(f"position_embeddings: cos {tuple(out[0].shape)} and sin {tuple(out[1].shape)} differ")
    return tuple(out)


def _takes_position_embeddings(module: nn.Module) -> bool:
    try:
        return "position_embeddings" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


class JacobianOperator:
    """Matrix-free Jacobian of one attention layer (see the module docstring for the math).

    Args:
        layer_or_qkv: an attention module known to :mod:`condinit.models.adapters` (any registered
            class: ``nn.MultiheadAttention``, HF Llama/Mistral/Qwen2/GPT-2/BERT/ViT, timm, custom),
            or a ``(q, k, v)`` triple ``[B, H, N, d]`` / ``[B, Hkv, N, d]`` x 2 (then ``wrt="qkv"``
            and ``x`` is None).
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
                 backend: Optional[str] = None, position_embeddings=None, transforms: str = "module"):
        check_choice("wrt", wrt, WRT)
        check_bool("causal", causal)
        check_bool("include_output_proj", include_output_proj)
        check_dtype("dtype", dtype)
        scale = check_real("scale", scale, min=0.0, min_open=True, allow_none=True)
        check_choice("backend", backend, _backends.BACKENDS + ("auto",), allow_none=True)
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
            self._init_module(layer_or_qkv, x, dtype, scale)
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
        self._nulls = None
        self._impls = self._choose_backends()

    # -- construction ---------------------------------------------------------------------------

    def _init_module(self, module, x, dtype, scale):
        spec = _spec_of(module)
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
        self.bq, self.bk, self.bv = (None if _proj_bias(p) is None else _proj_bias(p).to(self.device, cdt).clone()
                                     for p in (spec.q, spec.k, spec.v))
        for name, w, b in (("q", self.Wq, self.bq), ("k", self.Wk, self.bk), ("v", self.Wv, self.bv)):
            _check_finite(f"layer: the {name} projection's weight", w)
            if b is not None:
                _check_finite(f"layer: the {name} projection's bias", b)
        self.scale = float(scale) if scale is not None else _layer_scale(module, self.d)
        if self.include_output_proj:
            wo = _output_proj(module)
            if wo is None:
                raise ValueError(f"include_output_proj=True: {type(module).__name__} holds no output projection "
                                 f"(looked for out_proj, o_proj, c_proj, proj)")
            if wo.shape[1] != self.H * self.d:
                raise ValueError(f"include_output_proj=True: output projection is {tuple(wo.shape)}, expected "
                                 f"[*, {self.H * self.d}] (num_heads * head_dim)")
            self._wo = wo.to(self.device, cdt).clone()
            _check_finite("layer: the output projection's weight", self._wo)
        check_tensor("x", x, floating=True)
        if x.dim() == 2:
            x = x.unsqueeze(0)
        if x.dim() != 3 or x.shape[-1] != self.D or x.shape[0] < 1 or x.shape[1] < 1:
            raise ValueError(f"x must be [B, N, D] (or [N, D]) with D = {self.D}, the layer's input width; got "
                             f"shape {tuple(x.shape)}")
        self._x_src_dtype = x.dtype
        self.X = x.detach().to(self.device, cdt).clone()
        _check_finite("x", self.X)
        self.B, self.N = x.shape[0], x.shape[1]
        self._qkv_given = None

    def _init_transforms(self, module: nn.Module, position_embeddings) -> None:
        """What the module computes between its projections and the softmax (read from its attributes,
        HF naming): RoPE from ``position_embeddings``, ``q_norm`` / ``k_norm``, ``sliding_window``,
        ``attn_logit_softcapping``."""
        for qn, kn in (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm")):
            for name, rows, heads, slot in ((qn, self.H * self.d, self.H, "q_norm"),
                                            (kn, self.Hkv * self.d, self.Hkv, "k_norm")):
                norm = getattr(module, name, None)
                if isinstance(norm, nn.Module):
                    setattr(self, slot, _QKNorm(name, norm, rows, heads, self.d, self.device, self.dtype))
        if position_embeddings is not None:
            self._rope_cs = _position_embeddings(position_embeddings, self.B, self.N, self.d, self.device, self.dtype)
        elif _takes_position_embeddings(module):
            self.excluded.append("RoPE (the module takes position_embeddings; none were given)")
        window = getattr(module, "sliding_window", None)
        config = getattr(module, "config", None)
        if not hasattr(module, "sliding_window") and config is not None:
            # Mistral-style modules pass config.sliding_window to the attention call (the model's mask
            # is then a sliding one for every layer, or for the "sliding_attention" layer_types)
            window = getattr(config, "sliding_window", None)
            types_ = getattr(config, "layer_types", None)
            idx = getattr(module, "layer_idx", None)
            if types_ is not None and isinstance(idx, int) and idx < len(types_) \
                    and types_[idx] != "sliding_attention":
                window = None
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            # HF: causal sliding_window_overlay (key j allowed iff i - j < W); bidirectional |i - j| <= W
            self.window = (window - 1, -1) if self.causal else (window, window)
            self.window_size = window
        cap = getattr(module, "attn_logit_softcapping", None)
        if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0:
            self.softcap = float(cap)
        dropout = getattr(module, "attention_dropout", getattr(module, "dropout", 0.0))
        if isinstance(dropout, (int, float)) and dropout > 0 and module.training:
            self.excluded.append(f"attention dropout (p = {dropout:g}; the operator is the deterministic map)")

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
        self._x_src_dtype = q.dtype
        self._qkv_given = tuple(t.detach().to(self.device, cdt).clone() for t in (q, k, v))
        for name, t in zip("qkv", self._qkv_given):
            _check_finite(name, t)
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

    @_no_autocast
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
                    out, lse = self._dense_fwd(q, k, v)
                else:
                    out, lse = torch.ops.condinit.attention_fwd(q, k, v, self.causal, self.scale, *self._mask,
                                                                self._impls["attention_fwd"])
            self._primals = (q, k, v, out, lse)
        return self._primals

    def _qk_primal(self, y: Tensor, norm, h: int) -> Tensor:
        if norm is not None:
            y = norm.at(y)
        y = self._heads(y, h)
        return y if self._rope_cs is None else _rope(y, *self._rope_cs)

    def _qk_tangent(self, t: Tensor, norm, h: int) -> Tensor:
        """Projection tangents ``[P, B, N, rows]`` -> tangents of the rotated heads ``[P, B, h, N, d]``."""
        if norm is not None:
            t = norm.jvp(t)
        t = self._heads(t, h)
        return t if self._rope_cs is None else _rope(t, *self._rope_cs)

    def _qk_cotangent(self, g: Tensor, norm) -> Tensor:
        """Cotangents of the rotated heads ``[P, B, h, N, d]`` -> of the projection ``[P, B, N, rows]``."""
        if self._rope_cs is not None:
            g = _rope(g, *self._rope_cs, transpose=True)
        g = self._unheads(g)
        return g if norm is None else norm.vjp(g)

    # -- the dense torch attention (soft-capping, sliding window) -------------------------------

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

    def _rep(self, t: Tensor) -> Tensor:
        """Key/value heads repeated to the query heads (head ``h`` reads ``h // G``)."""
        return t if self.G == 1 else t.repeat_interleave(self.G, dim=-3)

    def _group_sum(self, t: Tensor) -> Tensor:
        """[.., H, N, d] -> [.., Hkv, N, d]: the transpose of :meth:`_rep`."""
        if self.G == 1:
            return t
        return t.unflatten(-3, (self.Hkv, self.G)).sum(dim=-3)

    def _dense_fwd(self, q, k, v):
        s = (q @ self._rep(k).transpose(-1, -2)) * self.scale
        self._dcap = None
        if self.softcap is not None:
            th = torch.tanh(s / self.softcap)
            s = th * self.softcap
            self._dcap = 1 - th * th                    # d(c tanh(s / c)) / ds
        ok = self.allowed_keys(0, self.N)
        if ok is not None:
            s = s.masked_fill(~ok, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        self._probs = torch.exp(s - lse.unsqueeze(-1))
        return self._probs @ self._rep(v), lse

    def _probe_chunks(self, P: int):
        per = max(1, _DENSE_BLOCK_ENTRIES // max(1, self.B * self.H * self.N * self.N))
        return [(i, min(P, i + per)) for i in range(0, P, per)]

    def _dense_jvp(self, q, k, v, tq, tk, tv):
        p, kk, vv = self._probs, self._rep(k), self._rep(v)
        outs = []
        for a, b in self._probe_chunks(tq.shape[0]):
            ds = (tq[a:b] @ kk.transpose(-1, -2) + q @ self._rep(tk[a:b]).transpose(-1, -2)) * self.scale
            if self._dcap is not None:
                ds = ds * self._dcap
            dp = p * (ds - (p * ds).sum(dim=-1, keepdim=True))
            outs.append(dp @ vv + p @ self._rep(tv[a:b]))
        return torch.cat(outs)

    def _dense_vjp(self, g, q, k, v):
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

    @_no_autocast
    def _matmat_rows(self, T: Tensor) -> Tensor:
        """[P, n] -> [P, m]: one fused multi-probe JVP launch."""
        return self._jvp_outputs(self._tangents(T))

    def _jvp_outputs(self, tangents) -> Tensor:
        q, k, v, _, _ = self._primal()
        with torch.no_grad():
            tq, tk, tv = (t.contiguous() for t in tangents)
            if self.dense_path:
                tout = self._dense_jvp(q, k, v, tq, tk, tv)
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

    @_no_autocast
    def coord_rmv(self, u: Tensor) -> Tensor:
        """``G`` with ``J^T u = G^T X`` (flat ``[B N rows]``, rows = ``(H + 2 Hkv) d``)."""
        lin = self._cotangents(u.reshape(1, -1))
        return torch.cat(lin, dim=-1).reshape(-1)

    @_no_autocast
    def coord_gram(self, g: Tensor) -> Tensor:
        """``K G`` (flat): the tangents ``X dW^T`` of ``dW = G^T X``, and ``<G', K G>`` its inner products."""
        with torch.no_grad():
            return (self._gram() @ g.reshape(self.B * self.N, -1)).reshape(-1)

    @_no_autocast
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
                return self._dense_vjp(dO, q, k, v)
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

    @_no_autocast
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

    # -- known null directions ------------------------------------------------------------------

    @_no_autocast
    def _null_info(self):
        if self._nulls is None:
            self._nulls = self._compute_nulls()
        return self._nulls

    def _compute_nulls(self) -> dict:
        info = {"right_dims": 0, "left_dims": 0, "right": [], "left": []}
        rtol = _null_rtol(self._x_src_dtype)
        f64 = torch.float64
        shifts = self._key_shifts_are_null
        if not shifts:
            info["right"].append("(no key-shift nulls: " + ("RoPE rotates" if self._rope_cs is not None else
                                 "k_norm normalizes") + " a shift of all keys differently per key)")
        if self.wrt == "qkv":
            if shifts:
                info["right_dims"] = self.B * self.Hkv * self.d
                info["right"].append(f"key shifts K'_(b,g) = 1 c^T per (batch, kv-head): B*Hkv*d = "
                                     f"{info['right_dims']} dims")
        elif self.wrt == "input":
            wall = torch.cat([self.Wq, self.Wk, self.Wv]).to(f64)
            z0 = self._null_basis(wall, rtol)                 # [D, z0]
            wqv = torch.cat([self.Wq, self.Wv]).to(f64)
            z1 = self._null_basis(wqv, rtol) if shifts else wqv.new_zeros(self.D, 0)
            if z0.shape[1] and z1.shape[1]:
                z1 = _orth(z1 - z0 @ (z0.t() @ z1))
            self._z_row, self._z_shift = z0.to(self.dtype), z1.to(self.dtype)
            if z0.shape[1]:
                k = self.B * self.N * z0.shape[1]
                info["right_dims"] += k
                info["right"].append(f"rows of dX in null([W_Q; W_K; W_V]) ({z0.shape[1]} per token): {k} dims")
            if z1.shape[1]:
                k = self.B * z1.shape[1]
                info["right_dims"] += k
                info["right"].append(f"shifts dX_b = 1 u^T, u in null([W_Q; W_V]) (moves all keys alike): {k} dims")
        else:
            xa = self.X.reshape(-1, self.D).to(f64)
            # all of V is needed for null(X); U only thin (B N x min(B N, D))
            u_x, s, vh = torch.linalg.svd(xa, full_matrices=xa.shape[0] < self.D)
            smax = float(s.max()) if s.numel() else 0.0
            rank = int((s > rtol * smax).sum()) if smax > 0 else 0
            z = vh[rank:].t()                                  # [D, D - rank]
            self._z_row = z.to(self.dtype)
            self._w_shift = self._w_raw = None
            if z.shape[1]:
                k = (self.H + 2 * self.Hkv) * self.d * z.shape[1]
                info["right_dims"] += k
                info["right"].append(f"rows of dW in null(X) (X is [B*N, D] = [{xa.shape[0]}, {self.D}] of rank "
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
                    info["right_dims"] += k
                    info["right"].append(f"key shifts dW_K = c w^T with X w = 1 (1 in range(X), residual "
                                         f"{res:.1e}): Hkv*d = {k} dims")
            info["x_rank"] = rank
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
                info["right"].append("(no Q/K gauge: QK-norm breaks it; near-null directions such as "
                                     "dW_Q,h = c W_Q,h, null but for the norm's eps, stay in the estimate)")
            if k:
                info["right_dims"] += k
                info["right"].append(f"Q/K gauge dW_Q,h = E W_Q,h, dW_K,g = -E^T W_K,g ({what}): {k} dims")
        if self.causal and self.G > 1 and self._wo is None:
            k = self.B * self.Hkv * (self.G - 1) * self.d
            info["left_dims"] = k
            info["left"].append(f"causal GQA: the first query's output is v_0 for all {self.G} heads of a group; "
                                f"head differences there are unreachable: B*Hkv*(G-1)*d = {k} dims")
        elif self.causal and self.G > 1:
            info["left"].append("causal GQA with W_O: the first query's unreachable directions are not tracked "
                                "(expect a rank-deficient report)")
        return info

    @property
    def _key_shifts_are_null(self) -> bool:
        """A shift of all keys by one vector leaves each score row's softmax unchanged, unless RoPE
        (different rotation per key) or a k_norm sits between the projection and the scores."""
        return self._rope_cs is None and self.k_norm is None

    def _gauge_kind(self) -> Optional[str]:
        if self.q_norm is not None or self.k_norm is not None:
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
        eye = torch.eye(D, dtype=f64, device=self.device)
        z = self._z_row.to(f64)
        pi = eye - z @ z.t()
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
        gram = (torch.einsum("gaij,gbik,gkj->gab", F, F, A) + torch.einsum("gaij,gbkj,gki->gab", F, F, C))
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
        eye = torch.eye(D, dtype=f64, device=self.device)
        z = self._z_row.to(f64)
        pi_q = eye - z @ z.t()
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

    @staticmethod
    def _null_basis(w: Tensor, rtol: float) -> Tensor:
        """Orthonormal basis of null(w) for w [r, D] (float64)."""
        _, s, vh = torch.linalg.svd(w, full_matrices=True)
        smax = float(s.max()) if s.numel() else 0.0
        rank = int((s > rtol * smax).sum()) if smax > 0 else 0
        return vh[rank:].t()

    @property
    def null_dims(self) -> tuple[int, int]:
        """(input-side, output-side) dimensions of the known null spaces."""
        info = self._null_info()
        return info["right_dims"], info["left_dims"]

    @property
    def null_description(self) -> str:
        info = self._null_info()
        r = "; ".join(info["right"]) or "none"
        l = "; ".join(info["left"]) or "none"
        return f"input side: {r}. output side: {l}."

    @_no_autocast
    def project_input(self, T: Tensor) -> Tensor:
        """Orthogonal projection of ``[..., n]`` onto the complement of the known input-side nulls."""
        self._null_info()
        self._check_real(torch.as_tensor(T), "T")
        T = T.to(self.device, self.dtype)
        parts = list(self.split_input(T))
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

    @_no_autocast
    def project_output(self, U: Tensor) -> Tensor:
        """Orthogonal projection of ``[..., m]`` onto the complement of the known output-side nulls."""
        self._check_real(torch.as_tensor(U), "U")
        U = U.to(self.device, self.dtype)
        if not self._null_info()["left_dims"]:
            return U
        lead = U.shape[:-1]
        y = U.reshape(*lead, self.B, self.Hkv, self.G, self.N, self.d)
        row0 = y[..., :1, :].mean(dim=-3, keepdim=True).expand_as(y[..., :1, :])
        y = torch.cat([row0, y[..., 1:, :]], dim=-2)
        return y.reshape(*lead, -1)
