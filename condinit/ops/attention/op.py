"""The public fused-attention ops: validation, backend tables, torch.library registration.

Call path (one per op): :func:`attention` / :func:`attention_jvp` validate their arguments
(here, once), pick a backend from the op's table below (:meth:`condinit._backends.Op.choose`,
once per call), and call the custom op ``condinit::attention_fwd`` / ``attention_jvp`` with the
chosen name; the op's body runs that table row, which calls the kernel: the tiled PyTorch
reference (:mod:`condinit.ops.attention.reference`), the Triton kernels
(``condinit.kernels.attention``), or the C++ CPU / CUDA kernels of the native extension
(``torch.ops.condinit_C.attention_*``, from ``csrc/attention/``). Gradients go through
``condinit::attention_bwd`` the same way. Kernels check only the layout facts they index by.

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
On top of them, :func:`attention` (a ``torch.autograd.Function``: backward = flash VJP from the
saved log-sum-exp, ``jvp`` = the fused JVP op) and :func:`attention_jvp` (the single-pass JVP
with several probes, differentiable in all six inputs through ``attention_jvp_bwd``).

The math: ``docs/design.md``, "Attention".
"""

import torch
from torch import Tensor
from typing import Optional

from condinit import _backends
from condinit._validate import check_bool, check_int, check_real, check_tensor
from condinit.ops.attention import reference

__all__ = ["attention", "attention_jvp", "KERNEL_HEAD_DIMS", "KERNEL_DTYPES", "ATTENTION_FWD",
           "ATTENTION_BWD", "ATTENTION_JVP", "ATTENTION_JVP_BWD"]

# --------------------------------------------------------------------------------------------
# Backend tables: what each implementation runs. The choice and `condinit info` read these rows;
# the kernels do not repeat them.
# --------------------------------------------------------------------------------------------

# Head dims the Triton and CUDA launch configurations are tuned for (and the test grids walk).
# The kernels run any head dim up to 256 by padding to the next tuned tile width.
KERNEL_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Mask kinds a call can need (the "masks" limit of a row: the kinds it runs).
MASK_KINDS = ("causal", "window", "lens")
_GPU_LIMITS = {"dtype": KERNEL_DTYPES, "head_dim": range(1, 257), "masks": MASK_KINDS}
_ALL_MASKS = {"masks": MASK_KINDS}
_ANY = (_backends.ANY_DEVICE,)

ATTENTION_FWD = _backends.Op("attention_fwd")
ATTENTION_BWD = _backends.Op("attention_bwd")
ATTENTION_JVP = _backends.Op("attention_jvp")
# Gradients through attention_jvp's tangent output (one tiled pass from the saved out, tangent
# out and lse; O(N) memory on every backend).
ATTENTION_JVP_BWD = _backends.Op("attention_jvp_bwd")


def _zeros_tangents(q, k, v, tq, tk, tv):
    """Kernels take every tangent: a missing one becomes zeros [P, ...] (P from a given one)."""
    P = next(t.shape[0] for t in (tq, tk, tv) if t is not None)
    z = lambda x: x.new_zeros((P,) + tuple(x.shape))  # noqa: E731
    return (tq if tq is not None else z(q), tk if tk is not None else z(k),
            tv if tv is not None else z(v))


def _triton():
    from condinit.kernels import attention as kernels  # imports triton: only when a row runs
    return kernels


# torch: the tiled reference, any device, dtype and head dim
# Every row below takes the mask arguments (causal, scale, window_left, window_right, q_lens,
# kv_lens) after the tensors, in the order of the native schema.
for _op, _fn in ((ATTENTION_FWD, reference.attention_fwd), (ATTENTION_BWD, reference.attention_bwd),
                 (ATTENTION_JVP, reference.attention_jvp), (ATTENTION_JVP_BWD, reference.attention_jvp_bwd)):
    _op.register("torch", devices=_ANY, limits=_ALL_MASKS)(_fn)


