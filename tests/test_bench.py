"""``condinit bench``: the quick run prints tables at most 120 columns wide and writes valid JSON
(to a file or to stdout); every row names the backend that ran, every rate is a fraction of a
ceiling that bounds it (a row above it is flagged as noise), every aim has its verdict; a forced
backend that cannot run fails its rows instead of falling back."""
import json

import pytest
import torch

from condinit import bench
from helpers import run_cli

# The quick CPU attention shape, B=1 H=2 N=128 d=64, causal: 4 B H Nq Nk d, halved for causal
# with Nq = Nk, is 4 * 1 * 2 * 128 * 128 * 64 / 2 FLOPs; the backward 2.5x, the JVP 3x; 4 probes
# in one call 9x (the primal's two products once, four per probe: 2 + 4 * 4 = 18 products of the
# forward's 2); the backward through the tangent output 7.5x.
QUICK_ATTENTION_FLOPS = {"fwd": 4194304.0, "bwd": 10485760.0, "jvp": 12582912.0, "jvp_probes": 37748736.0,
                         "jvp_bwd": 31457280.0}
QUICK_MATMUL_FLOPS = 268435456.0     # 2 n^3, n = 512
# CholeskyQR2 on the quick stack (2 layers, D=512, 8 + 2 heads of 64): 4 GEMMs of 2 d^2 D per
# block, 2 * (8 + 2) = 20 blocks: 4 * 2 * 64^2 * 512 * 20
QUICK_INIT_FLOPS = 335544320.0
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
WIDTH = 120
# The rows with an aim: (key, the row it is compared with, the most its time may be of that row's).
AIMS = {"init.per_tensor": ("init.batched", 1.2), "init.batched": ("init.floor", 1.3),
        "attention.fwd": ("attention.sdpa_fwd", 1.1), "attention.jvp": ("attention.sdpa_fwd", 2.5),
        "attention.jvp_bwd": ("attention.math_jvp_bwd", 0.2)}


def _assert_width(text):
    too_wide = [ln for ln in text.splitlines() if len(ln) > WIDTH]
    assert not too_wide, too_wide


def _row_line(out, name):
    """The table line that starts row ``name``."""
    return next(ln for ln in out.splitlines() if ln.startswith(name + "  "))


def _run(capsys, *argv):
    return run_cli(capsys, "bench", "--no-progress", *argv)


