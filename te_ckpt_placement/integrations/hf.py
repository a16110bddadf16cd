"""Hugging Face Transformers ``Trainer``: the export policy around optimizer saves and resume.

Importing this module imports ``transformers`` (install the ``[hf]`` extra).

The Trainer has no pre-save callback event (``on_save`` fires after the save) and resumes the
optimizer (``_load_optimizer_and_scheduler``) before ``on_train_begin``, so a ``TrainerCallback``
cannot scope either. The integration therefore wraps the Trainer methods that export or load
optimizer state, and only those (:data:`PLACED_METHODS`):

- ``_save_checkpoint`` (required): every periodic, best-model and end-of-training save, and the
  SIGTERM "JIT checkpoint" save; it covers ``_save_optimizer_and_scheduler`` inside it, for
  DDP/single device (``torch.save(optimizer.state_dict())``), FSDP (``save_fsdp_optimizer``)
  and DeepSpeed.
- ``_save_optimizer_and_scheduler`` (optional): also on its own, for subclasses that call it.
- ``_tune_save_checkpoint`` (optional): Ray Tune trial checkpoints.
- ``_load_optimizer_and_scheduler`` (required): resume (``train(resume_from_checkpoint=...)``).

A required method that the installed Transformers lacks raises :class:`FrameworkMethodError`
(at import for the mixin, at :func:`place_trainer` for an instance); a missing optional one
warns. Both name the method and the Transformers version.

Resume does more than run under the policy, so that it leaves nothing but the optimizer's own
states on the GPU (inside a streaming policy; ``optimizer_export_placement=None`` keeps
Transformers' own resume):

- DDP and one device: Transformers reads ``optimizer.pt`` with ``map_location=args.device``
  when there are several processes, which puts the whole FP32 checkpoint on every GPU before
  the optimizer's load runs. The integration reads it into host memory instead (memory-mapped
  when training on a GPU), and the placed load streams it in.
- accelerate FSDP2: TE FusedAdam's states are built directly
  (:func:`te_ckpt_placement._te_load.initialize_states`), so torch's fake optimizer step is
  skipped. A ``SHARDED_STATE_DICT`` checkpoint loads through accelerate's calls with DCP's
  planning collectives on a host (gloo) group; a ``FULL_STATE_DICT`` ``optimizer.bin`` is
  memory-mapped on every rank, which copies its own shard of each state on the host, instead
  of torch broadcasting every whole state from rank 0 through GPU memory. When some rank cannot
  read ``optimizer.bin`` (no shared checkpoint directory), accelerate's broadcast load runs
  instead, with a ``RuntimeWarning``.
- DeepSpeed, XLA, SageMaker model parallel and FSDP1 run Transformers' own code inside the policy.

Every rank converts its checkpoint on the host at the same moment; the conversions run on the
package's host workers, sized to the rank's share of the CPUs (``available CPUs //
LOCAL_WORLD_SIZE``, see ``Placement(host_workers=...)``), each with one torch thread, so ranks
do not oversubscribe the host and torch's own thread count is left as it is.

Two forms:

- :class:`PlacementTrainerMixin` (or the ready-made :class:`PlacementTrainer`): class-level,
  ``class MyTrainer(PlacementTrainerMixin, SFTTrainer): ...``.
- :func:`place_trainer`: on one already-built trainer instance (for trainers that a framework
  builds for you); :func:`unplace_trainer` restores it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import transformers.trainer as _trainer_module
from transformers import Trainer

from . import _fsdp2_load, _resume
from ._methods import (
    Framework,
    Method,
    PlacementLike,
    check_methods,
    place_methods,
    placing,
    unplace_methods,
)

__all__ = [
    "PLACED_METHODS",
    "TRANSFORMERS",
    "PlacementTrainer",
    "PlacementTrainerMixin",
    "place_trainer",
    "placed_trainer_methods",
    "unplace_trainer",
]

# The framework as error messages name it, with the versions this integration was tested with.
TRANSFORMERS = Framework("transformers", ("transformers",), tested="5.17 and 5.24")

# File names as the Trainer and accelerate write them (transformers.trainer, accelerate.utils).
OPTIMIZER_NAME = getattr(_trainer_module, "OPTIMIZER_NAME", "optimizer.pt")
SCHEDULER_NAME = getattr(_trainer_module, "SCHEDULER_NAME", "scheduler.pt")
FSDP_OPTIMIZER_DIR = "optimizer_0"  # accelerate's SHARDED_STATE_DICT layout (use_dcp=True)
FSDP_OPTIMIZER_FILE = "optimizer.bin"  # accelerate's FULL_STATE_DICT layout


def _load_scheduler(trainer: Any, checkpoint: str) -> None:
    # Transformers' own scheduler load, as in _load_optimizer_and_scheduler.
    with warnings.catch_warnings(record=True) as caught:
        check = getattr(_trainer_module, "check_torch_load_is_safe", None)
        if check is not None:
            check()
        trainer.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        )
    reissue = getattr(_trainer_module, "reissue_pt_warnings", None)
    if reissue is not None:
        reissue(caught)
    else:
        for w in caught:
            warnings.warn(w.message, w.category, stacklevel=2)


def _framework_path(trainer: Any) -> bool:
    """True where Transformers' own load must run: DeepSpeed, XLA, SageMaker model parallel."""
    smp = getattr(_trainer_module, "is_sagemaker_mp_enabled", lambda: False)
    xla = getattr(_trainer_module, "is_torch_xla_available", lambda: False)
    return bool(getattr(trainer, "is_deepspeed_enabled", False) or smp() or xla())


