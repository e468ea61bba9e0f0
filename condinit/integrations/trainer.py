"""The conditioning monitor inside a Hugging Face ``transformers.Trainer``.

    from condinit.integrations.trainer import JacobianMonitorCallback

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[JacobianMonitorCallback(every=100, alerts={"max_logit": 50.0})])
    trainer.train()        # records in args.output_dir/jacobian/jacobian.jsonl (and .csv)

This module imports ``transformers`` and ``accelerate`` (``pip install 'condinit[hf]'``; without them
the import is an ImportError saying so); ``import condinit`` imports neither.
"""
from __future__ import annotations

import os

try:
    import accelerate  # noqa: F401  (transformers.Trainer needs it)
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError(f"the HF Trainer callback (condinit.integrations.trainer) needs transformers and accelerate: "
                      f"pip install 'condinit[hf]' ({exc})") from exc

from condinit._validate import check_bool, check_int
from condinit.integrations.trainer_common import fsdp2_sharded
from condinit.probe.records import logged_metrics

__all__ = ["JacobianMonitorCallback"]


class JacobianMonitorCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs a :class:`condinit.JacobianMonitor` on the model.

    ``on_train_begin`` creates the monitor on the Trainer's model (``JacobianMonitor(model,
    every=every, log_dir=log_dir, **monitor_kwargs)``; ``log_dir`` defaults to
    ``args.output_dir/jacobian``), numbering steps by ``state.global_step`` (so a resumed run goes
    on from its checkpoint's step). Inputs are captured only between ``on_step_begin`` and
    ``on_step_end`` (the first micro-batch of a sampled optimizer step; evaluation forwards are
    never taken); ``on_step_end`` runs :meth:`~condinit.JacobianMonitor.step`; ``on_train_end``
    closes the monitor. With ``log_signals``, each sampled step's values (kappa, ``||J||_F``, max
    logit, entropy, ``qk_norm`` as ``jacobian/LAYER/KEY``) become an entry of the Trainer's
    ``log_history`` (``trainer_state.json``) whose ``step`` is the step they were measured at, the
    monitor's own numbering (the Trainer's ``global_step`` before that step); the reporting
    integrations (``report_to``) do not see them: the monitor's own JSONL / CSV / TensorBoard files
    hold every record. Only the main process (``state.is_world_process_zero``)
    monitors, except for an FSDP2-sharded model, where every rank does (each on its own input, the
    weights gathered one layer at a time; rank 0 writes all records).

    The monitor never changes training: with the same seed, the final weights are bit-identical
    with and without this callback.

    Args:
        every: sample every ``every``-th optimizer step (steps ``0, every, ...``).
        log_dir: the monitor's directory (default ``args.output_dir/jacobian``).
        log_signals: add each sampled step's values to the Trainer's ``log_history``.
        **monitor_kwargs: further :class:`~condinit.JacobianMonitor` arguments (``alerts``,
            ``budget``, ``steps``, ``max_layers``, ``signals``, ...), checked by it on ``on_train_begin``.

    Examples:
        >>> from condinit.integrations.trainer import JacobianMonitorCallback
        >>> cb = JacobianMonitorCallback(every=50, alerts={"kappa_growth": 10.0}, max_layers=4)
        >>> trainer = transformers.Trainer(model, args, train_dataset=ds, callbacks=[cb])
        >>> trainer.train()
        >>> cb.monitor.history[-1]["kappa"]
    """

    def __init__(self, every: int = 100, log_dir=None, log_signals: bool = True, **monitor_kwargs):
        self.every = check_int("every", every, min=1)
        self.log_signals = check_bool("log_signals", log_signals)
        for key in ("model", "path"):
            if key in monitor_kwargs:
                raise TypeError(f"JacobianMonitorCallback: {key!r} is not an argument here (the model is the "
                                f"Trainer's; the files go to log_dir)")
        self.log_dir = log_dir
        self.monitor_kwargs = monitor_kwargs
        self.monitor = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("JacobianMonitorCallback: the Trainer passed no model to on_train_begin")
        if not state.is_world_process_zero and not fsdp2_sharded(model):
            return
        from condinit.probe import JacobianMonitor

        log_dir = self.log_dir if self.log_dir is not None else os.path.join(args.output_dir, "jacobian")
        self.monitor = JacobianMonitor(model, every=self.every, log_dir=log_dir, **self.monitor_kwargs)
        self.monitor.step_count = state.global_step
        self.monitor.capturing = False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.step_count = state.global_step
            self.monitor.capturing = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        self.monitor.capturing = False
        # global_step was advanced before on_step_end: the step that just ran is global_step - 1
        step = state.global_step - 1
        records = self.monitor.step(step=step)
        metrics = logged_metrics(records) if self.log_signals else {}
        if metrics and state.is_world_process_zero:
            # an entry of its own, at the step the records were measured (a logging step's entry
            # carries the Trainer's count after that step, which is one more)
            state.log_history.append({**metrics, "step": step})

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
