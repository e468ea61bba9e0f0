"""Directory outputs: every file of ``condinit init --out DIR/`` is written inside DIR, never through a
symlink in it (refused, or with ``--overwrite`` the link itself replaced), and one writer per
directory at a time (a lock file in DIR, its holder's PID and host in the refusal, stale locks taken
over, released on exit and on SIGTERM; two real ``condinit init`` processes into one directory: one
refused, never a mix)."""
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

transformers = pytest.importorskip("transformers")

from condinit.io.dirlock import LOCK_NAME, DirectoryLocked, directory_lock  # noqa: E402
from condinit.models.stream import write_pretrained  # noqa: E402

from helpers import LLAMA_SMALL, llama_config, run_cli, write_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD1 = "model-00001-of-00002.safetensors"


def tiny_config():
    return llama_config(LLAMA_SMALL, initializer_range=0.02)


def write(out, **kw):
    return write_pretrained(tiny_config(), out, max_shard_size=60_000, **kw)


def snapshot(d):
    """Every entry of ``d``: a regular file's bytes, or ("link", target)."""
    result = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if os.path.islink(p):
            result[name] = ("link", os.readlink(p))
        elif not os.path.isfile(p):
            result[name] = ("not a file", os.lstat(p).st_mode)
        else:
            with open(p, "rb") as fh:
                result[name] = fh.read()
    return result


@pytest.fixture
def written(tmp_path):
    """A two-shard directory, and a file outside it."""
    out = tmp_path / "out"
    rep = write(out, seed=1)
    assert [os.path.basename(f) for f in rep.files] == [SHARD1, "model-00002-of-00002.safetensors"]
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not yours\n")
    return out, outside


@pytest.mark.parametrize("name, kw", [(SHARD1, {"resume": True}), (SHARD1, {}),
                                      ("generation_config.json", {}), ("config.json", {}),
                                      ("model.safetensors.index.json", {"resume": True})])
def test_symlink_in_dir_is_refused_and_nothing_written(written, name, kw):
    out, outside = written
    os.unlink(out / name)
    os.symlink(outside, out / name)
    before = snapshot(out)
    with pytest.raises(ValueError, match=rf"{name} is a symlink to {outside}.*--overwrite"):
        write(out, seed=1, **kw)
    assert outside.read_bytes() == b"not yours\n"
    assert snapshot(out) == before


