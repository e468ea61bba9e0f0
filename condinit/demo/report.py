"""Summary, tables, JSON, CSV and plots of a ``condinit demo`` run.

Per task and init:

* **LR sweep**: the final validation metric (accuracy for MQAR and vision, higher is better; loss
  in nats per character for the LMs, lower is better), mean over seeds, at each learning-rate
  multiplier. **Best LR** (:func:`select_best_lr`): the multiplier with the best mean final
  metric, ties broken by the lower mean final loss, then by the smaller multiplier. Everything
  else below is at the init's own best LR, so no init is judged at another's tuned setting.
* **Final value**: mean and sample standard deviation over seeds at the last step.
* **Target**: the default init's final mean metric (at its best LR). **Steps to target**: the
  first evaluation step at which the init's seed-mean curve reaches it (``None`` if never).
* LMs: the validation loss at 25 % and 50 % of the budget. MQAR: the final accuracy per query,
  beside the shortcut baseline (:func:`condinit.demo.tasks.mqar_shortcut_baseline`).
* **kappa**: per layer at step 0 and at the end, the geometric mean over seeds of ``kappa(J)``,
  ``sigma_min(J)`` and ``sigma_min(P X)``, and the mean ``value_share`` (see
  :mod:`condinit.demo.train`); the table shows geometric means over layers (``value_share``: the
  smallest over layers), "value path" when every layer's share is at least ``VALUE_PATH_SHARE``.
* **kappa vs result**: per task, the Spearman rank correlation over inits between ``kappa(J)`` at
  init and the final metric (as "goodness": accuracy, or minus the loss). If a lower kappa meant
  faster training it would be near -1.

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

from condinit.io.atomic import check_output_dir

from .inits import INIT_LABELS

__all__ = ["summarize", "select_best_lr", "spearman", "format_table", "table_rows", "render_files",
           "write_outputs", "task_caption", "INIT_COLORS", "VALUE_PATH_SHARE"]

VALUE_PATH_SHARE = 0.9
BUDGET_FRACTIONS = (0.25, 0.5)
INIT_COLORS = {"default": "#7f7f7f", "mimetic": "#1f77b4", "conditioned": "#d62728", "spectral": "#2ca02c",
               "conditioned-qk": "#ff7f0e", "conditioned-v0.1": "#9467bd"}


def _stats(xs):
    xs = [float(x) for x in xs]
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "per_seed": xs}


def _geomean(xs):
    xs = [float(x) for x in xs]
    if any(math.isnan(x) for x in xs):
        return math.nan                 # a diverged run has no Jacobian
    if any(not math.isfinite(x) or x <= 0 for x in xs):
        return math.inf if any(x == math.inf for x in xs) else 0.0
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def _mean_curve(runs, step_key, value_key):
    steps = runs[0][step_key]
    for r in runs:
        if r[step_key] != steps:
            raise ValueError("runs of one init must share their evaluation steps")
    return steps, [statistics.fmean(r[value_key][i] for r in runs) for i in range(len(steps))]


def select_best_lr(sweep: dict, *, higher_is_better: bool):
    """The best learning-rate multiplier of ``sweep`` = ``{mult: (metric_mean, loss_mean)}``: best
    metric, then lower loss, then smaller multiplier. NaN metrics (diverged runs) never win unless
    every entry is NaN.

    Examples:
        >>> select_best_lr({0.3: (0.55, 0.9), 1.0: (0.99, 0.05), 3.0: (0.99, 0.03)}, higher_is_better=True)
        3.0
    """
    if not sweep:
        raise ValueError("sweep must hold at least one learning rate")

    def key(item):
        mult, (metric, loss) = item
        bad = not math.isfinite(metric)
        m = 0.0 if bad else (-metric if higher_is_better else metric)
        return (bad, m, loss if math.isfinite(loss) else math.inf, mult)

    return min(sweep.items(), key=key)[0]


def _ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(xs, ys):
    """Spearman rank correlation (average ranks for ties); None for fewer than 3 points or no spread."""
    if len(xs) != len(ys):
        raise ValueError("xs and ys must have the same length")
    if len(xs) < 3:
        return None
    rx, ry = _ranks(list(xs)), _ranks(list(ys))
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _kappa_spearman(pairs):
    """Spearman over the inits whose kappa and result are numbers (a diverged run has neither)."""
    pairs = [(k, g) for k, g in pairs if not math.isnan(k) and math.isfinite(g)]
    return spearman([k for k, _ in pairs], [g for _, g in pairs])


def _final_metric(run, metric):
    return run["eval_acc"][-1] if metric == "accuracy" else run["eval_loss"][-1]


def _probe_summary(rs, idx):
    """Per-layer seed-geomeans of the probe at index ``idx`` (0: init, -1: end)."""
    n_layers = len(rs[0]["kappa"][0])
    per_layer = []
    for lay in range(n_layers):
        per_layer.append({key: _geomean(r[key][idx][lay] for r in rs)
                          for key in ("kappa", "sigma_max", "sigma_min", "sigma_min_px")})
        per_layer[-1]["value_share"] = statistics.fmean(r["value_share"][idx][lay] for r in rs)
    return {"per_layer": per_layer,
            "kappa": _geomean(p["kappa"] for p in per_layer),
            "sigma_min": _geomean(p["sigma_min"] for p in per_layer),
            "sigma_min_px": _geomean(p["sigma_min_px"] for p in per_layer),
            "value_share_min": min(p["value_share"] for p in per_layer),
            "value_path": all(p["value_share"] >= VALUE_PATH_SHARE for p in per_layer)}


def summarize(results: dict) -> dict:
    """The per-task, per-init summary (see module doc) of :func:`condinit.demo.train.run_demo`'s output."""
    out = {"meta": results.get("meta", {}), "tasks": {}}
    for task, block in results["tasks"].items():
        runs, metric = block["runs"], block.get("metric", "accuracy")
        higher = metric == "accuracy"
        cfg = block["config"]
        budget = cfg["steps"]
        inits = list(dict.fromkeys(r["init"] for r in runs))
        mults = list(dict.fromkeys(r["lr_mult"] for r in runs))
        group = {(i, m): [r for r in runs if r["init"] == i and r["lr_mult"] == m] for i in inits for m in mults}
        t_out = {"config": cfg, "info": block.get("info", {}), "metric": metric, "higher_is_better": higher,
                 "budget_steps": budget, "lr_multipliers": mults, "inits": {}}
        best = {}
        for init in inits:
            sweep = {m: (statistics.fmean(_final_metric(r, metric) for r in group[(init, m)]),
                         statistics.fmean(r["eval_loss"][-1] for r in group[(init, m)])) for m in mults}
            best[init] = (select_best_lr(sweep, higher_is_better=higher), sweep)
        ref = "default" if "default" in inits else inits[0]
        target = best[ref][1][best[ref][0]][0]
        t_out.update({"reference_init": ref, "target": target})
        good_key = []
        for init in inits:
            mult, sweep = best[init]
            rs = group[(init, mult)]
            key = "eval_acc" if higher else "eval_loss"
            eval_steps, curve = _mean_curve(rs, "eval_step", key)
            reach = next((s for s, v in zip(eval_steps, curve) if (v >= target if higher else v <= target)), None)
            at_budget = {}
            for frac in BUDGET_FRACTIONS:
                idx = next(i for i, s in enumerate(eval_steps) if s >= frac * budget)
                at_budget[str(frac)] = {"step": eval_steps[idx], "mean": curve[idx]}
            s = {
                "label": INIT_LABELS.get(init, init),
                "seeds": [r["seed"] for r in rs],
                "best_lr_mult": mult, "best_lr": rs[0]["lr"],
                "sweep": {str(m): {"metric_mean": v[0], "loss_mean": v[1],
                                   "metric_per_seed": [_final_metric(r, metric) for r in group[(init, m)]]}
                          for m, v in sweep.items()},
                "final_metric": _stats(_final_metric(r, metric) for r in rs),
                "final_loss": _stats(r["eval_loss"][-1] for r in rs),
                "final_accuracy": _stats(r["eval_acc"][-1] for r in rs),
                "steps_to_target": reach,
                "steps_ratio": None if reach is None else reach / budget,
                "metric_at_budget": at_budget,
                "kappa_init": _probe_summary(rs, 0),
                "kappa_final": _probe_summary(rs, -1),
                "seconds": _stats(r["seconds"] for r in rs),
            }
            if rs[0].get("eval_query_acc"):
                nq = len(rs[0]["eval_query_acc"][-1])
                s["final_query_accuracy"] = [statistics.fmean(r["eval_query_acc"][-1][q] for r in rs) for q in range(nq)]
            t_out["inits"][init] = s
            good_key.append((init, s["kappa_init"]["kappa"], s["kappa_final"]["kappa"],
                             s["final_metric"]["mean"] if higher else -s["final_metric"]["mean"]))
        t_out["kappa_vs_result"] = {
            "spearman_kappa_init_vs_goodness": _kappa_spearman([(k, g) for _, k, _, g in good_key]),
            "spearman_kappa_final_vs_goodness": _kappa_spearman([(k, g) for _, _, k, g in good_key]),
            "inits": len(good_key)}
        out["tasks"][task] = t_out
    return out


