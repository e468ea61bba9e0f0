"""Checkpoint files: atomic writes survive SIGTERM / SIGKILL, modes, symlinks and special files as
destinations, byte-reproducible output, and one-line errors for damaged or hostile checkpoints."""
from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from condinit.commands.inspect import locate_attention, projection_blocks
from condinit.io import atomic
from condinit.io.atomic import atomic_output, check_output_path
from condinit.io.safetensors_format import MAX_HEADER_BYTES
from condinit.models.checkpoint import open_checkpoint, read_metadata, save_model_atomic
from helpers import run_cli

pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _temps(d, base):
    """Temporary files of atomic_output for destination ``base`` in ``d`` (any version's naming)."""
    return sorted(n for n in os.listdir(d) if n.startswith(f".{base}.") and n.endswith(".tmp"))


def _sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


class _Buffers(torch.nn.Module):
    def __init__(self, **tensors):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t)


# ------------------------------------------------------------------------------------------------
# signals

# Writes a ~150 MB checkpoint over argv[1] with the real writer, then pauses before the rename (the
# moment the reported failure left a full-size temporary file behind) until the test signals it.
_WRITER = r"""
import sys, time, torch
import safetensors.torch as st
from condinit.models.checkpoint import save_model_atomic

real_save_model = st.save_model
def save_then_pause(model, filename, metadata=None, force_contiguous=True):
    real_save_model(model, filename, metadata=metadata, force_contiguous=force_contiguous)
    print("written", flush=True)
    time.sleep(120)
st.save_model = save_then_pause

model = torch.nn.Module()
model.register_buffer("w", torch.full((37_500_000,), 1.5))
save_model_atomic(model, sys.argv[1])
"""


@pytest.mark.slow
def test_signal_during_overwrite_keeps_old_file_and_leaves_no_temp(tmp_path):
    # both writers run at once: each spends most of its time importing torch
    runs = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        d = tmp_path / sig.name
        d.mkdir()
        out = d / "model.safetensors"
        save_model_atomic(_Buffers(w=torch.arange(6.0)), out)
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        runs[sig] = (out, out.read_bytes(), proc)
    try:
        for sig, (out, old, proc) in runs.items():
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            line = proc.stdout.readline() if ready else ""
            if line.strip() != "written":
                proc.kill()
                raise AssertionError(f"the writer did not start: {line!r} {proc.communicate()[1]}")
            (tmp,) = _temps(out.parent, out.name)
            assert os.path.getsize(out.parent / tmp) > 150_000_000  # mid-write: full-size data, not yet renamed
            proc.send_signal(sig)
            proc.wait(timeout=60)
    finally:
        for _, _, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for sig, (out, old, proc) in runs.items():
        assert proc.returncode == -sig, sig.name  # terminated by the signal: the conventional status
        assert out.read_bytes() == old, sig.name
        if sig == signal.SIGTERM:
            assert _temps(out.parent, out.name) == []
        else:  # SIGKILL cannot be caught: the next write to the same destination removes the leftover
            assert len(_temps(out.parent, out.name)) == 1
        save_model_atomic(_Buffers(w=torch.arange(3.0)), out)
        assert os.listdir(out.parent) == ["model.safetensors"] and out.read_bytes() != old, sig.name


def _fake_temp(d, base, host, pid, age_s=0.0):
    path = os.path.join(d, f".{base}.{host}.{pid}.{len(os.listdir(d)):08d}.tmp")
    with open(path, "wb") as fh:
        fh.write(b"partial")
    t = time.time() - age_s
    os.utime(path, (t, t))
    return os.path.basename(path)


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_stale_temps_of_the_same_destination(tmp_path):
    out = tmp_path / "m.safetensors"
    host = atomic.HOST_TAG
    dead = _fake_temp(tmp_path, out.name, host, _dead_pid())
    live = _fake_temp(tmp_path, out.name, host, os.getppid())                 # a live writer: kept
    foreign = _fake_temp(tmp_path, out.name, "0badc0de", 1)                   # another host, recent: kept
    old_foreign = _fake_temp(tmp_path, out.name, "0badc0de", 1, age_s=2 * 3600)
    other = _fake_temp(tmp_path, "n.safetensors", host, _dead_pid())          # another destination: kept
    with atomic_output(out) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(b"new")
        # a write in flight in this process is a live writer too: a second write must keep its file
        save_model_atomic(_Buffers(w=torch.ones(2)), out)
        assert os.path.exists(tmp)
    left = set(os.listdir(tmp_path))
    assert dead not in left and old_foreign not in left
    assert {live, foreign, other} <= left
    assert out.read_bytes() == b"new"


