"""The host budget: before a save, warn once when it would hold more host memory than this rank has.

Each of the package's save paths estimates the host bytes it will hold and calls :func:`check`.
What a rank has is ``MemAvailable`` (``/proc/meminfo``) shared by the node's ranks
(``LOCAL_WORLD_SIZE``, as torchrun sets it; 1 without it). Over that, one
:class:`HostBudgetWarning` per path and process says the numbers and which path fits; the save
goes on (an estimate is not a reason to refuse). Nothing is checked where ``/proc/meminfo`` is
missing (not Linux).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterable

import torch

from ._tensors import local

MEMINFO = "/proc/meminfo"
#: Host bytes a streaming save holds besides its produced states (staging ring, writer buffers).
STREAMING_OVERHEAD_BYTES = 1 << 30

_warned: set[str] = set()
_lock = threading.Lock()


class HostBudgetWarning(UserWarning):
    """A save is estimated to hold more host memory than this rank has available."""


def available_bytes() -> int | None:
    """``MemAvailable`` divided by ``LOCAL_WORLD_SIZE``; None when it cannot be read."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])
                    break
            else:
                return None
    except (OSError, ValueError, IndexError):
        return None
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return kib * 1024 // ranks


def export_bytes(states: Iterable[dict[str, object]]) -> int:
    """Host bytes of an FP32 export of these optimizer states: 4 B per local element of each
    state (FP32 moments and masters), 2 B for int16 remainders."""
    total = 0
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                itemsize = 2 if value.dtype == torch.int16 else 4
                total += local(value).numel() * itemsize
    return total


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def check(path: str, estimate: int, *, fits: str) -> bool:
    """Warns once per ``path`` when ``estimate`` host bytes exceed what this rank has.

    Args:
        path: The save path (``"export"``, ``"streaming_save"``, ``"snapshot"``).
        estimate: The host bytes the save will hold.
        fits: What to use instead, with its own estimate, for the message.

    Returns:
        True when the estimate is over the budget (warned now or before).
    """
    available = available_bytes()
    if available is None or estimate <= available:
        return False
    with _lock:
        first = path not in _warned
        _warned.add(path)
    if first:
        ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
        warnings.warn(
            f"te_ckpt_placement: this {path} save is estimated to hold {_size(estimate)} of host "
            f"memory, more than the {_size(available)} this rank has (MemAvailable shared by "
            f"LOCAL_WORLD_SIZE={ranks} ranks): the host may run out of memory mid-save. {fits}. "
            "(Warned once per process; the save goes on.)",
            HostBudgetWarning,
            stacklevel=3,
        )
    return True