@ATTENTION_FWD.register("triton", devices=("cuda", "cpu"), limits=_GPU_LIMITS)
def _fwd_triton(q, k, v, *mask):
    return _triton().attention_fwd(q, k, v, *mask)


@ATTENTION_BWD.register("triton", devices=("cuda", "cpu"), limits=_GPU_LIMITS)
def _bwd_triton(dout, q, k, v, out, lse, *mask):
    return _triton().attention_bwd(dout, q, k, v, out, lse, *mask)


@ATTENTION_JVP.register("triton", devices=("cuda", "cpu"), limits=_GPU_LIMITS)
def _jvp_triton(q, k, v, tq, tk, tv, *mask):
    return _triton().attention_jvp(q, k, v, *_zeros_tangents(q, k, v, tq, tk, tv), *mask)


# native: one condinit_C schema with a CPU kernel (cpp-cpu, any head dim) and a CUDA kernel. The
# kernels return a float32 lse; float64 inputs therefore run on the reference (float64 lse).
def _fwd_native(q, k, v, *mask):
    return tuple(torch.ops.condinit_C.attention_fwd(q, k, v, *mask))


def _bwd_native(dout, q, k, v, out, lse, *mask):
    return tuple(torch.ops.condinit_C.attention_bwd(dout, q, k, v, out, lse, *mask))


def _jvp_native(q, k, v, tq, tk, tv, *mask):
    tq, tk, tv = _zeros_tangents(q, k, v, tq, tk, tv)
    return tuple(torch.ops.condinit_C.attention_jvp(q, k, v, tq, tk, tv, *mask))


for _op, _fn in ((ATTENTION_FWD, _fwd_native), (ATTENTION_BWD, _bwd_native), (ATTENTION_JVP, _jvp_native)):
    _op.register("cpp-cpu", devices=("cpu",), limits={"dtype": KERNEL_DTYPES, **_ALL_MASKS},
                 native_op=_op.name)(_fn)
    # CUDA: bf16/fp16 on tensor cores need sm_80+ (the kernel refuses older GPUs by name); the
    # backward runs separate dQ and dK/dV kernels, no atomics, so its bits are deterministic.
    _op.register("cuda", devices=("cuda",), limits=_GPU_LIMITS, native_op=_op.name)(_fn)


# The tangent backward's C++ kernel takes float64 too: it computes in float64 and recomputes a
# float32 lse in float64 (the forward on float64 runs on the reference, which saves a float64 lse).
def _given_tangents(gtout, q, k, v, tq, tk, tv):
    """The tangent backward kernels take every tangent: None becomes zeros ``[P, ...]``."""
    z = lambda x: x.new_zeros((gtout.shape[0],) + tuple(x.shape))  # noqa: E731
    return tuple(t if t is not None else z(x) for t, x in ((tq, q), (tk, k), (tv, v)))


@ATTENTION_JVP_BWD.register("triton", devices=("cuda", "cpu"), limits=_GPU_LIMITS)
def _jvp_bwd_triton(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, *mask):
    tq, tk, tv = _given_tangents(gtout, q, k, v, tq, tk, tv)
    return _triton().attention_jvp_bwd(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, *mask)


@ATTENTION_JVP_BWD.register("cuda", devices=("cuda",), limits=_GPU_LIMITS, native_op="attention_jvp_bwd")
def _jvp_bwd_cuda(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, *mask):
    tq, tk, tv = _given_tangents(gtout, q, k, v, tq, tk, tv)
    return tuple(torch.ops.condinit_C.attention_jvp_bwd(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse,
                                                        *mask))


@ATTENTION_JVP_BWD.register("cpp-cpu", devices=("cpu",),
                            limits={"dtype": KERNEL_DTYPES + (torch.float64,), **_ALL_MASKS},
                            native_op="attention_jvp_bwd")
def _jvp_bwd_native(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, *mask):
    tq, tk, tv = _given_tangents(gtout, q, k, v, tq, tk, tv)
    return tuple(torch.ops.condinit_C.attention_jvp_bwd(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse,
                                                        *mask))