def test_sigterm_handler_only_during_write_in_main_thread(tmp_path):
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with atomic_output(tmp_path / "a.txt") as tmp:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
            with open(tmp, "w") as fh:
                fh.write("a")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        def own_handler(signum, frame):  # an application's handler is left alone
            pass
        signal.signal(signal.SIGTERM, own_handler)
        with atomic_output(tmp_path / "b.txt") as tmp:
            assert signal.getsignal(signal.SIGTERM) is own_handler
            open(tmp, "w").close()
        assert signal.getsignal(signal.SIGTERM) is own_handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

        errors = []

        def write_in_thread():
            try:
                save_model_atomic(_Buffers(w=torch.ones(3)), tmp_path / "c.safetensors")
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)
        t = threading.Thread(target=write_in_thread)
        t.start()
        t.join()
        assert errors == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "c.safetensors"]
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------------------------------------
# modes

@pytest.fixture
def umask():
    saved = os.umask(0o022)
    os.umask(saved)

    def set_umask(mask):
        os.umask(mask)
    yield set_umask
    os.umask(saved)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_files_follow_umask_overwritten_files_keep_their_mode(tmp_path, umask):
    model = _Buffers(w=torch.ones(4))
    umask(0o022)
    save_model_atomic(model, tmp_path / "a.safetensors")
    assert _mode(tmp_path / "a.safetensors") == 0o644
    umask(0o027)
    with atomic_output(tmp_path / "b.txt") as tmp:
        open(tmp, "w").close()
    assert _mode(tmp_path / "b.txt") == 0o640
    umask(0o077)
    save_model_atomic(model, tmp_path / "a.safetensors")  # overwritten: keeps 0644 under any umask
    assert _mode(tmp_path / "a.safetensors") == 0o644
    os.chmod(tmp_path / "b.txt", 0o600)
    umask(0o000)
    with atomic_output(tmp_path / "b.txt") as tmp:
        open(tmp, "w").close()
    assert _mode(tmp_path / "b.txt") == 0o600


# ------------------------------------------------------------------------------------------------
# destinations

