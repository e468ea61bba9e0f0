"""condinit.sdpa against PyTorch's SDPA (MATH backend) in float64, which path each call takes,
every attn_mask shape SDPA accepts (a property test), its argument errors, and condinit.patch_sdpa
(with a timm ViT, nn.MultiheadAttention and nn.TransformerEncoderLayer)."""
import math
import os
import threading
from typing import NamedTuple, Optional

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import condinit
from condinit.ops.attention import sdpa as sdpa_module

from conftest import F64, assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

FP32 = torch.float32
SDPA = F.scaled_dot_product_attention   # PyTorch's, captured before any patch


def math_sdpa(*args, **kwargs):
    """PyTorch's SDPA on its MATH backend: the reference (it materializes P, so it has forward AD)."""
    with sdpa_kernel(SDPBackend.MATH):
        return SDPA(*args, **kwargs)


def randn(shape, rng, dtype=F64):
    return torch.randn(shape, generator=rng, dtype=F64).to(dtype)


def key_padding_mask(rng, batch, nk):
    keep = torch.rand((batch, 1, 1, nk), generator=rng) > 0.3
    keep[..., 0] = True
    return keep


def causal_bool(nq, nk, top_left=False):
    rows, cols = torch.arange(nq).unsqueeze(-1), torch.arange(nk)
    return cols <= rows + (0 if top_left else nk - nq)


def real_keys(nk, starts, ends):
    """[B, 1, 1, Nk] bool: batch b's real keys are [starts[b], ends[b]) (left / right padding)."""
    j = torch.arange(nk)
    return ((j >= torch.tensor(starts)[:, None]) & (j < torch.tensor(ends)[:, None]))[:, None, None, :]


def sliding(n, window):
    """[N, N] bool: Hugging Face's sliding-window causal mask (key j visible iff i - window < j <= i)."""
    rows, cols = torch.arange(n).unsqueeze(-1), torch.arange(n)
    return (cols <= rows) & (cols > rows - window)


@pytest.fixture
def paths(monkeypatch):
    """Counts the calls of the fused op and of the dense path inside condinit.sdpa."""
    count = {"fused": 0, "dense": 0}
    fused, dense = sdpa_module.attention, sdpa_module._attention_dense

    def counted_fused(*a, **kw):
        count["fused"] += 1
        return fused(*a, **kw)

    def counted_dense(*a, **kw):
        count["dense"] += 1
        return dense(*a, **kw)
    monkeypatch.setattr(sdpa_module, "attention", counted_fused)
    monkeypatch.setattr(sdpa_module, "_attention_dense", counted_dense)
    return count


