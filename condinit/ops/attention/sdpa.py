"""``torch.nn.functional.scaled_dot_product_attention`` on condinit's fused op, so that forward-mode
AD reaches the attention of existing models.

PyTorch's fused SDPA kernels (flash, memory-efficient, cuDNN, the CPU flash kernel) have no
forward-mode rule: ``torch.func.jvp`` through a model that calls SDPA raises, or only works through
the MATH backend, which stores the ``N x N`` attention matrix. :func:`sdpa` takes SDPA's arguments
and computes the same function with :func:`condinit.attention` wherever that op can express the
call, so ``torch.func.jvp`` / ``vjp`` / ``jacfwd`` / ``vmap`` and ``torch.autograd.forward_ad`` run
in O(N) memory; :func:`patch_sdpa` routes ``F.scaled_dot_product_attention`` to it for a block of
code. The Hugging Face registration (``attn_implementation="condinit"``) lives in
:mod:`condinit.integrations.hf` and calls :func:`sdpa`.

The math and the masks: ``docs/design.md``, "Attention".
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from condinit._validate import check_bool, check_real, check_tensor
from condinit.ops.attention.op import attention

__all__ = ["sdpa", "patch_sdpa"]

_functorch = torch._C._functorch


# --------------------------------------------------------------------------------------------
# Shapes: SDPA broadcasts every dimension but the last two (the head dimension -3 included);
# enable_gqa lets key/value have fewer heads that divide the query's.
# --------------------------------------------------------------------------------------------

class SdpaLayout:
    """The broadcast layout of one call.

    ``padded`` holds query, key and value with at least 3 dimensions; ``batch`` is the broadcast
    shape of the dimensions before the heads, ``heads`` the output head count; ``out`` is the
    output shape SDPA returns (as many dimensions as the largest input) and ``scores`` the shape
    ``attn_mask`` must broadcast to.
    """

    def __init__(self, query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool):
        ndim = max(query.dim(), key.dim(), value.dim())
        # Inputs with fewer dimensions get leading 1s (matmul broadcasting); at least 3 so that
        # every input has a head dimension.
        self.padded = [x.reshape((1,) * (max(ndim, 3) - x.dim()) + tuple(x.shape))
                       for x in (query, key, value)]
        q, k, v = self.padded
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if enable_gqa:
            for name, h in (("key", hk), ("value", hv)):
                if h == 0 or hq % h != 0:
                    raise ValueError(f"{name}'s head count {h} must divide query's head count {hq} "
                                     f"with enable_gqa=True, got query {tuple(query.shape)}, "
                                     f"{name} {tuple((key if name == 'key' else value).shape)}")
            self.heads = hq
        else:
            self.heads = _broadcast_dim("head", (("query", hq), ("key", hk), ("value", hv)),
                                        hint=" (pass enable_gqa=True for grouped-query attention)")
        lead = [x.shape[:-3] for x in self.padded]
        self.batch = tuple(_broadcast_dim(f"batch dimension {i}", (
            ("query", lead[0][i]), ("key", lead[1][i]), ("value", lead[2][i])))
            for i in range(len(lead[0])))
        self.hk, self.hv = hk, hv
        self.nq, self.nk = q.shape[-2], k.shape[-2]
        self.head_dim, self.value_dim = q.shape[-1], v.shape[-1]
        full = self.batch + (self.heads, self.nq, self.value_dim)
        self.out = full[len(full) - ndim:]
        self.scores = self.out[:-1] + (self.nk,)     # what attn_mask must broadcast to

    def fused(self) -> bool:
        """condinit's op needs one head dim for q, k, v and no empty dimension."""
        sizes = self.batch + (self.heads, self.nq, self.nk, self.head_dim)
        return self.head_dim == self.value_dim and all(s > 0 for s in sizes)

    def as_bhnd(self) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[B, H, Nq, d]`` and k, v ``[B, Hkv, Nk, d]`` for the fused op (broadcast batch
        dimensions expanded; key/value heads kept grouped unless key and value differ)."""
        q, k, v = self.padded
        if self.hk != self.hv:   # the op needs one kv head count: give both the query's
            k = k.repeat_interleave(self.heads // self.hk, dim=-3)
            v = v.repeat_interleave(self.heads // self.hv, dim=-3)
        kv_heads = k.shape[-3]     # divides heads: equal, 1 (broadcast), or the GQA group count
        b, d = math.prod(self.batch), self.head_dim
        q = q.expand(*self.batch, self.heads, self.nq, d).reshape(b, self.heads, self.nq, d)
        k = k.expand(*self.batch, kv_heads, self.nk, d).reshape(b, kv_heads, self.nk, d)
        v = v.expand(*self.batch, kv_heads, self.nk, d).reshape(b, kv_heads, self.nk, d)
        return q, k, v


def _broadcast_dim(what: str, sizes, hint: str = "") -> int:
    """The broadcast size of one dimension over ``(name, size)`` pairs (each 1 or the common size)."""
    common = max(s for _, s in sizes)
    if any(s == 0 for _, s in sizes):
        common = 0
    bad = [(n, s) for n, s in sizes if s not in (1, common)]
    if bad:
        shown = ", ".join(f"{n} {s}" for n, s in sizes)
        raise ValueError(f"query, key and value must have broadcastable {what} sizes, got {shown}{hint}")
    return common


def check_sdpa_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> SdpaLayout:
    """Every argument of :func:`sdpa` checked once; the call's broadcast layout."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, floating=True, min_dim=2)
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {t.device}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key must have query's head dim {query.shape[-1]} (last dimension), "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"value must have key's sequence length {key.shape[-2]} (dimension -2), "
                         f"got key {tuple(key.shape)}, value {tuple(value.shape)}")
    dropout_p = check_real("dropout_p", dropout_p, min=0.0, max=1.0)
    check_bool("is_causal", is_causal)
    check_real("scale", scale, allow_none=True)
    check_bool("enable_gqa", enable_gqa)
    if dropout_p > 0:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: condinit.sdpa has no attention dropout (dropout is random and "
            f"the fused op has none); pass dropout_p=0.0, e.g. put the model in eval() mode or set "
            f"its attention dropout to 0")
    layout = SdpaLayout(query, key, value, enable_gqa)
    if attn_mask is not None:
        check_tensor("attn_mask", attn_mask)
        if is_causal:
            raise ValueError("attn_mask must be None when is_causal=True (as in "
                             "torch.nn.functional.scaled_dot_product_attention)")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be a bool tensor (True = attend) or a floating-point "
                            f"tensor (added to the scores), got {attn_mask.dtype}")
        if attn_mask.is_floating_point() and attn_mask.dtype not in (torch.float32, query.dtype):
            raise TypeError(f"attn_mask: a floating-point mask must be float32 or query's dtype {query.dtype} "
                            f"(as in torch.nn.functional.scaled_dot_product_attention), got {attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask must be on query's device {query.device}, got {attn_mask.device}")
        target = layout.scores
        fits = attn_mask.dim() <= len(target) and all(
            m in (1, t) for m, t in zip(reversed(attn_mask.shape), reversed(target)))
        if not fits:
            raise ValueError(f"attn_mask must broadcast to the scores' shape {layout.scores} "
                             f"[..., Nq, Nk], got {tuple(attn_mask.shape)}")
    return layout