def _mask_kinds(causal: bool, window_left: int, window_right: int, q_lens: Optional[Tensor],
                kv_lens: Optional[Tensor]) -> tuple[str, ...]:
    """The mask kinds a call needs (the "masks" limit of the backend tables)."""
    return tuple(kind for kind, used in (("causal", causal),
                                         ("window", window_left >= 0 or window_right >= 0),
                                         ("lens", q_lens is not None or kv_lens is not None)) if used)


def _choose(op: _backends.Op, q: Tensor, backend: Optional[str], masks: tuple[str, ...] = ()) -> str:
    return _choose_cached(op.name, q.device, backend, q.dtype, int(q.shape[-1]), masks)


def _choose_cached(op_name: str, device: torch.device, backend: Optional[str], dtype: torch.dtype,
                   head_dim: int, masks: tuple[str, ...]) -> str:
    return _backends.get(op_name).choose(device, backend, dtype=dtype, head_dim=head_dim, masks=masks)


# A pure function of its arguments and the (cached) build facts: torch.compile records the chosen
# name as a constant instead of tracing the availability queries. This is what
# torch.compiler.assume_constant_result does; set directly because that function imports
# torch._dynamo (and with it triton), which must not happen when condinit.attention is merely
# resolved. tests/test_attention.py compiles with fullgraph=True, so a change in Dynamo shows.
_choose_cached._dynamo_marked_constant = True


# --------------------------------------------------------------------------------------------
# Custom ops: condinit::attention_fwd / attention_bwd / attention_jvp
# --------------------------------------------------------------------------------------------

def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _c(x: Optional[Tensor]) -> Optional[Tensor]:
    return x.contiguous() if x is not None else None


@torch.library.custom_op("condinit::attention_fwd", mutates_args=())
def _attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int,
                      window_right: int, q_lens: Optional[Tensor], kv_lens: Optional[Tensor],
                      impl: str) -> tuple[Tensor, Tensor]:
    """Fused attention forward on backend ``impl``: ``(out, lse)``."""
    out, lse = ATTENTION_FWD(impl, q.contiguous(), k.contiguous(), v.contiguous(), causal, scale,
                             window_left, window_right, q_lens, kv_lens)
    return out, lse


@_attention_fwd_op.register_fake
def _(q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
    B, H, Nq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, Nq), dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("condinit::attention_bwd", mutates_args=())
def _attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      causal: bool, scale: float, window_left: int, window_right: int,
                      q_lens: Optional[Tensor], kv_lens: Optional[Tensor], impl: str
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """Flash VJP from the saved ``lse`` on backend ``impl``: ``(dq, dk, dv)``."""
    dq, dk, dv = ATTENTION_BWD(impl, *(x.contiguous() for x in (dout, q, k, v, out, lse)), causal, scale,
                               window_left, window_right, q_lens, kv_lens)
    return dq, dk, dv


