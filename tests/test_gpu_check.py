"""benchmarks/gpu_check.py, the one-shot check run on a GPU machine: where no GPU is visible it
must still start, log the environment and say so; its own logic (the budget, sections in their
own processes with timeouts, every check recorded as it finishes, a check that raises a CUDA error
or crashes its process relaunched past, a hang cut at its timeout, the float64 references with
every mask, the tolerances, the warm-up jobs and the timing table of the ``condinit bench``
library) runs in a CPU dry run on the CPU backends at toy sizes."""
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_gpu_check_script_runs_and_says_when_there_is_no_gpu(tmp_path):
    """benchmarks/gpu_check.py is only useful on a GPU, but it must at least parse, start, write
    the environment first, and exit non-zero with a clear line where no GPU is visible (as here)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: run the script itself")
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--skip-build", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode == 1, out.stderr
    log = (tmp_path / "gpu_check.log").read_text()
    assert "no CUDA GPU visible" in out.stdout and "no CUDA GPU visible" in log
    env = (tmp_path / "environment.txt").read_text()
    for what in ("torch: ", "torch.version.cuda", "triton: ", "TORCH_CUDA_ARCH_LIST: ", "nvcc", "nvidia-smi"):
        assert what in env, what


@pytest.mark.slow
def test_cpu_dry_run_relaunches_past_a_cuda_error_and_a_crash_and_cuts_a_hang(tmp_path):
    """One dry run of every section, with three faults: the 2nd check of attention-cuda raises a
    sticky CUDA error, the 3rd of attention-triton aborts its process, the 2nd of the tiny shapes
    hangs. The first two sections are relaunched and skip what is done (no check runs twice);
    the hang is cut at the section's timeout with the check it hung in recorded, and the next
    section runs. Every other check passes; every timing row names its backend; the last thing
    printed is the markdown the benchmarks file records."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[gpu_check.FAULT_ENV] = "attention-cuda:cuda@2,attention-triton:crash@3,tiny:hang@2"
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run", "--out", str(tmp_path),
                          "--section-timeout", "sanitize=25"],
                         capture_output=True, text=True, timeout=1200, env=env, cwd=str(ROOT))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(ln) for ln in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    checks = [r for r in lines if r.get("kind") is None]
    starts = [(r["section"], r["name"]) for r in lines if r.get("kind") == "start"]

    def names(backend):
        return [gpu_check.case_label(gpu_check.DRY_BACKEND[backend], dt, c)
                for dt, c in gpu_check.attention_plan(backend, dry=True)]
    cuda, triton = names("cuda"), names("triton")
    tiny = [r["name"] for r in checks if r["section"] == "tiny" and r["name"] != "section"]
    failed = sorted((r["section"], r["name"]) for r in checks if r["status"] in ("FAIL", "ERROR"))
    assert failed == sorted([("attention-cuda", cuda[1]), ("attention-triton", triton[2]), ("tiny", tiny[1]),
                             ("tiny", "section")]), [(r["section"], r["name"], r["detail"]) for r in checks
                                                     if r["status"] in ("FAIL", "ERROR")]
    for section, planned in (("attention-cuda", cuda), ("attention-triton", triton)):
        mine = [r for r in checks if r["section"] == section and r["status"] != "INFO"]
        assert [r["name"] for r in mine] == planned          # each once, in order, across the launches
        assert all(starts.count((section, n)) <= 1 for n in planned)   # none ran twice
        relaunch = [r for r in checks if r["section"] == section and r["status"] == "INFO"]
        assert len(relaunch) == 1 and "relaunched" in relaunch[0]["detail"], relaunch
    assert f"status {gpu_check.CUDA_ERROR_EXIT}" in next(
        r["detail"] for r in checks if r["section"] == "attention-cuda" and r["status"] == "INFO")
    assert "died in this check" in next(r["detail"] for r in checks if r["name"] == triton[2])
    hung = {r["name"]: r["detail"] for r in checks if r["section"] == "tiny"}
    assert "timed out in this check" in hung[tiny[1]] and "timed out" in hung["section"]
    assert len(tiny) == 2                                     # the checks after the hang never ran
    # the warm-up ran every job; init (the section after all of these) passed
    warm = next(r for r in checks if r["section"] == "warm")
    n = len(gpu_check.warm_jobs(True, False))
    assert f"{n} of {n} jobs" in warm["detail"], warm
    assert sum(r["status"] == "PASS" for r in checks if r["section"] == "init") >= 10
    # timing: the bench library's rows, each once in the final records, with the backend that ran
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    keys = [(r["section"], r["row"]["key"]) for r in rows]
    assert len(set(keys)) == len(keys)
    assert {"init.batched", "init.per_tensor", "init.floor", "ceilings.matmul_fp32"} <= \
        {k for s, k in keys if s == "timing-init"}
    for section, backend in (("timing-attention-triton", "cpp-cpu"), ("timing-attention-cuda", "torch")):
        mine = {r["row"]["key"]: r["row"] for r in rows if r["section"] == section}
        assert mine["attention.jvp"]["backend"] == backend and mine["attention.fwd"]["backend"] == backend
        assert all(r["backend"] not in ("", "?") and r["error"] is None for r in mine.values())
    # the environment is logged first, the markdown tables last
    log = (tmp_path / "gpu_check.log").read_text()
    assert log.index("torch: ") < log.index("--- section")
    tables = (tmp_path / "gpu_check_tables.md").read_text().strip()
    assert out.stdout.rstrip().endswith(tables)
    assert tables.startswith("Command: `python benchmarks/gpu_check.py --cpu-dry-run") and "Machine: " in tables
    assert "Date: " in tables and "| timing-attention-cuda | condinit attention_jvp (1 probe) | torch |" in tables
    assert "| section | passed | failed | skipped | seconds |" in tables


