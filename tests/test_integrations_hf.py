"""Hugging Face Trainer integration: a real ``transformers.Trainer`` on a tiny CPU model.

A probe optimizer records ``current_placement()`` at every ``state_dict``, ``load_state_dict``
and ``step``; a callback records it at Trainer events. The tests assert that every checkpoint
export and resume load runs under ``Placement(device="cpu")`` and that nothing else does (the
training steps, the callbacks, accelerate's prepare-time round trip of the empty optimizer). A
plain Trainer is the control: there the same exports run with no policy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
import warnings
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
from te_ckpt_placement.integrations import FrameworkMethodError, hf  # noqa: E402
from te_ckpt_placement.integrations._methods import placed_methods  # noqa: E402

from .support.integration_probe import CPU, CallLog, ProbeAdamW, adam_steps  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


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
    assert len(loads) == 1 and loads[0].called_from("_resume_optimizer_and_scheduler"), log2
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
    assert log2.loads()[0].called_from("_resume_optimizer_and_scheduler")
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


class OldTrainer:
    """A Trainer of a version without the optional ``_tune_save_checkpoint`` and
    ``_save_optimizer_and_scheduler``."""

    def _save_checkpoint(self, model: Any, trial: Any) -> Any:
        return current_placement()

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> Any:
        return current_placement()


def test_place_trainer_warns_about_optional_methods_the_version_lacks() -> None:
    with pytest.warns(RuntimeWarning) as caught:
        old = hf.place_trainer(OldTrainer())
    messages = [str(w.message) for w in caught]
    version = f"transformers {transformers.__version__}"
    for name in ("_save_optimizer_and_scheduler", "_tune_save_checkpoint"):
        assert any(name in m and version in m for m in messages), messages
    assert set(placed_methods(old)) == {"_save_checkpoint", "_load_optimizer_and_scheduler"}
    assert not hasattr(old, "_tune_save_checkpoint")
    assert old._save_checkpoint(None, None) == CPU
    assert old._load_optimizer_and_scheduler("x") == CPU
    assert current_placement() is None


def test_place_trainer_without_a_required_method_is_an_error() -> None:
    class RenamedTrainer(OldTrainer):  # a release that renamed the resume entry point
        _load_optimizer_and_scheduler = None  # type: ignore[assignment]

    trainer = RenamedTrainer()
    with pytest.raises(FrameworkMethodError) as info:
        hf.place_trainer(trainer)
    message = str(info.value)
    assert "_load_optimizer_and_scheduler (resume" in message
    assert f"transformers {transformers.__version__}" in message
    assert placed_methods(trainer) == ()


def test_mixin_import_fails_when_the_trainer_lacks_a_required_method() -> None:
    # A Transformers release renaming the resume entry point must not turn PlacementTrainer
    # into a plain Trainer without a word.
    code = (
        "import transformers\n"
        "del transformers.Trainer._load_optimizer_and_scheduler\n"
        "import te_ckpt_placement.integrations.hf\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "FrameworkMethodError" in out.stderr, out.stderr
    assert "_load_optimizer_and_scheduler" in out.stderr
    assert f"transformers {transformers.__version__}" in out.stderr


# --- resume: the checkpoint goes to host memory, not onto the GPU -----------------------------


def gpu_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes TrainingArguments say what they say on rank r of 2 GPU processes."""
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    monkeypatch.setattr(TrainingArguments, "device", property(lambda self: torch.device("cuda", 0)))


