"""The ``attention`` rows of ``condinit bench``: condinit's fused attention kernels against SDPA and
``torch.func.jvp``.

The fused forward against SDPA's best backend (every SDPA backend forced in turn, the fastest
that runs is the baseline); the JVP against ``torch.func.jvp`` over SDPA MATH (the only SDPA
backend with forward-mode AD) and as a ratio to SDPA's fused forward; ``probes`` tangents in one
call against as many single-probe calls; the backward against SDPA's best backward; the backward
through the tangent output (reverse over forward) against the same through SDPA MATH.
"""
from __future__ import annotations

import warnings

import torch

from .config import ATTENTION_FLOP_FACTOR, AttentionShape, BenchConfig, jvp_flop_factor
from .measure import Row, Section, Timer, add_ratio, set_aim

__all__ = ["attention_flops", "sdpa_best", "math_jvp", "attention_backends", "attention_rows"]


def attention_flops(shape: AttentionShape, causal: bool, kind: str = "fwd") -> float:
    fwd = 4.0 * shape.batch * shape.heads * shape.seq * shape.seq * shape.head_dim
    if causal:
        fwd *= 0.5
    return fwd * ATTENTION_FLOP_FACTOR[kind]


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    names = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
    return [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]


def _sdpa(q, k, v, causal):
    import torch.nn.functional as F
    kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)


def sdpa_best(q, k, v, causal: bool, timer: Timer, backward: bool = False):
    """(backend name, Timing, {backend: why not}) of the fastest SDPA backend for this call, each
    forced in turn with ``sdpa_kernel`` (a backend that cannot run it raises and is skipped, with
    its reason). ``backward``: time the backward (``dout`` of ones) instead of the forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    best, why_not = None, {}
    for b in _sdpa_backends():
        if b == SDPBackend.MATH and best is not None:
            continue   # MATH is the reference, not a fused backend: only when nothing else runs
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel([b]):
                    if backward:
                        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                        out = _sdpa(*leaves, causal)
                        dout = torch.ones_like(out)
                        fn = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)  # noqa: E731
                    else:
                        fn = lambda: _sdpa(q, k, v, causal)  # noqa: E731
                    t = timer(fn)
        except RuntimeError as exc:
            why_not[b.name] = str(exc).splitlines()[0][:120]
            continue
        if best is None or t.seconds < best[1].seconds:
            best = (b.name, t)
    if best is None:
        raise RuntimeError(f"no SDPA backend ran: {why_not}")
    return best[0], best[1], why_not


def math_jvp(q, k, v, tq, tk, tv, causal):
    """``torch.func.jvp`` over SDPA forced to MATH, its only backend with forward-mode AD."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]), warnings.catch_warnings():
        # torch's forward-mode AD scripts its decompositions on first use and warns that torch.jit.script is
        # deprecated: torch's own internals, nothing the reader of the table can act on
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        return torch.func.jvp(lambda a, b, c: _sdpa(a, b, c, causal), (q, k, v), (tq, tk, tv))


def attention_backends(device, dtype, head_dim: int, backend=None) -> dict:
    """The backend each attention op runs for this call (what ``condinit.attention`` /
    ``attention_jvp`` choose)."""
    from condinit.ops.attention import op
    choose = lambda o: o.choose(device, backend, dtype=dtype, head_dim=head_dim)  # noqa: E731
    # the tangent backward has no Triton / CUDA row: attention_jvp then takes its automatic choice
    jvp_bwd_forced = backend if backend is None or backend in op.ATTENTION_JVP_BWD.impls else "auto"
    return {"fwd": choose(op.ATTENTION_FWD), "bwd": choose(op.ATTENTION_BWD), "jvp": choose(op.ATTENTION_JVP),
            "jvp_bwd": op.ATTENTION_JVP_BWD.choose(device, jvp_bwd_forced, dtype=dtype, head_dim=head_dim)}