# (name, q shape, k shape, v shape, kwargs builder (rng -> dict), expected path)
CASES = [
    ("plain", (2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), lambda r: {}, "fused"),
    ("causal square", (2, 3, 7, 8), (2, 3, 7, 8), (2, 3, 7, 8), lambda r: {"is_causal": True}, "fused"),
    ("causal Nq<Nk", (1, 2, 5, 8), (1, 2, 9, 8), (1, 2, 9, 8), lambda r: {"is_causal": True}, "fused"),
    ("causal Nq>Nk", (1, 2, 9, 8), (1, 2, 4, 8), (1, 2, 4, 8), lambda r: {"is_causal": True}, "fused"),
    ("gqa causal scale", (2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8),
     lambda r: {"is_causal": True, "enable_gqa": True, "scale": 0.3}, "fused"),
    ("mqa by broadcast", (2, 4, 6, 8), (2, 1, 5, 8), (2, 1, 5, 8), lambda r: {}, "fused"),
    ("query heads broadcast", (2, 1, 6, 8), (2, 3, 5, 8), (2, 3, 5, 8), lambda r: {}, "fused"),
    ("5-D batch broadcast", (3, 2, 2, 5, 8), (1, 2, 2, 6, 8), (3, 1, 2, 6, 8), lambda r: {}, "fused"),
    ("2-D", (6, 8), (6, 8), (6, 8), lambda r: {"is_causal": True}, "fused"),
    ("mixed ranks", (4, 5, 8), (2, 4, 7, 8), (4, 7, 8), lambda r: {}, "fused"),
    ("gqa, key and value head counts differ", (2, 4, 5, 8), (2, 2, 7, 8), (2, 1, 7, 8),
     lambda r: {"enable_gqa": True}, "fused"),
    ("bottom-right causal bool mask", (2, 2, 4, 8), (2, 2, 7, 8), (2, 2, 7, 8),
     lambda r: {"attn_mask": causal_bool(4, 7)}, "fused"),
    ("top-left causal bool mask", (2, 2, 4, 8), (2, 2, 7, 8), (2, 2, 7, 8),
     lambda r: {"attn_mask": causal_bool(4, 7, top_left=True)}, "fused"),
    ("causal float mask 0/-inf", (2, 2, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8),
     lambda r: {"attn_mask": torch.zeros(6, 6, dtype=F64).masked_fill(~causal_bool(6, 6), float("-inf"))},
     "fused"),
    ("all-visible mask", (2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8),
     lambda r: {"attn_mask": torch.ones(2, 1, 1, 6, dtype=torch.bool)}, "fused"),
    ("key padding mask (random keys)", (2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8),
     lambda r: {"attn_mask": key_padding_mask(r, 2, 6), "enable_gqa": True}, "dense"),
    # Masks the kernels run (causal, sliding window, real keys an interval per batch entry)
    ("right padding", (3, 4, 5, 8), (3, 2, 9, 8), (3, 2, 9, 8),
     lambda r: {"attn_mask": real_keys(9, [0, 0, 0], [9, 4, 1]), "enable_gqa": True}, "fused"),
    ("left and right padding", (3, 2, 5, 8), (3, 2, 9, 8), (3, 2, 9, 8),
     lambda r: {"attn_mask": real_keys(9, [2, 0, 5], [9, 6, 7])}, "fused"),
    ("causal + left padding (HF decoder)", (3, 2, 9, 8), (3, 2, 9, 8), (3, 2, 9, 8),
     lambda r: {"attn_mask": causal_bool(9, 9) & real_keys(9, [0, 3, 8], [9, 9, 9])}, "fused"),
    ("causal + right padding", (2, 2, 9, 8), (2, 2, 9, 8), (2, 2, 9, 8),
     lambda r: {"attn_mask": causal_bool(9, 9) & real_keys(9, [0, 2], [6, 9])}, "fused"),
    ("sliding window", (2, 4, 11, 8), (2, 2, 11, 8), (2, 2, 11, 8),
     lambda r: {"attn_mask": sliding(11, 4), "enable_gqa": True}, "fused"),
    ("sliding window + left padding, float mask", (2, 2, 11, 8), (2, 2, 11, 8), (2, 2, 11, 8),
     lambda r: {"attn_mask": torch.zeros(2, 1, 11, 11, dtype=F64).masked_fill(
         ~(sliding(11, 3) & real_keys(11, [0, 4], [11, 11])), float("-inf"))}, "fused"),
    ("sliding window + right padding (rows after the keys)", (2, 2, 11, 8), (2, 2, 11, 8), (2, 2, 11, 8),
     lambda r: {"attn_mask": sliding(11, 3) & real_keys(11, [0, 0], [11, 7])}, "dense"),
    ("heads with different masks", (1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8),
     lambda r: {"attn_mask": torch.stack([causal_bool(6, 6), sliding(6, 2)])}, "dense"),
    ("rows with no key", (1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8),
     lambda r: {"attn_mask": torch.rand((5, 6), generator=r) > torch.tensor([0.3, 0.3, 2, 0.3, 2]).unsqueeze(-1)},
     "dense"),
    ("additive float mask", (2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8),
     lambda r: {"attn_mask": randn((5, 6), r)}, "dense"),
    ("large-negative causal mask", (1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8),
     lambda r: {"attn_mask": torch.zeros(6, 6, dtype=F64).masked_fill(~causal_bool(6, 6), -1e30)},
     "dense"),
    ("value head dim differs", (2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 6, 3), lambda r: {"is_causal": True}, "dense"),
]


