"""Random byte mutations of safetensors headers and of model.safetensors.index.json, read by every
reader: ``condinit inspect FILE`` / ``DIR/``, ``condinit probe``, ``condinit init --resume`` (which
reads the directory's config.json, index and shard headers), ``open_checkpoint`` and
``read_metadata``. Never a traceback (the CLI exits 2 with one line on stderr, the library raises a
ValueError or OSError with a message); an index never makes a reader leave its directory."""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile

import pytest
import torch

from condinit.io.safetensors_format import WEIGHTS_INDEX_NAME, shard_name
from condinit.models.checkpoint import open_checkpoint, read_metadata
from helpers import LLAMA_SMALL, CliRun, run_cli, write_config

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("safetensors")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# one attention layer "a" with 8-row q / k / v projections of width 6, as condinit describes it
META = {"format": 1, "family": "llama", "seed": 0, "method": "auto", "v_mode": "identity", "num_heads": 2,
        "num_kv_heads": 2, "head_dim": 4,
        "layers": [{"index": 0, "name": "a", "num_heads": 2, "num_kv_heads": 2, "head_dim": 4,
                    **{p: {"tensor": f"a.{p}_proj.weight", "start": 0, "stop": 8, "transposed": False}
                       for p in "qkv"}}]}


def tensors():
    g = torch.Generator().manual_seed(0)
    return {f"a.{p}_proj.weight": torch.randn(8, 6, generator=g) for p in "qkv"}


def write_file(path, state):
    save_file(state, str(path), metadata={"condinit": json.dumps(META)})
    return path


def write_directory(d, outside_name=None):
    """A two-shard model directory (q in shard 1, k and v in shard 2) and its index."""
    os.makedirs(d, exist_ok=True)
    state = tensors()
    names = {"a.q_proj.weight": shard_name(1, 2), "a.k_proj.weight": shard_name(2, 2),
             "a.v_proj.weight": shard_name(2, 2)}
    for fname in set(names.values()):
        save_file({k: state[k] for k, f in names.items() if f == fname}, os.path.join(d, fname))
    index = {"metadata": {"total_size": 3 * 8 * 6 * 4, "condinit": META}, "weight_map": names}
    with open(os.path.join(d, WEIGHTS_INDEX_NAME), "w") as fh:
        json.dump(index, fh, indent=2)
    return d


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    single = write_file(root / "model.safetensors", tensors())
    directory = write_directory(str(root / "dir"))
    return {"file": single.read_bytes(),
            "shard": open(os.path.join(directory, shard_name(2, 2)), "rb").read(),
            "index": open(os.path.join(directory, WEIGHTS_INDEX_NAME), "rb").read()}


# one mutation: ("set", at, byte), ("insert", at, bytes) or ("delete", at, count); ``at`` is a fraction
# of the region mutated (a header, an index file)
MUTATION = st.one_of(
    st.tuples(st.just("set"), st.floats(0, 1), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=6)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 6)),
)
MUTATIONS = st.lists(MUTATION, min_size=1, max_size=6)


def mutate(data: bytes, end: int, mutations) -> bytes:
    """``data`` with ``mutations`` applied within its first ``end`` bytes."""
    head, tail = bytearray(data[:end]), data[end:]
    for kind, where, arg in mutations:
        at = min(int(where * len(head)), max(len(head) - 1, 0))
        if kind == "set" and head:
            head[at] = arg
        elif kind == "insert":
            head[at:at] = arg
        elif kind == "delete":
            del head[at:at + arg]
    return bytes(head) + tail


def header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def read_all(path) -> None:
    """Everything a library user reads of a checkpoint: open it, its metadata, every tensor."""
    with open_checkpoint(path) as fh:
        read_metadata(fh)
        for k in fh.keys():
            fh.get_tensor(k)


def assert_library_refuses_cleanly(path) -> None:
    try:
        read_all(path)
    except (ValueError, OSError) as exc:
        assert str(exc).strip() and "\n" not in str(exc), repr(exc)


def assert_cli_refuses_cleanly(capsys, command, *argv) -> None:
    rc, out, err = run_cli(capsys, command, *argv)
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err
    if rc == 2:
        assert err.count("\n") == 1 and err.startswith(f"condinit {command}: error: "), err