@pytest.mark.parametrize("cls", [Trainer, hf.PlacementTrainer])
def test_resume_reads_optimizer_pt_into_host_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type
) -> None:
    # Under DDP on GPUs, Transformers reads optimizer.pt with map_location=args.device: the
    # whole FP32 checkpoint on every GPU before the optimizer's load runs. The placed resume
    # maps it into host memory instead and the placed load streams it in.
    make_trainer(tmp_path, CallLog(), cls=hf.PlacementTrainer).train()
    log = CallLog()
    resumed = make_trainer(tmp_path, log, cls=cls)
    resumed.create_optimizer_and_scheduler(num_training_steps=6)
    reads: list[tuple[str, Any, Any]] = []
    real_load = torch.load

    def spy(f: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append((os.path.basename(str(f)), kwargs.get("map_location"), kwargs.get("mmap")))
        kwargs["map_location"] = "cpu"  # no GPU here: only the request is under test
        return real_load(f, *args, **kwargs)

    gpu_ranks(monkeypatch)
    monkeypatch.setattr(torch, "load", spy)
    resumed._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-4"))
    monkeypatch.undo()

    optimizer_reads = [r for r in reads if r[0] == "optimizer.pt"]
    assert len(optimizer_reads) == 1, reads
    if cls is Trainer:  # the control: Transformers' own request
        assert optimizer_reads[0][1] == torch.device("cuda", 0)
        assert [c.placement for c in log.loads()] == [None]
    else:
        assert optimizer_reads[0][1:] == ("cpu", True)
        assert [c.placement for c in log.loads()] == [CPU]
    assert [r[0] for r in reads].count("scheduler.pt") == 1
    assert adam_steps(resumed.optimizer) == {4}


@pytest.mark.parametrize("cls", [Trainer, hf.PlacementTrainer])
def test_resume_converts_on_the_ranks_share_of_host_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type
) -> None:
    # Every rank of the host converts its checkpoint at once. The placed resume's conversions
    # run on the rank's share of host workers (the package's team); torch's own thread count
    # is left as it is (it used to be capped process-wide for the resume).
    from te_ckpt_placement import _workers

    make_trainer(tmp_path, CallLog(), cls=hf.PlacementTrainer).train()
    resumed = make_trainer(tmp_path, CallLog(), cls=cls)
    resumed.create_optimizer_and_scheduler(num_training_steps=6)
    seen: list[tuple[int, int]] = []
    load = resumed.optimizer.load_state_dict

    def counted(state_dict: Any) -> Any:
        seen.append((torch.get_num_threads(), _workers.count()))
        return load(state_dict)

    resumed.optimizer.load_state_dict = counted
    monkeypatch.setattr(_workers, "available_cpus", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv(_workers.ENV, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        resumed._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-4"))
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
    assert seen == [(4, 2)]
    assert adam_steps(resumed.optimizer) == {4}


def test_resume_with_placement_none_is_transformers_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_trainer(tmp_path, CallLog(), cls=hf.PlacementTrainer).train()
    log = CallLog()
    resumed = make_trainer(tmp_path, log, cls=hf.PlacementTrainer)
    resumed.optimizer_export_placement = None
    resumed.create_optimizer_and_scheduler(num_training_steps=6)
    reads: list[Any] = []
    real_load = torch.load

    def spy(f: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(kwargs.get("map_location"))
        kwargs["map_location"] = "cpu"
        return real_load(f, *args, **kwargs)

    gpu_ranks(monkeypatch)
    monkeypatch.setattr(torch, "load", spy)
    resumed._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-4"))
    monkeypatch.undo()
    assert reads[0] == torch.device("cuda", 0)
    assert [c.placement for c in log.loads()] == [Placement(device=None)]


# --- resume under accelerate FSDP2, on 2 CPU ranks ---------------------------------------------


def fsdp2_rank(rank: int, port: int, out: str, state_dict_type: str) -> None:
    """Saves with accelerate's save_fsdp_optimizer, then resumes three ways and compares."""
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_optimizer, save_fsdp_optimizer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from te_ckpt_placement import _te_hooks as te_hooks
    from te_ckpt_placement.integrations import _resume

    from .support.helpers import bits, local
    from .support.standin import StandInFusedAdam, make_optimizer, train

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from accelerate import PartialState

    PartialState(cpu=True)  # accelerate's logging needs it
    te_hooks.patch_class(StandInFusedAdam)
    results: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (2,))
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
        accelerator = types.SimpleNamespace(process_index=rank, wait_for_everyone=dist.barrier)

        def build() -> tuple[Any, Any, Any]:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 6), torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)
            ).to(torch.bfloat16)
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = make_optimizer(model.parameters())
            steps: list[int] = []

            def counted(self: Any, closure: Any = None) -> Any:
                steps.append(1)
                return StandInFusedAdam.step(self, closure)

            optimizer.step = types.MethodType(counted, optimizer)  # type: ignore[method-assign]
            # As in the Trainer: the scheduler exists before a save and before a resume.
            optimizer.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            return model, optimizer, steps

        def fingerprint(optimizer: Any) -> list[tuple[str, Any]]:
            """Every state's bits, and every hyperparameter as ``repr`` (so types count too:
            torch's full-state load turns a group's tuples into lists)."""
            params = [p for g in optimizer.param_groups for p in g["params"]]
            states: list[tuple[str, Any]] = [
                (f"{i}.{name}", bits(local(value)))
                for i, p in enumerate(params)
                for name, value in sorted(optimizer.state[p].items())
            ]
            groups = [
                (f"group.{g}.{key}", repr(value))
                for g, group in enumerate(optimizer.param_groups)
                for key, value in sorted(group.items())
                if key != "params"
            ]
            return states + groups

        def states(fingerprinted: list[Any]) -> list[Any]:
            return [(k, v) for k, v in fingerprinted if not k.startswith("group.")]

        def differing(ours: list[Any], ref: list[Any]) -> list[str]:
            """The entries that differ (all of them when the lists do not line up)."""
            if [k for k, _ in ours] != [k for k, _ in ref]:
                return [k for k, _ in ref]
            return [
                k
                for (k, a), (_, b) in zip(ours, ref, strict=True)
                if not (torch.equal(a, b) if torch.is_tensor(a) else a == b)
            ]

        model, optimizer, _ = build()
        train(optimizer, steps=2)
        ckpt = Path(out) / "checkpoint"
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(ckpt))
        if rank == 0:
            torch.save(optimizer.scheduler.state_dict(), ckpt / "scheduler.pt")
        dist.barrier()
        saved = fingerprint(optimizer)

        # accelerate's own load (what Transformers runs without the integration)
        model, optimizer, steps = build()
        load_fsdp_optimizer(plugin, accelerator, optimizer, model, str(ckpt))
        results["plain_steps"] = len(steps)
        plain = fingerprint(optimizer)

        def fake_trainer(model: Any, optimizer: Any) -> Any:
            state = types.SimpleNamespace(fsdp_plugin=plugin)
            return types.SimpleNamespace(
                model=model,
                optimizer=optimizer,
                lr_scheduler=optimizer.scheduler,
                accelerator=types.SimpleNamespace(state=state),
                is_fsdp_enabled=True,
                is_deepspeed_enabled=False,
            )

        called: list[str] = []

        def original(checkpoint: str) -> None:  # Transformers' FSDP branch
            called.append(checkpoint)
            load_fsdp_optimizer(plugin, accelerator, optimizer, model, checkpoint)

        model, optimizer, steps = build()
        with export_placement("cpu"):
            hf._resume_optimizer_and_scheduler(fake_trainer(model, optimizer), original, str(ckpt))
        results["placed_steps"] = len(steps)
        results["placed_equal_plain"] = differing(fingerprint(optimizer), plain) or True
        results["plain_equal_saved"] = differing(states(plain), states(saved)) or True
        results["plain_groups"] = [v for k, v in plain if k.startswith("group.")]
        results["original_called"] = len(called)

        if state_dict_type == "FULL_STATE_DICT":
            # A rank that cannot read optimizer.bin: accelerate's broadcast load, with a warning.
            model, optimizer, steps = build()
            real_access = _resume.os.access
            _resume.os.access = lambda path, mode: rank == 0 and real_access(path, mode)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with export_placement("cpu"):
                        hf._resume_optimizer_and_scheduler(
                            fake_trainer(model, optimizer), original, str(ckpt)
                        )
            finally:
                _resume.os.access = real_access
            results["fallback_original_called"] = len(called) - results["original_called"]
            results["fallback_warned"] = any("cannot read" in str(w.message) for w in caught)
            results["fallback_equal_plain"] = differing(fingerprint(optimizer), plain) or True
        Path(f"{out}/rank{rank}.json").write_text(json.dumps(results))
    finally:
        te_hooks.unpatch_class(StandInFusedAdam)
        dist.destroy_process_group()


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_fsdp2_resume_matches_accelerate_without_fake_step(
    tmp_path: Path, state_dict_type: str
) -> None:
    from .support.distributed import spawn

    spawn(fsdp2_rank, str(tmp_path), state_dict_type)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results["plain_equal_saved"] is True, results
        assert results["plain_steps"] == 1  # torch's fake step on a fresh optimizer
        assert results["placed_steps"] == 0, results  # TE's states built directly instead
        assert results["placed_equal_plain"] is True, results
        assert results["original_called"] == 0  # our host-side load, not accelerate's
        if state_dict_type == "FULL_STATE_DICT":
            assert results["fallback_warned"] is True, results
            assert results["fallback_original_called"] == 1, results
            assert results["fallback_equal_plain"] is True, results


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
