"""The public fused-attention ops :func:`attention` and :func:`attention_jvp`, and their autograd.

Call path (one per op): :func:`attention` / :func:`attention_jvp` validate their arguments
(here, once, with :mod:`.checks`), pick a backend from the op's table
(:mod:`.backends`, :meth:`condinit._backends.Op.choose`, once per call), and call the custom op
``condinit::attention_fwd`` / ``attention_jvp`` (:mod:`.library`) with the chosen name; the op's
body runs that table row, which calls the kernel: the tiled PyTorch reference
(:mod:`condinit.ops.attention.reference`), the Triton kernels (``condinit.kernels.attention``), or
the C++ CPU / CUDA kernels of the native extension (``torch.ops.condinit_C.attention_*``, from
``csrc/attention/``). Gradients go through ``condinit::attention_bwd`` the same way. Kernels check
only the layout facts they index by.

:func:`attention` is a ``torch.autograd.Function`` (backward = flash VJP from the saved
log-sum-exp, ``jvp`` = the fused JVP op); :func:`attention_jvp` is the single-pass JVP with several
probes, differentiable in all six inputs through ``attention_jvp_bwd``. The mask contract:
:func:`attention` and ``docs/design.md``, "Attention", "Masks". The math: ``docs/design.md``,
"Attention".
"""
import torch
from torch import Tensor
from typing import Optional

from condinit import _backends
from condinit._validate import check_bool
from condinit.ops.attention.backends import (ATTENTION_BWD, ATTENTION_FWD, ATTENTION_JVP, ATTENTION_JVP_BWD,
                                             KERNEL_DTYPES, KERNEL_HEAD_DIMS, choose, mask_kinds)
from condinit.ops.attention.checks import check_mask, check_options, check_primals, check_tangents
from condinit.ops.attention.library import (AttentionBwd, attention_fwd_op, attention_jvp_bwd_op, attention_jvp_op,
                                            contiguous_or_none, fold, fold_mask, unfold)

__all__ = ["attention", "attention_jvp", "chosen_backends", "KERNEL_HEAD_DIMS", "KERNEL_DTYPES", "ATTENTION_FWD",
           "ATTENTION_BWD", "ATTENTION_JVP", "ATTENTION_JVP_BWD"]

# --------------------------------------------------------------------------------------------
# attention: autograd.Function with VJP and fused JVP
# --------------------------------------------------------------------------------------------

