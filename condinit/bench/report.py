"""The output of ``condinit bench``: the plain-text tables of the rows, one per section, at most
:data:`WIDTH` columns wide whatever the terminal, and the JSON (machine, versions, FLOP
conventions, configuration and every row)."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import textwrap
import time
from typing import Optional, Sequence

import torch

from .ceilings import CEILING_REPEATS, CEILING_SECONDS
from .config import FLOP_CONVENTIONS, BenchConfig, dtype_name
from .measure import Row

__all__ = ["WIDTH", "format_table", "section_titles", "machine_info", "versions", "to_json", "json_text",
           "write_json"]

WIDTH = 120
# (header, width, right-aligned): 119 columns with the two-space gaps
COLUMNS = (("what", 44, False), ("backend", 30, False), ("time [ms]", 9, True), ("rate", 12, True),
           ("% ceil", 6, True), ("verdict", 8, False))
NOISE = ("* above its ceiling: timing noise (the ceiling is the fastest GEMM of this run; on a busy machine its "
         "fastest call can still be slower than this row's)")


def _fmt_rate(r: Row) -> str:
    """``r``'s rate in three significant digits (four from 1000 on): 12 characters at most."""
    if r.rate is None:
        return ""
    if r.rate_unit == "FLOP/s":
        value, unit = (r.rate / 1e12, "TFLOP/s") if r.rate >= 1e12 else (r.rate / 1e9, "GFLOP/s")
    else:
        value, unit = r.rate / 1e9, "GB/s"
    digits = 0 if value >= 100 else 1 if value >= 10 else 2
    return f"{value:.{digits}f} {unit}"


def _fmt_ceiling(r: Row) -> str:
    if r.of_ceiling is None:
        return ""
    return f"{100 * r.of_ceiling:.0f}%" + ("*" if r.above_ceiling else "")


def _short(key: str) -> str:
    return key.split(".", 1)[1]


def _details(r: Row) -> str:
    """What follows a row on its own indented lines: the error, or the time ratios, aim and notes."""
    if not r.ok:
        return f"ERROR {r.error}"
    parts = []
    if r.ratios:
        parts.append("time " + ", ".join(f"{v:.3g}x {_short(k)}" for k, v in r.ratios.items()))
    if r.aim:
        parts.append(f"aim {r.aim}")
    if r.note:
        parts.append(r.note)
    if r.peak_bytes is not None:
        parts.append(f"peak {r.peak_bytes / 2**20:.0f} MiB")
    return "; ".join(parts)


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False) or [indent.rstrip()]


def _line(cells: Sequence[str]) -> str:
    return "  ".join(c.rjust(w) if right else c.ljust(w)
                     for c, (_, w, right) in zip(cells, COLUMNS)).rstrip()


def format_table(rows: Sequence[Row], header: str = "", titles: Optional[dict] = None) -> str:
    """The rows as plain-text tables, one per section (``titles``: a line above each, by section
    name), each line at most :data:`WIDTH` columns: what, backend, median time, rate, its
    percentage of the row's ceiling and the verdict against the row's aim, then on indented lines
    the time ratios to the rows compared against (``0.5x sdpa_fwd``: half that row's time), the aim
    and the notes. ``header``: lines printed first (each wrapped to the width)."""
    titles = titles or {}
    out = [w for line in header.splitlines() for w in _wrap(line, WIDTH)] if header else []
    sections = list(dict.fromkeys(r.section for r in rows))
    for section in sections:
        if out:
            out.append("")
        out += _wrap(titles.get(section, section), WIDTH)
        out.append(_line([c for c, _, _ in COLUMNS]))
        out.append(_line(["-" * w for _, w, _ in COLUMNS]))
        srows = [r for r in rows if r.section == section]
        for r in srows:
            cells = [r.name, r.backend, f"{r.seconds * 1e3:.2f}" if r.ok else "-", _fmt_rate(r), _fmt_ceiling(r),
                     r.verdict]
            wrapped = [_wrap(c, w) for c, (_, w, _) in zip(cells, COLUMNS)]
            for i in range(max(len(w) for w in wrapped)):
                out.append(_line([w[i] if i < len(w) else "" for w in wrapped]))
            details = _details(r)
            if details:
                out += _wrap(details, WIDTH, "    ")
        if any(r.above_ceiling for r in srows):
            out += _wrap(NOISE, WIDTH)
    return "\n".join(out)


def section_titles(cfg: BenchConfig, ceilings: dict) -> dict:
    """The line above each section's table: what it measures, its FLOP convention and the ceiling
    its rates are a percentage of (``ceilings``: section -> ceiling row, from
    :func:`condinit.bench.section_ceilings`)."""
    dt = dtype_name(cfg.dtype)

    def rated(section):
        c = ceilings.get(section)
        if c is None:
            return "% ceil: no GEMM ceiling in this run (add ceilings to --sections)"
        dtypes = "fp32" if section == "init" else " or ".join(dict.fromkeys((dt, "fp32")))
        return (f"% ceil: of {_short(c.key)} ({c.name}, {c.backend}, {_fmt_rate(c)}), the fastest {dtypes} GEMM "
                "of this run")
    return {
        "ceilings": (f"ceilings: the machine's best rates in this run, each from its fastest of at least "
                     f"{max(cfg.repeats, CEILING_REPEATS)} calls and {CEILING_SECONDS:g} s; a row below is rated "
                     "against the fastest GEMM of the dtypes its products run in (its % ceil), or against the copy "
                     "for bytes"),
        "init": (f"init: {cfg.init_shape.label()}, {dt} weights. FLOPs: CholeskyQR2's 4 GEMMs of 2 d^2 D per "
                 f"d x D block (floor: 3 d^2 D), in fp32. {rated('init')}"),
        "attention": (f"attention: {cfg.attention_shape.label()} {dt}{' causal' if cfg.causal else ''}. FLOPs: "
                      "forward 4 B H N^2 d (halved causal), backward 2.5x, JVP 3x ((1 + 2P)x for P probes in one "
                      f"call), tangent backward 7.5x. {rated('attention')}"),
    }


def machine_info(device) -> dict:
    dev = torch.device(device)
    info = {"platform": platform.platform(), "processor": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    try:
        info["load_average_1min"] = os.getloadavg()[0]
    except OSError:
        pass
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}",
                    gpu_memory_bytes=props.total_memory, gpu_sms=props.multi_processor_count)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def versions() -> dict:
    from condinit import __version__, _ext
    out = {"condinit": __version__, "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "native_extension": _ext.status()[1]}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception as exc:  # reported, like `condinit info` does
        out["triton"] = f"unavailable ({type(exc).__name__})"
    return out


def to_json(rows: Sequence[Row], cfg: BenchConfig) -> dict:
    config = dataclasses.asdict(cfg)
    config["dtype"] = dtype_name(cfg.dtype)
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
            "machine": machine_info(cfg.device), "versions": versions(), "flop_conventions": FLOP_CONVENTIONS,
            "timing": ("median of CUDA-event times" if torch.device(cfg.device).type == "cuda"
                       else "median wall time") + f" of {cfg.repeats} calls after a warm-up call",
            "config": config, "rows": [dataclasses.asdict(r) for r in rows]}


def json_text(rows, cfg) -> str:
    """:func:`to_json` as the text ``--json`` writes."""
    return json.dumps(to_json(rows, cfg), indent=1, default=str) + "\n"


def write_json(path, rows, cfg) -> None:
    with open(path, "w") as f:
        f.write(json_text(rows, cfg))