def _resume_fsdp2(trainer: Any, plugin: Any, checkpoint: str, original: Any) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    full = str(getattr(plugin.state_dict_type, "name", plugin.state_dict_type)).endswith(
        "FULL_STATE_DICT"
    )
    config = plugin.state_dict_config
    # accelerate's _prepare_sd_options for FSDP2.
    options = StateDictOptions(
        full_state_dict=full,
        cpu_offload=getattr(config, "offload_to_cpu", False),
        broadcast_from_rank0=getattr(config, "rank0_only", False),
    )
    model, optimizer = trainer.model, trainer.optimizer
    with _resume.initialized([optimizer]), _fsdp2_load.host_group() as group:
        if full:
            path = os.path.join(checkpoint, FSDP_OPTIMIZER_FILE)
            if not _fsdp2_load.load_full(model, optimizer, path, options, group):
                warnings.warn(
                    f"te_ckpt_placement: some rank cannot read {path}; resuming through "
                    "accelerate's load, which broadcasts each whole optimizer state from "
                    "rank 0 through GPU memory. Put checkpoints on a directory every rank "
                    "reads to resume without GPU temporaries.",
                    RuntimeWarning,
                    stacklevel=4,
                )
                original(checkpoint)
                return
        else:
            _fsdp2_load.load_sharded(
                model, optimizer, os.path.join(checkpoint, FSDP_OPTIMIZER_DIR), options, group
            )
    _load_scheduler(trainer, checkpoint)


def _resume_optimizer_and_scheduler(
    trainer: Any, original: Any, checkpoint: str | None = None, *args: Any, **kwargs: Any
) -> Any:
    """``Trainer._load_optimizer_and_scheduler`` without GPU temporaries (see module doc)."""
    if args or kwargs or checkpoint is None or not _resume.streaming():
        return original(checkpoint, *args, **kwargs)
    if _framework_path(trainer) or not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
        return original(checkpoint)
    return _resume_on_host(trainer, original, checkpoint)


def _resume_on_host(trainer: Any, original: Any, checkpoint: str) -> Any:
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        full_file = os.path.isfile(os.path.join(checkpoint, FSDP_OPTIMIZER_FILE))
        sharded_dir = os.path.isdir(os.path.join(checkpoint, FSDP_OPTIMIZER_DIR))
        if getattr(plugin, "fsdp_version", 1) == 2 and (full_file or sharded_dir):
            return _resume_fsdp2(trainer, plugin, checkpoint, original)
        return original(checkpoint)
    path = os.path.join(checkpoint, OPTIMIZER_NAME)
    if not os.path.isfile(path):
        return original(checkpoint)
    check = getattr(_trainer_module, "check_torch_load_is_safe", None)
    if check is not None:
        check()
    state = _resume.host_load(path, mmap=trainer.args.device.type != "cpu")
    trainer.optimizer.load_state_dict(state)
    del state
    _load_scheduler(trainer, checkpoint)
    return None


