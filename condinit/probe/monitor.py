"""Training-time conditioning monitor for attention Jacobians.

    monitor = JacobianMonitor(model, every=100, budget=30.0, log_dir="runs/jac")
    for step, batch in enumerate(loader):
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
        monitor.step()                  # estimates for the captured step, if it was sampled
    monitor.close()                      # or `with JacobianMonitor(...) as monitor:`

Forward pre-hooks on every attention layer the adapters know (:func:`condinit.models.find_attention`)
capture, on sampled steps only (``step % every == 0``), a detached copy of the layer's input, of the
rotary ``position_embeddings`` it is called with, and of its Q/K/V weights (a
:class:`~condinit.probe.JacobianOperator` of the attention the module computes -- QK-norm, RoPE,
sliding window, soft-capping -- is built at that moment, so the estimate refers to the weights the
forward pass used; the record's ``notes`` / the estimate's ``subspace`` say what is modelled).
:meth:`JacobianMonitor.step` then runs :func:`~condinit.probe.lanczos_svd` (``steps``, ``dense="auto"``:
the exact dense SVD, in float64, for a layer small enough that it is cheaper than Lanczos to exactness) and
:func:`~condinit.probe.frobenius_hutchinson` per layer and logs one record per layer to JSONL (and
CSV; TensorBoard scalars when ``torch.utils.tensorboard`` works).

Signals beside kappa, from the same captured step (``signals=True``, :mod:`condinit.probe.signals`):
per head and per layer, the max attention logit (``max_logit``), the attention entropy
(``entropy_mean`` / ``entropy_min``), the spectral norm of ``W_Q,h^T W_K,h`` (``qk_norm``), and
``||J||_F`` by :func:`~condinit.probe.frobenius_hutchinson` (``frobenius``, with
``frobenius_ci_low`` / ``frobenius_ci_high``).

Alerts (``alerts={"kappa_growth": 10.0, "max_logit": 50.0, "entropy": 0.1, "qk_norm": 100.0}``,
:mod:`condinit.probe.alerts`): each fires once per layer and kind, a ``ConditioningWarning`` and an
alert record in the JSONL file and in :attr:`JacobianMonitor.alerts` (not in the CSV or
:attr:`~JacobianMonitor.history`, which hold one row per layer). The records, their skip reasons
and the log files: :mod:`condinit.probe.records`.

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
``notes``). Nor because of the loop: a sampled forward under a :mod:`torch.func` transform (``vmap``,
``grad``, ``jvp``; per-sample gradients) or traced by ``torch.compile`` is recorded as skipped with
the reason (:mod:`condinit.probe.context`); ``functional_call``, autocast, ``no_grad`` and
``inference_mode`` forwards are measured. Any other exception of a capture or an estimate (a
kernel's) is recorded as ``skipped`` with its type and message. Nor because of its log files: they
are refused at construction if they are symlinks or not regular files, and an ``OSError`` writing
them (a full disk) is recorded in that step's records as ``log_error``. Programming errors in the call itself (a negative or non-int ``step``, a closed
monitor) do raise, at the call.

Distributed (FSDP2). For layers whose parameters are FSDP2 DTensors (``fully_shard``), the hooks keep
only the rank's own input; :meth:`JacobianMonitor.step`, which every rank must call, visits the layers
in one order on all ranks and, per layer, unshards the FSDP unit that owns it, builds the operator,
reshards, then estimates: at most one unit's weights are gathered at a time (``peak_unsharded``). The
weights are then those after the step's optimizer update (``weights`` in the record). Records carry
``rank`` and are gathered to rank 0, which alone writes files and raises alerts; other ranks keep
their own records in :attr:`~JacobianMonitor.history`.

Budget: ``budget`` seconds of estimator work per sampled step (None: no limit; <= 0: ValueError),
``max_layers`` layers per sampled step, ``max_tokens`` / ``max_batch`` to subsample the captured input.
The time budget is checked between layers (a layer already started finishes). Layers are visited
round-robin, so over several sampled steps every layer is covered; layers left out by the budget are
logged as skipped. Cost on a CPU (benchmarks/bench_probe.py): one layer's estimate (20 steps, wrt
weights) is 20 fused JVPs and 20 flash VJPs plus one ``[B N, B N] x [B N, rows]`` product per step
(the weights side runs in projection-output coordinates); with ``max_batch=1`` ``every=100`` costs
about 0.85 % of training time for a 12-layer D=768 model at 8 x 512 tokens.
The signals add one attention-score pass per layer (:mod:`condinit.probe.signals`, "Cost").
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
from torch import nn

from condinit._validate import SEED_MAX, check_bool, check_choice, check_dtype, check_int, check_real, check_seed

from .alerts import Alerts, check_alerts
from .autocast import autocast_disabled
from .capture import InputCapture, call_mask_rows, call_position_embeddings
from .context import compiling, functorch_transform
from .records import (BRACKET_KEYS, SKIPPED_BUDGET, SKIPPED_COMPILED, SKIPPED_MAX_LAYERS, SKIPPED_NOT_RUN,
                      RecordLog, skipped_error, skipped_exception, skipped_transform)
from .signals import attention_signals

__all__ = ["JacobianMonitor"]


class JacobianMonitor:
    """Samples a training step every ``every`` steps and logs attention-Jacobian conditioning per layer.

    Args:
        model: the model; attention layers are found by the adapter registry.
        every: sample steps ``0, every, 2 every, ...`` (counted by :meth:`step`).
        budget: max seconds of estimation per sampled step (None: unlimited; must be > 0).
        steps: at most this many Golub-Kahan-Lanczos steps per layer (None: lanczos_svd's 300); each
            layer stops as soon as its kappa bracket is within ``tol`` (:func:`~condinit.probe.lanczos_svd`).
            A given ``steps`` also bounds what the dense path may cost (``min(steps, r)`` Lanczos steps).
        dense: ``"auto"`` (default): a layer whose dense SVD is cheaper than the Lanczos run to
            exactness, and small, gets the exact dense SVD instead (:func:`condinit.probe.estimators.dense_preferred`;
            the record's ``method`` says which); False: Lanczos only; True: dense only.
        tol: the relative width of the kappa bracket at which a layer's estimate counts as converged
            (``kappa_hi <= (1 + tol) kappa_lo``).
        layer_budget: at most this many seconds of Lanczos steps per layer (None: no limit); the
            step's ``budget`` also bounds each layer by what is left of it.
        log_dir: directory for ``jacobian.jsonl``, ``jacobian.csv`` and TensorBoard events.
        path: explicit JSONL path (CSV beside it with ``.csv``); default ``log_dir/jacobian.jsonl``.
        seed: seed of the private generator, in ``[0, 2**64)`` (each sampled step and layer derive
            their own from it, modulo ``2**64``).
        wrt: ``"weights"`` (the paper's J), ``"input"`` or ``"qkv"``.
        causal: None = the module's own ``is_causal`` attribute (HF decoders), else a bool for all layers.
        max_layers: at most this many layers per sampled step (round-robin).
        max_batch, max_tokens: keep the first ``max_batch`` sequences / ``max_tokens`` tokens of the input.
            ``max_batch`` defaults to 1: one sequence keeps ``every=100`` below 1 % of training time
            for a 12-layer D=768 model at 8 x 512 tokens (the whole batch costs several times more);
            ``None``: all.
        frobenius_samples: Hutchinson probes per layer (0: skip).
        dtype: compute dtype (default: the layer's, float32 for half types; float64 for a layer
            whose estimate is exact, the dense SVD or Lanczos to the end of ``range(J)``, see
            :func:`~condinit.probe.estimators.exact_in_reach`; the record's ``dtype`` says which).
        include, exclude: fnmatch patterns on module names (as in :func:`condinit.apply`).
        tensorboard: also write TensorBoard scalars to ``log_dir`` when ``torch.utils.tensorboard``
            imports.
        signals: also log max logit, attention entropy and ``||W_Q,h^T W_K,h||_2`` per head (one extra
            attention-score pass per layer; see :mod:`condinit.probe.signals`).
        alerts: thresholds per alert kind (:data:`~condinit.probe.alerts.ALERT_KINDS`: ``"kappa_growth"``, ``"max_logit"``,
            ``"entropy"``, ``"qk_norm"``); each fires once per layer and kind, as a
            :class:`~condinit.probe.alerts.ConditioningWarning` and a record in :attr:`alerts` and the JSONL file.
        distributed: None (default): on when the model holds FSDP2-sharded attention layers and
            ``torch.distributed`` is initialized (then every rank must create the monitor and call
            :meth:`step`); False with sharded layers is a ValueError.

    :attr:`capturing` (default True) switches the hooks off while False (a trainer callback sets it
    False between its steps, so evaluation forwards are not taken for the next training step's).

    Examples:
        >>> model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with condinit.JacobianMonitor(model, every=2, steps=10, log_dir="runs/jac") as monitor:
        ...     for _ in range(4):
        ...         loss = model(torch.randn(2, 8, 16)).square().mean()
        ...         loss.backward(); opt.step(); opt.zero_grad()
        ...         records = monitor.step()          # one record per layer on steps 0 and 2
        >>> monitor.history[0]["kappa"], monitor.history[0]["max_logit_heads"]
        >>> mon = condinit.JacobianMonitor(model, every=1, alerts={"max_logit": 20.0, "kappa_growth": 10.0})
    """

    def __init__(self, model: nn.Module, every: int = 100, budget: Optional[float] = None, steps: Optional[int] = None, *,
                 tol: float = 0.1, dense="auto", layer_budget: Optional[float] = None, log_dir=None, path=None,
                 seed: int = 0,
                 wrt: str = "weights", causal: Optional[bool] = None,
                 max_layers: Optional[int] = None, max_batch: Optional[int] = 1,
                 max_tokens: Optional[int] = None, frobenius_samples: int = 8, dtype=None, include=None,
                 exclude=None, tensorboard: bool = True, signals: bool = True, alerts: Optional[dict] = None,
                 distributed: Optional[bool] = None):
        from condinit.models.apply import no_attention_error, find_attention
        from .operator import WRT

        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        every = check_int("every", every, min=1)
        steps = check_int("steps", steps, min=1, allow_none=True)
        tol = check_real("tol", tol, min=0.0)
        from .estimators import check_dense
        self.dense = check_dense(dense)
        layer_budget = check_real("layer_budget", layer_budget, min=0.0, min_open=True, allow_none=True)
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
        check_bool("signals", signals)
        alerts = check_alerts(alerts)
        check_bool("distributed", distributed, allow_none=True)
        self.layers = find_attention(model, include=include, exclude=exclude)
        if not self.layers:
            raise no_attention_error(model, include, exclude)
        self._setup_distributed(model, distributed)
        if self.distributed and self._rank != 0:
            log_dir = path = None            # rank 0 writes every rank's records
            tensorboard = False
        self.every, self.budget, self.steps, self.seed, self.wrt = every, budget, steps, seed, wrt
        self.tol, self.layer_budget = tol, layer_budget
        self.causal, self.max_layers, self.max_batch, self.max_tokens = causal, max_layers, max_batch, max_tokens
        self.frobenius_samples, self.dtype = frobenius_samples, dtype
        self.signals, self.thresholds = signals, alerts
        self._alert_rules = Alerts(alerts)
        self.history: list[dict] = []
        self.alerts: list[dict] = []
        self.capturing = True
        self.step_count = 0
        self._cursor = 0          # round-robin position over layers
        self._captured: dict = {}
        self._skipped: dict = {}      # layer -> the reason its capture on this step failed
        self._traced: dict = {}       # layers whose forward this step was a torch.compile graph
        self._notes: dict = {}        # layer -> what its capture left out (sequences with a mask it does not model)
        # output files: checked and opened before any hook is registered
        self._log = RecordLog(log_dir, path, tensorboard)
        self.path, self.csv_path = self._log.path, self._log.csv_path
        self._capture = InputCapture([l.module for l in self.layers], on_input=self._on_input, call_info=True)

    # -- hooks ----------------------------------------------------------------------------------

    @property
    def sampling(self) -> bool:
        """Whether the current step (:attr:`step_count`) is a sampled one."""
        return self.step_count % self.every == 0

    def _on_input(self, idx: int, module: nn.Module, x, call) -> None:
        """Pre-hook callback: on a sampled step, snapshot layer ``idx``'s first forward as an operator
        (sharded layers: its input only; the operator is built in :meth:`step`). Never raises: a
        forward that cannot be measured leaves the reason in ``_skipped`` (:mod:`.context`)."""
        if compiling():
            # traced into the graph (so the step counter is not read: no guard on it); the graph
            # replays this store each time it runs, and step() records the layer as not measured
            if self.capturing:
                self._traced[idx] = True
            return
        if not self.capturing or not self.sampling or idx in self._captured or idx in self._skipped \
                or idx in self._pending:
            return
        transform = functorch_transform()
        if transform is not None:
            self._skipped[idx] = skipped_transform(transform)
            return
        if x is None:
            self._skipped[idx] = skipped_error("could not find a [B, N, D] input tensor")
            return
        try:
            # the copies are plain tensors, also under inference_mode
            with torch.inference_mode(False), torch.no_grad():
                self._capture_input(idx, module, x, call)
        except Exception as exc:     # a hook must not raise into the training loop: the layer is skipped
            self._skipped[idx] = skipped_exception(exc)

    def _capture_input(self, idx: int, module: nn.Module, x, call) -> None:
        """Copy layer ``idx``'s input (cut to ``max_batch`` / ``max_tokens``) and build its operator."""
        details = self.layers[idx].spec.details
        pe = call_position_embeddings(*call, details.position_embeddings_arg)
        causal = self.causal if self.causal is not None else details.causal
        tokens = x.shape[1] if self.max_tokens is None else min(self.max_tokens, x.shape[1])
        rows, unread = call_mask_rows(module, call, x.shape[0], tokens, causal, details.sliding_window)
        if unread is not None:
            self._notes[idx] = f"the call's attention mask was not read ({unread}): J is that of the layer's own " \
                               f"{'causal' if causal else 'bidirectional'} pattern"
        elif rows is not None and bool(rows.any()):
            keep = (~rows).nonzero().flatten()
            if keep.numel() == 0:
                self._skipped[idx] = (
                    f"every sequence of this batch ({x.shape[0]}) has padding or a mask other than the layer's own "
                    f"{'causal' if causal else 'bidirectional'} pattern in its first {tokens} tokens (its attention "
                    f"mask), which the operator does not model")
                return
            self._notes[idx] = (f"{int(rows.sum())} of {x.shape[0]} sequences left out: their attention mask "
                                f"(padding, or pairs other than the layer's own pattern) is not modelled")
            x = x[keep.to(x.device)]
            pe = None if pe is None else tuple(t[keep.to(t.device)] if t.dim() == 3 and t.shape[0] == rows.numel()
                                               else t for t in pe)
        if self.max_batch is not None:
            x = x[: self.max_batch]
            pe = None if pe is None else tuple(t[: self.max_batch] if t.dim() == 3 else t for t in pe)
        if self.max_tokens is not None:
            x = x[:, : self.max_tokens]
            pe = None if pe is None else tuple(t[..., : self.max_tokens, :] for t in pe)
        if idx in self._sharded:
            # only this rank's input is kept; the layer's weights are gathered one layer at a time in step()
            self._pending[idx] = (x.clone(), None if pe is None else tuple(t.clone() for t in pe), causal)
            return
        self._build(idx, module, x, pe, causal)

    def _build(self, idx: int, module: nn.Module, x, pe, causal: bool) -> None:
        from .operator import JacobianOperator
        try:
            # copies x and the weights now (cast to the compute dtype, whatever autocast does in this
            # forward): the estimate refers to these weights
            op = JacobianOperator(module, x, wrt=self.wrt, causal=causal, dtype=self.dtype,
                                  position_embeddings=pe, spec=self.layers[idx].spec)
            self._captured[idx] = op
            if self.dtype is None and op.dtype != torch.float64:
                from .estimators import exact_in_reach
                if exact_in_reach(op, self.steps, self.dense):
                    # an exact estimate (the dense SVD, or Lanczos to the end of range(J)) is made on a
                    # float64 copy of the same data, where rounding cannot leave its bracket wide
                    self._captured[idx] = JacobianOperator(module, x, wrt=self.wrt, causal=causal,
                                                           dtype=torch.float64, position_embeddings=pe,
                                                           spec=self.layers[idx].spec)
        except (ValueError, TypeError) as exc:
            # non-finite data (NonFiniteError) or a layer the operator cannot read: logged as skipped
            # with the reason; training goes on
            self._skipped[idx] = skipped_error(str(exc))
        except Exception as exc:
            self._skipped[idx] = skipped_exception(exc)

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
        # every rank of a distributed monitor takes part in each sampled step (the gathers are collective)
        if self._captured or self._skipped or self._pending or (self._traced and self.sampling) \
                or (self.distributed and cur % self.every == 0):
            records = self._estimate(cur)
        self._captured, self._skipped, self._pending, self._traced, self._notes = {}, {}, {}, {}, {}
        self.step_count = cur + 1
        return records

    def _order(self) -> list[int]:
        L = len(self.layers)
        order = [(self._cursor + i) % L for i in range(L)]
        return order

    def _layer_time(self, t_start: float) -> Optional[float]:
        """Seconds one layer's Lanczos steps may take: ``layer_budget``, and what is left of ``budget``."""
        left = None if self.budget is None else max(self.budget - (time.perf_counter() - t_start), 1e-3)
        limits = [t for t in (self.layer_budget, left) if t is not None]
        return min(limits) if limits else None

    def _estimate(self, step: int) -> list[dict]:
        from .estimators import frobenius_hutchinson, lanczos_svd

        t_start = time.perf_counter()
        records, done = [], 0
        order = self._order()
        for idx in order:
            layer = self.layers[idx]
            base = {"step": step, "layer": layer.index, "name": layer.name, "wrt": self.wrt}
            if self.distributed:
                base["rank"] = self._rank
            over_time = self.budget is not None and time.perf_counter() - t_start >= self.budget
            over_layers = self.max_layers is not None and done >= self.max_layers
            if self.distributed:
                # one decision for all ranks: the gather of a sharded layer is a collective
                over_time = self._any_rank(over_time)
            if idx in self._sharded and not (over_time or over_layers):
                if self._gather_and_build(idx):
                    done += 1
                    self._cursor = (idx + 1) % len(self.layers)
            if idx in self._skipped:
                records.append({**base, "skipped": self._skipped[idx]})
                continue
            op = self._captured.get(idx)
            if op is None and idx in self._sharded and (over_time or over_layers):
                if idx in self._pending:
                    records.append({**base, "skipped": SKIPPED_BUDGET if over_time else SKIPPED_MAX_LAYERS})
                else:
                    records.append({**base, "skipped": SKIPPED_NOT_RUN})
                continue
            if op is None:
                records.append({**base, "skipped": SKIPPED_COMPILED if idx in self._traced else SKIPPED_NOT_RUN})
                continue
            if idx not in self._sharded and (over_time or over_layers):
                records.append({**base, "skipped": SKIPPED_BUDGET if over_time else SKIPPED_MAX_LAYERS})
                continue
            t0 = time.perf_counter()
            seed = (self.seed * 1_000_003 + step * 1009 + layer.index) % SEED_MAX
            try:
                with torch.no_grad(), autocast_disabled(op.device):
                    sig = attention_signals(op) if self.signals else {}
                    est = lanczos_svd(op, steps=self.steps, seed=seed, tol=self.tol,
                                      time_budget=self._layer_time(t_start), dense=self.dense)
                    fro = frobenius_hutchinson(op, samples=self.frobenius_samples, seed=(seed + 1) % SEED_MAX) \
                        if self.frobenius_samples and math.isfinite(est.sigma_max) else None
                # the estimators report an overflow of the compute dtype as NaN values with the reason
                reason = None if math.isfinite(est.sigma_max) else est.notes
            except Exception as exc:     # a kernel's error: recorded with its type and message, training goes on
                sig, reason = {}, skipped_exception(exc)
            self._captured.pop(idx, None)          # a layer's copies are freed once estimated
            if reason is not None:
                records.append({**base, **sig, "batch": op.B, "tokens": op.N, "time_s": time.perf_counter() - t0,
                                "skipped": reason})
                if idx not in self._sharded:
                    done += 1
                    self._cursor = (idx + 1) % len(self.layers)
                continue
            rec = {**base, "sigma_max": est.sigma_max, "sigma_min": est.sigma_min, "kappa": est.kappa,
                   **{key: getattr(est, key) for key in BRACKET_KEYS},
                   "rank_deficient": est.rank_deficient, "converged": est.converged, "method": est.method,
                   "dtype": str(op.dtype).replace("torch.", ""), "residual_max": est.residual_max, "residual_min": est.residual_min,
                   "lanczos_steps": est.iterations, "batch": op.B, "tokens": op.N,
                   "null_dims": list(est.null_dims), "time_s": time.perf_counter() - t0, "skipped": None,
                   "notes": "; ".join(n for n in (self._notes.get(idx), est.notes) if n)}
            if fro is not None:
                rec.update(frobenius=fro.frobenius, frobenius_ci_low=fro.ci_low, frobenius_ci_high=fro.ci_high)
            if idx in self._sharded:
                rec["weights"] = "gathered in step() (after this step's optimizer update)"
            rec.update(sig)
            records.append(rec)
            if idx not in self._sharded:
                done += 1
                self._cursor = (idx + 1) % len(self.layers)
        self._captured = {}
        if self.distributed:
            records = self._gather_records(records)
            if self._rank != 0:          # rank 0 writes and alerts for all; the others keep their own
                self.history.extend(records)
                return records
        alerts = []
        for r in records:      # before NaN / inf become None; a loop, not a comprehension: see stacklevel
            alerts += self._alert_rules.check(r)
        failed = self._log.write(records + alerts)
        if failed is not None:      # recorded, never raised into training
            for r in records + alerts:
                r["log_error"] = failed
        self.history.extend(records)
        self.alerts.extend(alerts)
        return records

    # -- distributed (FSDP2) ---------------------------------------------------------------------

    def _any_rank(self, flag: bool) -> bool:
        import torch.distributed as dist
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())

    def _gather_and_build(self, idx: int) -> bool:
        """All ranks: gather the weights of the FSDP unit that owns layer ``idx`` (only that unit is
        unsharded, so memory is bounded by one unit), build the operator on this rank's own captured
        input, reshard. Returns whether any rank had an input for the layer."""
        if not self._any_rank(idx in self._pending):
            return False
        unit = self._units[idx]
        layer = self.layers[idx]
        with torch.no_grad():
            unit.unshard()
            try:
                if idx in self._pending:
                    x, pe, causal = self._pending.pop(idx)
                    self._build(idx, layer.module, x, pe, causal)
                    self.peak_unsharded = max(self.peak_unsharded, self._unsharded_count())
            finally:
                unit.reshard()
        return True

    def _unsharded_count(self) -> int:
        """How many FSDP units hold unsharded (plain) parameters right now (for the memory bound)."""
        from torch.distributed.tensor import DTensor
        return sum(1 for u in {id(u): u for u in self._units.values()}.values()
                   if any(not isinstance(p, DTensor) for p in u.parameters(recurse=False))
                   or any(not isinstance(p, DTensor) for m in self._own_modules(u) for p in m.parameters(recurse=False)))

    def _own_modules(self, unit):
        """The submodules of an FSDP unit that it manages itself (not inside a nested unit)."""
        from torch.distributed.fsdp import FSDPModule
        out, stack = [], list(unit.children())
        while stack:
            m = stack.pop()
            if isinstance(m, FSDPModule):
                continue
            out.append(m)
            stack.extend(m.children())
        return out

    def _gather_records(self, records: list) -> list:
        """Every rank's records on rank 0 (rank order); other ranks keep their own."""
        import torch.distributed as dist
        world = dist.get_world_size(self._group)
        gathered = [None] * world if self._rank == 0 else None
        dist.gather_object(records, gathered, dst=0, group=self._group)
        if self._rank != 0:
            return records
        return [r for part in gathered for r in part]

    def _setup_distributed(self, model: nn.Module, distributed) -> None:
        """Layers whose parameters FSDP2 shards (DTensor) are estimated with their weights gathered per
        layer in :meth:`step`; records go to rank 0."""
        self._sharded, self._units, self._pending = set(), {}, {}
        self.peak_unsharded = 0
        try:
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.tensor import DTensor
        except ImportError:       # a torch without torch.distributed
            FSDPModule = DTensor = None
        import torch.distributed as dist
        ready = dist.is_available() and dist.is_initialized()
        if DTensor is not None:
            names = dict(model.named_modules())
            for i, layer in enumerate(self.layers):
                if not any(isinstance(p, DTensor) for p in layer.module.parameters()):
                    continue
                unit = None
                parts = layer.name.split(".") if layer.name else []
                for k in range(len(parts), -1, -1):
                    cand = names.get(".".join(parts[:k]))
                    if isinstance(cand, FSDPModule):
                        unit = cand
                        break
                if unit is None:
                    raise ValueError(f"layer {layer.name}: its parameters are DTensors but no enclosing module is "
                                     f"an FSDP2 (fully_shard) module; condinit gathers FSDP2-sharded layers only")
                self._sharded.add(i)
                self._units[i] = unit
        if distributed is None:
            distributed = bool(self._sharded) and ready
        if distributed and not ready:
            raise ValueError("distributed=True needs an initialized torch.distributed process group")
        if self._sharded and not distributed:
            raise ValueError("the model holds FSDP2-sharded attention layers: the monitor must run on every rank "
                             "(distributed=True or None)")
        self.distributed = bool(distributed)
        self._group = None
        self._rank = dist.get_rank() if self.distributed else 0
        backend = dist.get_backend() if self.distributed else None
        self._comm_device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                             else torch.device("cpu"))

    # -- lifetime -------------------------------------------------------------------------------

    def close(self):
        """Remove the hooks and close the log files (idempotent)."""
        if self._capture is not None:
            self._capture.remove()
            self._capture = None
        self._captured = {}
        self._log.close()

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
