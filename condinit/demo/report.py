"""Summary, table, JSON, CSV and plots of a ``condinit demo`` run.

**Final value** of an init: its test accuracy (and loss) at the last step, mean and sample standard
deviation over seeds. **Target**: the default init's final mean accuracy. **Steps to target**: the
first evaluation step at which an init's seed-mean test accuracy reaches the target (``None`` if it
never does); **ratio** = steps to target / the step budget, so the default's budget is 1.0 and the
paper's "300 -> 211 epochs" reads as 0.70. **kappa(J)**: per layer, the geometric mean over seeds
of each probe's condition number (see :mod:`condinit.demo.train`); the table shows the geometric
mean over layers at step 0, the median over layers and probes after step 0, and how often (over
those probes and layers) an init's kappa is below the default's. A rank-deficient probe (``sigma_min
<= 1e-10 sigma_max``) counts as ``kappa = inf``; the plots draw it at ``KAPPA_CAP``.

Files are rendered in memory first and each is then written to a temporary file in the output
directory and renamed over its final name, so a reader never sees a half-written file and a failure
while rendering writes nothing.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
import tempfile

__all__ = ["summarize", "format_table", "render_files", "write_outputs", "check_output_dir", "INIT_COLORS"]

KAPPA_CAP = 1e10   # where the plots draw a rank-deficient (kappa = inf) probe
INIT_COLORS = {"default": "#7f7f7f", "mimetic": "#1f77b4", "conditioned": "#d62728", "spectral": "#2ca02c"}


def _stats(xs):
    xs = [float(x) for x in xs]
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "per_seed": xs}


def _geomean(xs):
    xs = [float(x) for x in xs]
    if any(not math.isfinite(x) or x <= 0 for x in xs):
        return math.inf
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def _mean_curve(runs, step_key, value_key):
    steps = runs[0][step_key]
    for r in runs:
        if r[step_key] != steps:
            raise ValueError("runs of one init must share their evaluation steps")
    return steps, [statistics.fmean(r[value_key][i] for r in runs) for i in range(len(steps))]


def summarize(results: dict) -> dict:
    """The per-task, per-init summary (see module doc) of :func:`condinit.demo.train.run_demo`'s output."""
    out = {"meta": results.get("meta", {}), "tasks": {}}
    for task, block in results["tasks"].items():
        runs = block["runs"]
        inits = list(dict.fromkeys(r["init"] for r in runs))
        by_init = {i: [r for r in runs if r["init"] == i] for i in inits}
        budget = block["config"]["steps"]
        ref = "default" if "default" in by_init else inits[0]
        target = statistics.fmean(r["eval_acc"][-1] for r in by_init[ref])
        kappa_curves = {}
        for init, rs in by_init.items():
            steps = rs[0]["probe_step"]
            n_layers = len(rs[0]["kappa"][0])
            kappa_curves[init] = [[_geomean(r["kappa"][p][lay] for r in rs) for p in range(len(steps))]
                                  for lay in range(n_layers)]
        t_out = {"config": block["config"], "metric": "accuracy", "reference_init": ref, "target_accuracy": target,
                 "budget_steps": budget, "inits": {}}
        for init, rs in by_init.items():
            eval_steps, acc_curve = _mean_curve(rs, "eval_step", "eval_acc")
            reach = next((s for s, a in zip(eval_steps, acc_curve) if a >= target), None)
            kc = kappa_curves[init]
            probe_steps = rs[0]["probe_step"]
            below = None
            if init != ref:
                pairs = [(kc[lay][p], kappa_curves[ref][lay][p]) for lay in range(len(kc))
                         for p in range(1, len(probe_steps))]
                below = sum(a < b for a, b in pairs) / len(pairs) if pairs else None
            t_out["inits"][init] = {
                "seeds": [r["seed"] for r in rs],
                "final_accuracy": _stats(r["eval_acc"][-1] for r in rs),
                "final_loss": _stats(r["eval_loss"][-1] for r in rs),
                "best_accuracy": _stats(max(r["eval_acc"]) for r in rs),
                "steps_to_target": reach,
                "steps_ratio": None if reach is None else reach / budget,
                "kappa_probe_steps": probe_steps,
                "kappa_per_layer": kc,
                "kappa_initial": _geomean(kc[lay][0] for lay in range(len(kc))),
                "kappa_final": _geomean(kc[lay][-1] for lay in range(len(kc))),
                "kappa_median_training": statistics.median(kc[lay][p] for lay in range(len(kc))
                                                           for p in range(1, len(probe_steps)))
                if len(probe_steps) > 1 else None,
                "kappa_rank_deficient_probes": sum(not math.isfinite(r["kappa"][p][lay]) for r in rs
                                                   for p in range(len(probe_steps)) for lay in range(len(kc))),
                "kappa_below_default_fraction": below,
                "seconds": _stats(r["seconds"] for r in rs),
            }
        out["tasks"][task] = t_out
    return out


