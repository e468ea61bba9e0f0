"""One model directory written by several ranks (torchrun, gloo on the CPU): the same bytes as one
process, a failed or killed rank leaves no final-named partial shard and no index, a resume works
with another number of ranks, one run per directory; --dry-run plans for N ranks, past too little
disk space and a missing parent directory."""
import os
import random
import subprocess
import sys
import textwrap

import pytest

transformers = pytest.importorskip("transformers")

from condinit.cli import main  # noqa: E402
from condinit.io.dirlock import directory_lock  # noqa: E402
from condinit.models.stream import WEIGHTS_INDEX_NAME, assign, write_checkpoint, write_pretrained  # noqa: E402
from helpers import LLAMA_GQA, llama_config  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
_SHARD = "40KB"


def tiny_config():
    return llama_config(LLAMA_GQA, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def _files(d) -> dict:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The config file and the directory one process writes from it (the CLI, in this process)."""
    root = tmp_path_factory.mktemp("ranks")
    tiny_config().save_pretrained(root / "cfg")
    cfg = str(root / "cfg" / "config.json")
    assert main(["init", "--config", cfg, "--out", f"{root}/ref/", "--max-shard-size", _SHARD, "--quiet"]) == 0
    expected = _files(root / "ref")
    assert sum(n.endswith(".safetensors") for n in expected) >= 6, list(expected)
    return cfg, expected


def _torchrun(nproc: int, argv: list, script=None, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    target = ["-m", "condinit"] if script is None else [script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *target, *argv]
    path = os.pathsep.join([_TESTS, os.environ.get("PYTHONPATH", "")])
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    run_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env, cwd=_TESTS)


def _init_args(cfg, out, *more):
    return ["init", "--config", cfg, "--out", f"{out}{os.sep}", "--max-shard-size", _SHARD, "--quiet", *more]


# torchrun runs this file as each rank: rank FAIL_RANK fails at its FAIL_AT-th attention projection
# computed (FAIL_MODE "raise": an exception; "kill": the process ends at once, as on SIGKILL), then
# the condinit command line runs with the arguments given.
_FAILING_RANK = textwrap.dedent("""
    import os, sys
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
    from helpers import on_real_init

    def fail():
        if os.environ["FAIL_MODE"] == "kill":
            os._exit(9)
        raise RuntimeError("generation failed (simulated)")

    if os.environ["RANK"] == os.environ["FAIL_RANK"]:
        LlamaPreTrainedModel._init_weights = on_real_init(int(os.environ["FAIL_AT"]), fail)
    from condinit.cli import run
    run(sys.argv[1:])
""")


def test_assign_gives_every_shard_once_balanced_by_bytes():
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for _ in range(50):
        sizes = {f"f{i}": rng.randrange(1, 1000) for i in range(rng.randrange(0, 40))}
        world = rng.randrange(1, 9)
        shares = assign(sizes, world)
        assert len(shares) == world
        flat = [f for s in shares for f in s]
        assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat))
        order = list(sizes)
        assert all(s == sorted(s, key=order.index) for s in shares)          # each rank in file order
        loads = [sum(sizes[f] for f in s) for s in shares]
        # largest first, each to the least loaded: no rank carries more than the lightest plus one file
        assert max(loads) - min(loads) <= max(sizes.values(), default=0)
        assert assign(dict(sizes), world) == shares                          # deterministic
    assert assign({"a": 5, "b": 5, "c": 2, "d": 1}, 2) == [["a", "c"], ["b", "d"]]
    assert assign({"a": 1}, 3) == [["a"], [], []]


@pytest.mark.slow
def test_dry_run_plans_past_too_little_disk_and_a_missing_parent(tmp_path, monkeypatch, capsys):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    out = tmp_path / "not" / "yet" / "out"
    rep = write_pretrained(tiny_config(), out, max_shard_size=_SHARD, dry_run=True, world_size=3)
    plan = rep.plan
    assert len(plan.refusals) == 2, plan.refusals
    assert "parent directory" in plan.refusals[0] and str(out.parent) in plan.refusals[0]
    assert plan.refusals[1].startswith(f"not enough disk space for {out}") and "1.00 kB free" in plan.refusals[1]
    assert len(plan.ranks) == 3 and sorted(f for s in plan.ranks for f in s.files) == sorted(f.name for f in plan.files)
    assert sum(s.bytes for s in plan.ranks) == sum(f.size for f in plan.files)
    assert all(s.estimated_seconds > 0 for s in plan.ranks)
    assert plan.estimated_seconds == max(s.estimated_seconds for s in plan.ranks)
    assert not (tmp_path / "not").exists()
    # the real write refuses with the same numbers, before writing anything
    with pytest.raises(ValueError) as err:
        write_pretrained(tiny_config(), out, max_shard_size=_SHARD)
    assert str(err.value) == plan.refusals[0]
    os.makedirs(out.parent)
    with pytest.raises(ValueError) as err:
        write_pretrained(tiny_config(), out, max_shard_size=_SHARD)
    assert str(err.value) == plan.refusals[1]
    assert os.listdir(out.parent) == []
    with pytest.raises(ValueError, match="world_size=2: .* dry_run=True only"):
        write_pretrained(tiny_config(), out, max_shard_size=_SHARD, world_size=2)
    one = tmp_path / "one.safetensors"     # one file: the same for the disk space
    refusals = write_checkpoint(tiny_config(), one, dry_run=True).plan.refusals
    assert len(refusals) == 1 and refusals[0].startswith(f"not enough disk space for {one}")
    with pytest.raises(ValueError) as err:
        write_checkpoint(tiny_config(), one)
    assert str(err.value) == refusals[0] and not one.exists()
    # the command line prints the refusal and each rank's share
    tiny_config().save_pretrained(tmp_path / "cfg")
    argv = ["init", "--config", str(tmp_path / "cfg" / "config.json"), "--out", f"{tmp_path}/a/b/", "--dry-run",
            "--max-shard-size", _SHARD, "--nproc", "4", "--rank-rate", "100MB"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "the write would be refused: not enough disk space" in text and "parent directory" in text
    assert "4 ranks: " in text and "rank 3: " in text and "expected time at 100.00 MB/s per rank (given)" in text
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_ranks_write_the_bytes_of_one_process(tmp_path, reference, nproc):
    cfg, expected = reference
    out = tmp_path / "out"
    proc = _torchrun(nproc, _init_args(cfg, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(out), proc.stdout       # rank 0 alone prints
    assert _files(out) == expected


@pytest.mark.slow
def test_nproc_launches_the_ranks(tmp_path, reference):
    cfg, expected = reference
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "condinit"] + _init_args(cfg, out)[:-1] + ["--nproc", "2"],
                          capture_output=True, text=True, timeout=300, cwd=_TESTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks wrote" in proc.stdout and "rank 1 " in proc.stdout, proc.stdout[-2000:]
    assert _files(out) == expected


@pytest.mark.slow
def test_failed_rank_fails_every_rank_cleanly(tmp_path, reference):
    cfg, expected = reference
    script = tmp_path / "failing_rank.py"
    script.write_text(_FAILING_RANK)
    out = tmp_path / "out"
    proc = _torchrun(2, _init_args(cfg, out), str(script), env=dict(FAIL_RANK="1", FAIL_AT="2", FAIL_MODE="raise"))
    assert proc.returncode != 0
    assert "generation failed (simulated)" in proc.stderr
    # rank 0 finished its own shards and names rank 1 and the shard it failed in, in one line
    assert "condinit init: error: rank 1 of 2 failed writing model-" in proc.stderr, proc.stderr[-3000:]
    left = sorted(os.listdir(out))
    assert not any(n.startswith(".") for n in left), left           # no temporary file, no lock
    assert WEIGHTS_INDEX_NAME not in left and "config.json" not in left, left
    shards = [n for n in left if n.endswith(".safetensors")]
    assert 0 < len(shards) < sum(n.endswith(".safetensors") for n in expected)
    assert all(_files(out)[n] == expected[n] for n in shards)        # complete shards only


@pytest.mark.slow
def test_killed_rank_then_resume_with_three_ranks(tmp_path, reference):
    cfg, expected = reference
    script = tmp_path / "failing_rank.py"
    script.write_text(_FAILING_RANK)
    out = tmp_path / "out"
    proc = _torchrun(2, _init_args(cfg, out), str(script), env=dict(FAIL_RANK="1", FAIL_AT="3", FAIL_MODE="kill"))
    assert proc.returncode != 0
    left = sorted(os.listdir(out))
    assert WEIGHTS_INDEX_NAME not in left, left
    final = [n for n in left if n.endswith(".safetensors")]
    assert len(final) < sum(n.endswith(".safetensors") for n in expected)
    assert all(_files(out)[n] == expected[n] for n in final)         # no final-named partial shard
    with pytest.raises(Exception):
        transformers.AutoModelForCausalLM.from_pretrained(out)       # never a directory that loads
    # resumed by three ranks: the complete shards kept, the rest written, the killed rank's
    # temporary file swept; the directory is the one process's
    proc = _torchrun(3, _init_args(cfg, out, "--resume"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _files(out) == expected


@pytest.mark.slow
def test_second_run_into_a_locked_directory_is_refused_on_every_rank(tmp_path, reference):
    cfg, _ = reference
    out = tmp_path / "out"
    out.mkdir()
    with directory_lock(out):      # another run holds the directory
        proc = _torchrun(2, _init_args(cfg, out))
        assert proc.returncode != 0
        # both ranks refuse (their stderr lines may interleave: count the messages, not the lines)
        lines = proc.stderr.split("condinit init: error:")[1:]
        assert len(lines) == 2, proc.stderr[-3000:]
        assert all(f"out_dir {out} is being written by PID {os.getpid()}" in l for l in lines), lines
        assert sorted(os.listdir(out)) == [".condinit.lock"]