METHODS = (
    Method(
        "_save_checkpoint",
        "every periodic, best-model, end-of-training and SIGTERM (JIT) checkpoint save",
    ),
    Method(
        "_save_optimizer_and_scheduler",
        "the optimizer save inside _save_checkpoint, for subclasses that call it directly",
        required=False,
    ),
    Method("_tune_save_checkpoint", "Ray Tune trial checkpoints", required=False),
    Method(
        "_load_optimizer_and_scheduler",
        "resume: train(resume_from_checkpoint=...)",
        around=_resume_optimizer_and_scheduler,
    ),
)
# Every Trainer method known (in some Transformers version) to export or load optimizer state.
PLACED_METHODS = tuple(method.name for method in METHODS)


@placing(check_methods(Trainer, METHODS, TRANSFORMERS, what="transformers.Trainer"))
class PlacementTrainerMixin:
    """Runs the Trainer's optimizer saves and its resume inside ``export_placement``.

    Put it before the Trainer class: ``class MyTrainer(PlacementTrainerMixin, Trainer)``. It
    overrides those of :data:`PLACED_METHODS` that the installed ``transformers.Trainer`` has;
    resume reads the checkpoint into host memory as the module docstring describes.

    Attributes:
        optimizer_export_placement: the policy, ``"cpu"`` by default; a ``Placement`` for other
            options (``Placement(device="cpu", conversion="device")``), settable per class or
            per instance. ``None`` runs Transformers' own saves and resume.

    Raises:
        FrameworkMethodError: at import, when the installed Transformers' ``Trainer`` lacks
            ``_save_checkpoint`` or ``_load_optimizer_and_scheduler``.

    Example:
        >>> class MyTrainer(PlacementTrainerMixin, Trainer):  # doctest: +SKIP
        ...     pass
    """

    optimizer_export_placement: PlacementLike = "cpu"


class PlacementTrainer(PlacementTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`PlacementTrainerMixin`: a drop-in replacement."""


def placed_trainer_methods() -> tuple[str, ...]:
    """The methods of :data:`PLACED_METHODS` that the installed ``Trainer`` has (and so wraps)."""
    return tuple(name for name in PLACED_METHODS if callable(getattr(Trainer, name, None)))


def place_trainer(trainer: Any, placement: PlacementLike = "cpu") -> Any:
    """Runs one trainer instance's optimizer saves and resume inside ``export_placement``.

    Wraps the bound methods of :data:`PLACED_METHODS` that ``trainer`` has, on that instance only
    (its class and other trainers are untouched), with the resume behaviour of
    :class:`PlacementTrainerMixin`. Idempotent; calling it again changes the placement. Call it
    before ``trainer.train()`` to cover resume. The wrappers pickle with the trainer. Returns
    ``trainer``.

    Raises:
        ValueError: ``placement`` is not a valid device or ``Placement``.
        FrameworkMethodError: ``trainer`` lacks ``_save_checkpoint`` or
            ``_load_optimizer_and_scheduler``. Nothing is changed in either case.

    Warns:
        RuntimeWarning: ``trainer`` lacks an optional method (that path stays unplaced).

    Example:
        >>> trainer = place_trainer(Trainer(model=model, args=args))  # doctest: +SKIP
    """
    place_methods(
        trainer, METHODS, placement, framework=TRANSFORMERS, what=f"{type(trainer).__qualname__}"
    )
    return trainer


def unplace_trainer(trainer: Any) -> bool:
    """Restores the methods :func:`place_trainer` wrapped; returns False if it had wrapped none."""
    return unplace_methods(trainer)
