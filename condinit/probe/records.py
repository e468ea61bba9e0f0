"""The records :class:`~condinit.probe.JacobianMonitor` logs: their fields, the reasons a layer is
skipped, the keys trainer callbacks pass on, and the JSONL / CSV / TensorBoard log they are written to.

One record per layer and sampled step: ``step``, ``layer``, ``name``, ``wrt`` (and ``rank`` when
distributed), the estimate (``sigma_max``, ``sigma_min``, ``kappa``, their brackets
:data:`BRACKET_KEYS`, ``converged``, ...), the signals
(:mod:`condinit.probe.signals`), or ``skipped`` set to the reason the layer has no estimate.
Alert records (:mod:`condinit.probe.alerts`) go to the JSONL file only: the CSV has one row per
layer. A log line never carries NaN or inf: such values are written as None.
"""
from __future__ import annotations

import csv
import errno
import json
import math
import os
import stat
from typing import Optional

from condinit.io.atomic import open_nofollow, special_file

from .signals import HEAD_SIGNALS

__all__ = ["BRACKET_KEYS", "CSV_FIELDS", "TB_SCALARS", "LOGGED_KEYS", "logged_metrics", "SKIPPED_BUDGET",
           "SKIPPED_MAX_LAYERS", "SKIPPED_NOT_RUN", "SKIPPED_COMPILED", "skipped_error", "skipped_exception",
           "skipped_transform", "finite_or_none", "RecordLog"]

# an estimate's brackets (condinit.probe.SpectrumEstimate): lower and upper bounds, whether exact, and the
# tolerance on kappa's relative width that ``converged`` refers to
BRACKET_KEYS = ("sigma_max_lo", "sigma_max_hi", "sigma_min_lo", "sigma_min_hi", "kappa_lo", "kappa_hi", "exact", "tol")
# the CSV's columns (the JSONL lines hold every key of a record)
CSV_FIELDS = ("step", "layer", "name", "wrt", "sigma_max", "sigma_min", "kappa") + BRACKET_KEYS + (
              "rank_deficient", "converged",
              "residual_max", "residual_min", "lanczos_steps", "frobenius", "frobenius_ci_low", "frobenius_ci_high",
              "max_logit", "entropy_mean", "entropy_min", "qk_norm") + HEAD_SIGNALS + (
              "batch", "tokens", "time_s", "skipped", "notes")
# the TensorBoard scalars per layer (and, per head, those of HEAD_SIGNALS)
TB_SCALARS = ("sigma_max", "sigma_min", "kappa", "kappa_lo", "kappa_hi", "frobenius", "max_logit", "entropy_mean",
              "entropy_min", "qk_norm")

# why a layer's record has no estimate (``skipped``); an estimate that overflowed its dtype carries the
# estimator's own reason
SKIPPED_BUDGET = "budget"            # the step's time budget was spent
SKIPPED_MAX_LAYERS = "max_layers"    # max_layers layers were estimated this step
SKIPPED_NOT_RUN = "layer not run in the sampled forward"
# the sampled forward was a torch.compile graph: it does not call the hooks (condinit.probe.context)
SKIPPED_COMPILED = "forward under torch.compile: the compiled graph does not run the monitor's hooks"


def skipped_error(reason: str) -> str:
    """The ``skipped`` reason of a layer whose capture failed (non-finite data, a layer the operator
    cannot read)."""
    return f"error: {reason}"


def skipped_exception(exc: BaseException) -> str:
    """The ``skipped`` reason of a layer whose capture or estimate raised something other than a
    refusal of its data (a kernel's error, say): the exception's type and message."""
    return skipped_error(f"{type(exc).__name__}: {exc}")


def skipped_transform(transform: str) -> str:
    """The ``skipped`` reason of a layer whose sampled forward ran under a :mod:`torch.func`
    transform, ``transform`` naming those of its kind (``"grad, vjp or jacrev"``: its tensors are the
    transform's wrappers; :func:`condinit.probe.context.functorch_transform`)."""
    return f"forward under a torch.func transform ({transform}): the monitor does not measure transformed tensors"


# record keys a trainer callback passes on to its trainer's logger, as "jacobian/LAYER/KEY"
LOGGED_KEYS = ("kappa", "kappa_lo", "kappa_hi", "frobenius", "max_logit", "entropy_mean", "entropy_min", "qk_norm")


def logged_metrics(records) -> dict:
    """``{"jacobian/LAYER/KEY": value}`` for the non-None :data:`LOGGED_KEYS` of ``records`` (a later
    record of a layer overrides an earlier one): what the trainer callbacks log."""
    out = {}
    for rec in records:
        for key in LOGGED_KEYS:
            if rec.get(key) is not None:
                out[f"jacobian/{rec['layer']:02d}/{key}"] = rec[key]
    return out


