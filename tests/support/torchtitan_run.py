"""torchtitan 0.3.0's real ``CheckpointManager`` and ``OptimizersContainer`` on CPU ranks (gloo).

The trainer itself (``torchtitan.trainer``, which needs triton and a tokenizer) is not used: each
run builds what ``Trainer.__init__`` hands the checkpointer (model parts under ``fully_shard``,
the container, its ``LRSchedulersContainer``, a train state), and the saves and loads are
torchtitan's ``save``/``load``/``close``. TE's ``FusedAdam`` is the CPU stand-in, built by the
container through the ``TEFusedAdam`` optimizer name. torchtitan's pinned-memory mode makes a
``DefaultStager(StagingOptions(True, True, True, True))``, which needs an accelerator: on CPU only
the placed run of that mode runs (its stager is a ``SnapshotStager``).

:func:`save_phase` and :func:`resume_phase` run in separate spawns: the resume is a fresh process.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from te_ckpt_placement import _te_hooks as te_hooks
from te_ckpt_placement import export_placement

from .dcp_runs import FLAT, set_global_grads
from .distributed import fully_sharded, gather, init_group, param_dtype
from .helpers import bits
from .standin import StandInFusedAdam, storage_kwargs
from .storage import BF16

#: Checkpoint folders: (placed run?, torchtitan's async_mode).
SAVES = {
    "placed_sync": (True, "disabled"),
    "plain_sync": (False, "disabled"),
    "placed_async": (True, "async"),
    "placed_pinned": (True, "async_with_pinned_mem"),
}
#: (checkpoint, placed loader?): the bounded load, and each format direction.
RESUMES = (
    ("placed_sync", True),
    ("placed_sync", False),
    ("plain_sync", True),
    ("placed_async", True),
    ("placed_pinned", True),
)
MASTER = "fp32"
SAVE_STEP = 2


def _factory(name: str) -> Any:
    assert name == "TEFusedAdam", name
    return functools.partial(StandInFusedAdam, **storage_kwargs(moments=BF16, master=MASTER))


def container_class(placed: bool) -> type:
    """The placed container (the ready-made class), or torchtitan's own; both build the
    stand-in for ``"TEFusedAdam"``."""
    from torchtitan.components.optimizer import OptimizersContainer

    from te_ckpt_placement.integrations import torchtitan

    base = torchtitan.PlacementOptimizersContainer if placed else OptimizersContainer
    return type("StandInContainer", (base,), {"_resolve_optimizer_factory": staticmethod(_factory)})


def manager_class(placed: bool) -> type:
    from torchtitan.components.checkpoint import CheckpointManager

    from te_ckpt_placement.integrations import torchtitan

    return torchtitan.PlacementCheckpointManager if placed else CheckpointManager  # type: ignore[no-any-return]


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class TitanRun:
    """What torchtitan's ``Trainer`` gives its ``CheckpointManager``, and a training step."""

    def __init__(self, mesh: Any, folder: Path, *, placed: bool, async_mode: str, seed: int):
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig

        self.model = fully_sharded(mesh, param_dtype(MASTER), seed)
        container = container_class(placed)
        config = container.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=".*", optimizer_name="TEFusedAdam", optimizer_kwargs={"lr": 1e-2}
                )
            ],
            implementation="for-loop",
        )
        self.optimizers = container(config, model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
            optimizers=self.optimizers, training_steps=8
        )
        self.state = TrainState()
        self.checkpointer = manager_class(placed)(
            CheckpointManager.Config(enable=True, folder="ckpt", interval=1, async_mode=async_mode),
            dataloader=None,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.schedulers,
            states={"train_state": self.state},
            sd_adapter=None,
            base_folder=str(folder),
        )

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.state.step += 1
            gen = torch.Generator().manual_seed(100 + self.state.step)  # the same on every run
            params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
            set_global_grads(params, gen)
            self.checkpointer.maybe_wait_for_staging()  # torchtitan's train_step does this
            self.optimizers.step()
            self.optimizers.zero_grad()
            self.schedulers.step()

    def steps(self) -> list[Any]:
        return [g["step"] for o in self.optimizers for g in o.param_groups]

    def full(self) -> dict[str, Any]:
        """Global weights and TE's own export (no policy), as bits: what a checkpoint must hold."""
        out: dict[str, Any] = {}
        with export_placement(None):
            export = get_optimizer_state_dict(self.model, list(self.optimizers), options=FLAT)
        weights = {k: v.detach() for k, v in self.model.state_dict().items()}
        for key, value in {**weights, **export}.items():
            if isinstance(value, DTensor):
                value = gather(value)
            out[key] = bits(value).clone() if isinstance(value, torch.Tensor) else value
        out["lr"] = [g["lr"] for o in self.optimizers for g in o.param_groups]
        return out


