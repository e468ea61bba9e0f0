"""One script for a machine with one NVIDIA GPU: build, check every GPU path, time it, report.

    python benchmarks/gpu_check.py [--log PATH] [--skip-build] [--quick] [--budget 470]
    python benchmarks/gpu_check.py --cpu-dry-run      # the same logic on the CPU backends, toy sizes

Made so that one run cannot be lost (docs/design.md, "GPU checks"):

1. **build** (``pip install --no-index --no-build-isolation --no-deps -e .``, the visible GPU's arch
   only, offline) under a timeout; where the system Python refuses to install (an externally
   managed environment) into a venv with the system site packages, whose Python then runs the
   sections. A failed build is recorded and the sections run with whatever backends load.
2. **sections**, each in its own process with its own timeout (an illegal address is sticky for a
   whole CUDA context; a hang must not eat the budget): ``sanitize`` first (compute-sanitizer
   memcheck and racecheck on tiny shapes, time-capped, when compute-sanitizer exists), then
   ``init``, ``attention-triton``, ``attention-cuda``, and the timing sections, which run the
   ``condinit bench`` library (:mod:`condinit.bench`) with the backend forced (a backend that cannot
   run a row fails that row; nothing falls back) and print the backend on every row.
3. Every (section, dtype, shape) check is guarded and recorded the moment it finishes (one JSON
   line in a results file the parent reads back): a section that crashes or times out keeps every
   check it finished and gets one ERROR entry with the tail of its output.
4. The summary, the failed checks and the timing table are printed last; the full log goes to
   ``--log`` (default ``$OUT/gpu_check.log`` when ``$OUT`` is set, else ``gpu_check.log``) and every
   record to ``--json`` (default: next to the log).

fp32 Triton attention is checked on one small shape (its fp32 kernels compile slowly). The whole
run stays within ``--budget`` seconds (default 470, under 8 minutes on one H200 including the
build): each section's timeout is its own cap, cut to what the budget has left after reserving a
little for the sections after it. Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)

# (name, timeout cap in seconds, seconds reserved for it while earlier sections run)
SECTIONS = (
    ("sanitize", 75, 15),
    ("init", 60, 15),
    ("attention-triton", 110, 20),
    ("attention-cuda", 70, 15),
    ("timing-init", 60, 15),
    ("timing-attention-triton", 60, 15),
    ("timing-attention-cuda", 50, 10),
)
SANITIZER_TOOLS = (("memcheck", 0.6), ("racecheck", 0.4))   # share of the sanitize section's time
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
# A section may be made to fail on purpose (tests of the parent's bookkeeping): "section:crash" or
# "section:hang".
FAULT_ENV = "CONDINIT_GPU_CHECK_FAULT"
SEED_ENV = "CONDINIT_GPU_CHECK_SEED"


# ============================================================================================= parent

class Log:
    def __init__(self, path):
        self.path = path
        self.file = open(path, "w")

    def __call__(self, msg=""):
        print(msg, flush=True)
        self.file.write(msg + "\n")
        self.file.flush()


def run_limited(cmd, timeout, env=None, cwd=ROOT):
    """(returncode or None when it timed out, combined output): the command in its own process
    group, killed as a group at the timeout (compute-sanitizer and pip start children)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return None, out


