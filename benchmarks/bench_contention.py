"""Batched conditioned init on a busy machine: each workload timed quiet, then with busy processes
beside it that this script starts (and always stops), in one run.

Workloads, on a Llama-1B-shaped stack by default (16 layers, D = 2048, 32 Q heads and 8 KV heads of
64: 640 Q/K blocks [64, 2048], V the rectangular identity), fp32 on the CPU:

* ``conditioned_init_layers_``: condinit's batched call over the whole stack;
* ``Gram + Cholesky``: torch's ``bmm`` Gram of all 640 blocks and one batched float64 Cholesky
  (a lower bound of what any exact method does, with torch's own threading);
* ``per-head orthogonal_``: ``torch.nn.init.orthogonal_`` on every Q/K head block + ``eye_`` for V
  (what a user would otherwise write), timed on ``--baseline-blocks`` blocks (default 32) and scaled
  to the stack.

Contention: ``--contenders`` processes (default 2) of ``--load spin`` (``while True: pass``) or
``--load matmul`` (a single-threaded 512 x 512 fp32 matmul loop). They are stopped on exit, on
Ctrl-C and on error, and stop themselves when this process dies. Every number comes with the
1-minute load average read right after it (other work on the machine shows there). The run is
``--rounds`` rounds (default 3), each timing every workload quiet and then contended, so that a
drift of the machine's own background (a VM's neighbours, the page cache) falls inside a round;
the ratio column is the median of the rounds' ratios (contended / quiet medians), and every
round's ratio is listed beside it.

    python benchmarks/bench_contention.py [--shape llama-1b] [--repeats 5] [--rounds 3] [--load spin]
                                          [--contenders 2] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from condinit import bench

# Each contender exits as soon as its parent is gone (a killed benchmark leaves no busy process).
_LOADS = {
    "spin": "import os\np = os.getppid()\nwhile os.getppid() == p:\n    pass\n",
    "matmul": ("import os, torch\ntorch.set_num_threads(1)\np = os.getppid()\na = torch.randn(512, 512)\n"
               "while os.getppid() == p:\n    a @ a\n"),
}
SETTLE_S = 1.0   # contenders running before the first contended timing


class Contenders:
    """``count`` busy processes of kind ``load`` for the ``with`` block; stopped on any exit."""

    def __init__(self, count: int, load: str):
        self.count, self.code, self.procs = count, _LOADS[load], []

    def __enter__(self):
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen([sys.executable, "-c", self.code],
                                                   stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}))
            time.sleep(SETTLE_S)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def time_it(fn, repeats: int) -> dict:
    """Median, best and every time of ``repeats`` calls (after one untimed call), and the load
    average after each."""
    fn()
    times, loads = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        loads.append(os.getloadavg()[0])
    return {"median_s": statistics.median(times), "best_s": min(times), "all_s": times, "load_1min": loads}


def workloads(shape, baseline_blocks: int):
    stack = bench.make_stack(shape, "cpu")
    W = torch.randn(shape.blocks, shape.head_dim, shape.hidden)
    blocks = min(baseline_blocks, shape.blocks)
    scale = shape.blocks / blocks

    def gram_cholesky():
        torch.linalg.cholesky(torch.bmm(W, W.transpose(1, 2)).double())

    return [
        ("batched", "condinit conditioned_init_layers_", lambda: bench.init_batched(stack, shape), 1.0),
        ("gram_cholesky", "torch bmm Gram + float64 Cholesky", gram_cholesky, 1.0),
        ("orthogonal_loop", "per-head orthogonal_ loop + eye_" + (f" ({blocks} of {shape.blocks}, scaled)"
                                                                  if blocks < shape.blocks else ""),
         lambda: bench.per_head_orthogonal(stack, shape, max_blocks=blocks), scale),
    ]


def _pooled(timings: list) -> dict:
    times = [t for timing in timings for t in timing["all_s"]]
    return {"median_s": statistics.median(times), "best_s": min(times), "all_s": times,
            "load_1min": [x for timing in timings for x in timing["load_1min"]]}


def _row(key: str, label: str, rounds: list) -> dict:
    """One workload over the rounds: every call's time pooled per side, and the median of the
    rounds' ratios."""
    ratios = [c[key]["median_s"] / q[key]["median_s"] for q, c in rounds]
    return {"key": key, "label": label, "quiet": _pooled([q[key] for q, _ in rounds]),
            "contended": _pooled([c[key] for _, c in rounds]), "round_ratios": ratios,
            "ratio": statistics.median(ratios)}