def _rank_setup(rank: int, port: int, world: int) -> Any:
    init_group(rank, port, backend="gloo", timeout_s=120, world_size=world)
    te_hooks.patch_class(StandInFusedAdam)
    return init_device_mesh("cpu", (world,))


def _record(tmp: Path, name: str, value: Any) -> None:
    if dist.get_rank() == 0:
        torch.save(value, tmp / f"{name}.pt")


def save_phase(rank: int, port: int, world: int, tmp: Path, out: Any) -> None:
    """Each of :data:`SAVES`: train, save at step 2 (training goes on during an async save),
    one more step; records TE's export at the save point and after the next step."""
    mesh = _rank_setup(rank, port, world)
    for name, (placed, mode) in SAVES.items():
        run = TitanRun(mesh, tmp / name, placed=placed, async_mode=mode, seed=0)
        run.train(SAVE_STEP)
        _record(tmp, f"{name}_at_save", run.full())
        try:
            assert run.checkpointer.save(curr_step=SAVE_STEP)
            run.train(1)  # during the async write
            run.checkpointer.maybe_wait_for_saving()
        except Exception as exc:  # reported to the test, which decides
            if rank == 0:
                out[name] = f"{type(exc).__name__}: {exc}"
            dist.barrier()
            continue
        stager = run.checkpointer.stager
        report = getattr(stager, "last_report", None)
        run.checkpointer.close()
        if rank == 0:
            details = dict(report.details) if report is not None else None
            out[name] = (type(stager).__name__, details)
        _record(tmp, f"{name}_after", run.full())
    dist.destroy_process_group()


def resume_phase(rank: int, port: int, world: int, tmp: Path, results: Any) -> None:
    """A fresh process: each of :data:`RESUMES` loads (counting optimizer steps during the
    load), then trains one step; a fresh run in an empty folder starts at step 1."""
    mesh = _rank_setup(rank, port, world)
    for saved, placed in RESUMES:
        if not (tmp / saved / "ckpt" / f"step-{SAVE_STEP}" / ".metadata").exists():
            continue  # the save failed (save_phase reported it)
        run = TitanRun(mesh, tmp / saved, placed=placed, async_mode="disabled", seed=7)
        calls: list[int] = []
        count = functools.partial(lambda calls, *_: calls.append(1), calls)
        hooks = [o.register_step_pre_hook(count) for o in run.optimizers]
        assert run.checkpointer.load()
        for hook in hooks:
            hook.remove()
        loaded, steps, train_step = run.full(), run.steps(), run.state.step
        run.train(1)
        continued = run.full()
        run.checkpointer.close()
        if rank == 0:
            results[(saved, placed)] = (loaded, steps, len(calls), train_step, continued)
    for placed in (True, False):
        run = TitanRun(mesh, tmp / f"fresh_{placed}", placed=placed, async_mode="disabled", seed=0)
        found = run.checkpointer.load()
        had_state = any(bool(o.state) for o in run.optimizers)
        run.train(1)
        full = run.full()  # a collective: every rank
        run.checkpointer.close()
        if rank == 0:
            results[("fresh", placed)] = (found, had_state, run.steps(), full)
    dist.destroy_process_group()


def spawn_phase(phase: Any, world: int, tmp: Path) -> dict[Any, Any]:
    """Runs ``phase`` on ``world`` fresh ranks; returns what rank 0 put in its dict."""
    from .distributed import spawn_collecting

    return spawn_collecting(phase, world, tmp)