@_attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _AttentionBwd(torch.autograd.Function):
    """The flash VJP op, differentiable again: double backward differentiates the VJP as a
    function of (dout, q, k, v) through the tiled reference. ``out`` and ``lse`` are functions of
    q, k, v already accounted for by the recomputation, so they get no gradient of their own.
    (An autograd.Function rather than ``torch.library.register_autograd``, whose generated
    function does not run under ``torch.func.grad``.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(dout, q, k, v, out, lse, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
        return _attention_bwd_op(dout, q, k, v, out, lse, causal, scale, window_left, window_right,
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
def _attention_jvp_op(q: Tensor, k: Tensor, v: Tensor, tq: Optional[Tensor], tk: Optional[Tensor],
                      tv: Optional[Tensor], causal: bool, scale: float, window_left: int,
                      window_right: int, q_lens: Optional[Tensor], kv_lens: Optional[Tensor], impl: str
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """Fused single-pass JVP on backend ``impl``: ``(out, tout, lse)``; tangents ``[P, ...]``,
    at least one not None (a None tangent is zero)."""
    out, tout, lse = ATTENTION_JVP(impl, q.contiguous(), k.contiguous(), v.contiguous(),
                                   _c(tq), _c(tk), _c(tv), causal, scale, window_left, window_right,
                                   q_lens, kv_lens)
    return out, tout, lse


@_attention_jvp_op.register_fake
def _(q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
    B, H, Nq, _ = q.shape
    P = next(t.shape[0] for t in (tq, tk, tv) if t is not None)
    return (torch.empty_like(q), q.new_empty((P,) + tuple(q.shape)),
            q.new_empty((B, H, Nq), dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("condinit::attention_jvp_bwd", mutates_args=())
def _attention_jvp_bwd_op(gout: Tensor, gtout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                          tq: Optional[Tensor], tk: Optional[Tensor], tv: Optional[Tensor], out: Tensor,
                          tout: Tensor, lse: Tensor, causal: bool, scale: float, window_left: int,
                          window_right: int, q_lens: Optional[Tensor], kv_lens: Optional[Tensor],
                          impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward through the fused JVP on backend ``impl``: ``(dq, dk, dv, dtq, dtk, dtv)`` for
    upstream ``gout`` and ``gtout`` ``[P, ...]``. A None tangent is zero and still gets its
    gradient (the caller drops it)."""
    grads = ATTENTION_JVP_BWD(impl, *(x.contiguous() for x in (gout, gtout, q, k, v)), _c(tq), _c(tk),
                              _c(tv), *(x.contiguous() for x in (out, tout, lse)), causal, scale,
                              window_left, window_right, q_lens, kv_lens)
    return tuple(grads)


@_attention_jvp_bwd_op.register_fake
def _(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, causal, scale, window_left, window_right,
      q_lens, kv_lens, impl):
    P = gtout.shape[0]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            *(x.new_empty((P,) + tuple(x.shape)) for x in (q, k, v)))


# vmap rules: move the vmapped dim to the front and fold it into B ([V, B, ...] -> [V*B, ...]);
# tangents [P, B, ...] become [P, V*B, ...]. Unbatched inputs are expanded.

def _fold(x: Optional[Tensor], bdim: Optional[int], size: int) -> Optional[Tensor]:
    if x is None:
        return None
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _fold_tangent(x: Optional[Tensor], bdim: Optional[int], size: int) -> Optional[Tensor]:
    if x is None:
        return None
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    x = x.transpose(0, 1)                                   # [P, V, B, ...]
    return x.reshape(x.shape[0], size * x.shape[2], *x.shape[3:])