@pytest.mark.slow
def test_quick_run_prints_the_table_and_valid_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc, out, err = _run(capsys, "--quick", "--device", "cpu", "--json", str(path))
    assert rc == 0, out + err
    _assert_width(out)
    data = json.loads(path.read_text())
    assert {"machine", "versions", "flop_conventions", "config", "rows", "date", "timing"} <= set(data)
    assert data["versions"]["torch"] == torch.__version__
    assert data["machine"]["torch_threads"] == torch.get_num_threads()
    assert "4 B H Nq Nk d" in data["flop_conventions"]["attention_fwd"]
    rows = {r["key"]: r for r in data["rows"]}
    onednn = {"ceilings.matmul_fp32_onednn"} if torch.backends.mkldnn.is_available() else set()
    expected = {"ceilings.matmul_fp32", "ceilings.copy", "init.batched", "init.per_tensor", "init.floor",
                "init.orthogonal_loop", "init.batched_qr", "init.randn", "init.block_randn", "attention.sdpa_fwd",
                "attention.sdpa_bwd", "attention.fwd", "attention.math_jvp", "attention.jvp", "attention.jvp_probes",
                "attention.bwd", "attention.math_jvp_bwd", "attention.jvp_bwd"} | onednn
    assert set(rows) == expected
    for key, r in rows.items():
        assert r["error"] is None, (key, r["error"])
        assert r["seconds"] > 0 and r["backend"] not in ("", "?"), key
        line = _row_line(out, r["name"])         # every row in the table, with its backend and verdict
        assert line.endswith("  " + r["verdict"]), (line, r["verdict"])
        assert all(word in out for word in r["backend"].split()), key
    # automatically chosen: one of the CPU's backends (which one: the forced test below)
    assert rows["attention.jvp"]["backend"] in ("cpp-cpu", "torch")
    assert rows["attention.sdpa_fwd"]["backend"] in SDPA_BACKENDS
    # side by side: ratios to the baselines of the same run
    per, batched = rows["init.per_tensor"], rows["init.batched"]
    assert per["ratios"]["init.batched"] == pytest.approx(per["seconds"] / batched["seconds"])
    assert set(batched["ratios"]) == {"init.floor", "init.orthogonal_loop", "init.batched_qr", "init.randn"}
    assert set(rows["attention.jvp"]["ratios"]) == {"attention.math_jvp", "attention.sdpa_fwd"}
    assert set(rows["attention.jvp_probes"]["ratios"]) == {"attention.jvp*4"}
    assert set(rows["attention.jvp_bwd"]["ratios"]) == {"attention.math_jvp_bwd", "attention.sdpa_fwd"}
    # verdicts: from the rows' own times, against each aim; every other row has none
    for key, r in rows.items():
        if key in AIMS:
            other, at_most = AIMS[key]
            met = r["seconds"] / rows[other]["seconds"] <= at_most
            assert r["verdict"] == ("met" if met else "not met"), (key, r)
        else:
            assert r["verdict"] == "no aim", key
    # FLOP counts and the ceilings: the fastest fp32 GEMM measured (its rate from its fastest call)
    matmul = rows["ceilings.matmul_fp32"]
    assert matmul["flops"] == QUICK_MATMUL_FLOPS
    gemms = [r for k, r in rows.items() if k.startswith("ceilings.matmul_fp32")]
    for g in gemms:
        assert g["rate"] == pytest.approx(g["flops"] / g["best"])
    fastest = max(gemms, key=lambda g: g["flops"] / g["best"])
    for kind, flops in QUICK_ATTENTION_FLOPS.items():
        assert rows[f"attention.{kind}"]["flops"] == flops, kind
    assert rows["init.batched"]["flops"] == QUICK_INIT_FLOPS
    copy = rows["ceilings.copy"]
    for key, r in rows.items():
        if r["section"] == "ceilings" or r["rate"] is None:
            continue
        ceiling = fastest if r["flops"] else copy
        work = r["flops"] or r["bytes"]
        assert r["ceiling"] == ceiling["key"], key
        assert r["of_ceiling"] == pytest.approx(work / r["seconds"] / (work and ceiling["rate"])), key
        shown = f"{100 * r['of_ceiling']:.0f}%"
        line = _row_line(out, r["name"])
        if r["of_ceiling"] > 1:      # only as noise, and flagged as such in the table and the JSON
            assert shown + "*" in line and "timing noise" in r["note"], (key, line)
        else:
            assert f" {shown} " in line and "*" not in line, (key, line)
    assert "% ceil" in out and "verdict" in out


@pytest.mark.parametrize("json_args", [["--json", "-"], ["--json"]])
def test_json_to_stdout_is_the_only_thing_on_stdout(capsys, monkeypatch, json_args):
    """``--json -`` and ``--json`` without a path: stdout is the JSON alone, the tables go to stderr
    (the rows faked: this checks where the output goes; the slow test below runs them)."""
    rows = [bench.Row("init", "init.batched", "condinit conditioned_init_layers_", "torch", seconds=0.25, best=0.2)]
    monkeypatch.setattr(bench, "run", lambda cfg, progress=None, on_row=None: rows)
    rc, out, err = _run(capsys, "--quick", "--device", "cpu", "--sections", "init", *json_args)
    assert rc == 0, err
    data = json.loads(out)
    assert [r["key"] for r in data["rows"]] == ["init.batched"] and data["rows"][0]["seconds"] == 0.25
    assert "condinit conditioned_init_layers_" in err and "verdict" in err
    _assert_width(err)


