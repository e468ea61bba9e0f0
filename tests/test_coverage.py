"""Acceptance test of :func:`condinit.apply`'s coverage: every architecture the installed
transformers can build from a default config, timm's main ViT families and torch.nn's attention
modules are conditioned as the method says, or are on :data:`REFUSED` with the reason.

The check does not use condinit's discovery, adapters or report: ``tests/coverage_models.py`` finds
the attention layers by intercepting where attention is computed and reads each layer's Q/K/V rows
and head split from gradients (see its docstring). A model passes when every attention layer found
has orthonormal Q and K rows per head, V equal to the rectangular identity in the order the
attention reads it, zero Q/K/V biases, and every other parameter and buffer unchanged bit for bit;
or, for a model with no attention at all, when ``condinit.apply`` refuses it with "no attention".

``python tools/coverage_table.py`` runs the same sweep and writes the README's "Which models" table.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import condinit
from coverage_models import (Arch, architectures, bit_equal, check_conditioned, read_model, state_snapshot,
                             verify, hf_run, build_hf)

# Architectures that are not conditioned, and why. A reason names what the method or the model
# lacks; "cannot be built" entries are models transformers cannot build on CPU from their default
# config (plus the shrinking the sweep applies), with transformers' own error.
REFUSED = {
}


def apply_condinit(model):
    return condinit.apply(model, seed=0)


@functools.lru_cache(maxsize=1)
def _archs():
    return {a.name: a for a in architectures()}


def _arch_ids():
    return list(_archs())


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", _arch_ids())
def test_architecture(name):
    if name in REFUSED:
        pytest.skip(f"refused: {REFUSED[name]}")
    out = verify(_archs()[name], apply_condinit)
    assert out.status in ("conditioned", "no attention"), f"{name}: " + "\n  ".join(out.details)


def test_refusals_name_real_architectures():
    unknown = sorted(set(REFUSED) - set(_archs()))
    assert not unknown, f"REFUSED lists architectures the sweep does not have: {unknown}"
    assert all(isinstance(r, str) and len(r) > 10 for r in REFUSED.values())