def test_symlink_destination_is_written_through(tmp_path):
    links, targets = tmp_path / "links", tmp_path / "targets"
    links.mkdir()
    targets.mkdir()
    target = targets / "real.safetensors"
    save_model_atomic(_Buffers(w=torch.zeros(2)), target)
    os.chmod(target, 0o640)
    link = links / "out.safetensors"
    link.symlink_to(target)
    assert check_output_path(link) == str(link)  # the path as given
    assert save_model_atomic(_Buffers(w=torch.ones(5)), link) == str(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    with open_checkpoint(target) as fh:
        assert torch.equal(fh.get_tensor("w"), torch.ones(5))
    assert _mode(target) == 0o640
    assert os.listdir(links) == ["out.safetensors"] and os.listdir(targets) == ["real.safetensors"]
    dangling = links / "new.txt"
    dangling.symlink_to(targets / "created.txt")  # a dangling link creates its target
    with atomic_output(dangling) as tmp:
        with open(tmp, "w") as fh:
            fh.write("x")
    assert dangling.is_symlink() and (targets / "created.txt").read_text() == "x"


def test_special_files_are_refused_before_any_work(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    sock_path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(sock_path))
        for path, kind in (("/dev/null", "character device"), (fifo, "FIFO"), (sock_path, "socket")):
            with pytest.raises(ValueError, match=f"{path}.* is a {kind}"):
                check_output_path(path)
            with pytest.raises(ValueError, match=kind):
                with atomic_output(path):
                    raise AssertionError("atomic_output must refuse before yielding")
        link = tmp_path / "null.safetensors"
        link.symlink_to("/dev/null")
        with pytest.raises(ValueError, match=r"/dev/null \(the target of symlink .*null.safetensors\) is a character"):
            check_output_path(link)
        rc, _, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--out", str(fifo))
        assert rc == 2 and err.count("\n") == 1 and "FIFO" in err and str(fifo) in err
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
        assert sorted(os.listdir(tmp_path)) == ["null.safetensors", "pipe", "s.sock"]
    finally:
        sock.close()


# ------------------------------------------------------------------------------------------------
# reproducibility

def test_same_model_and_metadata_give_identical_bytes(tmp_path):
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
    model[1].weight = model[0].weight  # tied: safetensors adds a metadata entry for the dropped name
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(7, 4, generator=g))
    meta = {f"key{i}": {"value": i, "nested": {"b": 1, "a": 2}} for i in range(8)}
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_model_atomic(model, a, meta)
    save_model_atomic(model, b, dict(reversed(list(meta.items()))))
    assert _sha256(a) == _sha256(b)
    raw = a.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    assert header["__metadata__"]["key3"] == '{"nested":{"a":2,"b":1},"value":3}'


@pytest.mark.slow
def test_init_same_arguments_byte_identical(tmp_path, capsys):
    hashes = set()
    for name in ("a", "b"):
        out = tmp_path / f"{name}.safetensors"
        rc, _, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--seed", "0", "--out", str(out), "--quiet")
        assert rc == 0, err
        hashes.add(_sha256(out))
    assert len(hashes) == 1
    raw = out.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8:8 + n])["__metadata__"]  # the condinit entry and the dropped tied name
    assert len(meta) == 2 and list(meta) == sorted(meta)
    assert json.loads(meta["condinit"])["preset"] == "tiny-llama" and meta["condinit"].startswith('{"dtype":"fp32",')


# ------------------------------------------------------------------------------------------------
# damaged and hostile checkpoints