@contextlib.contextmanager
def _deadline(seconds):
    """Raise TimeoutError in the main thread after ``seconds`` (a blocking open of a FIFO included)."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("kw", [{}, {"overwrite": True}, {"resume": True}], ids=["plain", "overwrite", "resume"])
@pytest.mark.parametrize("name", [SHARD1, "config.json", "generation_config.json", "model.safetensors.index.json"])
def test_a_fifo_in_the_place_of_a_file_is_refused_before_anything(written, name, kw):
    """Never opened (a FIFO would block the write), never written through, refused before any file."""
    out, _ = written
    os.unlink(out / name)
    os.mkfifo(out / name)
    before = snapshot(out)
    with _deadline(60), pytest.raises(ValueError, match=rf"{out}[:/] ?{name} is a FIFO \(named pipe\)"):
        write(out, seed=1, **kw)
    assert snapshot(out) == before


def test_cli_directory_in_the_place_of_the_index_is_one_line(written, capsys):
    out, _ = written
    os.unlink(out / "model.safetensors.index.json")
    os.mkdir(out / "model.safetensors.index.json")
    before = snapshot(out)
    r = run_cli(capsys, "init", "--config", _config_file(out.parent), "--out", f"{out}/", "--overwrite",
                "--max-shard-size", "60000", "--seed", "1")
    assert r.rc == 2 and r.err == (f"condinit init: error: out_dir {out}: model.safetensors.index.json is a directory; "
                                   f"condinit writes a directory's files as regular files: remove it\n"), r
    assert snapshot(out) == before


def test_overwrite_replaces_the_link_itself(written):
    out, outside = written
    good = snapshot(out)
    for name in (SHARD1, "generation_config.json", "config.json"):
        os.unlink(out / name)
        os.symlink(outside, out / name)
    write(out, seed=1, overwrite=True, resume=True)
    assert outside.read_bytes() == b"not yours\n"
    assert snapshot(out) == good            # regular files again, the same bytes
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


def test_cli_resume_through_symlinked_shard_is_one_line(written, capsys):
    out, outside = written
    os.unlink(out / SHARD1)
    os.symlink(outside, out / SHARD1)
    r = run_cli(capsys, "init", "--config", _config_file(out.parent), "--out", f"{out}/", "--resume",
                "--max-shard-size", "60000", "--seed", "1")
    assert r.rc == 2 and len(r.err.strip().splitlines()) == 1, r
    assert f"{SHARD1} is a symlink to {outside}" in r.err
    assert outside.read_bytes() == b"not yours\n"


@pytest.mark.parametrize("name", ["model-00001-of-00009.safetensors", "model.safetensors",
                                  "model.safetensors.index.json"])
def test_resume_never_reads_through_a_link_out_of_the_directory(written, monkeypatch, name):
    """A symlink at a name the plan does not write, to a copy of one of this model's own shards (or
    its index) outside DIR: a resume refuses it naming the link, and opens no file outside DIR."""
    from condinit.models.stream import destination
    out, _ = written
    one = write_pretrained(tiny_config(), out.parent / "one", seed=1)    # a single-file write: no index
    outside = out.parent / ("copy.json" if name.endswith(".json") else "copy.safetensors")
    outside.write_bytes((out / ("model.safetensors.index.json" if name.endswith(".json") else SHARD1)).read_bytes())
    target = out.parent / "one" if name.endswith(".json") else out
    before = snapshot(target)
    os.symlink(outside, target / name)
    opened = []

    def spy(fn):
        def wrapped(path, *a, **kw):
            opened.append(os.path.realpath(path))
            return fn(path, *a, **kw)
        return wrapped
    monkeypatch.setattr(destination, "open", spy(open), raising=False)
    monkeypatch.setattr(destination, "read_header", spy(destination.read_header))
    with pytest.raises(ValueError, match=rf"{name} is a symlink to {outside}, outside the directory"):
        if target == out:
            write(out, seed=1, resume=True)
        else:
            write_pretrained(tiny_config(), target, seed=1, resume=True)
    assert all(p.startswith(str(target) + os.sep) for p in opened), opened
    os.unlink(target / name)
    assert snapshot(target) == before and len(one.files) == 1


def _config_file(d):
    return str(write_config(d, tiny_config()))


def test_lock_file_is_not_left_in_the_checkpoint(tmp_path):
    out = tmp_path / "out"
    write(out, seed=0)
    assert LOCK_NAME not in os.listdir(out)


def test_locked_directory_is_refused_with_pid_and_host(written):
    out, _ = written
    before = snapshot(out)
    with directory_lock(str(out)):
        with pytest.raises(DirectoryLocked, match=rf"PID {os.getpid()} on host {socket.gethostname()}"):
            write(out, seed=2, overwrite=True)
        with pytest.raises(DirectoryLocked):
            write(out, seed=1, resume=True)
    assert {k: v for k, v in snapshot(out).items()} == before
    write(out, seed=2, overwrite=True)    # released


def test_leftover_lock_file_of_a_dead_writer_is_taken_over(written):
    out, _ = written
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    (out / LOCK_NAME).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    write(out, seed=1)
    assert LOCK_NAME not in os.listdir(out)


def test_lock_file_symlink_is_refused(written):
    out, outside = written
    os.symlink(outside, out / LOCK_NAME)
    with pytest.raises(ValueError, match=rf"{LOCK_NAME} is a symlink"):
        write(out, seed=1)
    assert outside.read_bytes() == b"not yours\n"


# holds the lock on sys.argv[1] (the directory_lock of a writer) until stdin closes or SIGTERM;
# with sys.argv[2] == "orphan" it hands the locked descriptor to a child and exits, so the lock is
# held by a process that is not the one the lock file names
_HOLDER = textwrap.dedent("""
    import os, subprocess, sys
    from condinit.io.atomic import removing_temps_on_sigterm
    from condinit.io.dirlock import directory_lock
    with removing_temps_on_sigterm(), directory_lock(sys.argv[1]) as lock:
        if sys.argv[2] == "orphan":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=[lock.fd])
            print(child.pid, flush=True)
            os._exit(0)
        print("held", flush=True)
        sys.stdin.read()
