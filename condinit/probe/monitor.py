"""Training-time conditioning monitor for attention Jacobians.

    monitor = JacobianMonitor(model, every=100, budget=30.0, log_dir="runs/jac")
    for step, batch in enumerate(loader):
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
        monitor.step()                  # estimates for the captured step, if it was sampled
    monitor.close()                      # or `with JacobianMonitor(...) as monitor:`

Forward pre-hooks on every attention layer the adapters know (:func:`condinit.models.find_attention`)
capture, on sampled steps only (``step % every == 0``), a detached copy of the layer's input and of
its Q/K/V weights (a :class:`~condinit.probe.JacobianOperator` is built at that moment, so the estimate
refers to the weights the forward pass used). :meth:`JacobianMonitor.step` then runs
:func:`~condinit.probe.lanczos_svd` (``steps``) and :func:`~condinit.probe.frobenius_hutchinson` per layer
and logs one record per layer to JSONL (and CSV; TensorBoard scalars when ``torch.utils.tensorboard``
works).

It never changes training: the hooks return nothing and only copy detached tensors; estimates run
under ``torch.no_grad`` on those copies with a private ``torch.Generator`` (no draw from the global or
any user RNG); no module is called, so no module state, train/eval mode, buffer or ``.grad`` is
touched. A seeded training loop gives bit-identical losses and parameters with the monitor on or off
(tests/test_monitor.py checks it).

It never raises into the training loop because of the data. Estimates run with autocast off, in the
operator's dtype (float32 for a float32 model trained under ``torch.autocast`` with bfloat16: the
captured input and weights are cast up, the estimate is not skipped). A layer whose captured input
or weights hold NaN or Inf (a diverged step), whose estimate overflows its dtype (NaN values), or
that the operator cannot read, is logged as a record with ``skipped`` set to the reason; an
all-zero input gives the exact answer ``J = 0`` (``sigma_max`` 0, ``rank_deficient``, the reason in
``notes``). Programming errors in the call itself (a negative or non-int ``step``, a closed
monitor) do raise, at the call.

Budget: ``budget`` seconds of estimator work per sampled step (None: no limit; <= 0: ValueError),
``max_layers`` layers per sampled step, ``max_tokens`` / ``max_batch`` to subsample the captured input.
The time budget is checked between layers (a layer already started finishes). Layers are visited
round-robin, so over several sampled steps every layer is covered; layers left out by the budget are
logged as skipped. Cost on a CPU (benchmarks/bench_probe.py): one layer's estimate (20 steps, wrt
weights) is about 40 JVP/VJP passes, each about as costly as that layer's Q/K/V projection forward
plus 3 attention forwards; ``max_batch=1`` or ``max_layers`` bring ``every=100`` to about 1-3 %.
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from typing import Optional

import torch
from torch import nn

from condinit._validate import SEED_MAX, check_bool, check_choice, check_int, check_real, check_seed

from .capture import InputCapture
from .operator import _autocast_disabled

__all__ = ["JacobianMonitor"]

_CSV_FIELDS = ("step", "layer", "name", "wrt", "sigma_max", "sigma_min", "kappa", "rank_deficient", "converged",
               "residual_max", "residual_min", "lanczos_steps", "frobenius", "frobenius_ci_low", "frobenius_ci_high",
               "batch", "tokens", "time_s", "skipped", "notes")


class JacobianMonitor:
    """Samples a training step every ``every`` steps and logs attention-Jacobian conditioning per layer.

    Args:
        model: the model; attention layers are found by the adapter registry.
        every: sample steps ``0, every, 2 every, ...`` (counted by :meth:`step`).
        budget: max seconds of estimation per sampled step (None: unlimited; must be > 0).
        steps: Golub-Kahan-Lanczos steps per layer.
        log_dir: directory for ``jacobian.jsonl``, ``jacobian.csv`` and TensorBoard events.
        path: explicit JSONL path (CSV beside it with ``.csv``); default ``log_dir/jacobian.jsonl``.
        seed: seed of the private generator, in ``[0, 2**64)`` (each sampled step and layer derive
            their own from it, modulo ``2**64``).
        wrt: ``"weights"`` (the paper's J), ``"input"`` or ``"qkv"``.
        causal: None = the module's own ``is_causal`` attribute (HF decoders), else a bool for all layers.
        max_layers: at most this many layers per sampled step (round-robin).
        max_batch, max_tokens: keep the first ``max_batch`` sequences / ``max_tokens`` tokens of the input.
            ``max_batch`` defaults to 1: one sequence keeps ``every=100`` at about 1.6 % of training time
            for a 12-layer D=768 model at 8 x 512 tokens (the whole batch costs about 10 %); ``None``: all.
        frobenius_samples: Hutchinson probes per layer (0: skip).
        dtype: compute dtype (default: the layer's, float32 for half types).
        include, exclude: fnmatch patterns on module names (as in :func:`condinit.apply`).
        tensorboard: also write TensorBoard scalars to ``log_dir`` when ``torch.utils.tensorboard``
            imports.

    Examples:
        >>> model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with condinit.JacobianMonitor(model, every=2, steps=10, log_dir="runs/jac") as monitor:
        ...     for _ in range(4):
        ...         loss = model(torch.randn(2, 8, 16)).square().mean()
        ...         loss.backward(); opt.step(); opt.zero_grad()
        ...         records = monitor.step()          # one record per layer on steps 0 and 2
        >>> monitor.history[0]["kappa"]
    """

    def __init__(self, model: nn.Module, every: int = 100, budget: Optional[float] = None, steps: int = 20, *,
                 log_dir=None, path=None, seed: int = 0, wrt: str = "weights", causal: Optional[bool] = None,
                 max_layers: Optional[int] = None, max_batch: Optional[int] = 1,
                 max_tokens: Optional[int] = None, frobenius_samples: int = 8, dtype=None, include=None,
                 exclude=None, tensorboard: bool = True):
        from condinit.models.apply import _no_attention_error, find_attention
        from .operator import WRT, check_dtype

        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        every = check_int("every", every, min=1)
        steps = check_int("steps", steps, min=1)
        frobenius_samples = check_int("frobenius_samples", frobenius_samples, min=0)
        if frobenius_samples == 1:
            raise ValueError("frobenius_samples must be 0 (off) or >= 2 (a confidence interval needs 2 probes)")
        max_layers = check_int("max_layers", max_layers, min=1, allow_none=True)
        max_batch = check_int("max_batch", max_batch, min=1, allow_none=True)
        max_tokens = check_int("max_tokens", max_tokens, min=1, allow_none=True)
        # seconds of estimation per sampled step; None for no limit
        budget = check_real("budget", budget, min=0.0, min_open=True, allow_none=True)
        seed = check_seed("seed", seed)
        check_choice("wrt", wrt, WRT)
        check_bool("causal", causal, allow_none=True)
        check_dtype("dtype", dtype)
        check_bool("tensorboard", tensorboard)
        self.layers = find_attention(model, include=include, exclude=exclude)
        if not self.layers:
            raise _no_attention_error(model, include, exclude)
        self.every, self.budget, self.steps, self.seed, self.wrt = every, budget, steps, seed, wrt
        self.causal, self.max_layers, self.max_batch, self.max_tokens = causal, max_layers, max_batch, max_tokens
        self.frobenius_samples, self.dtype = frobenius_samples, dtype
        self.history: list[dict] = []
        self.step_count = 0
        self._cursor = 0          # round-robin position over layers
        self._captured: dict = {}
        self._errors: dict = {}
        # output files: checked and opened before any hook is registered
        self.path = self.csv_path = None
        if path is not None or log_dir is not None:
            if path is None:
                os.makedirs(log_dir, exist_ok=True)
                path = os.path.join(log_dir, "jacobian.jsonl")
            path = os.path.abspath(os.fspath(path))
            if os.path.isdir(path):
                raise ValueError(f"path {path} is a directory, expected a .jsonl file path")
            if not os.path.isdir(os.path.dirname(path)):
                raise ValueError(f"path: directory {os.path.dirname(path)} does not exist")
            self.path = path
            self.csv_path = os.path.splitext(path)[0] + ".csv"
        self._jsonl = open(self.path, "a", encoding="utf-8") if self.path else None
        self._csv_fh = open(self.csv_path, "a", newline="", encoding="utf-8") if self.csv_path else None
        self._csv = None
        if self._csv_fh is not None:
            self._csv = csv.DictWriter(self._csv_fh, fieldnames=_CSV_FIELDS, extrasaction="ignore")
            if self._csv_fh.tell() == 0:
                self._csv.writeheader()
        self._tb = None
        if tensorboard and (log_dir is not None):
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=os.fspath(log_dir))
            except ImportError:      # tensorboard is optional
                self._tb = None
        self._capture = InputCapture([l.module for l in self.layers], on_input=self._on_input)

    # -- hooks ----------------------------------------------------------------------------------

    @property
    def sampling(self) -> bool:
        """Whether the current step (:attr:`step_count`) is a sampled one."""
        return self.step_count % self.every == 0

    def _on_input(self, idx: int, module: nn.Module, x) -> None:
        """Pre-hook callback: on a sampled step, snapshot layer ``idx``'s first forward as an operator."""
        if not self.sampling or idx in self._captured or idx in self._errors:
            return
        if x is None:
            self._errors[idx] = "could not find a [B, N, D] input tensor"
            return
        if self.max_batch is not None:
            x = x[: self.max_batch]
        if self.max_tokens is not None:
            x = x[:, : self.max_tokens]
        causal = self.causal if self.causal is not None else bool(getattr(module, "is_causal", False))
        from .operator import JacobianOperator
        try:
            # copies x and the weights now (cast to the compute dtype, whatever autocast does in this
            # forward): the estimate refers to this forward's weights
            self._captured[idx] = JacobianOperator(module, x, wrt=self.wrt, causal=causal, dtype=self.dtype)
        except (ValueError, TypeError) as exc:
            # non-finite data (NonFiniteError) or a layer the operator cannot read: logged as skipped
            # with the reason; training goes on
            self._errors[idx] = str(exc)

    # -- estimation -----------------------------------------------------------------------------

    def step(self, step: Optional[int] = None) -> list[dict]:
        """End of a training step: estimate what was captured (if this step was sampled), log it,
        advance the step counter (or set it to ``step + 1``). Returns this step's records.

        Raises only for a wrong call: ``step`` not an int ``>= 0`` (TypeError / ValueError), or a
        closed monitor (RuntimeError). Problems of the data are records with ``skipped`` set.
        """
        if self._capture is None:
            raise RuntimeError("JacobianMonitor is closed")
        step = check_int("step", step, min=0, allow_none=True)
        cur = self.step_count if step is None else step
        records = []
        if self._captured or self._errors:
            records = self._estimate(cur)
        self._captured, self._errors = {}, {}
        self.step_count = cur + 1
        return records

    def _order(self) -> list[int]:
        L = len(self.layers)
        order = [(self._cursor + i) % L for i in range(L)]
        return order

    def _estimate(self, step: int) -> list[dict]:
        from .estimators import frobenius_hutchinson, lanczos_svd

        t_start = time.perf_counter()
        records, done = [], 0
        order = self._order()
        for idx in order:
            layer = self.layers[idx]
            base = {"step": step, "layer": layer.index, "name": layer.name, "wrt": self.wrt}
            if idx in self._errors:
                records.append({**base, "skipped": f"error: {self._errors[idx]}"})
                continue
            op = self._captured.get(idx)
            if op is None:
                records.append({**base, "skipped": "layer not run in the sampled forward"})
                continue
            over_time = self.budget is not None and time.perf_counter() - t_start >= self.budget
            over_layers = self.max_layers is not None and done >= self.max_layers
            if over_time or over_layers:
                records.append({**base, "skipped": "budget" if over_time else "max_layers"})
                continue
            t0 = time.perf_counter()
            seed = (self.seed * 1_000_003 + step * 1009 + layer.index) % SEED_MAX
            with torch.no_grad(), _autocast_disabled(op.device):
                est = lanczos_svd(op, steps=self.steps, seed=seed)
                fro = frobenius_hutchinson(op, samples=self.frobenius_samples, seed=(seed + 1) % SEED_MAX) \
                    if self.frobenius_samples and math.isfinite(est.sigma_max) else None
            if not math.isfinite(est.sigma_max):
                # the estimators report an overflow of the compute dtype as NaN values with the reason
                records.append({**base, "batch": op.B, "tokens": op.N, "time_s": time.perf_counter() - t0,
                                "skipped": est.notes})
                done += 1
                self._cursor = (idx + 1) % len(self.layers)
                continue
            rec = {**base, "sigma_max": est.sigma_max, "sigma_min": est.sigma_min, "kappa": est.kappa,
                   "rank_deficient": est.rank_deficient, "converged": est.converged,
                   "residual_max": est.residual_max, "residual_min": est.residual_min,
                   "lanczos_steps": est.iterations, "batch": op.B, "tokens": op.N,
                   "null_dims": list(est.null_dims), "time_s": time.perf_counter() - t0, "skipped": None,
                   "notes": est.notes}
            if fro is not None:
                rec.update(frobenius=fro.frobenius, frobenius_ci_low=fro.ci_low, frobenius_ci_high=fro.ci_high)
            records.append(rec)
            done += 1
            self._cursor = (idx + 1) % len(self.layers)
        self._captured = {}
        self._write(records)
        self.history.extend(records)
        return records

    def _write(self, records):
        for r in records:
            for k, v in r.items():   # a log line must never carry NaN / inf (or break training)
                if isinstance(v, float) and not math.isfinite(v):
                    r[k] = None
            if self._jsonl is not None:
                self._jsonl.write(json.dumps(r, allow_nan=False, default=str) + "\n")
            if self._csv is not None:
                self._csv.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in _CSV_FIELDS})
            if self._tb is not None and r.get("skipped") is None:
                tag = f"jacobian/{r['layer']:03d}"
                for key in ("sigma_max", "sigma_min", "kappa", "frobenius"):
                    if r.get(key) is not None:
                        self._tb.add_scalar(f"{tag}/{key}", r[key], r["step"])
        for fh in (self._jsonl, self._csv_fh):
            if fh is not None:
                fh.flush()

    # -- lifetime -------------------------------------------------------------------------------

    def close(self):
        """Remove the hooks and close the log files (idempotent)."""
        if self._capture is not None:
            self._capture.remove()
            self._capture = None
        self._captured = {}
        for fh in (self._jsonl, self._csv_fh):
            if fh is not None and not fh.closed:
                fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
