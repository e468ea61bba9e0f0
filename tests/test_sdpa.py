"""condinit.sdpa against PyTorch's SDPA (MATH backend) in float64, which path each call takes,
its argument errors, and condinit.patch_sdpa (with a timm ViT)."""
import threading

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
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
