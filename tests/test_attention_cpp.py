"""The native attention kernels torch.ops.condinit_C.attention_{fwd,jvp,bwd} against a float64 reference.

The reference materializes P (softmax of the masked scores) in float64; its tangent and gradients
come from torch.func.jvp / torch.func.vjp. Inputs are rounded to the tested dtype first, so the
error measured is the kernel's, not the input rounding. Errors are relative norms
||x - ref|| / ||ref|| per tensor (for dq, dk plus 1% of the magnitude of the summed terms,
since they cancel to exactly 0 when a row sees a single key). CPU always; CUDA too when a GPU and the CUDA kernels are there.
"""
import math
import os

import pytest
import torch

try:
    from conftest import TOLERANCES
except ImportError:  # run from elsewhere
    TOLERANCES = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5),
                  torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _ops():
    # A developer can point CONDINIT_TEST_NATIVE_LIB at a separately built library holding the ops.
    lib = os.environ.get("CONDINIT_TEST_NATIVE_LIB")
    if lib:
        torch.ops.load_library(lib)
    else:
        from condinit import _ext
        ok, why = _ext.status()
        if not ok:
            return None, f"condinit._C unavailable: {why}"
    try:
        if not torch._C._dispatch_has_kernel_for_dispatch_key("condinit_C::attention_jvp", "CPU"):
            return None, "condinit._C has no attention_jvp CPU kernel"
    except RuntimeError:
        return None, "condinit._C was built without the attention ops"
    return torch.ops.condinit_C, ""


OPS, WHY = _ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=WHY)

DEVICES = ["cpu"]
if torch.cuda.is_available() and OPS is not None and \
        torch._C._dispatch_has_kernel_for_dispatch_key("condinit_C::attention_jvp", "CUDA"):
    DEVICES.append("cuda")