class Parent:
    def __init__(self, args, log):
        self.args, self.log = args, log
        self.t0 = time.monotonic()
        self.records = []
        self.python = sys.executable
        self.installed = False   # set when the build installed condinit (children import that one)

    def left(self):
        return self.args.budget - (time.monotonic() - self.t0)

    def record(self, section, name, status, detail="", seconds=0.0):
        rec = {"section": section, "name": name, "status": status, "detail": detail, "seconds": seconds}
        self.records.append(rec)
        self.log(f"[{status}] {section}: {name} {detail}")

    def env(self):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not self.installed:   # no (successful) build: import condinit from this tree
            env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
        if not self.args.cpu_dry_run:
            env.pop("TRITON_INTERPRET", None)   # the real kernels, not the interpreter
        return env

    # ---- build
    def build(self, timeout):
        import torch
        major, minor = torch.cuda.get_device_capability(0)
        env = {**self.env(), "CONDINIT_STRICT_BUILD": "1", "MAX_JOBS": str(os.cpu_count() or 8),
               "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}", "PIP_NO_INDEX": "1"}
        env.setdefault("CUDA_HOME", "/usr/local/cuda")
        t0 = time.monotonic()
        pip = ["-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-deps", "-e", ROOT]
        self.log(f"$ python {' '.join(pip)}  (TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']}, "
                 f"timeout {timeout:.0f} s)")
        rc, out = run_limited([self.python, *pip], timeout, env)
        if rc not in (0, None) and "externally-managed-environment" in out:
            venv = os.path.join(tempfile.gettempdir(), "condinit-gpu-check-venv")
            self.log(f"the system Python refuses installs: venv with system site packages at {venv}")
            rc_v, out_v = run_limited([self.python, "-m", "venv", "--system-site-packages", venv],
                                      max(1.0, timeout - (time.monotonic() - t0)), env)
            if rc_v == 0:
                self.python = os.path.join(venv, "bin", "python")
                rc, out = run_limited([self.python, *pip], max(1.0, timeout - (time.monotonic() - t0)), env)
            else:
                out += "\n" + out_v
        self.log(out[-15000:])
        seconds = time.monotonic() - t0
        if rc is None:
            self.record("build", "pip install -e . with CUDA", "ERROR", f"timed out after {seconds:.0f} s", seconds)
        else:
            self.record("build", "pip install -e . with CUDA", "PASS" if rc == 0 else "FAIL",
                        f"{seconds:.0f} s, exit {rc}", seconds)
        return rc == 0

    # ---- sections
    def section(self, name, cap, later_reserve):
        timeout = min(cap, self.args.section_timeout.get(name, self.args.section_timeout.get("*", cap)),
                      self.left() - later_reserve)
        if timeout < 5:
            self.record(name, "section", "SKIP", f"budget spent ({self.left():.0f} s left)")
            return
        fd, results = tempfile.mkstemp(prefix=f"gpu_check-{name}-", suffix=".jsonl")
        os.close(fd)
        if name == "sanitize":
            return self.sanitize(timeout, results)
        self.log(f"--- section {name} (timeout {timeout:.0f} s)")
        cmd = [self.python, SCRIPT, "--section", name, "--results", results] + self.child_flags()
        self.child(name, cmd, timeout, results)

    def child_flags(self):
        return ["--cpu-dry-run"] * self.args.cpu_dry_run + ["--quick"] * self.args.quick + \
            ["--autotune"] * self.args.autotune

    def child(self, name, cmd, timeout, results, label=None):
        t0 = time.monotonic()
        rc, out = run_limited(cmd, timeout, self.env())
        seconds = time.monotonic() - t0
        got = read_records(results)
        if os.path.exists(results):
            os.remove(results)
        # a timing row is emitted when measured and again with its rates at the end: keep the last
        keyed = {}
        for rec in got:
            if rec.get("kind") == "row":
                keyed[(rec["section"], rec["row"]["key"])] = rec
            else:
                self.records.append(rec)
        self.records += keyed.values()
        self.log(out.rstrip()[-20000:])
        label = label or name
        if rc is None:
            self.record(label, "section", "ERROR", f"timed out after {seconds:.0f} s; {len(got)} records kept; "
                        f"last output: {tail(out)}", seconds)
        elif rc != 0:
            self.record(label, "section", "ERROR", f"exit status {rc} after {seconds:.0f} s; {len(got)} records "
                        f"kept; last output: {tail(out)}", seconds)
        else:
            self.log(f"    (section {label}: {len(got)} records, {seconds:.0f} s)")
        return rc, out

    def sanitize(self, timeout, results):
        tool = shutil.which("compute-sanitizer") or next(
            (p for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer"),
                         "/usr/local/cuda/bin/compute-sanitizer") if os.path.isfile(p)), None)
        if tool is None or self.args.cpu_dry_run:
            why = "CPU dry run" if self.args.cpu_dry_run else "compute-sanitizer not found"
            self.record("sanitize", "compute-sanitizer", "SKIP", why)
            # the tiny checks still run (without the sanitizer), so their logic is exercised
            self.log("--- section sanitize: tiny shapes without compute-sanitizer")
            self.child("sanitize", [self.python, SCRIPT, "--section", "tiny", "--results", results]
                       + self.child_flags(), timeout, results, "tiny")
            return
        for tool_name, share in SANITIZER_TOOLS:
            cap = timeout * share
            self.log(f"--- section sanitize: {tool_name} on tiny shapes (timeout {cap:.0f} s)")
            res = results if tool_name == "memcheck" else results + f".{tool_name}"
            cmd = [tool, "--tool", tool_name, "--error-exitcode", "97", "--target-processes", "all",
                   self.python, SCRIPT, "--section", "tiny", "--results", res, "--tag", tool_name] + self.child_flags()
            rc, out = self.child(f"sanitize-{tool_name}", cmd, cap, res)
            summary = " | ".join(ln.strip("= ").strip() for ln in out.splitlines() if "SUMMARY" in ln)
            # --error-exitcode: any memory error or hazard makes the exit status non-zero
            status = "ERROR" if rc is None else ("PASS" if rc == 0 else "FAIL")
            self.record("sanitize", f"compute-sanitizer {tool_name} (tiny shapes)", status,
                        (summary or "no summary") + (" (timed out)" if rc is None else f" (exit {rc})"))

    def run(self):
        import torch
        args = self.args
        self.log(f"condinit gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')}; python {sys.version.split()[0]}, "
                 f"torch {torch.__version__}; budget {args.budget:.0f} s")
        if not args.cpu_dry_run and not torch.cuda.is_available():
            self.log("no CUDA GPU visible: nothing to check")
            return 1
        device = "CPU dry run" if args.cpu_dry_run else torch.cuda.get_device_name(0)
        if not args.cpu_dry_run:
            self.log(f"GPU: {device}, capability {torch.cuda.get_device_capability(0)}")
        reserve = sum(r for _, _, r in SECTIONS)
        if not args.skip_build and not args.cpu_dry_run:
            self.installed = self.build(min(args.build_timeout, self.left() - reserve))
        wanted = args.sections.split(",") if args.sections else [s for s, _, _ in SECTIONS]
        for i, (name, cap, _) in enumerate(SECTIONS):
            if name in wanted:
                later = sum(r for n, _, r in SECTIONS[i + 1:] if n in wanted)
                self.section(name, cap, later)
        return self.summary(device)

    def summary(self, device):
        log = self.log
        checks = [r for r in self.records if r.get("kind") != "row"]
        rows = [r for r in self.records if r.get("kind") == "row"]
        failed = [r for r in checks if r["status"] not in ("PASS", "SKIP")]
        log("")
        log(f"=== condinit gpu_check summary ({device}, {time.monotonic() - self.t0:.0f} s of a "
            f"{self.args.budget:.0f} s budget) ===")
        log(f"checks: {sum(r['status'] == 'PASS' for r in checks)} passed, {len(failed)} failed, "
            f"{sum(r['status'] == 'SKIP' for r in checks)} skipped")
        for r in failed:
            log(f"  {r['status']} {r['section']}: {r['name']} {r['detail']}")
        if rows:
            sys.path.insert(0, ROOT)
            from condinit import bench
            fields = {f for f in bench.Row.__dataclass_fields__}
            table = [bench.Row(**{k: v for k, v in r["row"].items() if k in fields}) for r in rows]
            log(bench.format_table(table, "timing (median; FLOPs: attention fwd 4BHN^2d halved causal, bwd 2.5x, "
                                          "jvp 3x, tangent bwd 7.5x; % of the ceiling measured in the same section)"))
        with open(self.args.json, "w") as f:
            json.dump({"device": device, "records": self.records}, f, indent=1, default=str)
        log(f"log: {self.log.path}; records: {self.args.json}")
        return 0 if not failed else 1


