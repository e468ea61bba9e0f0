"""The alerts of :class:`~condinit.probe.JacobianMonitor`: the kinds, their thresholds, and the rules
that turn a record crossing one into a :class:`ConditioningWarning` and an alert record.

Alerts (``alerts={"kappa_growth": 10.0, "max_logit": 50.0, "entropy": 0.1, "qk_norm": 100.0}``):
kappa over the layer's first recorded kappa above ``kappa_growth``, a head's max logit above
``max_logit``, a head's mean entropy below ``entropy``, a head's ``qk_norm`` above ``qk_norm``. Each
fires once per layer and kind: a :class:`ConditioningWarning` (``warnings.warn``) and an alert
record (``{"alert": kind, "step", "layer", "name", "head", "value", "threshold", ...}``). A NaN value
(a diverged head) counts as crossing the bound, whichever its direction.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

from condinit._validate import check_real

__all__ = ["ALERT_KINDS", "ConditioningWarning", "check_alerts", "Alerts"]

# alert kind -> (what it compares, the bound's check_real arguments)
ALERT_KINDS = {
    "kappa_growth": ("kappa / the layer's first recorded kappa above the bound", dict(min=0.0, min_open=True)),
    "max_logit": ("a head's max attention logit above the bound", {}),
    "entropy": ("a head's mean attention entropy (nats) below the bound", dict(min=0.0)),
    "qk_norm": ("a head's ||W_Q,h^T W_K,h||_2 above the bound", dict(min=0.0, min_open=True)),
}


class ConditioningWarning(UserWarning):
    """An alert of :class:`~condinit.probe.JacobianMonitor` (a signal crossed a user threshold)."""


def check_alerts(alerts) -> dict:
    """``alerts`` (a dict of kind -> threshold, or None) checked against :data:`ALERT_KINDS`."""
    if alerts is None:
        return {}
    if not isinstance(alerts, dict):
        raise TypeError(f"alerts must be a dict mapping alert kinds ({', '.join(ALERT_KINDS)}) to thresholds, "
                        f"got {type(alerts).__name__}")
    out = {}
    for kind, bound in alerts.items():
        if kind not in ALERT_KINDS:
            raise ValueError(f"alerts: unknown kind {kind!r}; expected one of {', '.join(ALERT_KINDS)}")
        out[kind] = check_real(f"alerts[{kind!r}]", bound, **ALERT_KINDS[kind][1])
    return out


class Alerts:
    """The alert rules of one monitor: ``thresholds`` per kind (checked by :func:`check_alerts`); each
    (layer, kind) fires once."""

    def __init__(self, thresholds: dict):
        self.thresholds = thresholds
        self._kappa_first: dict = {}     # layer index -> its first recorded kappa
        self._alerted: set = set()       # (layer index, kind) already reported

    def check(self, rec: dict) -> list[dict]:
        """The alert records ``rec`` triggers (each (layer, kind) once per monitor), with their warnings."""
        out = []
        if "kappa_growth" in self.thresholds and rec.get("kappa") is not None:
            first = self._kappa_first.setdefault(rec["layer"], rec["kappa"])
            growth = rec["kappa"] / first
            if growth > self.thresholds["kappa_growth"]:
                out += self._alert(rec, "kappa_growth", None, growth, kappa=rec["kappa"], kappa_first=first)
        for kind, key, worst in (("max_logit", "max_logit_heads", max), ("entropy", "entropy_mean_heads", min),
                                 ("qk_norm", "qk_norm_heads", max)):
            values = rec.get(key)
            if kind not in self.thresholds or not values:
                continue
            bound = self.thresholds[kind]
            # a NaN value (a diverged head) counts as crossing the bound, whichever its direction
            nan = [h for h, v in enumerate(values) if v is not None and math.isnan(v)]
            finite = [h for h, v in enumerate(values) if v is not None and not math.isnan(v)]
            if not nan and not finite:
                continue
            head = nan[0] if nan else worst(finite, key=lambda h: values[h])
            value = values[head]
            if nan or (value < bound if kind == "entropy" else value > bound):
                out += self._alert(rec, kind, head, value)
        return out

    def _alert(self, rec: dict, kind: str, head: Optional[int], value: float, **extra) -> list[dict]:
        if (rec["layer"], kind) in self._alerted:
            return []
        self._alerted.add((rec["layer"], kind))
        bound = self.thresholds[kind]
        where = f"layer {rec['layer']} ({rec['name']})" + ("" if head is None else f" head {head}")
        message = (f"condinit JacobianMonitor: step {rec['step']}: {where}: {kind} = {value:.4g} "
                   f"({ALERT_KINDS[kind][0]} {bound:g})")
        # stacklevel 5: the caller of JacobianMonitor.step (step -> _estimate -> Alerts.check -> _alert)
        warnings.warn(message, ConditioningWarning, stacklevel=5)
        return [{"step": rec["step"], "layer": rec["layer"], "name": rec["name"], "alert": kind, "head": head,
                 "value": value, "threshold": bound, **extra, "message": message}]