@pytest.mark.slow
def test_json_dash_of_a_real_run(capsys):
    rc, out, err = _run(capsys, "--quick", "--device", "cpu", "--sections", "init", "--repeats", "1",
                        "--skip", "orthogonal_loop,batched_qr", "--json", "-")
    assert rc == 0, err
    rows = {r["key"]: r for r in json.loads(out)["rows"]}
    assert {"init.batched", "init.per_tensor", "init.floor"} <= set(rows)
    assert all(r["error"] is None and r["name"] in err for r in rows.values())


def test_forced_backend_that_cannot_run_fails_its_rows(capsys):
    """--backend cuda on a CPU tensor: condinit's rows fail with the reason (no silent fallback)."""
    rc, out, err = _run(capsys, "--quick", "--device", "cpu", "--sections", "attention", "--backend", "cuda",
                        "--skip", "math_jvp,math_jvp_bwd", "--repeats", "1")
    assert rc == 1
    for what in ("condinit attention forward", "condinit attention_jvp (1 probe)"):
        lines = out.splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith(what + "  "))
        assert lines[at].endswith("  not met") and lines[at + 1].startswith("    ERROR BackendUnavailableError"), \
            lines[at:at + 2]
    assert "SDPA forward, best backend" in out and "attention.fwd" in err


def test_rows_name_the_backend_the_environment_forces(tmp_path, capsys, forced_backend):
    """CONDINIT_BACKEND=torch: every condinit row runs and names the torch reference, the SDPA rows
    still name the SDPA backend that ran."""
    forced_backend("torch")
    path = tmp_path / "bench.json"
    rc, out, err = _run(capsys, "--quick", "--device", "cpu", "--sections", "init,attention", "--repeats", "1",
                        "--init-shape", "1,64,2,1,16", "--attention-shape", "1,2,1,32,16",
                        "--skip", "orthogonal_loop,batched_qr,math_jvp,math_jvp_bwd", "--json", str(path))
    assert rc == 0, out + err
    rows = {r["key"]: r for r in json.loads(path.read_text())["rows"]}
    for key in ("attention.fwd", "attention.jvp", "attention.jvp_probes", "attention.bwd", "attention.jvp_bwd",
                "init.block_randn"):
        assert rows[key]["error"] is None and rows[key]["backend"] == "torch", (key, rows[key])
    for key in ("init.batched", "init.per_tensor"):
        assert rows[key]["backend"] == "orthogonalize=torch (cholqr2), randn=torch", (key, rows[key])
    assert rows["attention.sdpa_fwd"]["backend"] in SDPA_BACKENDS