def read_records(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:   # a line cut short by a crash
                        pass
    except OSError:
        pass
    return out


def tail(text, n=3):
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-600:]


# ============================================================================================= child

class Child:
    """One section in its own process: each check guarded, recorded as one JSON line at once."""

    def __init__(self, section, results, dry, quick, tag=None):
        self.section, self.dry, self.quick = section, dry, quick
        self.label = f"{section}-{tag}" if tag else section
        self.results = open(results, "a")
        self.dev = "cpu" if dry else "cuda"

    def emit(self, rec):
        self.results.write(json.dumps(rec, default=str) + "\n")
        self.results.flush()
        os.fsync(self.results.fileno())

    def record(self, name, status, detail="", seconds=0.0):
        self.emit({"section": self.label, "name": name, "status": status, "detail": detail, "seconds": seconds})
        print(f"[{status}] {self.label}: {name} {detail}", flush=True)

    def check(self, name, fn, *args):
        """Run ``fn(*args) -> (ok, detail)``; an exception is an ERROR with its message."""
        t0 = time.perf_counter()
        try:
            ok, detail = fn(*args)
            status = "PASS" if ok else "FAIL"
        except Exception as exc:
            status, detail = "ERROR", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            traceback.print_exc()
        self.record(name, status, detail, time.perf_counter() - t0)

    def row(self, row):
        import dataclasses
        self.emit({"section": self.label, "kind": "row", "row": dataclasses.asdict(row)})
        print(f"[ROW] {self.label}: {row.name} [{row.backend}] "
              + (f"{row.seconds * 1e3:.2f} ms" if row.ok else f"ERROR {row.error}"), flush=True)


