"""What the attention tests share: the float64 naive reference, inputs, shapes, and the backends
runnable on this machine.

The reference is written here, not taken from condinit, so that a check never compares the code
under test with itself: ``softmax(scale Q K^T + mask) V`` with the N x N matrix materialized, in
whatever dtype it is given (the tests give it float64 copies of the rounded inputs, so the error
measured is the kernel's, not the input rounding). Its tangents and gradients come from
``torch.func``.
"""
import pytest
import torch

from condinit import _backends
from condinit.ops.attention.op import ATTENTION_FWD

F64 = torch.float64


def visible(n_q: int, n_k: int, causal: bool, device="cpu") -> torch.Tensor:
    """[Nq, Nk] bool: query ``i`` attends key ``j`` (causal: ``j <= i + Nk - Nq``, bottom-right)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return (j <= i + (n_k - n_q)) if causal else torch.ones(n_q, n_k, dtype=torch.bool, device=device)


def _scores(q, k, causal, scale):
    group = q.shape[1] // k.shape[1]
    s = scale * q @ k.repeat_interleave(group, 1).transpose(-1, -2)
    return s.masked_fill(~visible(q.shape[2], k.shape[2], causal, q.device), float("-inf"))


def naive_attention(q, k, v, causal, scale):
    """softmax(scale q k^T + mask) v; a row that sees no key gives 0 (finite in every AD mode)."""
    s = _scores(q, k, causal, scale)
    seen = visible(q.shape[2], k.shape[2], causal, q.device).any(-1, keepdim=True)
    p = torch.softmax(torch.where(seen, s, 0.0), -1) * seen
    return p @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)


def naive_lse(q, k, causal, scale):
    """log sum_j exp(s_ij) over the visible keys: -inf for a row that sees none."""
    return torch.logsumexp(_scores(q, k, causal, scale), -1)


def naive_jvp(q, k, v, tq, tk, tv, causal, scale):
    """(out, tangent [P, ...]) of the naive attention; tangents carry a leading probe dim."""
    f = lambda a, b, c: naive_attention(a, b, c, causal, scale)  # noqa: E731
    touts = [torch.func.jvp(f, (q, k, v), (tq[p], tk[p], tv[p]))[1] for p in range(tq.shape[0])]
    return f(q, k, v), torch.stack(touts)


def naive_vjp(q, k, v, dout, causal, scale):
    """(dq, dk, dv) of the naive attention for the cotangent ``dout``."""
    return torch.func.vjp(lambda a, b, c: naive_attention(a, b, c, causal, scale), q, k, v)[1](dout)


def randn(shape, dtype, rng, device="cpu"):
    """Standard normal drawn in float64 and rounded to ``dtype`` (the same draw for every dtype)."""
    return torch.randn(shape, generator=rng, dtype=F64).to(dtype).to(device)


def make_qkv(B, H, Hkv, Nq, Nk, d, dtype, rng, device="cpu"):
    return (randn((B, H, Nq, d), dtype, rng, device), randn((B, Hkv, Nk, d), dtype, rng, device),
            randn((B, Hkv, Nk, d), dtype, rng, device))


def make_tangents(q, k, v, P, rng):
    """Tangents like q, k, v with a leading probe dim of P."""
    return tuple(randn((P,) + tuple(x.shape), x.dtype, rng, x.device) for x in (q, k, v))


def f64(*xs):
    return tuple(x.detach().to(F64) for x in xs)


def joint_floor(refs):
    """Error floor for a group of gradients (dq, dk, dv): one that is exactly 0 in exact arithmetic
    (a row seeing a single key has dq = 0, the softmax being constant) comes out as rounding noise
    of the size of its siblings' terms, so it is measured against 0.1 x the group's largest."""
    return 0.1 * max(r.abs().max().item() for r in refs)


def empty_rows(n_q, n_k, causal):
    """Rows 0..(this - 1) see no key (causal with Nq > Nk)."""
    return n_q - n_k if causal and n_q > n_k else 0


# ------------------------------------------------------------------------------------------------
# shapes: (B, H, Hkv, Nq, Nk, d, causal)
# ------------------------------------------------------------------------------------------------

# For the torch reference and the C++ CPU kernels: N in {1, 17, 123}, Nq != Nk both ways with
# causal (bottom-right aligned: Nq > Nk leaves rows that see no key), GQA ratios 1/2/4, and every
# head dim the kernels take (KERNEL_HEAD_DIMS of condinit/ops/attention/op.py).
CASES = [
    (1, 1, 1, 1, 1, 16, False),        # N = 1
    (2, 2, 1, 1, 17, 64, True),        # one query sees every key; GQA 2
    (1, 2, 2, 17, 17, 80, True),       # ragged N, head dim not a power of two
    (2, 4, 2, 17, 123, 32, False),     # Nq < Nk
    (1, 4, 1, 123, 17, 96, True),      # GQA 4; rows 0..105 see no key
    (1, 4, 4, 123, 123, 128, True),
    (1, 2, 1, 123, 1, 16, False),      # one key: dq is exactly 0
    (1, 4, 2, 17, 123, 256, True),     # causal Nq < Nk
]
# A head dim the Triton and CUDA kernels do not take (the torch reference and the C++ CPU kernel do).
ODD_HEAD_DIM_CASES = [(1, 4, 2, 17, 23, 24, True)]
# The Triton interpreter runs one program at a time with 16 x 16 tiles: a few tiny cases cover a
# single element, ragged and several tiles, the causal diagonal both ways, rows that see no key,
# GQA 2 and 4 and a padded head dim.
TRITON_CASES = [
    (1, 1, 1, 1, 1, 16, False),
    (1, 2, 1, 17, 9, 16, True),        # GQA 2, rows 0..7 see no key
    (1, 4, 1, 9, 33, 80, True),        # GQA 4, Nq < Nk, head dim padded to 128
]


def case_id(case):
    B, H, Hkv, Nq, Nk, d, causal = case
    return f"B{B}H{H}kv{Hkv}-{Nq}x{Nk}-d{d}" + ("-causal" if causal else "")


# ------------------------------------------------------------------------------------------------
# backends
# ------------------------------------------------------------------------------------------------

ATTENTION_OPS = ("attention_fwd", "attention_bwd", "attention_jvp")
# (backend, device) pairs that can exist here: the CUDA kernels only where a GPU is visible.
BACKENDS = [("torch", "cpu"), ("cpp-cpu", "cpu"), ("triton", "cpu")]
if torch.cuda.is_available():
    BACKENDS.append(("cuda", "cuda"))
DEVICE = dict(BACKENDS)


def unavailable(backend: str):
    """Why ``backend`` cannot run the attention ops here, or None."""
    device = DEVICE[backend]
    for op in ATTENTION_OPS:
        ok, why = _backends.available(backend, device, op if backend in ("cpp-cpu", "cuda") else None)
        if not ok:
            return f"{backend} cannot run {op} on {device}: {why}"
    if backend == "triton":
        try:
            import condinit.kernels.attention  # noqa: F401
        except Exception as exc:  # a broken kernel module must show as the skip reason
            return f"condinit.kernels.attention does not import: {type(exc).__name__}: {exc}"
    return None


def require(backend: str) -> str:
    """Skip (with the reason) when ``backend`` is unavailable; returns its device."""
    why = unavailable(backend)
    if why:
        pytest.skip(why)
    return DEVICE[backend]


def backend_param(backend: str, *values, id=None):
    """A pytest param whose first value is ``backend``; Triton ones carry the ``triton`` mark."""
    marks = [pytest.mark.triton] if backend == "triton" else []
    return pytest.param(backend, *values, marks=marks, id=id or backend)


def accepts(backend: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``backend``'s row of the attention table declares this dtype and head dim."""
    call = {"dtype": dtype, "head_dim": head_dim}
    return ATTENTION_FWD.impls[backend].not_supported(DEVICE[backend], call) is None


