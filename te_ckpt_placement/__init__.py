"""Checkpoint-scoped placement of Transformer Engine FusedAdam optimizer-state exports.

Example:
    >>> from te_ckpt_placement import export_placement
    >>> with export_placement("cpu"):
    ...     state = optimizer.state_dict()  # doctest: +SKIP

``import te_ckpt_placement`` does not import Transformer Engine; ``te_ckpt_placement.FusedAdam``
does, on first access. The DCP helpers are in :mod:`te_ckpt_placement.dcp`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from . import _pool
from ._host_budget import HostBudgetWarning
from ._policy import Placement, current_placement, export_placement
from ._prewarm import prewarm
from ._reports import TransferReport, last_report
from ._te_contract import ContractError
from ._te_hooks import install, is_installed, uninstall
from ._te_load_write import PartialLoadError

if TYPE_CHECKING:
    from ._fused_adam import FusedAdam as FusedAdam

# FusedAdam is not listed: `from te_ckpt_placement import *` must work without TE installed.
__all__ = [
    "ContractError",
    "HostBudgetWarning",
    "PartialLoadError",
    "Placement",
    "TransferReport",
    "current_placement",
    "export_placement",
    "install",
    "is_installed",
    "last_report",
    "pinned_pool_bytes",
    "prewarm",
    "release_buffers",
    "uninstall",
]
__version__ = "0.1.0"

# Silent unless the application configures logging (the reports log at INFO).
logging.getLogger(__name__).addHandler(logging.NullHandler())


def release_buffers() -> None:
    """Frees the kept host buffers (``reuse_buffers`` exports, snapshots) and idle staging rings.

    Buffers still referenced by a state dict stay alive with it.
    """
    _pool.release_all()


def pinned_pool_bytes() -> int:
    """Pinned host bytes held: the staging rings and the snapshots' pinned buffers."""
    return _pool.held_bytes(pinned=True)


def __dir__() -> list[str]:
    return sorted([*globals(), "FusedAdam"])


def __getattr__(name: str) -> Any:
    if name == "FusedAdam":
        from ._fused_adam import FusedAdam as FusedAdam

        return FusedAdam
    raise AttributeError(f"module 'te_ckpt_placement' has no attribute {name!r}")
