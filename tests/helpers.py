"""What several test files share besides the fixtures and tolerances of conftest.py: the command
line run in this process, orthonormality and refused-call checks, a tiny training model, the tiny
Llama configs the writer and CLI tests write, and the attention call the argument-error tests break
one argument at a time, with guards on the kernels."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

ORTHO_ATOL = 1e-5   # fp32: max |W W^T - I| of a semi-orthogonal block


class CliRun(NamedTuple):
    """What one ``condinit`` command returned and printed."""
    rc: int
    out: str
    err: str


def run_cli(capsys, *argv) -> CliRun:
    """``condinit ARGV...`` through ``condinit.cli.main`` in this process, its output captured."""
    from condinit.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return CliRun(rc, out, err)


def assert_orthonormal_rows(w: torch.Tensor, what: str, atol: float = ORTHO_ATOL) -> None:
    """``w`` (``[m, n]``, ``m <= n``) has orthonormal rows: max |W W^T - I| <= ``atol``, in float64."""
    w = w.detach().double()
    assert w.shape[0] <= w.shape[1], what
    err = (w @ w.T - torch.eye(w.shape[0], dtype=torch.float64)).abs().max().item()
    assert err <= atol, f"{what}: max |W W^T - I| = {err:.3g}"


def assert_refused(fn, tensors, exc=(ValueError, TypeError), match=None) -> None:
    """``fn()`` raises ``exc`` (its message matching ``match``) and leaves every one of ``tensors``
    bit-identical (NaN where it was NaN): nothing was written before the error."""
    import pytest

    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        fn()
    for i, (t, b) in enumerate(zip(tensors, before)):
        assert torch.equal(t, b) or (t.isnan() == b.isnan()).all() and torch.equal(t.nan_to_num(), b.nan_to_num()), \
            f"tensor {i} was written before the error"


class TinyTransformer(nn.Module):
    """Token embedding, ``layers`` encoder layers (nn.MultiheadAttention inside) with dropout, so
    that any draw from the global RNG by a monitor would change the loss trajectory, and a linear
    head. ``padding_idx``: that token's embedding is zero; ``nan_token``: token ``vocab - 1`` has a
    NaN embedding (a NaN activation in any forward that reads it)."""

    def __init__(self, vocab=11, D=16, H=2, layers=2, padding_idx=None, nan_token=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, D, padding_idx=padding_idx)
        if nan_token:
            with torch.no_grad():
                self.emb.weight[vocab - 1] = float("nan")
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(D, H, dim_feedforward=24, dropout=0.1,
                                                               batch_first=True) for _ in range(layers))
        self.head = nn.Linear(D, vocab)

    def forward(self, tok):
        h = self.emb(tok)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


# Tiny Llama shapes (LlamaConfig keyword arguments) that the writer and CLI tests write: LLAMA_GQA has
# 3 layers of 4 query heads over 2 key/value heads, LLAMA_SMALL 2 layers of 2 heads.
LLAMA_GQA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=300)
LLAMA_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16, vocab_size=64)


def llama_config(shape: dict, **overrides):
    """A ``transformers.LlamaConfig`` of ``shape`` (``LLAMA_GQA``, ``LLAMA_SMALL``) with ``overrides``."""
    import transformers

    return transformers.LlamaConfig(**{**shape, **overrides})


def write_config(directory, config, name: str = "config.json") -> Path:
    """``config`` (a dict, or a ``transformers`` config) written as JSON to ``directory / name``, for
    ``condinit init --config``."""
    path = Path(directory) / name
    path.write_text(json.dumps(config) if isinstance(config, dict) else config.to_json_string())
    return path


def on_real_init(k: int, action):
    """A Llama ``_init_weights`` that calls ``action()`` at its ``k``-th call on a module holding real
    (not meta) tensors: the attention projections, which a write computes whole, in layer order, while
    their shard is being written (3 per layer: ``k = 4`` is layer 1's ``q_proj``)."""
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    real, calls = LlamaPreTrainedModel._init_weights, [0]

    def init_weights(self, module):
        if any(not t.is_meta for t in module.parameters(recurse=False)):
            calls[0] += 1
            if calls[0] == k:
                action()
        return real(self, module)
    return init_weights


class AttentionInputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def valid_attention_inputs() -> AttentionInputs:
    """q ``[1, 4, 8, 16]``, k and v ``[1, 2, 6, 16]`` (two query heads per key head), from a
    generator seeded 0: a call every attention op accepts."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=g)
    k = torch.randn(1, 2, 6, 16, generator=g)
    v = torch.randn(1, 2, 6, 16, generator=g)
    return AttentionInputs(q, k, v)


def make_kernels_unreachable(monkeypatch, *tables) -> None:
    """Every implementation of the backend ``tables`` raises an AssertionError if it is reached:
    a call that must be refused by its argument checks proves that no kernel ran."""
    def unreachable(*_):
        raise AssertionError("a kernel ran for an invalid call")
    for table in tables:
        for name, impl in table.impls.items():
            monkeypatch.setitem(table.impls, name, dataclasses.replace(impl, fn=unreachable))


def make_chosen_kernel_raise(monkeypatch, table, chosen: str, error: Exception) -> None:
    """The ``chosen`` row of a backend ``table`` raises ``error``; every other row raises an
    AssertionError: a call that reaches the caller with ``error`` tried no other backend."""
    def boom(*_):
        raise error

    def fallback(*_):
        raise AssertionError("fell back to another backend")
    for name, impl in table.impls.items():
        monkeypatch.setitem(table.impls, name, dataclasses.replace(impl, fn=boom if name == chosen else fallback))
