"""Benchmark: the cost of leaving the Jacobian monitor on, and the multi-probe JVP launch.

    python benchmarks/bench_probe.py            # 12 layers, D=768, 12 heads, batch 8 x 512, 20 Lanczos steps
    python benchmarks/bench_probe.py --quick    # 4 layers, D=256, 4 heads, batch 4 x 128
    python -m pytest benchmarks/bench_probe.py --benchmark-enable   # tiny pytest-benchmark cases
    python benchmarks/bench_probe.py --convergence  # kappa's bracket per layer at the estimators' defaults

Side by side, in one run on the CPU:

1. **Monitoring vs training.** A pre-LN causal Transformer (``nn.TransformerEncoderLayer``, its
   ``nn.MultiheadAttention`` seen by the adapters) trained with AdamW. Timed: a training step without
   the monitor; a sampled training step with :class:`condinit.JacobianMonitor` on (its hooks copy the
   attention inputs and weights); the monitor's estimation for that step (Golub-Kahan-Lanczos,
   ``--steps``, an 8-probe Hutchinson and the signals, all layers). Reported: ratio = (estimation +
   time inside the capture hooks) / (100 training steps), i.e. the overhead of ``every=100``
   (bar: <= 1 %), for the full
   captured batch and for ``max_batch=1`` (the knob that bounds it).
2. **Multi-probe JVP.** ``condinit.attention_jvp`` with P = 8 tangents in one launch against 8
   single-probe calls (bar: >= 1.5x), on the automatic backend and on the torch reference.

3. **Convergence** (``--convergence``). At the defaults of :func:`condinit.probe.lanczos_svd` (and of
   :class:`condinit.JacobianMonitor`): the estimate of every layer of a tiny Llama trained by the
   Hugging Face ``Trainer`` with :class:`~condinit.integrations.trainer.JacobianMonitorCallback`
   (hidden 64, 4 heads / 2 key-value heads, 2 layers, 32 tokens; its records: method, steps, kappa's
   bracket, converged, seconds), and a Llama-1B-shaped layer (hidden 2048, 32 heads / 8 key-value
   heads of 64, RoPE, causal; a one-layer ``LlamaModel`` with random init, then ``condinit.apply``)
   at 512 tokens: the bracket reached within each ``--time-budgets`` (default 10, 30, 60 s), by one
   run on ``J`` whole and block by block over its 8 key/value groups (``blocks=True``).

The machine these numbers come from is shared: timings are medians of a few repeats and still noisy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

BAR_MONITOR = 0.01
BAR_MULTIPROBE = 1.5

FULL = dict(layers=12, D=768, H=12, B=8, N=512, steps=20)
QUICK = dict(layers=4, D=256, H=4, B=4, N=128, steps=20)


class Model(nn.Module):
    def __init__(self, layers, D, H):
        super().__init__()
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        n = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        for blk in self.blocks:
            x = blk(x, src_mask=mask, is_causal=True)
        return self.norm(x)


def _median_time(fn, repeats):
    """Median (wall seconds, process CPU seconds): on a shared machine the CPU time of this process
    is the steadier measure of cost; both are reported."""
    ts, cs = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return statistics.median(ts), statistics.median(cs)


def bench_monitor(cfg, repeats=2, max_batch=(None, 1), log=print):
    from condinit import JacobianMonitor

    torch.manual_seed(0)
    model = Model(cfg["layers"], cfg["D"], cfg["H"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(cfg["B"], cfg["N"], cfg["D"])
    target = torch.randn_like(x)

    def train_step():
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    train_step()                                  # warm-up
    # one-time costs (lazy imports of torch.library / dynamo pieces on the first custom-op call) are
    # paid on a tiny model first, so the timed estimate is the steady state
    tiny = Model(1, 32, 2)
    with JacobianMonitor(tiny, every=1, steps=2, causal=True, frobenius_samples=2) as warm:
        with torch.no_grad():
            tiny(torch.randn(1, 8, 32))
        warm.step()
    t_train, c_train = _median_time(train_step, repeats)
    log(f"  training step: {t_train:.3f} s wall, {c_train:.3f} s CPU")
    rows = []
    for mb in max_batch:
        mon = JacobianMonitor(model, every=100, steps=cfg["steps"], causal=True, max_batch=mb, frobenius_samples=8)
        # the capture cost is timed inside the hooks (the difference of two noisy training steps
        # would drown it); a sampled step is the training step plus that
        hook_time = [0.0, 0.0]
        on_input = mon._on_input

        def timed_hook(*args):
            c0, t0 = time.process_time(), time.perf_counter()
            on_input(*args)
            hook_time[0] += time.perf_counter() - t0
            hook_time[1] += time.process_time() - c0

        mon._on_input = timed_hook
        mon._capture._on_input = timed_hook
        t_cap, c_cap = _median_time(train_step, 1)        # a sampled step: the hooks copy inputs and weights
        holder = {}
        t_est, c_est = _median_time(lambda: holder.setdefault("recs", mon.step()), 1)
        mon.close()
        ratio = (t_est + hook_time[0]) / (100 * t_train)
        ratio_cpu = (c_est + hook_time[1]) / (100 * c_train)
        rows.append(dict(max_batch=mb or cfg["B"], t_train=t_train, c_train=c_train, t_sampled=t_cap,
                         t_estimate=t_est, c_estimate=c_est, t_hooks=hook_time[0], c_hooks=hook_time[1],
                         ratio=ratio, ratio_cpu=ratio_cpu,
                         layers=len([r for r in holder["recs"] if r.get("skipped") is None])))
        log(f"  monitor (batch {mb or cfg['B']}): estimate {t_est:.3f} s wall / {c_est:.3f} s CPU, capture hooks "
            f"{hook_time[0]:.3f} s wall / {hook_time[1]:.3f} s CPU (sampled step {t_cap:.3f} s wall / {c_cap:.3f} s "
            f"CPU); ratio {ratio:.2%} wall, {ratio_cpu:.2%} CPU")
    return rows


def bench_multiprobe(B, H, N, d, P=8, repeats=3, backends=(None, "torch"), log=print):
    from condinit import attention_jvp

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in range(3))
    tq, tk, tv = (torch.randn(P, B, H, N, d, generator=g) for _ in range(3))
    rows = []
    for be in backends:
        fused = lambda: attention_jvp(q, k, v, tq, tk, tv, causal=True, backend=be)  # noqa: E731
        sep = lambda: [attention_jvp(q, k, v, tq[i], tk[i], tv[i], causal=True, backend=be) for i in range(P)]  # noqa: E731
        fused()
        sep()
        (t_f, c_f), (t_s, c_s) = _median_time(fused, repeats), _median_time(sep, repeats)
        rows.append(dict(backend=be or "auto", t_fused=t_f, t_separate=t_s, speedup=t_s / t_f, c_fused=c_f,
                         c_separate=c_s, speedup_cpu=c_s / c_f))
        log(f"  attention_jvp P={P} [{be or 'auto'}]: fused {t_f:.3f} s, {P} separate {t_s:.3f} s, "
            f"speedup {t_s / t_f:.2f}x wall, {c_s / c_f:.2f}x CPU")
    return rows


# ------------------------------------------------------------------------------------------------
# convergence of the kappa estimates at the defaults

def _fmt_est(e) -> str:
    kb = "-" if e.kappa_lo is None else f"[{e.kappa_lo:.4g}, {e.kappa_hi:.4g}]"
    sb = f"[{e.sigma_min_lo:.4g}, {e.sigma_min_hi:.4g}]" if e.sigma_min_lo is not None else "-"
    return (f"{e.method}, {e.iterations} steps, kappa {e.kappa if e.kappa is None else format(e.kappa, '.4g')} "
            f"in {kb}, sigma_min in {sb}, converged {e.converged}, exact {e.exact}, {e.wall_s:.2f} s")


def bench_trainer_convergence(log=print, output_dir=None):
    """Every layer's record of the tiny-Llama HF Trainer run at the monitor's defaults (``every=1``)."""
    import tempfile

    import condinit
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from condinit.integrations.trainer import JacobianMonitorCallback

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    condinit.apply(model, seed=0, report=False)
    ids = torch.randint(0, cfg.vocab_size, (16, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in ids]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=output_dir or tmp, max_steps=2, per_device_train_batch_size=2,
                                 learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                                 disable_tqdm=True, seed=3)
        cb = JacobianMonitorCallback(every=1)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    rows = []
    for r in cb.monitor.history:
        rows.append({k: r.get(k) for k in ("step", "layer", "kappa", "kappa_lo", "kappa_hi", "sigma_min_lo",
                                           "sigma_min_hi", "converged", "exact", "lanczos_steps", "time_s")}
                    | {"method": r.get("method"), "dtype": r.get("dtype")})
        if r["kappa"] is None:
            kappa = (f"rank-deficient (sigma_min in [{r['sigma_min_lo']:.4g}, {r['sigma_min_hi']:.4g}] "
                     f"<= rank_rtol sigma_max)")
        else:
            kappa = f"kappa {r['kappa']:.5g} in [{r['kappa_lo']:.5g}, {r['kappa_hi']:.5g}]"
        log(f"  trainer step {r['step']} layer {r['layer']}: {kappa}, converged {r['converged']}, exact "
            f"{r['exact']}, {r['method']} in {r['dtype']}, {r['lanczos_steps']} Lanczos steps, {r['time_s']:.2f} s")
    return rows


def llama1b_layer_operator(tokens=512, seed=0):
    """The weight Jacobian of a Llama-1B-shaped attention layer at ``tokens`` tokens (its input and RoPE
    captured from a one-layer ``LlamaModel`` forward, after ``condinit.apply``)."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=1, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=1000, max_position_embeddings=2048)
    return _first_layer_operator(LlamaModel(cfg).eval(), cfg.vocab_size, tokens, seed)


