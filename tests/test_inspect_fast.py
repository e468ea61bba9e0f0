"""``condinit inspect`` reads only the attention weights, one layer at a time, and gives the numbers
of reading every tensor whole: per head, the spectrum of the stored weights."""
from __future__ import annotations

import json

import pytest
import torch

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

from condinit.cli import main  # noqa: E402
from condinit.commands.inspect import analyze  # noqa: E402
from condinit.init.spectrum import spectrum  # noqa: E402


class _Recorder:
    """Wraps ``safetensors.safe_open``: which tensors each open file handed out, and which files were
    open (and had handed out tensors) at each read."""

    def __init__(self, real):
        self.real, self.open, self.reads = real, [], []

    def __call__(self, path, *args, **kwargs):
        rec = self

        class Handle:
            def __init__(self):
                self.h, self.names = rec.real(path, *args, **kwargs), []

            def __enter__(self):
                rec.open.append(self)
                return self

            def __exit__(self, *exc):
                rec.open.remove(self)
                return self.h.__exit__(*exc)

            def get_tensor(self, name):
                self.names.append(name)
                rec.reads.append((name, [n for o in rec.open for n in o.names]))
                return self.h.get_tensor(name)

            def __getattr__(self, name):
                return getattr(self.h, name)

        return Handle().__enter__()


def _layer_of(name: str) -> str:
    return name.rsplit(".", 2)[0]


def _whole_file_reference(files, layers, heads):
    """Per layer and projection, what reading each file whole and taking its float32 blocks gives."""
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    out = []
    for prefix in layers:
        row = {}
        for p, h in zip("qkv", heads):
            w = tensors[f"{prefix}.{p}_proj.weight"].float()
            smax, smin, cond = spectrum(w.reshape(h, -1, w.shape[1]))
            row[p] = {"cond_per_head": cond.tolist(), "sigma_max": float(smax.max()), "sigma_min": float(smin.min())}
            # and independently of spectrum(): float64 singular values of each head block
            sv = torch.linalg.svdvals(w.double().reshape(h, -1, w.shape[1]))
            torch.testing.assert_close(torch.tensor(row[p]["cond_per_head"], dtype=torch.float64),
                                       sv[:, 0] / sv[:, -1], rtol=1e-9, atol=0)
        out.append(row)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_inspect_reads_only_attention_one_layer_at_a_time_and_matches_whole_reads(tmp_path, monkeypatch, dtype):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n_layers, heads, d, D = 3, (4, 2, 2), 8, 48
    layers = [f"model.layers.{i}.self_attn" for i in range(n_layers)]
    # a trained-looking checkpoint without metadata: random scales per head, across two shards
    # (layer 1 split between them), with other tensors that must never be read
    shards = [{}, {}]
    for i, prefix in enumerate(layers):
        for j, (p, h) in enumerate(zip("qkv", heads)):
            scale = torch.logspace(-2, 2, h, dtype=torch.float64)[torch.randperm(h, generator=g)]
            w = torch.randn(h, d, D, generator=g, dtype=torch.float64) * scale.view(-1, 1, 1)
            w[:, 0] *= 50          # ill-conditioned heads too
            shards[(i + (j > 0)) // 2][f"{prefix}.{p}_proj.weight"] = w.reshape(h * d, D).to(dtype)
        shards[i // 2][f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(64, D, generator=g).to(dtype)
    shards[0]["model.embed_tokens.weight"] = torch.randn(100, D, generator=g).to(dtype)
    files, weight_map = [], {}
    for k, sd in enumerate(shards):
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file(sd, str(tmp_path / name))
        files.append(str(tmp_path / name))
        weight_map.update({t: name for t in sd})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    recorder = _Recorder(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", recorder)
    meta, rows = analyze(str(tmp_path), num_heads=heads[0], head_dim=d)
    assert not recorder.open                                   # every file closed again
    read = [name for name, _ in recorder.reads]
    assert sorted(read) == sorted(f"{l}.{p}_proj.weight" for l in layers for p in "qkv")   # nothing else, once each
    for name, mapped in recorder.reads:                        # at each read, only this layer's tensors mapped
        assert {_layer_of(n) for n in mapped} == {_layer_of(name)}, (name, mapped)
    monkeypatch.undo()

    ref = _whole_file_reference(files, layers, heads)
    assert [r["name"] for r in rows] == layers and meta is None
    for row, want in zip(rows, ref):
        for p in "qkv":
            assert row[p] == want[p], (row["name"], p)          # the very same numbers, bit for bit


@pytest.mark.slow
def test_inspect_of_a_written_directory_matches_whole_reads(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["init", "--preset", "tiny-llama", "--dtype", "bf16", "--seed", "5", "--out", f"{out}/",
                 "--max-shard-size", "600KB", "--quiet"]) == 0
    capsys.readouterr()
    files = sorted(str(p) for p in out.glob("model-*.safetensors"))
    assert len(files) > 2
    assert main(["inspect", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    layers = [r["name"] for r in got["layers"]]
    assert len(layers) == 4 and got["metadata"]["family"] == "llama"
    ref = _whole_file_reference(files, layers, (8, 4, 4))
    for row, want in zip(got["layers"], ref):
        for p in "qkv":
            assert row[p] == want[p], (row["name"], p)
        assert max(row["q"]["cond_per_head"] + row["k"]["cond_per_head"]) < 1 + 1e-2   # conditioned, in bf16