def rel_err(x, ref, floor=1e-30):
    """max |x - ref| / max |ref|; ``floor`` bounds the denominator from below (a gradient that is
    exactly zero, e.g. dq when each row sees one key, would otherwise divide rounding noise by 0)."""
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


def naive_attention(q, k, v, causal, scale):
    import torch
    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = scale * q @ k.mT
    if not causal:
        return torch.softmax(s, dim=-1) @ v
    nq, nk = q.shape[2], k.shape[2]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
    # a finite fill keeps rows that see no key NaN-free (also in their gradients); zero them after
    p = torch.softmax(s.masked_fill(~mask, torch.finfo(s.dtype).min), dim=-1)
    return (p * mask.any(-1, keepdim=True)) @ v


def attention_case(dev, backend, dtype, case, probes=2):
    """(ok, detail): forward, ``probes``-probe JVP and backward of ``condinit`` on ``backend`` (forced)
    against float64 references, one case ``(B, H, Hkv, Nq, Nk, d, causal)``."""
    import torch
    import condinit
    B, H, Hkv, Nq, Nk, d, causal = case
    mk = lambda h, n: torch.randn(B, h, n, d, device=dev, dtype=torch.float64)  # noqa: E731
    q, k, v = mk(H, Nq), mk(Hkv, Nk), mk(Hkv, Nk)
    tq, tk, tv = (torch.randn(probes, *t.shape, device=dev, dtype=torch.float64) for t in (q, k, v))
    scale = d ** -0.5
    f = lambda a, b, c: naive_attention(a, b, c, causal, scale)  # noqa: E731
    ref_out = f(q, k, v)
    ref_t = torch.stack([torch.func.jvp(f, (q, k, v), (tq[p], tk[p], tv[p]))[1] for p in range(probes)])
    dout = torch.randn_like(ref_out)
    _, vjp = torch.func.vjp(f, q, k, v)
    ref_g = vjp(dout)
    c = lambda t: t.to(dtype).contiguous()  # noqa: E731
    out, tout = condinit.attention_jvp(c(q), c(k), c(v), c(tq), c(tk), c(tv), causal=causal, scale=scale,
                                       backend=backend)
    qq, kk, vv = (c(t).requires_grad_() for t in (q, k, v))
    o2 = condinit.attention(qq, kk, vv, causal=causal, scale=scale, backend=backend)
    grads = torch.autograd.grad(o2, (qq, kk, vv), c(dout))
    if any(bool(torch.isnan(t).any()) for t in (out, tout, o2, *grads)):
        return False, "NaN in an output"
    err = {"out": max(rel_err(out, ref_out), rel_err(o2, ref_out)), "tout": rel_err(tout, ref_t),
           # inputs are unit Gaussians, so gradients are O(1): floor the denominator at 1
           "grad": max(rel_err(a, b, floor=1.0) for a, b in zip(grads, ref_g))}
    tol = TOL[str(dtype).split(".")[1]]
    return all(e <= tol for e in err.values()), " ".join(f"{k}={e:.1e}" for k, e in err.items()) + f" (tol {tol:.0e})"