def gpt2_layer_operator(tokens=512, seed=0):
    """The same for a GPT-2-small-shaped layer (hidden 768, 12 heads of 64, every head its own key/value
    head, learned positions, causal)."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=768, n_layer=1, n_head=12, vocab_size=1000, n_positions=1024,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return _first_layer_operator(GPT2Model(cfg).eval(), cfg.vocab_size, tokens, seed)


def _first_layer_operator(model, vocab, tokens, seed):
    """The weight Jacobian of ``model``'s first attention layer at its input in one forward of ``tokens``
    random tokens, after ``condinit.apply``."""
    import condinit
    from condinit.probe import InputCapture
    from condinit.probe.capture import layer_position_embeddings

    condinit.apply(model, seed=seed, report=False)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed + 1))
    (layer,) = condinit.models.find_attention(model)
    seen = {}

    def keep(i, module, x, call):
        seen.setdefault(i, (x.clone(), layer_position_embeddings(module, *call)))

    with InputCapture([layer.module], on_input=keep, call_info=True), torch.no_grad():
        model(input_ids=ids)
    x, pe = seen[0]
    return condinit.JacobianOperator(layer.module, x, wrt="weights", causal=True, position_embeddings=pe,
                                     spec=layer.spec)


def bench_llama1b_convergence(budgets=(10.0, 30.0, 60.0), tokens=512, log=print, blocks=(False, True)):
    """The bracket of kappa reached by ``lanczos_svd`` at its defaults within each time budget, on ``J``
    whole and block by block over its key/value groups."""
    from condinit.probe import lanczos_svd

    t0 = time.perf_counter()
    op = llama1b_layer_operator(tokens)
    log(f"  Llama-1B layer, {tokens} tokens: J is {op.m} x {op.n}, known nulls {op.null_dims} "
        f"(built in {time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    dims = [b.null_dims for b in op.kv_blocks()]
    log(f"  its {len(dims)} key/value blocks: {op.kv_blocks()[0].shape} each, known nulls {dims[0]} "
        f"(set up in {time.perf_counter() - t0:.1f} s)")
    rows = []
    for blk in blocks:
        for b in budgets:
            e = lanczos_svd(op, seed=0, time_budget=b, blocks=blk)
            rows.append(dict(blocks=blk, budget=b, steps=e.iterations, kappa=e.kappa, kappa_lo=e.kappa_lo,
                             kappa_hi=e.kappa_hi, sigma_max=(e.sigma_max_lo, e.sigma_max_hi),
                             sigma_min=(e.sigma_min_lo, e.sigma_min_hi), converged=e.converged, wall=e.wall_s,
                             method=e.method, cpu=time.process_time()))
            log(f"  blocks={blk} time_budget {b:g} s ({e.wall_s:.1f} s): {_fmt_est(e)}; sigma_min in "
                f"[{e.sigma_min_lo:.4g}, {e.sigma_min_hi:.4g}], sigma_max in [{e.sigma_max_lo:.4g}, "
                f"{e.sigma_max_hi:.4g}]")
    return rows


def bench_floor(D=64, H=4, N=48, steps=60, log=print):
    """The certified floor under sigma_min (``condinit.probe.floor``) and a short Lanczos
    run's bracket, against the dense Jacobian's smallest nonzero singular value, on a float64
    ``nn.MultiheadAttention`` layer after ``condinit.apply`` (its output projection included, so the
    reference is the module's own output), bidirectional and causal."""
    import condinit
    from condinit.probe import lanczos_svd
    from condinit.probe.floor import sigma_min_floor

    rows = []
    for causal in (False, True):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        m = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
        condinit.apply(m, seed=0, report=False)
        x = torch.randn(1, N, D, generator=g, dtype=torch.float64)
        mask = torch.triu(torch.ones(N, N, dtype=torch.bool), 1) if causal else None

        def f(w):
            kw = dict(attn_mask=mask, need_weights=False)
            return torch.func.functional_call(m, {"in_proj_weight": w}, (x, x, x), kw)[0].reshape(-1)

        t0 = time.perf_counter()
        s = torch.linalg.svdvals(torch.func.jacrev(f)(m.in_proj_weight.detach()).detach().reshape(N * D, -1))
        t_ref = time.perf_counter() - t0
        truth = float(s[s > 1e-10 * s[0]][-1])
        op = condinit.JacobianOperator(m, x, wrt="weights", causal=causal, include_output_proj=True)
        t0 = time.perf_counter()
        fl = sigma_min_floor(op)
        t_floor = time.perf_counter() - t0
        e = lanczos_svd(op, steps=steps, seed=0)
        rows.append(dict(causal=causal, truth=truth, floor=fl.value, bracket=(e.sigma_min_lo,
                         e.sigma_min_hi), kappa=float(s[0]) / truth, kappa_bracket=(e.kappa_lo, e.kappa_hi)))
        log(f"  {'causal' if causal else 'bidirectional'}, J {op.m} x {op.n}: smallest nonzero sigma {truth:.4g} "
            f"(dense reference {t_ref:.0f} s); floor {fl.value:.4g} ({fl.value / truth:.3g}x) in {t_floor:.2f} s; {steps} Lanczos steps: sigma_min in "
            f"[{e.sigma_min_lo:.4g}, {e.sigma_min_hi:.4g}], kappa in [{e.kappa_lo:.4g}, {e.kappa_hi:.4g}] "
            f"(true {float(s[0]) / truth:.4g})")
    rows += bench_floor_grouped(steps=steps, log=log)
    return rows


def bench_floor_grouped(H=8, Hkv=2, d=8, tokens=(16, 48), steps=60, log=print):
    """The same on causal grouped-query attention (``wrt="qkv"``, float64 random q, k, v), where J has
    output directions no tangent reaches: the reference is the dense Jacobian of torch's own
    ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``."""
    import condinit
    from condinit.probe import lanczos_svd
    from condinit.probe.floor import sigma_min_floor

    rows = []
    for N in tokens:
        g = torch.Generator().manual_seed(N)
        q, k, v = (torch.randn(1, h, N, d, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def f(q, k, v):
            return sdpa(q, k, v, is_causal=True, enable_gqa=True).reshape(-1)

        J = torch.cat([t.reshape(H * N * d, -1) for t in torch.func.jacrev(f, argnums=(0, 1, 2))(q, k, v)], 1)
        s = torch.linalg.svdvals(J)
        nz = s[s > 1e-10 * s[0]]
        truth = float(nz[-1])
        op = condinit.JacobianOperator((q, k, v), None, wrt="qkv", causal=True)
        t0 = time.perf_counter()
        fl = sigma_min_floor(op)
        t_floor = time.perf_counter() - t0
        e = lanczos_svd(op, steps=steps, seed=0)
        rows.append(dict(causal=True, grouped=(H, Hkv), tokens=N, truth=truth, floor=fl.value,
                         ceiling=fl.ceiling, bracket=(e.sigma_min_lo, e.sigma_min_hi), kappa=float(s[0]) / truth,
                         kappa_bracket=(e.kappa_lo, e.kappa_hi)))
        log(f"  causal GQA {H}:{Hkv}, d={d}, {N} tokens, J {op.m} x {op.n} of rank {len(nz)}: smallest nonzero "
            f"sigma {truth:.4g}; floor {fl.value:.4g} ({fl.value / truth:.3g}x) and ceiling {fl.ceiling:.4g} in "
            f"{t_floor:.2f} s; {steps} Lanczos steps: sigma_min in [{e.sigma_min_lo:.4g}, {e.sigma_min_hi:.4g}], "
            f"kappa in [{e.kappa_lo:.4g}, {e.kappa_hi:.4g}] (true {float(s[0]) / truth:.4g})")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes (4 layers, D=256, batch 4 x 128)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-monitor", action="store_true")
    ap.add_argument("--skip-multiprobe", action="store_true")
    ap.add_argument("--monitor-batches", default="all,1",
                    help="comma list of capture batch sizes for the monitor ('all' = the training batch)")
    ap.add_argument("--convergence", action="store_true",
                    help="kappa's bracket per layer at the defaults (tiny-Llama Trainer run, Llama-1B layer)")
    ap.add_argument("--only", choices=("trainer", "llama1b", "floor"), default=None, help="with --convergence: one part")
    ap.add_argument("--time-budgets", default="10,30,60", help="with --convergence: Llama-1B time budgets [s]")
    ap.add_argument("--tokens", type=int, default=512, help="with --convergence: Llama-1B layer tokens")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.convergence:
        return convergence_main(args)
    cfg = QUICK if args.quick else FULL
    print(f"bench_probe ({'quick' if args.quick else 'full'}): {cfg}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; shared machine: timings are noisy")
    mbs = tuple(None if b.strip() == "all" else int(b) for b in args.monitor_batches.split(","))
    mon_rows = [] if args.skip_monitor else bench_monitor(cfg, repeats=args.repeats, max_batch=mbs)
    d = cfg["D"] // cfg["H"]
    mp_rows = [] if args.skip_multiprobe else bench_multiprobe(1 if args.quick else cfg["B"], cfg["H"], cfg["N"], d,
                                                               repeats=args.repeats)
    print()
    print("| measurement | value | bar |")
    print("| --- | --- | --- |")
    if mon_rows:
        print(f"| training step (no monitor) | {mon_rows[0]['t_train']:.3f} s wall, {mon_rows[0]['c_train']:.3f} s CPU"
              f" | |")
    for r in mon_rows:
        ok = "PASS" if r["ratio_cpu"] <= BAR_MONITOR else "FAIL"
        print(f"| monitor estimate, {r['layers']} layers, capture batch {r['max_batch']} | {r['t_estimate']:.3f} s "
              f"wall, {r['c_estimate']:.3f} s CPU | |")
        print(f"| capture hooks in the sampled step | {r['t_hooks']:.3f} s wall, {r['c_hooks']:.3f} s CPU | |")
        print(f"| (estimate + capture) / 100 training steps, batch {r['max_batch']} | {r['ratio_cpu']:.2%} CPU "
              f"({r['ratio']:.2%} wall) | <= {BAR_MONITOR:.0%} {ok} |")
    for r in mp_rows:
        ok = "PASS" if r["speedup_cpu"] >= BAR_MULTIPROBE else "FAIL"
        print(f"| attention_jvp P=8 fused vs 8 calls [{r['backend']}] | {r['t_fused']:.3f} s vs "
              f"{r['t_separate']:.3f} s wall: {r['speedup']:.2f}x wall, {r['speedup_cpu']:.2f}x CPU | "
              f">= {BAR_MULTIPROBE}x {ok} |")
    return 0


def convergence_main(args):
    import os
    import platform

    print(f"bench_probe --convergence: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.2f}")
    if args.only in (None, "trainer"):
        print("Trainer example (tiny Llama, JacobianMonitorCallback(every=1), monitor defaults):")
        bench_trainer_convergence()
    if args.only in (None, "llama1b"):
        budgets = tuple(float(b) for b in args.time_budgets.split(","))
        print(f"Llama-1B-shaped layer at {args.tokens} tokens, lanczos_svd defaults and time_budget:")
        bench_llama1b_convergence(budgets, args.tokens)
    if args.only in (None, "floor"):
        print("sigma_min's floor, float64 nn.MultiheadAttention (D=64, 4 heads, 48 tokens, with W_O), then causal "
              "grouped-query q, k, v:")
        bench_floor()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


# ------------------------------------------------------------------------------------------------
# pytest-benchmark (tiny sizes; `pytest benchmarks/bench_probe.py --benchmark-enable`)

def test_bench_monitor_step_tiny(benchmark):
    from condinit import JacobianMonitor

    torch.manual_seed(0)
    model = Model(2, 32, 2)
    x = torch.randn(2, 16, 32)
    mon = JacobianMonitor(model, every=1, steps=10, causal=True, frobenius_samples=4)

    def sampled():
        with torch.no_grad():
            model(x)
        return mon.step()

    recs = benchmark(sampled)
    mon.close()
    assert len(recs) == 2 and all(r["sigma_max"] > 0 for r in recs)


def test_bench_multiprobe_jvp_tiny(benchmark):
    from condinit import attention_jvp

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    t = torch.randn(8, 1, 2, 64, 16, generator=g)
    out, tout = benchmark(lambda: attention_jvp(q, k, v, t, t, t, causal=True))
    assert tout.shape == (8, 1, 2, 64, 16)


if __name__ == "__main__":
    sys.exit(main())