def _raw(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD_HEADERS = {
    "list": (b"[1, 2, 3]", b"", "is an array in JSON, expected an object"),
    "number": (b"12345", b"", "is a number in JSON"),
    "deep": (b"[" * 200_000 + b"]" * 200_000, b"", "nested too deeply"),
    "deep_in_object": (b'{"w":' + b"[" * 200_000 + b"]" * 200_000 + b"}", b"", "nested too deeply"),
    "not_utf8": (b'{"\xff":1}', b"", "not UTF-8 JSON"),
    "offsets_one": (json.dumps({"w": _entry(offsets=(0,))}).encode(), b"\0" * 4, "data_offsets must be"),
    "offsets_reversed": (json.dumps({"w": _entry(offsets=(4, 0))}).encode(), b"\0" * 4, "data_offsets must be"),
    "offsets_float": (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}', b"\0" * 4, "data_offsets must"),
    "entry_not_object": (json.dumps({"w": [1]}).encode(), b"", "must be an object with dtype"),
    "shape_negative": (json.dumps({"w": _entry(shape=(-1,))}).encode(), b"\0" * 4, "shape must be"),
    "shape_bool": (json.dumps({"w": _entry(shape=(True,))}).encode(), b"\0" * 4, "shape must be"),
    "dtype_missing": (json.dumps({"w": {"shape": [1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4, "dtype must"),
    "size_mismatch": (json.dumps({"w": _entry(shape=(3,))}).encode(), b"\0" * 4, "needs 12 bytes"),
    "metadata_values": (json.dumps({"__metadata__": {"a": 1}}).encode(), b"", "must map names to strings"),
    "past_end": (json.dumps({"w": _entry(shape=(4,), offsets=(0, 16))}).encode(), b"\0" * 4, "truncated"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_bad_headers_are_one_line_value_errors(tmp_path, case):
    header, data, what = BAD_HEADERS[case]
    path = _raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ValueError) as info:
        open_checkpoint(path)
    msg = str(info.value)
    assert str(path) in msg and what in msg and "\n" not in msg, msg


def test_huge_header_length_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        fh.truncate(MAX_HEADER_BYTES + 64)  # sparse: no disk used
    with pytest.raises(ValueError, match="above the 100000000-byte limit"):
        open_checkpoint(path)


def _tiny_meta(**layer_changes):
    proj = {p: {"tensor": f"a.{p}_proj.weight", "start": 0, "stop": 8, "transposed": False} for p in "qkv"}
    layer = {"index": 0, "name": "a", "num_heads": 2, "num_kv_heads": 2, "head_dim": 4, **proj}
    meta = {"format": 1, "family": "llama", "seed": 0, "method": "auto", "v_mode": "identity", "num_heads": 2,
            "num_kv_heads": 2, "head_dim": 4, "layers": [layer]}
    for path, value in layer_changes.items():
        *parents, last = path.split("__")
        target = meta
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[last] = value
    return meta


def _with_meta(path, meta, tensors=None):
    g = torch.Generator().manual_seed(0)
    tensors = tensors or {f"a.{p}_proj.weight": torch.randn(8, 6, generator=g) for p in "qkv"}
    save_file(tensors, str(path), metadata={"condinit": meta if isinstance(meta, str) else json.dumps(meta)})
    return path


BAD_METADATA = {
    "layers_string": (dict(layers="abc"), "field layers must be a list"),
    "layer_not_object": (dict(layers=[3]), "field layers[0] must be an object"),
    "heads_string": ({"layers__0__num_heads": "2"}, "layers[0].num_heads must be an integer >= 1"),
    "heads_bool": ({"layers__0__head_dim": True}, "layers[0].head_dim must be an integer >= 1"),
    "proj_string": ({"layers__0__q": "x"}, "layers[0].q must be an object"),
    "start_string": ({"layers__0__k__start": "0"}, "layers[0].k.start must be an integer >= 0"),
    "stop_below_start": ({"layers__0__k__start": 8}, "layers[0].k.start must be below stop"),
    "tensor_number": ({"layers__0__v__tensor": 5}, "layers[0].v.tensor must be a tensor name"),
    "transposed_int": ({"layers__0__v__transposed": 1}, "layers[0].v.transposed must be true or false"),
    "family_number": ({"family": 3}, "field family must be a string"),
    "seed_negative": ({"seed": -1}, "field seed must be an integer >= 0"),
    "format": ({"format": 2}, "field format must be 1"),
    "missing_tensor": ({"layers__0__q__tensor": "nope"}, "names tensor 'nope' for a.q, which is not in the file"),
    "rows_out_of_range": ({"layers__0__q__stop": 9}, "rows 0:9 of tensor 'a.q_proj.weight' for a.q, which has 8"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_bad_condinit_metadata_is_a_value_error_naming_file_and_field(tmp_path, case):
    changes, what = BAD_METADATA[case]
    meta = _tiny_meta(**changes)
    path = _with_meta(tmp_path / "m.safetensors", meta)
    with open_checkpoint(path) as fh:
        with pytest.raises(ValueError) as info:
            read_metadata(fh)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and what in msg and "\n" not in msg, msg
    with pytest.raises(ValueError, match="^m.safetensors: "):
        locate_attention({"a.q_proj.weight": (8, 6), "a.k_proj.weight": (8, 6), "a.v_proj.weight": (8, 6)}, meta,
                         source="m.safetensors")


def test_one_dimensional_tensor_where_a_projection_is_expected(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.q_proj.weight": torch.randn(8, generator=g), "a.k_proj.weight": torch.randn(8, 6, generator=g),
               "a.v_proj.weight": torch.randn(8, 6, generator=g)}
    path = _with_meta(tmp_path / "flat.safetensors", _tiny_meta(), tensors)
    with open_checkpoint(path) as fh:
        with pytest.raises(ValueError, match=r"'a\.q_proj\.weight' \(1-D, shape \[8\]\) for a\.q, expected a 2-D"):
            read_metadata(fh)
        loc = {"name": "a", "num_heads": 2, "num_kv_heads": 2, "head_dim": 4,
               **{p: {"tensor": f"a.{p}_proj.weight", "start": 0, "stop": 8, "transposed": False} for p in "qkv"}}
        with pytest.raises(ValueError, match=rf"^{path}: tensor 'a\.q_proj\.weight' \(a\.q\) is 1-D"):
            projection_blocks(fh, loc, "q", {})
        assert projection_blocks(fh, loc, "k", {}).shape == (2, 4, 6)
    rc, _, err = run_cli(capsys, "inspect", str(path))
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"condinit inspect: error: {path}: ")


@pytest.mark.slow
def test_inspect_bad_files_one_line_errors(tmp_path, capsys):
    cases = [_raw(tmp_path / "list.safetensors", b"[1, 2, 3]"),
             _raw(tmp_path / "offsets.safetensors", json.dumps({"w": _entry(offsets=(0,))}).encode(), b"\0" * 4),
             _with_meta(tmp_path / "meta.safetensors", _tiny_meta(layers__0__num_heads="2"))]
    for path in cases:
        rc, out, err = run_cli(capsys, "inspect", str(path))
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"condinit inspect: error: {path}")
    # the real entry point, for the case that used to end in a RecursionError traceback
    deep = _raw(tmp_path / "deep.safetensors", b"[" * 200_000 + b"]" * 200_000)
    res = subprocess.run([sys.executable, "-m", "condinit", "inspect", str(deep)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [f"condinit inspect: error: {deep} is not a readable safetensors file: its "
                                       f"header is JSON nested too deeply to parse"]


@pytest.mark.parametrize("header_len", [640, 896, 1152])
def test_header_length_that_starts_like_a_pickle_still_reads(tmp_path, header_len):
    """A valid header whose little-endian length starts with 0x80 0x02..0x05 (a pickle's PROTO
    opcode) is safetensors, not a pickle."""
    from condinit.models.checkpoint import open_checkpoint
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, len(data)]}}).encode()
    hdr = hdr + b" " * (header_len - len(hdr))
    assert struct.pack("<Q", header_len)[0] == 0x80
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", header_len) + hdr + data)
    ck = open_checkpoint(str(path))
    with ck as fh:
        assert torch.equal(fh.get_tensor("w"), torch.arange(6, dtype=torch.float32).view(2, 3))


_TEMP_BEING_MADE = """
import os, sys, tempfile, threading, time
from condinit.io.atomic import atomic_output, removing_temps_on_sigterm
out = sys.argv[1]
made = threading.Event()
real_mkstemp = tempfile.mkstemp
def slow_mkstemp(*args, **kwargs):   # the temporary file exists, its registration is still to come
    fd, path = real_mkstemp(*args, **kwargs)
    if not kwargs.get("prefix", "").startswith(".shard.bin."):    # the output path's writability probe
        return fd, path
    made.set()
    time.sleep(0.5)
    return fd, path
tempfile.mkstemp = slow_mkstemp
def writer():
    with atomic_output(os.path.join(out, "shard.bin")) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(b"x" * 4096)
with removing_temps_on_sigterm():
    threading.Thread(target=writer, daemon=True).start()
    made.wait(30)
    os.kill(os.getpid(), 15)          # SIGTERM while the writer thread is making its temporary file
    time.sleep(30)
"""


@pytest.mark.slow
def test_sigterm_while_a_writer_thread_makes_its_temporary_file(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _TEMP_BEING_MADE, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert os.listdir(tmp_path) == []       # neither the temporary file nor a renamed one