# ------------------------------------------------------------------------------------------------
# tables

def _fmt_g(x):
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "inf"
    return f"{x:.3g}"


def _fmt_metric(v, metric):
    return f"{100 * v:.1f}" if metric == "accuracy" else f"{v:.3f}"


def _fmt_mult(m):
    return f"{m:g}x"


def table_rows(summary: dict, task: str):
    """Header and rows (strings) of ``task``'s table."""
    t = summary["tasks"][task]
    metric, mults = t["metric"], t["lr_multipliers"]
    unit = "acc %" if metric == "accuracy" else "val loss"
    header = ["init", f"LR sweep ({unit}): " + " / ".join(_fmt_mult(m) for m in mults), "best LR",
              f"final {unit} (mean ± std)", f"steps to default's final ({t['budget_steps']})"]
    if metric == "loss":
        header.append("val loss @ " + " / ".join(f"{int(100 * f)} %" for f in BUDGET_FRACTIONS))
    is_mqar = any("final_query_accuracy" in s for s in t["inits"].values())
    if is_mqar:
        sc = t["info"].get("shortcut_per_query", [])
        header.append("acc per query (shortcut " + " ".join(f"{v:.2f}" for v in sc) + ")")
    header += ["κ(J) init", "σ_min(J) / σ_min(PX) init", "V share (init)", "κ(J) end"]
    rows = []
    for init, s in t["inits"].items():
        sweep = " / ".join(("*" if float(m) == s["best_lr_mult"] else "") + _fmt_metric(v["metric_mean"], metric)
                           for m, v in s["sweep"].items())
        fm = s["final_metric"]
        mean_std = (f"{100 * fm['mean']:.1f} ± {100 * fm['std']:.1f}" if metric == "accuracy"
                    else f"{fm['mean']:.3f} ± {fm['std']:.3f}")
        row = [s["label"], sweep, f"{_fmt_mult(s['best_lr_mult'])} ({s['best_lr']:.2g})", mean_std,
               "not reached" if s["steps_to_target"] is None else str(s["steps_to_target"])]
        if metric == "loss":
            row.append(" / ".join(f"{s['metric_at_budget'][str(f)]['mean']:.3f}" for f in BUDGET_FRACTIONS))
        if is_mqar:
            row.append(" ".join(f"{v:.2f}" for v in s.get("final_query_accuracy", [])))
        ki, kf = s["kappa_init"], s["kappa_final"]
        share = f"{100 * ki['value_share_min']:.0f} %" + (" (value path)" if ki["value_path"] else "")
        row += [_fmt_g(ki["kappa"]), f"{_fmt_g(ki['sigma_min'])} / {_fmt_g(ki['sigma_min_px'])}", share,
                _fmt_g(kf["kappa"])]
        rows.append(row)
    return header, rows


def task_caption(task: str, t: dict) -> str:
    """One task's caption: model and training configuration, corpus or baseline, and kappa against the result."""
    cfg, info = t["config"], t["info"]
    m = cfg["model"]
    parts = [f"width {m['dim']}, {m.get('depth', 2)} layers, {m['num_heads']} heads, {cfg['steps']} steps, "
             f"batch {cfg['batch_size']}, base LR {cfg['lr']:g}"]
    if "sha256" in info:
        parts.append(f"corpus: Python {info['python']} stdlib, {info['files']} files, {info['train_chars']:,} train / "
                     f"{info['valid_chars']:,} validation characters, sha256 {info['sha256'][:12]}")
    if "shortcut_mean" in info:
        parts.append(f"shortcut baseline {100 * info['shortcut_mean']:.1f} %, chance {100 * info['chance']:.1f} %")
    kv = t["kappa_vs_result"]
    rho = kv["spearman_kappa_init_vs_goodness"]
    parts.append("Spearman(κ(J) at init, result) over inits = " + ("-" if rho is None else f"{rho:+.2f}"))
    return "; ".join(parts)


def format_table(summary: dict) -> str:
    """Every task's table as GitHub markdown, each under a caption line."""
    out = []
    for task, t in summary["tasks"].items():
        header, rows = table_rows(summary, task)
        out.append(f"**{task}** ({task_caption(task, t)})\n")
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" for _ in header) + "|")
        out += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("")
    out.append("`*`: the best LR of the sweep. Everything after the sweep column is at each init's best LR.")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# files

