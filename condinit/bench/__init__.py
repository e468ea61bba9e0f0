"""Kernel throughput on this machine: condinit's kernels against the machine's ceilings and against
what a user would otherwise run, side by side in one run (``condinit bench``; docs/design.md,
"Backends").

Sections (each a list of :class:`Row`), one module each:

``ceilings`` (:mod:`condinit.bench.ceilings`)
    The machine's GEMM rates for the dtype (each library condinit's kernels use, a large and a
    cache-resident size) and its memory copy bandwidth, measured in the same run; every other
    row's rate is a fraction of the fastest GEMM of its dtypes, a measured upper bound for it.
``init`` (:mod:`condinit.bench.init_rows`)
    Conditioned initialization of an attention stack: the batched ``conditioned_init_layers_``,
    ``semi_orthogonal_`` per weight, the floor of any exact method, and the torch baselines.
``attention`` (:mod:`condinit.bench.attention_rows`)
    The fused attention forward, JVP (one and several probes), backward and backward through the
    tangent output, against SDPA's best backend and ``torch.func.jvp`` over SDPA MATH.

Every row says which backend ran: condinit's rows name the backend its tables chose
(``Op.choose``, the same call the public function makes; ``--backend`` forces one and a forced
backend that cannot run the call fails the row, never falls back), the SDPA rows the
``SDPBackend`` that ran.

The shapes, presets and FLOP conventions are in :mod:`condinit.bench.config`, the timer and the
rows and their verdicts in :mod:`condinit.bench.measure`, the tables and the JSON in
:mod:`condinit.bench.report`; :func:`run` measures the sections, rates them against the ceilings
and judges each row against its aim (met / not met / no aim).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .attention_rows import attention_backends, attention_flops, attention_rows, math_jvp, sdpa_best
from .ceilings import ceiling_plan, ceiling_rows, gemm_ceiling
from .config import (ATTENTION_PRESETS, FLOP_CONVENTIONS, INIT_PRESETS, AttentionShape, BenchConfig, InitShape,
                     default_config, dtype_name, jvp_flop_factor, parse_shape)
from .init_rows import batched_qr, init_batched, init_floor, init_per_tensor, init_rows, make_stack, per_head_orthogonal
from .measure import VERDICTS, Row, Timer, fill_rates, judge, set_aim
from .report import format_table, json_text, machine_info, section_titles, to_json, write_json

__all__ = ["InitShape", "AttentionShape", "BenchConfig", "Row", "Timer", "INIT_PRESETS", "make_stack",
           "init_batched", "init_per_tensor", "init_floor", "per_head_orthogonal", "batched_qr",
           "ATTENTION_PRESETS", "FLOP_CONVENTIONS", "math_jvp", "attention_backends", "sdpa_best",
           "default_config", "ceiling_rows", "init_rows",
           "attention_rows", "run", "format_table", "to_json", "machine_info", "attention_flops",
           "parse_shape", "planned_rows", "write_json", "json_text", "dtype_name", "section_ceilings",
           "section_titles", "gemm_ceiling", "ceiling_plan", "judge", "set_aim", "VERDICTS", "jvp_flop_factor"]


SECTIONS = {"ceilings": ceiling_rows, "init": init_rows, "attention": attention_rows}


def run(cfg: BenchConfig, progress: Optional[Callable[[str], None]] = None,
        on_row: Optional[Callable[[Row], None]] = None) -> list[Row]:
    """Every row of ``cfg.sections`` (ceilings first: the others are rated against them), with its
    rate, its ceiling (:func:`section_ceilings`) and its verdict. ``progress(what)`` is called
    before each measurement, ``on_row(row)`` after it (its rates, ratios and verdict are filled in
    once the section, or for rates and verdicts the run, is done)."""
    progress = progress or (lambda s: None)
    rows: list[Row] = []
    for name in ("ceilings", "init", "attention"):
        if name in cfg.sections:
            rows += SECTIONS[name](cfg, progress, on_row)
    copy = next((r for r in rows if r.key == "ceilings.copy" and r.ok), None)
    for section, ceiling in section_ceilings(rows, cfg).items():
        fill_rates([r for r in rows if r.section == section], ceiling, copy)
    judge(rows)
    return rows


def section_ceilings(rows, cfg: BenchConfig) -> dict:
    """The FLOP ceiling row of each rated section: the fastest GEMM of the dtypes its products run
    in (init: fp32, the GEMM dtype of orthogonalization; attention: the run's dtype and fp32, in
    which the CPU kernels compute fp16 / bf16 inputs); None where no ceiling ran."""
    return {"init": gemm_ceiling(rows, (torch.float32,)),
            "attention": gemm_ceiling(rows, (cfg.dtype, torch.float32))}


def planned_rows(cfg: BenchConfig) -> int:
    """How many progress steps :func:`run` reports (for a progress bar)."""
    n = 0
    if "ceilings" in cfg.sections:
        n += len(ceiling_plan(cfg)) + 1
    if "init" in cfg.sections:
        n += 7 - sum(k in cfg.skip for k in ("orthogonal_loop", "batched_qr"))
    if "attention" in cfg.sections:
        n += 8 + (cfg.probes > 1) - sum(k in cfg.skip for k in ("math_jvp", "math_jvp_bwd", "jvp_probes"))
    return n
