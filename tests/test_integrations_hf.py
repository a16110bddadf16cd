"""Hugging Face Trainer integration: a real ``transformers.Trainer`` on a tiny CPU model.

A probe optimizer records ``current_placement()`` at every ``state_dict``, ``load_state_dict``
and ``step``; a callback records it at Trainer events. The tests assert that every checkpoint
export and resume load runs under ``Placement(device="cpu")`` and that nothing else does (the
training steps, the callbacks, accelerate's prepare-time round trip of the empty optimizer). A
plain Trainer is the control: there the same exports run with no policy.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from te_ckpt_placement import Placement, current_placement, export_placement  # noqa: E402
from te_ckpt_placement.integrations import hf  # noqa: E402
from te_ckpt_placement.integrations._methods import placed_methods  # noqa: E402

from .integration_probe import CPU, CallLog, ProbeAdamW, adam_steps  # noqa: E402


class TinyRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        pred = self.lin(x).squeeze(-1)
        out = {"logits": pred}
        if labels is not None:
            out["loss"] = ((pred - labels) ** 2).mean()
        return out


class Recorder(TrainerCallback):
    """Records the policy at the Trainer events around steps and saves."""

    EVENTS = ("on_train_begin", "on_step_begin", "on_step_end", "on_save", "on_train_end")

    def __init__(self, log: CallLog) -> None:
        self.log = log
        for event in self.EVENTS:
            setattr(self, event, self._recorder(event))

    def _recorder(self, event: str) -> Any:
        def hook(args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.log.record(f"cb.{event}")

        return hook


def dataset(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)} for _ in range(n)
    ]


def make_trainer(
    out: Path,
    log: CallLog,
    *,
    cls: type = Trainer,
    max_steps: int = 4,
    save_steps: int = 2,
    callbacks: list[Any] | None = None,
    **args: Any,
) -> Any:
    torch.manual_seed(0)
    model = TinyRegressor()
    optimizer = ProbeAdamW(model.parameters(), log, lr=1e-2)
    training_args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        save_steps=save_steps,
        save_strategy=args.pop("save_strategy", "steps"),
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        **args,
    )
    return cls(
        model=model,
        args=training_args,
        train_dataset=dataset(),
        optimizers=(optimizer, None),
        callbacks=[Recorder(log), *(callbacks or [])],
    )


def assert_only_io_placed(log: CallLog, placement: Placement = CPU) -> None:
    """Every checkpoint export and load ran under ``placement``; every other call under none."""
    for call in (*log.exports(), *log.loads()):
        assert call.placement == placement, call
    for call in log.others():
        assert call.placement is None, call


# --- the control -------------------------------------------------------------------------------


def test_control_plain_trainer_exports_without_policy(tmp_path: Path) -> None:
    log = CallLog()
    make_trainer(tmp_path, log).train()
    exports = log.exports()
    assert len(exports) == 2 and all(c.called_from("_save_checkpoint") for c in exports), exports
    assert [c.placement for c in exports] == [None, None]
    assert len(log.of("step")) == 4


# --- the mixin ---------------------------------------------------------------------------------


def test_mixin_covers_installed_trainer_methods() -> None:
    names = hf.placed_trainer_methods()
    # The save and resume entry points of every supported transformers version.
    assert {"_save_checkpoint", "_load_optimizer_and_scheduler"} <= set(names), names
    assert set(names) <= set(hf.PLACED_METHODS)
    for name in names:
        assert callable(getattr(Trainer, name))
        assert name in vars(hf.PlacementTrainerMixin), name
    for name in set(hf.PLACED_METHODS) - set(names):
        assert name not in vars(hf.PlacementTrainerMixin), name


def test_mixin_save_and_resume(tmp_path: Path) -> None:
    log = CallLog()
    trainer = make_trainer(tmp_path, log, cls=hf.PlacementTrainer)
    trainer.train()
    assert current_placement() is None

    exports = log.exports()
    assert len(exports) == 2, log
    assert all(c.called_from("_save_optimizer_and_scheduler") for c in exports), exports
    assert [c.placement for c in exports] == [CPU, CPU]
    assert len(log.of("step")) == 4
    assert [c.placement for c in log.of("cb.on_save")] == [None, None]  # on_save: after the save
    assert_only_io_placed(log)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]

    # Resume, with another placement set on the instance: the load runs under it.
    log2 = CallLog()
    other = Placement(device="cpu", conversion="device")
    resumed = make_trainer(tmp_path, log2, cls=hf.PlacementTrainer, max_steps=6)
    resumed.optimizer_export_placement = other
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert current_placement() is None

    loads = log2.loads()
    assert len(loads) == 1 and loads[0].called_from("_load_optimizer_and_scheduler"), log2
    assert loads[0].placement == other
    # Resume happens before on_train_begin, which already sees no policy.
    first_begin = log2.index(log2.of("cb.on_train_begin")[0])
    assert log2.index(loads[0]) < first_begin
    assert len(log2.of("step")) == 2  # steps 5 and 6
    assert [c.placement for c in log2.exports()] == [other]  # checkpoint-6
    assert_only_io_placed(log2, other)
    # The load was real: Adam continued from step 4.
    assert adam_steps(resumed.optimizer.optimizer) == {6}


def test_mixin_tune_save_checkpoint(tmp_path: Path) -> None:
    if "_tune_save_checkpoint" not in hf.placed_trainer_methods():
        pytest.skip(f"transformers {transformers.__version__} has no Trainer._tune_save_checkpoint")
    log = CallLog()
    trainer = make_trainer(tmp_path / "run", log, cls=hf.PlacementTrainer, save_strategy="no")
    trainer.train()
    assert log.exports() == []
    trainer._tune_save_checkpoint(checkpoint_dir=str(tmp_path / "tune"))
    exports = log.exports()
    assert len(exports) == 1 and exports[0].called_from("_tune_save_checkpoint"), log
    assert exports[0].placement == CPU
    assert (tmp_path / "tune" / "checkpoint-4" / "optimizer.pt").is_file()
    assert current_placement() is None


class SigtermAtStep(TrainerCallback):
    """Sends SIGTERM at a step and waits until the JIT manager has requested its checkpoint."""

    def __init__(self, trainer: Any, step: int) -> None:
        self.trainer = trainer
        self.step = step
        self.sent = False

    def jit_manager(self) -> Any:
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback

        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, JITCheckpointCallback):
                return cb.jit_manager
        raise AssertionError("no JITCheckpointCallback although enable_jit_checkpoint=True")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.sent or state.global_step != self.step:
            return
        manager = self.jit_manager()
        # Only ever signal ourselves when the JIT handler is the one installed.
        assert signal.getsignal(signal.SIGTERM) == manager._sigterm_handler
        manager.kill_wait = 0
        self.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not manager.is_checkpoint_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.is_checkpoint_requested


def test_mixin_sigterm_jit_checkpoint(tmp_path: Path) -> None:
    if "enable_jit_checkpoint" not in TrainingArguments.__dataclass_fields__:
        pytest.skip(f"transformers {transformers.__version__} has no JIT (SIGTERM) checkpoint")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        log = CallLog()
        trainer = make_trainer(
            tmp_path,
            log,
            cls=hf.PlacementTrainer,
            max_steps=8,
            save_strategy="no",
            enable_jit_checkpoint=True,
        )
        sigterm = SigtermAtStep(trainer, step=2)
        trainer.add_callback(sigterm)
        trainer.train()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sigterm.sent
    exports = log.exports()
    assert len(exports) == 1 and exports[0].called_from("execute_jit_checkpoint"), log
    assert exports[0].placement == CPU
    assert_only_io_placed(log)
    assert len(log.of("step")) < 8  # the JIT checkpoint stopped training
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file()
    assert not (ckpt / "checkpoint-is-incomplete.txt").exists()


# --- the instance form -------------------------------------------------------------------------


def test_place_trainer_save_resume_and_unplace(tmp_path: Path) -> None:
    log = CallLog()
    trainer = make_trainer(tmp_path, log)
    bystander = make_trainer(tmp_path / "other", CallLog())

    def custom(*args: Any, **kwargs: Any) -> None:
        pass

    trainer._tune_save_checkpoint = custom  # someone else's instance attribute

    assert hf.place_trainer(trainer) is trainer
    wrappers = {name: vars(trainer)[name] for name in placed_methods(trainer)}
    assert set(wrappers) == set(hf.placed_trainer_methods())
    hf.place_trainer(trainer)  # idempotent: the same wrappers, not wrappers of wrappers
    assert {name: vars(trainer)[name] for name in placed_methods(trainer)} == wrappers
    assert placed_methods(bystander) == ()
    assert "_save_checkpoint" not in vars(bystander)

    trainer.train()
    assert [c.placement for c in log.exports()] == [CPU, CPU]
    assert_only_io_placed(log)

    log2 = CallLog()
    resumed = hf.place_trainer(make_trainer(tmp_path, log2, max_steps=6))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert [c.placement for c in log2.loads()] == [CPU]
    assert log2.loads()[0].called_from("_load_optimizer_and_scheduler")
    assert adam_steps(resumed.optimizer.optimizer) == {6}
    assert_only_io_placed(log2)

    # Unplace restores exactly what was there: the class's methods, and the custom attribute.
    assert hf.unplace_trainer(trainer)
    assert placed_methods(trainer) == ()
    for name in hf.placed_trainer_methods():
        if name == "_tune_save_checkpoint":
            assert trainer._tune_save_checkpoint is custom
        else:
            assert name not in vars(trainer), name
            assert getattr(trainer, name).__func__ is getattr(Trainer, name), name
    assert not hf.unplace_trainer(trainer)
    # And the policy is gone: a save now exports with none.
    del log[:]
    trainer._save_checkpoint(trainer.model, trial=None)
    assert [c.placement for c in log.exports()] == [None]


def test_place_trainer_rejects_bad_placement(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, CallLog())
    with pytest.raises(ValueError, match="unsupported export device"):
        hf.place_trainer(trainer, "cuda:7")
    assert placed_methods(trainer) == ()


def test_place_trainer_skips_methods_the_version_lacks() -> None:
    class OldTrainer:  # a Trainer of a version without _tune_save_checkpoint
        def _save_checkpoint(self, model: Any, trial: Any) -> Any:
            return current_placement()

        def _load_optimizer_and_scheduler(self, checkpoint: Any) -> Any:
            return current_placement()

    old = hf.place_trainer(OldTrainer())
    assert set(placed_methods(old)) == {"_save_checkpoint", "_load_optimizer_and_scheduler"}
    assert not hasattr(old, "_tune_save_checkpoint")
    assert old._save_checkpoint(None, None) == CPU
    assert old._load_optimizer_and_scheduler("x") == CPU
    assert current_placement() is None


# --- the decorator -----------------------------------------------------------------------------


@export_placement("cpu")
def save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    torch.save(optimizer.state_dict(), path)


@export_placement("cpu")
def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    optimizer.load_state_dict(torch.load(path, weights_only=True))


class CustomSave(TrainerCallback):
    """A user's own optimizer save in ``on_save``: decorated, and undecorated as a control."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs["optimizer"]
        save_optimizer(optimizer, self.out / f"decorated-{state.global_step}.pt")
        torch.save(optimizer.state_dict(), self.out / f"plain-{state.global_step}.pt")


def test_decorator_custom_save_and_load(tmp_path: Path) -> None:
    log = CallLog()
    trainer = make_trainer(tmp_path, log, max_steps=2, callbacks=[CustomSave(tmp_path)])
    trainer.train()
    exports = [c for c in log.exports() if c.called_from("on_save")]
    assert len(exports) == 2, log
    assert [c.called_from("save_optimizer") for c in exports] == [True, False]
    assert [c.placement for c in exports] == [CPU, None]
    assert current_placement() is None

    load_optimizer(trainer.optimizer, tmp_path / "decorated-2.pt")
    assert [c.placement for c in log.loads()] == [CPU]
    assert current_placement() is None