@pytest.mark.slow   # condinit probe builds its preset model
@FUZZ
@given(mutations=MUTATIONS)
def test_fuzz_file_header(originals, capsys, mutations):
    data = originals["file"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        with open(path, "wb") as fh:
            fh.write(mutate(data, header_end(data), mutations))
        assert_library_refuses_cleanly(path)
        assert_cli_refuses_cleanly(capsys, "inspect", path)
        assert_cli_refuses_cleanly(capsys, "probe", path, "--preset", "tiny-llama", "--steps", "1")


@pytest.mark.slow   # condinit probe builds its preset model
@FUZZ
@given(mutations=MUTATIONS)
def test_fuzz_shard_header(originals, capsys, mutations):
    data = originals["shard"]
    with tempfile.TemporaryDirectory() as d:
        write_directory(d)
        with open(os.path.join(d, shard_name(2, 2)), "wb") as fh:
            fh.write(mutate(data, header_end(data), mutations))
        assert_library_refuses_cleanly(d)
        assert_cli_refuses_cleanly(capsys, "inspect", d + os.sep)
        assert_cli_refuses_cleanly(capsys, "probe", d + os.sep, "--preset", "tiny-llama", "--steps", "1")


@pytest.mark.slow   # condinit probe builds its preset model
@FUZZ
@given(mutations=MUTATIONS)
def test_fuzz_index(originals, capsys, mutations):
    data = originals["index"]
    with tempfile.TemporaryDirectory() as d:
        write_directory(d)
        with open(os.path.join(d, WEIGHTS_INDEX_NAME), "wb") as fh:
            fh.write(mutate(data, len(data), mutations))
        assert_library_refuses_cleanly(d)
        assert_cli_refuses_cleanly(capsys, "inspect", d + os.sep)
        assert_cli_refuses_cleanly(capsys, "probe", d + os.sep, "--preset", "tiny-llama", "--steps", "1")


SEGMENTS = st.sampled_from(["..", ".", "", "sub", "dir", shard_name(1, 2), "outside.safetensors"])


@FUZZ
@given(parts=st.lists(SEGMENTS, min_size=1, max_size=5), absolute=st.booleans())
def test_index_never_leads_outside_the_directory(capsys, parts, absolute):
    """An index naming a shard by a path (``../outside.safetensors``, an absolute path, ``sub/x``) is
    refused, even where that path holds a valid shard with the tensor."""
    with tempfile.TemporaryDirectory() as root:
        d = write_directory(os.path.join(root, "dir"))
        os.makedirs(os.path.join(d, "sub"))
        state = tensors()
        for where in (root, os.path.join(d, "sub")):
            for fname in ("outside.safetensors", shard_name(1, 2)):
                save_file({"a.q_proj.weight": state["a.q_proj.weight"]}, os.path.join(where, fname))
        name = ("/" if absolute else "") + "/".join(parts)
        if absolute:
            name = os.path.join(root, *parts)
        index_path = os.path.join(d, WEIGHTS_INDEX_NAME)
        index = json.load(open(index_path))
        index["weight_map"]["a.q_proj.weight"] = name
        with open(index_path, "w") as fh:
            json.dump(index, fh)
        if name == shard_name(1, 2):      # a plain name in the directory is the one thing read
            read_all(d)
            return
        in_directory = os.path.basename(name) == name and name.endswith(".safetensors")
        message = "which is missing" if in_directory else "must be a .safetensors file name in the directory"
        with pytest.raises(ValueError, match=message):
            open_checkpoint(d)
        rc, _, err = run_cli(capsys, "inspect", d + os.sep)
        assert rc == 2 and err.count("\n") == 1 and message in err


# hostile JSON values put in place of any one value of a header or an index
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


def value_paths(value, path=()):
    """The key paths of every value inside ``value`` (itself included)."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from value_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from value_paths(v, path + (i,))


def replaced(value, path, new):
    if not path:
        return new
    value = value.copy()
    value[path[0]] = replaced(value[path[0]], path[1:], new)
    return value


def decoded_header(data: bytes) -> dict:
    """The header of a file, its condinit entry parsed (so that values inside it are replaced too)."""
    header = json.loads(data[8:header_end(data)])
    header["__metadata__"]["condinit"] = json.loads(header["__metadata__"]["condinit"])
    return header


@FUZZ
@given(data=st.data(), new=JSON_VALUES, encode=st.booleans())
def test_fuzz_file_header_values(originals, capsys, data, new, encode):
    original = originals["file"]
    header = decoded_header(original)
    paths = list(value_paths(header))
    header = replaced(header, data.draw(st.sampled_from(paths)), new)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if encode and isinstance(meta, dict) and "condinit" in meta:
        meta["condinit"] = json.dumps(meta["condinit"])
    raw = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        with open(path, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw + original[header_end(original):])
        assert_library_refuses_cleanly(path)
        assert_cli_refuses_cleanly(capsys, "inspect", path)


@FUZZ
@given(data=st.data(), new=JSON_VALUES, drop_index_metadata=st.booleans())
def test_fuzz_index_values(originals, capsys, data, new, drop_index_metadata):
    index = json.loads(originals["index"])
    if drop_index_metadata:          # the readers then take the condinit entry from the shards' headers
        del index["metadata"]["condinit"]
    index = replaced(index, data.draw(st.sampled_from(list(value_paths(index)))), new)
    with tempfile.TemporaryDirectory() as d:
        write_directory(d)
        if drop_index_metadata:
            state = tensors()
            shard_meta = json.dumps(data.draw(JSON_VALUES)) if data.draw(st.booleans()) else json.dumps(META)
            save_file({"a.q_proj.weight": state["a.q_proj.weight"]}, os.path.join(d, shard_name(1, 2)),
                      metadata={"condinit": shard_meta})
        with open(os.path.join(d, WEIGHTS_INDEX_NAME), "w") as fh:
            json.dump(index, fh)
        assert_library_refuses_cleanly(d)
        assert_cli_refuses_cleanly(capsys, "inspect", d + os.sep)


def test_shard_entry_nested_too_deeply(tmp_path, capsys):
    """Without a condinit entry in the index, the shards' entries are read: one nested too deeply
    to parse is refused like the index's."""
    d = write_directory(str(tmp_path / "dir"))
    index_path = os.path.join(d, WEIGHTS_INDEX_NAME)
    index = json.load(open(index_path))
    del index["metadata"]["condinit"]
    with open(index_path, "w") as fh:
        json.dump(index, fh)
    shard = os.path.join(d, shard_name(1, 2))
    save_file({"a.q_proj.weight": tensors()["a.q_proj.weight"]}, shard,
              metadata={"condinit": "[" * 100_000 + "]" * 100_000})
    message = f"{shard}: the 'condinit' metadata entry is JSON nested too deeply to parse"
    with open_checkpoint(d) as fh:
        with pytest.raises(ValueError, match="^" + message.replace(".", r"\.") + "$"):
            read_metadata(fh)
    rc, out, err = run_cli(capsys, "inspect", d + os.sep)
    assert rc == 2 and err == f"condinit inspect: error: {message}\n"


# ``condinit init --resume`` of a directory condinit wrote: what it reads there (config.json, the
# index, every shard's header) damaged or hostile. Either the resume refuses in one line and the
# directory is as it was, or it finishes and the directory is the one a fresh write gives.
RESUME_CONFIG = {"model_type": "llama", **LLAMA_SMALL}
RESUME_SHARD = shard_name(1, 2)


def _resume_argv(config_path, out):
    return ("--config", str(config_path), "--out", f"{out}{os.sep}", "--max-shard-size", "60000", "--seed", "1",
            "--quiet")


def _tree(d) -> dict:
    """Every entry of ``d``: a regular file's bytes, anything else its kind."""
    result = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        result[name] = open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else "not a file"
    return result


@pytest.fixture(scope="module")
def resume_original(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    config = write_config(root, RESUME_CONFIG)
    from condinit.cli import main
    assert main(["init", *_resume_argv(config, root / "orig")]) == 0
    return config, root / "orig", _tree(root / "orig")


def assert_resume_refuses_or_restores(capsys, resume_original, d) -> CliRun:
    """``condinit init --resume`` of ``d``: one line and ``d`` untouched, or ``d`` as a fresh write."""
    config, _, original = resume_original
    before = _tree(d)
    r = run_cli(capsys, "init", *_resume_argv(config, d), "--resume")
    assert r.rc in (0, 2) and "Traceback" not in r.err, r
    if r.rc == 2:
        assert r.err.count("\n") == 1 and r.err.startswith("condinit init: error: "), r.err
        assert _tree(d) == before
    else:
        after = _tree(d)
        assert {k: v for k, v in after.items() if k != "config.json"} == \
            {k: v for k, v in original.items() if k != "config.json"}
        # a config.json that parses to the same config is kept as it is
        assert json.loads(after["config.json"]) == json.loads(original["config.json"])
    return r


def _damaged_copy(resume_original, d, name, data: bytes) -> str:
    shutil.copytree(resume_original[1], d)
    with open(os.path.join(d, name), "wb") as fh:
        fh.write(data)
    return d


def _shard_with_entry(path, entry: str) -> bytes:
    save_file({"x": torch.zeros(2)}, str(path), metadata={"condinit": entry})
    return open(path, "rb").read()


def _entry_with_layers(resume_original, layers) -> str:
    meta = json.loads(resume_original[2][WEIGHTS_INDEX_NAME])["metadata"]["condinit"]
    return json.dumps({**meta, "layers": layers})


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name, make, expect", [
    ("config.json", lambda ro, tmp: DEEP.encode(), "its config.json is not readable JSON"),
    (WEIGHTS_INDEX_NAME, lambda ro, tmp: DEEP.encode(), f"its {WEIGHTS_INDEX_NAME} is not a readable index"),
    (WEIGHTS_INDEX_NAME, lambda ro, tmp: json.dumps({"metadata": {"condinit": json.loads(_entry_with_layers(ro, 5))}}
                                                    ).encode(), f"{WEIGHTS_INDEX_NAME} describes other attention"),
    # a shard of this write's plan is rewritten whatever it holds; another one is read and refused
    (RESUME_SHARD, lambda ro, tmp: _shard_with_entry(tmp / "s.safetensors", DEEP), None),
    (shard_name(1, 7), lambda ro, tmp: _shard_with_entry(tmp / "s.safetensors", DEEP),
     f"{shard_name(1, 7)} is not a readable safetensors file"),
    (shard_name(3, 7), lambda ro, tmp: _shard_with_entry(tmp / "s.safetensors", _entry_with_layers(ro, {"a": 1})),
     f"{shard_name(3, 7)} describes other attention layers"),
], ids=["config-deep", "index-deep", "index-layers-int", "planned-shard-deep", "other-shard-deep",
        "other-shard-layers-object"])