""")


def _holder(out, mode="hold"):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out), mode], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, "the holder did not start"
    return proc, line


def test_second_process_is_refused_while_the_first_holds_the_lock(written, capsys):
    out, _ = written
    before = snapshot(out)
    proc, _ = _holder(out)
    try:
        r = run_cli(capsys, "init", "--config", _config_file(out.parent), "--out", f"{out}/", "--overwrite",
                    "--max-shard-size", "60000", "--seed", "5")
        assert r.rc == 2 and len(r.err.strip().splitlines()) == 1, r
        assert f"PID {proc.pid} on host {socket.gethostname()}" in r.err, r.err
        assert {k: v for k, v in snapshot(out).items() if k != LOCK_NAME} == before
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    assert LOCK_NAME not in os.listdir(out)    # removed on SIGTERM
    write(out, seed=5, overwrite=True)          # and released


def test_lock_held_by_an_orphan_of_a_dead_writer_is_stale(written):
    out, _ = written
    proc, child = _holder(out, "orphan")
    proc.wait(timeout=30)
    try:
        fd = os.open(out / LOCK_NAME, os.O_RDWR)
        try:   # still held, by the orphan
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        write(out, seed=1)     # the file names a dead PID: taken over
        assert LOCK_NAME not in os.listdir(out)
    finally:
        os.kill(int(child), signal.SIGKILL)


def test_dcp_write_into_a_locked_directory_is_refused_before_any_work(tmp_path):
    """``write_torchtitan_seed`` takes the lock ``condinit init --out DIR/`` takes: while another
    process holds it, the write is refused naming that PID and host, and leaves nothing."""
    from condinit.models.engines.dcp import write_torchtitan_seed
    out = tmp_path / "seed"
    out.mkdir()
    proc, _ = _holder(out)
    try:
        t0 = time.perf_counter()
        with pytest.raises(DirectoryLocked, match=rf"PID {proc.pid} on host {socket.gethostname()}"):
            write_torchtitan_seed("llama3:debugmodel", out, seed=1)
        assert time.perf_counter() - t0 < 2.0      # refused at its first check: nothing built
        assert sorted(os.listdir(tmp_path)) == ["seed"] and os.listdir(out) == [LOCK_NAME]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    assert os.listdir(out) == []


def test_dcp_out_dir_symlink_is_resolved_by_its_check(tmp_path):
    """The library's check of a DCP directory resolves a symlink (the files are moved into the
    directory it names), and refuses a link to a directory that is not empty, naming that directory."""
    from condinit.models.engines.dcp import check_empty_dir
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    assert check_empty_dir(tmp_path / "link") == str(tmp_path / "real")
    assert check_empty_dir(str(tmp_path / "link") + "/") == str(tmp_path / "real")
    (tmp_path / "real" / LOCK_NAME).write_text("{}")          # a lock file left behind is not content
    assert check_empty_dir(tmp_path / "link") == str(tmp_path / "real")
    (tmp_path / "real" / "x").write_text("")
    with pytest.raises(ValueError, match=rf"out_dir {tmp_path / 'real'} is not empty"):
        check_empty_dir(tmp_path / "link")


def test_sigterm_removes_a_registered_temporary_directory_whole(tmp_path):
    """A directory registered for removal on SIGTERM (a DCP write's temporary directory, files in it)
    is removed with everything in it when the writer is terminated; the lock file too."""
    script = textwrap.dedent("""
        import os, sys
        from condinit.io.atomic import removed_on_sigterm, removing_temps_on_sigterm
        from condinit.io.dirlock import directory_lock
        tmp = sys.argv[1] + "/.partial"
        os.makedirs(tmp + "/sub")
        open(tmp + "/__0_0.distcp", "wb").write(b"x" * 100)
        with removing_temps_on_sigterm(), directory_lock(sys.argv[1]), removed_on_sigterm(tmp):
            print("held", flush=True)
            sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    assert sorted(os.listdir(tmp_path)) == [".condinit.lock", ".partial"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert os.listdir(tmp_path) == []


# a model large enough that writing it takes a while (about 70 MB in float32)
_SLOW_CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32000}


def _condinit(*argv, **kw):
    return subprocess.Popen([sys.executable, "-m", "condinit", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _lock_holder_pid(out):
    try:
        return json.loads((out / LOCK_NAME).read_text()).get("pid")
    except (OSError, ValueError):
        return None


def _stop_once_locked(proc, out):
    """SIGSTOP ``proc`` as soon as it holds ``out``'s lock (it must not end before)."""
    deadline = time.monotonic() + 240
    while _lock_holder_pid(out) != proc.pid:
        assert proc.poll() is None, f"the write ended before it was caught: {proc.communicate()}"
        assert time.monotonic() < deadline, "the write never took the lock"
        time.sleep(0.002)
    proc.send_signal(signal.SIGSTOP)


def _seeds(out):
    """The seed in the condinit entry of the index and of every weights file in ``out``."""
    from condinit.io.safetensors_format import read_header
    seeds = {json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["condinit"]["seed"]}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            seeds.add(json.loads(read_header(str(out / name))["__metadata__"]["condinit"])["seed"])
    return seeds


@pytest.mark.slow   # three condinit processes
def test_two_condinit_processes_into_one_directory_one_refused_never_a_mix(tmp_path):
    """``condinit init --out DIR/ --seed 1`` is caught (SIGSTOP) while it holds DIR's lock; a second
    ``condinit init`` into DIR, with another seed (``--overwrite``) or resuming, is refused naming the
    first one's PID and host; the first then finishes alone: every file is its own."""
    config = write_config(tmp_path, _SLOW_CONFIG)
    out = tmp_path / "out"
    common = ("init", "--config", str(config), "--out", f"{out}/", "--max-shard-size", "20MB", "--quiet")
    first = _condinit(*common, "--seed", "1")
    try:
        _stop_once_locked(first, out)
        assert _lock_holder_pid(out) == first.pid, "the first write finished before it was stopped"
        for extra in (("--seed", "2", "--overwrite"), ("--seed", "1", "--resume")):
            second = _condinit(*common, *extra)
            _, err = second.communicate(timeout=240)
            assert second.returncode == 2 and len(err.strip().splitlines()) == 1, (extra, err)
            assert f"is being written by PID {first.pid} on host {socket.gethostname()}" in err, err
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    names = sorted(os.listdir(out))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert names == sorted(set(index["weight_map"].values()) | {"config.json", "generation_config.json",
                                                                 "model.safetensors.index.json"})
    assert _seeds(out) == {1}
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


@pytest.mark.slow   # torchtitan's debug model is built and written
def test_dcp_out_through_a_symlinked_directory_is_written_into_its_target(tmp_path, capsys):
    """``init --format dcp --out LINK/`` (a DCP directory's files are moved into place when complete): the link
    is resolved before any work, the checkpoint lands in the directory it names, the link stays."""
    pytest.importorskip("torchtitan.models.llama3")
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    r = run_cli(capsys, "init", "--format", "dcp", "--torchtitan", "llama3:debugmodel", "--out",
                f"{tmp_path / 'link'}/", "--quiet")
    assert r.rc == 0, r
    assert os.path.islink(tmp_path / "link") and os.readlink(tmp_path / "link") == "real"
    assert ".metadata" in os.listdir(tmp_path / "real")
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]     # no temporary directory left beside


@pytest.mark.slow   # three condinit processes, two of them write torchtitan's debug model
def test_dcp_write_holds_the_lock_until_its_files_are_in_place(tmp_path):
    """``init --format dcp --out DIR/`` is caught (SIGSTOP) while it holds DIR's lock; a second DCP
    write into DIR is refused at once naming the first's PID and host; the first then finishes alone
    (no lock file, no temporary directory left); a third, stopped the same way, is ended by SIGTERM:
    its lock file is removed and DIR is writable again."""
    pytest.importorskip("torchtitan.models.llama3")
    out = tmp_path / "seed"
    common = ("init", "--format", "dcp", "--torchtitan", "llama3:debugmodel", "--out", f"{out}/", "--quiet")

    first = _condinit(*common, "--seed", "1")
    try:
        _stop_once_locked(first, out)
        second = _condinit(*common, "--seed", "2")
        _, err = second.communicate(timeout=240)
        assert second.returncode == 2 and len(err.strip().splitlines()) == 1, err
        assert f"is being written by PID {first.pid} on host {socket.gethostname()}" in err, err
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]
    assert sorted(os.listdir(tmp_path)) == ["seed"]
    shutil.rmtree(out)
    third = _condinit(*common, "--seed", "3")
    _stop_once_locked(third, out)
    third.send_signal(signal.SIGTERM)
    third.send_signal(signal.SIGCONT)
    third.communicate(timeout=60)
    assert third.returncode == -signal.SIGTERM
    assert LOCK_NAME not in os.listdir(out)
    with directory_lock(str(out)):      # released
        pass


@pytest.mark.slow   # two condinit processes write torchtitan's debug model
def test_two_dcp_writes_at_once_one_refused_in_one_line(tmp_path):
    """Two ``init --format dcp`` into one directory at once: one succeeds, the other is refused in one
    line (the directory is locked by the first, or no longer empty) and leaves nothing."""
    pytest.importorskip("torchtitan.models.llama3")
    out = tmp_path / "seed"
    procs = [_condinit("init", "--format", "dcp", "--torchtitan", "llama3:debugmodel", "--out", f"{out}/",
                       "--seed", str(seed), "--quiet") for seed in (1, 2)]
    results = [(p.communicate(timeout=300)[1], p.returncode)[::-1] for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    err = next(e for rc, e in results if rc == 2)
    assert len(err.strip().splitlines()) == 1 and err.startswith("condinit init: error: "), err
    assert sorted(os.listdir(tmp_path)) == ["seed"]     # no temporary directory left
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]


def test_output_checks_leave_the_directory_untouched(tmp_path):
    """Checking an output file or directory writes nothing there: its listing and modification time
    stay as they were (a refusal later must not look like a write)."""
    from condinit.io.atomic import check_output_dir, check_output_path

    os.utime(tmp_path, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = os.stat(tmp_path).st_mtime_ns
    check_output_path(tmp_path / "model.safetensors")
    check_output_dir(tmp_path)
    check_output_dir(tmp_path / "new")
    assert os.stat(tmp_path).st_mtime_ns == before and os.listdir(tmp_path) == []


def test_an_error_writing_the_temporary_file_names_the_output(tmp_path):
    """An OSError on the temporary file (a full disk, say) names the output it was for, and no
    temporary file is left."""
    import errno

    from condinit.io.atomic import atomic_output

    out = tmp_path / "probe.json"
    with pytest.raises(OSError) as info:
        with atomic_output(out) as tmp:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)
    assert info.value.filename == str(out) and info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []
