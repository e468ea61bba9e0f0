"""``condinit demo``: does the method help, and where? Small Transformers trained from scratch, on CPU.

Trains small Transformers with the attention inits side by side (framework default, mimetic,
conditioned, spectral conditioning, and two ablations of the conditioned init: Q/K only, and
``W_V = 0.1 I``; see :mod:`condinit.demo.inits`), each at several learning rates, on five tasks
that need no download (MQAR recall at widths 32 and 128, causal and masked character LMs on
Python's standard library, the digits ViT; see :mod:`condinit.demo.tasks`). Reports each init at
its best learning rate, the attention Jacobian's kappa beside what sets it, and writes
``summary.json``, ``curves.csv``, ``table.md`` and one PNG per task to ``--out``.
"""
from __future__ import annotations

import os
import platform
import sys
import time

NAME = "demo"
HELP = ("train small Transformers with default, mimetic, conditioned, spectral and ablated conditioned attention "
        "init, each at its best of several learning rates (MQAR recall, stdlib character LMs, digits ViT), and "
        "report results, steps to the default's result and kappa(J) with what sets it")


def add_arguments(p):
    p.add_argument("--task", default="all", metavar="LIST",
                   help="comma-separated tasks: mqar-32, mqar-128, lm-causal, lm-masked, vision, or the groups "
                        "mqar, lm, all (default)")
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="number of seeds 0..N-1 per init and learning rate (default 2; 1 with --quick)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="training steps per run (default per task: mqar-32 1000, others 300; --quick 20)")
    p.add_argument("--lr-mults", default=None, metavar="LIST",
                   help="comma-separated learning-rate multipliers of each task's base LR (default 0.3,1,3; "
                        "--quick 1,3)")
    p.add_argument("--out", default="condinit-demo", metavar="DIR",
                   help="output directory for summary.json, curves.csv, table.md and plots (default ./condinit-demo)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run (under a minute on 2 idle cores): 20 steps, inits default,conditioned, LRs 1x,3x, 1 seed")
    p.add_argument("--inits", default=None, metavar="LIST",
                   help="comma-separated subset of default,mimetic,conditioned,spectral,conditioned-qk,"
                        "conditioned-v0.1 (default: all)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="worker processes, each single-threaded (default: min(2, CPUs)); results do not depend on it")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (needs matplotlib otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _split(name: str, value: str) -> tuple:
    items = tuple(s.strip() for s in value.split(",") if s.strip())
    if not items:
        raise ValueError(f"{name} must be a non-empty comma-separated list, got {value!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"{name} lists an item twice: {value!r}")
    return items


def _validate(args):
    from condinit._validate import check_int, check_real
    from condinit.demo.inits import INITS
    from condinit.io.atomic import check_output_dir
    from condinit.demo.tasks import TASK_GROUPS, TASKS
    from condinit.demo.train import QUICK_INITS

    tasks = []
    for item in _split("--task", args.task):
        if item in TASK_GROUPS:
            tasks += [t for t in TASK_GROUPS[item] if t not in tasks]
        elif item in TASKS:
            if item not in tasks:
                tasks.append(item)
        else:
            raise ValueError(f"--task must be a comma-separated list of {', '.join(TASKS)} or "
                             f"{', '.join(TASK_GROUPS)}, got {item!r}")
    seeds = check_int("--seeds", args.seeds if args.seeds is not None else (1 if args.quick else 2), min=1)
    check_int("--steps", args.steps, min=1, allow_none=True)
    if args.inits is None:
        inits = QUICK_INITS if args.quick else INITS
    else:
        inits = _split("--inits", args.inits)
        bad = [i for i in inits if i not in INITS]
        if bad:
            raise ValueError(f"--inits must be a comma-separated subset of {','.join(INITS)}, got {args.inits!r}")
    mults = None
    if args.lr_mults is not None:
        try:
            mults = tuple(float(m) for m in _split("--lr-mults", args.lr_mults))
        except ValueError as exc:
            raise ValueError(f"--lr-mults must be comma-separated positive numbers, got {args.lr_mults!r}") from exc
        for m in mults:
            check_real("--lr-mults", m, min=0.0, min_open=True)
        if len(set(mults)) != len(mults):
            raise ValueError(f"--lr-mults lists a multiplier twice: {args.lr_mults!r}")
    jobs = check_int("--jobs", args.jobs if args.jobs is not None else max(1, min(2, os.cpu_count() or 1)), min=1)
    out = check_output_dir(args.out)
    plots = not args.no_plots
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ValueError("condinit demo's plots need matplotlib: pip install 'condinit[demo]', or pass "
                             "--no-plots") from exc
    if "vision" in tasks:
        from condinit.demo.tasks import require_sklearn
        require_sklearn()
    return tuple(tasks), seeds, inits, mults, jobs, out, plots


def run(args) -> int:
    tasks, seeds, inits, mults, jobs, out, plots = _validate(args)   # everything checked before any work

    from condinit.demo.report import render_files, summarize, table_rows, write_outputs
    from condinit.demo.train import run_demo

    argv = ["condinit", "demo", "--task", ",".join(tasks), "--seeds", str(seeds)]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if mults is not None:
        argv += ["--lr-mults", ",".join(f"{m:g}" for m in mults)]
    if args.quick:
        argv.append("--quick")
    if args.inits is not None:
        argv += ["--inits", ",".join(inits)]
    results = run_demo(tasks, seeds=seeds, steps=args.steps, quick=args.quick, inits=inits, lr_multipliers=mults,
                       jobs=jobs, progress=not args.no_progress)
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

    from condinit.demo.report import task_caption

    con = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)  # piped: 120 columns, cells wrap
    for task in summary["tasks"]:
        header, rows = table_rows(summary, task)
        # two tables of at most 120 columns: training (the init, then its results), then the Jacobian
        # at init and at the end, each row again led by its init
        cut = next((i for i, col in enumerate(header) if col.startswith("κ(J)")), len(header))
        for part, (lo, hi) in enumerate(((0, cut), (cut, len(header)))):
            if lo == hi:
                continue
            cols = ([0] if lo else []) + list(range(lo, hi))
            table = Table(title=f"{task}: {task_caption(task, summary['tasks'][task])}" if part == 0 else None,
                          title_justify="left")
            for i in cols:
                table.add_column(header[i])
            for r in rows:
                table.add_row(*(r[i] for i in cols))
            con.print(table)
    con.print("*: best LR of the sweep; the other columns are at each init's best LR. "
              "κ(J) is a diagnostic, not a predictor of training speed (see the Spearman line per task).")
    con.print(f"{len(written)} files written to {out} in {summary['meta']['seconds']:.0f} s: "
              + ", ".join(os.path.basename(w) for w in written), overflow="fold")
    return 0