def _inputs(case, rng, dtype=F64):
    _, qs, ks, vs, kwargs, _ = case
    return [randn(s, rng, dtype) for s in (qs, ks, vs)], kwargs(rng)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_math_sdpa_output_tangent_and_gradients(case, rng, paths):
    """Output, forward-mode tangent (torch.func.jvp) and gradients (torch.func.vjp) equal those of
    SDPA's MATH backend in float64; and the call takes the expected path."""
    (q, k, v), kwargs = _inputs(case, rng)
    mine = lambda q, k, v: condinit.sdpa(q, k, v, **kwargs)      # noqa: E731
    ref = lambda q, k, v: math_sdpa(q, k, v, **kwargs)           # noqa: E731
    tangents = tuple(randn(x.shape, rng) for x in (q, k, v))
    out, tout = torch.func.jvp(mine, (q, k, v), tangents)
    out_ref, tout_ref = torch.func.jvp(ref, (q, k, v), tangents)
    assert out.shape == out_ref.shape
    assert_close(out, out_ref, F64, "out")
    assert_close(tout, tout_ref, F64, "tangent")
    dout = randn(out.shape, rng)
    grads = torch.func.vjp(mine, q, k, v)[1](dout)
    grads_ref = torch.func.vjp(ref, q, k, v)[1](dout)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert_close(g, g_ref, F64, f"d{name}")
    expected = case[-1]
    assert paths[expected] > 0 and paths["dense" if expected == "fused" else "fused"] == 0, paths


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}], ids=["full", "causal"])
def test_float32_matches_float64_reference(kwargs, rng):
    q, k, v = (randn((2, 4, 33, 16), rng, FP32) for _ in range(3))
    out = condinit.sdpa(q, k, v, **kwargs)
    assert out.dtype == FP32
    assert_close(out, math_sdpa(q.double(), k.double(), v.double(), **kwargs), FP32, "out", factor=5)


def test_transforms_vmap_jacfwd_and_forward_ad(rng, paths):
    q, k, v = (randn((3, 2, 2, 5, 8), rng) for _ in range(3))
    mask = causal_bool(5, 5)
    mine = lambda q, k, v: condinit.sdpa(q, k, v, attn_mask=mask)    # noqa: E731
    ref = lambda q, k, v: math_sdpa(q, k, v, attn_mask=mask)         # noqa: E731
    assert_close(torch.func.vmap(mine)(q, k, v), torch.func.vmap(ref)(q, k, v), F64, "vmap")
    jac = torch.func.jacfwd(mine, argnums=1)(q[0, :1], k[0, :1], v[0, :1])
    jac_ref = torch.func.jacfwd(ref, argnums=1)(q[0, :1], k[0, :1], v[0, :1])
    assert_close(jac, jac_ref, F64, "jacfwd")
    tq = randn(q.shape, rng)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(condinit.sdpa(fwAD.make_dual(q, tq), k, v, is_causal=True)).tangent
    assert_close(tangent, torch.func.jvp(lambda q: math_sdpa(q, k, v, is_causal=True), (q,), (tq,))[1],
                 F64, "forward_ad")
    assert paths["dense"] == 0


def test_masks_whose_values_cannot_be_read_take_the_dense_path(rng, paths):
    """A mask batched by vmap (values differ per slice) and a float mask that requires grad or
    carries a tangent (the fused op would drop its derivative) run the dense path, with SDPA's
    results."""
    q, k, v = (randn((2, 2, 5, 8), rng) for _ in range(3))
    masks = torch.stack([causal_bool(5, 5), key_padding_mask(rng, 1, 5)[0, 0].expand(5, 5)])
    out = torch.func.vmap(lambda m: condinit.sdpa(q, k, v, attn_mask=m))(masks)
    assert_close(out, torch.func.vmap(lambda m: math_sdpa(q, k, v, attn_mask=m))(masks), F64, "vmap mask")
    assert paths == {"fused": 0, "dense": 1}
    bias = torch.zeros(5, 5, dtype=F64).masked_fill(~causal_bool(5, 5), float("-inf")).requires_grad_()
    g = torch.autograd.grad(condinit.sdpa(q, k, v, attn_mask=bias).sum(), bias)[0]
    g_ref = torch.autograd.grad(math_sdpa(q, k, v, attn_mask=bias).sum(), bias)[0]
    assert_close(g, g_ref, F64, "d attn_mask")
    assert paths == {"fused": 0, "dense": 2}
    bias = bias.detach()
    dbias = randn(bias.shape, rng).masked_fill(bias.isinf(), 0.0)
    tangent = torch.func.jvp(lambda m: condinit.sdpa(q, k, v, attn_mask=m), (bias,), (dbias,))[1]
    tangent_ref = torch.func.jvp(lambda m: math_sdpa(q, k, v, attn_mask=m), (bias,), (dbias,))[1]
    assert_close(tangent, tangent_ref, F64, "tangent along attn_mask")
    assert paths == {"fused": 0, "dense": 3}