def test_budget_guarantees_every_section_its_cap():
    """The caps (environment, build, every section, summary) fit the default budget, each timing
    section gets at least 60 s and runs before the checks, and the timeout rule gives every
    section at least its cap whether the sections before it use all their time or none."""
    caps = dict(gpu_check.SECTIONS)
    assert gpu_check.ENV_CAP + gpu_check.BUILD_CAP + sum(caps.values()) + gpu_check.SUMMARY_RESERVE \
        <= gpu_check.DEFAULT_BUDGET <= 540
    order = [name for name, _ in gpu_check.SECTIONS]
    timing = [n for n in order if n.startswith("timing-")]
    assert len(timing) == 3 and all(caps[n] >= 60 for n in timing)
    assert max(order.index(n) for n in timing) < min(order.index(n) for n in order if n.startswith("attention-"))
    assert gpu_check.section_caps(gpu_check.DEFAULT_BUDGET, order) == {**caps, "build": gpu_check.BUILD_CAP}
    half = gpu_check.section_caps(gpu_check.DEFAULT_BUDGET / 2, order)
    assert sum(half.values()) <= gpu_check.DEFAULT_BUDGET / 2 - gpu_check.ENV_CAP - gpu_check.SUMMARY_RESERVE + 1e-9
    for used_share in (0.0, 1.0):   # each section uses none or all of the time it is given
        left = gpu_check.DEFAULT_BUDGET - gpu_check.ENV_CAP - gpu_check.BUILD_CAP
        for i, name in enumerate(order):
            timeout = gpu_check.section_timeout(left, sum(caps[n] for n in order[i + 1:]))
            assert timeout >= caps[name], (name, timeout)
            left -= used_share * timeout
    assert gpu_check._section_timeouts("12") == {"*": 12.0}
    assert gpu_check._section_timeouts("init=3,timing-init=4.5") == {"init": 3.0, "timing-init": 4.5}


def test_the_case_list_covers_every_mask_kind_on_both_backends():
    for backend in ("triton", "cuda"):
        plan = gpu_check.attention_plan(backend, dry=False)
        cases = [c for dt, c in plan if dt == "bfloat16"]
        assert any(c.window and c.window[1] >= 0 for c in cases) and any(c.window and c.causal for c in cases)
        assert any(c.kv_lens and not c.varlen for c in cases) and any(c.q_lens and not c.varlen for c in cases)
        assert any(c.varlen for c in cases) and {"float16", "float32"} <= {dt for dt, _ in plan}
    for dry in (False, True):
        jobs = gpu_check.warm_jobs(dry, False)
        ops = {"fwd", "jvp", "bwd", "jvp_bwd"} | ({"polar"} if not dry else set())
        assert {op for _, op, _, _, _ in jobs} == ops and jobs[0][0] == "timing"
        assert len({repr((op, c, dt, p)) for _, op, c, dt, p in jobs}) == len(jobs)