# --------------------------------------------------------------------------------------------
# Masks the fused op can run: none, causal (bottom-right), causal (top-left, SDPA's is_causal)
# --------------------------------------------------------------------------------------------

def mask_values_readable(mask: Tensor) -> bool:
    """Whether :func:`_mask_pattern` may read the mask's values: not under ``torch.compile``, not
    a meta tensor, not batched by ``vmap`` at any level (its values differ per vmapped slice), and,
    for a float mask, carrying no gradient or tangent (the fused op has no mask input, so it would
    drop the mask's derivative)."""
    if torch.compiler.is_compiling() or mask.device.type == "meta":
        return False
    x = mask
    while _functorch.is_functorch_wrapped_tensor(x):
        if _functorch.is_batchedtensor(x):
            return False
        x = _functorch.get_unwrapped(x)
    if mask.dtype != torch.bool:
        if mask.requires_grad or forward_ad.unpack_dual(mask).tangent is not None:
            return False
    return True


def _visible(mask: Tensor) -> Optional[Tensor]:
    """The bool mask of visible pairs, or None for a float mask with entries other than 0 / -inf."""
    if mask.dtype == torch.bool:
        return mask
    visible = mask == 0
    return visible if bool((visible | (mask == float("-inf"))).all()) else None


def _mask_pattern(mask: Tensor, nq: int, nk: int) -> Optional[str]:
    """``"none"`` (every key visible), ``"causal"`` (key ``j`` visible to query ``i`` iff
    ``j <= i + Nk - Nq``), ``"causal_top_left"`` (iff ``j <= i``), or None (another mask).

    A float mask counts only if every entry is 0 or -inf (a large negative number instead of -inf
    gives a fully masked row a uniform average, not 0, so it is a different function). One
    comparison over the mask per candidate pattern: cheap next to the attention itself."""
    if mask.dtype == torch.bool:
        visible = mask
    else:
        visible = mask == 0
        if not (visible | (mask == float("-inf"))).all():
            return None
    if visible.all():
        return "none"
    rows = torch.arange(nq, device=mask.device).unsqueeze(-1)
    cols = torch.arange(nk, device=mask.device)
    if (visible == (cols <= rows + (nk - nq))).all():
        return "causal"
    if (visible == (cols <= rows)).all():
        return "causal_top_left"
    return None


