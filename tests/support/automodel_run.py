"""NeMo Automodel's real ``BaseRecipe`` and ``Checkpointer`` on CPU ranks (gloo), stand-in hooked.

Automodel's LLM recipe ``setup()`` calls ``torch.cuda``, so :class:`MinimalRecipe` sets up what
``BaseRecipe.save_checkpoint``/``load_checkpoint`` read (a model, ``[optimizer]``, ``[scheduler]``,
a config, a ``Checkpointer``) itself, and everything after that is Automodel's code.
``DefaultStager()`` needs an accelerator (its non-blocking copies), so on CPU the unplaced async
runs build it without pinned memory and non-blocking copies (:func:`cpu_default_stager`).

:func:`save_phase` and :func:`resume_phase` run in separate spawns: the resume is a fresh process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from te_ckpt_placement import _te_hooks as te_hooks
from te_ckpt_placement import export_placement

from .backends import CPU
from .dcp_runs import FLAT, Run
from .distributed import gather, init_group
from .helpers import bits
from .standin import StandInFusedAdam
from .storage import BF16

#: Checkpoint directories: who saved it and how.
SAVES = {
    "placed_sync": (True, False),
    "plain_sync": (False, False),
    "placed_async": (True, True),
}
#: (checkpoint, placed loader?): the bounded load, and each format direction.
RESUMES = (("placed_sync", True), ("placed_sync", False), ("plain_sync", True))
#: The process-based async save, resumed by the placed recipe (when the save completed).
ASYNC_RESUME = ("placed_async", True)
MASTER = "fp32"
SAVE_STEP = 2
#: Where the placed recipe's checkpointer keeps the run's SnapshotStager.
STAGER = "_te_ckpt_placement_stager"


def cpu_default_stager(*_: Any, **__: Any) -> Any:
    """torch's ``DefaultStager`` with the options a CPU runs (no pinned or shared memory, no
    non-blocking copies; staging in the background as by default, so Automodel gets the
    ``AsyncSaveResponse`` it waits on); Automodel's ``DefaultStager()`` asserts an accelerator."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )


def _rank_setup(rank: int, port: int, world: int) -> Any:
    init_group(rank, port, backend="gloo", timeout_s=120, world_size=world)
    te_hooks.patch_class(StandInFusedAdam)
    from nemo_automodel.components.checkpoint import checkpointing

    checkpointing.DefaultStager = cpu_default_stager  # the module-level name Automodel calls
    return init_device_mesh("cpu", (world,))


def recipe_class(placed: bool) -> type:
    from nemo_automodel.recipes.base_recipe import BaseRecipe

    from te_ckpt_placement.integrations import automodel

    class MinimalRecipe(BaseRecipe):  # type: ignore[misc]
        def __init__(self, checkpoint_dir: Path, run: Run, *, is_async: bool) -> None:
            from nemo_automodel.components.checkpoint.checkpointing import (
                Checkpointer,
                CheckpointingConfig,
            )
            from nemo_automodel.components.config.loader import ConfigNode
            from nemo_automodel.components.optim.scheduler import OptimizerParamScheduler

            self.run = run  # not tracked by BaseRecipe (not a model, optimizer or Stateful)
            self.model = run.model
            self.optimizer = [run.opt]
            self.lr_scheduler = [
                OptimizerParamScheduler(
                    run.opt,
                    init_lr=1e-3,
                    max_lr=1e-2,
                    min_lr=1e-3,
                    lr_warmup_steps=1,
                    lr_decay_steps=8,
                    lr_decay_style="cosine",
                    start_wd=0.0,
                    end_wd=0.0,
                    wd_incr_steps=8,
                    wd_incr_style="constant",
                )
            ]
            self.cfg = ConfigNode({"recipe": "MinimalRecipe"})
            self.peft_config = None
            config = CheckpointingConfig(
                checkpoint_dir=str(checkpoint_dir),
                model_save_format="torch_save",
                save_consolidated=False,
                is_async=is_async,
                model_repo_id=None,
                model_cache_dir=None,
                is_peft=False,
            )
            self.checkpointer = Checkpointer(config, dp_rank=dist.get_rank(), tp_rank=0, pp_rank=0)

        def train(self, steps: int, seed: int) -> None:
            for _ in range(steps):
                self.run.train(1, seed)
                self.lr_scheduler[0].step(1)
                seed += 1

    return automodel.placement_recipe(MinimalRecipe) if placed else MinimalRecipe