def format_rows(rows) -> str:
    head = (f"{'workload':<52} {'quiet ms':>9} {'load':>5} {'contended ms':>12} {'load':>5} {'ratio':>6}  "
            "rounds")
    lines = [head, "-" * len(head)]
    for r in rows:
        q, c = r["quiet"], r["contended"]
        lines.append(f"{r['label'][:52]:<52} {q['median_s'] * 1e3:>9.0f} {q['load_1min'][-1]:>5.2f} "
                     f"{c['median_s'] * 1e3:>12.0f} {c['load_1min'][-1]:>5.2f} {r['ratio']:>6.2f}  "
                     + " ".join(f"{x:.2f}" for x in r["round_ratios"]))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-1b", help="a preset of condinit.bench.INIT_PRESETS or L,D,H,HKV,d")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per workload, condition and round")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of quiet-then-contended timings (the ratio is the median of the rounds')")
    p.add_argument("--contenders", type=int, default=2, help="busy processes started beside it")
    p.add_argument("--load", choices=sorted(_LOADS), default="spin", help="what each contender runs")
    p.add_argument("--baseline-blocks", type=int, default=32,
                   help="blocks of the per-head orthogonal_ loop that are timed (then scaled to the stack)")
    p.add_argument("--json", metavar="PATH", help="also write the rows, the machine and the settings here")
    args = p.parse_args(argv)
    for name in ("repeats", "rounds", "contenders", "baseline_blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    shape = bench.parse_shape(args.shape, "init")
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            p.error(f"--json: directory {parent} does not exist")
    work = workloads(shape, args.baseline_blocks)

    def scaled(t, s):
        return {**t, "median_s": t["median_s"] * s, "best_s": t["best_s"] * s, "all_s": [x * s for x in t["all_s"]]}

    # Rounds of quiet-then-contended timings: a drift of the machine's background (other VMs, the
    # page cache) then lands on both sides of a round's ratio instead of on one side of the run's.
    rounds = []
    for r in range(args.rounds):
        print(f"... round {r + 1}/{args.rounds}: quiet ({torch.get_num_threads()} torch threads, "
              f"load {os.getloadavg()[0]:.2f})", flush=True)
        quiet = {key: scaled(time_it(fn, args.repeats), s) for key, _, fn, s in work}
        print(f"... round {r + 1}/{args.rounds}: {args.contenders} x {args.load} contenders", flush=True)
        with Contenders(args.contenders, args.load):
            contended = {key: scaled(time_it(fn, args.repeats), s) for key, _, fn, s in work}
        rounds.append((quiet, contended))
    rows = [_row(key, label, rounds) for key, label, _, _ in work]
    print(f"\nshape {args.shape}: {shape.blocks} Q/K blocks [{shape.head_dim}, {shape.hidden}]; "
          f"{args.contenders} x {args.load} contenders; {args.rounds} rounds of {args.repeats} calls per side; "
          "ms: medians of every call; ratio: median of the rounds' ratios (each contended / quiet median); "
          "load: 1-min average after the last call")
    print(format_rows(rows))
    if args.json:
        doc = {"shape": args.shape, "blocks": shape.blocks, "contenders": args.contenders, "load": args.load,
               "repeats": args.repeats, "rounds": args.rounds, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
               "cpus": os.cpu_count(), "rows": rows}
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.json)
    return rows


if __name__ == "__main__":
    main()