@pytest.mark.parametrize("kwargs,error,match", [
    ({"dropout_p": 0.1}, NotImplementedError, "dropout_p"),
    ({"dropout_p": 1.5}, ValueError, "dropout_p"),
    ({"is_causal": 1}, TypeError, "is_causal"),
    ({"enable_gqa": "yes"}, TypeError, "enable_gqa"),
    ({"scale": "0.1"}, TypeError, "scale"),
    ({"scale": float("nan")}, ValueError, "scale"),
    ({"is_causal": True, "attn_mask": torch.ones(5, 5, dtype=torch.bool)}, ValueError, "attn_mask"),
    ({"attn_mask": torch.ones(5, 5, dtype=torch.long)}, TypeError, "attn_mask"),
    ({"attn_mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError, "attn_mask"),
    ({"attn_mask": torch.ones(2, 2, 2, 5, 5, dtype=torch.bool)}, ValueError, "attn_mask"),
    ({"attn_mask": [[True]]}, TypeError, "attn_mask"),
    ({"k": (2, 2, 5, 8)}, ValueError, "enable_gqa=True"),
    ({"k": (2, 3, 5, 8), "v": (2, 3, 5, 8), "enable_gqa": True}, ValueError, "divide"),
    ({"k": (2, 4, 5, 6)}, ValueError, "head dim"),
    ({"v": (2, 4, 6, 8)}, ValueError, "sequence length"),
    ({"k": (3, 4, 5, 8), "v": (3, 4, 5, 8)}, ValueError, "batch"),
    ({"q": (8,)}, ValueError, "query"),
    ({"k_dtype": torch.float32}, TypeError, "key"),
    ({"q_dtype": torch.int64}, TypeError, "query"),
])
def test_argument_errors(kwargs, error, match):
    kwargs = dict(kwargs)
    shapes = {n: kwargs.pop(n, (2, 4, 5, 8)) for n in "qkv"}
    dtypes = {n: kwargs.pop(f"{n}_dtype", F64) for n in "qkv"}
    q, k, v = (torch.ones(shapes[n], dtype=dtypes[n]) for n in "qkv")
    with pytest.raises(error, match=match):
        condinit.sdpa(q, k, v, **kwargs)


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize("q_dtype", FLOATS)
@pytest.mark.parametrize("mask_dtype", FLOATS)
def test_float_mask_dtypes_as_sdpa_accepts_them(q_dtype, mask_dtype):
    """A float mask whose dtype SDPA refuses is refused naming attn_mask and both dtypes; one it
    accepts gives SDPA's output."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v = (torch.randn(2, 3, 4, 8, generator=g).to(q_dtype) for _ in range(3))
    mask = torch.randn(4, 4, generator=g).to(mask_dtype)
    try:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    except RuntimeError:
        with pytest.raises(TypeError, match=rf"attn_mask.*{q_dtype}.*got {mask_dtype}"):
            condinit.sdpa(q, k, v, attn_mask=mask)
        return
    assert_close(condinit.sdpa(q, k, v, attn_mask=mask), expected, q_dtype, f"{q_dtype}, {mask_dtype} mask")


# ------------------------------------------------------------------------------------------------
# Every mask shape SDPA accepts: each of [B, H, Nq, Nk] full or 1, leading dimensions dropped
# ------------------------------------------------------------------------------------------------

MASKS = settings(max_examples=int(os.environ.get("CONDINIT_FUZZ_EXAMPLES", "40")), deadline=None,
                 derandomize=os.environ.get("CONDINIT_FUZZ_RANDOM") != "1", print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
KINDS = ("random", "padding", "causal", "causal padding", "window", "empty rows")


def reference(q, k, v, attn_mask=None, is_causal=False):
    """Softmax attention in float64 from its definition; a row with no visible key gives 0 (what
    condinit.sdpa documents)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask.double()
    empty = (scores == float("-inf")).all(-1, keepdim=True)
    weights = torch.softmax(torch.where(empty, 0.0, scores), dim=-1)
    return torch.where(empty, 0.0, weights @ v)


class MaskCase(NamedTuple):
    """One drawn call: q ``[B, H, Nq, d]``, k / v ``[B, Hkv, Nk, d]`` and the mask's shape / values."""
    batch: int
    heads: int
    kv_heads: int
    nq: int
    nk: int
    shape: tuple
    kind: str
    as_float: Optional[str]     # None: bool; "inf": 0 / -inf; "bias": random values, -inf where hidden
    is_causal: bool
    seed: int


def mask_values(case: MaskCase, g: torch.Generator) -> torch.Tensor:
    """The bool visibility of ``case.kind`` in ``case.shape`` (index grids of size 1 where the mask
    broadcasts): key padding with one interval of real keys per leading index, (windowed) causal
    masks, random masks, rows with no visible key."""
    shape = case.shape
    full = (1,) * (4 - len(shape)) + shape
    rows = torch.arange(full[2]).view(-1, 1)
    cols = torch.arange(full[3]).view(1, -1)
    lead = full[:2] + (1, 1)
    start = torch.randint(0, case.nk, lead, generator=g).clamp(max=full[3] - 1)
    end = start + 1 + torch.randint(0, case.nk, lead, generator=g)
    padding = (cols >= start) & (cols < end)
    diag = int(torch.randint(0, 2, (), generator=g)) * (case.nk - case.nq)
    causal = cols <= rows + diag
    width = 1 + int(torch.randint(0, 3, (), generator=g))
    chance = torch.rand(full, generator=g)
    visible = {
        "random": chance > 0.4,
        "padding": padding,
        "causal": causal,
        "causal padding": causal & padding,
        "window": causal & (cols > rows + diag - width),
        "empty rows": (chance > 0.3) & (torch.rand(full[:3] + (1,), generator=g) > 0.5),
    }[case.kind]
    return visible.expand(full).reshape(shape)


def build_mask(case: MaskCase, g: torch.Generator) -> torch.Tensor:
    visible = mask_values(case, g)
    if case.as_float is None:
        return visible
    values = torch.zeros(case.shape, dtype=F64)
    if case.as_float == "bias":
        values = torch.randn(case.shape, generator=g, dtype=F64)
    return values.masked_fill(~visible, float("-inf"))


@st.composite
def mask_cases(draw):
    batch, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    nq, nk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    full = draw(st.lists(st.booleans(), min_size=4, max_size=4))
    drop = draw(st.integers(0, 4))
    shape = tuple(s if f else 1 for s, f in zip((batch, heads, nq, nk), full))[drop:]
    return MaskCase(batch, heads, draw(st.sampled_from((heads, 1))), nq, nk, shape,
                    draw(st.sampled_from(KINDS)), draw(st.sampled_from((None, "inf", "bias"))),
                    draw(st.sampled_from((False, False, False, True))), draw(st.integers(0, 2 ** 31 - 1)))


def inputs(case: MaskCase, g: torch.Generator):
    q = torch.randn(case.batch, case.heads, case.nq, 4, generator=g, dtype=F64)
    k, v = (torch.randn(case.batch, case.kv_heads, case.nk, 4, generator=g, dtype=F64) for _ in range(2))
    return q, k, v


def assert_matches(q, k, v, **kwargs):
    """condinit.sdpa in float64 (output and forward-mode tangent) and float32 against the float64
    reference; PyTorch's SDPA (MATH) against the same reference."""
    g = torch.Generator().manual_seed(1)
    expected = reference(q, k, v, **kwargs)
    theirs = math_sdpa(q, k, v, **kwargs)
    assert theirs.shape == expected.shape
    # a row with no visible key: 0 in condinit.sdpa (and the MATH backend here), NaN in some
    # SDPA backends and versions
    theirs = torch.where(theirs.isnan() & (expected == 0), 0.0, theirs)
    assert_close(theirs, expected, F64, "torch SDPA (MATH)")
    tangents = tuple(torch.randn(x.shape, generator=g, dtype=F64) for x in (q, k, v))
    out, tangent = torch.func.jvp(lambda q, k, v: condinit.sdpa(q, k, v, **kwargs), (q, k, v), tangents)
    _, tangent_ref = torch.func.jvp(lambda q, k, v: reference(q, k, v, **kwargs), (q, k, v), tangents)
    assert out.shape == expected.shape and not out.isnan().any() and not tangent.isnan().any()
    assert_close(out, expected, F64, "out")
    assert_close(tangent, tangent_ref, F64, "tangent")
    low = {name: (m.float() if isinstance(m, torch.Tensor) and m.is_floating_point() else m)
           for name, m in kwargs.items()}
    out32 = condinit.sdpa(q.float(), k.float(), v.float(), **low)
    assert out32.dtype == FP32
    assert_close(out32, expected, FP32, "float32 out", factor=5)


@MASKS
@given(case=mask_cases())
def test_every_broadcastable_mask_shape_matches_sdpa(case):
    g = torch.Generator().manual_seed(case.seed)
    q, k, v = inputs(case, g)
    mask = build_mask(case, g)
    if case.is_causal:
        # SDPA refuses a mask together with is_causal; so does condinit.sdpa
        with pytest.raises(RuntimeError):
            SDPA(q, k, v, attn_mask=mask, is_causal=True)
        with pytest.raises(ValueError, match="attn_mask must be None when is_causal=True"):
            condinit.sdpa(q, k, v, attn_mask=mask, is_causal=True)
        assert_matches(q, k, v, is_causal=True)
    else:
        assert_matches(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("shape", [(1, 5), (1, 1, 5), (1, 1, 1, 5), (5, 1), (1, 2, 1, 5), (2, 1, 5)],
                         ids=str)
@pytest.mark.parametrize("as_float", [False, True], ids=["bool", "float"])
def test_key_padding_with_a_broadcast_query_dimension(batch, shape, as_float, paths):
    """Key padding (and its transpose: queries with no key) whose query, batch or head dimensions
    broadcast; key padding runs on the fused op."""
    g = torch.Generator().manual_seed(batch)
    q, k, v = (torch.randn(batch, 2, 5, 4, generator=g, dtype=F64) for _ in range(3))
    visible = torch.tensor([True, True, True, False, False]).reshape(shape[-2:] if shape[-1] == 1 else -1)
    mask = visible.expand(shape)
    if as_float:
        mask = torch.zeros(shape, dtype=F64).masked_fill(~mask, float("-inf"))
    assert_matches(q, k, v, attn_mask=mask)
    if shape[-1] != 1:
        assert paths["dense"] == 0 and paths["fused"] > 0, paths


@pytest.mark.parametrize("mask", [torch.tensor([True, True, False, True, False]),
                                  torch.tensor([True, True, True, False, False]).expand(5, 5)],
                         ids=["1-D", "2-D padding"])
def test_two_dimensional_inputs_with_a_padding_mask(mask):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 4, generator=g, dtype=F64) for _ in range(3))
    assert_matches(q, k, v, attn_mask=mask)


# ------------------------------------------------------------------------------------------------
# patch_sdpa
# ------------------------------------------------------------------------------------------------

def test_patch_sdpa_restores_on_exit_exception_and_nesting():
    patch = condinit.patch_sdpa()
    with patch:
        assert F.scaled_dot_product_attention is condinit.sdpa
        with condinit.patch_sdpa():
            assert F.scaled_dot_product_attention is condinit.sdpa
        assert F.scaled_dot_product_attention is condinit.sdpa     # the inner exit keeps it
        with patch:                                                # the same object again
            pass
        assert F.scaled_dot_product_attention is condinit.sdpa
    assert F.scaled_dot_product_attention is SDPA
    with pytest.raises(KeyError):
        with condinit.patch_sdpa():
            raise KeyError("inside")
    assert F.scaled_dot_product_attention is SDPA

    @condinit.patch_sdpa()
    def inside():
        return F.scaled_dot_product_attention
    assert inside() is condinit.sdpa and inside() is condinit.sdpa
    assert F.scaled_dot_product_attention is SDPA


def test_patch_sdpa_overlapping_threads_restore_once_all_leave():
    entered, release = threading.Barrier(3), threading.Event()

    def worker():
        with condinit.patch_sdpa():
            entered.wait()
            release.wait()
    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    assert F.scaled_dot_product_attention is condinit.sdpa
    release.set()
    for t in threads:
        t.join()
    assert F.scaled_dot_product_attention is SDPA


def test_timm_vit_jvp_needs_the_patch_and_matches_float64(rng):
    """timm's ViT calls F.scaled_dot_product_attention: torch.func.jvp through it fails on the CPU
    without the patch and matches a float64 MATH-backend reference with it."""
    vision_transformer = pytest.importorskip("timm.models.vision_transformer")
    torch.manual_seed(rng.initial_seed())
    model = vision_transformer.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2,
                                                 num_heads=4, num_classes=5).eval()
    assert all(block.attn.fused_attn for block in model.blocks)
    x, dx = randn((2, 3, 16, 16), rng, FP32), randn((2, 3, 16, 16), rng, FP32)
    with pytest.raises(NotImplementedError, match="forward AD"):
        torch.func.jvp(model, (x,), (dx,))
    with condinit.patch_sdpa():
        out, tangent = torch.func.jvp(model, (x,), (dx,))
    assert F.scaled_dot_product_attention is SDPA
    model64 = model.double()
    with sdpa_kernel(SDPBackend.MATH):
        out_ref, tangent_ref = torch.func.jvp(model64, (x.double(),), (dx.double(),))
    assert_close(out, out_ref, FP32, "ViT output", factor=10)
    assert_close(tangent, tangent_ref, FP32, "ViT tangent", factor=10)


