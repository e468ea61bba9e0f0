"""The backend tables of the attention ops (``attention_fwd``, ``attention_bwd``, ``attention_jvp``,
``attention_jvp_bwd``): which implementation each row runs, what it supports, and the one choice.

The choice and ``condinit info`` read these rows; the kernels do not repeat them.
"""
import torch
from torch import Tensor
from typing import Optional

from condinit import _backends
from condinit.ops.attention import reference

__all__ = ["KERNEL_HEAD_DIMS", "KERNEL_DTYPES", "CPU_DTYPES", "MASK_KINDS", "ATTENTION_FWD", "ATTENTION_BWD", "ATTENTION_JVP",
           "ATTENTION_JVP_BWD", "choose", "mask_kinds"]

# Head dims the Triton and CUDA launch configurations are tuned for (and the test grids walk).
# The kernels run any head dim up to 256 by padding to the next tuned tile width.
KERNEL_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The C++ CPU kernels also take float64 (computed and accumulated in float64, lse in float64).
CPU_DTYPES = KERNEL_DTYPES + (torch.float64,)
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


# native: one condinit_C schema with a CPU kernel (cpp-cpu, any head dim, float64 too) and a CUDA
# kernel. The lse is float32, float64 for float64 inputs (as the reference's).
def _fwd_native(q, k, v, *mask):
    return tuple(torch.ops.condinit_C.attention_fwd(q, k, v, *mask))


def _bwd_native(dout, q, k, v, out, lse, *mask):
    return tuple(torch.ops.condinit_C.attention_bwd(dout, q, k, v, out, lse, *mask))


def _jvp_native(q, k, v, tq, tk, tv, *mask):
    tq, tk, tv = _zeros_tangents(q, k, v, tq, tk, tv)
    return tuple(torch.ops.condinit_C.attention_jvp(q, k, v, tq, tk, tv, *mask))


for _op, _fn in ((ATTENTION_FWD, _fwd_native), (ATTENTION_BWD, _bwd_native), (ATTENTION_JVP, _jvp_native)):
    _op.register("cpp-cpu", devices=("cpu",), limits={"dtype": CPU_DTYPES, **_ALL_MASKS},
                 native_op=_op.name)(_fn)
    # CUDA: bf16/fp16 on tensor cores need sm_80+ (the kernel refuses older GPUs by name); the
    # backward runs separate dQ and dK/dV kernels, no atomics, so its bits are deterministic.
    _op.register("cuda", devices=("cuda",), limits=_GPU_LIMITS, native_op=_op.name)(_fn)


# The tangent backward's C++ CPU kernel takes float64 too (a float32 lse given with float64 inputs
# is recomputed in float64).
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
                            limits={"dtype": CPU_DTYPES, **_ALL_MASKS},
                            native_op="attention_jvp_bwd")
def _jvp_bwd_native(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, *mask):
    tq, tk, tv = _given_tangents(gtout, q, k, v, tq, tk, tv)
    return tuple(torch.ops.condinit_C.attention_jvp_bwd(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse,
                                                        *mask))


def mask_kinds(causal: bool, window_left: int, window_right: int, q_lens: Optional[Tensor],
                kv_lens: Optional[Tensor]) -> tuple[str, ...]:
    """The mask kinds a call needs (the "masks" limit of the backend tables)."""
    return tuple(kind for kind, used in (("causal", causal),
                                         ("window", window_left >= 0 or window_right >= 0),
                                         ("lens", q_lens is not None or kv_lens is not None)) if used)


def choose(op: _backends.Op, q: Tensor, backend: Optional[str], masks: tuple[str, ...] = ()) -> str:
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