@pytest.mark.parametrize("argv, message", [
    (["--sections", "init,bogus"], "--sections entries"),
    (["--init-shape", "2,64,3,2,16"], "kv_heads=2 must divide heads=3"),
    (["--attention-shape", "1,2,x,4,5"], "attention shape must be a preset"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--backend", "gpu"], "--backend"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_parse_shape_presets_and_ints():
    assert bench.parse_shape("llama-1b", "init") == bench.InitShape(16, 2048, 32, 8, 64)
    assert bench.parse_shape("2,128,4,2,32", "init").blocks == 2 * (4 + 2)
    assert bench.parse_shape("1,4,2,64,16", "attention") == bench.AttentionShape(1, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="5 positive ints"):
        bench.parse_shape("1,2,3", "init")


def test_timer_takes_the_median_and_scales():
    calls = []
    t = bench.Timer("cpu", repeats=3, warmup=2)(lambda: calls.append(1), scale=4.0)
    assert len(calls) == 5 and len(t.all) == 3 and t.scale == 4.0
    assert t.best <= t.seconds and t.seconds == sorted(t.all)[1]


def test_timer_keeps_calling_until_its_minimum_time():
    """A ceiling's timer: at least ``repeats`` calls, and more while their total is under
    ``min_seconds``; the best is the fastest call."""
    import time
    calls = []
    t = bench.Timer("cpu", repeats=2, warmup=1, min_seconds=0.05)(lambda: calls.append(time.sleep(0.01)))
    assert len(t.all) >= 5 and len(calls) == len(t.all) + 1 and sum(t.all) >= 0.05
    assert t.best == min(t.all) >= 0.01


def test_table_shows_errors_and_ratios():
    ok = bench.Row("init", "init.batched", "batched", "torch", seconds=0.5, ratios={"init.floor": 1.25})
    bad = bench.Row("init", "init.floor", "floor", "torch", error="RuntimeError: boom")
    text = bench.format_table([ok, bad])
    assert "1.25x floor" in text and "ERROR RuntimeError: boom" in text and "500.00" in text


def test_table_lines_fit_in_120_columns_whatever_the_cells():
    """Long names, backends, ratios, notes and errors wrap inside their columns or on indented
    lines; no line is wider than 120, every word is still there."""
    long_name = "condinit a_function_name " + "and its many arguments " * 3
    rows = [bench.Row("init", "init.a", long_name, "orthogonalize=triton (polar), randn=cuda, and more words",
                      seconds=1.5, flops=3e12, rate=2e12, rate_unit="FLOP/s", of_ceiling=0.5,
                      ratios={f"init.other_row_{i}": 1.0 + i for i in range(12)}, aim="<= 1.3x other_row_0",
                      note="a note " * 30),
            bench.Row("attention", "attention.b", "b", "torch", error="RuntimeError: " + "x " * 200)]
    text = bench.format_table(rows, header="header " * 40, titles={"init": "title " * 40})
    _assert_width(text)
    words = " ".join(text.split())
    for w in long_name.split() + ["orthogonalize=triton", "(polar),", "randn=cuda,", "other_row_11", "ERROR"]:
        assert w in words, w


def test_verdicts_against_each_aim():
    """met / not met from the time ratio, no aim without one, unknown (said why) when the row it is
    compared with did not run; a row that failed does not meet its aim."""
    base = bench.Row("s", "s.base", "base", "torch", seconds=1.0)
    fast = bench.Row("s", "s.fast", "fast", "torch", seconds=0.5)
    slow = bench.Row("s", "s.slow", "slow", "torch", seconds=2.0)
    lone = bench.Row("s", "s.lone", "lone", "torch", seconds=1.0)
    broken = bench.Row("s", "s.broken", "broken", "torch", error="RuntimeError: boom")
    for r, other in ((fast, "s.base"), (slow, "s.base"), (lone, "s.missing"), (broken, "s.base")):
        bench.set_aim(r, other, 1.5, f"<= 1.5x {other}")
    for r in (fast, slow):
        r.ratios["s.base"] = r.seconds / base.seconds
    bench.judge([base, fast, slow, lone, broken])
    assert [r.verdict for r in (base, fast, slow, lone, broken)] == ["no aim", "met", "not met", "unknown", "not met"]
    assert "no verdict: s.missing did not run" in lone.note
    assert set(r.verdict for r in (base, fast, slow, lone, broken)) <= set(bench.VERDICTS)


def test_a_rate_above_its_ceiling_is_flagged_as_noise():
    ceiling = bench.Row("ceilings", "ceilings.matmul_fp32", "matmul", "MKL", seconds=1.0, best=1.0, flops=100.0,
                        rate=100.0, rate_unit="FLOP/s")
    under = bench.Row("attention", "attention.fwd", "under", "cpp-cpu", seconds=1.0, flops=80.0)
    over = bench.Row("attention", "attention.jvp", "over", "cpp-cpu", seconds=1.0, flops=104.0)
    bench.fill_rates([under, over], ceiling, None)
    assert under.of_ceiling == pytest.approx(0.8) and not under.above_ceiling and under.ceiling == ceiling.key
    assert over.of_ceiling == pytest.approx(1.04) and "timing noise" in over.note
    text = bench.format_table([ceiling, under, over])
    assert " 80% " in _row_line(text, "under") and "104%*" in _row_line(text, "over")
    assert "* above its ceiling: timing noise" in text


def test_the_ceiling_is_the_fastest_gemm_of_the_dtypes():
    rows = [bench.Row("ceilings", "ceilings.matmul_fp32", "a", "MKL", flops=1.0, rate=5.0),
            bench.Row("ceilings", "ceilings.matmul_fp32_onednn", "b", "oneDNN", flops=1.0, rate=7.0),
            bench.Row("ceilings", "ceilings.matmul_bf16", "c", "cuBLAS", flops=1.0, rate=9.0),
            bench.Row("ceilings", "ceilings.matmul_fp16", "d", "cuBLAS", flops=1.0, rate=99.0, error="x"),
            bench.Row("ceilings", "ceilings.copy", "e", "copy_", bytes=1.0, rate=50.0)]
    assert bench.gemm_ceiling(rows, (torch.float32,)).key == "ceilings.matmul_fp32_onednn"
    assert bench.gemm_ceiling(rows, (torch.bfloat16, torch.float32)).key == "ceilings.matmul_bf16"
    assert bench.gemm_ceiling(rows, (torch.float16,)) is None


@pytest.mark.slow
def test_planned_rows_counts_what_run_measures(monkeypatch):
    """The progress total is the number of progress calls of a run (every row timed as a no-op)."""
    import importlib
    measure, attention = (importlib.import_module(f"condinit.bench.{m}") for m in ("measure", "attention_rows"))
    timing = measure.Timing(1e-3, 1e-3, [1e-3])
    monkeypatch.setattr(measure.Timer, "__call__", lambda self, fn, scale=1.0: timing)
    monkeypatch.setattr(attention, "sdpa_best", lambda *a, **k: ("MATH", timing, {}))
    for sections, skip in ((("ceilings",), ()), (("ceilings", "init", "attention"), ("math_jvp", "batched_qr"))):
        cfg = bench.default_config("cpu", quick=True, sections=sections, skip=skip)
        calls = []
        bench.run(cfg, progress=calls.append)
        assert len(calls) == bench.planned_rows(cfg), (sections, calls)


@pytest.mark.parametrize("rate, unit, shown", [(153.5e9, "FLOP/s", "154 GFLOP/s"), (15.94e9, "FLOP/s", "15.9 GFLOP/s"),
                                               (5e9, "FLOP/s", "5.00 GFLOP/s"), (989e12, "FLOP/s", "989 TFLOP/s"),
                                               (4.8e12, "B/s", "4800 GB/s")])
def test_a_rate_fits_its_column(rate, unit, shown):
    row = bench.Row("attention", "attention.fwd", "fwd", "cuda", seconds=1.0, rate=rate, rate_unit=unit)
    line = _row_line(bench.format_table([row]), "fwd")
    assert f"  {shown}  " in line


def test_ceiling_plan_per_device():
    """The GEMM ceilings each run measures: on the CPU MKL at the run's size and cache-resident at
    512, oneDNN at 512 for fp32; on GPUs cuBLAS in the dtype and in fp32 (planned without a GPU)."""
    onednn = [("matmul_fp32_onednn", torch.float32, 512, "oneDNN")] if torch.backends.mkldnn.is_available() else []
    mkl = "MKL" if torch.backends.mkl.is_available() else "torch CPU BLAS"
    assert bench.ceiling_plan(bench.default_config("cpu", quick=True)) == \
        [("matmul_fp32", torch.float32, 512, mkl)] + onednn
    assert bench.ceiling_plan(bench.default_config("cpu")) == \
        [("matmul_fp32", torch.float32, 2048, mkl), ("matmul_fp32_512", torch.float32, 512, mkl)] + onednn
    assert bench.ceiling_plan(bench.default_config("cuda")) == \
        [("matmul_bf16", torch.bfloat16, 8192, "cuBLAS"), ("matmul_fp32", torch.float32, 8192, "cuBLAS")]