def curves_csv(results: dict) -> str:
    """Long format: ``task,init,lr_mult,seed,step,series,index,value`` (``index``: layer for probe
    series, query for ``eval_query_acc``, else empty)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["task", "init", "lr_mult", "seed", "step", "series", "index", "value"])
    for task, block in results["tasks"].items():
        for r in block["runs"]:
            key = (task, r["init"], r["lr_mult"], r["seed"])
            for series, steps in (("train_loss", "train_step"), ("eval_loss", "eval_step"), ("eval_acc", "eval_step")):
                for s, v in zip(r[steps], r[series]):
                    w.writerow([*key, s, series, "", repr(float(v))])
            for s, per_q in zip(r["eval_step"], r.get("eval_query_acc") or []):
                for q, v in enumerate(per_q):
                    w.writerow([*key, s, "eval_query_acc", q, repr(float(v))])
            for series in ("kappa", "sigma_max", "sigma_min", "sigma_min_px", "value_share"):
                for s, per_layer in zip(r["probe_step"], r[series]):
                    for lay, v in enumerate(per_layer):
                        w.writerow([*key, s, series, lay, repr(float(v))])
    return buf.getvalue()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, bbox_inches="tight")
    return buf.getvalue()


def render_plots(results: dict, summary: dict) -> dict:
    """``{<task>.png: bytes}``: curves at each init's best LR, the LR sweep, kappa(J) at init and at
    the end with sigma_min(PX), and for MQAR the accuracy per query against the shortcut baseline.

    Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend change).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    files = {}
    for task, block in results["tasks"].items():
        t = summary["tasks"][task]
        metric, higher = t["metric"], t["higher_is_better"]
        runs = block["runs"]
        inits = list(t["inits"])
        is_mqar = "shortcut_per_query" in t["info"]
        n_panels = 4 if is_mqar else 3
        fig = Figure(figsize=(4.2 * n_panels, 3.4))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, n_panels)
        scale = 100 if higher else 1
        ylabel = "validation accuracy (%)" if higher else "validation loss (nats/char)"
        ax = axes[0]
        for init in inits:
            s = t["inits"][init]
            rs = [r for r in runs if r["init"] == init and r["lr_mult"] == s["best_lr_mult"]]
            key = "eval_acc" if higher else "eval_loss"
            steps, mean = _mean_curve(rs, "eval_step", key)
            c = INIT_COLORS.get(init)
            ax.plot(steps, [scale * v for v in mean], color=c, label=f"{init} ({_fmt_mult(s['best_lr_mult'])})")
            lo = [scale * min(r[key][i] for r in rs) for i in range(len(steps))]
            hi = [scale * max(r[key][i] for r in rs) for i in range(len(steps))]
            ax.fill_between(steps, lo, hi, color=c, alpha=0.15, linewidth=0)
        ax.axhline(scale * t["target"], color="black", linestyle=":", linewidth=1, label="default's final")
        if is_mqar:
            ax.axhline(100 * t["info"]["shortcut_mean"], color="black", linestyle="--", linewidth=1,
                       label="shortcut baseline")
        if not higher:
            finals = [t["inits"][i]["final_metric"]["min"] for i in inits]
            ax.set_ylim(min(finals) - 0.1, max(finals) + 1.0)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{task}: at each init's best LR")
        ax.legend(fontsize=6)

        ax = axes[1]
        for init in inits:
            s = t["inits"][init]
            ms = [float(m) for m in s["sweep"]]
            ax.plot(ms, [scale * v["metric_mean"] for v in s["sweep"].values()], marker="o",
                    color=INIT_COLORS.get(init), label=init)
        ax.set(xscale="log", xlabel=f"LR multiplier (base {t['config']['lr']:g})", ylabel=f"final {ylabel}",
               title=f"{task}: LR sweep (mean over seeds)")
        ax.set_xticks([float(m) for m in t["lr_multipliers"]], [_fmt_mult(m) for m in t["lr_multipliers"]])
        ax.minorticks_off()
        if not higher:
            finals = [v["metric_mean"] for s in t["inits"].values() for v in s["sweep"].values()
                      if math.isfinite(v["metric_mean"])]
            ax.set_ylim(min(finals) - 0.05, min(max(finals), min(finals) + 1.5) + 0.05)

        ax = axes[2]
        xs = range(len(inits))
        for which, marker in (("kappa_init", "o"), ("kappa_final", "x")):
            ax.scatter(xs, [min(t["inits"][i][which]["kappa"], 1e12) for i in inits], marker=marker,
                       color=[INIT_COLORS.get(i) for i in inits], label="κ(J) " + ("init" if marker == "o" else "end"))
        ax2 = ax.twinx()
        ax2.plot(xs, [t["inits"][i]["kappa_init"]["sigma_min"] for i in inits], "k.", label="σ_min(J) init")
        ax2.plot(xs, [t["inits"][i]["kappa_init"]["sigma_min_px"] for i in inits], "k_", markersize=12,
                 label="σ_min(PX) init")
        ax2.set_yscale("log")
        ax2.set_ylabel("σ_min (black)", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(inits, rotation=30, ha="right", fontsize=7)
        ax.set(yscale="log", ylabel="κ(J) (o: init, x: end)", title=f"{task}: κ(J) and what sets it")
        ax2.legend(fontsize=6, loc="lower right")

        if is_mqar:
            ax = axes[3]
            nq = len(t["info"]["shortcut_per_query"])
            w = 0.8 / len(inits)
            for k, init in enumerate(inits):
                pq = t["inits"][init].get("final_query_accuracy", [])
                ax.bar([q + (k - len(inits) / 2 + 0.5) * w for q in range(nq)], [100 * v for v in pq], width=w,
                       color=INIT_COLORS.get(init), label=init)
            for q, v in enumerate(t["info"]["shortcut_per_query"]):
                ax.hlines(100 * v, q - 0.45, q + 0.45, color="black", linewidth=2,
                          label="shortcut baseline" if q == 0 else None)
            ax.set_xticks(range(nq))
            ax.set_xticklabels([f"query {q + 1}" for q in range(nq)])
            ax.set(ylabel="final accuracy (%)", title=f"{task}: per query vs shortcut")
            ax.legend(fontsize=6)
        n_seeds = len({r["seed"] for r in runs})
        fig.suptitle(f"condinit demo, {task}: mean over {n_seeds} seed(s), band = min..max", fontsize=9)
        fig.tight_layout()
        files[f"{task}.png"] = _png(fig)
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


def write_outputs(out_dir, files: dict) -> list[str]:
    """Write ``{name: bytes}`` into ``out_dir`` (created if needed, in its existing parent), each file atomically."""
    out_dir = check_output_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)  # its parent exists (check_output_dir)
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
