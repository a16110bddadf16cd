"""Lightning (``import lightning``): the export policy around optimizer saves and resume.

Importing this module imports ``lightning`` (install the ``[lightning]`` extra). For the
standalone ``pytorch_lightning`` package use
:mod:`te_ckpt_placement.integrations.pytorch_lightning`, which has the same names.

Lightning collects optimizer state (``trainer.strategy.optimizer_state``) inside
``dump_checkpoint`` before ``Callback.on_save_checkpoint`` runs, and a ``CheckpointIO`` only sees
the finished dict, so neither can scope the export. :class:`PlacementCallback` instead wraps the
strategy's optimizer export and load methods from ``setup`` to ``teardown``::

    trainer = Trainer(callbacks=[PlacementCallback()])
    trainer.fit(model, ckpt_path="last")  # resume and every save stream to host memory

Fabric: ``with export_placement("cpu"): fabric.save(path, state)`` (the decorator works too), or
``place_strategy(fabric.strategy)`` once.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from ._lightning import (
    STRATEGY_METHODS,
    PlacementCallbackLogic,
    PlacementStrategyMixin,
    place_strategy,
    unplace_strategy,
)

__all__ = [
    "STRATEGY_METHODS",
    "PlacementCallback",
    "PlacementStrategyMixin",
    "place_strategy",
    "unplace_strategy",
]


class PlacementCallback(PlacementCallbackLogic, Callback):
    """Optimizer exports and loads of the Trainer's strategy run inside ``export_placement``.

    Installed in ``setup``, removed in ``teardown`` (see :class:`PlacementCallbackLogic` for
    the exact rules: idempotent, per strategy, restores exactly the original methods).

    Args:
        placement: ``"cpu"`` (default) or a ``Placement``.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.

    Example:
        >>> trainer = Trainer(callbacks=[PlacementCallback()])  # doctest: +SKIP
    """
