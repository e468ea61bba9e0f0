"""The output of ``condinit bench``: the plain-text table of the rows, and the JSON file (machine,
versions, FLOP conventions, configuration and every row)."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from typing import Sequence

import torch

from .config import FLOP_CONVENTIONS, BenchConfig, dtype_name
from .measure import Row

__all__ = ["format_table", "machine_info", "versions", "to_json", "write_json"]


def _fmt_rate(r: Row) -> str:
    if r.rate is None:
        return ""
    if r.rate_unit == "FLOP/s":
        text = f"{r.rate / 1e12:.2f} TFLOP/s" if r.rate >= 1e12 else f"{r.rate / 1e9:.1f} GFLOP/s"
    else:
        text = f"{r.rate / 1e9:.1f} GB/s"
    if r.of_ceiling is not None:
        text += f" ({100 * r.of_ceiling:.0f}%)"
    return text


def _short(key: str) -> str:
    return key.split(".", 1)[1]


def format_table(rows: Sequence[Row], header: str = "") -> str:
    """The rows as a plain-text table: what, backend, time, rate (% of the measured ceiling), and
    time ratios to the rows compared against (``0.5x sdpa_fwd``: half of that row's time)."""
    cols = ["section", "what", "backend", "time [ms]", "rate (% of ceiling)", "time / other row's", "note"]
    table = []
    for r in rows:
        if not r.ok:
            table.append([r.section, r.name, r.backend, "-", "", "", f"ERROR {r.error}"])
            continue
        ratios = ", ".join(f"{v:.3g}x {_short(k)}" for k, v in r.ratios.items())
        note = "; ".join(x for x in (r.note, f"aim {r.aim}" if r.aim else "",
                                    f"peak {r.peak_bytes / 2**20:.0f} MiB" if r.peak_bytes is not None else "") if x)
        table.append([r.section, r.name, r.backend, f"{r.seconds * 1e3:.2f}", _fmt_rate(r), ratios, note])
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])
    lines = [header] if header else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    for t in table:
        lines.append("  ".join(x.rjust(w) if i == 3 else x.ljust(w) for i, (x, w) in enumerate(zip(t, widths))).rstrip())
    return "\n".join(lines)


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


def write_json(path, rows, cfg) -> None:
    with open(path, "w") as f:
        json.dump(to_json(rows, cfg), f, indent=1, default=str)
        f.write("\n")