ATTENTION_CASES = [  # B, H, Hkv, Nq, Nk, d, causal
    (1, 2, 2, 64, 64, 64, True), (1, 2, 2, 1, 1, 64, False), (2, 4, 2, 17, 17, 16, True),
    (1, 8, 1, 128, 128, 128, True), (1, 4, 4, 333, 333, 80, False), (1, 2, 1, 200, 64, 64, True),
    (1, 2, 2, 64, 300, 256, True), (1, 8, 2, 129, 257, 96, False), (1, 2, 2, 1000, 1000, 32, True),
]


def section_tiny(ch):
    """Tiny shapes of every GPU kernel (under compute-sanitizer: memory errors and races)."""
    import torch
    from condinit.init import orthogonalize
    from condinit.ops.random.op import block_randn
    randn_backend = "cpp-cpu" if ch.dry else "cuda"

    def randn():
        a = block_randn(7, 3, [0, 2**33 + 1], (5, 37), device=ch.dev, backend=randn_backend).cpu()
        b = block_randn(7, 3, [0, 2**33 + 1], (5, 37), device="cpu", backend="torch")
        return torch.equal(a, b), f"{randn_backend} == torch reference bit for bit"
    ch.check(f"randn {randn_backend} (2, 5, 37)", randn)
    x = torch.randn(3, 16, 96, device=ch.dev)
    for method, backend in (("cholqr2", "torch"), ("polar", "triton")):
        if ch.dry and backend == "triton":
            continue

        def orth(method=method, backend=backend):
            qm = orthogonalize(x, method, backend=backend)
            err = (qm @ qm.mT - torch.eye(16, device=ch.dev)).abs().max().item()
            return err <= 1e-5, f"max|QQ^T-I|={err:.1e}"
        ch.check(f"orthogonalize {method} [{backend}] (3, 16, 96)", orth)
    backends = ("cpp-cpu", "torch") if ch.dry else ("triton", "cuda")
    tiny = (1, 2, 1, 33, 33, 64, True)
    for backend in backends:
        for dtype in (torch.bfloat16, torch.float32):
            ch.check(f"attention {backend} {str(dtype)[6:]} {tiny} fwd/jvp/bwd", attention_case, ch.dev, backend,
                     dtype, tiny, 1)


