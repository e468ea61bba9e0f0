"""The conditioning monitor inside a Lightning ``Trainer``.

    from condinit.integrations.lightning import JacobianMonitorCallback

    trainer = lightning.Trainer(callbacks=[JacobianMonitorCallback(every=100, log_dir="runs/jac")])

``lightning`` (or the older ``pytorch_lightning``) is imported when :class:`JacobianMonitorCallback`
is first looked up, not when this module (or ``condinit``) is imported; without either package the
lookup raises an ImportError naming the extra that installs it (``pip install 'condinit[lightning]'``).
"""
from __future__ import annotations

import importlib

from condinit._validate import check_bool, check_int

__all__ = ["JacobianMonitorCallback"]

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_cls = None


def _callback_base():
    for name in _PACKAGES:
        try:
            return importlib.import_module(name).Callback
        except ModuleNotFoundError as exc:
            if exc.name not in (name, name.split(".")[0]):   # installed but broken: say so
                raise
    raise ImportError("the Lightning callback (condinit.integrations.lightning.JacobianMonitorCallback) needs "
                      "lightning or pytorch_lightning, and neither is installed: pip install 'condinit[lightning]'")


def _build():
    from condinit.probe.records import logged_metrics

    Callback = _callback_base()

    class JacobianMonitorCallback(Callback):
        """A Lightning ``Callback`` that runs a :class:`condinit.JacobianMonitor` on the LightningModule.

        ``on_fit_start`` creates the monitor on ``pl_module`` (``log_dir`` defaults to
        ``trainer.log_dir/jacobian``, else ``trainer.default_root_dir/jacobian``), numbering steps by
        ``trainer.global_step`` (optimizer steps). Inputs are captured from ``on_train_batch_start``
        until the optimizer step that ends the batch (with gradient accumulation: the first
        micro-batch of a sampled step; validation forwards are never taken);
        ``on_train_batch_end`` runs :meth:`~condinit.JacobianMonitor.step` once
        ``trainer.global_step`` has advanced, and with ``log_signals`` logs the latest values as
        ``jacobian/LAYER/KEY`` to every logger of the trainer at the step they were measured (and
        into ``callback_metrics`` through ``pl_module.log_dict``); ``on_fit_end`` / ``on_exception``
        close it. Only global rank 0 monitors.

        Args:
            every: sample every ``every``-th optimizer step.
            log_dir: the monitor's directory.
            log_signals: log each sampled step's values to the trainer's loggers at that step.
            **monitor_kwargs: further :class:`~condinit.JacobianMonitor` arguments.

        Examples:
            >>> from condinit.integrations.lightning import JacobianMonitorCallback
            >>> trainer = lightning.Trainer(max_steps=1000, callbacks=[JacobianMonitorCallback(every=50)])
            >>> trainer.fit(module, loader)
        """

        def __init__(self, every: int = 100, log_dir=None, log_signals: bool = True, **monitor_kwargs):
            super().__init__()
            self.every = check_int("every", every, min=1)
            self.log_signals = check_bool("log_signals", log_signals)
            for key in ("model", "path"):
                if key in monitor_kwargs:
                    raise TypeError(f"JacobianMonitorCallback: {key!r} is not an argument here (the model is "
                                    f"the LightningModule; the files go to log_dir)")
            self.log_dir, self.monitor_kwargs = log_dir, monitor_kwargs
            self.monitor = None
            self._done_step = None

        def on_fit_start(self, trainer, pl_module):
            import os

            from condinit.probe import JacobianMonitor

            from condinit.integrations.trainer_common import fsdp2_sharded

            if trainer.global_rank != 0 and not fsdp2_sharded(pl_module):
                return          # FSDP2-sharded: every rank monitors (the weight gathers are collective)
            log_dir = self.log_dir
            if log_dir is None:
                root = getattr(trainer, "log_dir", None) or trainer.default_root_dir
                log_dir = os.path.join(root, "jacobian")
            self.monitor = JacobianMonitor(pl_module, every=self.every, log_dir=log_dir, **self.monitor_kwargs)
            self.monitor.step_count = self._done_step = trainer.global_step
            self.monitor.capturing = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.monitor is not None:
                self.monitor.step_count = trainer.global_step
                self.monitor.capturing = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.monitor is None or trainer.global_step == self._done_step:
                return      # a micro-batch of gradient accumulation: the optimizer step is still to come
            self.monitor.capturing = False
            records = self.monitor.step(step=trainer.global_step - 1)
            self._done_step = trainer.global_step
            metrics = logged_metrics(records) if self.log_signals else {}
            if metrics:
                # to the loggers at the step the records were measured (``self.log`` would stamp them
                # with the count after the optimizer step); callback_metrics get them as well
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step - 1)
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, logger=False)

        def on_fit_end(self, trainer, pl_module):
            if self.monitor is not None:
                self.monitor.close()

        def on_exception(self, trainer, pl_module, exception):
            if self.monitor is not None:
                self.monitor.close()

    JacobianMonitorCallback.__module__ = __name__
    return JacobianMonitorCallback


def __getattr__(name):
    global _cls
    if name != "JacobianMonitorCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _cls is None:
        _cls = _build()
    return _cls
