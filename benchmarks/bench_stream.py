"""``condinit init --out DIR/`` (streamed, sharded) vs what a user would do today, side by side in one run.

Each variant runs in a fresh subprocess (peak RSS from ``os.wait4``, wall time around it, imports
included for both), with ``sync`` and the output removed between runs, in this order:

* disk: the write speed of this filesystem, a ``--disk-gb`` buffer written in 64 MB pieces and
  ``fsync``ed, once with the writeback left to the kernel and once started after each piece (as
  condinit's writer does); the faster is the disk speed (the bound any writer of that many bytes
  meets);
* condinit: ``condinit init --config CONFIG --dtype bf16 --out DIR/ --max-shard-size 5GB --quiet``
  (every shard fsynced before its rename), ending as the console script does
  (``condinit.cli.finish``: exit handlers run, no interpreter teardown);
* with ``--sequential``: the same condinit write with the writer thread's overlap off (each tensor
  written before the next is computed), to measure what the overlap gives;
* baseline (``--baseline``, default on): ``AutoModelForCausalLM.from_config(config, dtype=bf16)`` then
  ``save_pretrained(DIR, max_shard_size="5GB")``, timed to its return and to a following ``os.sync()``
  (``save_pretrained`` does not fsync; condinit's time includes its fsyncs); a plain script, so its
  exit includes the interpreter's teardown (1.4 s here with these libraries).

The model: ``--shape llama-1b`` (Llama-3.2-1B: 16 layers, D 2048, 32/8 heads of 64, MLP 8192,
vocabulary 128256, tied embeddings; 2.47 GB in bf16) or ``llama-3-8b`` (32 layers, D 4096, 32/8
heads of 128, MLP 14336, vocabulary 128256, untied; 16.06 GB in bf16: run it with
``--no-baseline``).

    python benchmarks/bench_stream.py [--shape llama-1b] [--out-root /tmp] [--disk-gb 1.5] [--no-baseline]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "tiny-llama": dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096,
                       tie_word_embeddings=True, architectures=["LlamaForCausalLM"]),   # a smoke test of the script
    "llama-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=True, architectures=["LlamaForCausalLM"]),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
}

# The disk's write speed: n bytes in 64 MB pieces, then fsync; "plain" leaves the writeback to the
# kernel (it starts late: the disk idles until the dirty threshold or the fsync), "streamed" starts
# it after each piece as condinit's writer does (posix_fadvise DONTNEED): the sustained rate.
_DISK = r"""
import json, os, sys, time
n, path = int(sys.argv[1]), sys.argv[2]
piece = os.urandom(64 << 20)
out = {}
for mode in ("plain", "streamed"):
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        done = dropped = started = 0
        while done < n:
            k = min(len(piece), n - done)
            fh.write(piece[:k])
            done += k
            if mode == "streamed":
                fh.flush()
                os.posix_fadvise(fh.fileno(), dropped, done - dropped, os.POSIX_FADV_DONTNEED)
                dropped, started = started, done
        os.fsync(fh.fileno())
    out[mode] = time.perf_counter() - t0
    os.unlink(path)
    os.sync()
print(json.dumps(out))
"""

_BASELINE = r"""
import json, os, sys, time
t_start = time.perf_counter()
import torch, transformers
import transformers.models.llama.modeling_llama
import_s = time.perf_counter() - t_start
cfg = json.load(open(sys.argv[1]))
config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
t0 = time.perf_counter()
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
t1 = time.perf_counter()
model.save_pretrained(sys.argv[2], max_shard_size="5GB")
t2 = time.perf_counter()
os.sync()
print(json.dumps({"import_s": import_s, "build_s": t1 - t0, "save_s": t2 - t1, "sync_s": time.perf_counter() - t2}))
"""


# condinit's command line, timed from after its imports (the baseline's script does the same)
_CONDINIT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
import transformers.models.llama.modeling_llama
from condinit.cli import finish, main
from condinit.models.stream import tuned
t1 = time.perf_counter()
with tuned(overlap_writes=sys.argv[3] == "overlap"):
    rc = main(["init", "--config", sys.argv[1], "--dtype", "bf16", "--out", sys.argv[2], "--max-shard-size", "5GB",
               "--quiet"])
print(json.dumps({"import_s": t1 - t0, "work_s": time.perf_counter() - t1}), flush=True)
finish(rc)   # as the console script ends (condinit.cli.run)
"""