def section_init(ch):
    import torch
    from condinit.init import conditioned_init_layers_, orthogonalize
    from condinit.ops.random.op import block_randn
    randn_backend = "cpp-cpu" if ch.dry else "cuda"

    def randn():
        ids = [0, 5, 123456789, 2**33 + 7]
        gpu = block_randn(1234, 7, ids, (64, 1000), device=ch.dev, backend=randn_backend).cpu()
        cpu = block_randn(1234, 7, ids, (64, 1000), device="cpu")
        return torch.equal(gpu, cpu), f"max|diff|={(gpu - cpu).abs().max().item():.2e}"
    ch.check(f"randn [{randn_backend}] == cpu bit for bit", randn)
    g = torch.Generator(device=ch.dev).manual_seed(0)
    shapes = [(64, 1, 1), (96, 64, 2048), (2, 17, 123), (2, 300, 40), (8, 128, 8192), (4, 256, 16384)]
    for shape in (shapes[:4] if ch.dry else shapes):
        x = torch.randn(shape, device=ch.dev, generator=g)
        for method, backend in (("householder", "torch"), ("cholqr2", "torch"), ("polar", "torch"),
                                ("polar", "triton"), ("svd", "torch")):
            if ch.dry and backend == "triton":
                continue

            def orth(x=x, method=method, backend=backend):
                q = orthogonalize(x, method=method, backend=backend)
                m, n = x.shape[-2:]
                gram = q @ q.mT if m <= n else q.mT @ q
                err = (gram - torch.eye(min(m, n), device=ch.dev)).abs().max().item()
                return err <= 1e-5, f"max|WW^T-I|={err:.1e}"
            ch.check(f"orthogonalize {method} [{backend}] {shape}", orth)

    def same_q():
        x = torch.randn(16, 64, 4096, device=ch.dev, generator=g)
        d = (orthogonalize(x, method="cholqr2") - orthogonalize(x, method="householder")).abs().max().item()
        return d <= 1e-5, f"max|diff|={d:.1e}"
    ch.check("cholqr2 Q == householder Q (sign-fixed)", same_q)

    def gpu_equals_cpu():
        L, D, H, Hkv, d = 3, 512, 8, 2, 64
        make = lambda device: [dict(q=torch.empty(H * d, D, device=device), k=torch.empty(Hkv * d, D, device=device),  # noqa: E731
                                    v=torch.empty(Hkv * d, D, device=device)) for _ in range(L)]
        cpu, gpu = make("cpu"), make(ch.dev)
        conditioned_init_layers_(cpu, num_heads=H, num_kv_heads=Hkv, seed=11)
        conditioned_init_layers_(gpu, num_heads=H, num_kv_heads=Hkv, seed=11)
        err = max((a[n] - b[n].cpu()).abs().max().item() for a, b in zip(cpu, gpu) for n in "qkv")
        return err <= 1e-5, f"max|diff|={err:.1e}"
    ch.check(f"conditioned_init_layers_ {ch.dev} == cpu", gpu_equals_cpu)

    try:
        import transformers
    except ImportError:
        ch.record(f"condinit init --device {ch.dev} == cpu", "SKIP", "transformers is not installed")
        return

    def streamed_write():
        # every tensor drawn on the device (pieces, layers, constructor values) and streamed to disk:
        # the own init bit for bit the CPU's, the conditioned Q/K/V within fp32 rounding
        from safetensors.torch import load_file
        from condinit.models.stream import write_pretrained
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096)
        with tempfile.TemporaryDirectory() as d:
            sds = []
            for device in (ch.dev, "cpu"):
                rep = write_pretrained(cfg, os.path.join(d, device), seed=5, device=device, max_shard_size="2MB")
                sd = {}
                for f in rep.files:
                    sd.update(load_file(f))
                sds.append(sd)
        dev, cpu = sds
        attn = [k for k in cpu if any(f".{p}_proj." in k for p in "qkv")]
        same = [k for k in cpu if k not in attn and not torch.equal(dev[k], cpu[k])]
        err = max((dev[k] - cpu[k]).abs().max().item() for k in attn)
        return not same and err <= 1e-5 and dev.keys() == cpu.keys(), \
            f"{len(cpu)} tensors, own init differs in {same[:3]}, Q/K/V max|diff|={err:.1e}"
    ch.check(f"condinit init --device {ch.dev} == cpu", streamed_write)


def section_attention(ch, backend):
    import torch
    os.environ["CONDINIT_ATTN_AUTOTUNE"] = "0"   # many shapes: each autotune config would compile
    cases = ATTENTION_CASES[:2] if ch.dry else ATTENTION_CASES
    # bf16 / fp16 first (what the GPU runs for speed), every case; fp32 on the first, small case only
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for case in (cases[:1] if (dtype == torch.float32 and backend == "triton") else cases):
            ch.check(f"{backend} {str(dtype)[6:]} {case} fwd/jvp(P=2)/bwd vs float64", attention_case, ch.dev,
                     backend, dtype, case)


