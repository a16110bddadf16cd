"""The standalone ``pytorch_lightning`` package: the same names as :mod:`.lightning`.

Importing this module imports ``pytorch_lightning``. A ``pytorch_lightning.Trainer`` accepts
only ``pytorch_lightning.Callback`` subclasses, so use this module's :class:`PlacementCallback`
with ``import pytorch_lightning as pl`` and :mod:`te_ckpt_placement.integrations.lightning`'s with
``import lightning``. See :mod:`te_ckpt_placement.integrations.lightning` for the behaviour.
"""

from __future__ import annotations

from pytorch_lightning import Callback

from ._lightning import (
    FABRIC_METHODS,
    STRATEGY_METHODS,
    TRAINER_METHODS,
    PlacementStrategyMixin,
    callback_class,
    place_strategy,
    strategy_placement,
    unplace_strategy,
)

__all__ = [
    "FABRIC_METHODS",
    "STRATEGY_METHODS",
    "TRAINER_METHODS",
    "PlacementCallback",
    "PlacementStrategyMixin",
    "place_strategy",
    "strategy_placement",
    "unplace_strategy",
]

PlacementCallback = callback_class(Callback, __name__)
