"""Benchmark ``condinit.apply`` on real models, side by side with the model's own init.

    python benchmarks/bench_apply.py                 # Llama-1B-shaped on CPU (+ GPU section with CUDA)
    python benchmarks/bench_apply.py --preset tiny-llama --no-gpu
    python -m pytest benchmarks/bench_apply.py --benchmark-enable   # pytest-benchmark, tiny sizes

CPU section (Hugging Face Llama-3.2-1B-shaped model, fp32; every variant in a fresh subprocess so
that its peak RSS is its own):

* **time**: the model's own init pass (``model.initialize_weights()``, HF's ``_init_weights`` on every
  module of an allocated model) against ``condinit.apply`` (report off / on) on the same model, and
  the meta-device path (own init of everything but Q/K/V, then conditioned Q/K/V) against building
  the model with its default init. Bar: apply adds at most 25 % to the own init.
* **memory**: peak RSS above the RSS after imports, against the model's own size (bytes of its
  unique parameters and buffers). Bar: at most 10 % above the model.

GPU section (skipped without CUDA): a Llama-3-70B-shaped attention stack (80 layers, D = 8192,
64 heads / 8 KV heads of 128; HF ``LlamaAttention`` modules, bf16) built on the meta device and
materialized + conditioned on the GPU by ``condinit.apply``, blocks streamed through a bounded
memory budget (``--gpu-buffer-mib``); reports time, peak GPU memory against the stack's size, and the
fp32 FLOP rate of the orthogonalization (CholeskyQR2: 4 GEMMs of 2 d^2 D per block).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _hf_own_init(model):
    """Re-run a HF model's own init on an allocated model (what post_init does at construction)."""
    for m in model.modules():
        if "_is_hf_initialized" in m.__dict__:
            del m.__dict__["_is_hf_initialized"]
    for p in model.parameters():
        if "_is_hf_initialized" in p.__dict__:
            del p.__dict__["_is_hf_initialized"]
    model.initialize_weights()


# ------------------------------------------------------------------------------------------------
# children (one variant per fresh process)

def child(variant: str, preset: str, threads: int, repeats: int = 2) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    import condinit  # noqa: F401
    from condinit.models import apply
    from condinit.models.presets import build_model

    import transformers  # noqa: F401  (import cost stays out of the baseline)

    torch.manual_seed(0)
    base = _rss_bytes()
    res = {"variant": variant, "preset": preset, "threads": torch.get_num_threads()}
    if variant == "own":
        t0 = time.perf_counter()
        model, _ = build_model(preset, device="cpu")
        res["t_build"] = time.perf_counter() - t0
        res["peak_own"] = _peak_rss_bytes() - base
        # own init and apply alternate `repeats` times on the same model; the minimum of each is
        # reported, so that a burst of load from other processes does not decide the ratio
        own, app, app_rep = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _hf_own_init(model)
            own.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rep = apply(model, seed=0, report=False)
            app.append(time.perf_counter() - t0)
        res["peak_after_apply"] = _peak_rss_bytes() - base
        t0 = time.perf_counter()
        apply(model, seed=0, report=True)
        app_rep.append(time.perf_counter() - t0)
        res.update(t_own_init=min(own), t_apply=min(app), t_apply_report=min(app_rep), launches=rep.launches,
                   t_own_init_all=own, t_apply_all=app)
    elif variant == "meta":
        t0 = time.perf_counter()
        model, _ = build_model(preset, device="meta")
        rep = apply(model, seed=0, report=False, device="cpu")
        res["t_meta_total"] = time.perf_counter() - t0
        res["t_meta_own_init"] = rep.init_time_s
        res["t_meta_condition"] = rep.total_time_s - rep.init_time_s
        res["peak"] = _peak_rss_bytes() - base
    elif variant == "default":
        t0 = time.perf_counter()
        model, _ = build_model(preset, device="cpu")
        res["t_build"] = time.perf_counter() - t0
        res["peak"] = _peak_rss_bytes() - base
    else:
        raise ValueError(f"unknown variant {variant!r}")
    res["model_bytes"] = _model_bytes(model)
    res["baseline_rss"] = base
    return res


def run_child(variant, preset, threads, repeats) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--preset", preset,
           "--threads", str(threads), "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# GPU section

def gpu_section(buffer_mib: int, layers: int = 80, device: str = "cuda") -> dict:
    import torch
    from torch import nn

    from condinit.models import apply
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    cfg = LlamaConfig(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      num_hidden_layers=layers, intermediate_size=28672)
    with torch.device("meta"):
        stack = nn.ModuleList([LlamaAttention(cfg, i) for i in range(layers)]).to(torch.bfloat16)
    nbytes = _model_bytes(stack)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rep = apply(stack, seed=0, report=False, device=dev, memory_budget=buffer_mib << 20)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    cond = rep.total_time_s - rep.init_time_s
    peak = torch.cuda.max_memory_allocated(dev) - base if cuda else float("nan")
    d, D = 128, 8192
    blocks = layers * (64 + 8)
    flop = blocks * 4 * 2 * d * d * D  # CholeskyQR2: 4 GEMMs of 2 d^2 D
    return {"layers": layers, "stack_bytes": nbytes, "t_total": total, "t_own_init": rep.init_time_s,
            "t_condition": cond, "launches": rep.launches, "peak_gpu_bytes": peak, "qk_blocks": blocks,
            "tflops_orth": flop / cond / 1e12, "written_gb_per_s": blocks * d * D * 2 / cond / 1e9,
            "buffer_mib": buffer_mib, "gpu": torch.cuda.get_device_name(dev) if cuda else str(dev)}


