"""``condinit demo``: the paper's claim, reproduced at small scale on CPU, with plots.

Trains small Transformers from scratch with four attention initializations side by side (framework
default, mimetic, conditioned, spectral conditioning; see :mod:`condinit.demo.inits`) on two tasks
whose data ship with the dependencies (scikit-learn's digits for a tiny ViT, multi-query associative
recall for a tiny causal LM), logs loss, accuracy and the attention Jacobian's condition number,
prints the paper-style table and writes ``summary.json``, ``curves.csv``, ``table.md`` and PNG plots
to ``--out``.
"""
from __future__ import annotations

import os
import platform
import sys
import time

NAME = "demo"
HELP = ("train small Transformers with default, mimetic, conditioned and spectral attention init side by side "
        "(digits ViT, associative-recall LM) and report accuracy, steps to the default's accuracy and kappa(J)")

TASK_CHOICES = ("vision", "text", "all")


def add_arguments(p):
    p.add_argument("--task", default="all", metavar="{vision,text,all}",
                   help="which task: vision (digits ViT), text (MQAR causal LM) or all (default)")
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="number of seeds 0..N-1 per init (default 3; 2 with --quick)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="training steps per run (default per task: vision 600, text 1200; --quick 40)")
    p.add_argument("--out", default="condinit-demo", metavar="DIR",
                   help="output directory for summary.json, curves.csv, table.md and plots (default ./condinit-demo)")
    p.add_argument("--quick", action="store_true", help="a smoke run (well under a minute): few steps, small probes")
    p.add_argument("--inits", default=None, metavar="LIST",
                   help="comma-separated subset of default,mimetic,conditioned,spectral (default: all four)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="worker processes, each single-threaded (default: min(2, CPUs)); results do not depend on it")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (needs matplotlib otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _validate(args):
    from condinit._validate import check_choice, check_int
    from condinit.demo.inits import INITS
    from condinit.demo.report import check_output_dir

    check_choice("--task", args.task, TASK_CHOICES)
    tasks = ("vision", "text") if args.task == "all" else (args.task,)
    seeds = check_int("--seeds", args.seeds if args.seeds is not None else (2 if args.quick else 3), min=1)
    check_int("--steps", args.steps, min=1, allow_none=True)
    inits = INITS if args.inits is None else tuple(s.strip() for s in args.inits.split(",") if s.strip())
    bad = [i for i in inits if i not in INITS]
    if bad or not inits:
        raise ValueError(f"--inits must be a comma-separated subset of {','.join(INITS)}, got {args.inits!r}")
    if len(set(inits)) != len(inits):
        raise ValueError(f"--inits lists an init twice: {args.inits!r}")
    jobs = check_int("--jobs", args.jobs if args.jobs is not None else max(1, min(2, os.cpu_count() or 1)), min=1)
    out = check_output_dir(args.out)
    plots = not args.no_plots
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ValueError("plots need matplotlib (pip install 'condinit[demo]'), or pass --no-plots") from exc
    if "vision" in tasks:
        from condinit.demo.tasks import _require_sklearn
        _require_sklearn()
    return tasks, seeds, inits, jobs, out, plots


def run(args) -> int:
    tasks, seeds, inits, jobs, out, plots = _validate(args)   # everything checked before any work

    from condinit.demo.report import render_files, summarize, table_rows, write_outputs
    from condinit.demo.train import run_demo

    argv = ["condinit", "demo", "--task", args.task, "--seeds", str(seeds)]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if args.quick:
        argv.append("--quick")
    if args.inits is not None:
        argv += ["--inits", ",".join(inits)]
    results = run_demo(tasks, seeds=seeds, steps=args.steps, quick=args.quick, inits=inits, jobs=jobs,
                       progress=not args.no_progress)
    summary = summarize(results)
    import torch
    summary["meta"].update({
        "command": " ".join(argv), "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    })
    files = render_files(results, summary, plots=plots)
    written = write_outputs(out, files)

    from rich.console import Console
    from rich.table import Table

    header, rows = table_rows(summary)
    table = Table(title=f"condinit demo ({summary['meta']['command']}): target = default init's final test accuracy")
    for col in header:
        table.add_column(col)
    for r in rows:
        table.add_row(*r)
    con = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)  # no squeezing when piped
    con.print(table)
    con.print(f"{len(written)} files written to {out} in {summary['meta']['seconds']:.0f} s: "
              + ", ".join(os.path.basename(w) for w in written))
    return 0
