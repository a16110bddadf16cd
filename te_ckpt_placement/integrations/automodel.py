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
  ``Checkpointer.save_optimizer``/``load_optimizer`` calls they make, for a plain TE
  ``_target_`` optimizer too, and routes those two to the bounded DCP paths (:mod:`._bounded`):
  a sync save is the streaming save, an ``is_async: true`` save the raw snapshot on Automodel's
  process executor with one ``SnapshotStager`` kept for the run (instead of a fresh
  ``DefaultStager`` per save; made and prewarmed at setup, when ``load_checkpoint`` returns),
  and the load reads through ``StreamingLoadPlanner`` (no FP32
  template). For the load, fresh TE optimizers get their states directly, so torch skips its
  fake step; when ``load_checkpoint`` loads nothing (a fresh run), those states are taken back.
  The checkpoint is the one Automodel writes (``<step dir>/optim``: ``optim.*`` and ``sched``).

Launchers. Automodel's CLI resolves a dotted ``recipe:`` with ``importlib.import_module`` +
``getattr`` when it runs the recipe in-process (one device, or under ``torchrun -m
nemo_automodel.cli.app``). NeMo-Run instead runs ``python -m <recipe module> -c config.yaml``:
this module then runs the recipe the YAML names (:func:`main`), as Automodel's own recipe
modules do. Automodel's interactive multi-GPU launch and SkyPilot run the module's *file* with
torchrun; that works when te_ckpt_placement is installed into the same ``site-packages`` as
``nemo_automodel`` (not as an editable install), otherwise use ``torchrun --nproc-per-node N -m
nemo_automodel.cli.app config.yaml``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from te_ckpt_placement import _te_contract as te_contract
from te_ckpt_placement import _wrap
from te_ckpt_placement._policy import as_placement, current_placement

# Absolute imports: the module also runs as a script (Automodel's torchrun launchers).
from te_ckpt_placement.integrations import _bounded, _resume
from te_ckpt_placement.integrations._methods import (
    Framework,
    Method,
    PlacementLike,
    check_methods,
    placing,
)

__all__ = [
    "AUTOMODEL",
    "READY_MADE",
    "PlacementRecipeMixin",
    "main",
    "placement_recipe",
]

MODULE = "te_ckpt_placement.integrations.automodel"
# The framework as error messages name it, with the source this integration was written against.
AUTOMODEL = Framework(
    "NeMo Automodel", ("nemo_automodel", "nemo-automodel"), tested="at commit 36044ad3 (source)"
)

# Ready-made recipe classes: name here -> the Automodel recipe it extends (NVIDIA-NeMo/Automodel
# at 36044ad3: both inherit BaseRecipe.save_checkpoint/load_checkpoint).
READY_MADE = {
    "PlacementFinetuneRecipe": (
        "nemo_automodel.recipes.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction"
    ),
    "PlacementVLMFinetuneRecipe": "nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM",
}


def _recipe_optimizers(recipe: Any) -> list[Any]:
    # Automodel recipes keep their optimizers in attributes (`self.optimizer`, a list).
    found: list[Any] = []
    for value in vars(recipe).values():
        found += _resume.optimizers_in(value)
    return found


# --- the Checkpointer's optimizer save and load, routed to the bounded paths -------------------
# The recipe's one SnapshotStager for is_async saves, kept for the run (Automodel 0.7.0 closes its
# DefaultStager after every save: checkpointing.py Checkpointer._release_async_stager).
STAGER = "_te_ckpt_placement_stager"
OWNER = "te_ckpt_placement.integrations.automodel"


def _unbounded_reason(checkpointer: Any, path: str) -> str | None:
    """Why this save or load keeps Automodel's own code (under the policy), or None."""
    config = checkpointer.config
    if getattr(config, "is_peft", False):
        # OptimizerState may export torch's native (unflattened) state for PEFT (0.7.0
        # stateful_wrappers.py OptimizerState._use_native_optimizer_state); adapters are small.
        return "a PEFT run (Automodel may save the optimizer's native state dict)"
    if str(path).startswith("msc://"):
        return "a multi-storage-client path (Automodel's own storage writer)"
    return None


def _keep_automodel(reason: str) -> None:
    _bounded.warn_once(
        reason,
        f"te_ckpt_placement: {reason}: Automodel's own optimizer save/load runs, under the "
        "export policy but holding the whole FP32 export on the host; the bounded paths "
        "cover flattened (non-PEFT) optimizer states on file paths",
        stacklevel=4,
    )