def _unfold(x: Tensor, size: int, lead: int = 0) -> Tensor:
    """[..lead.., V*B, ...] -> [..lead.., V, B, ...]."""
    s = x.shape
    return x.reshape(*s[:lead], size, s[lead] // size, *s[lead + 1:])


def _fold_mask(n: int, in_dims, causal, scale, window_left, window_right, q_lens, kv_lens) -> tuple:
    """The mask arguments for the folded batch: lens ``[B]`` (or ``[V, B]`` when vmapped)
    become ``[V*B]`` int32."""
    lens = [_fold(x, d, n) for x, d in zip((q_lens, kv_lens), in_dims)]
    lens = [x.to(torch.int32).contiguous() if x is not None else None for x in lens]
    return (causal, scale, window_left, window_right, *lens)


@torch.library.register_vmap("condinit::attention_fwd")
def _(info, in_dims, q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, impl):
    n = info.batch_size
    qd, kd, vd = in_dims[:3]
    mask = _fold_mask(n, in_dims[7:9], causal, scale, window_left, window_right, q_lens, kv_lens)
    out, lse = _attention_fwd_op(_fold(q, qd, n), _fold(k, kd, n), _fold(v, vd, n), *mask, impl)
    return (_unfold(out, n), _unfold(lse, n)), (0, 0)


@torch.library.register_vmap("condinit::attention_bwd")
def _(info, in_dims, dout, q, k, v, out, lse, causal, scale, window_left, window_right, q_lens, kv_lens,
      impl):
    n = info.batch_size
    args = [_fold(x, d, n) for x, d in zip((dout, q, k, v, out, lse), in_dims[:6])]
    mask = _fold_mask(n, in_dims[10:12], causal, scale, window_left, window_right, q_lens, kv_lens)
    dq, dk, dv = _attention_bwd_op(*args, *mask, impl)
    return (_unfold(dq, n), _unfold(dk, n), _unfold(dv, n)), (0, 0, 0)


@torch.library.register_vmap("condinit::attention_jvp")
def _(info, in_dims, q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens,
      impl):
    n = info.batch_size
    primals = [_fold(x, d, n) for x, d in zip((q, k, v), in_dims[:3])]
    tangents = [_fold_tangent(x, d, n) for x, d in zip((tq, tk, tv), in_dims[3:6])]
    mask = _fold_mask(n, in_dims[10:12], causal, scale, window_left, window_right, q_lens, kv_lens)
    out, tout, lse = _attention_jvp_op(*primals, *tangents, *mask, impl)
    return (_unfold(out, n), _unfold(tout, n, lead=1), _unfold(lse, n)), (0, 1, 0)


@torch.library.register_vmap("condinit::attention_jvp_bwd")
def _(info, in_dims, gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, causal, scale, window_left,
      window_right, q_lens, kv_lens, impl):
    n = info.batch_size
    fold = [_fold, _fold_tangent, _fold, _fold, _fold, _fold_tangent, _fold_tangent, _fold_tangent,
            _fold, _fold_tangent, _fold]
    args = [f(x, d, n) for f, x, d in zip(fold, (gout, gtout, q, k, v, tq, tk, tv, out, tout, lse), in_dims)]
    mask = _fold_mask(n, in_dims[15:17], causal, scale, window_left, window_right, q_lens, kv_lens)
    grads = _attention_jvp_bwd_op(*args, *mask, impl)
    return (tuple(_unfold(g, n) for g in grads[:3]) + tuple(_unfold(g, n, lead=1) for g in grads[3:]),
            (0, 0, 0, 1, 1, 1))


# --------------------------------------------------------------------------------------------
# Validation: once, here, before any kernel runs
# --------------------------------------------------------------------------------------------

def _check_primals(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, floating=True)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, N, d], got shape {tuple(t.shape)}")
        if any(s == 0 for s in t.shape):
            raise ValueError(f"{name} must have no empty dimension, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    B, H, _, d = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"k and v must have q's batch size {B}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"k and v must have q's head dim d={d}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, Hkv, Nk, d], got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if H % k.shape[1] != 0:
        raise ValueError(f"k's head count Hkv={k.shape[1]} must divide q's head count H={H} "
                         f"(grouped-query attention)")


def _check_options(scale, backend, d: int) -> tuple[float, Optional[str]]:
    scale = 1.0 / d ** 0.5 if scale is None else check_real("scale", scale)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if backend is not None and backend != "auto" and backend not in _backends.BACKENDS:
        raise ValueError(f"backend must be one of {_backends.BACKENDS}, 'auto' or None, got {backend!r}")
    return scale, backend


def _check_lens(name: str, lens, batch: int, n: int, what: str, device: torch.device) -> Optional[Tensor]:
    """``lens`` (None, or a ``[B]`` int tensor / sequence of ints in ``[0, n]``) as int32 on
    ``device``."""
    if lens is None:
        return None
    if isinstance(lens, (list, tuple)):
        for x in lens:
            check_int(f"{name} entries", x)
        lens = torch.tensor(lens, dtype=torch.int64)
    check_tensor(name, lens)
    if lens.dtype.is_floating_point or lens.dtype.is_complex or lens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {lens.dtype}")
    if tuple(lens.shape) != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}] (one {what} length per batch entry), "
                         f"got {tuple(lens.shape)}")
    # (Reading the values would break a torch.compile graph: there the C++ kernels check them.)
    if not torch.compiler.is_compiling() and bool(((lens < 0) | (lens > n)).any()):
        raise ValueError(f"{name} must be in [0, {n}] ({what} length at most its dimension), "
                         f"got {lens.tolist()}")
    return lens.to(device=device, dtype=torch.int32).contiguous()