def te_full(run: Run) -> dict[str, Any]:
    """Global weights and TE's own export (no policy), as bits: what a checkpoint must hold."""
    out: dict[str, Any] = {}
    with export_placement(None):
        export = get_optimizer_state_dict(run.model, run.opt, options=FLAT)
    weights = {k: v.detach() for k, v in run.model.state_dict().items()}
    for key, value in {**weights, **export}.items():
        if isinstance(value, DTensor):
            value = gather(value)
        out[key] = bits(value).clone() if isinstance(value, torch.Tensor) else value
    return out


def _record(tmp: Path, name: str, value: Any) -> None:
    if dist.get_rank() == 0:
        torch.save(value, tmp / f"{name}.pt")


def save_phase(rank: int, port: int, world: int, tmp: Path, failures: Any) -> None:
    """Each of :data:`SAVES`: train, save at step 2 (training goes on during an async save),
    one more step; records TE's export at the save point and after the next step."""
    mesh = _rank_setup(rank, port, world)
    for name, (placed, is_async) in SAVES.items():
        run = Run(CPU, mesh, BF16, MASTER, seed=0)
        recipe = recipe_class(placed)(tmp / name, run, is_async=is_async)
        recipe.load_checkpoint()  # the recipe's setup: nothing to load in a fresh directory
        stager = getattr(recipe.checkpointer, STAGER, None)
        prewarmed = None if stager is None else stager.buffer_bytes
        recipe.train(SAVE_STEP, seed=1)
        _record(tmp, f"{name}_at_save", te_full(run))
        try:
            recipe.save_checkpoint(epoch=0, step=SAVE_STEP, train_loss=0.0)
            stager = getattr(recipe.checkpointer, STAGER, None)
            staged = None if stager is None or stager.last_report is None else stager.last_report
            _record(
                tmp,
                f"{name}_stager",
                {
                    "prewarmed_bytes": prewarmed,
                    "buffer_bytes": None if stager is None else stager.buffer_bytes,
                    "allocated_at_save": None
                    if staged is None
                    else staged.details.get("allocated_bytes"),
                },
            )
            recipe.train(1, seed=1 + SAVE_STEP)  # during the async write
            recipe.checkpointer.async_wait()
            recipe.checkpointer.lifecycle.complete_pending()
        except Exception as exc:  # reported to the test, which decides
            if rank == 0:
                failures[name] = f"{type(exc).__name__}: {exc}"
            recipe.checkpointer._optim_ctx.future = None  # the failed save, reported above
            recipe._finalize_and_close_checkpointer()
            dist.barrier()
            continue
        recipe._finalize_and_close_checkpointer()
        if placed and is_async:
            stager = getattr(recipe.checkpointer, STAGER, None)
            assert stager is None, "close() frees the run's stager"
        _record(tmp, f"{name}_after", te_full(run))
    dist.destroy_process_group()


def resume_phase(rank: int, port: int, world: int, tmp: Path, results: Any) -> None:
    """A fresh process: each of :data:`RESUMES` loads, then trains one step; a fresh run in an
    empty directory starts at step 1."""
    mesh = _rank_setup(rank, port, world)
    for saved, placed in (*RESUMES, ASYNC_RESUME):
        if not (tmp / saved / f"epoch_0_step_{SAVE_STEP}" / "optim" / ".metadata").exists():
            continue  # the save failed (save_phase reported it)
        run = Run(CPU, mesh, BF16, MASTER, seed=7)  # other weights: the load must set them
        recipe = recipe_class(placed)(tmp / saved, run, is_async=False)
        recipe.load_checkpoint(restore_from=str(tmp / saved / f"epoch_0_step_{SAVE_STEP}"))
        loaded = te_full(run)
        steps = [g["step"] for g in run.opt.param_groups]
        recipe.train(1, seed=1 + SAVE_STEP)
        continued = te_full(run)
        recipe._finalize_and_close_checkpointer()
        if rank == 0:
            results[(saved, placed)] = (loaded, steps, continued)
    # A fresh run: load_checkpoint finds nothing, training starts at step 1.
    for placed in (True, False):
        run = Run(CPU, mesh, BF16, MASTER, seed=0)
        empty = tmp / f"fresh_{placed}"
        recipe = recipe_class(placed)(empty, run, is_async=False)
        recipe.load_checkpoint()
        had_state = bool(run.opt.state)
        recipe.train(1, seed=1)
        recipe._finalize_and_close_checkpointer()
        full = te_full(run)  # a collective: every rank
        if rank == 0:
            results[("fresh", placed)] = (
                had_state,
                [g["step"] for g in run.opt.param_groups],
                full,
            )
    dist.destroy_process_group()


def spawn_phase(phase: Any, world: int, tmp: Path) -> dict[Any, Any]:
    """Runs ``phase`` on ``world`` fresh ranks; returns what rank 0 put in its dict."""
    from .distributed import spawn_collecting

    return spawn_collecting(phase, world, tmp)