def _optimizer_state(checkpointer: Any, model: Any, optimizer: Any, save: str) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from te_ckpt_placement.dcp import PlacedOptimizerState

    options = StateDictOptions(
        flatten_optimizer_state_dict=True, cpu_offload=bool(checkpointer.config.cpu_offload)
    )
    placement = current_placement()  # the recipe's, set by the mixin around save/load_checkpoint
    mode: Any = save
    return PlacedOptimizerState(model, optimizer, placement=placement, options=options, save=mode)


def _state(checkpointer: Any, model: Any, optimizer: Any, scheduler: Any, save: str) -> Any:
    # Automodel's layout (stateful_wrappers.py OptimizerState.state_dict): the flattened optimizer
    # state under "optim", the first scheduler's state dict under "sched".
    state: dict[str, Any] = {"optim": _optimizer_state(checkpointer, model, optimizer, save)}
    if scheduler is not None:
        schedulers = scheduler if isinstance(scheduler, (list, tuple)) else [scheduler]
        state["sched"] = _bounded.SchedulerState(list(schedulers))
    return state


def _save_optimizer(
    checkpointer: Any,
    original: Any,
    optimizer: Any,
    model: Any,
    weights_path: str,
    scheduler: Any = None,
    **kwargs: Any,
) -> None:
    """``Checkpointer.save_optimizer`` through the streaming save or the raw snapshot."""
    path = os.path.join(weights_path, "optim")
    reason = _unbounded_reason(checkpointer, path)
    if reason is not None:
        _keep_automodel(reason)
        return original(optimizer, model, weights_path, scheduler, **kwargs)  # type: ignore[no-any-return]
    # Automodel's own directory set-up (every rank sees the directory before any writes).
    module = importlib.import_module(type(checkpointer).__module__)
    module._ensure_shared_dirs(path, process_group=checkpointer.process_group)
    state = _state(checkpointer, model, optimizer, scheduler, "streaming")
    if not checkpointer.config.is_async:
        _bounded.save(state, path, process_group=checkpointer.process_group)
        return None
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    ctx = checkpointer._optim_ctx  # Automodel's async bookkeeping (checkpointing._AsyncSaveContext)
    if ctx.stager is not None:  # Automodel's DefaultStager, unused on this route
        ctx.stager.close()
        ctx.stager = None  # so async_wait's _release_async_stager leaves ours alone
    stager = _run_stager(checkpointer)
    result = _bounded.save(
        state,
        path,
        process_group=ctx.process_group,
        executor=AsyncCheckpointerType.PROCESS,
        stager=stager,
    )
    ctx.future = _bounded.as_response(result)  # Automodel waits on staging_completion
    ctx.staging_active = True
    return None


def _run_stager(checkpointer: Any) -> Any:
    """The run's one ``SnapshotStager`` (made on first use), freed by ``Checkpointer.close``."""
    stager = getattr(checkpointer, STAGER, None)
    if stager is None:
        from te_ckpt_placement.dcp import SnapshotStager

        stager = SnapshotStager()
        setattr(checkpointer, STAGER, stager)
        _wrap.add_wrapper(checkpointer, "close", _close, owner=OWNER)  # idempotent
    return stager


def _load_optimizer(
    checkpointer: Any,
    original: Any,
    optimizer: Any,
    model: Any,
    weights_path: str,
    scheduler: Any = None,
    **kwargs: Any,
) -> None:
    """``Checkpointer.load_optimizer`` through ``StreamingLoadPlanner``."""
    path = os.path.join(weights_path, "optim")
    reason = _unbounded_reason(checkpointer, path)
    if reason is not None:
        _keep_automodel(reason)
        return original(optimizer, model, weights_path, scheduler, **kwargs)  # type: ignore[no-any-return]
    state = _state(checkpointer, model, optimizer, scheduler, "export")
    _bounded.load(state, path, state["optim"], process_group=checkpointer.process_group)
    return None


