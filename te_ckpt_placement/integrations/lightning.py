"""Lightning (``import lightning``): the export policy around optimizer saves and resume.

Importing this module imports ``lightning`` (install the ``[lightning]`` extra). For the
standalone ``pytorch_lightning`` package use
:mod:`te_ckpt_placement.integrations.pytorch_lightning`, which has the same names.

Lightning collects optimizer state (``trainer.strategy.optimizer_state``) inside
``dump_checkpoint`` before ``Callback.on_save_checkpoint`` runs, and a ``CheckpointIO`` only sees
the finished dict, so neither can scope the export. :class:`PlacementCallback` instead wraps the
strategy's optimizer export and load methods (:data:`TRAINER_METHODS`) from ``setup`` to
``teardown``::

    trainer = Trainer(callbacks=[PlacementCallback()])
    trainer.fit(model, ckpt_path="last")  # resume and every save stream to host memory

Resume leaves nothing but the optimizer's own states on the GPU: the placed ``load_checkpoint``
reads the checkpoint file into host memory (``map_location="cpu"``, memory-mapped when training
on a GPU), where Lightning would otherwise put every tensor back on the device it was saved
from until the resume ends, and the placed optimizer load streams each state in.

Fabric: ``place_strategy(fabric.strategy)`` once places ``fabric.save``, ``fabric.load``,
``fabric.load_raw`` and the ``state_dict()``/``load_state_dict()`` of the optimizers Fabric set
up; or ``with export_placement("cpu"): fabric.save(path, state)`` (the decorator works too)
around single calls.

A strategy method that the installed Lightning lacks raises :class:`FrameworkMethodError`
naming it and the Lightning version, instead of leaving that path unplaced.
"""

from __future__ import annotations

from lightning.pytorch import Callback

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