def _fmt_kappa(k):
    return "inf (rank-deficient)" if not math.isfinite(k) else f"{k:.3g}"


def table_rows(summary: dict):
    """Header and rows of the paper-style table (strings)."""
    header = ["task", "init", "final acc (mean ± std)", "final loss", "steps to default's final acc",
              "ratio", "κ(J) at init", "κ(J) median, training", "κ(J) < default's"]
    rows = []
    for task, t in summary["tasks"].items():
        for init, s in t["inits"].items():
            fa, fl = s["final_accuracy"], s["final_loss"]
            reach = "not reached" if s["steps_to_target"] is None else str(s["steps_to_target"])
            ratio = "-" if s["steps_ratio"] is None else f"{s['steps_ratio']:.2f}"
            below = "-" if s["kappa_below_default_fraction"] is None else f"{100 * s['kappa_below_default_fraction']:.0f} %"
            rows.append([task, init, f"{100 * fa['mean']:.1f} ± {100 * fa['std']:.1f} %", f"{fl['mean']:.3f}",
                         f"{reach} / {t['budget_steps']}", ratio, _fmt_kappa(s["kappa_initial"]),
                         "-" if s["kappa_median_training"] is None else _fmt_kappa(s["kappa_median_training"]), below])
    return header, rows


def format_table(summary: dict) -> str:
    """The table as GitHub markdown."""
    header, rows = table_rows(summary)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def curves_csv(results: dict) -> str:
    """Long format: ``task,init,seed,step,series,layer,value`` (``layer`` empty except for kappa)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["task", "init", "seed", "step", "series", "layer", "value"])
    for task, block in results["tasks"].items():
        for r in block["runs"]:
            key = (task, r["init"], r["seed"])
            for series, steps in (("train_loss", "train_step"), ("train_acc", "train_step"),
                                  ("eval_loss", "eval_step"), ("eval_acc", "eval_step")):
                for s, v in zip(r[steps], r[series]):
                    w.writerow([*key, s, series, "", repr(float(v))])
            for series in ("kappa", "sigma_max", "sigma_min"):
                for s, per_layer in zip(r["probe_step"], r[series]):
                    for lay, v in enumerate(per_layer):
                        w.writerow([*key, s, series, lay, repr(float(v))])
    return buf.getvalue()


def _running_mean(xs, k):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _band(runs, step_key, key, smooth=1):
    steps = runs[0][step_key]
    curves = [_running_mean(r[key], smooth) if smooth > 1 else list(r[key]) for r in runs]
    mean = [statistics.fmean(c[i] for c in curves) for i in range(len(steps))]
    lo = [min(c[i] for c in curves) for i in range(len(steps))]
    hi = [max(c[i] for c in curves) for i in range(len(steps))]
    return steps, mean, lo, hi


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def render_plots(results: dict, summary: dict) -> dict:
    """``{filename: png bytes}``: per task, loss/accuracy curves and kappa(J) per layer.

    Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend change).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    files = {}
    for task, block in results["tasks"].items():
        runs = block["runs"]
        inits = list(dict.fromkeys(r["init"] for r in runs))
        n_seeds = len({r["seed"] for r in runs})
        fig = Figure(figsize=(11, 4))
        FigureCanvasAgg(fig)
        ax_l, ax_a = fig.subplots(1, 2)
        smooth = max(1, block["config"]["steps"] // 40)
        for init in inits:
            rs = [r for r in runs if r["init"] == init]
            c = INIT_COLORS.get(init)
            s, m, lo, hi = _band(rs, "train_step", "train_loss", smooth)
            ax_l.plot(s, m, color=c, label=init)
            ax_l.fill_between(s, lo, hi, color=c, alpha=0.2, linewidth=0)
            s, m, lo, hi = _band(rs, "eval_step", "eval_acc")
            ax_a.plot(s, [100 * v for v in m], color=c, label=init)
            ax_a.fill_between(s, [100 * v for v in lo], [100 * v for v in hi], color=c, alpha=0.2, linewidth=0)
        tgt = 100 * summary["tasks"][task]["target_accuracy"]
        ax_a.axhline(tgt, color="black", linestyle=":", linewidth=1, label="default's final")
        ax_l.set(xlabel="step", ylabel=f"training loss (running mean of {smooth})", yscale="log",
                 title=f"{task}: training loss")
        ax_a.set(xlabel="step", ylabel="test accuracy (%)", title=f"{task}: test accuracy")
        ax_a.legend(fontsize=8)
        fig.suptitle(f"condinit demo, {task}: mean over {n_seeds} seed(s), band = min..max over seeds", fontsize=10)
        files[f"{task}_curves.png"] = _png(fig)

        n_layers = len(runs[0]["kappa"][0])
        fig = Figure(figsize=(5.5 * n_layers, 4))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, n_layers, squeeze=False)[0]
        for lay, ax in enumerate(axes):
            for init in inits:
                rs = [r for r in runs if r["init"] == init]
                c = INIT_COLORS.get(init)
                steps = rs[0]["probe_step"]
                vals = [[min(r["kappa"][p][lay], KAPPA_CAP) for r in rs] for p in range(len(steps))]
                ax.plot(steps, [_geomean(v) for v in vals], color=c, marker=".", label=init)
                ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=c, alpha=0.2,
                                linewidth=0)
            if any(not math.isfinite(r["kappa"][p][lay]) for r in runs for p in range(len(r["probe_step"]))):
                ax.axhline(KAPPA_CAP, color="black", linestyle="--", linewidth=0.8, label="rank-deficient (κ = ∞)")
            ax.set(xlabel="step", ylabel="κ(J) = σ_max / σ_min", yscale="log",
                   title=f"{task}: attention layer {lay}")
            ax.legend(fontsize=8)
        fig.suptitle(f"condinit demo, {task}: κ of the attention Jacobian wrt W_Q, W_K, W_V "
                     f"(geometric mean over {n_seeds} seed(s), band = min..max)", fontsize=10)
        files[f"{task}_kappa.png"] = _png(fig)
    return files


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def render_files(results: dict, summary: dict, *, plots: bool = True) -> dict:
    """Every output file, rendered in memory: ``{name: bytes}``."""
    files = {
        "summary.json": (json.dumps(_json_safe(summary), indent=1, allow_nan=False) + "\n").encode(),
        "curves.csv": curves_csv(results).encode(),
        "table.md": (format_table(summary) + "\n").encode(),
    }
    if plots:
        files.update(render_plots(results, summary))
    return files


def check_output_dir(path) -> str:
    """Raise ValueError unless ``path`` is (or can be created as) a writable directory. Writes nothing."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"out must be a directory path, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        what = "is" if probe == path else f"cannot be created: {probe!r} is"
        raise ValueError(f"out directory {path!r} {what} not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"out directory {path!r} is not writable ({probe!r} does not allow writing)")
    try:  # os.access says yes to root on read-only mounts: try for real, leave nothing behind
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise ValueError(f"out directory {path!r} is not writable: {exc}") from exc
    return path


def write_outputs(out_dir, files: dict) -> list[str]:
    """Write ``{name: bytes}`` into ``out_dir`` (created if needed), each file atomically."""
    out_dir = check_output_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    mode = 0o666 & ~umask          # mkstemp makes 0600 files; give the usual permissions
    written, tmps = [], []
    try:
        for name, data in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
            tmps.append(tmp)
            os.chmod(tmp, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for (name, _), tmp in zip(files.items(), tmps):
            final = os.path.join(out_dir, name)
            os.replace(tmp, final)
            written.append(final)
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return written