def _close(checkpointer: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
    """``Checkpointer.close`` that also frees the run's snapshot buffers."""
    try:
        return original(*args, **kwargs)
    finally:
        stager = vars(checkpointer).pop(STAGER, None)
        if stager is not None:
            stager.close()


ROUTES = (("save_optimizer", _save_optimizer), ("load_optimizer", _load_optimizer))


@contextlib.contextmanager
def _routed(recipe: Any) -> Iterator[None]:
    """The recipe's checkpointer saves and loads optimizer state on the bounded paths for the
    block (inside a streaming policy only; ``None`` keeps Automodel's own)."""
    checkpointer = getattr(recipe, "checkpointer", None)
    if checkpointer is None or not _resume.streaming():
        yield
        return
    # Kept on the instance for the run: frees the stager when the recipe finalizes its checkpointer.
    _wrap.add_wrapper(checkpointer, "close", _close, owner=OWNER)
    with contextlib.ExitStack() as stack:
        for name, around in ROUTES:
            stack.enter_context(_wrap.wrapping(checkpointer, name, around, owner=OWNER))
        yield


def _save_checkpoint(recipe: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
    """``BaseRecipe.save_checkpoint`` with the optimizer saved on the bounded paths."""
    with _routed(recipe):
        return original(*args, **kwargs)


def _load_checkpoint(recipe: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
    """``BaseRecipe.load_checkpoint`` with fresh TE optimizers' states built for its load (taken
    back when it loads nothing, as on a fresh run), the optimizer read by the streaming load;
    then, for ``is_async`` saves, the run's snapshot buffers made (:func:`_prewarm_snapshot`)."""
    with _resume.initialized(_recipe_optimizers(recipe)), _routed(recipe):
        result = original(*args, **kwargs)
    _prewarm_snapshot(recipe)
    return result


def _saved_objects(recipe: Any) -> tuple[Any, Any, Any] | str:
    """The model, optimizer and scheduler that ``save_checkpoint`` hands ``save_optimizer``,
    found as it finds them (0.7.0 base_recipe.py: the tracked attributes in sorted order, the
    teacher model skipped, the last of each kind kept); or why they cannot be known here."""
    from nemo_automodel.recipes.base_recipe import (
        BaseRecipe,
        is_lr_scheduler,
        is_model,
        is_optimizer,
    )

    saving = next(
        cls
        for cls in type(recipe).__mro__
        if "save_checkpoint" in vars(cls) and cls is not PlacementRecipeMixin
    )
    if saving is not BaseRecipe:  # EAGLE, DFlash and others save another model's optimizer
        return f"{saving.__qualname__} has a save_checkpoint of its own"
    model = optimizer = scheduler = None
    for key in sorted(vars(recipe).get("__state_tracked", ())):
        value = getattr(recipe, key, None)
        if is_model(value):
            if key != "teacher_model":
                model = value
        elif is_optimizer(value):
            optimizer = value
        elif is_lr_scheduler(value):
            scheduler = value
    return model, optimizer, scheduler


def _not_prewarmed(reason: str) -> None:
    _bounded.warn_once(
        f"not prewarmed: {reason}",
        f"te_ckpt_placement: the snapshot buffers of is_async saves are not made at setup: "
        f"{reason}. The first save makes them (it blocks for the allocation once); later saves "
        "reuse them.",
        stacklevel=4,
    )


def _prewarm_snapshot(recipe: Any) -> None:
    """Makes and pins the run's ``SnapshotStager`` buffers at setup (the end of the recipe's
    ``load_checkpoint``, which Automodel's recipes call once in ``setup``, resuming or not), so
    the first ``is_async`` save blocks only for its copies instead of also allocating and
    pinning them (on one H200, 2.0 s against 0.084 s: ``h200_framework_save_364360e.json``).

    Only for the route that keeps them: a streaming policy, ``is_async`` saves, a non-PEFT run
    on a file path. It costs what the first save would keep for the run anyway: the raw stored
    optimizer bytes and the scheduler's state in host memory, and one copy of them now.
    """
    checkpointer = getattr(recipe, "checkpointer", None)
    if checkpointer is None or not _resume.streaming():
        return
    config = checkpointer.config
    if not getattr(config, "enabled", True) or not getattr(config, "is_async", False):
        return
    if _unbounded_reason(checkpointer, str(getattr(config, "checkpoint_dir", ""))) is not None:
        return  # save_optimizer keeps Automodel's own path (and says so there)
    found = _saved_objects(recipe)
    if isinstance(found, str):
        _not_prewarmed(found)
        return
    model, optimizer, scheduler = found
    if model is None or optimizer is None:
        return
    fresh_other = [
        type(o).__qualname__
        for o in _resume.optimizers_in(optimizer)
        if not te_contract.has_contract(o) and not o.state
    ]
    if fresh_other:  # sized only from TE's initial states; torch's would be its fake step
        _not_prewarmed(f"{', '.join(fresh_other)} (not a TE FusedAdam) has no state yet")
        return
    stager = _run_stager(checkpointer)
    stager.prewarm(_state(checkpointer, model, optimizer, scheduler, "streaming"))


METHODS = (
    Method(
        "save_checkpoint",
        "every recipe checkpoint save (model, optimizer, scheduler)",
        around=_save_checkpoint,
    ),
    Method(
        "load_checkpoint",
        "resume: Checkpointer.load_model and load_optimizer",
        around=_load_checkpoint,
    ),
)


@placing(METHODS)
class PlacementRecipeMixin:
    """Runs a recipe's ``save_checkpoint`` and ``load_checkpoint`` inside ``export_placement``.

    ``class MyRecipe(PlacementRecipeMixin, TrainFinetuneRecipeForNextTokenPrediction): ...``.
    The whole save is in scope (model, optimizer, scheduler); the policy only changes TE
    ``FusedAdam`` exports and imports, so the training steps never run under it. Inside a
    streaming policy the recipe's ``Checkpointer.save_optimizer`` is the streaming save (sync)
    or the raw snapshot on the process executor (``is_async``; one ``SnapshotStager`` per run,
    made and prewarmed when ``load_checkpoint`` returns, freed by ``Checkpointer.close``), and
    ``load_optimizer`` reads through
    ``StreamingLoadPlanner``; the checkpoint is the one Automodel writes. ``load_checkpoint``
    gives fresh TE optimizers their initial states for its load, so no fake step runs, and
    takes them back when it loads nothing (a fresh run).

    Attributes:
        optimizer_export_placement: ``"cpu"`` by default, or a ``Placement``; ``None`` runs
            Automodel's own saves and loads.
    """

    optimizer_export_placement: PlacementLike = "cpu"


def placement_recipe(
    base: type, placement: PlacementLike = "cpu", *, name: str | None = None
) -> type:
    """A subclass of the recipe class ``base`` with :class:`PlacementRecipeMixin` in front.

    Args:
        base: an Automodel recipe class (``save_checkpoint`` and ``load_checkpoint``).
        placement: its ``optimizer_export_placement``.
        name: the new class's name; ``"Placement" + base.__name__`` by default.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.
        FrameworkMethodError: ``base`` lacks ``save_checkpoint`` or ``load_checkpoint``.
    """
    resolved = as_placement(placement)
    check_methods(base, METHODS, AUTOMODEL, what=f"recipe {base.__qualname__}")
    return type(
        name or f"Placement{base.__name__}",
        (PlacementRecipeMixin, base),
        {"optimizer_export_placement": resolved},
    )


def _ready_made(name: str) -> type:
    target = READY_MADE[name]
    base = _bounded.framework_class(
        f"{MODULE}.{name}", target, "NeMo Automodel (pip install nemo-automodel)"
    )
    cls = placement_recipe(base, name=name)
    cls.__module__ = MODULE
    return cls


def __getattr__(name: str) -> Any:
    if name not in READY_MADE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _ready_made(name)
    globals()[name] = cls  # built once: the same class on every lookup
    return cls


def _recipe_name(config_path: str) -> str:
    """The ready-made recipe the YAML's ``recipe:`` names (a dotted path or a bare name)."""
    import yaml

    with open(config_path) as f:
        config = yaml.safe_load(f) or {}
    raw = config.get("recipe")
    if isinstance(raw, dict):
        raw = raw.get("_target_")
    names = ", ".join(f"{MODULE}.{n}" for n in READY_MADE)
    if not isinstance(raw, str) or not raw.strip():
        raise SystemExit(
            f"{config_path} names no recipe: `python -m {MODULE}` runs a recipe of this module; "
            f"set `recipe:` to one of {names}"
        )
    raw = raw.strip()
    module, _, name = raw.rpartition(".")
    if name not in READY_MADE or module not in ("", MODULE):
        raise SystemExit(
            f"{config_path} names recipe {raw!r}, which is not a recipe of this module: "
            f"`python -m {MODULE}` runs one of {names}. Run other recipes through their own "
            "module or `automodel config.yaml`."
        )
    return name


def main(argv: list[str] | None = None) -> int:
    """Runs the ready-made recipe a YAML config names, as Automodel's recipe modules do.

    This is what ``python -m te_ckpt_placement.integrations.automodel -c config.yaml
    [--dotted.key value ...]`` runs (NeMo-Run's launch): Automodel's own argument parser reads
    the config and the overrides, then the recipe's ``setup()`` and
    ``run_train_validation_loop()`` run. Returns 0 once training finished.

    Raises:
        SystemExit: NeMo Automodel is not installed, ``--config`` is missing, or the config's
            ``recipe:`` is not one of :data:`READY_MADE` (never a silent exit 0).
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        from nemo_automodel.components.config._arg_parser import (
            parse_args_and_load_config,
            parse_cli_argv,
        )
    except ImportError as exc:
        raise SystemExit(
            f"python -m {MODULE} runs a NeMo Automodel recipe and needs NeMo Automodel "
            f"(pip install nemo-automodel): {exc}"
        ) from exc
    try:
        config_path, _ = parse_cli_argv(None, argv=argv)
    except ValueError as exc:
        raise SystemExit(f"python -m {MODULE} -c config.yaml: {exc}") from exc
    recipe_cls = getattr(importlib.import_module(MODULE), _recipe_name(config_path))
    config = parse_args_and_load_config(config_path, argv=argv)
    recipe = recipe_cls(config)
    recipe.setup()
    recipe.run_train_validation_loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