def reference(q, k, v, causal, scale):
    """float64 attention with materialized P; rows that see no key give out 0, lse -inf."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    Nq, Nk = q.shape[2], k.shape[2]
    S = scale * q @ k.transpose(-1, -2)
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        hidden = j > i + (Nk - Nq)
    else:
        hidden = torch.zeros(Nq, Nk, dtype=torch.bool, device=q.device)
    S = S.masked_fill(hidden, float("-inf"))
    any_visible = (~hidden).any(-1, keepdim=True)
    P = torch.softmax(torch.where(any_visible, S, torch.zeros_like(S)), dim=-1) * any_visible
    return P @ v, torch.logsumexp(S, dim=-1), P


def grad_scales(q, k, v, dout, P, scale):
    """Magnitudes of the terms summed into dq and dk: s (P o (|dO| |V|^T)) |K| and the transpose with |Q|.

    dq = s (P o (dP - D)) K cancels exactly when a row sees one key (dq = 0): fp32 rounding of dP - D
    then sets the error scale, not ||dq||."""
    G = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    W = P * (dout.abs() @ vr.abs().transpose(-1, -2))
    sq = scale * W @ kr.abs()
    sk = scale * (W.transpose(-1, -2) @ q.abs())
    sk = sk.reshape(k.shape[0], k.shape[1], G, *sk.shape[2:]).sum(2)
    return sq, sk


def rel_err(x, ref, magnitude=None):
    """||x - ref|| / ||ref||; with the magnitude of the summed terms, / (||ref|| + 0.01 ||magnitude||)."""
    x, ref = x.double().cpu(), ref.double().cpu()
    denom = ref.norm() + (0.01 * magnitude.norm() if magnitude is not None else 0.0)
    return ((x - ref).norm() / denom.clamp_min(1e-300)).item()


def make(shape, gen, dtype, device):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


CASES = [
    # B, H, Hkv, Nq, Nk, d, causal, P
    (1, 1, 1, 1, 1, 16, False, 1),
    (1, 2, 2, 1, 17, 16, True, 1),
    (2, 4, 2, 17, 17, 64, True, 3),
    (1, 8, 1, 128, 333, 80, True, 1),
    (1, 2, 1, 333, 128, 128, False, 3),
    (1, 2, 2, 128, 17, 64, True, 3),   # Nq > Nk, causal: the first 111 rows see no key
    (1, 8, 8, 17, 128, 16, True, 1),
    (1, 8, 4, 123, 123, 64, False, 1),
]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype):
    return TOLERANCES[dtype][1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hkv{}Nq{}Nk{}d{}{}P{}".format(*c[:6], "c" if c[6] else "", c[7]))
def test_against_float64_reference(case, dtype, device, rng):
    B, H, Hkv, Nq, Nk, d, causal, P = case
    if device == "cuda" and (dtype == torch.float64 or d not in (16, 32, 64, 80, 96, 128, 256)):
        pytest.skip("the CUDA kernels take fp32/fp16/bf16 and d in {16, 32, 64, 80, 96, 128, 256}")
    scale = 0.7 / math.sqrt(d)
    q = make((B, H, Nq, d), rng, dtype, device)
    k = make((B, Hkv, Nk, d), rng, dtype, device)
    v = make((B, Hkv, Nk, d), rng, dtype, device)
    tq = make((P, B, H, Nq, d), rng, dtype, device)
    tk = make((P, B, Hkv, Nk, d), rng, dtype, device)
    tv = make((P, B, Hkv, Nk, d), rng, dtype, device)
    dout = make((B, H, Nq, d), rng, dtype, device)

    f64 = [x.double().cpu() for x in (q, k, v, tq, tk, tv, dout)]
    q64, k64, v64, tq64, tk64, tv64, do64 = f64
    fn = lambda a, b, c: reference(a, b, c, causal, scale)[0]  # noqa: E731
    out_ref, lse_ref, P_ref = reference(q64, k64, v64, causal, scale)
    dq_mag, dk_mag = grad_scales(q64, k64, v64, do64, P_ref, scale)
    tout_ref = torch.stack([torch.func.jvp(fn, (q64, k64, v64), (tq64[p], tk64[p], tv64[p]))[1] for p in range(P)])
    _, vjp = torch.func.vjp(fn, q64, k64, v64)
    dq_ref, dk_ref, dv_ref = vjp(do64)

    out, lse = OPS.attention_fwd(q, k, v, causal, scale)
    out2, tout, lse2 = OPS.attention_jvp(q, k, v, tq, tk, tv, causal, scale)
    dq, dk, dv = OPS.attention_bwd(dout, q, k, v, out, lse, causal, scale)

    assert out.dtype == dtype and tout.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Nq) and tout.shape == (P, B, H, Nq, d)
    assert dk.shape == k.shape and dv.shape == v.shape
    for x in (out, out2, tout, dq, dk, dv):
        assert not torch.isnan(x).any()
    tol = _tol(dtype)
    errs = {"out": rel_err(out, out_ref), "out(jvp)": rel_err(out2, out_ref), "tout": rel_err(tout, tout_ref),
            "dq": rel_err(dq, dq_ref, dq_mag), "dk": rel_err(dk, dk_ref, dk_mag), "dv": rel_err(dv, dv_ref)}
    bad = {name: e for name, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"

    # lse: -inf exactly where nothing is visible, float32 accuracy elsewhere.
    for L in (lse, lse2):
        L = L.cpu().double()
        assert torch.equal(torch.isneginf(L), torch.isneginf(lse_ref))
        fin = torch.isfinite(lse_ref)
        assert not torch.isnan(L).any()
        if fin.any():
            assert (L[fin] - lse_ref[fin]).abs().max().item() <= max(tol, 2e-6) * (1 + lse_ref[fin].abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_see_nothing_are_zero(device, rng):
    # Nq > Nk with a bottom-right causal mask: query i sees keys j <= i - (Nq - Nk), none for i < Nq - Nk.
    B, H, Nq, Nk, d = 1, 2, 40, 7, 16
    q, k, v = (make(s, rng, torch.float32, device) for s in ((B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, d)))
    tq, tk, tv = (make((2,) + tuple(x.shape), rng, torch.float32, device) for x in (q, k, v))
    out, tout, lse = OPS.attention_jvp(q, k, v, tq, tk, tv, True, 0.25)
    dq, dk, dv = OPS.attention_bwd(make(q.shape, rng, torch.float32, device), q, k, v, out, lse, True, 0.25)
    blind = Nq - Nk
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()
    assert (out[:, :, :blind] == 0).all() and (tout[:, :, :, :blind] == 0).all() and (dq[:, :, :blind] == 0).all()
    assert (out[:, :, blind:] != 0).any()
    for x in (out, tout, dq, dk, dv):
        assert torch.isfinite(x).all()


@pytest.mark.parametrize("device", DEVICES)
def test_probes_share_one_launch(device, rng):
    # P probes in one call give the same tangents as P separate calls.
    q, k, v = (make((1, 4, 70, 32), rng, torch.float32, device) for _ in range(3))
    tq, tk, tv = (make((3, 1, 4, 70, 32), rng, torch.float32, device) for _ in range(3))
    _, tout, _ = OPS.attention_jvp(q, k, v, tq, tk, tv, True, 0.2)
    for p in range(3):
        _, t1, _ = OPS.attention_jvp(q, k, v, tq[p:p + 1], tk[p:p + 1], tv[p:p + 1], True, 0.2)
        torch.testing.assert_close(tout[p], t1[0], rtol=1e-6, atol=1e-6)


def test_meta_shapes():
    q = torch.empty(2, 4, 9, 16, device="meta")
    k = torch.empty(2, 2, 5, 16, device="meta")
    t = torch.empty(3, 2, 4, 9, 16, device="meta")
    tk = torch.empty(3, 2, 2, 5, 16, device="meta")
    out, tout, lse = OPS.attention_jvp(q, k, k, t, tk, tk, False, 1.0)
    assert out.shape == q.shape and tout.shape == t.shape and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    dq, dk, dv = OPS.attention_bwd(q, q, k, k, q, torch.empty(2, 4, 9, device="meta"), False, 1.0)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_clear_errors(device):
    f = dict(device=device)
    q = torch.randn(1, 4, 8, 16, **f)
    k = torch.randn(1, 2, 8, 16, **f)
    t5 = torch.randn(1, 1, 4, 8, 16, **f)
    tk5 = torch.randn(1, 1, 2, 8, 16, **f)
    fwd, jvp, bwd = OPS.attention_fwd, OPS.attention_jvp, OPS.attention_bwd
    with pytest.raises(RuntimeError, match="float32, float16, bfloat16"):
        fwd(q.int(), k.int(), k.int(), False, 1.0)
    with pytest.raises(RuntimeError, match="same dtype"):
        fwd(q, k.double(), k, False, 1.0)
    with pytest.raises(RuntimeError, match="same shape"):
        fwd(q, k, k[:, :, :4], False, 1.0)
    with pytest.raises(RuntimeError, match="must divide"):
        fwd(q, torch.randn(1, 3, 8, 16, **f), torch.randn(1, 3, 8, 16, **f), False, 1.0)
    with pytest.raises(RuntimeError, match="head dim"):
        fwd(q, k[..., :8].contiguous(), k[..., :8].contiguous(), False, 1.0)
    with pytest.raises(RuntimeError, match="4-D"):
        fwd(q[0], k, k, False, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        fwd(q.transpose(2, 3).contiguous().transpose(2, 3), k, k, False, 1.0)
    with pytest.raises(RuntimeError, match="tq must have shape"):
        jvp(q, k, k, t5[:, :, :2], tk5, tk5, False, 1.0)
    with pytest.raises(RuntimeError, match="tk must have shape"):
        jvp(q, k, k, t5, t5, tk5, False, 1.0)
    with pytest.raises(RuntimeError, match="5-D"):
        jvp(q, k, k, q, k, k, False, 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        jvp(q, k, k, t5.double(), tk5, tk5, False, 1.0)
    lse = torch.zeros(1, 4, 8, **f)
    with pytest.raises(RuntimeError, match="lse must be float32"):
        bwd(q, q, k, k, q, lse.double(), False, 1.0)
    with pytest.raises(RuntimeError, match="lse must have shape"):
        bwd(q, q, k, k, q, lse[:, :2], False, 1.0)
    with pytest.raises(RuntimeError, match="dout and out must have the shape"):
        bwd(q[:, :, :4], q, k, k, q, lse, False, 1.0)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="head dim"):
            fwd(torch.randn(1, 1, 8, 24, **f), torch.randn(1, 1, 8, 24, **f), torch.randn(1, 1, 8, 24, **f), False, 1.0)
        with pytest.raises(RuntimeError, match="same device"):
            fwd(q, k.cpu(), k, False, 1.0)