def test_dense_mask_follows_the_documented_rule():
    """The reference's mask against the rule of condinit.attention's docstring, entry by entry."""
    case = gpu_check.Case("m", 3, 1, 1, 7, 9, 16, True, (2, 1), q_lens=[7, 4, 0], kv_lens=[9, 3, 5])
    for causal, window in itertools.product((False, True), (None, (2, 1), (-1, 0), (0, -1))):
        c = case._replace(causal=causal, window=window)
        m = gpu_check.dense_mask(c, "cpu")[:, 0]
        for b, i, j in itertools.product(range(3), range(7), range(9)):
            lq, lk = c.q_lens[b], c.kv_lens[b]
            off = lk - lq
            want = i < lq and j < lk and (not causal or j <= i + off)
            if window is not None:
                left, right = window
                want = want and (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
            assert bool(m[b, i, j]) == want, (causal, window, b, i, j)


@pytest.mark.slow
def test_reference_zeroes_rows_without_keys_and_matches_softmax():
    torch.manual_seed(0)
    case = gpu_check.Case("r", 2, 2, 1, 5, 6, 8, True, q_lens=[5, 5], kv_lens=[6, 1])
    q, k, v, *_ = gpu_check.make_inputs(case, "cpu", 1)
    out = gpu_check.reference_fn(case, "cpu")(q, k, v)
    # batch 1 sees one key: queries 0..3 see none (causal, bottom-right aligned), query 4 sees key 0
    assert torch.equal(out[1, :, :4], torch.zeros_like(out[1, :, :4]))
    torch.testing.assert_close(out[1, :, 4], v[1, 0, 0].expand(2, -1), rtol=0, atol=1e-12)
    s = (q[0] @ k[0, [0, 0]].mT) * case.d ** -0.5
    s = s.masked_fill(~torch.ones(5, 6, dtype=torch.bool).tril(1), float("-inf"))
    torch.testing.assert_close(out[0], torch.softmax(s, -1) @ v[0, [0, 0]], rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_run_limited_kills_the_whole_process_group():
    rc, out = gpu_check.run_limited([sys.executable, "-c", "import subprocess, sys, time; "
                                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                                     "print('started', flush=True); time.sleep(60)"], timeout=3)
    assert rc is None and "started" in out


@pytest.mark.slow
def test_run_limited_returns_when_an_escaped_grandchild_keeps_the_pipe_open():
    """A grandchild in its own session survives the group kill and holds the output pipe: the read
    after the kill is bounded too."""
    t0 = time.monotonic()
    rc, _ = gpu_check.run_limited([sys.executable, "-c", "import subprocess, sys, time; "
                                   "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(40)'], "
                                   "start_new_session=True); time.sleep(60)"], timeout=2)
    assert rc is None and time.monotonic() - t0 < 30


FAKE_SANITIZER = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
if args == ["--help"]:
    print("  --kernel-name arg   Filter the kernels to check")
    sys.exit(0)
with open(os.environ["FAKE_SANITIZER_LOG"], "a") as f:
    f.write(" ".join(args) + "\\n")
i = args.index("--target-processes") + 2
if args[i] == "--kernel-name":
    i += 2
rc = subprocess.call(args[i:])
print("========= ERROR SUMMARY: 0 errors")
sys.exit(rc)
"""


@pytest.mark.slow
def test_sanitize_section_runs_cuda_first_and_racechecks_the_extension_only(tmp_path):
    """The sanitize section under a stand-in for compute-sanitizer (it logs its arguments and runs
    the program): memcheck on every tiny check, the CUDA backend's first; racecheck on the CUDA
    backend's only, filtered to the extension's kernels; autotuning off; both recorded."""
    tool = tmp_path / "compute-sanitizer"
    tool.write_text(FAKE_SANITIZER.format(python=sys.executable))
    tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FAKE_SANITIZER_LOG"] = str(tmp_path / "argv.txt")
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run", "--out", str(tmp_path / "o"),
                          "--sections", "sanitize", "--sanitizer", str(tool)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    argv = (tmp_path / "argv.txt").read_text().splitlines()
    assert len(argv) == 2 and argv[0].startswith("--tool memcheck") and argv[1].startswith("--tool racecheck")
    assert f"--kernel-name kns={gpu_check.RACECHECK_KERNELS}" in argv[1] and "--kernel-name" not in argv[0]
    assert "--only all" in argv[0] and "--only cuda" in argv[1]
    checks = [r for r in map(json.loads, (tmp_path / "o" / "gpu_check.jsonl").read_text().splitlines())
              if r.get("kind") is None]
    mem = [r["name"] for r in checks if r["section"] == "tiny-memcheck"]
    race = [r["name"] for r in checks if r["section"] == "tiny-racecheck"]
    cuda, triton = gpu_check.DRY_BACKEND["cuda"], gpu_check.DRY_BACKEND["triton"]
    assert [n.split()[0] for n in mem] == [cuda, cuda, "randn", triton, triton], mem
    assert race == mem[:3]
    tools = {r["name"].split()[1]: r for r in checks if r["section"] == "sanitize"}
    assert tools["memcheck"]["status"] == tools["racecheck"]["status"] == "PASS", tools
    assert all(r["status"] == "PASS" for r in checks if r["section"].startswith("tiny-"))
