"""The torch.library custom ops of fused attention: each runs the backend row it is given.

Custom ops in the ``condinit`` namespace (``impl`` is the chosen backend's name, so a traced
graph or a saved autograd context replays the same kernel):

* ``condinit::attention_fwd(q, k, v, <mask>, impl) -> (out, lse)``
* ``condinit::attention_bwd(dout, q, k, v, out, lse, <mask>, impl) -> (dq, dk, dv)``
* ``condinit::attention_jvp(q, k, v, tq?, tk?, tv?, <mask>, impl) -> (out, tout, lse)``
* ``condinit::attention_jvp_bwd(gout, gtout, q, k, v, tq?, tk?, tv?, out, tout, lse, <mask>,
  impl) -> (dq, dk, dv, dtq, dtk, dtv)`` (the backward through the tangent output)

where ``<mask>`` is ``causal, scale, window_left, window_right, q_lens?, kv_lens?`` (the mask
contract every backend implements: :func:`attention` and ``docs/design.md``, "Attention",
"Masks"; lens are int32 ``[B]``).

Each has a fake (meta) kernel, so ``torch.compile`` traces them, and a vmap rule that folds the
vmapped dimension into the batch dimension, so ``torch.vmap`` / ``jacfwd`` / ``jacrev`` work.

Each op's body, when it runs, adds one :class:`DispatchRecord` (the op, the backend it ran, the
shapes and mask kinds) to every open :func:`condinit.explain.dispatch_log` (``ACTIVE_LOGS``; an
empty list costs one truth test per call).
"""
import dataclasses
import torch
from torch import Tensor
from typing import Optional

from condinit.ops.attention import reference
from condinit.ops.attention.backends import (ATTENTION_BWD, ATTENTION_FWD, ATTENTION_JVP, ATTENTION_JVP_BWD,
                                             mask_kinds)

@dataclasses.dataclass(frozen=True)
class DispatchRecord:
    """One attention kernel call as it ran: the op, the backend row, and what the row was chosen
    for (device, dtype, shapes, probes, mask kinds)."""
    op: str
    backend: str
    device: str
    dtype: torch.dtype
    shape: tuple[int, int, int, int, int, int]   # B, H, Hkv, Nq, Nk, d
    probes: int                                  # P for the JVP ops, 0 otherwise
    masks: tuple[str, ...]                       # the mask kinds: "causal", "window", "lens"
    window: tuple[int, int]                      # (window_left, window_right), -1: unbounded

    def __str__(self) -> str:
        B, H, Hkv, Nq, Nk, d = self.shape
        probes = f", {self.probes} probe{'s' * (self.probes != 1)}" if self.probes else ""
        window = f" {self.window}" if "window" in self.masks else ""
        masks = ", ".join(m + window if m == "window" else m for m in self.masks) or "no mask"
        return (f"{self.op} on {self.backend}: {self.device} {str(self.dtype).replace('torch.', '')} "
                f"B={B} H={H} Hkv={Hkv} Nq={Nq} Nk={Nk} d={d}{probes}; {masks}")


# The lists of the open dispatch logs (condinit.explain.dispatch_log appends and removes them).
ACTIVE_LOGS: list[list] = []


def _record(op: str, impl: str, q: Tensor, k: Tensor, probes: int, causal: bool, window_left: int,
            window_right: int, q_lens: Optional[Tensor], kv_lens: Optional[Tensor]) -> None:
    B, H, Nq, d = q.shape
    rec = DispatchRecord(op, impl, q.device.type, q.dtype, (B, H, k.shape[1], Nq, k.shape[2], d), probes,
                         mask_kinds(causal, window_left, window_right, q_lens, kv_lens),
                         (window_left, window_right))
    for log in ACTIVE_LOGS:
        log.append(rec)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def contiguous_or_none(x: Optional[Tensor]) -> Optional[Tensor]:
    return x.contiguous() if x is not None else None


@torch.library.custom_op("condinit::attention_fwd", mutates_args=())
def attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int,
                      window_right: int, q_lens: Optional[Tensor], kv_lens: Optional[Tensor],
                      impl: str) -> tuple[Tensor, Tensor]:
    """Fused attention forward on backend ``impl``: ``(out, lse)``."""
    if ACTIVE_LOGS:
        _record("attention_fwd", impl, q, k, 0, causal, window_left, window_right, q_lens, kv_lens)
    out, lse = ATTENTION_FWD(impl, q.contiguous(), k.contiguous(), v.contiguous(), causal, scale,
                             window_left, window_right, q_lens, kv_lens)
    return out, lse


@attention_fwd_op.register_fake
def _(q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
    B, H, Nq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, Nq), dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("condinit::attention_bwd", mutates_args=())
def attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      causal: bool, scale: float, window_left: int, window_right: int,
                      q_lens: Optional[Tensor], kv_lens: Optional[Tensor], impl: str
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """Flash VJP from the saved ``lse`` on backend ``impl``: ``(dq, dk, dv)``."""
    if ACTIVE_LOGS:
        _record("attention_bwd", impl, q, k, 0, causal, window_left, window_right, q_lens, kv_lens)
    dq, dk, dv = ATTENTION_BWD(impl, *(x.contiguous() for x in (dout, q, k, v, out, lse)), causal, scale,
                               window_left, window_right, q_lens, kv_lens)
    return dq, dk, dv


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class AttentionBwd(torch.autograd.Function):
    """The flash VJP op, differentiable again: double backward differentiates the VJP as a
    function of (dout, q, k, v) through the tiled reference. ``out`` and ``lse`` are functions of
    q, k, v already accounted for by the recomputation, so they get no gradient of their own.
    (An autograd.Function rather than ``torch.library.register_autograd``, whose generated
    function does not run under ``torch.func.grad``.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(dout, q, k, v, out, lse, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
        return attention_bwd_op(dout, q, k, v, out, lse, causal, scale, window_left, window_right,
                                 q_lens, kv_lens, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        dout, q, k, v, out, lse, causal, scale, window_left, window_right, q_lens, kv_lens, impl = inputs
        ctx.save_for_backward(dout, q, k, v)
        ctx.mask = (causal, scale, window_left, window_right, q_lens, kv_lens)

    @staticmethod
    def backward(ctx, gdq, gdk, gdv):
        dout, q, k, v = ctx.saved_tensors
        mask = ctx.mask

        def vjp_of_attention(do, q_, k_, v_):
            f = lambda a, b, c: reference.attention_fwd(a, b, c, *mask)[0]  # noqa: E731
            return torch.func.vjp(f, q_, k_, v_)[1](do)

        _, vjp_fn = torch.func.vjp(vjp_of_attention, dout, q, k, v)
        gdout, gq, gk, gv = vjp_fn((gdq, gdk, gdv))
        return (gdout, gq, gk, gv) + (None,) * 9


@torch.library.custom_op("condinit::attention_jvp", mutates_args=())
def attention_jvp_op(q: Tensor, k: Tensor, v: Tensor, tq: Optional[Tensor], tk: Optional[Tensor],
                      tv: Optional[Tensor], causal: bool, scale: float, window_left: int,
                      window_right: int, q_lens: Optional[Tensor], kv_lens: Optional[Tensor], impl: str
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """Fused single-pass JVP on backend ``impl``: ``(out, tout, lse)``; tangents ``[P, ...]``,
    at least one not None (a None tangent is zero)."""
    if ACTIVE_LOGS:
        P = next(t.shape[0] for t in (tq, tk, tv) if t is not None)
        _record("attention_jvp", impl, q, k, P, causal, window_left, window_right, q_lens, kv_lens)
    out, tout, lse = ATTENTION_JVP(impl, q.contiguous(), k.contiguous(), v.contiguous(),
                                   contiguous_or_none(tq), contiguous_or_none(tk), contiguous_or_none(tv), causal, scale, window_left, window_right,
                                   q_lens, kv_lens)
    return out, tout, lse


@attention_jvp_op.register_fake
def _(q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
    B, H, Nq, _ = q.shape
    P = next(t.shape[0] for t in (tq, tk, tv) if t is not None)
    return (torch.empty_like(q), q.new_empty((P,) + tuple(q.shape)),
            q.new_empty((B, H, Nq), dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("condinit::attention_jvp_bwd", mutates_args=())
def attention_jvp_bwd_op(gout: Tensor, gtout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                          tq: Optional[Tensor], tk: Optional[Tensor], tv: Optional[Tensor], out: Tensor,
                          tout: Tensor, lse: Tensor, causal: bool, scale: float, window_left: int,
                          window_right: int, q_lens: Optional[Tensor], kv_lens: Optional[Tensor],
                          impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward through the fused JVP on backend ``impl``: ``(dq, dk, dv, dtq, dtk, dtv)`` for
    upstream ``gout`` and ``gtout`` ``[P, ...]``. A None tangent is zero and still gets its
    gradient (the caller drops it)."""
    if ACTIVE_LOGS:
        _record("attention_jvp_bwd", impl, q, k, gtout.shape[0], causal, window_left, window_right, q_lens,
                kv_lens)
    grads = ATTENTION_JVP_BWD(impl, *(x.contiguous() for x in (gout, gtout, q, k, v)), contiguous_or_none(tq), contiguous_or_none(tk),
                              contiguous_or_none(tv), *(x.contiguous() for x in (out, tout, lse)), causal, scale,
                              window_left, window_right, q_lens, kv_lens)
    return tuple(grads)


