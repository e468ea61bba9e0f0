"""One script for a machine with one NVIDIA GPU: log the machine, build, warm, time, check, report.

    python benchmarks/gpu_check.py [--out DIR] [--skip-build] [--quick] [--budget 480] [--autotune]
    python benchmarks/gpu_check.py --cpu-dry-run      # the same logic on the CPU backends, toy sizes

Made so that one run cannot be lost (docs/design.md, "GPU checks"):

1. **environment** first, into ``DIR/environment.txt`` and the log: GPU, driver and ``nvidia-smi``,
   ``nvcc --version``, ``torch.version.cuda``, ``TORCH_CUDA_ARCH_LIST``, the triton version.
2. **build** (``pip install --no-index --no-build-isolation --no-deps -e .``, the visible GPU's arch
   only, offline, under a timeout); a failed build is retried without the native extension
   (``CONDINIT_NO_EXT=1``), so that the Triton and torch paths still run from the installed package.
   The sections import the installed package, never the source tree.
3. **sections**, in this order, each in its own processes with a guaranteed time (``SECTIONS``: the
   caps, with the environment, the build and the summary, sum to the default budget; time a
   section leaves unused goes to the ones after it): ``warm`` (the Triton kernels of every later
   section compiled in parallel, one host function per job, on every core), the timing sections
   (the ``condinit bench`` rows with the backend forced and autotuning off unless ``--autotune``),
   ``sanitize`` (compute-sanitizer memcheck on the CUDA kernels first and then Triton's, racecheck
   on the extension's kernels only, autotuning off), and the float64 checks of both GPU backends
   and of init.
4. Every check is restartable: it is recorded (one JSON line in ``DIR/gpu_check.jsonl``, flushed)
   the moment it finishes; a CUDA error is recorded with its check and ends the process with
   status ``CUDA_ERROR_EXIT`` (a sticky error poisons the whole context); a process that dies
   inside a check gets that check recorded as crashed; either way the section is relaunched and
   skips every check already recorded. A hang is cut at the section's timeout (the check it hung
   in is recorded) and the next section runs.
5. The summary, the failed checks and last the tables BENCHMARKS.md records (markdown, with the
   command, machine and date; also ``DIR/gpu_check_tables.md``). Exit status 0 when every check
   passed.

``DIR`` is ``--out``, else ``$OUT``, else ``gpu_check_out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import namedtuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)

# Seconds of the default budget, in the order they run. Each section's timeout is at least its cap
# (what is left after reserving the caps of the sections after it).
DEFAULT_BUDGET = 480.0
ENV_CAP, BUILD_CAP, SUMMARY_RESERVE = 10.0, 120.0, 5.0
SECTIONS = (
    ("warm", 35),
    ("timing-attention-triton", 65),
    ("timing-attention-cuda", 60),
    ("timing-init", 60),
    ("sanitize", 40),
    ("attention-cuda", 30),
    ("attention-triton", 35),
    ("init", 20),
)
SANITIZER_TOOLS = (("memcheck", 0.6), ("racecheck", 0.4))   # share of the sanitize section's time
RACECHECK_KERNELS = "attention_cuda"   # the namespace of the extension's attention kernels
CUDA_ERROR_EXIT = 86               # a child's status after a CUDA error: relaunch, skipping what is done
MAX_LAUNCHES = 4                   # per section (each relaunch must have made progress)
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
# Sticky CUDA errors: after one the context is lost and every later CUDA call fails.
STICKY = re.compile(r"illegal memory access|illegal instruction|misaligned address|unspecified launch failure|"
                    r"device-side assert|hardware stack error|AcceleratorError", re.I)
# Faults made on purpose (tests of the bookkeeping): "SECTION:KIND@N" with KIND crash (the process
# aborts in the N-th check), hang (sleeps in it) or cuda (it raises a sticky CUDA error), comma-separated.
FAULT_ENV = "CONDINIT_GPU_CHECK_FAULT"
SEED_ENV = "CONDINIT_GPU_CHECK_SEED"
DRY_BACKEND = {"triton": "cpp-cpu", "cuda": "torch"}   # what the CPU dry run runs in each GPU backend's place


# ============================================================================================ cases

Case = namedtuple("Case", "name B H Hkv Nq Nk d causal window q_lens kv_lens varlen",
                  defaults=(False, None, None, None, False))
# Float64-on-device checks, per backend and dtype (forward, JVP with 2 probes, the gradients of the
# forward and the gradients through the JVP's two outputs): every mask kind, then the shapes.
CASES = [
    Case("causal", 1, 2, 2, 64, 64, 64, True),
    Case("sliding window", 1, 4, 2, 300, 300, 64, True, (63, -1)),
    Case("key padding", 3, 4, 2, 130, 130, 64, kv_lens=[130, 77, 1]),
    Case("varlen causal", 3, 4, 2, 128, 128, 64, True, q_lens=[37, 128, 5], kv_lens=[37, 128, 5], varlen=True),
    Case("q and kv lengths causal", 3, 2, 1, 96, 160, 64, True, q_lens=[96, 33, 0], kv_lens=[160, 20, 70]),
    Case("window and padding", 2, 4, 4, 256, 256, 128, True, (31, -1), kv_lens=[256, 100]),
    Case("two-sided window", 2, 2, 2, 150, 200, 128, False, (40, 17)),
    Case("varlen cross", 2, 2, 2, 64, 96, 128, q_lens=[20, 64], kv_lens=[96, 50], varlen=True),
    Case("gqa ragged", 2, 4, 2, 17, 17, 16, True),
    Case("mqa d128", 1, 8, 1, 128, 128, 128, True),
    Case("Nq > Nk causal", 1, 2, 1, 200, 64, 64, True),
    Case("one query", 1, 2, 2, 1, 1, 64),
    Case("d80 ragged", 1, 4, 4, 333, 333, 80),
    Case("d96 gqa", 1, 8, 2, 129, 257, 96),
    Case("d256", 1, 2, 2, 64, 300, 256, True),
    Case("long", 1, 2, 2, 1000, 1000, 32, True),
]
DRY_CASES = ("causal", "sliding window", "key padding", "varlen causal", "q and kv lengths causal")
# bf16 on every case; fp16 and fp32 on some (fp32 Triton kernels compile slowly)
DTYPE_CASES = {
    "triton": {"bfloat16": None, "float16": ("causal", "key padding"), "float32": ("causal",)},
    "cuda": {"bfloat16": None, "float16": ("causal", "key padding", "d80 ragged", "varlen causal"),
             "float32": ("causal", "sliding window", "key padding", "varlen causal", "gqa ragged")},
}
# The orthogonalization checks of the init section (the dry run: the first four), and the tiny one.
INIT_SHAPES = [(64, 1, 1), (96, 64, 2048), (2, 17, 123), (2, 300, 40), (8, 128, 8192), (4, 256, 16384)]
TINY_ORTH = (3, 16, 96)
# Under compute-sanitizer: one tiny case with every mask kind.
TINY = Case("tiny", 2, 2, 1, 33, 40, 64, True, (7, -1), q_lens=[33, 20], kv_lens=[40, 21])


def attention_plan(backend, dry):
    """[(dtype name, Case)] of an attention section, in the order they run."""
    cases = [c for c in CASES if c.name in DRY_CASES] if dry else CASES
    plan = [(dt, c) for dt, names in DTYPE_CASES[backend].items() for c in cases if names is None or c.name in names]
    # the dry run: every mask in bf16, one case in each other dtype
    return [(dt, c) for dt, c in plan if not dry or dt == "bfloat16" or c.name == cases[0].name]


def case_label(backend, dtype, case, probes=2):
    mask = ", ".join(x for x in ("causal" if case.causal else "", f"window {case.window}" if case.window else "",
                                 f"q_lens {case.q_lens}" if case.q_lens and not case.varlen else "",
                                 f"kv_lens {case.kv_lens}" if case.kv_lens and not case.varlen else "",
                                 f"varlen q {case.q_lens} k {case.kv_lens}" if case.varlen else "") if x)
    shape = f"B={case.B} H={case.H}/{case.Hkv} Nq={case.Nq} Nk={case.Nk} d={case.d}"
    return f"{backend} {dtype} {case.name} ({shape}{'; ' + mask if mask else ''}) fwd, jvp(P={probes}), grads"


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
    group, killed as a group at the timeout (compute-sanitizer and pip start children); the read
    after the kill is bounded too."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        return proc.returncode, out
    except subprocess.TimeoutExpired as exc:
        kill_group(proc)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:   # a grandchild keeps the pipe open: give up on its output
            out = (exc.output or b"").decode(errors="replace") if isinstance(exc.output, bytes) else (exc.output or "")
        return None, out


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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


def section_caps(budget, wanted):
    """{name: guaranteed seconds} of the wanted sections and the build's, scaled down together
    when ``budget`` is below the default."""
    fixed = ENV_CAP + SUMMARY_RESERVE
    total = BUILD_CAP + sum(cap for name, cap in SECTIONS if name in wanted)
    scale = min(1.0, max(0.0, budget - fixed) / total)
    caps = {name: cap * scale for name, cap in SECTIONS if name in wanted}
    caps["build"] = BUILD_CAP * scale
    return caps


def section_timeout(left, later_caps):
    """A section's timeout: what the budget has left, less the summary's time and the caps of the
    sections after it (so each gets at least its cap, and whatever earlier ones left unused)."""
    return left - SUMMARY_RESERVE - later_caps


class Parent:
    def __init__(self, args, log):
        self.args, self.log = args, log
        self.t0 = time.monotonic()
        self.results = os.path.join(args.out, "gpu_check.jsonl")
        open(self.results, "w").close()
        self.python = sys.executable
        self.pythonpath = None   # set when condinit is not installed (children then import this tree)
        self.env_info = {}
        self.wanted = args.sections.split(",") if args.sections else [s for s, _ in SECTIONS]
        self.caps = section_caps(args.budget, self.wanted)

    def left(self):
        return self.args.budget - (time.monotonic() - self.t0)

    def emit(self, rec):
        with open(self.results, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def record(self, section, name, status, detail="", seconds=0.0):
        self.emit({"section": section, "name": name, "status": status, "detail": detail, "seconds": seconds})
        self.log(f"[{status}] {section}: {name} {detail}")

    def env(self, **extra):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath + os.pathsep + os.environ.get("PYTHONPATH", "")
        if not self.args.cpu_dry_run:
            env.pop("TRITON_INTERPRET", None)   # the real kernels, not the interpreter
        return env

    # ---- environment
    def environment(self):
        """Everything a failed build or run needs to be understood, written before anything runs."""
        lines = [f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", f"host: {platform.node()}",
                 f"platform: {platform.platform()}", f"python: {sys.version.split()[0]} ({sys.executable})",
                 f"cpu cores: {os.cpu_count()}"]
        for var in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "TRITON_CACHE_DIR"):
            lines.append(f"{var}: {os.environ.get(var, '(unset)')}")
        smi = shutil.which("nvidia-smi")
        nvcc = next((p for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                                 shutil.which("nvcc")) if p and os.path.isfile(p)), None)
        commands = [("nvidia-smi --query-gpu", [smi, "--query-gpu=name,driver_version,memory.total,compute_cap",
                                                 "--format=csv,noheader"] if smi else None),
                    ("nvcc --version", [nvcc, "--version"] if nvcc else None),
                    ("nvidia-smi", [smi] if smi else None)]
        for label, cmd in commands:
            if cmd is None:
                lines.append(f"{label}: not found")
                continue
            rc, out = run_limited(cmd, 5)
            lines.append(f"$ {' '.join(cmd)}" + ("  (timed out)" if rc is None else f"  (exit {rc})"))
            lines += out.rstrip().splitlines()
            if label == "nvidia-smi --query-gpu" and rc == 0 and out.strip():
                self.env_info["nvidia-smi"] = out.strip().splitlines()[0]
            if label == "nvcc --version" and rc == 0:
                self.env_info["nvcc"] = next((ln.strip() for ln in out.splitlines() if "release" in ln), "?")
        path = os.path.join(self.args.out, "environment.txt")
        with open(path, "w") as f:   # written before torch is imported (in case that fails), then again
            f.write("\n".join(lines) + "\n")
        try:
            from importlib.metadata import version
            triton_version = version("triton")
        except Exception as exc:
            triton_version = f"not installed ({type(exc).__name__})"
        import torch
        self.env_info.update(torch=torch.__version__, cuda=torch.version.cuda, triton=triton_version)
        lines += [f"torch: {torch.__version__} (torch.version.cuda {torch.version.cuda}, cudnn "
                  f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None})",
                  f"triton: {triton_version}"]
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            self.env_info["gpu"] = (f"{props.name} (sm_{props.major}{props.minor}, "
                                    f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)")
            lines.append(f"torch sees {torch.cuda.device_count()} GPU(s); device 0: {self.env_info['gpu']}")
        else:
            lines.append("torch sees no CUDA GPU")
        nvcc_release = re.search(r"release (\d+)\.", self.env_info.get("nvcc", ""))
        if nvcc_release and torch.version.cuda and nvcc_release.group(1) != torch.version.cuda.split(".")[0]:
            lines.append(f"note: nvcc is CUDA {nvcc_release.group(1)}, torch was built with CUDA {torch.version.cuda}: "
                         "the extension build is likely to fail (then retried without it)")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        for ln in lines:
            self.log(ln)

    # ---- build
    def pip_install(self, timeout, **extra):
        env = self.env(PIP_NO_INDEX="1", **extra)
        pip = ["-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-deps", "-e", ROOT]
        shown = " ".join(f"{k}={v}" for k, v in extra.items())
        self.log(f"$ {shown} python {' '.join(pip)}  (timeout {timeout:.0f} s)")
        t0 = time.monotonic()
        rc, out = run_limited([self.python, *pip], timeout, env)
        if rc not in (0, None) and "externally-managed-environment" in out:
            venv = os.path.join(tempfile.gettempdir(), "condinit-gpu-check-venv")
            self.log(f"the system Python refuses installs: venv with system site packages at {venv}")
            rc_v, out_v = run_limited([sys.executable, "-m", "venv", "--system-site-packages", venv],
                                      timeout - (time.monotonic() - t0), env)
            if rc_v == 0:
                self.python = os.path.join(venv, "bin", "python")
                rc, out = run_limited([self.python, *pip], timeout - (time.monotonic() - t0), env)
            else:
                out += "\n" + out_v
        self.log(out[-15000:])
        return rc, time.monotonic() - t0

    def build(self, timeout):
        import torch
        major, minor = torch.cuda.get_device_capability(0)
        t_end = time.monotonic() + timeout
        rc, seconds = self.pip_install(timeout - 15, CONDINIT_STRICT_BUILD="1", MAX_JOBS=str(os.cpu_count() or 8),
                                       TORCH_CUDA_ARCH_LIST=f"{major}.{minor}",
                                       CUDA_HOME=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
        what = "pip install -e . with the CUDA extension"
        if rc == 0:
            self.record("build", what, "PASS", f"{seconds:.0f} s", seconds)
            return
        self.record("build", what, "ERROR" if rc is None else "FAIL",
                    f"timed out after {seconds:.0f} s" if rc is None else f"exit {rc} after {seconds:.0f} s", seconds)
        rc, seconds = self.pip_install(max(5.0, t_end - time.monotonic()), CONDINIT_NO_EXT="1")
        self.record("build", "pip install -e . without the native extension (Triton and torch only)",
                    "PASS" if rc == 0 else "ERROR", f"{seconds:.0f} s" if rc is not None else "timed out", seconds)

    def import_origin(self):
        """Where the sections' ``import condinit`` comes from (run outside the tree, as they are)."""
        code = ("import condinit, condinit._ext as e; print(condinit.__file__); print(e.status()[1]); "
                "import condinit.kernels")
        rc, out = run_limited([self.python, "-c", code], 60, self.env(), cwd=tempfile.gettempdir())
        if rc != 0 and "No module named 'condinit'" in out:
            self.pythonpath = ROOT
            self.log(f"condinit is not installed: the sections import {ROOT} (condinit.kernels exists only "
                     "in an installed package: the Triton rows will fail)")
            rc, out = run_limited([self.python, "-c", code], 60, self.env(), cwd=tempfile.gettempdir())
        self.log(f"sections import: {out.strip()}" + ("" if rc == 0 else f" (exit {rc})"))

    # ---- one section: launches until it is done, relaunched after a CUDA error or a crash
    def launches(self, label, cmd, timeout, env):
        """Run ``cmd`` (a child recording under ``label``) until it exits 0, relaunching it after a
        CUDA error or a crash when it made progress; all launches within ``timeout``. Returns the
        launches' (status, output)."""
        deadline = time.monotonic() + timeout
        runs = []
        count = lambda: sum(r.get("section") == label and r.get("kind") in (None, "row")  # noqa: E731
                            for r in read_records(self.results))
        while True:
            before = count()   # the records this launch adds are its progress
            t0 = time.monotonic()
            rc, out = run_limited(cmd, deadline - t0, env)
            seconds = time.monotonic() - t0
            runs.append((rc, out))
            self.log(out.rstrip()[-20000:])
            recs = [r for r in read_records(self.results) if r.get("section") == label]
            finished = {r["name"] for r in recs if r.get("kind") is None and r["status"] != "INFO"}
            dangling = [r["name"] for r in recs if r.get("kind") == "start" and r["name"] not in finished]
            made_progress = count() > before or bool(dangling)
            if rc is None:
                for name in dangling:
                    self.record(label, name, "ERROR", f"timed out in this check (the section's {timeout:.0f} s)")
                self.record(label, "section", "ERROR", f"timed out after {seconds:.0f} s; last output: {tail(out)}",
                            seconds)
                return runs
            if rc == 0:
                self.log(f"    (section {label}: launch {len(runs)} done in {seconds:.0f} s)")
                return runs
            for name in dangling:
                self.record(label, name, "ERROR", f"the process died in this check (exit status {rc}); last output: "
                            f"{tail(out)}")
            if rc != CUDA_ERROR_EXIT and not dangling:
                self.record(label, f"launch {len(runs)}", "ERROR", f"exit status {rc} after {seconds:.0f} s outside "
                            f"any check; last output: {tail(out)}", seconds)
            if not made_progress or len(runs) >= MAX_LAUNCHES or deadline - time.monotonic() < 5:
                why = ("no progress" if not made_progress else f"{len(runs)} launches" if len(runs) >= MAX_LAUNCHES
                       else "no time left")
                self.record(label, "section", "ERROR", f"exit status {rc}; not relaunched ({why})", seconds)
                return runs
            self.record(label, f"relaunch {len(runs)}", "INFO", f"exit status {rc} "
                        f"({'CUDA error' if rc == CUDA_ERROR_EXIT else 'crash'}): relaunched, skipping the "
                        f"{len(finished) + len(dangling)} checks done")

    def child_cmd(self, section, *extra):
        return ([self.python, SCRIPT, "--section", section, "--results", self.results] + list(extra)
                + ["--cpu-dry-run"] * self.args.cpu_dry_run + ["--quick"] * self.args.quick
                + ["--autotune"] * self.args.autotune)

    def section(self, name, timeout):
        self.log(f"--- section {name} (timeout {timeout:.0f} s, {self.left():.0f} s of the budget left)")
        if name == "warm":
            return self.warm(timeout)
        if name == "sanitize":
            return self.sanitize(timeout)
        self.launches(name, self.child_cmd(name), timeout, self.env())

    def warm(self, timeout):
        """The Triton kernels of every later section, compiled in parallel processes (one job per
        host function and specialization) into Triton's cache; cut at the timeout."""
        n = 2 if self.args.cpu_dry_run else max(1, min(16, os.cpu_count() or 1))
        t0 = time.monotonic()
        env = self.env(CONDINIT_ATTN_AUTOTUNE="0")
        procs = [subprocess.Popen(self.child_cmd("warm", "--worker", f"{i}/{n}"), cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                  start_new_session=True) for i in range(n)]
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                kill_group(p)
                try:
                    out, _ = p.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    out = ""
            outs.append(out)
        text = "\n".join(outs)
        self.log(text.rstrip()[-8000:])
        done = text.count("[warm] done")
        failed = [ln for ln in text.splitlines() if ln.startswith("[warm] error")]
        total = next((int(m.group(1)) for m in re.finditer(r"\[warm\] jobs (\d+)", text)), 0)
        self.record("warm", "Triton kernels compiled", "INFO",
                    f"{done} of {total} jobs in {time.monotonic() - t0:.0f} s on {n} processes"
                    + (f"; {len(failed)} raised (the checks record why): {failed[0][:200]}" if failed else ""),
                    time.monotonic() - t0)

    def sanitize(self, timeout):
        tool = self.args.sanitizer or (None if self.args.cpu_dry_run else shutil.which("compute-sanitizer") or next(
            (p for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer"),
                         "/usr/local/cuda/bin/compute-sanitizer") if os.path.isfile(p)), None))
        env = self.env(CONDINIT_ATTN_AUTOTUNE="0")
        if tool is None:
            self.record("sanitize", "compute-sanitizer", "SKIP", "CPU dry run" if self.args.cpu_dry_run
                        else "compute-sanitizer not found")
            self.log("--- the tiny shapes without compute-sanitizer")
            self.launches("tiny", self.child_cmd("tiny"), timeout, env)
            return
        _, help_text = run_limited([tool, "--help"], 10)
        kernel_filter = next((opt for opt in ("--kernel-name", "--kernel-regex") if opt in help_text), None)
        for tool_name, share in SANITIZER_TOOLS:
            cap = timeout * share
            only = "all" if tool_name == "memcheck" else "cuda"
            cmd = [tool, "--tool", tool_name, "--error-exitcode", "97", "--target-processes", "all"]
            note = "CUDA kernels, then Triton's" if only == "all" else "the extension's kernels"
            if tool_name == "racecheck":
                if kernel_filter:
                    cmd += [kernel_filter, f"kns={RACECHECK_KERNELS}"]
                else:
                    note += " (this compute-sanitizer has no kernel filter: every kernel checked)"
            self.log(f"--- sanitize: {tool_name} on tiny shapes, {note} (timeout {cap:.0f} s)")
            label = f"tiny-{tool_name}"
            runs = self.launches(label, cmd + self.child_cmd("tiny", "--tag", tool_name, "--only", only), cap, env)
            summary = " | ".join(ln.strip("= ").strip() for _, out in runs for ln in out.splitlines()
                                 if "SUMMARY" in ln)
            errors = any(rc not in (0, CUDA_ERROR_EXIT) for rc, _ in runs) or bool(
                re.search(r"ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9]", summary))
            status = "ERROR" if runs[-1][0] is None else ("FAIL" if errors else "PASS")
            self.record("sanitize", f"compute-sanitizer {tool_name} ({note})", status,
                        (summary or "no summary") + f" (exit status {', '.join(str(rc) for rc, _ in runs)})")

    def run(self):
        args = self.args
        self.log(f"condinit gpu_check; budget {args.budget:.0f} s; output in {args.out}")
        self.environment()
        import torch
        if not args.cpu_dry_run and not torch.cuda.is_available():
            self.log("no CUDA GPU visible: nothing to check")
            return 1
        if not args.skip_build and not args.cpu_dry_run:
            self.build(section_timeout(self.left(), sum(c for n, c in self.caps.items() if n != "build")))
        self.import_origin()
        order = [name for name, _ in SECTIONS if name in self.wanted]
        for i, name in enumerate(order):
            timeout = section_timeout(self.left(), sum(self.caps[n] for n in order[i + 1:]))
            timeout = min(timeout, args.section_timeout.get(name, args.section_timeout.get("*", timeout)))
            if timeout < 5:
                self.record(name, "section", "SKIP", f"budget spent ({self.left():.0f} s left)")
                continue
            self.section(name, timeout)
            self.write_tables()
        return self.summary()

    # ---- summary
    def folded(self):
        """(checks, timing rows) recorded so far, each once."""
        checks, rows = {}, {}
        for r in read_records(self.results):
            if r.get("kind") == "row":
                rows[(r["section"], r["row"]["key"])] = r   # emitted when measured and again with its rates
            elif r.get("kind") is None:
                checks[(r["section"], r["name"])] = r       # a relaunch never repeats a check: the last one
        return list(checks.values()), list(rows.values())

    def write_tables(self):
        """DIR/gpu_check_tables.md from what is recorded so far (rewritten after every section)."""
        tables = self.tables(*self.folded(), time.monotonic() - self.t0)
        with open(os.path.join(self.args.out, "gpu_check_tables.md"), "w") as f:
            f.write(tables + "\n")
        return tables

    def summary(self):
        log, args = self.log, self.args
        checks, rows = self.folded()
        failed = [r for r in checks if r["status"] in ("FAIL", "ERROR")]
        count = lambda s: sum(r["status"] == s for r in checks)  # noqa: E731
        used = time.monotonic() - self.t0
        log("")
        log(f"=== condinit gpu_check summary ({self.machine()}, {used:.0f} s of a {args.budget:.0f} s budget) ===")
        log(f"checks: {count('PASS')} passed, {len(failed)} failed, {count('SKIP')} skipped")
        for r in failed:
            log(f"  {r['status']} {r['section']}: {r['name']} {r['detail']}")
        with open(args.json, "w") as f:
            json.dump({"machine": self.machine(), "environment": self.env_info, "checks": checks,
                       "rows": rows}, f, indent=1, default=str)
        tables = self.write_tables()
        log(f"log: {self.log.path}; records: {self.results}, {args.json}; tables: "
            f"{os.path.join(args.out, 'gpu_check_tables.md')}")
        log("")
        log(tables)
        return 0 if not failed else 1

    def machine(self):
        if self.args.cpu_dry_run:
            return f"CPU dry run on {platform.node()}"
        return self.env_info.get("gpu", "?")

    def tables(self, checks, rows, used):
        info = self.env_info
        cmd = "python benchmarks/gpu_check.py " + " ".join(self.args.argv)
        lines = [f"Command: `{cmd.strip()}` ({used:.0f} s of a {self.args.budget:.0f} s budget). "
                 f"Machine: {self.machine()}; nvidia-smi: {info.get('nvidia-smi', 'n/a')}; "
                 f"{info.get('nvcc', 'nvcc n/a')}; torch {info.get('torch')} (CUDA {info.get('cuda')}), "
                 f"triton {info.get('triton')}; {os.cpu_count()} CPU cores. "
                 f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
        if rows:
            lines += ["Timing (median; FLOPs: attention fwd 4BHN^2d halved causal, bwd 2.5x, jvp 3x, tangent bwd "
                      "7.5x; % of the ceiling measured in the same section):", "",
                      "| section | what | backend | time [ms] | rate (% of ceiling) | time / other row's | note |",
                      "|---|---|---|---:|---|---|---|"]
            for rec in rows:
                section, r = rec["section"], rec["row"]
                if r.get("error"):
                    lines.append(f"| {section} | {cell(r['name'])} | {r['backend']} | - | | | "
                                 f"ERROR {cell(r['error'])} |")
                    continue
                ratios = ", ".join(f"{v:.3g}x {k.split('.', 1)[1]}" for k, v in (r.get("ratios") or {}).items())
                note = "; ".join(x for x in (r.get("note"), f"aim {r['aim']}" if r.get("aim") else "",
                                            f"peak {r['peak_bytes'] / 2**20:.0f} MiB" if r.get("peak_bytes") is not None
                                            else "") if x)
                lines.append(f"| {section} | {cell(r['name'])} | {r['backend']} | {r['seconds'] * 1e3:.2f} | "
                             f"{fmt_rate(r)} | {ratios} | {cell(note)} |")
            lines.append("")
        lines += ["| section | passed | failed | skipped | seconds |", "|---|---:|---:|---:|---:|"]
        for section in dict.fromkeys(r["section"] for r in checks):
            mine = [r for r in checks if r["section"] == section]
            lines.append(f"| {section} | {sum(r['status'] == 'PASS' for r in mine)} | "
                         f"{sum(r['status'] in ('FAIL', 'ERROR') for r in mine)} | "
                         f"{sum(r['status'] == 'SKIP' for r in mine)} | "
                         f"{sum(r.get('seconds') or 0 for r in mine):.0f} |")
        return "\n".join(lines)


def cell(text):
    return str(text).replace("|", "\\|")


def fmt_rate(r):
    if r.get("rate") is None:
        return ""
    rate = r["rate"]
    if r.get("rate_unit") == "FLOP/s":
        text = f"{rate / 1e12:.2f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
    else:
        text = f"{rate / 1e9:.1f} GB/s"
    return text + (f" ({100 * r['of_ceiling']:.0f}%)" if r.get("of_ceiling") is not None else "")


# ============================================================================================= child

class Child:
    """One launch of a section: each check guarded and recorded as one JSON line at once; checks
    an earlier launch recorded are skipped; a CUDA error ends the launch with CUDA_ERROR_EXIT."""

    def __init__(self, label, results, dry):
        self.label, self.dry = label, dry
        self.dev = "cpu" if dry else "cuda"
        previous = [r for r in read_records(results) if r.get("section") == label]
        self.done = {r["name"] for r in previous if r.get("kind") is None and r["status"] != "INFO"}
        self.done_rows = {r["row"]["key"]: r["row"] for r in previous if r.get("kind") == "row"}
        self.results = open(results, "a")
        self.index = 0
        self.faults = {}
        for item in os.environ.get(FAULT_ENV, "").split(","):
            section, _, rest = item.partition(":")
            kind, _, n = rest.partition("@")
            if section == label and n.isdigit():
                self.faults[int(n)] = kind
        if self.done:
            print(f"{label}: relaunched; skipping {len(self.done)} checks done", flush=True)

    def emit(self, rec):
        self.results.write(json.dumps(rec, default=str) + "\n")
        self.results.flush()
        os.fsync(self.results.fileno())

    def record(self, name, status, detail="", seconds=0.0):
        self.emit({"section": self.label, "name": name, "status": status, "detail": detail, "seconds": seconds})
        print(f"[{status}] {self.label}: {name} {detail}", flush=True)

    def cuda_lost(self, error):
        """After a sticky CUDA error: this launch ends (the parent relaunches the section)."""
        print(f"{self.label}: CUDA error ({error}); ending this launch with status {CUDA_ERROR_EXIT}", flush=True)
        self.results.close()
        os._exit(CUDA_ERROR_EXIT)

    def check(self, name, fn, *args):
        """Run ``fn(*args) -> (ok, detail)``; an exception is an ERROR with its message."""
        self.index += 1
        if name in self.done:
            return
        self.emit({"section": self.label, "name": name, "kind": "start"})
        fault = self.faults.get(self.index)
        t0 = time.perf_counter()
        sticky = False
        try:
            if fault == "crash":
                os.abort()
            if fault == "hang":
                time.sleep(3600)
            if fault == "cuda":
                raise RuntimeError(f"CUDA error: an illegal memory access was encountered (made by {FAULT_ENV})")
            ok, detail = fn(*args)
            if not self.dry:
                import torch
                torch.cuda.synchronize()   # an asynchronous kernel error belongs to this check
            status = "PASS" if ok else "FAIL"
        except Exception as exc:
            status, detail = "ERROR", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            sticky = bool(STICKY.search(f"{type(exc).__name__}: {exc}"))
            traceback.print_exc()
        self.record(name, status, detail, time.perf_counter() - t0)
        if sticky:
            self.cuda_lost(detail)

    def row(self, row):
        import dataclasses
        self.emit({"section": self.label, "kind": "row", "row": dataclasses.asdict(row)})
        print(f"[ROW] {self.label}: {row.name} [{row.backend}] "
              + (f"{row.seconds * 1e3:.2f} ms" if row.ok else f"ERROR {row.error}"), flush=True)
        if not row.ok and STICKY.search(row.error):
            self.cuda_lost(row.error)


def rel_err(x, ref, floor=1e-30):
    """max |x - ref| / max |ref|; ``floor`` bounds the denominator from below (a gradient that is
    exactly zero, e.g. dq when each row sees one key, would otherwise divide rounding noise by 0)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(floor)).item() if ref.numel() else 0.0


def dense_mask(case, dev):
    """``[B, 1, Nq, Nk]`` bool: query i sees key j (the semantics of condinit.attention's docstring)."""
    import torch
    B, Nq, Nk = case.B, case.Nq, case.Nk
    Lq = torch.tensor(case.q_lens or [Nq] * B, device=dev)[:, None, None]
    Lk = torch.tensor(case.kv_lens or [Nk] * B, device=dev)[:, None, None]
    i = torch.arange(Nq, device=dev)[None, :, None]
    j = torch.arange(Nk, device=dev)[None, None, :]
    off = Lk - Lq
    m = (i < Lq) & (j < Lk)
    if case.causal:
        m &= j <= i + off
    if case.window is not None:
        left, right = case.window
        if left >= 0:
            m &= j >= i + off - left
        if right >= 0:
            m &= j <= i + off + right
    return m[:, None]


def naive_attention(q, k, v, mask, scale):
    """Dense float64 attention ``[B, H, N, d]`` under a bool ``mask``; rows that see no key give 0."""
    import torch
    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = (scale * q @ k.mT).masked_fill(~mask, torch.finfo(q.dtype).min)
    # a finite fill keeps rows that see no key NaN-free (also in their gradients); zero them after
    return (torch.softmax(s, dim=-1) * mask.any(-1, keepdim=True)) @ v


def pad_packed(x, lens, n):
    """Packed ``[T, heads, d]`` -> ``[S, heads, n, d]`` (zeros past each length)."""
    import torch
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    seqs = [x[a:b].transpose(0, 1) for a, b in zip(starts, starts[1:])]
    return torch.stack([torch.nn.functional.pad(s, (0, 0, 0, n - s.shape[1])) for s in seqs])


def unpad(y, lens):
    import torch
    return torch.cat([y[s, :, :length].transpose(0, 1) for s, length in enumerate(lens)])


def make_inputs(case, dev, probes, dtype=None):
    """Float64 (or ``dtype``) q, k, v and ``[P, ...]`` tangents of ``case`` (packed for varlen)."""
    import torch
    dtype = dtype or torch.float64
    if case.varlen:
        shapes = [(sum(case.q_lens), case.H, case.d), (sum(case.kv_lens), case.Hkv, case.d)]
    else:
        shapes = [(case.B, case.H, case.Nq, case.d), (case.B, case.Hkv, case.Nk, case.d)]
    q, k, v = (torch.randn(s, device=dev, dtype=torch.float64).to(dtype) for s in (shapes[0], shapes[1], shapes[1]))
    tq, tk, tv = (torch.randn(probes, *t.shape, device=dev, dtype=torch.float64).to(dtype) for t in (q, k, v))
    return q, k, v, tq, tk, tv


def condinit_fns(case, backend):
    """condinit's (attention, attention_jvp) for ``case`` on ``backend`` (forced)."""
    import condinit
    kw = dict(causal=case.causal, window=case.window, scale=case.d ** -0.5, backend=backend)
    if case.varlen:
        import torch
        cu = lambda lens: torch.tensor([0] + list(__import__("itertools").accumulate(lens)))  # noqa: E731
        vk = dict(cu_seqlens_q=cu(case.q_lens), cu_seqlens_k=cu(case.kv_lens), max_seqlen_q=case.Nq,
                  max_seqlen_k=case.Nk)
        attn = lambda q, k, v: condinit.attention_varlen(q, k, v, vk["cu_seqlens_q"], vk["cu_seqlens_k"],  # noqa: E731
                                                         case.Nq, case.Nk, **kw)
        jvp = lambda *x: condinit.attention_jvp_varlen(*x, **vk, **kw)  # noqa: E731
        return attn, jvp
    lens = dict(q_lens=case.q_lens, kv_lens=case.kv_lens)
    return (lambda q, k, v: condinit.attention(q, k, v, **lens, **kw),
            lambda *x: condinit.attention_jvp(*x, **lens, **kw))


def reference_fn(case, dev):
    """Float64 attention of ``case`` (packed in and out for varlen), independent of condinit."""
    mask = dense_mask(case, dev)
    scale = case.d ** -0.5
    if not case.varlen:
        return lambda q, k, v: naive_attention(q, k, v, mask, scale)

    def f(q, k, v):
        out = naive_attention(pad_packed(q, case.q_lens, case.Nq), pad_packed(k, case.kv_lens, case.Nk),
                              pad_packed(v, case.kv_lens, case.Nk), mask, scale)
        return unpad(out, case.q_lens)
    return f


def attention_case(dev, backend, dtype, case, probes=2):
    """(ok, detail): ``condinit`` on ``backend`` (forced) against float64 references computed on the
    same device: the forward and the ``probes``-probe JVP (out, tout), the forward's gradients
    (the flash backward: grad) and the gradients of a loss on both JVP outputs with respect to all
    six inputs (the tangent backward: tgrad)."""
    import torch
    q, k, v, tq, tk, tv = make_inputs(case, dev, probes)
    f = reference_fn(case, dev)

    def with_tangents(q, k, v, tq, tk, tv):
        return f(q, k, v), torch.stack([torch.func.jvp(f, (q, k, v), (tq[p], tk[p], tv[p]))[1]
                                        for p in range(probes)])
    (ref_out, ref_t), ref_tvjp = torch.func.vjp(with_tangents, q, k, v, tq, tk, tv)
    gout, gtout = torch.randn_like(ref_out), torch.randn_like(ref_t)
    ref_tgrads = ref_tvjp((gout, gtout))
    _, ref_vjp = torch.func.vjp(f, q, k, v)
    ref_grads = ref_vjp(gout)

    c = lambda t: t.to(dtype).contiguous()  # noqa: E731
    attn, jvp = condinit_fns(case, backend)
    leaves = [c(t).requires_grad_() for t in (q, k, v, tq, tk, tv)]
    out, tout = jvp(*leaves)
    tgrads = torch.autograd.grad((out, tout), leaves, (c(gout), c(gtout)))
    leaves3 = [c(t).requires_grad_() for t in (q, k, v)]
    o2 = attn(*leaves3)
    grads = torch.autograd.grad(o2, leaves3, c(gout))
    if any(bool(torch.isnan(t).any()) for t in (out, tout, o2, *grads, *tgrads)):
        return False, "NaN in an output"
    err = {"out": max(rel_err(out, ref_out), rel_err(o2, ref_out)), "tout": rel_err(tout, ref_t),
           # inputs are unit Gaussians, so gradients are O(1): floor the denominator at 1
           "grad": max(rel_err(a, b, floor=1.0) for a, b in zip(grads, ref_grads)),
           "tgrad": max(rel_err(a, b, floor=1.0) for a, b in zip(tgrads, ref_tgrads))}
    tol = TOL[str(dtype).split(".")[1]]
    return all(e <= tol for e in err.values()), " ".join(f"{k}={e:.1e}" for k, e in err.items()) + f" (tol {tol:.0e})"


def gpu_backend(backend, dry):
    return DRY_BACKEND[backend] if dry else backend


def section_tiny(ch, only):
    """Tiny shapes of every GPU kernel, the CUDA extension's first (under compute-sanitizer:
    memory errors and races)."""
    import torch
    from condinit.init import orthogonalize
    from condinit.ops.random.op import block_randn
    if only in ("all", "cuda"):
        for dtype in (torch.bfloat16, torch.float32):
            backend = gpu_backend("cuda", ch.dry)
            ch.check(case_label(backend, str(dtype)[6:], TINY, 1), attention_case, ch.dev, backend, dtype, TINY, 1)
        randn_backend = "cpp-cpu" if ch.dry else "cuda"

        def randn():
            a = block_randn(7, 3, [0, 2**33 + 1], (5, 37), device=ch.dev, backend=randn_backend).cpu()
            b = block_randn(7, 3, [0, 2**33 + 1], (5, 37), device="cpu", backend="torch")
            return torch.equal(a, b), f"{randn_backend} == torch reference bit for bit"
        ch.check(f"randn {randn_backend} (2, 5, 37)", randn)
    if only in ("all", "triton"):
        for dtype in (torch.bfloat16, torch.float32):
            backend = gpu_backend("triton", ch.dry)
            ch.check(case_label(backend, str(dtype)[6:], TINY, 1), attention_case, ch.dev, backend, dtype, TINY, 1)
        if not ch.dry:
            x = torch.randn(TINY_ORTH, device=ch.dev)

            def orth():
                qm = orthogonalize(x, "polar", backend="triton")
                err = (qm @ qm.mT - torch.eye(TINY_ORTH[1], device=ch.dev)).abs().max().item()
                return err <= 1e-5, f"max|QQ^T-I|={err:.1e}"
            ch.check(f"orthogonalize polar [triton] {TINY_ORTH}", orth)


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
    for shape in (INIT_SHAPES[:4] if ch.dry else INIT_SHAPES):
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
    name = gpu_backend(backend, ch.dry)
    for dt, case in attention_plan(backend, ch.dry):
        ch.check(case_label(name, dt, case), attention_case, ch.dev, name, getattr(torch, dt), case)


def timing_config(dev, what, quick, dry):
    import torch
    from condinit import bench
    cfg = bench.default_config(dev, quick=quick or dry)
    if dry:
        cfg.init_shape = bench.InitShape(1, 512, 4, 2, 64)
        cfg.attention_shape = bench.AttentionShape(1, 2, 2, 64, 32)
        cfg.repeats, cfg.baseline_blocks = 1, 4
    if what == "init":
        cfg.sections, cfg.backend = ("ceilings", "init"), "torch"
        cfg.dtype = torch.float32 if dry else torch.bfloat16
    else:
        cfg.sections = ("ceilings", "attention")
        cfg.backend = what
        if what in ("cuda", DRY_BACKEND["cuda"]):   # the SDPA MATH baselines are the same as in the Triton section
            cfg.skip = ("math_jvp", "math_jvp_bwd")
    return cfg


def reusing_rows(done_rows):
    """``condinit.bench``'s rows measured by an earlier launch of this section are returned as they
    were instead of measured again (the launch after a CUDA error skips them and the row that
    failed)."""
    from condinit.bench import measure
    measure_row = measure.Section.measure

    def measure_or_reuse(sec, key, name, *args, **kwargs):
        row = done_rows.get(f"{sec.name}.{key}")
        if row is None:
            return measure_row(sec, key, name, *args, **kwargs)
        print(f"  ... {sec.name}: {name} (measured by an earlier launch)", flush=True)
        return sec.add(measure.Row(**{k: v for k, v in row.items() if k in measure.Row.__dataclass_fields__}))
    measure.Section.measure = measure_or_reuse


def section_timing(ch, what, quick):
    """The ``condinit bench`` rows, backends forced; ceilings measured in the same process."""
    from condinit import bench
    cfg = timing_config(ch.dev, what, quick, ch.dry)
    if ch.done_rows:
        reusing_rows(ch.done_rows)
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


def warm_jobs(dry, quick):
    """Jobs of the warm section: (label, op, Case, dtype name, probes), one per host function and
    specialization the later sections launch, the timing section's first; on a GPU also the Triton
    polar orthogonalization of the init shapes (op "polar", the shape in the Case's place)."""
    from condinit import bench
    shape = timing_config("cpu" if dry else "cuda", "triton", quick, dry).attention_shape
    # the timing shape at a short length: the same specializations (every length and stride a
    # multiple of 16), seconds to run
    timing = Case("timing", shape.batch, shape.heads, shape.kv_heads, 256, 256, shape.head_dim, True)
    jobs = [("timing", op, timing, "bfloat16", p) for op, p in (("fwd", 1), ("jvp", 1), ("jvp", bench.default_config(
        "cuda").probes), ("bwd", 1), ("jvp_bwd", 1))]
    for dt in ("bfloat16", "float32"):
        jobs += [("tiny", op, TINY, dt, 1) for op in ("fwd", "jvp", "bwd", "jvp_bwd")]
    for dt, case in attention_plan("triton", dry):
        jobs += [("check", op, case, dt, 2 if op.startswith("jvp") else 1) for op in ("fwd", "jvp", "bwd", "jvp_bwd")]
    if not dry:
        jobs += [("init", "polar", shape, "float32", 1) for shape in [TINY_ORTH] + INIT_SHAPES]
    return jobs


def run_warm_job(dev, backend, op, case, dtype, probes):
    """One host function of ``case`` through the op it runs in (mask arguments as the public
    functions pass them, varlen as its padded batch): compiles its kernels."""
    import torch
    from condinit import _ext
    from condinit.ops.attention.checks import check_mask
    from condinit.ops.attention.library import (attention_bwd_op, attention_fwd_op, attention_jvp_bwd_op,
                                                attention_jvp_op)
    if op == "polar":
        from condinit.init import orthogonalize
        orthogonalize(torch.randn(case, device=dev), "polar", backend="triton")
        torch.cuda.synchronize()
        return
    _ext.load()   # the native backends' ops (the public functions load it when they choose a backend)
    dense = case._replace(varlen=False)
    q, k, v, tq, tk, tv = make_inputs(dense, dev, probes, getattr(torch, dtype))
    mask = check_mask(q, k, case.causal, case.window, case.q_lens, case.kv_lens)
    causal, rest = mask[0], mask[1:]
    scale = case.d ** -0.5
    if op == "fwd":
        attention_fwd_op(q, k, v, causal, scale, *rest, backend)
    elif op == "jvp":
        attention_jvp_op(q, k, v, tq, tk, tv, causal, scale, *rest, backend)
    elif op == "bwd":
        lse = torch.zeros(q.shape[:3], device=dev, dtype=torch.float32)
        attention_bwd_op(torch.randn_like(q), q, k, v, torch.randn_like(q), lse, causal, scale, *rest, backend)
    else:
        lse = torch.zeros(q.shape[:3], device=dev, dtype=torch.float32)
        attention_jvp_bwd_op(torch.randn_like(q), torch.randn_like(tq), q, k, v, tq, tk, tv, torch.randn_like(q),
                             torch.randn_like(tq), lse, causal, scale, *rest, backend)
    if dev != "cpu":
        torch.cuda.synchronize()


def warm_worker(args):
    i, n = (int(x) for x in args.worker.split("/"))
    jobs = warm_jobs(args.cpu_dry_run, args.quick)
    dev = "cpu" if args.cpu_dry_run else "cuda"
    backend = gpu_backend("triton", args.cpu_dry_run)
    if i == 0:
        print(f"[warm] jobs {len(jobs)}", flush=True)
    for label, op, case, dtype, probes in jobs[i::n]:
        t0 = time.perf_counter()
        what = f"{label} {getattr(case, 'name', case)} {dtype} {op} P={probes}"
        try:
            run_warm_job(dev, backend, op, case, dtype, probes)
            print(f"[warm] done {what} {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as exc:
            print(f"[warm] error {what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  flush=True)
            if STICKY.search(str(exc)):
                return 1
    return 0


def child_main(args):
    if args.section == "warm":
        return warm_worker(args)
    label = f"{args.section}-{args.tag}" if args.tag else args.section
    ch = Child(label, args.results, args.cpu_dry_run)
    import torch
    import condinit
    from condinit import _ext
    print(f"section {label}: condinit from {os.path.dirname(condinit.__file__)}; native extension: "
          f"{_ext.status()[1]}; torch {torch.__version__}", flush=True)
    # fresh inputs on every GPU run (the seed is logged, to replay a failure); fixed in the dry run
    seed = os.environ.get(SEED_ENV) or (0 if ch.dry else int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(int(seed))
    print(f"section {label}: seed {seed} (replay with {SEED_ENV}={seed})", flush=True)
    # autotuning only where asked, for the timings (each config of each list would compile)
    os.environ["CONDINIT_ATTN_AUTOTUNE"] = "1" if args.autotune and args.section.startswith("timing-") else "0"
    if args.section == "tiny":
        section_tiny(ch, args.only)
    elif args.section == "init":
        section_init(ch)
    elif args.section.startswith("attention-"):
        section_attention(ch, args.section.split("-", 1)[1])
    elif args.section.startswith("timing-"):
        what = args.section.split("-", 1)[1]
        if what.startswith("attention-"):
            what = gpu_backend(what.split("-", 1)[1], ch.dry)
        section_timing(ch, what, args.quick)
    else:
        raise SystemExit(f"unknown section {args.section!r}")
    return 0


# ============================================================================================= main

def _section_timeouts(text):
    out = {}
    for item in text.split(","):
        name, sep, value = item.rpartition("=")
        out[name.strip() if sep else "*"] = float(value)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                        help="output directory: log, environment, records, tables (default $OUT, else gpu_check_out)")
    parser.add_argument("--log", default=None, help="the log (default OUT/gpu_check.log)")
    parser.add_argument("--json", default=None, help="the final records (default OUT/gpu_check.json)")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for the whole run")
    parser.add_argument("--section-timeout", type=_section_timeouts, default={},
                        help="cap section timeouts: SECONDS (every section) or NAME=SECONDS,NAME=SECONDS")
    parser.add_argument("--quick", action="store_true", help="smaller timing shapes")
    parser.add_argument("--autotune", action="store_true",
                        help="let the Triton attention kernels autotune for the timings (default: their "
                             "first config)")
    parser.add_argument("--sections", default=None,
                        help="comma-separated subset of " + ",".join(s for s, _ in SECTIONS))
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the script's logic on the CPU at toy sizes with the CPU backends (no build, "
                             "no sanitizer)")
    parser.add_argument("--sanitizer", default=None,
                        help="compute-sanitizer to run (default: on PATH or in CUDA_HOME; none in the dry run)")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--only", default="all", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        return child_main(args)
    args.argv = argv
    os.makedirs(args.out, exist_ok=True)
    args.log = args.log or os.path.join(args.out, "gpu_check.log")
    args.json = args.json or os.path.join(args.out, "gpu_check.json")
    return Parent(args, Log(args.log)).run()


if __name__ == "__main__":
    sys.exit(main())
