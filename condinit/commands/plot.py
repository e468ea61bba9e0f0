"""``condinit plot``: PNG curves of a JacobianMonitor run (kappa, max logit, attention entropy per layer)."""
from __future__ import annotations

import json
import math
import os

NAME = "plot"
HELP = ("plot a JacobianMonitor run: kappa(J), max attention logit and attention entropy per layer over steps, "
        "as PNGs")

# (record key, file name, y-axis label, log scale)
PLOTS = (("kappa", "kappa.png", "kappa(J)", True),
         ("max_logit", "max_logit.png", "max attention logit (max over heads)", False),
         ("entropy_mean", "entropy.png", "attention entropy, nats (mean over heads and queries)", False))


def add_arguments(p):
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="the monitor's log_dir (holding jacobian.jsonl), or the path of a JSONL file it wrote")
    p.add_argument("--out", default=None, metavar="DIR", help="where to write the PNGs (default: RUN_DIR)")


def read_records(path: str) -> tuple[list[dict], list[dict]]:
    """(per-layer records, alert records) of a monitor's JSONL file; ValueError names a bad line."""
    records, alerts = [], []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from None
            if not isinstance(rec, dict) or "step" not in rec or "layer" not in rec:
                raise ValueError(f"{path}:{lineno}: not a JacobianMonitor record (no step / layer)")
            (alerts if "alert" in rec else records).append(rec)
    return records, alerts


def series(records: list[dict], key: str) -> dict:
    """``{layer: ([steps], [values])}`` of the records with a finite ``key``, in step order."""
    out: dict = {}
    for rec in sorted(records, key=lambda r: (r["layer"], r["step"])):
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps, values = out.setdefault(rec["layer"], ([], []))
            steps.append(rec["step"])
            values.append(v)
    return out


def _resolve(run_dir: str) -> str:
    if os.path.isdir(run_dir):
        path = os.path.join(run_dir, "jacobian.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"RUN_DIR {run_dir}: no jacobian.jsonl in it (is it a JacobianMonitor log_dir?)")
        return path
    if not os.path.isfile(run_dir):
        raise FileNotFoundError(f"RUN_DIR {run_dir}: no such directory or file")
    return run_dir


def run(args) -> int:
    from condinit.cli import CLIError

    path = _resolve(args.run_dir)
    out = args.out if args.out is not None else (args.run_dir if os.path.isdir(args.run_dir)
                                                 else os.path.dirname(os.path.abspath(path)))
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out}: exists and is not a directory")
    records, alerts = read_records(path)
    if not records:
        raise CLIError(f"{path}: holds no per-layer records")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError("plots need matplotlib: pip install 'condinit[demo]'") from None
    os.makedirs(out, exist_ok=True)
    names = {r["layer"]: r.get("name") or "" for r in records}
    written = []
    for key, fname, label, log in PLOTS:
        data = series(records, key)
        if not data:
            print(f"{fname}: skipped, no record has a {key} value")
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for layer, (steps, values) in data.items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3,
                    label=f"{layer}: {names[layer]}" if names[layer] else f"layer {layer}")
        for a in alerts:     # mark where an alert on this signal fired
            if (key, a.get("alert")) in (("kappa", "kappa_growth"), ("max_logit", "max_logit"),
                                         ("entropy_mean", "entropy")):
                ax.axvline(a["step"], color="red", lw=0.8, ls=":")
        if log and all(v > 0 for _, values in data.values() for v in values):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(f"{label} per layer")
        if len(data) <= 24:
            ax.legend(fontsize=7, ncol=1 + len(data) // 12)
        fig.tight_layout()
        target = os.path.join(out, fname)
        fig.savefig(target, dpi=110)
        plt.close(fig)
        written.append(target)
    for target in written:
        print(target)
    return 0