class _Attention(torch.autograd.Function):
    """``(out, lse) = attention(q, k, v)``; backward is the flash VJP from the saved ``lse``.

    ``fwd_impl``, ``bwd_impl``, ``jvp_impl`` name the backends chosen for the three ops (separate
    str arguments: ``generate_vmap_rule`` composes with ``jvp`` only for flat arguments). This
    class has no ``jvp`` so that ``torch.compile`` (Dynamo) can trace it; :class:`_AttentionAD` adds the
    forward-mode rule for eager / ``torch.func`` use.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, fwd_impl, bwd_impl, jvp_impl,
                jvp_bwd_impl):
        return attention_fwd_op(q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, fwd_impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, fwd_impl, bwd_impl, jvp_impl,
         jvp_bwd_impl) = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask = (causal, scale, window_left, window_right, q_lens, kv_lens)
        ctx.bwd_impl, ctx.jvp_impl, ctx.jvp_bwd_impl = bwd_impl, jvp_impl, jvp_bwd_impl

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = AttentionBwd.apply(dout, q, k, v, out, lse, *ctx.mask, ctx.bwd_impl)
        return (dq, dk, dv) + (None,) * 10


class _AttentionAD(_Attention):
    """:class:`_Attention` plus forward mode: the tangent comes from the fused JVP op.

    Forward-mode AD calls ``forward`` (primal) and then ``jvp``, which runs the fused pass again
    (primal tiles included): about 4 forwards in all. :func:`attention_jvp` is the single-pass
    route when the tangent is all you need.
    """

    # torch's generated vmap rule does not compose with a jvp rule (jvp of vmap hits an internal
    # assert): fold the vmapped dimension into the batch explicitly, as the custom ops do.
    generate_vmap_rule = False

    @staticmethod
    def vmap(info, in_dims, q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, fwd_impl, bwd_impl,
             jvp_impl, jvp_bwd_impl):
        n = info.batch_size
        mask = fold_mask(n, in_dims[7:9], causal, scale, window_left, window_right, q_lens, kv_lens)
        out, lse = _AttentionAD.apply(fold(q, in_dims[0], n), fold(k, in_dims[1], n),
                                      fold(v, in_dims[2], n), *mask, fwd_impl, bwd_impl, jvp_impl,
                                      jvp_bwd_impl)
        return (unfold(out, n), unfold(lse, n)), (0, 0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _Attention.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs[:3])

    @staticmethod
    def jvp(ctx, tq, tk, tv, *_):
        q, k, v = ctx.saved_tensors
        if tq is None and tk is None and tv is None:
            return torch.zeros_like(q), None
        tangents = [t.unsqueeze(0) if t is not None else None for t in (tq, tk, tv)]
        # Through the differentiable JVP op: a loss on the tangent (consistency models, MeanFlow)
        # differentiates it under torch.func.grad / vjp, by the tangent backward op.
        _, tout, _ = _AttentionJVP.apply(q, k, v, *tangents, *ctx.mask, ctx.jvp_impl, ctx.jvp_bwd_impl)
        return tout.squeeze(0), None


def chosen_backends(q: Tensor, backend: Optional[str], masks: tuple[str, ...]) -> dict[str, str]:
    """The backend of each op a :func:`attention` call runs, by op name: the forward, its
    backward, forward mode (the fused JVP) and the backward through that tangent (chosen once per
    call; :func:`condinit.explain` reports them)."""
    impls = {op.name: choose(op, q, backend, masks) for op in (ATTENTION_FWD, ATTENTION_BWD, ATTENTION_JVP)}
    impls[ATTENTION_JVP_BWD.name] = backward_backend(ATTENTION_JVP_BWD, q, backend, masks)
    return impls


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              window: Optional[tuple[int, int]] = None, q_lens: Optional[Tensor] = None,
              kv_lens: Optional[Tensor] = None, scale: Optional[float] = None,
              backend: Optional[str] = None) -> Tensor:
    """Fused scaled-dot-product attention, ``softmax(scale Q K^T [+ mask]) V``.

    Args:
        q: ``[B, H, Nq, d]``.
        k, v: ``[B, Hkv, Nk, d]``, ``Hkv`` divides ``H`` (query head ``h`` uses key/value head
            ``h // (H // Hkv)``).
        causal, window, q_lens, kv_lens: the mask, which every backend of every attention op
            implements (also ``docs/design.md``, "Attention", "Masks"). For batch entry ``b`` let
            ``Lq = q_lens[b]`` (default ``Nq``), ``Lk = kv_lens[b]`` (default ``Nk``) and
            ``off = Lk - Lq``. Query ``i < Lq`` attends key ``j`` iff ``j < Lk`` and,
            with ``causal``, ``j <= i + off`` (bottom-right aligned) and, with ``window = (left,
            right)``, ``i + off - left <= j <= i + off + right`` (-1: unbounded on that side;
            Hugging Face's ``sliding_window=W`` is ``causal=True, window=(W - 1, -1)``). Queries
            ``i >= Lq`` are padding. A query with no key gets 0 (and zero gradients); padded keys
            get zero gradients. ``q_lens`` / ``kv_lens``: int tensors (or lists) ``[B]``.
        scale: defaults to ``1 / sqrt(d)``.
        backend: ``"cuda"``, ``"triton"``, ``"cpp-cpu"``, ``"torch"``, or None / ``"auto"``
            (the first deterministic backend that supports the call; ``condinit info`` shows the
            table). A forced backend that cannot run the call raises
            :class:`condinit.BackendUnavailableError`.

    Returns ``out`` ``[B, H, Nq, d]`` in the input dtype (fp32 accumulation; float64 inputs in
    float64).

    Differentiable in reverse mode (flash VJP from the saved log-sum-exp, O(N) memory) and
    forward mode (``torch.func.jvp``, ``torch.autograd.forward_ad``: the fused JVP kernel), and
    under ``torch.func.vmap`` / ``jacfwd`` / ``jacrev`` and ``torch.compile``. Forward mode runs
    the primal and then the fused JVP; :func:`attention_jvp` does both in one pass, with several
    probes at once. The forward-mode tangent is differentiable in reverse mode (a loss on
    ``torch.func.jvp``'s tangent, under ``torch.autograd`` or ``torch.func.grad``): its gradients
    come from the tangent backward op, O(N) memory.

    Examples:
        >>> q, k, v = torch.randn(2, 8, 128, 64), torch.randn(2, 2, 128, 64), torch.randn(2, 2, 128, 64)
        >>> out = condinit.attention(q, k, v, causal=True)            # GQA: 8 query, 2 kv heads
        >>> out = condinit.attention(q, k, v, causal=True, window=(31, -1))   # sliding window 32
        >>> out = condinit.attention(q, k, v, kv_lens=torch.tensor([128, 100]))  # key padding
        >>> out, tangent = torch.func.jvp(condinit.attention, (q, k, v), (q, k, v))
    """
    check_primals(q, k, v)
    causal, left, right, q_lens, kv_lens = check_mask(q, k, causal, window, q_lens, kv_lens)
    scale, backend = check_options(scale, backend, q.shape[-1])
    masks = mask_kinds(causal, left, right, q_lens, kv_lens)
    impls = tuple(chosen_backends(q, backend, masks).values())
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    args = (q, k, v, causal, scale, left, right, q_lens, kv_lens, *impls)
    if not torch.compiler.is_compiling():
        return _AttentionAD.apply(*args)[0]
    if _transformed():
        return _eager_attention(*args)
    return _Attention.apply(*args)[0]


def _transformed() -> bool:
    """Whether a torch.func transform or a forward-AD dual level is active (both readable while
    Dynamo traces). Traced under them, a custom op inside an autograd.Function loses its
    forward-mode rule (the tangent comes out zero), so such calls leave the graph."""
    return torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0


def _eager_attention(*args) -> Tensor:
    """:class:`_AttentionAD` outside the compiled graph (a graph break; ``fullgraph=True`` raises).
    The disable wrapper is made here, not at import: ``torch.compiler.disable`` imports Dynamo,
    and with it triton, which ``import condinit`` must not."""
    return torch.compiler.disable(_attention_ad)(*args)


def _attention_ad(*args) -> Tensor:
    return _AttentionAD.apply(*args)[0]


# --------------------------------------------------------------------------------------------
# attention_jvp: the fused single-pass JVP, differentiable in all six inputs
# --------------------------------------------------------------------------------------------

class _FirstOrderOnly(torch.autograd.Function):
    """``grads = _FirstOrderOnly.apply(n, *grads, *inputs)``: the ``n`` gradients unchanged, tied
    to the ``inputs`` they were computed from by a node whose backward raises.

    :class:`_AttentionJVP` applies it when its backward runs while a graph is recorded
    (``create_graph=True``, nested ``torch.func`` transforms), so that a second-order gradient
    through the tangent backward raises. (``once_differentiable`` does not do that under
    ``torch.func``: there the second derivative silently comes out as zero.)
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(n, *tensors):
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            "condinit.attention_jvp: second-order gradients through the backward of its tangent "
            "output are not implemented (that backward is not differentiable). A loss that does "
            "not use tangent_out can pass grad_through_tangent=False, whose backward is.")


class _JVPForward(torch.autograd.Function):
    """The fused JVP op's ``(out, tout, lse)`` as an autograd function; the subclasses say what its
    backward differentiates."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens, jvp_impl, bwd_impl):
        return attention_jvp_op(q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens,
                                 jvp_impl)



class _AttentionJVP(_JVPForward):
    """``(out, tout, lse)`` from the fused JVP op; backward = ``condinit::attention_jvp_bwd``, the
    tiled pass through both outputs from the saved ``(out, tout, lse)`` (O(N) memory).

    ``jvp_impl`` and ``bwd_impl`` name the backends of the JVP and of its backward. The backward
    is not itself differentiable: second-order gradients through it raise
    (:class:`_FirstOrderOnly`).
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens, jvp_impl, bwd_impl = inputs
        ctx.mark_non_differentiable(output[2])
        ctx.present = tuple(t is not None for t in (tq, tk, tv))
        ctx.save_for_backward(q, k, v, tq, tk, tv, *output)
        ctx.mask = (causal, scale, window_left, window_right, q_lens, kv_lens)
        ctx.bwd_impl = bwd_impl

    @staticmethod
    def backward(ctx, gout, gtout, _glse):
        q, k, v, tq, tk, tv, out, tout, lse = ctx.saved_tensors
        inputs = [x for x in (gout, gtout, q, k, v, tq, tk, tv) if x is not None]
        recording = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
        with torch.no_grad():  # the op has no autograd formula; _FirstOrderOnly stands in for one
            grads = attention_jvp_bwd_op(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse,
                                          *ctx.mask, ctx.bwd_impl)
        if recording:
            grads = _FirstOrderOnly.apply(len(grads), *grads, *inputs)
        dq, dk, dv, *dt = grads
        dt = [g if p else None for g, p in zip(dt, ctx.present)]
        return (dq, dk, dv, *dt) + (None,) * 8


class _AttentionJVPOutGrad(_JVPForward):
    """``(out, tout, lse)`` from the fused JVP op with ``tout`` not differentiable: backward = the
    flash VJP of ``out`` alone (``condinit::attention_bwd``, itself differentiable)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens, jvp_impl, bwd_impl = inputs
        out, tout, lse = output
        ctx.mark_non_differentiable(tout, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask = (causal, scale, window_left, window_right, q_lens, kv_lens)
        ctx.bwd_impl = bwd_impl

    @staticmethod
    def backward(ctx, gout, _gtout, _glse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = AttentionBwd.apply(gout, q, k, v, out, lse, *ctx.mask, ctx.bwd_impl)
        return (dq, dk, dv) + (None,) * 11


def backward_backend(op: _backends.Op, q: Tensor, backend: Optional[str], masks: tuple[str, ...]) -> str:
    """The backward's backend: the one forced for the forward where ``op`` has a row for it
    (every attention op has torch, Triton, cpp-cpu and CUDA rows), else the automatic choice."""
    return choose(op, q, backend if backend is None or backend in op.impls else "auto", masks)


def attention_jvp(q: Tensor, k: Tensor, v: Tensor, tq: Optional[Tensor] = None,
                  tk: Optional[Tensor] = None, tv: Optional[Tensor] = None, *,
                  causal: bool = False, window: Optional[tuple[int, int]] = None,
                  q_lens: Optional[Tensor] = None, kv_lens: Optional[Tensor] = None,
                  scale: Optional[float] = None,
                  backend: Optional[str] = None, grad_through_tangent: bool = True
                  ) -> tuple[Tensor, Tensor]:
    """Attention and its Jacobian-vector product in one fused pass: ``(out, tangent_out)``.

    With ``S = scale Q K^T (+ mask)``, ``P = softmax(S)``, ``O = P V``::

        S' = scale (Q' K^T + Q K'^T),   P' = P * (S' - rowsum(P * S')),   O' = P' V + P V'

    computed without any N x N matrix (online softmax; ``docs/design.md``, "Attention").

    Args:
        q, k, v: as in :func:`attention`.
        tq, tk, tv: tangents shaped like their primal, or with a leading probe dim ``[P, ...]``
            (all given ones alike); None means a zero tangent (its work is skipped where the
            backend allows). The ``P`` probes share the primal tiles in one pass.
        causal, window, q_lens, kv_lens, scale: as in :func:`attention` (rows that attend no
            key, padded queries included, get a zero tangent).
        backend: as in :func:`attention`, for the JVP. The backward uses the same backend where
            its table has that row, else the automatic choice (the backward through the tangent
            has torch, cpp-cpu, Triton and CUDA rows: ``condinit info``).
        grad_through_tangent: if True (default), gradients flow through both outputs. If False,
            ``tangent_out`` is returned detached (no gradient reaches q, k, v or the tangents
            through it) and the backward is the plain flash backward of ``out`` (5 tile
            products instead of ``8 + 16 P``): for callers whose loss does not use the tangent.

    Returns ``out`` ``[B, H, Nq, d]`` and ``tangent_out`` ``[B, H, Nq, d]`` or
    ``[P, B, H, Nq, d]``, both in the input dtype.

    Gradients: a loss on ``(out, tangent_out)`` gets gradients with respect to q, k, v (summed
    over the probes) and each probe's tq, tk, tv (None for a None tangent) from one tiled
    backward pass (``docs/design.md``, "Attention": backward through the tangent output). It
    recomputes the scores and ``rowsum(P * S')`` from the saved ``out``, ``tangent_out`` and
    log-sum-exp and never holds an N x N matrix: O(N) memory for every backend. fp16 / bf16
    accumulate in fp32. The backward is not itself differentiable: a second-order gradient
    through it raises (``grad_through_tangent=False`` keeps the flash backward, which is).

    Examples:
        >>> q, k, v = (torch.randn(1, 4, 256, 64) for _ in range(3))
        >>> out, tout = condinit.attention_jvp(q, k, v, tq=torch.randn_like(q))       # one probe
        >>> out, touts = condinit.attention_jvp(q, k, v, tk=torch.randn(8, 1, 4, 256, 64))  # 8 probes
        >>> q = torch.randn(1, 4, 256, 64, requires_grad=True)
        >>> out, tout = condinit.attention_jvp(q, k, v, tq=torch.randn_like(q))
        >>> (out.square().sum() + tout.square().sum()).backward()                    # q.grad
    """
    check_primals(q, k, v)
    causal, left, right, q_lens, kv_lens = check_mask(q, k, causal, window, q_lens, kv_lens)
    scale, backend = check_options(scale, backend, q.shape[-1])
    check_bool("grad_through_tangent", grad_through_tangent)
    has_p, P = check_tangents((("q", q), ("k", k), ("v", v)), (("tq", tq), ("tk", tk), ("tv", tv)))
    masks = mask_kinds(causal, left, right, q_lens, kv_lens)
    mask = (causal, scale, left, right, q_lens, kv_lens)
    impl = choose(ATTENTION_JVP, q, backend, masks)
    if tq is None and tk is None and tv is None:
        tv = torch.zeros_like(v)  # all-zero tangent: keep one code path (out is still needed)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tangents = []
    for t in (tq, tk, tv):
        if t is not None and not has_p:
            t = t.unsqueeze(0)
        if t is not None and not grad_through_tangent:
            t = t.detach()  # no gradient path through tangent_out
        tangents.append(contiguous_or_none(t))
    differentiable = (q, k, v, *tangents) if grad_through_tangent else (q, k, v)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in differentiable)
    if needs_grad:
        fn, bwd_op = ((_AttentionJVP, ATTENTION_JVP_BWD) if grad_through_tangent
                      else (_AttentionJVPOutGrad, ATTENTION_BWD))
        bwd_impl = backward_backend(bwd_op, q, backend, masks)
        out, tout, _ = fn.apply(q, k, v, *tangents, *mask, impl, bwd_impl)
    else:
        out, tout, _ = attention_jvp_op(q, k, v, *tangents, *mask, impl)
    return out, (tout if has_p else tout.squeeze(0))