def _attention_top_left(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention with SDPA's alignment (query ``i`` sees keys ``j <= i``) on the fused op,
    whose causal mask is bottom-right aligned. Nq <= Nk: the keys after ``Nq`` are seen by no
    query, so dropping them makes the two alignments equal. Nq > Nk: the first Nk queries are a
    square causal block; the others see every key."""
    nq, nk = q.shape[-2], k.shape[-2]
    if nq <= nk:
        return attention(q, k[:, :, :nq], v[:, :, :nq], causal=True, scale=scale)
    head = attention(q[:, :, :nk], k, v, causal=True, scale=scale)
    tail = attention(q[:, :, nk:], k, v, causal=False, scale=scale)
    return torch.cat([head, tail], dim=2)


# --------------------------------------------------------------------------------------------
# Masks the fused op runs through its kernel masks (windows, key lengths): sliding windows and
# key padding as Hugging Face builds them, O(N) memory
# --------------------------------------------------------------------------------------------

class _MaskPlan:
    """How a recognised mask runs on the fused op. Per batch entry ``b`` the keys
    ``[start[b], end[b])`` are real (padding on the left and/or right), and

    * ``causal=False``: every query sees exactly those keys;
    * ``causal=True``: query ``i`` sees key ``j`` iff ``j <= i + diag`` (``diag`` 0: SDPA's
      top-left alignment, ``Nk - Nq``: bottom-right), ``j > i + diag - window`` when ``window``
      is set, and ``j`` is real. With padding only ``Nq == Nk`` is planned.
    """

    def __init__(self, causal: bool, window: Optional[int], diag: int, start: Tensor, end: Tensor,
                 nq: int, nk: int):
        self.causal, self.window, self.diag = causal, window, diag
        self.start, self.end = start, end
        self.padded = bool((start > 0).any() or (end < nk).any())
        # Causal with padding: query rows after the last real key see every real key
        # (causal keeps none of them out) unless a window does.
        self.tail_rows = causal and self.padded and bool((end < nq).any())


def _first_true(x: Tensor) -> Tensor:
    """Index of the first True along the last dim (0 where there is none)."""
    return torch.where(x.any(-1), x.to(torch.int8).argmax(-1), 0)


def _mask_plan(visible: Tensor, layout: "SdpaLayout") -> Optional[_MaskPlan]:
    """A :class:`_MaskPlan` when the bool ``visible`` (broadcastable to the scores) is a padding
    mask, a (sliding-window) causal mask or both, the same for every head; else None."""
    nq, nk = layout.nq, layout.nk
    # [*batch, heads, Nq, Nk] in rank, the query and key dimensions expanded (a key-padding mask
    # broadcasts its query dimension); batch and head dimensions stay 1 where they broadcast.
    rank = len(layout.batch) + 3
    v = visible.reshape((1,) * (rank - visible.dim()) + tuple(visible.shape))
    v = v.expand(*v.shape[:-2], nq, nk)
    if v.shape[-3] != 1:
        if not bool((v == v[..., :1, :, :]).all()):
            return None                        # the heads differ: the kernels take one mask
        v = v[..., :1, :, :]
    batch = layout.batch
    if all(s == 1 for s in v.shape[:-3]):
        v = v.reshape(1, nq, nk)               # one mask for the whole batch
    else:
        v = v.expand(*batch, 1, nq, nk).reshape(-1, nq, nk)
    cols = v.any(-2)                           # [b, Nk]: keys some query sees
    start = _first_true(cols)
    end = start + cols.sum(-1)
    j = torch.arange(nk, device=v.device)
    real = (j >= start[:, None]) & (j < end[:, None])
    if not bool((cols == real).all()):
        return None                            # the real keys are not one interval
    real = real[:, None, :]
    if bool((v == real).all()):
        return _MaskPlan(False, None, 0, start, end, nq, nk)
    i = torch.arange(nq, device=v.device)[:, None]
    widths = v.sum(-1)
    longest = int(widths.max())
    padded = bool((start > 0).any() or (end < nk).any())
    for diag in ((0,) if padded else (nk - nq, 0)):
        if padded and nq != nk:
            break
        for window in (None, longest):
            expected = (j <= i + diag) & real
            if window is not None:
                if window < 1:
                    continue
                expected &= j > i + diag - window
            if bool((v == expected).all()):
                plan = _MaskPlan(True, window, diag, start, end, nq, nk)
                if diag != nk - nq and not (diag == 0 and nq <= nk):
                    return None                # top-left with Nq > Nk: not a kernel mask
                if plan.tail_rows and window is not None:
                    return None                # rows past the real keys with a window: dense
                return plan
    return None


def _shift(x: Tensor, start: Tensor, back: bool = False) -> Tensor:
    """Rows of ``x`` ``[B, h, N, d]`` moved up by ``start[b]`` (row ``t`` <- ``t + start``), or
    back down (row ``t`` <- ``t - start``, 0 above ``start``). An index gather: differentiable in
    every mode. Rows moved in from past the end repeat the last one; callers mask them."""
    n = x.shape[2]
    t = torch.arange(n, device=x.device)
    src = t - start[:, None] if back else t + start[:, None]
    idx = src.clamp(0, n - 1)[:, None, :, None].expand(x.shape[0], x.shape[1], n, x.shape[3])
    y = x.gather(2, idx)
    if back:
        y = torch.where((src >= 0)[:, None, :, None], y, torch.zeros_like(y))
    return y


def _attention_planned(plan: _MaskPlan, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """The fused op on ``q`` ``[B, H, Nq, d]``, ``k``, ``v`` ``[B, Hkv, Nk, d]`` under a
    recognised mask (O(N) memory)."""
    B, nq, nk = q.shape[0], q.shape[2], k.shape[2]
    start, end = plan.start.expand(B), plan.end.expand(B)
    window = (plan.window - 1, -1) if plan.window is not None else None
    if not plan.causal:
        if bool((start > 0).any()):
            k, v = _shift(k, start), _shift(v, start)
        return attention(q, k, v, kv_lens=end - start, scale=scale)
    if not plan.padded:
        if plan.diag != nk - nq:           # top-left with Nq <= Nk: the later keys are unseen
            k, v = k[:, :, :nq], v[:, :, :nq]
        return attention(q, k, v, causal=True, window=window, scale=scale)
    # Nq == Nk with padding: move each sequence's real tokens to the front; its query rows and
    # keys then align at 0 (top-left = bottom-right), and its lengths are end - start.
    lens = end - start
    shifted = start > 0
    qs, ks, vs = (_shift(x, start) for x in (q, k, v)) if bool(shifted.any()) else (q, k, v)
    out = attention(qs, ks, vs, causal=True, window=window, q_lens=lens, kv_lens=lens, scale=scale)
    out = _shift(out, start, back=True) if bool(shifted.any()) else out
    if plan.tail_rows:                     # rows i >= end see all real keys (no window here)
        tail = attention(q, ks, vs, kv_lens=lens, scale=scale)
        rows = torch.arange(nq, device=q.device)
        out = torch.where((rows >= end[:, None])[:, None, :, None], tail, out)
    return out


# --------------------------------------------------------------------------------------------
# The dense path: any mask, any value head dim; O(Nq Nk) memory
# --------------------------------------------------------------------------------------------

def _attention_dense(layout: SdpaLayout, attn_mask: Optional[Tensor], is_causal: bool,
                     scale: float, enable_gqa: bool) -> Tensor:
    """Softmax attention in plain torch ops (so forward AD, vmap and every transform apply), with
    the semantics of SDPA's MATH backend: a bool mask blocks where False, a float mask is added,
    and a row with no visible key gives 0 (and zero derivatives), not NaN."""
    q, k, v = layout.padded
    if enable_gqa and layout.hk != layout.heads:
        k = k.repeat_interleave(layout.heads // layout.hk, dim=-3)
    if enable_gqa and layout.hv != layout.heads:
        v = v.repeat_interleave(layout.heads // layout.hv, dim=-3)
    out_dtype = q.dtype
    # fp32 accumulation for half-precision inputs, as the fused kernels do
    work = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        rows = torch.arange(layout.nq, device=q.device).unsqueeze(-1)
        attn_mask = torch.arange(layout.nk, device=q.device) <= rows
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(work)
    if layout.nk > 0:
        # The shift only keeps exp() in range (softmax does not depend on it): no derivative.
        # A row whose scores are all -inf is shifted by 0, so its weights are exp(-inf) = 0.
        shift = scores.amax(dim=-1, keepdim=True).detach()
        shift = torch.where(torch.isinf(shift) & (shift < 0), 0.0, shift)
        weights = torch.exp(scores - shift)
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / torch.where(total == 0, 1.0, total)
    else:
        weights = scores
    out = torch.matmul(weights, v).to(out_dtype)
    return out.reshape(layout.out)


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------

def sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
         enable_gqa: bool = False) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with forward-mode AD, on condinit's
    fused attention op where it applies.

    Same arguments, broadcasting and result as PyTorch's SDPA (its MATH backend, to rounding):

    Args:
        query: ``[..., H, Nq, E]`` (at least 2-D; leading dimensions broadcast against key's and
            value's, the head dimension included).
        key: ``[..., Hkv, Nk, E]``.
        value: ``[..., Hkv, Nk, Ev]``; ``Ev`` may differ from ``E``.
        attn_mask: None, a bool tensor (True = attend), or a floating-point tensor added to the
            scores; broadcast to ``[..., H, Nq, Nk]``. A row with no visible key gives 0.
        dropout_p: must be 0.0: attention dropout is random and the fused op has none; a value
            ``> 0`` raises :class:`NotImplementedError` (put the model in ``eval()`` mode, or set its
            attention dropout to 0). Values outside ``[0, 1]`` raise :class:`ValueError`.
        is_causal: query ``i`` attends key ``j`` iff ``j <= i`` (top-left aligned, as SDPA; when
            ``Nq != Nk`` this differs from :func:`condinit.attention`'s bottom-right ``causal``,
            and is translated). Requires ``attn_mask=None``.
        scale: defaults to ``1 / sqrt(E)``.
        enable_gqa: allow ``Hkv < H`` with ``Hkv`` dividing ``H`` (grouped-query attention:
            query head ``h`` uses key/value head ``h // (H / Hkv)``). Without it the head counts
            must be equal or 1 (broadcast), as in SDPA.

    Returns ``[..., H, Nq, Ev]`` in the input dtype.

    Which path runs (the result is the same function either way):

    * **fused** (:func:`condinit.attention`: O(N) memory, forward AD through the fused JVP
      kernel, flash VJP backward, its kernel masks): ``attn_mask=None``; ``is_causal=True``; and
      an ``attn_mask`` tensor (bool, or float with only 0 and -inf entries), the same for every
      head, whose values equal no mask, a causal mask (bottom-right or top-left aligned), a
      sliding-window causal mask (Hugging Face's), key padding whose real keys are one interval
      per batch entry (left or right padding), or padding with a (windowed) causal mask when
      ``Nq == Nk`` -- recognised by a few comparisons over the mask, when its values can be
      read: not under ``torch.compile``, not batched by ``vmap``, and for a float mask, not
      requiring grad and carrying no tangent. ``E == Ev`` and no empty dimension.
    * **dense** (plain torch ops, O(Nq Nk) memory per head; forward AD and every
      ``torch.func`` transform still apply): every other mask (random key padding, masks that
      differ per head, additive biases, a window with padded query rows after the real keys)
      and ``E != Ev``.

    Errors are raised before anything runs and name the argument (``ValueError`` /
    ``TypeError``, where SDPA raises ``RuntimeError``).

    Examples:
        >>> q, k, v = torch.randn(2, 8, 128, 64), torch.randn(2, 2, 128, 64), torch.randn(2, 2, 128, 64)
        >>> out = condinit.sdpa(q, k, v, is_causal=True, enable_gqa=True)     # 8 query, 2 kv heads
        >>> f = lambda q, k, v: condinit.sdpa(q, k, v, is_causal=True, enable_gqa=True)
        >>> out, tangent = torch.func.jvp(f, (q, k, v), (q, k, v))       # F.sdpa raises here
    """
    layout = check_sdpa_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    pattern = None      # what the fused op runs; None: the dense path
    plan = None
    if layout.fused():
        if is_causal:
            pattern = "causal_top_left"
        elif attn_mask is None:
            pattern = "none"
        elif mask_values_readable(attn_mask):
            pattern = _mask_pattern(attn_mask, layout.nq, layout.nk)
            visible = _visible(attn_mask) if pattern is None else None
            if visible is not None:
                plan = _mask_plan(visible, layout)
    if pattern is None and plan is None:
        return _attention_dense(layout, attn_mask, is_causal, scale, enable_gqa)
    q, k, v = layout.as_bhnd()
    if plan is not None:
        out = _attention_planned(plan, q, k, v, scale)
    elif pattern == "causal_top_left":
        out = _attention_top_left(q, k, v, scale)
    else:
        out = attention(q, k, v, causal=pattern == "causal", scale=scale)
    return out.reshape(layout.out)


# --------------------------------------------------------------------------------------------
# patch_sdpa: route torch.nn.functional.scaled_dot_product_attention to sdpa
# --------------------------------------------------------------------------------------------

_PATCH_LOCK = threading.Lock()
_patch_depth = 0
_patched_original = None


class _PatchSDPA(contextlib.ContextDecorator):
    """The object :func:`patch_sdpa` returns; its state (depth, saved function) is module-wide,
    so one instance may be entered several times, also as a decorator."""

    def __enter__(self):
        global _patch_depth, _patched_original
        with _PATCH_LOCK:
            if _patch_depth == 0:
                _patched_original = torch.nn.functional.scaled_dot_product_attention
                torch.nn.functional.scaled_dot_product_attention = sdpa
            _patch_depth += 1
        return self

    def __exit__(self, *exc):
        global _patch_depth, _patched_original
        with _PATCH_LOCK:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch.nn.functional.scaled_dot_product_attention = _patched_original
                _patched_original = None
        return False


def patch_sdpa() -> _PatchSDPA:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to :func:`condinit.sdpa` while
    a block runs: a context manager and a decorator.

    Code that looks the function up at call time (``F.scaled_dot_product_attention(...)``:
    timm, diffusers-style attention processors, ``torch.nn.MultiheadAttention``, your own
    modules) then runs condinit's op, so ``torch.func.jvp`` and ``torch.autograd.forward_ad``
    work through the model. Code that bound the function at import
    (``from torch.nn.functional import scaled_dot_product_attention``) keeps PyTorch's and is
    not covered; nor are attention paths that do not call SDPA.

    The original is restored on exit, also when the block raises. Nesting works (only the
    outermost exit restores). The patch replaces a module attribute, so it is process-wide:
    while it is active, every thread that calls ``F.scaled_dot_product_attention`` gets
    :func:`condinit.sdpa`. Entering and leaving are serialized by a lock and counted, so
    overlapping blocks in several threads restore the original only when the last one leaves.

    Examples:
        >>> with condinit.patch_sdpa():
        ...     out, tangent = torch.func.jvp(model, (x,), (dx,))
        >>> @condinit.patch_sdpa()
        ... def tangent_of(model, x, dx):
        ...     return torch.func.jvp(model, (x,), (dx,))[1]
    """
    return _PatchSDPA()