def backend_params(*names):
    return [backend_param(b) for b in (names or tuple(DEVICE))]


def cases_per_backend(dtype=torch.float32, kernel_cases=CASES, triton_cases=TRITON_CASES,
                      extra_cases=ODD_HEAD_DIM_CASES):
    """(backend, case) params: on every backend the cases of the grid its table row accepts
    (Triton, slow in the interpreter: its own tiny ones)."""
    params = []
    for b in DEVICE:
        cases = triton_cases if b == "triton" else list(kernel_cases) + list(extra_cases)
        params += [backend_param(b, c, id=f"{b}-{case_id(c)}") for c in cases if accepts(b, dtype, c[5])]
    return params


# ------------------------------------------------------------------------------------------------
# masks: the naive reference of the mask contract (causal, window, per-sequence lengths)
# ------------------------------------------------------------------------------------------------

def allowed_pairs(B, n_q, n_k, causal=False, window=None, q_lens=None, kv_lens=None, device="cpu"):
    """[B, 1, Nq, Nk] bool: query ``i`` of batch ``b`` attends key ``j``. With ``Lq``, ``Lk`` the
    lengths and ``off = Lk - Lq``: ``i < Lq``, ``j < Lk``, causal ``j <= i + off``, window
    ``(left, right)`` ``i + off - left <= j <= i + off + right`` (-1: unbounded)."""
    lq = torch.as_tensor(q_lens if q_lens is not None else [n_q] * B, device=device).view(B, 1, 1)
    lk = torch.as_tensor(kv_lens if kv_lens is not None else [n_k] * B, device=device).view(B, 1, 1)
    i = torch.arange(n_q, device=device)[None, :, None]
    j = torch.arange(n_k, device=device)[None, None, :]
    diag = i + (lk - lq)
    ok = (i < lq) & (j < lk)
    if causal:
        ok &= j <= diag
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= diag - left
        if right >= 0:
            ok &= j <= diag + right
    return ok[:, None]


def naive_masked(q, k, v, allowed, scale):
    """softmax(scale q k^T, masked) v with an explicit [B, 1 or H, Nq, Nk] mask; a row with no
    allowed key gives 0 (finite in every AD mode). Masked entries are replaced, not multiplied,
    so NaN / Inf there never reach the result."""
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ kr.transpose(-1, -2)
    seen = allowed.any(-1, keepdim=True)
    s = torch.where(allowed, s, float("-inf"))
    p = torch.softmax(torch.where(seen, s, 0.0), -1)
    p = torch.where(allowed & seen, p, 0.0)
    vr = torch.where(allowed.any(-2)[..., None], vr, 0.0)  # keys nobody attends: never read
    return p @ vr