def finite_or_none(v):
    """Floats (also inside lists, tuples and dicts) that are NaN / inf become None: a log line must stay
    valid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite_or_none(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite_or_none(x) for x in v]
    return v


def _open_for_append(path: str, what: str, newline=None):
    """``path`` opened for appending, as a regular file in its own directory: a symlink there (to a
    file elsewhere, or dangling) or a directory, FIFO, device or socket is refused (ValueError naming
    it), never written through or opened."""
    kind = special_file(path)
    if kind is not None:
        raise ValueError(f"{what} {path} is {kind}; the monitor appends its records to a regular file")
    try:
        fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
                           | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        target = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
        raise ValueError(f"{what} {path} is a symlink to {target}; the monitor never writes through a link: "
                         f"remove it, or choose another path") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):   # replaced between the check and the open
        os.close(fd)
        raise ValueError(f"{what} {path} is not a regular file; the monitor appends its records to a regular file")
    return os.fdopen(fd, "a", newline=newline, encoding="utf-8")


class RecordLog:
    """The monitor's output files: ``path`` (JSONL, appended to), ``csv_path`` beside it, and
    TensorBoard scalars in ``log_dir`` (when ``tensorboard`` and ``torch.utils.tensorboard``
    imports; TensorBoard names its own new event file there). ``path`` defaults to
    ``log_dir/jacobian.jsonl``; neither given: nothing is written. Bad paths raise ``ValueError``
    here, before any record: ``log_dir`` not a directory, the JSONL or CSV file a symlink or not a
    regular file. :meth:`write` never raises an ``OSError``: it returns it."""

    def __init__(self, log_dir=None, path=None, tensorboard: bool = True):
        self.path = self.csv_path = None
        if path is not None or log_dir is not None:
            if path is None:
                if os.path.lexists(log_dir) and not os.path.isdir(log_dir):
                    raise ValueError(f"log_dir {os.path.abspath(os.fspath(log_dir))} is not a directory")
                os.makedirs(log_dir, exist_ok=True)
                path = os.path.join(log_dir, "jacobian.jsonl")
            path = os.path.abspath(os.fspath(path))
            if os.path.isdir(path) and not os.path.islink(path):
                raise ValueError(f"path {path} is a directory, expected a .jsonl file path")
            if not os.path.isdir(os.path.dirname(path)):
                raise ValueError(f"path: directory {os.path.dirname(path)} does not exist")
            self.path = path
            self.csv_path = os.path.splitext(path)[0] + ".csv"
        self._jsonl = _open_for_append(self.path, "path") if self.path else None
        try:
            self._csv_fh = _open_for_append(self.csv_path, "path's CSV file", newline="") if self.csv_path else None
        except BaseException:
            self._jsonl.close()
            raise
        self._csv = None
        if self._csv_fh is not None:
            self._csv = csv.DictWriter(self._csv_fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
            if self._csv_fh.tell() == 0:
                self._csv.writeheader()
        self._tb = None
        if tensorboard and (log_dir is not None):
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=os.fspath(log_dir))
            except ImportError:      # tensorboard is optional
                self._tb = None

    def write(self, records) -> Optional[str]:
        """Append ``records`` (NaN / inf values become None, in place). Returns None, or the
        ``OSError`` that stopped the write (a full disk, say) as ``"<Type>: <message>"``: the monitor
        records it, it never raises into training."""
        try:
            self._write(records)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _write(self, records) -> None:
        for r in records:
            for k, v in r.items():   # a log line must never carry NaN / inf (or break training)
                r[k] = finite_or_none(v)
            if self._jsonl is not None:
                self._jsonl.write(json.dumps(r, allow_nan=False, default=str) + "\n")
            if "alert" in r:         # alerts go to the JSONL file only: the CSV has one row per layer
                continue
            if self._csv is not None:
                self._csv.writerow({k: ("" if r.get(k) is None else json.dumps(r[k]) if isinstance(r[k], list)
                                        else r[k]) for k in CSV_FIELDS})
            if self._tb is not None:
                tag = f"jacobian/{r['layer']:03d}"
                for key in TB_SCALARS:
                    if r.get(key) is not None:
                        self._tb.add_scalar(f"{tag}/{key}", r[key], r["step"])
                for key in HEAD_SIGNALS:
                    for h, v in enumerate(r.get(key) or ()):
                        if v is not None:
                            self._tb.add_scalar(f"{tag}/{key[:-len('_heads')]}/head_{h:02d}", v, r["step"])
        for fh in (self._jsonl, self._csv_fh):
            if fh is not None:
                fh.flush()

    def close(self) -> None:
        """Close the files (idempotent)."""
        for fh in (self._jsonl, self._csv_fh):
            if fh is not None and not fh.closed:
                fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