# ------------------------------------------------------------------------------------------------
# main

def _gb(x):
    return f"{x / 2 ** 30:.2f} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per child (0: torch's default)")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--gpu-buffer-mib", type=int, default=2048)
    ap.add_argument("--gpu-layers", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=2, help="alternating own-init / apply timings (min kept)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.preset, args.threads, args.repeats)))
        return 0

    from rich.console import Console
    from rich.table import Table

    results = {v: run_child(v, args.preset, args.threads, args.repeats) for v in ("own", "meta", "default")}
    own, meta, default = results["own"], results["meta"], results["default"]
    con = Console(width=160)
    mb = own["model_bytes"]
    t = Table(title=f"condinit.apply vs the model's own init: {args.preset} on CPU, fp32, "
                    f"{own['threads']} threads, model {_gb(mb)}")
    for c in ("what", "own init (s)", "condinit (s)", "condinit / own", "bar"):
        t.add_column(c)
    t.add_row("apply on an initialized model (report off)", f"{own['t_own_init']:.2f}", f"{own['t_apply']:.2f}",
              f"{own['t_apply'] / own['t_own_init']:.1%}", "<= 25 %")
    t.add_row("apply on an initialized model (report on)", f"{own['t_own_init']:.2f}",
              f"{own['t_apply_report']:.2f}", f"{own['t_apply_report'] / own['t_own_init']:.1%}", "")
    t.add_row("meta path: own init (no Q/K/V) + apply vs build with default init", f"{default['t_build']:.2f}",
              f"{meta['t_meta_total']:.2f}", f"{meta['t_meta_total'] / default['t_build']:.1%}", "")
    con.print(t)
    m = Table(title="peak RSS above the RSS after imports (fresh process per variant)")
    for c in ("variant", "model", "peak", "peak / model", "bar"):
        m.add_column(c)
    m.add_row("build on CPU with default init", _gb(mb), _gb(default["peak"]), f"{default['peak'] / mb:.3f}", "")
    m.add_row("build on CPU + condinit.apply", _gb(mb), _gb(own["peak_after_apply"]),
              f"{own['peak_after_apply'] / mb:.3f}", "")
    m.add_row("build on meta + condinit.apply (deferred)", _gb(meta["model_bytes"]), _gb(meta["peak"]),
              f"{meta['peak'] / meta['model_bytes']:.3f}", "<= 1.10")
    con.print(m)
    gpu = None
    if not args.no_gpu:
        import torch

        if torch.cuda.is_available():
            gpu = gpu_section(args.gpu_buffer_mib, args.gpu_layers)
            g = Table(title=f"GPU: Llama-3-70B-shaped attention stack ({gpu['layers']} layers, bf16, "
                            f"{_gb(gpu['stack_bytes'])}) on meta -> {gpu['gpu']}")
            for c in ("own init (s)", "condition (s)", "launches", "peak GPU / stack", "TFLOP/s (orth, fp32)",
                      "GB/s written"):
                g.add_column(c)
            g.add_row(f"{gpu['t_own_init']:.3f}", f"{gpu['t_condition']:.3f}", str(gpu["launches"]),
                      f"{gpu['peak_gpu_bytes'] / gpu['stack_bytes']:.3f}", f"{gpu['tflops_orth']:.1f}",
                      f"{gpu['written_gb_per_s']:.1f}")
            con.print(g)
        else:
            con.print("GPU section skipped: no CUDA device")
    if args.json:
        print(json.dumps({"cpu": results, "gpu": gpu}, indent=1))
    return 0


# ------------------------------------------------------------------------------------------------
# pytest-benchmark (tiny sizes): python -m pytest benchmarks/bench_apply.py --benchmark-enable

def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256))


def test_bench_own_init_tiny(benchmark):
    import pytest

    pytest.importorskip("transformers")
    model = _tiny_llama()
    benchmark(_hf_own_init, model)


def test_bench_apply_tiny(benchmark):
    import pytest

    pytest.importorskip("transformers")
    from condinit.models import apply

    model = _tiny_llama()
    rep = benchmark(apply, model, seed=0, report=False)
    assert len(rep) == 2


def test_bench_apply_meta_tiny(benchmark):
    import pytest
    import torch

    pytest.importorskip("transformers")
    from condinit.models import apply

    def run():
        with torch.device("meta"):
            model = _tiny_llama()
        return apply(model, seed=0, report=False)

    assert benchmark(run).materialized


if __name__ == "__main__":
    sys.exit(main())
