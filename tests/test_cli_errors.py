"""The command line's one error path: every OSError and every malformed input file is one line on
stderr naming the file, exit status 2, nothing left behind; output paths checked before any work."""
from __future__ import annotations

import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys

import pytest

from helpers import run_cli


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


# -- every OSError: one line naming the file ---------------------------------------------------------

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EACCES, errno.EROFS, errno.ENAMETOOLONG,
                                  errno.EMFILE, errno.ENOENT, errno.EIO])
def test_an_os_error_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, code):
    import condinit.commands.info as info

    target = str(tmp_path / "model.safetensors")

    def fail():
        raise OSError(code, os.strerror(code), target)

    monkeypatch.setattr(info, "collect", fail)
    rc, out, err = run_cli(capsys, "info")
    line = _one_line(err)
    assert rc == 2 and out == ""
    assert line.startswith(f"condinit info: error: {target}: {os.strerror(code)} ({errno.errorcode[code]}")
    if code == errno.ENOSPC:
        assert "bytes left on its filesystem" in line


def test_an_os_error_without_a_file_and_with_notes_is_still_one_line(capsys, monkeypatch):
    import condinit.commands.info as info

    def fail():
        exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        exc.add_note("model-00002-of-00003.safetensors: 4096 bytes missing")
        raise exc

    monkeypatch.setattr(info, "collect", fail)
    rc, _, err = run_cli(capsys, "info")
    assert rc == 2
    assert _one_line(err) == (f"condinit info: error: {os.strerror(errno.ENOSPC)} (ENOSPC); "
                              f"model-00002-of-00003.safetensors: 4096 bytes missing")


def test_a_multi_line_message_is_printed_on_one_line(capsys, monkeypatch):
    import condinit.commands.info as info

    def fail():
        raise ValueError("first part\n  second part\n")

    monkeypatch.setattr(info, "collect", fail)
    rc, _, err = run_cli(capsys, "info")
    assert rc == 2 and _one_line(err) == "condinit info: error: first part second part"


def test_debug_shows_the_os_error_itself(capsys, monkeypatch):
    import condinit.commands.info as info

    def fail():
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), "x.safetensors")

    monkeypatch.setattr(info, "collect", fail)
    from condinit.cli import main
    assert run_cli(capsys, "info").rc == 2
    with pytest.raises(OSError, match="File too large"):
        main(["--debug", "info"])


# -- a file-size limit hit mid-write, for real ---------------------------------------------------------

FSIZE_LIMIT = 100_000   # bytes: config.json fits, the first weights file does not


