"""``condinit info``: "compiled in" apart from "usable on this machine" (no GPU: every cuda row is
not usable, saying why), a table at most 120 columns wide and not squeezed to 80 when piped."""
import json

import pytest
import torch

from condinit import _backends
from helpers import run_cli

WIDTH = 120


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")


def _json(capsys):
    rc, out, err = run_cli(capsys, "info", "--json")
    assert rc == 0, err
    return json.loads(out)


def test_without_a_gpu_no_cuda_row_is_usable_and_each_says_why(capsys, monkeypatch):
    _no_gpu(monkeypatch)
    data = _json(capsys)
    assert data["gpu"] is None and not data["cuda_available"]
    rows = data["backends"]
    assert {r["device"] for r in rows} == {"cpu", "cuda"}
    for r in rows:
        if r["device"] == "cuda":
            assert not r["usable"], r
            assert r["usable_reason"] == ("no CUDA device visible" if r["compiled_in"] else r["compiled_in_reason"]), r
        else:   # on the CPU, usable is what the backend table says for the CPU
            assert r["usable"] == r["available"], r
            assert r["usable_reason"] == ("" if r["usable"] else r["reason"]), r
        assert r["compiled_in"] or r["compiled_in_reason"], r


def test_compiled_in_does_not_depend_on_the_devices(capsys, monkeypatch):
    """The same "compiled in" with and without a GPU; the pure-PyTorch rows always compiled in; a
    backend compiled in for one device type is compiled in for the other; with a GPU, a cuda row
    is usable exactly when the backend table says it is available."""
    _no_gpu(monkeypatch)
    without = _json(capsys)["backends"]
    _fake_gpu(monkeypatch)
    with_gpu = _json(capsys)
    assert with_gpu["gpu"] == "Test GPU"
    key = lambda r: (r["op"], r["device"], r["backend"])  # noqa: E731
    assert {key(r): r["compiled_in"] for r in without} == {key(r): r["compiled_in"] for r in with_gpu["backends"]}
    by_backend = {}
    for r in without:
        by_backend.setdefault((r["op"], r["backend"]), set()).add(r["compiled_in"])
        if r["backend"] == "torch":
            assert r["compiled_in"], r
    assert all(len(v) == 1 for v in by_backend.values()), by_backend
    for r in with_gpu["backends"]:
        if r["device"] == "cuda":
            assert r["usable"] == r["available"], r
    assert _backends.ops() == sorted({r["op"] for r in without})


@pytest.mark.parametrize("columns", ["60", "200"])
def test_table_is_120_columns_wide_whatever_the_terminal(capsys, monkeypatch, columns):
    """Piped (captured) and with COLUMNS set narrow or wide: the same fixed width, the column
    headers and every row in the table."""
    _no_gpu(monkeypatch)
    monkeypatch.setenv("COLUMNS", columns)
    rc, out, err = run_cli(capsys, "info")
    assert rc == 0, err
    lines = out.splitlines()
    assert 100 < max(len(ln) for ln in lines) <= WIDTH   # not squeezed to 80, never wider than 120
    header = next(ln for ln in lines if ln.lstrip().startswith("op "))
    for col in ("device", "backend", "compiled in", "usable"):
        assert col in header
    assert "GPU: none visible (no CUDA device visible" in out
    table = [ln.split() for ln in lines if ln.split() and ln.split()[0] in _backends.ops()]
    rows = _json(capsys)["backends"]
    assert len(table) == len(rows)
    for cells, r in zip(table, rows):
        assert cells[:5] == [r["op"], r["device"], r["backend"], "yes" if r["compiled_in"] else "no",
                             "yes" if r["usable"] else "no"], (cells, r)
        if r["device"] == "cuda":
            assert " ".join(cells[5:]).startswith("no CUDA device visible"), cells