def attention_rows(cfg: BenchConfig, progress=lambda s: None, on_row=None) -> list[Row]:
    import condinit
    dev = torch.device(cfg.device)
    s, dtype, causal = cfg.attention_shape, cfg.dtype, cfg.causal
    timer = Timer(dev, cfg.repeats)
    sec = Section("attention", timer, progress, on_row)
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda h: torch.randn(s.batch, h, s.seq, s.head_dim, device=dev, generator=g).to(dtype)  # noqa: E731
    q, k, v = mk(s.heads), mk(s.kv_heads), mk(s.kv_heads)
    tq, tk, tv = mk(s.heads), mk(s.kv_heads), mk(s.kv_heads)
    fl = {kind: attention_flops(s, causal, kind) for kind in ATTENTION_FLOP_FACTOR}
    chosen = lambda kind: attention_backends(dev, dtype, s.head_dim, cfg.backend)[kind]  # noqa: E731
    kw = {"backend": cfg.backend} if cfg.backend else {}

    # SDPA's best fused forward and backward (measured first: the other rows compare to them)
    sdpa_fwd = _measure_sdpa(sec, "sdpa_fwd", "SDPA forward, best backend", q, k, v, causal, timer,
                             False, fl["fwd"])
    sdpa_bwd = _measure_sdpa(sec, "sdpa_bwd", "SDPA backward, best backend", q, k, v, causal, timer, True,
                             fl["bwd"])
    fwd = sec.measure("fwd", "condinit attention forward", lambda: chosen("fwd"),
                      lambda: condinit.attention(q, k, v, causal=causal, **kw), flops=fl["fwd"], peak_memory=True)
    add_ratio(fwd, sdpa_fwd)
    set_aim(fwd, "attention.sdpa_fwd", 1.1, "<= 1.1x sdpa_fwd")

    if "math_jvp" not in cfg.skip:
        math_row = sec.measure("math_jvp", "torch.func.jvp over SDPA MATH", "SDPA MATH",
                               lambda: math_jvp(q, k, v, tq, tk, tv, causal), flops=fl["jvp"], peak_memory=True)
    else:
        math_row = None
    jvp = sec.measure("jvp", "condinit attention_jvp (1 probe)", lambda: chosen("jvp"),
                      lambda: condinit.attention_jvp(q, k, v, tq, tk, tv, causal=causal, **kw), flops=fl["jvp"],
                      peak_memory=True)
    add_ratio(jvp, math_row)
    add_ratio(jvp, sdpa_fwd)
    set_aim(jvp, "attention.sdpa_fwd", 2.5, "<= 2.5x sdpa_fwd (3x its FLOPs)")
    P = cfg.probes
    if P > 1 and "jvp_probes" not in cfg.skip:
        def probes_setup():
            t = [torch.randn(P, *x.shape, device=dev, generator=g).to(dtype) for x in (q, k, v)]
            return lambda: condinit.attention_jvp(q, k, v, *t, causal=causal, **kw)
        multi = sec.measure("jvp_probes", f"condinit attention_jvp, {P} probes in one call", lambda: chosen("jvp"),
                            None, setup=probes_setup, flops=jvp_flop_factor(P) * fl["fwd"])
        if multi.ok and jvp.ok:   # against P single-probe calls (the row above)
            multi.ratios[f"attention.jvp*{P}"] = multi.seconds / (P * jvp.seconds)

    def bwd_setup():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = condinit.attention(*leaves, causal=causal, **kw)
        dout = torch.ones_like(out)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    bwd = sec.measure("bwd", "condinit attention backward", lambda: chosen("bwd"), None, setup=bwd_setup,
                      flops=fl["bwd"])
    add_ratio(bwd, sdpa_bwd)
    add_ratio(bwd, sdpa_fwd)

    def tangent_bwd_setup(fn):
        def setup():
            leaves = [x.detach().requires_grad_() for x in (q, k, v, tq, tk, tv)]
            out, tout = fn(*leaves)
            grads = (torch.ones_like(out), torch.ones_like(tout))
            return lambda: torch.autograd.grad((out, tout), leaves, grads, retain_graph=True)
        return setup

    if "math_jvp_bwd" not in cfg.skip:
        math_tb = sec.measure("math_jvp_bwd", "backward through torch.func.jvp over MATH", "SDPA MATH", None,
                              setup=tangent_bwd_setup(lambda *x: math_jvp(*x, causal)), flops=fl["jvp_bwd"],
                              peak_memory=True)
    else:
        math_tb = None
    tb = sec.measure("jvp_bwd", "backward through condinit attention_jvp", lambda: chosen("jvp_bwd"),
                     None, setup=tangent_bwd_setup(
                         lambda a, b, c, ta, tb_, tc: condinit.attention_jvp(a, b, c, ta, tb_, tc, causal=causal, **kw)),
                     flops=fl["jvp_bwd"], peak_memory=True)
    add_ratio(tb, math_tb)
    add_ratio(tb, sdpa_fwd)
    set_aim(tb, "attention.math_jvp_bwd", 0.2, "<= 0.2x math_jvp_bwd")
    return sec.rows


def _measure_sdpa(sec: Section, key, name, q, k, v, causal, timer, backward, flops) -> Row:
    sec.progress(f"{sec.name}: {name}")
    row = Row(sec.name, f"{sec.name}.{key}", name, "?")
    try:
        backend, t, why_not = sdpa_best(q, k, v, causal, timer, backward)
        row.backend, row.seconds, row.best, row.flops = backend, t.seconds, t.best, flops
        if why_not:
            row.note = "not run: " + ", ".join(sorted(why_not))
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
    return sec.add(row)
