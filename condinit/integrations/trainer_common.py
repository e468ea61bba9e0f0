"""What the trainer callbacks share (imports neither transformers nor lightning)."""
from __future__ import annotations

from torch import nn

__all__ = ["fsdp2_sharded"]


def fsdp2_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 (DTensor) parameters: then every rank runs the monitor, since
    its per-layer weight gathers are collective (rank 0 writes every rank's records)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:        # a torch built without torch.distributed
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())