def section_timing(ch, what, quick, autotune):
    """The ``condinit bench`` rows, backends forced; ceilings measured in the same process."""
    import torch
    from condinit import bench
    os.environ["CONDINIT_ATTN_AUTOTUNE"] = "1" if autotune else "0"
    cfg = bench.default_config(ch.dev, quick=quick or ch.dry)
    if ch.dry:
        cfg.init_shape = bench.InitShape(1, 512, 4, 2, 64)
        cfg.attention_shape = bench.AttentionShape(1, 2, 2, 64, 32)
        cfg.repeats, cfg.baseline_blocks = 1, 4
    if what == "init":
        cfg.sections, cfg.backend = ("ceilings", "init"), "torch"
        cfg.dtype = torch.float32 if ch.dry else torch.bfloat16
    else:
        cfg.sections = ("ceilings", "attention")
        cfg.backend = what
        if what == "cuda":   # the SDPA MATH baselines are the same as in the Triton section
            cfg.skip = ("math_jvp", "math_jvp_bwd")
    progress = lambda s: print(f"  ... {s}", flush=True)  # noqa: E731
    keep = lambda r: r.section != "ceilings" or what == "init"  # noqa: E731
    # each row is recorded as soon as it is measured (a timeout keeps it), and again with its rates
    rows = bench.run(cfg, progress, on_row=lambda r: ch.row(r) if keep(r) else None)
    for r in rows:
        if keep(r):
            ch.row(r)
    for r in rows:
        if not r.ok:
            ch.record(f"{r.name} [{r.backend}]", "ERROR", r.error)


def child_main(args):
    ch = Child(args.section, args.results, args.cpu_dry_run, args.quick, args.tag)
    fault = os.environ.get(FAULT_ENV, "")
    import torch
    import condinit
    from condinit import _ext
    print(f"section {args.section}: condinit from {os.path.dirname(condinit.__file__)}; native extension: "
          f"{_ext.status()[1]}; torch {torch.__version__}", flush=True)
    # fresh inputs on every GPU run (the seed is logged, to replay a failure); fixed in the dry run
    seed = os.environ.get(SEED_ENV) or (0 if ch.dry else int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(int(seed))
    print(f"section {args.section}: seed {seed} (replay with {SEED_ENV}={seed})", flush=True)
    if args.section == "tiny":
        section_tiny(ch)
    elif args.section == "init":
        section_init(ch)
    elif args.section.startswith("attention-"):
        backend = args.section.split("-", 1)[1]
        section_attention(ch, ("cpp-cpu" if backend == "triton" else "torch") if ch.dry else backend)
    elif args.section.startswith("timing-"):
        what = args.section.split("-", 1)[1]
        if what.startswith("attention-"):
            what = what.split("-", 1)[1]
            what = ("cpp-cpu" if what == "triton" else "torch") if ch.dry else what
        section_timing(ch, what, args.quick, args.autotune)
    else:
        raise SystemExit(f"unknown section {args.section!r}")
    faults = fault.split(",")
    if f"{args.section}:crash" in faults:
        os.abort()
    if f"{args.section}:hang" in faults:
        time.sleep(3600)
    return 0


# ============================================================================================= main

def _section_timeouts(text):
    out = {}
    for item in text.split(","):
        name, sep, value = item.rpartition("=")
        out[name.strip() if sep else "*"] = float(value)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out_dir = os.environ.get("OUT")
    parser.add_argument("--log", default=os.path.join(out_dir, "gpu_check.log") if out_dir else "gpu_check.log")
    parser.add_argument("--json", default=None, help="every record (default: the log's path with .json)")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--build-timeout", type=float, default=240.0)
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for the whole run")
    parser.add_argument("--section-timeout", type=_section_timeouts, default={},
                        help="cap section timeouts: SECONDS (every section) or NAME=SECONDS,NAME=SECONDS")
    parser.add_argument("--quick", action="store_true", help="smaller timing shapes")
    parser.add_argument("--autotune", action="store_true",
                        help="let the Triton attention kernels autotune for the timings (default: their "
                             "first config)")
    parser.add_argument("--sections", default=None,
                        help="comma-separated subset of " + ",".join(s for s, _, _ in SECTIONS))
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the script's logic on the CPU at toy sizes with the CPU backends (no build, "
                             "no sanitizer)")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        return child_main(args)
    if args.json is None:
        args.json = os.path.splitext(args.log)[0] + ".json"
    log = Log(args.log)
    return Parent(args, log).run()


if __name__ == "__main__":
    sys.exit(main())