def _init_under_file_size_limit(out: str, cwd) -> subprocess.CompletedProcess:
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # write() then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))

    return subprocess.run([sys.executable, "-m", "condinit", "init", "--preset", "tiny-llama", "--out", out],
                          cwd=cwd, preexec_fn=limit, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def efbig_directory(tmp_path_factory):
    """``condinit init --out DIR/`` under a file-size limit; DIR held one unrelated file before."""
    d = tmp_path_factory.mktemp("efbig") / "ckpt"
    d.mkdir()
    (d / "notes.txt").write_text("kept\n")
    res = _init_under_file_size_limit(str(d) + os.sep, d.parent)
    return d, res


@pytest.mark.slow
def test_file_size_limit_writing_a_directory_is_one_line_exit_2(efbig_directory):
    d, res = efbig_directory
    assert res.returncode == 2, res.stderr
    line = _one_line(res.stderr)
    assert line.startswith(f"condinit init: error: {d}") and "File too large (EFBIG" in line
    assert re.match(rf"condinit init: error: {re.escape(str(d))}/model[-0-9of]*\.safetensors: ", line), line
    assert f"the file-size limit, ulimit -f, is {FSIZE_LIMIT} bytes" in line
    left = set(os.listdir(d))
    assert not [n for n in left if n.endswith((".tmp", ".safetensors")) or n.startswith(".")], left


@pytest.mark.slow
def test_file_size_limit_writing_a_directory_leaves_only_what_was_there(efbig_directory):
    d, res = efbig_directory
    assert res.returncode == 2
    assert sorted(os.listdir(d)) == ["notes.txt"]


@pytest.mark.slow
def test_file_size_limit_writing_one_file_names_it_and_leaves_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("kept\n")
    res = _init_under_file_size_limit("model.safetensors", tmp_path)
    assert res.returncode == 2, res.stderr
    line = _one_line(res.stderr)
    assert line.startswith(f"condinit init: error: {tmp_path / 'model.safetensors'}: File too large (EFBIG")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


# -- output paths checked before any work -----------------------------------------------------------

def test_bench_json_into_a_missing_directory_is_refused_before_running(tmp_path, capsys, monkeypatch):
    import condinit.bench as bench

    ran = []
    monkeypatch.setattr(bench, "run", lambda *a, **k: ran.append(1) or [])
    target = tmp_path / "missing" / "bench.json"
    rc, out, err = run_cli(capsys, "bench", "--quick", "--device", "cpu", "--no-progress", "--json", str(target))
    assert rc == 2 and not ran and out == ""
    assert _one_line(err) == f"condinit bench: error: output directory {target.parent} does not exist"


def test_bench_json_that_is_a_directory_is_refused_before_running(tmp_path, capsys, monkeypatch):
    import condinit.bench as bench

    ran = []
    monkeypatch.setattr(bench, "run", lambda *a, **k: ran.append(1) or [])
    rc, _, err = run_cli(capsys, "bench", "--quick", "--device", "cpu", "--no-progress", "--json", str(tmp_path))
    assert rc == 2 and not ran
    assert f"output {tmp_path} is a directory" in _one_line(err)


@pytest.mark.parametrize("flag, name", [("--json", "r.json"), ("--plot", "r.png")])
def test_probe_outputs_are_checked_before_the_checkpoint_is_read(tmp_path, capsys, flag, name):
    target = tmp_path / "missing" / name
    rc, out, err = run_cli(capsys, "probe", str(tmp_path / "absent.safetensors"), "--preset", "tiny-llama",
                           flag, str(target))
    assert rc == 2 and out == ""
    assert _one_line(err) == f"condinit probe: error: output directory {target.parent} does not exist"


def test_init_directory_under_a_file_is_refused_before_building_the_model(tmp_path, capsys, monkeypatch):
    import condinit.models.presets as presets

    built = []
    monkeypatch.setattr(presets, "build_model", lambda *a, **k: built.append(1))
    (tmp_path / "file").write_text("")
    rc, _, err = run_cli(capsys, "init", "--out", str(tmp_path / "file" / "ckpt") + os.sep)
    assert rc == 2 and not built
    assert "not a directory" in _one_line(err)


def test_init_config_nested_too_deeply_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text("[" * 100_000 + "]" * 100_000)
    rc, _, err = run_cli(capsys, "init", "--config", str(cfg), "--out", str(tmp_path / "m.safetensors"))
    assert rc == 2
    assert _one_line(err) == f"condinit init: error: config {cfg} is not readable JSON: nested too deeply"
    assert sorted(os.listdir(tmp_path)) == ["config.json"]


# -- condinit plot of a malformed monitor log ----------------------------------------------------------

def _record(step, layer=0, **fields):
    return {"step": step, "layer": layer, "name": f"layers.{layer}.attn", "kappa": 1.5,
            "max_logit": 2.0, "entropy_mean": 1.0, **fields}


def _log(tmp_path, *lines) -> str:
    path = tmp_path / "jacobian.jsonl"
    with open(path, "wb") as fh:
        for line in lines:
            fh.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
    return str(path)


@pytest.mark.parametrize("bad, why", [
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "not a JSON line (nested too deeply)"),
    (b'{"step": 1, "layer": {"a": ' * 20_000 + b"0" + b"}" * 20_000 + b"}\n", "not a JSON line (nested too deeply)"),
    (_record("3"), "field 'step' is a string, expected an integer"),
    (_record(3, layer=1.0), "field 'layer' is a float, expected an integer"),
    (_record(3, layer=True), "field 'layer' is a boolean, expected an integer"),
    (_record(3, kappa="big"), "field 'kappa' is a string, expected a number or null"),
    (_record(3, entropy_mean=[1.0]), "field 'entropy_mean' is a list, expected a number or null"),
    (_record(3, name=7), "field 'name' is an integer, expected a string"),
    (_record(3, alert={"kind": "kappa"}), "field 'alert' is an object, expected a string"),
    (b'{"step": 1, "layer": 0, "kappa": 1.0\xff}\n', "not UTF-8 text (byte 36)"),
    (b'{"step": ' + b"9" * 5000 + b', "layer": 0}\n', "not a JSON line (Exceeds the limit"),
], ids=["nested-list", "nested-object", "step-str", "layer-float", "layer-bool", "kappa-str", "entropy-list",
        "name-int", "alert-object", "not-utf8", "huge-int"])
