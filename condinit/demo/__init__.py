"""``condinit demo``: conditioned init against the default, mimetic and spectral-conditioning inits on
two small tasks that need no download, with loss / accuracy curves and the attention Jacobian's
condition number over training.

    from condinit.demo import run_demo, summarize, format_table
    results = run_demo(("vision",), seeds=2, quick=True)
    print(format_table(summarize(results)))

Modules: :mod:`~condinit.demo.tasks` (data), :mod:`~condinit.demo.models` (tiny ViT and causal LM on
``nn.MultiheadAttention``), :mod:`~condinit.demo.inits` (the four inits),
:mod:`~condinit.demo.train` (training loop and Jacobian probe), :mod:`~condinit.demo.report`
(table, JSON, CSV, plots). The CLI is ``condinit demo`` (:mod:`condinit.commands.demo`).
"""
from .inits import INITS, base_init_, initialize_, mimetic_init_, spectral_condition_
from .report import check_output_dir, format_table, render_files, summarize, write_outputs
from .tasks import TASKS, make_task
from .train import attention_jacobian_sigma, probe_kappa, run_demo, task_config, train_run

__all__ = ["INITS", "TASKS", "base_init_", "initialize_", "mimetic_init_", "spectral_condition_", "make_task",
           "task_config", "train_run", "run_demo", "attention_jacobian_sigma", "probe_kappa", "summarize",
           "format_table", "render_files", "write_outputs", "check_output_dir"]
