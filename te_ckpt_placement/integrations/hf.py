"""Hugging Face Transformers ``Trainer``: the export policy around optimizer saves and resume.

Importing this module imports ``transformers`` (install the ``[hf]`` extra).

The Trainer has no pre-save callback event (``on_save`` fires after the save) and resumes the
optimizer (``_load_optimizer_and_scheduler``) before ``on_train_begin``, so a ``TrainerCallback``
cannot scope either. The integration therefore wraps the Trainer methods that export or load
optimizer state, and only those:

- ``_save_checkpoint``: every periodic, best-model and end-of-training save, and the SIGTERM
  "JIT checkpoint" save (``trainer_jit_checkpoint.CheckpointManager.execute_jit_checkpoint``
  calls ``trainer._save_checkpoint``); it covers ``_save_optimizer_and_scheduler`` inside it,
  for DDP/single device (``torch.save(optimizer.state_dict())``), FSDP
  (``save_fsdp_optimizer`` → ``get_optimizer_state_dict``) and DeepSpeed.
- ``_save_optimizer_and_scheduler``: also on its own, for subclasses that call it directly.
- ``_tune_save_checkpoint``: Ray Tune trial checkpoints (where the Trainer has it).
- ``_load_optimizer_and_scheduler``: resume (``train(resume_from_checkpoint=...)``), including
  accelerate's ``load_fsdp_optimizer``, which exports a DCP template before loading.

Methods that the installed Transformers version lacks are skipped. Two forms:

- :class:`PlacementTrainerMixin` (or the ready-made :class:`PlacementTrainer`): class-level,
  ``class MyTrainer(PlacementTrainerMixin, SFTTrainer): ...``.
- :func:`place_trainer`: on one already-built trainer instance (for trainers that a framework
  builds for you); :func:`unplace_trainer` restores it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import Trainer

from ..policy import as_placement, export_placement
from ._methods import PlacementLike, place_methods, unplace_methods

__all__ = [
    "PLACED_METHODS",
    "PlacementTrainer",
    "PlacementTrainerMixin",
    "place_trainer",
    "placed_trainer_methods",
    "unplace_trainer",
]

# Every Trainer method known (in some Transformers version) to export or load optimizer state.
PLACED_METHODS = (
    "_save_checkpoint",
    "_save_optimizer_and_scheduler",
    "_tune_save_checkpoint",
    "_load_optimizer_and_scheduler",
)


def _placed(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with export_placement(as_placement(self.optimizer_export_placement)):
            return getattr(super(PlacementTrainerMixin, self), name)(*args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"PlacementTrainerMixin.{name}"
    method.__doc__ = f"``Trainer.{name}`` inside ``export_placement(optimizer_export_placement)``."
    return method


class PlacementTrainerMixin:
    """Runs the Trainer's optimizer saves and its resume inside ``export_placement``.

    Put it before the Trainer class: ``class MyTrainer(PlacementTrainerMixin, Trainer)``. It
    overrides, of :data:`PLACED_METHODS`, those that the installed ``transformers.Trainer`` has.

    Attributes:
        optimizer_export_placement: the policy, ``"cpu"`` by default; a ``Placement`` for other
            options (``Placement(device="cpu", conversion="device")``), settable per class or
            per instance.

    Example:
        >>> class MyTrainer(PlacementTrainerMixin, Trainer):  # doctest: +SKIP
        ...     pass
    """

    optimizer_export_placement: PlacementLike = "cpu"


for _name in PLACED_METHODS:
    if callable(getattr(Trainer, _name, None)):
        setattr(PlacementTrainerMixin, _name, _placed(_name))
del _name


class PlacementTrainer(PlacementTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`PlacementTrainerMixin`: a drop-in replacement."""


def placed_trainer_methods() -> tuple[str, ...]:
    """The methods of :data:`PLACED_METHODS` that the installed ``Trainer`` has (and so wraps)."""
    return tuple(name for name in PLACED_METHODS if callable(getattr(Trainer, name, None)))


def place_trainer(trainer: Any, placement: PlacementLike = "cpu") -> Any:
    """Runs one trainer instance's optimizer saves and resume inside ``export_placement``.

    Wraps the bound methods of :data:`PLACED_METHODS` that ``trainer`` has, on that instance only
    (its class and other trainers are untouched). Idempotent; calling it again changes the
    placement. Call it before ``trainer.train()`` to cover resume. Returns ``trainer``.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.

    Example:
        >>> trainer = place_trainer(Trainer(model=model, args=args))  # doctest: +SKIP
    """
    place_methods(trainer, PLACED_METHODS, placement)
    return trainer


def unplace_trainer(trainer: Any) -> bool:
    """Restores the methods :func:`place_trainer` wrapped; returns False if it had wrapped none."""
    return unplace_methods(trainer)