def padding(batch, n, g, as_float=False):
    """``[B, N]`` key_padding_mask (True / -inf = padded): entry 0 pads its last two keys, the
    others random keys too, and the last one (batch > 1) its second half; key 0 is always kept."""
    padded = torch.rand(batch, n, generator=g) > 0.6
    padded[0] = False
    padded[:, -2:] = True
    padded[:, 0] = False
    if batch > 1:
        padded[-1, n // 2:] = True
    if as_float:
        return torch.zeros(batch, n, dtype=F64).masked_fill(padded, float("-inf"))
    return padded


MODULE_CASES = {
    "key padding": lambda b, n, g: {"key_padding_mask": padding(b, n, g)},
    "float key padding": lambda b, n, g: {"key_padding_mask": padding(b, n, g, as_float=True)},
    "causal attn_mask": lambda b, n, g: {"attn_mask": ~torch.ones(n, n, dtype=torch.bool).tril()},
    "causal attn_mask + key padding": lambda b, n, g: {
        "attn_mask": ~torch.ones(n, n, dtype=torch.bool).tril(), "key_padding_mask": padding(b, n, g)},
    "is_causal": lambda b, n, g: {"attn_mask": nn.Transformer.generate_square_subsequent_mask(n, dtype=F64),
                                  "is_causal": True},
    "an entry with every key padded": lambda b, n, g: {"key_padding_mask": padding(b, n, g) | (
        torch.arange(b) == b - 1)[:, None]},
    "per-head float attn_mask": lambda b, n, g: {"attn_mask": torch.randn(b * 2, n, n, generator=g, dtype=F64)},
}


def run_both(module, x, kwargs, call):
    """The module under patch_sdpa and without it (PyTorch's SDPA, MATH backend), the output and
    the forward-mode tangent along a random direction."""
    dx = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    with condinit.patch_sdpa():
        mine = torch.func.jvp(lambda x: call(module, x, kwargs), (x,), (dx,))
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.func.jvp(lambda x: call(module, x, kwargs), (x,), (dx,))
    return mine, ref


def mha_call(module, x, kwargs):
    return module(x, x, x, need_weights=False, **kwargs)[0]


def encoder_call(module, x, kwargs):
    renamed = {"attn_mask": "src_mask", "key_padding_mask": "src_key_padding_mask"}
    return module(x, **{renamed.get(name, name): value for name, value in kwargs.items()})


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("case", MODULE_CASES, ids=str)
def test_multihead_attention_under_patch_sdpa(case, batch, batch_first, paths):
    g = torch.Generator().manual_seed(batch)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, dtype=F64)
    n = 6
    x = torch.randn((batch, n, 8) if batch_first else (n, batch, 8), generator=g, dtype=F64)
    (out, tangent), (out_ref, tangent_ref) = run_both(mha, x, MODULE_CASES[case](batch, n, g), mha_call)
    assert not out.isnan().any() and not tangent.isnan().any()
    assert_close(out, out_ref, F64, "out")
    assert_close(tangent, tangent_ref, F64, "tangent")
    assert paths["fused"] + paths["dense"] > 0, "condinit.sdpa did not run"


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", MODULE_CASES, ids=str)
def test_transformer_encoder_layer_under_patch_sdpa(case, batch, paths):
    g = torch.Generator().manual_seed(batch)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True, dtype=F64)
    n = 6
    x = torch.randn(batch, n, 8, generator=g, dtype=F64)
    (out, tangent), (out_ref, tangent_ref) = run_both(layer, x, MODULE_CASES[case](batch, n, g), encoder_call)
    assert not out.isnan().any() and not tangent.isnan().any()
    assert_close(out, out_ref, F64, "out")
    assert_close(tangent, tangent_ref, F64, "tangent")
    assert paths["fused"] + paths["dense"] > 0, "condinit.sdpa did not run"
