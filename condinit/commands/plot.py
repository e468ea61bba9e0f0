"""``condinit plot``: PNG curves of a JacobianMonitor run (kappa, max logit, attention entropy per layer).

The output directory and files are checked before the log is read; every malformed line of the log
is refused with its file, line number and field; each PNG is written atomically inside the output
directory (a symlink in a PNG's place is replaced by the PNG, its target never written)."""
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


# fields a record may hold that the plots read, and what each must be
_INT_FIELDS = ("step", "layer")
_TEXT_FIELDS = ("name", "alert")
_NUMBER_FIELDS = tuple(key for key, *_ in PLOTS)


def _field_error(rec: dict) -> str | None:
    """Why a record's fields cannot be plotted (naming the field), or None."""
    for key in _INT_FIELDS:
        v = rec[key]
        if not isinstance(v, int) or isinstance(v, bool):
            return f"field {key!r} is {_kind(v)}, expected an integer"
    for key in _TEXT_FIELDS:
        v = rec.get(key)
        if v is not None and not isinstance(v, str):
            return f"field {key!r} is {_kind(v)}, expected a string"
    for key in _NUMBER_FIELDS:
        v = rec.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            return f"field {key!r} is {_kind(v)}, expected a number or null"
    return None


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a float", type(None): "null"}.get(type(v), type(v).__name__)


def read_records(path: str) -> tuple[list[dict], list[dict]]:
    """(per-layer records, alert records) of a monitor's JSONL file; a line that is not UTF-8, not
    JSON, nested too deeply, not a record or holding a field of the wrong type is a ValueError naming
    the file, the line and the field."""
    records, alerts = [], []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from None
            except RecursionError:
                raise ValueError(f"{path}:{lineno}: not a JSON line (nested too deeply)") from None
            except ValueError as exc:   # e.g. an integer beyond the digits limit
                raise ValueError(f"{path}:{lineno}: not a JSON line ({exc})") from None
            if not isinstance(rec, dict) or "step" not in rec or "layer" not in rec:
                raise ValueError(f"{path}:{lineno}: not a JacobianMonitor record (no step / layer)")
            why = _field_error(rec)
            if why is not None:
                raise ValueError(f"{path}:{lineno}: {why}")
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

    from condinit.io.atomic import check_output_dir
    from condinit.io.atomic import atomic_output, check_output_path

    path = _resolve(args.run_dir)
    out = args.out if args.out is not None else (args.run_dir if os.path.isdir(args.run_dir)
                                                 else os.path.dirname(os.path.abspath(path)))
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out}: exists and is not a directory")
    check_output_dir(out)
    if os.path.isdir(out):
        for _, fname, _, _ in PLOTS:
            check_output_path(os.path.join(out, fname), follow_symlinks=False)
    records, alerts = read_records(path)
    if not records:
        raise CLIError(f"{path}: holds no per-layer records")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError("condinit plot needs matplotlib: pip install 'condinit[plot]'") from None
    os.makedirs(out, exist_ok=True)  # its parent exists (check_output_dir)
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
        try:
            with atomic_output(target, follow_symlinks=False) as tmp:
                fig.savefig(tmp, format="png", dpi=110)
        finally:
            plt.close(fig)
        written.append(target)
    for target in written:
        print(target)
    return 0
