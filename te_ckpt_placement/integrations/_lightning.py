"""The Lightning integration's logic, shared by ``lightning`` and ``pytorch_lightning`` builds.

No framework imports: :mod:`te_ckpt_placement.integrations.lightning` and
:mod:`te_ckpt_placement.integrations.pytorch_lightning` combine these classes with their
package's ``Callback``.
"""

from __future__ import annotations

from typing import Any

from ..policy import as_placement, export_placement
from ._methods import PlacementLike, methods_owner, place_methods, placed_methods, unplace_methods

__all__ = [
    "STRATEGY_METHODS",
    "PlacementCallbackLogic",
    "PlacementStrategyMixin",
    "place_strategy",
    "unplace_strategy",
]

# The strategy methods that export or load optimizer state, in Lightning 2.x:
# - optimizer_state: Trainer saves; `_CheckpointConnector.dump_checkpoint` calls it for every
#   optimizer BEFORE any `on_save_checkpoint` hook or CheckpointIO sees the checkpoint.
# - get_optimizer_state: Fabric saves (`fabric.save` -> `_convert_stateful_objects_in_state`)
#   and `_FabricOptimizer.state_dict()`.
# - save_checkpoint: DeepSpeed's engine exports its optimizer there (`deepspeed_engine.
#   save_checkpoint`); for the other strategies it only writes the already exported dict.
# - load_optimizer_state_dict: Trainer resume (`restore_optimizers`), `optimizer.load_state_dict`.
# - load_checkpoint: reads the checkpoint; FSDP, ModelParallel (FSDP2/TP) and DeepSpeed load the
#   optimizer state inside it, and Fabric's `fabric.load` calls `optimizer.load_state_dict` there.
STRATEGY_METHODS = (
    "optimizer_state",
    "get_optimizer_state",
    "save_checkpoint",
    "load_optimizer_state_dict",
    "load_checkpoint",
)


def place_strategy(strategy: Any, placement: PlacementLike = "cpu") -> Any:
    """Runs one strategy's optimizer exports and loads inside ``export_placement``.

    Wraps, on that instance only, the methods of :data:`STRATEGY_METHODS` it has: a Lightning
    ``Trainer`` strategy (``trainer.strategy``) or a Fabric strategy (``fabric.strategy``).
    Idempotent; calling it again changes the placement. Returns ``strategy``.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.
    """
    place_methods(strategy, STRATEGY_METHODS, placement)
    return strategy


def unplace_strategy(strategy: Any) -> bool:
    """Restores what :func:`place_strategy` wrapped; returns False if it had wrapped nothing."""
    return unplace_methods(strategy)


class PlacementCallbackLogic:
    """Places ``trainer.strategy`` in ``setup`` and restores it in ``teardown``.

    ``setup`` runs before the Trainer restores a checkpoint (``ckpt_path=``) and ``teardown``
    after the last save of the stage, so resume and every save of ``fit``/``validate``/``test``
    run under the policy, and nothing else does: the policy is entered only inside the wrapped
    strategy methods, never during training steps.

    A strategy that something else already placed (another ``PlacementCallback``,
    ``place_strategy``) is left alone, and ``teardown`` removes only what this callback installed.
    When ``fit`` raises, Lightning calls ``on_exception`` (where ``OnExceptionCheckpoint`` saves)
    but not ``teardown``: the wrappers then stay on that strategy, still scoped to its optimizer
    exports, until the next ``teardown`` of this callback or ``unplace_strategy``.
    """

    def __init__(self, placement: PlacementLike = "cpu") -> None:
        super().__init__()
        self.placement = as_placement(placement)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        owner = methods_owner(strategy)
        if owner is self or (owner is None and not placed_methods(strategy)):
            place_methods(strategy, STRATEGY_METHODS, self.placement, owner=self)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if methods_owner(trainer.strategy) is self:
            unplace_methods(trainer.strategy)


class PlacementStrategyMixin:
    """For custom strategies: ``class MyStrategy(PlacementStrategyMixin, FSDPStrategy)``.

    Runs ``optimizer_state``, ``save_checkpoint``, ``load_optimizer_state_dict`` and
    ``load_checkpoint`` inside
    ``export_placement(optimizer_export_placement)``, for the strategy's whole life (also for
    ``trainer.save_checkpoint`` calls after ``fit`` returns).

    Attributes:
        optimizer_export_placement: ``"cpu"`` by default, or a ``Placement``.
    """

    optimizer_export_placement: PlacementLike = "cpu"

    def optimizer_state(self, optimizer: Any) -> Any:
        with export_placement(as_placement(self.optimizer_export_placement)):
            return super().optimizer_state(optimizer)  # type: ignore[misc]

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with export_placement(as_placement(self.optimizer_export_placement)):
            return super().save_checkpoint(*args, **kwargs)  # type: ignore[misc]

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        with export_placement(as_placement(self.optimizer_export_placement)):
            super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with export_placement(as_placement(self.optimizer_export_placement)):
            return super().load_checkpoint(*args, **kwargs)  # type: ignore[misc]
