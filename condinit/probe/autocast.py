"""Autocast switched off for the probes: they compute in their own dtype, whatever autocast region
the caller is in."""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["autocast_disabled", "no_autocast"]


def autocast_disabled(device: torch.device):
    """A context with autocast off on ``device``'s type: the probes compute in their own dtype
    (their tangents must match the primal's dtype), whatever autocast region the caller is in."""
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is not None and available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def no_autocast(method):
    """Run a method with autocast off on its object's ``device`` (see :func:`autocast_disabled`)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with autocast_disabled(self.device):
            return method(self, *args, **kwargs)
    return wrapper
