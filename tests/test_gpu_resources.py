"""Static resource model of the GPU attention kernels, checked without a GPU.

**Triton** (kernels/attention/). Each launch configuration is compiled offline for sm_80
(A100) and sm_90 (H100 / H200) with ``triton.compile``, from the argument list the host code
really builds: the host function runs on CPU tensors with a recording ``_launch``, and triton's
own binder specializes those arguments (dtypes, 16-divisibility) as the JIT does on a GPU. The
compiled kernel must fit its target: shared memory (dynamic + static) within the per-block
opt-in limit, registers x threads within the register file, and a stack frame (spilled
registers, bytes per thread) within ``spill_limit`` of kernels/attention/configs.py. Each record
also holds the static SASS instruction mix (tensor-core products, exponentials, spill loads and
stores) for the tables. Compiles run in
subprocesses without ``TRITON_INTERPRET`` and with an empty triton cache; their records are
cached by a hash of kernels/attention/*.py, this file, the triton version and the job
(``RESULT_CACHE``; ``CONDINIT_RESOURCE_CACHE=0`` turns it off), so a rerun without an edit of
either file compiles nothing. A deliberately oversized config must be rejected by the same check.

By default (CI: about 2.5 minutes on 2 idle cores, 4-5 under load, without cached records) the
first config of a list, the one ``CONDINIT_ATTN_AUTOTUNE=0`` launches, is compiled for the lists
most at risk (``CI_CASES``: every kernel at d = 256, the JVP at d = 64, 128 and 256 and with two
probes per program, on sm_90 and mostly sm_80; bf16 at d = 128 on sm_90; the three kernels of
the backward through the tangent output), bf16 and fp32, and for two lists with the masks
(``CI_MASKED_CASES``: per-sequence lengths and a window).
``CONDINIT_FULL_RESOURCE_CHECK=1`` compiles every config of every list for fp16, bf16 and fp32,
every supported head dim, causal and not, on both targets (about 1000 compiles: 1-3 hours on 2
cores; ``CONDINIT_RESOURCE_CHECK_JOBS`` sets the number of compiling processes, default 2).

**CUDA** (csrc/attention/*.cu). ``nvcc --resource-usage`` for sm_80 and sm_90
gives registers, spills and static shared memory per kernel; a small host program built from the
same source prints what the launchers pick (``launch_plan``: warps per block, dynamic shared
memory) for every kernel, head dim and dtype at each target's opt-in limit. The launch must fit,
and hold two or more blocks per SM where the design says so (under a minute).

``python tests/test_gpu_resources.py --table [--full] [--json PATH]`` prints the tables of
BENCHMARKS.md, "Static resource model of the GPU kernels". Tests are skipped, with the reason,
when triton cannot compile for CUDA here (no CUDA backend, ptxas or cuobjdump) or nvcc is absent.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # offline GPU compiles / whole-script runs: CI, not the edit loop

ROOT = Path(__file__).resolve().parents[1]
CU_SOURCES = sorted((ROOT / "csrc" / "attention").glob("*.cu"))

# Per target: shared memory one block may opt in to, shared memory of the SM, register file.
TARGETS = {
    80: dict(name="sm_80 (A100)", smem_block=163 * 1024, smem_sm=164 * 1024, regs_sm=65536),
    90: dict(name="sm_90 (H100/H200)", smem_block=227 * 1024, smem_sm=228 * 1024, regs_sm=65536),
}
MAX_THREADS_SM, MAX_BLOCKS_SM = 2048, 32
SMEM_RESERVED_PER_BLOCK = 1024  # what the driver keeps per resident block (sm_80 and later)
# Spill threshold for the CUDA kernels (bytes of stack frame per thread).
CUDA_SPILL_LIMIT = 512

DTYPES = {"fp16": 2, "bf16": 2, "fp32": 4}
FULL = os.environ.get("CONDINIT_FULL_RESOURCE_CHECK", "0") == "1"
N_PROCS = int(os.environ.get("CONDINIT_RESOURCE_CHECK_JOBS", "2"))
# Compile records of earlier runs (see compile_jobs); CONDINIT_RESOURCE_CACHE=0: none.
_CACHE_SETTING = os.environ.get("CONDINIT_RESOURCE_CACHE", str(Path.home() / ".cache" / "condinit" / "gpu-resources"))
RESULT_CACHE = None if _CACHE_SETTING == "0" else Path(_CACHE_SETTING)

# A config the check must reject: 8 pipeline stages of 128-row K and V tiles need about 273 KiB of
# shared memory (bf16, d = 64; compiles in seconds, unlike 256 x 256 tiles at d = 256).
OVERSIZED = dict(kind="fwd", dtype="bf16", head_dim=64, causal=True, n_probes=1, arch=90,
                 config=[128, 128, 8, 8])


# ------------------------------------------------------------------------------------------------
# Compile worker (runs in a subprocess: no TRITON_INTERPRET, a fresh triton cache)
# ------------------------------------------------------------------------------------------------

def _host_launches(attn, torch, kind, dtype, head_dim, causal, n_probes, masked=False):
    """The launches the host function of ``kind`` makes on CPU tensors, recorded instead of run:
    ``[(kind, positional args, compile-time meta), ...]`` (``"pre"``: the backward's rowsum).
    ``masked``: with a sliding window and per-sequence lengths (the HAS_LENS kernels)."""
    calls = []
    saved = attn.configs.launch, attn.bwd.attn_bwd_preprocess_kernel

    class _Recorder:
        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(("pre", args, meta))

    attn.configs.launch = lambda name, grid_fn, args, meta: calls.append((name, args, meta))
    attn.bwd.attn_bwd_preprocess_kernel = _Recorder()
    try:
        t = getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[dtype])
        B, H, Hkv, N = 2, 4, 2, 1024  # GQA, N a multiple of 16 as in real models
        q = torch.empty(B, H, N, head_dim, dtype=t)
        k = torch.empty(B, Hkv, N, head_dim, dtype=t)
        lens = torch.full((B,), N, dtype=torch.int32)
        mask = (255, -1, lens, lens) if masked else ()
        tq, tk = (q, k) if n_probes == 1 else (q.expand(n_probes, *q.shape), k.expand(n_probes, *k.shape))
        tq, tk = tq.contiguous(), tk.contiguous()
        lse = torch.empty(B, H, N, dtype=torch.float32)
        if kind == "fwd":
            attn.attention_fwd(q, k, k, causal, 0.125, *mask)
        elif kind == "jvp":
            attn.attention_jvp(q, k, k, tq, tk, tk, causal, 0.125, *mask)
        elif kind.startswith("jvp_bwd"):
            tq5, tk5 = (tq[None], tk[None]) if n_probes == 1 else (tq, tk)
            attn.attention_jvp_bwd(q, tq5, q, k, k, tq5, tk5, tk5, q, tq5, lse, causal, 0.125, *mask)
        else:
            attn.attention_bwd(q, q, k, k, q, lse, causal, 0.125, *mask)
    finally:
        attn.configs.launch, attn.bwd.attn_bwd_preprocess_kernel = saved
    return calls


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([triton.knobs.nvidia.cuobjdump.path, flag, f.name],
                              capture_output=True, text=True, check=True).stdout


def _cubin_resources(cubin: bytes) -> dict:
    out = _cuobjdump(cubin, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    regs, stack, shared, local = map(int, m.groups())
    return dict(regs=regs, stack=stack, static_shared=shared, local=local, **_sass_mix(cubin))


def _sass_mix(cubin: bytes) -> dict:
    """Static instruction mix of the SASS (each instruction counted once, loops not unrolled):
    the total, the tensor-core products (HMMA: mma.sync; HGMMA: wgmma), the exponentials (MUFU)
    and the local-memory (spill) loads and stores."""
    sass = _cuobjdump(cubin, "-sass")
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    count = lambda *names: sum(op in names for op in ops)  # noqa: E731
    return dict(sass_total=len(ops), sass_hmma=count("HMMA"), sass_hgmma=count("HGMMA"),
                sass_mufu=count("MUFU"), sass_local=count("LDL", "STL"))


def _compile_one(attn, job: dict) -> dict:
    """Compile one (kernel, dtype, head dim, causal, probes, config) for one target."""
    import contextlib
    import io

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kind = job["kind"]
    launches = [c for c in _host_launches(attn, torch, kind if kind != "pre" else "dkdv", job["dtype"],
                                          job["head_dim"], job["causal"], job["n_probes"],
                                          job.get("masked", False)) if c[0] == kind]
    (_, args, meta), = launches
    fn = attn.bwd.attn_bwd_preprocess_kernel if kind == "pre" else attn.configs.KERNELS[kind]
    kwargs = dict(meta)
    rec = dict(job)
    if kind != "pre":
        cfgs = attn.configs.configs(kind, DTYPES[job["dtype"]], meta["BLOCK_D"], meta.get("PROBES_PER_PROGRAM", 1),
                                    job["arch"])
        c = job["config"]
        if isinstance(c, int):
            cfg = dict(cfgs[c].kwargs, num_warps=cfgs[c].num_warps, num_stages=cfgs[c].num_stages)
        else:
            cfg = dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3])
            if len(c) > 4:  # a register cap for ptxas (triton's maxnreg)
                cfg["maxnreg"] = c[4]
        kwargs.update(cfg)
        rec.update(block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"])
    rec.update(probes_per_program=meta.get("PROBES_PER_PROGRAM", 1), block_d=meta["BLOCK_D"])
    # As JITFunction.run does on a GPU.
    kwargs["debug"] = bool(triton.knobs.runtime.debug)
    kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    target = GPUTarget("cuda", job["arch"], 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    start = time.time()
    with contextlib.redirect_stdout(log):  # the ptxas -v log (dump_ptxas_log) is printed
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
    rec["seconds"] = round(time.time() - start, 1)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    rec.update(_cubin_resources(kernel.asm["cubin"]),
               shared=kernel.metadata.shared, warps=kernel.metadata.num_warps,
               stages=kernel.metadata.num_stages,
               spill_stores=int(spills.group(1)) if spills else None,
               spill_loads=int(spills.group(2)) if spills else None)
    return rec


def _worker_main():
    """Compile the jobs given as JSON on stdin; one JSON line per job on stdout."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="condinit-resources-")
    try:
        import triton
        from condinit.kernels import attention as attn
        triton.knobs.nvidia.dump_ptxas_log = True
        for job in json.load(sys.stdin):
            try:
                rec = _compile_one(attn, job)
            except Exception as e:  # reported to the parent, which fails the test with it
                rec = dict(job, error=f"{type(e).__name__}: {e}"[:2000])
            print(json.dumps(rec), flush=True)
    finally:
        shutil.rmtree(os.environ["TRITON_CACHE_DIR"], ignore_errors=True)


def _cache_key(job: dict) -> str:
    """What a compile record depends on: the kernel source, this file's compile procedure, the
    triton version and the job."""
    import hashlib
    import triton
    h = hashlib.sha256()
    for path in (*sorted((ROOT / "kernels" / "attention").glob("*.py")), Path(__file__)):
        h.update(path.read_bytes())
    h.update(triton.__version__.encode())
    h.update(json.dumps(job, sort_keys=True).encode())
    return h.hexdigest()[:32]


def compile_jobs(jobs: list, n_procs: int = None) -> list:
    """Run the compile worker over ``jobs`` in ``n_procs`` subprocesses; results in job order.

    Records are cached in ``RESULT_CACHE`` under a hash of the kernel source, this file, the
    triton version and the job (so an edit of either file recompiles everything); an error is
    never cached. ``CONDINIT_RESOURCE_CACHE=0`` turns the cache off."""
    n_procs = n_procs or N_PROCS
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    results = {}
    if RESULT_CACHE is not None:
        for job in jobs:
            cached = RESULT_CACHE / f"{_cache_key(job)}.json"
            if cached.is_file():
                results[_job_id(job)] = json.loads(cached.read_text())
    todo = [j for j in jobs if _job_id(j) not in results]
    chunks = [todo[i::n_procs] for i in range(n_procs) if todo[i::n_procs]]
    with tempfile.TemporaryDirectory(prefix="condinit-resources-") as tmp:
        procs = []
        for i, chunk in enumerate(chunks):
            (Path(tmp) / f"jobs{i}.json").write_text(json.dumps(chunk))
            with open(Path(tmp) / f"jobs{i}.json") as stdin, open(Path(tmp) / f"out{i}", "w") as out, \
                    open(Path(tmp) / f"err{i}", "w") as err:
                procs.append(subprocess.Popen([sys.executable, __file__, "--worker"], stdin=stdin, stdout=out,
                                              stderr=err, env=env, cwd=ROOT))
        for i, p in enumerate(procs):
            if p.wait() != 0:
                err = (Path(tmp) / f"err{i}").read_text()
                raise RuntimeError(f"compile worker failed ({p.returncode}):\n{err[-4000:]}")
            for line in (Path(tmp) / f"out{i}").read_text().splitlines():
                rec = json.loads(line)
                results[_job_id(rec)] = rec
    if RESULT_CACHE is not None:
        RESULT_CACHE.mkdir(parents=True, exist_ok=True)
        for job in todo:
            rec = results[_job_id(job)]
            if "error" not in rec:
                (RESULT_CACHE / f"{_cache_key(job)}.json").write_text(json.dumps(rec))
    return [results[_job_id(j)] for j in jobs]


def _job_id(job: dict) -> str:
    c = job["config"]
    cfg = f"cfg{c}" if isinstance(c, int) else "x".join(map(str, c))
    return (f"{job['kind']}-{job['dtype']}-d{job['head_dim']}-p{job['n_probes']}-"
            f"{'causal' if job['causal'] else 'full'}{'-masked' if job.get('masked') else ''}-sm{job['arch']}-{cfg}")


# ------------------------------------------------------------------------------------------------
# The model: what fits a target, and how many blocks an SM holds
# ------------------------------------------------------------------------------------------------

def spill_bytes(rec: dict) -> int:
    """Local memory per thread: the stack frame ptxas spills registers to."""
    return rec["stack"] + rec["local"]


def spill_limit(rec: dict) -> int:
    from condinit.kernels import attention as attn
    return attn.configs.spill_limit(rec["kind"], DTYPES[rec["dtype"]], rec["block_d"])


def problems(rec: dict, spill_limit: int) -> list:
    """Why a compiled kernel cannot launch, or launches spilling heavily, on its target."""
    t = TARGETS[rec["arch"]]
    out = []
    smem = rec["shared"] + rec["static_shared"]
    if smem > t["smem_block"]:
        out.append(f"shared memory {smem / 1024:.1f} KiB > {t['smem_block'] // 1024} KiB per block")
    threads = 32 * rec["warps"]
    if rec["regs"] * threads > t["regs_sm"]:
        out.append(f"{rec['regs']} registers x {threads} threads > {t['regs_sm']}")
    if spill_bytes(rec) > spill_limit:
        out.append(f"{spill_bytes(rec)} B/thread of spills > {spill_limit}")
    return out


def blocks_per_sm(rec: dict) -> tuple:
    """Resident blocks per SM that shared memory, registers and threads allow, and the binding
    limit (the CUDA occupancy rules: registers allocated per warp in units of 256)."""
    t = TARGETS[rec["arch"]]
    threads = 32 * rec["warps"]
    smem = rec["shared"] + rec["static_shared"] + SMEM_RESERVED_PER_BLOCK
    regs_per_warp = -(-rec["regs"] * 32 // 256) * 256
    limits = {"smem": t["smem_sm"] // smem, "regs": t["regs_sm"] // (regs_per_warp * rec["warps"]),
              "threads": MAX_THREADS_SM // threads, "blocks": MAX_BLOCKS_SM}
    n = min(limits.values())
    return n, "/".join(k for k, v in limits.items() if v == n)


# ------------------------------------------------------------------------------------------------
# Which configs are checked
# ------------------------------------------------------------------------------------------------

def _kernel_cases(head_dims, dtypes):
    """(kind, dtype, head_dim, n_probes) for every kernel and probe count the host launches."""
    for dtype in dtypes:
        for d in head_dims:
            yield "fwd", dtype, d, 1
            yield "jvp", dtype, d, 1
            yield "jvp", dtype, d, 2
            yield "dkdv", dtype, d, 1
            yield "dq", dtype, d, 1
            for kind in ("jvp_bwd_rows", "jvp_bwd_dq", "jvp_bwd_dkdv"):
                yield kind, dtype, d, 1


def _probes_per_program(kind, dtype, head_dim, n_probes):
    """What the host launches (kernels/attention/ decides)."""
    from condinit.kernels import attention as attn
    block_d = attn.configs.common_meta(head_dim)["BLOCK_D"]
    return block_d, attn.configs.probes_per_program(DTYPES[dtype], block_d, kind == "jvp", n_probes)


def _list_length(kind, dtype, head_dim, n_probes, arch):
    from condinit.kernels import attention as attn
    return len(attn.configs.configs(kind, DTYPES[dtype], *_probes_per_program(kind, dtype, head_dim, n_probes),
                                    arch))


def _runs_one_probe_per_program(kind, dtype, head_dim, n_probes):
    """A multi-probe JVP that launches one probe per program: the same kernel as one probe."""
    return n_probes > 1 and _probes_per_program(kind, dtype, head_dim, n_probes)[1] == 1


# CI: the first config of the lists most at risk (the JVP, the widest head dims, the two-probe
# lists) on both targets, and of the common d = 128 on sm_90 (there sm_80's tiles stay 60 KiB
# under its limit and spill at most a few hundred bytes), plus the largest rowsum kernel. Everything else (d = 16-96, fp16, not causal, every further
# config of a list) is in the full check.
BOTH, SM90 = (90, 80), (90,)
CI_CASES = [("fwd", "bf16", 128, 1, SM90), ("fwd", "bf16", 256, 1, BOTH), ("fwd", "fp32", 256, 1, BOTH),
            ("jvp", "bf16", 128, 1, BOTH), ("jvp", "bf16", 256, 1, BOTH), ("jvp", "fp32", 128, 1, BOTH),
            ("jvp", "fp32", 256, 1, BOTH), ("jvp", "bf16", 64, 1, BOTH), ("jvp", "bf16", 64, 2, BOTH),
            ("jvp", "fp32", 64, 2, BOTH),
            ("dkdv", "bf16", 128, 1, SM90), ("dkdv", "bf16", 256, 1, BOTH), ("dkdv", "fp32", 256, 1, SM90),
            ("dq", "bf16", 128, 1, SM90), ("dq", "bf16", 256, 1, SM90), ("dq", "fp32", 256, 1, SM90)]
# The backward through the tangent output (its widest lists and the fp32 dK/dV kernel, the one
# closest to its spill limit at d = 128), and the masked (HAS_LENS) variants of two lists: a
# sliding window with per-sequence lengths.
CI_CASES += [("jvp_bwd_rows", "bf16", 256, 1, SM90), ("jvp_bwd_dq", "bf16", 128, 1, BOTH),
             ("jvp_bwd_dkdv", "bf16", 128, 1, SM90), ("jvp_bwd_dkdv", "fp32", 128, 1, SM90)]
CI_MASKED_CASES = [("jvp", "bf16", 128, 1, BOTH), ("jvp_bwd_dkdv", "bf16", 128, 1, SM90)]


def ci_jobs() -> list:
    jobs = [dict(kind=kind, dtype=dtype, head_dim=d, causal=True, n_probes=n_probes, arch=arch, config=0)
            for kind, dtype, d, n_probes, archs in CI_CASES for arch in archs]
    jobs += [dict(kind=kind, dtype=dtype, head_dim=d, causal=True, n_probes=n_probes, arch=arch, config=0,
                  masked=True)
             for kind, dtype, d, n_probes, archs in CI_MASKED_CASES for arch in archs]
    jobs.append(dict(kind="pre", dtype="fp32", head_dim=256, causal=True, n_probes=1, arch=90, config=0))
    return jobs


def full_jobs() -> list:
    jobs = []
    for kind, dtype, d, n_probes in _kernel_cases((16, 32, 64, 80, 96, 128, 256), tuple(DTYPES)):
        if _runs_one_probe_per_program(kind, dtype, d, n_probes):
            continue
        for arch in (90, 80):
            for i in range(_list_length(kind, dtype, d, n_probes, arch)):
                for causal in (True, False):
                    jobs.append(dict(kind=kind, dtype=dtype, head_dim=d, causal=causal,
                                     n_probes=n_probes, arch=arch, config=i))
    for dtype in DTYPES:
        for d in (16, 64, 80, 128, 256):
            for arch in (90, 80):
                jobs.append(dict(kind="pre", dtype=dtype, head_dim=d, causal=True, n_probes=1, arch=arch,
                                 config=0))
    return jobs


def _triton_compile_unavailable():
    """Why triton cannot compile for CUDA here, or None."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
    except Exception as e:
        return f"triton's offline compiler is not importable: {e}"
    if "nvidia" not in triton.backends.backends:
        return "triton has no CUDA backend"
    try:
        triton.knobs.nvidia.ptxas.path
        triton.knobs.nvidia.cuobjdump.path
    except Exception as e:
        return f"triton's ptxas / cuobjdump are missing: {e}"
    return None


_WHY_NOT_TRITON = _triton_compile_unavailable()
needs_triton_compiler = pytest.mark.skipif(_WHY_NOT_TRITON is not None, reason=str(_WHY_NOT_TRITON))


# ------------------------------------------------------------------------------------------------
# Triton tests
# ------------------------------------------------------------------------------------------------

def _kernels():
    pytest.importorskip("triton")
    from condinit.kernels import attention
    return attention


# Without a usable compiler the parametrized test still shows up, skipped with the reason.
_JOBS = ((full_jobs() if FULL else ci_jobs()) if _WHY_NOT_TRITON is None else [OVERSIZED])


@pytest.fixture(scope="module")
def compiled():
    """Every job of this run compiled once (one batch over N_PROCS processes), by job id."""
    return {_job_id(r): r for r in compile_jobs(_JOBS + [OVERSIZED])}


@needs_triton_compiler
@pytest.mark.parametrize("job", _JOBS, ids=_job_id)
def test_triton_config_fits_the_target(compiled, job):
    rec = compiled[_job_id(job)]
    assert "error" not in rec, rec["error"]
    found = problems(rec, spill_limit(rec))
    assert not found, (found, rec)


@needs_triton_compiler
def test_the_check_rejects_an_oversized_config(compiled):
    rec = compiled[_job_id(OVERSIZED)]
    assert "error" not in rec, rec["error"]
    found = problems(rec, spill_limit(rec))
    assert any("shared memory" in p for p in found), rec


def test_the_check_names_each_exceeded_resource():
    fits = dict(arch=80, shared=160 * 1024, static_shared=0, warps=8, regs=255, stack=512, local=0)
    assert problems(fits, 512) == []
    assert blocks_per_sm(fits) == (1, "smem/regs")
    for change, word in ((dict(shared=163 * 1024, static_shared=1), "shared memory"),
                         (dict(warps=16), "registers x"), (dict(stack=500, local=13), "spills")):
        found = problems(dict(fits, **change), 512)
        assert len(found) == 1 and word in found[0], (change, found)


@pytest.mark.triton
def test_config_lists_cover_every_launch():
    """Every (kernel, dtype size, head-dim bucket) has a list with one probe per program; lists
    hold tl.dot-sized power-of-two tiles; two probes per program only where a list exists."""
    attn = _kernels()
    assert set(attn.configs.SM80_CONFIGS) <= set(attn.configs.CONFIGS)
    for (kind, elem_bytes, bucket, ppp), cfgs in [*attn.configs.CONFIGS.items(), *attn.configs.SM80_CONFIGS.items()]:
        assert kind in attn.configs.KERNELS and elem_bytes in (2, 4) and bucket in (64, 128, 256)
        assert ppp == 1 or (kind == "jvp" and ppp == 2)
        assert cfgs and len(set(cfgs)) == len(cfgs)
        for m, n, w, s in cfgs:
            assert m >= 16 and n >= 16 and m & (m - 1) == 0 and n & (n - 1) == 0
            assert w in (4, 8) and 1 <= s <= 4
    for kind in attn.configs.KERNELS:
        for elem_bytes in (2, 4):
            for block_d in (16, 32, 64, 128, 256):
                assert attn.configs.configs(kind, elem_bytes, block_d, 1)
                for n_probes in (1, 2, 5):
                    ppp = attn.configs.probes_per_program(elem_bytes, block_d, kind == "jvp", n_probes)
                    assert ppp == 1 or (kind == "jvp" and n_probes > 1)
                    assert attn.configs.configs(kind, elem_bytes, block_d, ppp)


@pytest.mark.triton
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_autotune_off_launches_the_first_config_of_its_list(monkeypatch, dtype, arch):
    """With CONDINIT_ATTN_AUTOTUNE=0 each GPU launch takes the first config of the list for its
    own dtype, head dim, probes per program and GPU (the kernels are replaced by recorders)."""
    import torch
    attn = _kernels()
    seen = []

    class _Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((self.name, args[0].element_size(), kw))

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("CONDINIT_ATTN_AUTOTUNE", "0")
    monkeypatch.setattr(attn.configs, "KERNELS", {name: _Kernel(name) for name in attn.configs.KERNELS})
    monkeypatch.setattr(attn.bwd, "attn_bwd_preprocess_kernel", _Kernel("pre"))
    monkeypatch.setattr(attn.configs, "device_arch", lambda t: arch)
    t = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    q = torch.empty(1, 2, 64, 80, dtype=t)
    k = torch.empty(1, 1, 64, 80, dtype=t)
    tangents = (q.expand(3, *q.shape).contiguous(), k.expand(3, *k.shape).contiguous(),
                k.expand(3, *k.shape).contiguous())
    attn.attention_fwd(q, k, k, True, 0.1)
    attn.attention_jvp(q, k, k, *tangents, True, 0.1)
    attn.attention_bwd(q, q, k, k, q, torch.empty(1, 2, 64), True, 0.1)
    attn.attention_jvp_bwd(q, tangents[0], q, k, k, *tangents, q, tangents[0], torch.empty(1, 2, 64), True, 0.1,
                           7, -1, None, torch.full((1,), 60, dtype=torch.int32))
    launched = [(name, size, kw) for name, size, kw in seen if name != "pre"]
    assert [name for name, _, _ in launched] == ["fwd", "jvp", "dkdv", "dq", "jvp_bwd_rows", "jvp_bwd_dq",
                                                  "jvp_bwd_dkdv"]
    assert [kw["HAS_LENS"] for _, _, kw in launched] == [False] * 4 + [True] * 3
    for name, size, kw in launched:
        assert size == q.element_size() and kw["BLOCK_D"] == 128 and kw["HEAD_DIM"] == 80
        ppp = kw.get("PROBES_PER_PROGRAM", 1)
        assert ppp == attn.configs.probes_per_program(size, 128, name == "jvp", 3)
        first = attn.configs.configs(name, size, 128, ppp, arch)[0]
        got = (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"])
        assert got == (first.kwargs["BLOCK_M"], first.kwargs["BLOCK_N"], first.num_warps, first.num_stages)


@pytest.mark.triton
def test_autotuners_key_on_head_dim_dtype_probes_and_causal():
    attn = _kernels()
    for kind in attn.configs.KERNELS:
        for elem_bytes in (2, 4):
            tuner = attn.configs.tuned(kind, elem_bytes, 128, 1, 90)
            assert {"tune_q", "tune_k", "BLOCK_D", "CAUSAL", "HAS_LENS"} <= set(tuner.keys)
            if kind in ("fwd", "jvp"):
                assert {"JVP", "PROBES_PER_PROGRAM"} <= set(tuner.keys)
            assert [(c.kwargs, c.num_warps, c.num_stages) for c in tuner.configs] == [
                (c.kwargs, c.num_warps, c.num_stages) for c in attn.configs.configs(kind, elem_bytes, 128, 1, 90)]


# ------------------------------------------------------------------------------------------------
# CUDA kernels: nvcc --resource-usage against the launchers' choices
# ------------------------------------------------------------------------------------------------

# The nvcc flags setup.py builds the extension with.
NVCC_FLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
# Head dims the table and the checks cover (the kernels take 1..256, padded to a multiple of 16).
CUDA_HEAD_DIMS = (16, 32, 64, 72, 80, 96, 128, 192, 256)
# launch_plan's KernelKinds (csrc/attention/kernel_kind.h), in their order: the kernel each one launches
# (the last three: the tangent backward's r, query side, key side).
CUDA_KERNELS = ("fwd", "jvp", "dq", "dkdv", "jvp_r", "jvp_bwd_q", "jvp_bwd_kv")


def _two_blocks_designed(kernel, arch, elem_bytes, d):
    """Where the design promises two or more resident blocks per SM: up to d = 128, 16-bit dtypes
    on both targets and fp32 on sm_90 (A100's 164 KiB holds one fp32 JVP / backward block); the
    tangent backward's gradient kernels (eight tiles each) 16-bit on sm_90 only."""
    if d > 128:
        return False
    if kernel in ("jvp_bwd_q", "jvp_bwd_kv"):
        return elem_bytes == 2 and arch == 90
    return elem_bytes == 2 or arch == 90


# Prints, for the opt-in limit given as argv[1], what launch_plan (the launchers' choice) picks for
# every kernel, head dim and element size: kind d elem warps smem_bytes dpad cols loop_tile.
_CUDA_LAUNCH_PROBE = r"""
#include "attention/attention_cuda.h"
#include <cstdio>
#include <cstdlib>
using namespace condinit::attention_cuda;
int main(int argc, char** argv) {
  const size_t limit = (size_t)atol(argv[1]);
  const int dims[] = {%(dims)s};
  for (int kind = 0; kind < kNumKernelKinds; ++kind)
    for (int d : dims)
      for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
        const LaunchPlan p = launch_plan((KernelKind)kind, dt, d, limit);
        printf("%%d %%d %%d %%d %%zu %%d %%d %%d\n", kind, d, dt == DType::kFloat32 ? 4 : 2, p.warps, p.smem_bytes,
               p.dpad, p.cols_per_block, p.loop_tile);
      }
  return 0;
}
"""


def _nvcc():
    """nvcc of CUDA_HOME (or on PATH) together with its headers, or None."""
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file() and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def parse_nvcc_resource_usage(text: str) -> dict:
    """``{(kernel, dtype): dict(regs, stack, spill_stores, static_shared)}`` from ``nvcc
    --resource-usage`` (ptxas -v) output; kernel in CUDA_KERNELS."""
    dtypes = {"I13__nv_bfloat16": "bf16", "I6__half": "fp16", "IfL": "fp32", "IfE": "fp32"}
    out = {}
    for block in re.split(r"ptxas info\s+: Compiling entry function ", text)[1:]:
        name = re.match(r"'([^']+)'", block).group(1)
        if "attention_fwd_kernel" in name:
            kernel = "jvp" if "Lb1E" in name else "fwd"
        elif "attention_dq_kernel" in name:
            kernel = "dq"
        elif "attention_dkdv_kernel" in name:
            kernel = "dkdv"
        elif "attention_jvp_r_kernel" in name:
            kernel = "jvp_r"
        elif "attention_jvp_bwd_q_kernel" in name:
            kernel = "jvp_bwd_q"
        elif "attention_jvp_bwd_kv_kernel" in name:
            kernel = "jvp_bwd_kv"
        else:
            continue
        dtype = next(v for k, v in dtypes.items() if k in name)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", block)
        used = re.search(r"Used (\d+) registers", block)
        smem = re.search(r"(\d+) bytes smem", block)
        out[(kernel, dtype)] = dict(regs=int(used.group(1)), stack=int(frame.group(1)),
                                    spill_stores=int(frame.group(2)), static_shared=int(smem.group(1)) if smem else 0)
    return out


def cuda_resources(workdir: Path) -> tuple:
    """nvcc resource usage per (arch, kernel, dtype), and the launch plans per arch:
    ``[dict(arch, kernel, d, elem_bytes, warps, dynamic_shared, dpad, cols, loop_tile)]``."""
    nvcc = _nvcc()
    probe = workdir / "launch_probe.cu"
    probe.write_text(_CUDA_LAUNCH_PROBE % dict(dims=", ".join(map(str, CUDA_HEAD_DIMS))))
    usage = {}
    # sm_90: the probe program, built with the kernels (one nvcc run gives both); sm_80: the kernels.
    sources = [str(x) for x in CU_SOURCES]
    cmds = {90: [nvcc, *NVCC_FLAGS, "--resource-usage", "-arch=sm_90", f"-I{ROOT / 'csrc'}", str(probe), *sources,
                 "-o", str(workdir / "launch_probe")],
            80: [nvcc, *NVCC_FLAGS, "--resource-usage", "-arch=sm_80", f"-I{ROOT / 'csrc'}", "-c", *sources,
                 "-odir", str(workdir)]}
    procs = {arch: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for arch, cmd in cmds.items()}
    for arch, p in procs.items():
        text = p.communicate()[0]
        assert p.returncode == 0, f"nvcc for sm_{arch} failed:\n{text[-4000:]}"
        for key, rec in parse_nvcc_resource_usage(text).items():
            usage[(arch,) + key] = rec
    launches = []
    for arch, t in TARGETS.items():
        lines = subprocess.run([str(workdir / "launch_probe"), str(t["smem_block"])], capture_output=True,
                               text=True, check=True).stdout.split("\n")
        for line in filter(None, lines):
            kind, d, sz, warps, smem, dpad, cols, tile = map(int, line.split())
            launches.append(dict(arch=arch, kernel=CUDA_KERNELS[kind], d=d, elem_bytes=sz, warps=warps,
                                 dynamic_shared=smem, dpad=dpad, cols=cols, loop_tile=tile))
    return usage, launches


def cuda_blocks_per_sm(usage: dict, launch: dict, dtype: str) -> tuple:
    """Resident blocks per SM of a CUDA launch (the rules of blocks_per_sm) and the binding limit."""
    rec = usage[(launch["arch"], launch["kernel"], dtype)]
    return blocks_per_sm(dict(rec, arch=launch["arch"], warps=launch["warps"], shared=launch["dynamic_shared"]))


def cuda_launch_problems(usage: dict, launch: dict) -> list:
    """Why a CUDA launch the host code makes would fail, spill heavily, or hold fewer blocks per SM
    than designed, on its target."""
    t = TARGETS[launch["arch"]]
    if launch["warps"] == 0:
        return [f"no block fits {t['smem_block']} B of shared memory"]
    out = []
    threads = 32 * launch["warps"]
    for dtype, size in DTYPES.items():
        if size != launch["elem_bytes"]:
            continue
        rec = usage[(launch["arch"], launch["kernel"], dtype)]
        smem = rec["static_shared"] + launch["dynamic_shared"]
        if smem > t["smem_block"]:
            out.append(f"{dtype}: shared memory {smem} B > {t['smem_block']}")
        if rec["regs"] * threads > t["regs_sm"]:
            out.append(f"{dtype}: {rec['regs']} registers x {threads} threads > {t['regs_sm']}")
        if threads > 128:
            out.append(f"{dtype}: {threads} threads > __launch_bounds__(128)")
        if rec["stack"] > CUDA_SPILL_LIMIT:
            out.append(f"{dtype}: {rec['stack']} B/thread of spills > {CUDA_SPILL_LIMIT}")
        n, why = cuda_blocks_per_sm(usage, launch, dtype)
        if _two_blocks_designed(launch["kernel"], launch["arch"], size, launch["d"]) and n < 2:
            out.append(f"{dtype}: {n} block per SM ({why}) where the design needs 2")
    return out


@pytest.fixture(scope="module")
def cuda_usage(tmp_path_factory):
    return cuda_resources(tmp_path_factory.mktemp("nvcc"))


@pytest.mark.skipif(_nvcc() is None, reason="nvcc with CUDA headers not found (CUDA_HOME)")
def test_cuda_kernels_fit_every_launch(cuda_usage):
    usage, launches = cuda_usage
    for arch in TARGETS:
        for kernel in CUDA_KERNELS:
            for dtype in DTYPES:
                assert (arch, kernel, dtype) in usage, f"no ptxas report for {kernel}<{dtype}> on sm_{arch}"
    assert len(launches) == len(TARGETS) * len(CUDA_KERNELS) * len(CUDA_HEAD_DIMS) * 2
    bad = {f"sm_{x['arch']} {x['kernel']} d={x['d']} {x['elem_bytes']}B": cuda_launch_problems(usage, x)
           for x in launches}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.skipif(_nvcc() is None, reason="nvcc with CUDA headers not found (CUDA_HOME)")
def test_cuda_check_rejects_a_launch_over_the_limit(cuda_usage):
    usage, launches = cuda_usage
    over = dict(launches[0], dynamic_shared=TARGETS[launches[0]["arch"]]["smem_block"] + 1)
    assert any("shared memory" in p for p in cuda_launch_problems(usage, over))
    # Half the SM's shared memory plus one byte leaves one block per SM where the design needs two.
    x = next(x for x in launches if _two_blocks_designed(x["kernel"], x["arch"], x["elem_bytes"], x["d"]))
    crowded = dict(x, dynamic_shared=TARGETS[x["arch"]]["smem_sm"] // 2 + 1)
    assert any("block per SM" in p for p in cuda_launch_problems(usage, crowded))


# ------------------------------------------------------------------------------------------------
# Entry points: the compile worker, and the tables of BENCHMARKS.md
# ------------------------------------------------------------------------------------------------

def table_jobs(head_dims=(64, 128, 256), dtypes=("bf16", "fp32")) -> list:
    """Every config of every list for the BENCHMARKS.md tables (causal, the list of each target
    on that target), one job per distinct (kernel, dtype, head dim, probes per program, target,
    config)."""
    jobs, seen = [], set()
    for kind, dtype, d, n_probes in _kernel_cases(head_dims, dtypes):
        ppp = _probes_per_program(kind, dtype, d, n_probes)[1]
        for arch in (90, 80):
            for i in range(_list_length(kind, dtype, d, n_probes, arch)):
                if (kind, dtype, d, ppp, arch, i) in seen:
                    continue
                seen.add((kind, dtype, d, ppp, arch, i))
                jobs.append(dict(kind=kind, dtype=dtype, head_dim=d, causal=True, n_probes=n_probes,
                                 arch=arch, config=i))
    return jobs


def _tool_versions() -> str:
    import triton
    ptxas = subprocess.run([triton.knobs.nvidia.ptxas.path, "--version"], capture_output=True,
                           text=True).stdout
    release = re.search(r"release ([\d.]+)", ptxas)
    return f"triton {triton.__version__}, its ptxas {release.group(1) if release else '?'}"


def _list_position(per_arch: dict) -> int:
    """Where a table row sorts: its sm_90 list position, then those only in sm_80's list."""
    pos = {arch: r["config"] if isinstance(r["config"], int) else 0 for arch, r in per_arch.items()}
    return pos[90] if 90 in pos else 100 + pos[80]


def print_tables(recs: list, cuda=None) -> None:
    """Markdown tables: one per Triton kernel (sm_90 and sm_80 side by side), one for CUDA."""
    from condinit.kernels import attention as attn
    by_key = {}
    for r in recs:
        if "error" in r:
            print(f"ERROR {_job_id(r)}: {r['error'][:300]}")
            continue
        # One row per tile: sm_80's list may hold it at another position, or not at all.
        tile = (r["block_m"], r["block_n"], r["warps"], r["stages"]) if "block_m" in r else ()
        key = (r["kind"], r["dtype"], r["head_dim"], r["probes_per_program"], tile, r["causal"],
               bool(r.get("masked")))
        by_key.setdefault(key, {})[r["arch"]] = r
    titles = {"fwd": "Forward", "jvp": "Forward + JVP", "dkdv": "Backward dK/dV", "dq": "Backward dQ",
              "pre": "Backward rowsum(dO o O)", "jvp_bwd_rows": "Tangent backward: row statistics",
              "jvp_bwd_dq": "Tangent backward: dQ, dtQ", "jvp_bwd_dkdv": "Tangent backward: dK, dV, dtK, dtV"}
    for kind, title in titles.items():
        rows = sorted(((k, v) for k, v in by_key.items() if k[0] == kind),
                      key=lambda kv: (kv[0][:4], _list_position(kv[1]), kv[0][4:]))
        if not rows:
            continue
        print(f"\n**{title}** (`{'attn_bwd_preprocess_kernel' if kind == 'pre' else attn.configs.KERNELS[kind].__name__}`)\n")
        print("| dtype | d | probes/program | list entry | BLOCK_M x BLOCK_N | warps | stages | "
              "sm_90 smem [KiB] | regs | spills [B] | blocks/SM (limit) | sm_80 smem [KiB] | regs | spills [B] | "
              "SASS: sm_90 HGMMA / all | sm_80 HMMA / all |")
        print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for (_, dtype, d, ppp, _, causal, masked), per_arch in rows:
            any_rec = next(iter(per_arch.values()))
            tile = (f"{any_rec['block_m']} x {any_rec['block_n']}" if "block_m" in any_rec else "-")
            cells = []
            for arch in (90, 80):
                r = per_arch.get(arch)
                if r is None:
                    cells += ["-"] * (4 if arch == 90 else 3)
                    continue
                bad = " ".join(problems(r, spill_limit(r)))
                marks = [" **(!)**" if word in bad else "" for word in ("shared", "registers x", "spills")]
                cells += [f"{(r['shared'] + r['static_shared']) / 1024:.1f}{marks[0]}", f"{r['regs']}{marks[1]}",
                          f"{spill_bytes(r)}{marks[2]}"]
                if arch == 90:
                    n, lim = blocks_per_sm(r)
                    cells.append(f"{n} ({lim})")
            pos = {arch: str(r["config"] + 1) if isinstance(r["config"], int) else "-" for arch, r in per_arch.items()}
            mix = [f"{per_arch[arch][op]} / {per_arch[arch]['sass_total']}" if arch in per_arch else "-"
                   for arch, op in ((90, "sass_hgmma"), (80, "sass_hmma"))]
            entry = "-" if kind == "pre" else pos.get(90, "-")
            if kind != "pre" and pos.get(80, "-") != entry:
                entry += f" (sm_80: {pos.get(80, '-')})"
            print(f"| {dtype}{' (masked)' if masked else ''} | {d} | {ppp} | {entry} | {tile} | {any_rec['warps']} | "
                  f"{any_rec['stages']} | "
                  + " | ".join(cells + mix) + " |")
    if cuda is not None:
        usage, launches = cuda
        print("\n**CUDA kernels** (`nvcc --resource-usage`, per template instance)\n")
        print("| kernel | dtype | sm_90 regs | spills [B] | static smem [B] | sm_80 regs | spills [B] | static smem [B] |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for kernel in CUDA_KERNELS:
            for dtype in DTYPES:
                a, b = usage[(90, kernel, dtype)], usage[(80, kernel, dtype)]
                print(f"| {kernel} | {dtype} | {a['regs']} | {a['stack']} | {a['static_shared']} | "
                      f"{b['regs']} | {b['stack']} | {b['static_shared']} |")
        print("\n**CUDA launches** (what the launcher picks at each target's opt-in limit; bf16 stands for "
              "fp16 too)\n")
        print("| kernel | dtype | d | padded d | cols/block | loop tile | sm_90 warps | smem [KiB] | "
              "blocks/SM (limit) | sm_80 warps | smem [KiB] | blocks/SM (limit) |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |")
        index = {(x["arch"], x["kernel"], x["elem_bytes"], x["d"]): x for x in launches}
        for kernel in CUDA_KERNELS:
            for dtype, sz in (("bf16", 2), ("fp32", 4)):
                for d in CUDA_HEAD_DIMS:
                    a, b = index[(90, kernel, sz, d)], index[(80, kernel, sz, d)]
                    cells = []
                    for x in (a, b):
                        n, lim = cuda_blocks_per_sm(usage, x, dtype) if x["warps"] else (0, "-")
                        cells += [str(x["warps"]), f"{x['dynamic_shared'] / 1024:.1f}", f"{n} ({lim})"]
                    print(f"| {kernel} | {dtype} | {d} | {a['dpad']} | {a['cols']} | {a['loop_tile']} | "
                          + " | ".join(cells) + " |")

if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker_main()
    elif sys.argv[1:2] == ["--table"]:
        import platform
        start = time.time()
        jobs = full_jobs() if "--full" in sys.argv else table_jobs()
        recs = compile_jobs(jobs)
        if "--json" in sys.argv:
            Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(recs, indent=1))
        cuda = cuda_resources(Path(tempfile.mkdtemp(prefix="condinit-nvcc-"))) if _nvcc() else None
        print(f"{len(recs)} Triton compiles ({_tool_versions()}), {platform.machine()}, "
              f"{os.cpu_count()} CPUs, {N_PROCS} processes, {time.time() - start:.0f} s")
        print_tables(recs, cuda)
    else:
        sys.exit("usage: python tests/test_gpu_resources.py --table [--full] [--json PATH]")
