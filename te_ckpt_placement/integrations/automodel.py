"""NeMo Automodel (YAML-configured recipes): the export policy around checkpoint save and resume.

Importing this module does not import ``nemo_automodel``; asking for a ready-made recipe class
(:data:`READY_MADE`, e.g. ``PlacementFinetuneRecipe``) does, at that moment.

Two YAML routes, usable together:

- the optimizer, ``_target_: te_ckpt_placement.FusedAdam`` with ``state_dict_placement: cpu``:
  a TE ``FusedAdam`` subclass (Automodel keeps its zero-size-shard guard for subclasses) with an
  explicit signature (no ``**kwargs``, so Automodel injects no ``foreach=False``); its
  ``state_dict()`` and ``load_state_dict()`` stream on every call;
- the recipe, ``recipe: te_ckpt_placement.integrations.automodel.PlacementFinetuneRecipe``:
  ``save_checkpoint`` and ``load_checkpoint`` run inside ``export_placement``, which covers the
  ``Checkpointer.save_optimizer``/``load_optimizer`` calls they make (the load builds its DCP
  template with ``optimizer.state_dict()``) for a plain TE ``_target_`` optimizer too.

Automodel's CLI resolves a dotted ``recipe:`` with ``importlib.import_module`` + ``getattr``
when it runs the recipe in-process (one device, or under ``torchrun -m nemo_automodel.cli.app``).
Its own multi-GPU launch instead runs the recipe's module file as a script, which this module
is not: launch multi-GPU jobs with ``torchrun --nproc-per-node N -m nemo_automodel.cli.app
config.yaml``.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..policy import as_placement, export_placement
from ._methods import PlacementLike

__all__ = ["READY_MADE", "PlacementRecipeMixin", "placement_recipe"]

# Ready-made recipe classes: name here -> the Automodel recipe it extends (NVIDIA-NeMo/Automodel
# at 36044ad3: both inherit BaseRecipe.save_checkpoint/load_checkpoint).
READY_MADE = {
    "PlacementFinetuneRecipe": (
        "nemo_automodel.recipes.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction"
    ),
    "PlacementVLMFinetuneRecipe": "nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM",
}


class PlacementRecipeMixin:
    """Runs a recipe's ``save_checkpoint`` and ``load_checkpoint`` inside ``export_placement``.

    ``class MyRecipe(PlacementRecipeMixin, TrainFinetuneRecipeForNextTokenPrediction): ...``.
    The whole save is in scope (model, optimizer, scheduler); the policy only changes TE
    ``FusedAdam`` exports and imports, which Automodel builds synchronously before any async
    DCP staging, so the training steps never run under it.

    Attributes:
        optimizer_export_placement: ``"cpu"`` by default, or a ``Placement``.
    """

    optimizer_export_placement: PlacementLike = "cpu"

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with export_placement(as_placement(self.optimizer_export_placement)):
            return super().save_checkpoint(*args, **kwargs)  # type: ignore[misc]

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with export_placement(as_placement(self.optimizer_export_placement)):
            return super().load_checkpoint(*args, **kwargs)  # type: ignore[misc]


def placement_recipe(
    base: type, placement: PlacementLike = "cpu", *, name: str | None = None
) -> type:
    """A subclass of the recipe class ``base`` with :class:`PlacementRecipeMixin` in front.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.
    """
    resolved = as_placement(placement)
    return type(
        name or f"Placement{base.__name__}",
        (PlacementRecipeMixin, base),
        {"optimizer_export_placement": resolved},
    )


def __getattr__(name: str) -> Any:
    target = READY_MADE.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, base_name = target.rsplit(".", 1)
    try:
        base = getattr(importlib.import_module(module_name), base_name)
    except ImportError as exc:
        raise ImportError(
            f"{__name__}.{name} extends {target}, which needs NeMo Automodel "
            f"(pip install nemo-automodel): {exc}"
        ) from exc
    cls = placement_recipe(base, name=name)
    cls.__module__ = __name__
    globals()[name] = cls  # built once: the same class on every lookup
    return cls
