"""``condinit bench``: the quick run prints its table and writes valid JSON; every row names the
backend that ran; a forced backend that cannot run fails its rows instead of falling back."""
import json

import pytest
import torch

from condinit import bench
from helpers import run_cli

# The quick CPU attention shape, B=1 H=2 N=128 d=64, causal: 4 B H Nq Nk d, halved for causal
# with Nq = Nk, is 4 * 1 * 2 * 128 * 128 * 64 / 2 FLOPs; the backward 2.5x, the JVP 3x (per
# probe; 4 probes in the multi-probe row), the backward through the tangent output 7.5x.
QUICK_ATTENTION_FLOPS = {"fwd": 4194304.0, "bwd": 10485760.0, "jvp": 12582912.0, "jvp_probes": 50331648.0,
                         "jvp_bwd": 31457280.0}
QUICK_MATMUL_FLOPS = 268435456.0     # 2 n^3, n = 512
# CholeskyQR2 on the quick stack (2 layers, D=512, 8 + 2 heads of 64): 4 GEMMs of 2 d^2 D per
# block, 2 * (8 + 2) = 20 blocks: 4 * 2 * 64^2 * 512 * 20
QUICK_INIT_FLOPS = 335544320.0
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def _run(capsys, *argv):
    return run_cli(capsys, "bench", "--no-progress", *argv)


@pytest.mark.slow
def test_quick_run_prints_the_table_and_valid_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc, out, err = _run(capsys, "--quick", "--device", "cpu", "--json", str(path))
    assert rc == 0, out + err
    data = json.loads(path.read_text())
    assert {"machine", "versions", "flop_conventions", "config", "rows", "date", "timing"} <= set(data)
    assert data["versions"]["torch"] == torch.__version__
    assert data["machine"]["torch_threads"] == torch.get_num_threads()
    assert "4 B H Nq Nk d" in data["flop_conventions"]["attention_fwd"]
    rows = {r["key"]: r for r in data["rows"]}
    expected = {"ceilings.matmul_fp32", "ceilings.copy", "init.batched", "init.per_tensor", "init.floor",
                "init.orthogonal_loop", "init.batched_qr", "init.randn", "init.block_randn", "attention.sdpa_fwd", "attention.sdpa_bwd",
                "attention.fwd", "attention.math_jvp", "attention.jvp", "attention.jvp_probes", "attention.bwd", "attention.math_jvp_bwd",
                "attention.jvp_bwd"}
    assert set(rows) == expected
    for key, r in rows.items():
        assert r["error"] is None, (key, r["error"])
        assert r["seconds"] > 0 and r["backend"] not in ("", "?"), key
        assert r["name"] in out and r["backend"] in out, key     # every row in the table, with its backend
    # automatically chosen: one of the CPU's backends (which one: the forced test below)
    assert rows["attention.jvp"]["backend"] in ("cpp-cpu", "torch")
    assert rows["attention.sdpa_fwd"]["backend"] in SDPA_BACKENDS
    # side by side: ratios to the baselines of the same run, rates against the measured ceilings
    per, batched = rows["init.per_tensor"], rows["init.batched"]
    assert per["ratios"]["init.batched"] == pytest.approx(per["seconds"] / batched["seconds"])
    assert set(batched["ratios"]) == {"init.floor", "init.orthogonal_loop", "init.batched_qr", "init.randn"}
    assert set(rows["attention.jvp"]["ratios"]) == {"attention.math_jvp", "attention.sdpa_fwd"}
    assert set(rows["attention.jvp_probes"]["ratios"]) == {"attention.jvp*4"}
    assert set(rows["attention.jvp_bwd"]["ratios"]) == {"attention.math_jvp_bwd", "attention.sdpa_fwd"}
    matmul = rows["ceilings.matmul_fp32"]
    assert matmul["flops"] == QUICK_MATMUL_FLOPS
    assert matmul["rate"] == pytest.approx(matmul["flops"] / matmul["best"])
    for kind, flops in QUICK_ATTENTION_FLOPS.items():
        assert rows[f"attention.{kind}"]["flops"] == flops, kind
    assert rows["init.batched"]["flops"] == QUICK_INIT_FLOPS
    fwd = rows["attention.fwd"]
    assert fwd["of_ceiling"] == pytest.approx(fwd["rate"] / matmul["rate"])
    assert "time / other row's" in out and "% of ceiling" in out


def test_forced_backend_that_cannot_run_fails_its_rows(capsys):
    """--backend cuda on a CPU tensor: condinit's rows fail with the reason (no silent fallback)."""
    rc, out, err = _run(capsys, "--quick", "--device", "cpu", "--sections", "attention", "--backend", "cuda",
                        "--skip", "math_jvp,math_jvp_bwd", "--repeats", "1")
    assert rc == 1
    for what in ("condinit attention forward", "condinit attention_jvp (1 probe)"):
        line = next(ln for ln in out.splitlines() if what in ln)
        assert "ERROR BackendUnavailableError" in line, line
    assert "SDPA forward, best backend" in out and "attention.fwd" in err


def test_rows_name_the_backend_the_environment_forces(tmp_path, capsys, forced_backend):
    """CONDINIT_BACKEND=torch: every condinit row runs and names the torch reference, the SDPA rows
    still name the SDPA backend that ran."""
    forced_backend("torch")
    path = tmp_path / "bench.json"
    rc, out, err = _run(capsys, "--quick", "--device", "cpu", "--sections", "init,attention", "--repeats", "1",
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


def test_table_shows_errors_and_ratios():
    ok = bench.Row("init", "init.batched", "batched", "torch", seconds=0.5, ratios={"init.floor": 1.25})
    bad = bench.Row("init", "init.floor", "floor", "torch", error="RuntimeError: boom")
    text = bench.format_table([ok, bad])
    assert "1.25x floor" in text and "ERROR RuntimeError: boom" in text and "500.00" in text