@attention_jvp_bwd_op.register_fake
def _(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, causal, scale, window_left, window_right,
      q_lens, kv_lens, impl):
    P = gtout.shape[0]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            *(x.new_empty((P,) + tuple(x.shape)) for x in (q, k, v)))


# vmap rules: move the vmapped dim to the front and fold it into B ([V, B, ...] -> [V*B, ...]);
# tangents [P, B, ...] become [P, V*B, ...]. Unbatched inputs are expanded.

def fold(x: Optional[Tensor], bdim: Optional[int], size: int) -> Optional[Tensor]:
    if x is None:
        return None
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def fold_tangent(x: Optional[Tensor], bdim: Optional[int], size: int) -> Optional[Tensor]:
    if x is None:
        return None
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    x = x.transpose(0, 1)                                   # [P, V, B, ...]
    return x.reshape(x.shape[0], size * x.shape[2], *x.shape[3:])


def unfold(x: Tensor, size: int, lead: int = 0) -> Tensor:
    """[..lead.., V*B, ...] -> [..lead.., V, B, ...]."""
    s = x.shape
    return x.reshape(*s[:lead], size, s[lead] // size, *s[lead + 1:])


def fold_mask(n: int, in_dims, causal, scale, window_left, window_right, q_lens, kv_lens) -> tuple:
    """The mask arguments for the folded batch: lens ``[B]`` (or ``[V, B]`` when vmapped)
    become ``[V*B]`` int32."""
    lens = [fold(x, d, n) for x, d in zip((q_lens, kv_lens), in_dims)]
    lens = [x.to(torch.int32).contiguous() if x is not None else None for x in lens]
    return (causal, scale, window_left, window_right, *lens)


@torch.library.register_vmap("condinit::attention_fwd")
def _(info, in_dims, q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
    n = info.batch_size
    qd, kd, vd = in_dims[:3]
    mask = fold_mask(n, in_dims[7:9], causal, scale, window_left, window_right, q_lens, kv_lens)
    out, lse = attention_fwd_op(fold(q, qd, n), fold(k, kd, n), fold(v, vd, n), *mask, impl)
    return (unfold(out, n), unfold(lse, n)), (0, 0)


@torch.library.register_vmap("condinit::attention_bwd")
def _(info, in_dims, dout, q, k, v, out, lse, causal, scale, window_left, window_right, q_lens, kv_lens,
      impl):
    n = info.batch_size
    args = [fold(x, d, n) for x, d in zip((dout, q, k, v, out, lse), in_dims[:6])]
    mask = fold_mask(n, in_dims[10:12], causal, scale, window_left, window_right, q_lens, kv_lens)
    dq, dk, dv = attention_bwd_op(*args, *mask, impl)
    return (unfold(dq, n), unfold(dk, n), unfold(dv, n)), (0, 0, 0)


@torch.library.register_vmap("condinit::attention_jvp")
def _(info, in_dims, q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens,
      impl):
    n = info.batch_size
    primals = [fold(x, d, n) for x, d in zip((q, k, v), in_dims[:3])]
    tangents = [fold_tangent(x, d, n) for x, d in zip((tq, tk, tv), in_dims[3:6])]
    mask = fold_mask(n, in_dims[10:12], causal, scale, window_left, window_right, q_lens, kv_lens)
    out, tout, lse = attention_jvp_op(*primals, *tangents, *mask, impl)
    return (unfold(out, n), unfold(tout, n, lead=1), unfold(lse, n)), (0, 1, 0)


@torch.library.register_vmap("condinit::attention_jvp_bwd")
def _(info, in_dims, gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, causal, scale, window_left,
      window_right, q_lens, kv_lens, impl):
    n = info.batch_size
    folds = [fold, fold_tangent, fold, fold, fold, fold_tangent, fold_tangent, fold_tangent,
             fold, fold_tangent, fold]
    args = [f(x, d, n) for f, x, d in zip(folds, (gout, gtout, q, k, v, tq, tk, tv, out, tout, lse), in_dims)]
    mask = fold_mask(n, in_dims[15:17], causal, scale, window_left, window_right, q_lens, kv_lens)
    grads = attention_jvp_bwd_op(*args, *mask, impl)
    return (tuple(unfold(g, n) for g in grads[:3]) + tuple(unfold(g, n, lead=1) for g in grads[3:]),
            (0, 0, 0, 1, 1, 1))


