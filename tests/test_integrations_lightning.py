"""Lightning integration: a real ``lightning.Trainer`` and ``Fabric`` on a tiny CPU model.

A probe optimizer records ``current_placement()`` at every ``state_dict``, ``load_state_dict``
and ``step``; the module and a callback record it at hooks. The tests assert that every
checkpoint export and resume load runs under ``Placement(device="cpu")`` and nothing else does,
that the callback's wrappers exist exactly between ``setup`` and ``teardown`` on that trainer's
strategy only, and that teardown restores the original methods. A Trainer without the callback
is the control: there the same exports run with no policy.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402

from te_ckpt_placement import Placement, current_placement, export_placement  # noqa: E402
from te_ckpt_placement.integrations import lightning as tl  # noqa: E402
from te_ckpt_placement.integrations._methods import methods_owner, placed_methods  # noqa: E402

from .integration_probe import CPU, CallLog, ProbeAdamW, adam_steps  # noqa: E402

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