def _check_mask(q: Tensor, k: Tensor, causal, window, q_lens, kv_lens) -> tuple:
    """``(causal, window_left, window_right, q_lens, kv_lens)`` as the kernels take them."""
    check_bool("causal", causal)
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be None or a pair (left, right) of ints >= -1 (-1: unbounded), "
                            f"got {window!r}")
        left = check_int("window[0] (left)", window[0], min=-1)
        right = check_int("window[1] (right)", window[1], min=-1)
    B = q.shape[0]
    q_lens = _check_lens("q_lens", q_lens, B, q.shape[2], "query", q.device)
    kv_lens = _check_lens("kv_lens", kv_lens, B, k.shape[2], "key", q.device)
    return causal, left, right, q_lens, kv_lens


def _check_tangents(primals, tangents) -> tuple[bool, int]:
    """Validate tangents against their primals; returns (has probe dim, P)."""
    probe, P = None, None
    for (pname, x), (tname, t) in zip(primals, tangents):
        if t is None:
            continue
        check_tensor(tname, t, floating=True)
        if t.dtype != x.dtype:
            raise TypeError(f"{tname} must have {pname}'s dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{tname} must be on {pname}'s device {x.device}, got {t.device}")
        if t.shape == x.shape:
            has_p, p = False, 1
        elif t.dim() == x.dim() + 1 and t.shape[1:] == x.shape and t.shape[0] >= 1:
            has_p, p = True, t.shape[0]
        else:
            raise ValueError(f"{tname} must have {pname}'s shape {tuple(x.shape)} or [P, "
                             f"*{tuple(x.shape)}] with a leading probe dim, got {tuple(t.shape)}")
        if probe is None:
            probe, P = has_p, p
        elif has_p != probe:
            raise ValueError("tangents must all have a leading probe dim P or all not, got "
                             + ", ".join(f"{n} {tuple(t.shape)}" for n, t in tangents if t is not None))
        elif p != P:
            raise ValueError(f"tangents must agree on the probe count P, got {tname} with P={p}, "
                             f"expected P={P}")
    return bool(probe), P or 1


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
        return _attention_fwd_op(q, k, v, causal, scale, window_left, window_right, q_lens, kv_lens, fwd_impl)

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
        dq, dk, dv = _AttentionBwd.apply(dout, q, k, v, out, lse, *ctx.mask, ctx.bwd_impl)
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
        mask = _fold_mask(n, in_dims[7:9], causal, scale, window_left, window_right, q_lens, kv_lens)
        out, lse = _AttentionAD.apply(_fold(q, in_dims[0], n), _fold(k, in_dims[1], n),
                                      _fold(v, in_dims[2], n), *mask, fwd_impl, bwd_impl, jvp_impl,
                                      jvp_bwd_impl)
        return (_unfold(out, n), _unfold(lse, n)), (0, 0)

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

    Returns ``out`` ``[B, H, Nq, d]`` in the input dtype (fp32 accumulation).

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
    _check_primals(q, k, v)
    causal, left, right, q_lens, kv_lens = _check_mask(q, k, causal, window, q_lens, kv_lens)
    scale, backend = _check_options(scale, backend, q.shape[-1])
    masks = _mask_kinds(causal, left, right, q_lens, kv_lens)
    impls = tuple(_choose(op, q, backend, masks) for op in (ATTENTION_FWD, ATTENTION_BWD, ATTENTION_JVP))
    impls += (_backward_backend(ATTENTION_JVP_BWD, q, backend, masks),)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    fn = _Attention if torch.compiler.is_compiling() else _AttentionAD
    out, _ = fn.apply(q, k, v, causal, scale, left, right, q_lens, kv_lens, *impls)
    return out


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


