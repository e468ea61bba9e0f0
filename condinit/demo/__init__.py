"""``condinit demo``: conditioned init against the default, mimetic and spectral-conditioning inits
and two ablations of itself, each at its best of several learning rates, on five small tasks that
need no download, with curves, the LR sweep and the attention Jacobian's condition number beside
what sets it.

    from condinit.demo import run_demo, summarize, format_table
    results = run_demo(("mqar-32",), seeds=1, quick=True)
    print(format_table(summarize(results)))

Modules: :mod:`~condinit.demo.tasks` (data), :mod:`~condinit.demo.models` (tiny ViT and LM on
``nn.MultiheadAttention``), :mod:`~condinit.demo.inits` (the inits),
:mod:`~condinit.demo.train` (training loop, LR sweep and Jacobian probe), :mod:`~condinit.demo.report`
(tables, JSON, CSV, plots). The CLI is ``condinit demo`` (:mod:`condinit.commands.demo`).
"""
from .inits import INIT_LABELS, INITS, base_init_, initialize_, mimetic_init_, spectral_condition_
from .report import format_table, render_files, select_best_lr, summarize, write_outputs
from .tasks import TASKS, make_task, mqar_shortcut_baseline, stdlib_corpus
from .train import attention_jacobian_sigma, head_probe, probe_kappa, run_demo, task_config, train_run

__all__ = ["INITS", "INIT_LABELS", "TASKS", "base_init_", "initialize_", "mimetic_init_", "spectral_condition_",
           "make_task", "mqar_shortcut_baseline", "stdlib_corpus", "task_config", "train_run", "run_demo",
           "attention_jacobian_sigma", "head_probe", "probe_kappa", "summarize", "select_best_lr", "format_table",
           "render_files", "write_outputs"]