def test_resume_of_a_hostile_file_is_one_line_naming_it(resume_original, tmp_path, capsys, name, make, expect):
    d = _damaged_copy(resume_original, str(tmp_path / "d"), name, make(resume_original, tmp_path))
    r = assert_resume_refuses_or_restores(capsys, resume_original, d)
    if expect is None:
        assert r.rc == 0
    else:
        assert r.rc == 2 and expect in r.err, r.err


@pytest.mark.slow   # each example is a condinit init --resume
@FUZZ
@given(which=st.sampled_from(["config.json", WEIGHTS_INDEX_NAME, RESUME_SHARD]), mutations=MUTATIONS)
def test_fuzz_resume(resume_original, capsys, which, mutations):
    data = resume_original[2][which]
    end = header_end(data) if which.endswith(".safetensors") else len(data)
    with tempfile.TemporaryDirectory() as root:
        d = _damaged_copy(resume_original, os.path.join(root, "d"), which, mutate(data, end, mutations))
        assert_resume_refuses_or_restores(capsys, resume_original, d)


@pytest.mark.slow   # each example is a condinit init --resume
@FUZZ
@given(data=st.data(), new=JSON_VALUES)
def test_fuzz_resume_values(resume_original, capsys, data, new):
    index = json.loads(resume_original[2][WEIGHTS_INDEX_NAME])
    index = replaced(index, data.draw(st.sampled_from(list(value_paths(index)))), new)
    with tempfile.TemporaryDirectory() as root:
        d = _damaged_copy(resume_original, os.path.join(root, "d"), WEIGHTS_INDEX_NAME, json.dumps(index).encode())
        assert_resume_refuses_or_restores(capsys, resume_original, d)