def _run(argv) -> dict:
    """Wall time, peak RSS and stdout of a subprocess."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed ({proc.returncode}): {err[-2000:]}")
    return {"wall_s": wall, "peak_rss": usage.ru_maxrss * 1024, "stdout": out}


def _dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--out-root", default=tempfile.gettempdir(), help="where outputs are written (then removed)")
    p.add_argument("--disk-gb", type=float, default=1.5, help="bytes for the disk-speed measurement (GB)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sequential", action="store_true", help="also run condinit without write overlap")
    p.add_argument("--keep", action="store_true", help="keep the condinit output directory")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    root = tempfile.mkdtemp(prefix="condinit-bench-stream-", dir=args.out_root)
    cfg_path = os.path.join(root, "config.json")
    with open(cfg_path, "w") as fh:
        json.dump(SHAPES[args.shape], fh)
    res = {"shape": args.shape, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "cpus": os.cpu_count()}
    try:
        os.sync()
        n = int(args.disk_gb * 1e9)
        res["load_disk"] = _load()
        r = _run([sys.executable, "-c", _DISK, str(n), os.path.join(root, "disk.bin")])
        res["disk_bytes"], res["disk_modes_s"] = n, json.loads(r["stdout"].strip())
        res["disk_s"] = min(res["disk_modes_s"].values())
        res["disk_rate"] = n / res["disk_s"]

        out = os.path.join(root, "condinit") + os.sep
        res["load_condinit"] = _load()
        r = _run([sys.executable, "-c", _CONDINIT, cfg_path, out, "overlap"])
        res["condinit_s"], res["condinit_rss"] = r["wall_s"], r["peak_rss"]
        res["condinit_parts"] = json.loads(r["stdout"].strip().splitlines()[-1])
        res["condinit_bytes"] = _dir_bytes(out)
        res["condinit_files"] = sorted(os.listdir(out))
        shard = [os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors")]
        res["largest_shard"] = max(shard)
        if not args.keep:
            shutil.rmtree(out)
        os.sync()

        if args.sequential:
            seq = os.path.join(root, "sequential") + os.sep
            res["load_sequential"] = _load()
            r = _run([sys.executable, "-c", _CONDINIT, cfg_path, seq, "sequential"])
            res["sequential_s"], res["sequential_rss"] = r["wall_s"], r["peak_rss"]
            res["sequential_parts"] = json.loads(r["stdout"].strip().splitlines()[-1])
            shutil.rmtree(seq)
            os.sync()

        if args.baseline:
            base = os.path.join(root, "baseline")
            res["load_baseline"] = _load()
            r = _run([sys.executable, "-c", _BASELINE, cfg_path, base])
            inner = json.loads(r["stdout"].strip().splitlines()[-1])
            res["baseline_s"], res["baseline_rss"] = r["wall_s"], r["peak_rss"]
            res["baseline_to_return_s"] = r["wall_s"] - inner["sync_s"]
            res["baseline_parts"] = inner
            res["baseline_bytes"] = _dir_bytes(base)
            shutil.rmtree(base)
            os.sync()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    gb = 1e9
    print(f"{res['date']}, {res['cpus']} CPUs, shape {args.shape} in bf16, outputs under {args.out_root}")
    dm = res["disk_modes_s"]
    print(f"disk: {res['disk_bytes'] / gb:.2f} GB + fsync in {res['disk_s']:.2f} s = {res['disk_rate'] / 1e6:.0f} MB/s "
          f"(writeback started as written: {dm['streamed']:.2f} s; left to the kernel: {dm['plain']:.2f} s) "
          f"(load {res['load_disk']})")
    floor = res["condinit_bytes"] / res["disk_rate"]
    cw = res["condinit_parts"]["work_s"]
    print(f"condinit: {res['condinit_s']:.1f} s ({res['condinit_parts']['import_s']:.1f} s imports, {cw:.1f} s "
          f"writing), peak RSS {res['condinit_rss'] / gb:.2f} GB, wrote "
          f"{res['condinit_bytes'] / gb:.2f} GB in {len(res['condinit_files'])} files (largest shard "
          f"{res['largest_shard'] / gb:.2f} GB); the disk alone needs {floor:.1f} s for that: "
          f"{100 * floor / cw:.0f} % of the disk's speed over the writing time (load {res['load_condinit']})")
    if args.sequential:
        sw = res["sequential_parts"]["work_s"]
        print(f"condinit without write overlap: {res['sequential_s']:.1f} s ({sw:.1f} s writing), peak RSS "
              f"{res['sequential_rss'] / gb:.2f} GB (load {res['load_sequential']}): the overlap saves "
              f"{sw - cw:.1f} s of writing")
    if args.baseline:
        print(f"baseline: {res['baseline_s']:.1f} s to durable ({res['baseline_to_return_s']:.1f} s to return: build "
              f"{res['baseline_parts']['build_s']:.1f} s, save {res['baseline_parts']['save_s']:.1f} s, sync "
              f"{res['baseline_parts']['sync_s']:.1f} s), peak RSS {res['baseline_rss'] / gb:.2f} GB "
              f"(load {res['load_baseline']})")
        bp = res["baseline_parts"]
        bw = bp["build_s"] + bp["save_s"] + bp["sync_s"]
        print(f"ratio: condinit {res['baseline_s'] / res['condinit_s']:.2f}x faster than the baseline end to end "
              f"(to durable; {res['baseline_to_return_s'] / res['condinit_s']:.2f}x to its return), "
              f"{bw / cw:.2f}x after imports (baseline {bw:.1f} s build + save + sync, imports "
              f"{bp['import_s']:.1f} s); peak RSS {res['condinit_rss'] / res['baseline_rss']:.3f} of the baseline's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
