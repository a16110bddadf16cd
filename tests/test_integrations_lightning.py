"""Lightning integration: a real ``lightning.Trainer`` and ``Fabric`` on a tiny CPU model.

A probe optimizer records ``current_placement()`` at every ``state_dict``, ``load_state_dict``
and ``step``; the module and a callback record it at hooks. The tests assert that every
checkpoint export and resume load runs under ``Placement(device="cpu")`` and nothing else does,
that the callback's wrappers exist exactly between ``setup`` and ``teardown`` on that trainer's
strategy only, and that teardown restores the original methods. A Trainer without the callback
is the control: there the same exports run with no policy.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import (  # noqa: E402
    SingleDeviceStrategy as FabricSingleDeviceStrategy,
)
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402

from te_ckpt_placement import Placement, current_placement, export_placement  # noqa: E402
from te_ckpt_placement.integrations import FrameworkMethodError  # noqa: E402
from te_ckpt_placement.integrations import lightning as tl  # noqa: E402
from te_ckpt_placement.integrations._methods import methods_owner, placed_methods  # noqa: E402

from .support.integration_probe import CPU, CallLog, ProbeAdamW, adam_steps  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)

# The strategy methods that a Trainer strategy (SingleDeviceStrategy) has.
TRAINER_METHODS = (
    "optimizer_state",
    "save_checkpoint",
    "load_optimizer_state_dict",
    "load_checkpoint",
)


class TinyModule(pl.LightningModule):
    def __init__(self, log: CallLog, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.probe_log = log
        self.fail_at_step = fail_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.probe_log.record("training_step")
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError("injected failure")
        x, y = batch
        return ((self.lin(x).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return ProbeAdamW(self.parameters(), self.probe_log, lr=1e-2)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.probe_log.record("module.on_save_checkpoint")

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, generator=g))
        return DataLoader(data, batch_size=2)


class Recorder(pl.Callback):
    """Records the policy at hooks, and which strategies are placed during fit."""

    def __init__(self, log: CallLog, watch: tuple[Any, ...] = ()) -> None:
        self.probe_log = log  # not `log`: Lightning sets callback.log to LightningModule.log
        self.watch = watch
        self.placed_during_fit: list[tuple[str, ...]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.probe_log.record("cb.on_train_start")
        self.placed_during_fit = [placed_methods(t.strategy) for t in self.watch]

    def on_train_batch_end(self, *args: Any) -> None:
        self.probe_log.record("cb.on_train_batch_end")

    def on_save_checkpoint(self, *args: Any) -> None:
        self.probe_log.record("cb.on_save_checkpoint")


def make_trainer(
    out: Path,
    log: CallLog,
    *,
    max_steps: int = 4,
    callbacks: list[Any] | None = None,
    every: int = 2,
    **kwargs: Any,
) -> Any:
    checkpoint = ModelCheckpoint(
        dirpath=out, filename="{step}", every_n_train_steps=every, save_top_k=-1
    )
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[Recorder(log), checkpoint, *(callbacks or [])],
        **kwargs,
    )


def fit(trainer: Any, log: CallLog, ckpt_path: Path | None = None, **module_kwargs: Any) -> Any:
    torch.manual_seed(0)
    module = TinyModule(log, **module_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return module


def assert_only_io_placed(log: CallLog, placement: Placement = CPU) -> None:
    """Every checkpoint export and load ran under ``placement``; every other call under none."""
    for call in (*log.exports(), *log.loads()):
        assert call.placement == placement, call
    for call in log.others():
        assert call.placement is None, call


def assert_unplaced(strategy: Any) -> None:
    assert placed_methods(strategy) == ()
    for name in TRAINER_METHODS:
        assert name not in vars(strategy), name
        assert getattr(strategy, name).__func__ is getattr(type(strategy), name), name


# --- the control -------------------------------------------------------------------------------


def test_control_trainer_exports_without_policy(tmp_path: Path) -> None:
    log = CallLog()
    fit(make_trainer(tmp_path, log), log)
    exports = log.exports()
    assert len(exports) == 2 and all(c.called_from("optimizer_state") for c in exports), log
    assert [c.placement for c in exports] == [None, None]
    assert len(log.of("step")) == 4


# --- the callback ------------------------------------------------------------------------------


def test_callback_save_and_resume(tmp_path: Path) -> None:
    log = CallLog()
    callback = tl.PlacementCallback()
    trainer = make_trainer(tmp_path, log, callbacks=[callback])
    recorder = trainer.callbacks[0]
    recorder.watch = (trainer,)
    strategy = trainer.strategy
    original = strategy.optimizer_state
    assert_unplaced(strategy)

    fit(trainer, log)
    assert current_placement() is None
    # Installed during fit, on this strategy, by this callback; removed at teardown.
    assert recorder.placed_during_fit == [TRAINER_METHODS]
    assert_unplaced(strategy)
    assert strategy.optimizer_state == original

    exports = log.exports()
    assert len(exports) == 2 and all(c.called_from("dump_checkpoint") for c in exports), log
    assert [c.placement for c in exports] == [CPU, CPU]
    assert len(log.of("step")) == 4 and len(log.of("training_step")) == 4
    # The save hooks run after the export, outside the policy.
    assert [c.placement for c in log.of("cb.on_save_checkpoint")] == [None, None]
    assert [c.placement for c in log.of("module.on_save_checkpoint")] == [None, None]
    assert_only_io_placed(log)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=4.ckpt"]

    # Resume from step 4 to step 6.
    log2 = CallLog()
    resumed = make_trainer(tmp_path / "resumed", log2, max_steps=6, callbacks=[callback])
    module = fit(resumed, log2, ckpt_path=tmp_path / "step=4.ckpt")
    loads = log2.loads()
    assert len(loads) == 1 and loads[0].called_from("load_optimizer_state_dict"), log2
    assert loads[0].placement == CPU
    assert log2.index(loads[0]) < log2.index(log2.of("cb.on_train_start")[0])
    assert len(log2.of("step")) == 2
    assert [c.placement for c in log2.exports()] == [CPU]  # step=6
    assert_only_io_placed(log2)
    assert adam_steps(module.optimizers().optimizer) == {6}
    assert_unplaced(resumed.strategy)
    assert current_placement() is None


def test_callback_setup_is_idempotent_and_teardown_exact(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, CallLog())
    strategy = trainer.strategy
    callback = tl.PlacementCallback()
    callback.setup(trainer, None, "fit")
    wrappers = {name: vars(strategy)[name] for name in TRAINER_METHODS}
    callback.setup(trainer, None, "fit")  # again: the same wrappers, not wrappers of wrappers
    assert {name: vars(strategy)[name] for name in TRAINER_METHODS} == wrappers
    assert methods_owner(strategy) is callback

    # A second callback neither takes over nor removes the first one's wrappers.
    other = tl.PlacementCallback(Placement(device="cpu", conversion="device"))
    other.setup(trainer, None, "fit")
    other.teardown(trainer, None, "fit")
    assert {name: vars(strategy)[name] for name in TRAINER_METHODS} == wrappers

    callback.teardown(trainer, None, "fit")
    assert_unplaced(strategy)
    callback.teardown(trainer, None, "fit")  # again: nothing to do
    assert_unplaced(strategy)

    with pytest.raises(ValueError, match="unsupported export device"):
        tl.PlacementCallback("cuda:7")


def test_callback_two_trainers(tmp_path: Path) -> None:
    callback = tl.PlacementCallback()
    log_a, log_b = CallLog(), CallLog()
    trainer_a = make_trainer(tmp_path / "a", log_a, callbacks=[callback])
    trainer_b = make_trainer(tmp_path / "b", log_b, callbacks=[callback])
    trainer_a.callbacks[0].watch = trainer_b.callbacks[0].watch = (trainer_a, trainer_b)

    # Someone else's instance attribute on B's strategy: wrapped during fit, restored after.
    custom_calls = CallLog()

    def custom_optimizer_state(optimizer: Any) -> Any:
        custom_calls.record("custom_optimizer_state")
        return type(trainer_b.strategy).optimizer_state(trainer_b.strategy, optimizer)

    trainer_b.strategy.optimizer_state = custom_optimizer_state

    fit(trainer_a, log_a)
    placed_a, placed_b = trainer_a.callbacks[0].placed_during_fit
    assert placed_a and placed_b == (), (placed_a, placed_b)
    assert_unplaced(trainer_a.strategy)
    assert trainer_b.strategy.optimizer_state is custom_optimizer_state

    fit(trainer_b, log_b)
    placed_a, placed_b = trainer_b.callbacks[0].placed_during_fit
    assert placed_a == () and placed_b, (placed_a, placed_b)
    assert trainer_b.strategy.optimizer_state is custom_optimizer_state
    assert placed_methods(trainer_b.strategy) == ()

    for log in (log_a, log_b):
        assert [c.placement for c in log.exports()] == [CPU, CPU]
        assert_only_io_placed(log)
    assert [c.placement for c in custom_calls] == [CPU, CPU]


def test_callback_covers_on_exception_checkpoint(tmp_path: Path) -> None:
    log = CallLog()
    callback = tl.PlacementCallback()
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")
    trainer = make_trainer(
        tmp_path, log, max_steps=8, every=100, callbacks=[callback, on_exception]
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        fit(trainer, log, fail_at_step=3)
    assert current_placement() is None
    exports = log.exports()
    assert len(exports) == 1 and exports[0].called_from("on_exception"), log
    assert exports[0].placement == CPU
    assert_only_io_placed(log)
    assert (tmp_path / "on_exception.ckpt").is_file()
    # teardown never ran: the wrappers stay until the callback's next teardown.
    assert methods_owner(trainer.strategy) is callback
    callback.teardown(trainer, None, "fit")
    assert_unplaced(trainer.strategy)


# --- the strategy mixin ------------------------------------------------------------------------


class PlacementSingleDevice(tl.PlacementStrategyMixin, SingleDeviceStrategy):
    pass


def test_strategy_mixin_save_resume_and_manual_save(tmp_path: Path) -> None:
    log = CallLog()
    trainer = make_trainer(tmp_path, log, strategy=PlacementSingleDevice(device="cpu"))
    fit(trainer, log)
    trainer.save_checkpoint(tmp_path / "manual.ckpt")  # after fit: still covered
    exports = log.exports()
    assert len(exports) == 3 and exports[-1].called_from("save_checkpoint"), log
    assert [c.placement for c in exports] == [CPU, CPU, CPU]
    assert_only_io_placed(log)

    log2 = CallLog()
    strategy = PlacementSingleDevice(device="cpu")
    strategy.optimizer_export_placement = Placement(device="cpu", conversion="device")
    resumed = make_trainer(tmp_path / "resumed", log2, max_steps=6, strategy=strategy)
    fit(resumed, log2, ckpt_path=tmp_path / "manual.ckpt")
    assert [c.placement for c in log2.loads()] == [strategy.optimizer_export_placement]
    assert_only_io_placed(log2, strategy.optimizer_export_placement)
    assert current_placement() is None


# --- Fabric ------------------------------------------------------------------------------------


def fabric_run(log: CallLog, steps: int = 3) -> tuple[Any, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, ProbeAdamW(model.parameters(), log, lr=1e-2))
    for _ in range(steps):
        loss = model(torch.randn(2, 4)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return fabric, model, optimizer


@export_placement("cpu")
def fabric_load(fabric: Any, path: Path, state: dict[str, Any]) -> None:
    fabric.load(path, state)


def test_fabric_context_manager_and_decorator(tmp_path: Path) -> None:
    log = CallLog()
    fabric, model, optimizer = fabric_run(log)
    state = {"model": model, "optimizer": optimizer}
    with export_placement("cpu"):
        fabric.save(tmp_path / "placed.ckpt", state)
    fabric.save(tmp_path / "plain.ckpt", state)  # the control
    assert [c.placement for c in log.exports()] == [CPU, None]

    fabric_load(fabric, tmp_path / "placed.ckpt", state)
    assert [c.placement for c in log.loads()] == [CPU]
    assert adam_steps(optimizer.optimizer) == {3}
    assert len(log.of("step")) == 3
    assert all(c.placement is None for c in log.of("step"))
    assert current_placement() is None


def test_fabric_place_strategy(tmp_path: Path) -> None:
    log = CallLog()
    fabric, model, optimizer = fabric_run(log, steps=2)
    state = {"model": model, "optimizer": optimizer}
    assert tl.place_strategy(fabric.strategy) is fabric.strategy
    placed = set(placed_methods(fabric.strategy))
    assert placed == {"get_optimizer_state", "save_checkpoint", "load_checkpoint"}
    fabric.save(tmp_path / "a.ckpt", state)
    optimizer.state_dict()  # the Fabric optimizer's own export goes through the strategy too
    fabric.load(tmp_path / "a.ckpt", state)
    assert [c.placement for c in log.exports()] == [CPU, CPU]
    assert [c.placement for c in log.loads()] == [CPU]

    assert tl.unplace_strategy(fabric.strategy)
    assert placed_methods(fabric.strategy) == ()
    assert "get_optimizer_state" not in vars(fabric.strategy)
    fabric.save(tmp_path / "b.ckpt", state)
    assert log.exports()[-1].placement is None
    assert_only_io_placed(CallLog(log[:-1]))


def test_pytorch_lightning_build(tmp_path: Path) -> None:
    ptl = pytest.importorskip("pytorch_lightning")
    from te_ckpt_placement.integrations import pytorch_lightning as tpl

    callback = tpl.PlacementCallback()
    assert isinstance(callback, ptl.Callback) and not isinstance(callback, pl.Callback)
    assert not isinstance(tl.PlacementCallback(), ptl.Callback)
    trainer = ptl.Trainer(
        accelerator="cpu", devices=1, logger=False, callbacks=[callback], default_root_dir=tmp_path
    )
    assert callback in trainer.callbacks
    callback.setup(trainer, None, "fit")
    assert set(placed_methods(trainer.strategy)) == set(TRAINER_METHODS)
    callback.teardown(trainer, None, "fit")
    assert_unplaced(trainer.strategy)


# --- pickling: ddp_spawn ------------------------------------------------------------------------


class SpawnModule(TinyModule):
    """Writes, per rank, the policy of every checkpoint export and load it saw."""

    def __init__(self, log: CallLog, out: str, tag: str) -> None:
        super().__init__(log)
        self.out = out
        self.tag = tag

    def on_fit_end(self) -> None:
        record = {
            "exports": [repr(c.placement) for c in self.probe_log.exports()],
            "loads": [repr(c.placement) for c in self.probe_log.loads()],
            "steps": [repr(c.placement) for c in self.probe_log.of("step")],
        }
        Path(self.out, f"{self.tag}-rank{self.global_rank}.json").write_text(json.dumps(record))


def spawn_fit(out: Path, tag: str, ckpt_path: Path | None, max_steps: int) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[
            ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=2, save_top_k=-1)
        ],
    )
    tl.place_strategy(trainer.strategy)  # before fit: the spawn pickles the placed strategy
    torch.manual_seed(0)
    module = SpawnModule(CallLog(), str(out), tag)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=None if ckpt_path is None else str(ckpt_path))


def test_place_strategy_survives_ddp_spawn(tmp_path: Path) -> None:
    spawn_fit(tmp_path, "fit", None, max_steps=2)
    spawn_fit(tmp_path, "resume", tmp_path / "step=2.ckpt", max_steps=3)
    cpu = repr(CPU)
    for rank in range(2):
        fit = json.loads((tmp_path / f"fit-rank{rank}.json").read_text())
        assert fit["exports"] == [cpu], fit  # Lightning exports on every rank
        assert fit["steps"] == [repr(None)] * 2
        resume = json.loads((tmp_path / f"resume-rank{rank}.json").read_text())
        assert resume["loads"] == [cpu], resume
        assert resume["steps"] == [repr(None)]


# --- resume reads the checkpoint into host memory -----------------------------------------------


def test_callback_resume_reads_checkpoint_into_host_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's TorchCheckpointIO keeps each tensor on the device it was saved from (the model
    # weights, and a TE export made without the policy, come back onto the GPU until
    # resume_end). Under the callback the file is read with map_location="cpu".
    fit(make_trainer(tmp_path, CallLog(), callbacks=[tl.PlacementCallback()]), CallLog())
    requests: list[Any] = []
    real_load = torch.load

    def spy(f: Any, *args: Any, **kwargs: Any) -> Any:
        requests.append((kwargs.get("map_location"), kwargs.get("mmap")))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    for callbacks, expected in (([], None), ([tl.PlacementCallback()], "cpu")):
        del requests[:]
        log = CallLog()
        trainer = make_trainer(tmp_path / "r", log, max_steps=6, callbacks=callbacks)
        module = fit(trainer, log, ckpt_path=tmp_path / "step=4.ckpt")
        assert len(requests) == 1, requests
        if expected is None:  # the control: Lightning's own identity map_location
            assert callable(requests[0][0])
        else:
            assert requests[0][0] == "cpu"
            assert not requests[0][1]  # memory-mapped only for a GPU root device
        assert adam_steps(module.optimizers().optimizer) == {6}
    strategy = trainer.strategy
    assert "load_checkpoint" not in vars(strategy.checkpoint_io)  # restored after the read


def test_host_reads_map_files_for_gpu_training_and_unwrap_async_io(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from te_ckpt_placement.integrations._lightning import _reading_to_host, _stock_torch_io

    path = tmp_path / "c.ckpt"
    torch.save({"w": torch.arange(6.0)}, path)
    strategy = SingleDeviceStrategy(device="cpu")
    assert type(_stock_torch_io(strategy)) is TorchCheckpointIO
    strategy.checkpoint_io = AsyncCheckpointIO()
    io = _stock_torch_io(strategy)
    assert type(io) is TorchCheckpointIO and io is strategy.checkpoint_io.checkpoint_io
    with _reading_to_host(io, mmap=True):
        loaded = strategy.checkpoint_io.load_checkpoint(path)
    assert torch.equal(loaded["w"], torch.arange(6.0))
    # mmap'd: the tensor's storage is a view of the file, not fresh memory.
    assert loaded["w"].untyped_storage().nbytes() <= path.stat().st_size
    assert "load_checkpoint" not in vars(io)

    class Custom(TorchCheckpointIO):
        def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            return super().load_checkpoint(*args, **kwargs)

    strategy.checkpoint_io = Custom()
    assert _stock_torch_io(strategy) is None  # a user's own IO is left alone


# --- Fabric: the optimizer's own load, and the strategy mixin ------------------------------------


def test_fabric_optimizer_load_state_dict_is_placed(tmp_path: Path) -> None:
    log = CallLog()
    fabric, _, optimizer = fabric_run(log, steps=2)
    state = optimizer.state_dict()  # unplaced strategy: the control
    optimizer.load_state_dict(state)
    tl.place_strategy(fabric.strategy)
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)  # calls the raw optimizer, bypassing the strategy
    assert [c.placement for c in log.exports()] == [None, CPU]
    assert [c.placement for c in log.loads()] == [None, CPU]
    assert tl.strategy_placement(fabric.strategy) == CPU
    tl.unplace_strategy(fabric.strategy)
    optimizer.load_state_dict(state)
    assert log.loads()[-1].placement is None
    assert current_placement() is None


class PlacementFabricSingle(tl.PlacementStrategyMixin, FabricSingleDeviceStrategy):
    pass


def test_strategy_mixin_on_fabric_places_optimizer_state_dict(tmp_path: Path) -> None:
    log = CallLog()
    fabric = Fabric(strategy=PlacementFabricSingle(device=torch.device("cpu")))
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, ProbeAdamW(model.parameters(), log, lr=1e-2))
    fabric.backward(model(torch.randn(2, 4)).square().mean())
    optimizer.step()
    state = {"model": model, "optimizer": optimizer}
    fabric.save(tmp_path / "a.ckpt", state)
    exported = optimizer.state_dict()  # through the strategy's get_optimizer_state
    optimizer.load_state_dict(exported)
    fabric.load(tmp_path / "a.ckpt", state)
    assert [c.placement for c in log.exports()] == [CPU, CPU]
    assert [c.placement for c in log.loads()] == [CPU, CPU]
    assert [c.placement for c in log.of("step")] == [None]
    assert current_placement() is None


def test_strategy_missing_a_method_is_an_error() -> None:
    class Renamed(SingleDeviceStrategy):  # a release that renamed the resume method
        load_optimizer_state_dict = None  # type: ignore[assignment]

    with pytest.raises(FrameworkMethodError) as info:

        class Placed(tl.PlacementStrategyMixin, Renamed):
            pass

    message = str(info.value)
    assert "load_optimizer_state_dict (resume" in message
    assert "Lightning" in message and pl.__version__ in message
    strategy = Renamed(device="cpu")
    with pytest.raises(FrameworkMethodError, match="load_optimizer_state_dict"):
        tl.place_strategy(strategy)
    assert placed_methods(strategy) == ()
    with pytest.raises(TypeError, match="Lightning Trainer strategy"):
        tl.place_strategy(object())


def test_state_dict_api_strategies_get_te_states_before_loading(tmp_path: Path) -> None:
    # FSDP/ModelParallel load_checkpoint runs torch's get/set_optimizer_state_dict, whose fake
    # step on a fresh optimizer puts zero gradients for every parameter on the GPU.
    from .support.standin import make_optimizer

    class ModelParallelStrategy(FabricSingleDeviceStrategy):  # named like Lightning's
        pass

    model = nn.Linear(4, 3)
    optimizer = make_optimizer(model.parameters())
    torch.save({"step": 1}, tmp_path / "c.ckpt")
    strategy = ModelParallelStrategy(device=torch.device("cpu"))
    seen: list[int] = []
    real = strategy.checkpoint_io.load_checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(len(optimizer.state))
        return real(*args, **kwargs)

    strategy.checkpoint_io.load_checkpoint = spy  # a user's own load: left alone
    strategy.load_checkpoint(tmp_path / "c.ckpt", state={"optimizer": optimizer}, strict=False)
    tl.place_strategy(strategy)
    strategy.load_checkpoint(tmp_path / "c.ckpt", state={"optimizer": optimizer}, strict=False)
    assert seen == [0, 2]  # no states before; TE's initial states before the placed read