def test_plot_of_a_malformed_line_names_the_file_line_and_field(tmp_path, capsys, bad, why):
    path = _log(tmp_path, _record(0), b"\n", bad, _record(1))
    rc, out, err = run_cli(capsys, "plot", str(tmp_path), "--out", str(tmp_path / "plots"))
    assert rc == 2 and out == ""
    assert _one_line(err).startswith(f"condinit plot: error: {path}:3: {why}")
    assert not (tmp_path / "plots").exists() or not os.listdir(tmp_path / "plots")


def test_plot_checks_every_output_file_before_writing_any(tmp_path, capsys):
    _log(tmp_path, _record(0), _record(1))
    out = tmp_path / "plots"
    (out / "entropy.png").mkdir(parents=True)
    rc, _, err = run_cli(capsys, "plot", str(tmp_path), "--out", str(out))
    assert rc == 2
    assert f"output {out / 'entropy.png'} is a directory" in _one_line(err)
    assert sorted(os.listdir(out)) == ["entropy.png"]


def test_plot_out_under_a_file_is_refused(tmp_path, capsys):
    _log(tmp_path, _record(0))
    (tmp_path / "file").write_text("")
    rc, _, err = run_cli(capsys, "plot", str(tmp_path), "--out", str(tmp_path / "file" / "plots"))
    assert rc == 2 and "not a directory" in _one_line(err)


def test_plot_and_demo_create_their_directory_only_in_an_existing_parent(tmp_path, capsys):
    """As init --out DIR/: the directory is created, its missing parents are not (a typo in the path
    is refused, nothing is created)."""
    _log(tmp_path, _record(0), _record(1))
    out = tmp_path / "missing" / "plots"
    for argv in (("plot", str(tmp_path), "--out", str(out)),
                 ("demo", "--quick", "--task", "mqar-32", "--no-progress", "--out", str(out))):
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2 and f"its parent directory '{out.parent}' does not exist" in _one_line(err), err
        assert not (tmp_path / "missing").exists()
    rc, _, err = run_cli(capsys, "plot", str(tmp_path), "--out", str(tmp_path / "plots"))
    assert rc == 0 and sorted(os.listdir(tmp_path / "plots")), err


def test_plot_replaces_a_symlink_in_the_output_directory_never_its_target(tmp_path, capsys):
    """A PNG's name in the output directory that is a symlink (to a file outside, or dangling) is
    replaced by the PNG itself: nothing is written through the link."""
    _log(tmp_path, _record(0), _record(1))
    outside, absent = tmp_path / "outside.txt", tmp_path / "absent.png"
    outside.write_bytes(b"not yours\n")
    out = tmp_path / "plots"
    out.mkdir()
    os.symlink(outside, out / "kappa.png")
    os.symlink(absent, out / "entropy.png")
    rc, _, err = run_cli(capsys, "plot", str(tmp_path), "--out", str(out))
    assert rc == 0, err
    assert outside.read_bytes() == b"not yours\n" and not absent.exists()
    for name in ("kappa.png", "entropy.png", "max_logit.png"):
        assert not os.path.islink(out / name) and (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.parametrize("command", ["inspect", "probe"])
def test_plot_must_be_a_png_before_anything_is_read(tmp_path, capsys, command):
    """--plot of another format is refused naming the flag, before the checkpoint is opened (the file
    named does not even exist)."""
    argv = [command, str(tmp_path / "absent.safetensors"), "--plot", str(tmp_path / "kappa.txt")]
    if command == "probe":
        argv += ["--preset", "tiny-llama"]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and _one_line(err) == f"condinit {command}: error: --plot must name a .png file, got " \
                                         f"{tmp_path / 'kappa.txt'}", err
    assert os.listdir(tmp_path) == []


def test_unknown_model_type_is_a_short_line_with_suggestions(tmp_path, capsys):
    """--config with a model_type transformers does not know: one short line, the near names."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model_type": "lama", "hidden_size": 8}))
    rc, _, err = run_cli(capsys, "init", "--config", str(cfg), "--out", str(tmp_path / "m.safetensors"))
    line = _one_line(err)
    # short apart from the path it names (pytest's temporary directories grow with the runs)
    assert rc == 2 and len(line) - len(str(cfg)) < 160 and "model_type 'lama'" in line and "llama" in line, line
    assert sorted(os.listdir(tmp_path)) == ["c.json"]