class _AttentionJVP(torch.autograd.Function):
    """``(out, tout, lse)`` from the fused JVP op; backward = ``condinit::attention_jvp_bwd``, the
    tiled pass through both outputs from the saved ``(out, tout, lse)`` (O(N) memory).

    ``jvp_impl`` and ``bwd_impl`` name the backends of the JVP and of its backward. The backward
    is not itself differentiable: second-order gradients through it raise
    (:class:`_FirstOrderOnly`).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens, jvp_impl, bwd_impl):
        return _attention_jvp_op(q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens,
                                 jvp_impl)

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
            grads = _attention_jvp_bwd_op(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse,
                                          *ctx.mask, ctx.bwd_impl)
        if recording:
            grads = _FirstOrderOnly.apply(len(grads), *grads, *inputs)
        dq, dk, dv, *dt = grads
        dt = [g if p else None for g, p in zip(dt, ctx.present)]
        return (dq, dk, dv, *dt) + (None,) * 8


class _AttentionJVPOutGrad(torch.autograd.Function):
    """``(out, tout, lse)`` from the fused JVP op with ``tout`` not differentiable: backward = the
    flash VJP of ``out`` alone (``condinit::attention_bwd``, itself differentiable)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens, jvp_impl, bwd_impl):
        return _attention_jvp_op(q, k, v, tq, tk, tv, causal, scale, window_left, window_right, q_lens, kv_lens,
                                 jvp_impl)

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
        dq, dk, dv = _AttentionBwd.apply(gout, q, k, v, out, lse, *ctx.mask, ctx.bwd_impl)
        return (dq, dk, dv) + (None,) * 11


def _backward_backend(op: _backends.Op, q: Tensor, backend: Optional[str], masks: tuple[str, ...]) -> str:
    """The backward's backend: the one forced for the forward where ``op`` has a row for it
    (every attention op has torch, Triton, cpp-cpu and CUDA rows), else the automatic choice."""
    return _choose(op, q, backend if backend is None or backend in op.impls else "auto", masks)


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
    _check_primals(q, k, v)
    causal, left, right, q_lens, kv_lens = _check_mask(q, k, causal, window, q_lens, kv_lens)
    scale, backend = _check_options(scale, backend, q.shape[-1])
    check_bool("grad_through_tangent", grad_through_tangent)
    has_p, P = _check_tangents((("q", q), ("k", k), ("v", v)), (("tq", tq), ("tk", tk), ("tv", tv)))
    masks = _mask_kinds(causal, left, right, q_lens, kv_lens)
    mask = (causal, scale, left, right, q_lens, kv_lens)
    impl = _choose(ATTENTION_JVP, q, backend, masks)
    if tq is None and tk is None and tv is None:
        tv = torch.zeros_like(v)  # all-zero tangent: keep one code path (out is still needed)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tangents = []
    for t in (tq, tk, tv):
        if t is not None and not has_p:
            t = t.unsqueeze(0)
        if t is not None and not grad_through_tangent:
            t = t.detach()  # no gradient path through tangent_out
        tangents.append(_c(t))
    differentiable = (q, k, v, *tangents) if grad_through_tangent else (q, k, v)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in differentiable)
    if needs_grad:
        fn, bwd_op = ((_AttentionJVP, ATTENTION_JVP_BWD) if grad_through_tangent
                      else (_AttentionJVPOutGrad, ATTENTION_BWD))
        bwd_impl = _backward_backend(bwd_op, q, backend, masks)
        out, tout, _ = fn.apply(q, k, v, *tangents, *mask, impl, bwd_impl)
    else:
        out, tout, _ = _attention_jvp_op(q, k, v, *tangents, *mask, impl)
    return out, (tout if has_p else tout.squeeze(0))
