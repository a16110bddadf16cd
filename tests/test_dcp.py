"""te_ckpt_placement.dcp against the CPU stand-in: staging without copies, the Stateful adapter,
and DCP save/load/async_save/resharding under the policy on 2 CPU ranks (gloo, FSDP2).

The in-process tests cover :class:`PassThroughStager` and :class:`PlacedOptimizerState` on their
own. One spawn of 2 ranks (process start-up dominates the runtime) then runs every distributed
check on ``fully_shard`` models, each against an uninterrupted or never-checkpointed reference:

1. sync round trip (``cpu_offload`` True and False; BF16, FP16 and int16 states) into a fresh
   model and optimizer, equal to TE's own load of the same checkpoint and, where TE's load is
   exact (all but FP16/FP8 states, whose scales TE re-derives), to the saved optimizer; then 3 more
   steps equal to the uninterrupted run (FP8 states of DTensors: test_gpu_dcp.py, real TE only);
2. ``dcp.async_save`` with the default stager, ``DefaultStager`` options, and ``PassThroughStager``
   (which is shown to pass export tensors through and to copy everything else);
3. resharding 2 ranks -> 1 rank (a 1-rank gloo group, and no group at all) and 1 -> 2, with
   training continued against the uninterrupted run on the other world size;
4. ``full_state_dict=True`` without and with the policy;
5. DCP's fake step on a fresh optimizer (TE's step counter is overwritten by the checkpoint's);
6. every export under the policy sits on one device, the CPU;
7. the Stateful adapter through ``dcp.save``/``dcp.load`` and ``dcp.async_save``.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import (
    AsyncStager,
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from te_ckpt_placement import PassThroughStager, PlacedOptimizerState, export_placement
from te_ckpt_placement.engine import is_exported

from .support.helpers import (
    assert_bit_equal,
    assert_same_export,
    assert_snapshot_equal,
    bits,
    local,
)
from .support.standin import StandInFusedAdam, make_optimizer, train
from .test_dtensor import (
    WORLD,
    _by_position,
    _free_port,
    _fully_sharded,
    _gather,
    _hyperparams,
    _ordered_params,
    _train_global,
)
from .test_dtensor import _init as _init_mesh

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class Backend:
    """Where the 2-rank checks run: the CPU stand-in here, real TE on CUDA in test_gpu_dcp."""

    device: str
    make_optimizer: Callable[..., torch.optim.Optimizer]


BACKEND = Backend("cpu", make_optimizer)
# dcp.async_save's own stager when none is given (state_dict_saver.py): all four options off.
ASYNC_SAVE_DEFAULTS = StagingOptions(False, False, False, False)


pytestmark = pytest.mark.usefixtures("hooked_standin")


# --- shared checks ------------------------------------------------------------------------------
def tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors(value)


def assert_all_on_cpu(export: Any, where: str) -> None:
    """Test 6: one device for every state of an export (DCP's full-state load demands it)."""
    devices = set()
    for t in tensors(export):
        if t.dim() > 0:
            devices.add(t.device.type)
            devices.add(local(t).device.type)
    assert devices == {"cpu"}, f"{where}: export on {devices}"


def assert_exports(export: dict[str, Any], where: str) -> None:
    """Every optimizer state of a flattened export is a registered export tensor."""
    states = [v for k, v in export.items() if k.startswith("state.")]
    assert states, f"{where}: no states"
    assert all(is_exported(v) for v in states), f"{where}: not every state is an export"


@torch.no_grad()
def blank(tree: Any) -> None:
    """Overwrites every tensor of a load template, so a load that skips one cannot pass."""
    for t in tensors(tree):
        loc = local(t)
        if loc.is_floating_point():
            loc.fill_(float("nan"))
        else:
            loc.fill_(-7)


# --- PassThroughStager, in process --------------------------------------------------------------
class RecordingStager(DefaultStager):
    """A DefaultStager that remembers every tensor it was asked to stage."""

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        self.seen: list[torch.Tensor] = []
        self.closed = False

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        self.seen.extend(tensors(state_dict))
        return super().stage(state_dict, **kwargs)

    def close(self) -> None:
        self.closed = True
        super().close()


def exported_optimizer(seed: int = 0) -> tuple[StandInFusedAdam, dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5, 3), (4,))]
    opt = make_optimizer(params, moments=torch.bfloat16, master="fp32")
    train(opt, steps=2, seed=seed)
    with export_placement("cpu"):
        return opt, opt.state_dict()


STAGERS: dict[str, Callable[[], PassThroughStager]] = {
    "default": PassThroughStager,
    "options_sync": lambda: PassThroughStager(StagingOptions(False, False, False, False)),
    # Shared memory and a staging thread work on a CPU-only machine; pinning is accepted and
    # ignored there (torch warns). Non-blocking copies need an accelerator: see the test below.
    "options_async_shared": lambda: PassThroughStager(StagingOptions(True, True, True, False)),
    "inner_blocking": lambda: PassThroughStager(inner=BlockingAsyncStager()),
    "inner_recording_async": lambda: PassThroughStager(
        inner=RecordingStager(StagingOptions(False, False, True, False))
    ),
}


def ids(container: Any) -> list[int]:
    values = container.values() if isinstance(container, dict) else container
    return [id(v) for v in values]


def resolve(staged: Any) -> Any:
    return staged.result() if isinstance(staged, Future) else staged


@pytest.mark.parametrize("kind", list(STAGERS))
def test_pass_through_stager_passes_exports_and_copies_the_rest(kind: str) -> None:
    _, export = exported_optimizer()
    states = export["state"]
    weight = torch.randn(6)  # a plain CPU tensor, like a model weight
    view = states[0]["exp_avg"][1:]  # a view of an export is not an export
    assert is_exported(states[0]["exp_avg"]) and not is_exported(view)
    assert not is_exported(weight)
    state_dict = {
        "optim": export,
        "model": {"w": weight},
        "nested": [states[1]["exp_avg_sq"], (view, 3, "s"), {"n": None}],
        "step": 7,
    }
    before = ids(state_dict), ids(state_dict["nested"])
    frozen = copy.deepcopy(state_dict)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Ignoring pin_memory", UserWarning)
        stager = STAGERS[kind]()
        staged = stager.stage(state_dict)
    async_inner = kind.endswith("async") or kind == "options_async_shared"
    assert isinstance(staged, Future) == async_inner, f"{kind}: {type(staged)}"
    if stager.should_synchronize_after_execute:
        stager.synchronize_staging()
    staged = resolve(staged)

    # Same structure and values ...
    assert_same_export(staged, frozen, kind)
    assert isinstance(staged["nested"][1], tuple)
    # ... exports passed through as the same objects ...
    for index, names in states.items():
        for name, value in names.items():
            assert staged["optim"]["state"][index][name] is value, f"{kind}: {index}.{name} copied"
    assert staged["nested"][0] is states[1]["exp_avg_sq"]
    # ... everything else copied.
    assert staged["model"]["w"].data_ptr() != weight.data_ptr(), f"{kind}: weight not staged"
    assert staged["nested"][1][0].data_ptr() != view.data_ptr(), f"{kind}: view not staged"
    # The caller's containers are untouched (the stager works on copies of them).
    assert ids(state_dict) == before[0] and ids(state_dict["nested"]) == before[1]
    assert_same_export(state_dict, frozen, f"{kind}: caller's dict changed")
    inner = stager.inner
    if isinstance(inner, RecordingStager):
        exported = {id(t) for t in tensors(export)}
        assert inner.seen and not exported & {id(t) for t in inner.seen}, "inner saw an export"
        assert any(t is weight for t in inner.seen)
    stager.close()
    if isinstance(inner, RecordingStager):
        assert inner.closed


def test_pass_through_stager_without_exports_is_the_inner_stager() -> None:
    inner = RecordingStager(ASYNC_SAVE_DEFAULTS)
    state_dict = {"w": torch.randn(3), "x": [torch.randn(2)]}
    staged = PassThroughStager(inner=inner).stage(state_dict)
    assert [id(t) for t in inner.seen] == [id(t) for t in tensors(state_dict)]
    assert_same_export(staged, state_dict)
    assert staged["w"].data_ptr() != state_dict["w"].data_ptr()


class FailingStager(DefaultStager):
    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        raise OSError("staging failed")


def test_pass_through_stager_propagates_inner_failures() -> None:
    _, export = exported_optimizer()
    sync = PassThroughStager(inner=FailingStager(ASYNC_SAVE_DEFAULTS))
    with pytest.raises(OSError, match="staging failed"):
        sync.stage({"optim": export, "w": torch.ones(2)})
    threaded = PassThroughStager(inner=FailingStager(StagingOptions(False, False, True, False)))
    future = threaded.stage({"optim": export, "w": torch.ones(2)})
    assert isinstance(future, Future)
    with pytest.raises(OSError, match="staging failed"):
        future.result(timeout=30)
    with pytest.raises(OSError, match="staging failed"):
        threaded.synchronize_staging()  # the waited-on staging failed: say so
    threaded.close()


def test_pass_through_stager_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"valid values are None \(.*\) or a .*StagingOptions"):
        PassThroughStager({"use_pinned_memory": False})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"valid values are None \(.*\) or an AsyncStager"):
        PassThroughStager(inner=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        PassThroughStager(StagingOptions(), inner=BlockingAsyncStager())
    # Non-blocking copies need an accelerator; on a CPU-only machine torch's stager refuses them,
    # which is why no test here covers use_non_blocking_copy=True.
    if not torch.accelerator.is_available():
        with pytest.raises(AssertionError, match="accelerator"):
            PassThroughStager(StagingOptions(False, False, False, True))
    assert isinstance(PassThroughStager(), AsyncStager)


# --- PlacedOptimizerState, in process -----------------------------------------------------------
def model_parts(seed: int) -> tuple[list[torch.nn.Module], list[StandInFusedAdam]]:
    torch.manual_seed(seed)
    parts: list[torch.nn.Module] = [
        torch.nn.Linear(3, 4),
        torch.nn.Sequential(torch.nn.Linear(4, 2)),
    ]
    return parts, [make_optimizer(p.parameters(), moments=torch.bfloat16) for p in parts]


def test_placed_optimizer_state_rejects_bad_arguments() -> None:
    parts, opts = model_parts(0)
    with pytest.raises(ValueError, match=r"valid values are a torch\.nn\.Module"):
        PlacedOptimizerState(opts[0], opts[0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"valid values are a torch\.nn\.Module"):
        PlacedOptimizerState([], opts)
    with pytest.raises(ValueError, match=r"valid values are a torch\.optim\.Optimizer"):
        PlacedOptimizerState(parts[0], parts[0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one optimizer per model part"):
        PlacedOptimizerState(parts, opts[:1])
    with pytest.raises(ValueError, match="valid values are 'cpu'"):
        PlacedOptimizerState(parts[0], opts[0], placement="cuda")
    with pytest.raises(ValueError, match="valid values are 'cpu'"):
        PlacedOptimizerState(parts[0], opts[0], placement=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict=True"):
        PlacedOptimizerState(parts[0], opts[0], options=StateDictOptions())
    with pytest.raises(ValueError, match="full_state_dict=True"):
        PlacedOptimizerState(
            parts[0],
            opts[0],
            options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
        )
    with pytest.raises(ValueError, match="StateDictOptions"):
        PlacedOptimizerState(parts[0], opts[0], options={"cpu_offload": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PlacedOptimizerState(parts[0], opts[0], "cpu")  # type: ignore[misc]
    state = PlacedOptimizerState(parts[0], opts[0], placement=None)
    assert state.placement.device is None


def test_placed_optimizer_state_model_parts_round_trip(tmp_path: Path) -> None:
    parts, opts = model_parts(0)
    for i, opt in enumerate(opts):
        train(opt, steps=2, seed=i)
    state = PlacedOptimizerState(parts, opts)
    export = state.state_dict()
    assert_exports(export, "model parts")
    assert_all_on_cpu(export, "model parts")
    with export_placement(None):
        ref = {k: v for p, o in zip(parts, opts, strict=True) for k, v in
               get_optimizer_state_dict(p, o, options=FLAT).items()}  # fmt: skip
    assert_same_export(export, ref, "model parts")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"optim": state}, checkpoint_id=str(tmp_path))
        parts2, opts2 = model_parts(1)
        state2 = PlacedOptimizerState(parts2, opts2)
        dcp.load({"optim": state2}, checkpoint_id=str(tmp_path))
    for opt, opt2 in zip(opts, opts2, strict=True):
        assert_snapshot_equal(_by_position(opt), _by_position(opt2))
        assert _hyperparams(opt2) == _hyperparams(opt)
    # Parts whose parameter names overlap would overwrite each other's states: refused.
    clash = PlacedOptimizerState([parts[0], parts2[0]], [opts[0], opts2[0]])
    with pytest.raises(ValueError, match="same keys"):
        clash.state_dict()


# --- the 2-rank checks --------------------------------------------------------------------------
def _init(rank: int, port: int) -> tuple[DeviceMesh, Any]:
    mesh = _init_mesh(rank, port)
    warnings.filterwarnings("ignore", "Ignoring pin_memory", UserWarning)
    # Async saves run their collectives in a background thread: a group of their own keeps
    # them from interleaving with the main thread's (torchtitan does the same).
    return mesh, dist.new_group(backend="gloo")


def _param_dtype(master: str) -> torch.dtype:
    return torch.bfloat16 if master == "remainder" else torch.float32


class Run:
    """A fully_shard model with its stand-in optimizer."""

    def __init__(
        self, mesh: DeviceMesh | None, moments: torch.dtype, master: str, seed: int
    ) -> None:
        dtype = _param_dtype(master)
        if mesh is None:  # one process, no DTensors: what an offline consolidation would use
            torch.manual_seed(seed)
            model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 4))
            self.model = model.to(device=BACKEND.device, dtype=dtype)
        else:  # fully_shard places the parameters on the mesh's device
            self.model = _fully_sharded(mesh, dtype, seed)
        self.opt = BACKEND.make_optimizer(self.model.parameters(), moments=moments, master=master)

    def train(self, steps: int, seed: int) -> None:
        if isinstance(next(self.model.parameters()), DTensor):
            _train_global(self.opt, steps, seed)
        else:  # the same global gradients, drawn in the same order
            gen = torch.Generator().manual_seed(seed)
            for _ in range(steps):
                for p in _ordered_params(self.opt):
                    g = torch.randn(p.shape, generator=gen) * math.exp(
                        float(torch.randn(1, generator=gen)) * 3
                    )
                    p.grad = g.to(device=p.device, dtype=p.dtype)
                self.opt.step()

    def export(self, options: StateDictOptions = FLAT, placement: Any = "cpu") -> dict[str, Any]:
        with export_placement(placement):
            return get_optimizer_state_dict(self.model, self.opt, options=options)

    def template(self, where: str) -> dict[str, Any]:
        """DCP's load template under the policy, blanked so the load has to fill it."""
        state = {"model": get_model_state_dict(self.model), "optim": self.export()}
        assert_all_on_cpu(state["optim"], f"{where} template")
        assert_exports(state["optim"], f"{where} template")
        blank(state)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"])
        with export_placement("cpu"):
            set_optimizer_state_dict(self.model, self.opt, state["optim"], options=FLAT)

    def full(self) -> dict[str, Any]:
        """Global params, global exported states and hyperparameters (a collective)."""
        out: dict[str, Any] = {}
        for key, value in {**get_model_state_dict(self.model), **self.export()}.items():
            if isinstance(value, DTensor):
                value = _gather(value)
            out[key] = bits(value).clone() if isinstance(value, torch.Tensor) else value
        return out


def _groups(opt: torch.optim.Optimizer, tuples_as_lists: bool) -> list[dict[str, Any]]:
    groups = _hyperparams(opt)
    if tuples_as_lists:
        groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]
    return groups


def assert_same_run(
    ours: Run, ref: Run, where: str, *, params: bool = True, tuples_as_lists: bool = False
) -> None:
    """Params, live states by position, FP16/FP8 scales and param_groups (step included).

    ``tuples_as_lists``: torch's full-state load returns ``betas`` as a list, policy or not.
    """
    named = ref.model.named_parameters() if params else ()
    for (name, p), q in zip(named, ours.model.parameters(), strict=False):
        assert_bit_equal(q, p, f"{where}: param {name}")
    assert_snapshot_equal(_by_position(ref.opt), _by_position(ours.opt))
    for i, (p, q) in enumerate(
        zip(_ordered_params(ref.opt), _ordered_params(ours.opt), strict=True)
    ):
        scales, scales2 = ref.opt._scales.get(p, {}), ours.opt._scales.get(q, {})
        assert scales.keys() == scales2.keys(), f"{where}: param {i}: scaled states differ"
        for name in scales:
            assert torch.equal(bits(scales[name]), bits(scales2[name])), f"{where}: {i} {name}"
    groups, ref_groups = _groups(ours.opt, tuples_as_lists), _groups(ref.opt, tuples_as_lists)
    assert groups == ref_groups, f"{where}: param_groups {groups} != {ref_groups}"


def assert_same_full(ours: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    assert ours.keys() == ref.keys(), f"{where}: keys {sorted(ours.keys() ^ ref.keys())}"
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), f"{where}: {key} differs"
        else:
            assert ours[key] == value, f"{where}: {key}: {ours[key]!r} != {value!r}"


# 1, 5, 6: sync round trip into a fresh optimizer, then continued training.
def check_sync_round_trip(
    mesh: DeviceMesh, moments: torch.dtype, master: str, cpu_offload: bool, path: Path
) -> Run:
    where = f"rank {dist.get_rank()} sync {moments} {master} cpu_offload={cpu_offload}"
    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=cpu_offload)
    run = Run(mesh, moments, master, seed=1)
    run.train(3, seed=2)
    saved = run.export(options)
    assert_all_on_cpu(saved, where)
    # cpu_offload returns CPU tensors as they are: still the export's own tensors.
    assert_exports(saved, where)
    assert_same_export(saved, run.export(options, placement=None), f"{where}: vs TE")
    dcp.save({"model": get_model_state_dict(run.model), "optim": saved}, checkpoint_id=str(path))

    fresh = Run(mesh, moments, master, seed=3)
    assert not fresh.opt.state
    state = fresh.template(where)
    # 5: building the template ran DCP's fake step, which TE counts as a step.
    assert fresh.opt.state and all(g["step"] == 1 for g in fresh.opt.param_groups), where
    dcp.load(state, checkpoint_id=str(path))
    fresh.restore(state)
    # The checkpoint's param_groups replaced the fake step's count: 3, not 1 or 4.
    assert all(g["step"] == 3 for g in fresh.opt.param_groups), f"{where}: step"

    # The same checkpoint through TE's own template and load, with no policy anywhere.
    te = Run(mesh, moments, master, seed=3)
    with export_placement(None):
        te_state = {
            "model": get_model_state_dict(te.model),
            "optim": get_optimizer_state_dict(te.model, te.opt, options=options),
        }
        dcp.load(te_state, checkpoint_id=str(path))
        set_model_state_dict(te.model, te_state["model"])
        set_optimizer_state_dict(te.model, te.opt, te_state["optim"], options=options)
    assert_same_run(fresh, te, f"{where}: policy load vs TE load")
    # BF16/FP32/int16 states come back with the bits they were saved with. FP16/FP8 ones do not,
    # with TE's own load either: it re-derives every scale from the loaded values. For those the
    # reference is TE's load (checked above), for the rest the optimizer that was saved.
    exact = moments in (torch.bfloat16, torch.float32)
    reference = run if exact else te
    if exact:
        assert_same_run(fresh, run, f"{where}: loaded vs saved")
        assert_same_export(fresh.export(options), saved, f"{where}: re-export")

    # 5: a fresh optimizer loaded without a template: the fake step runs inside the load.
    direct = Run(mesh, moments, master, seed=4)
    set_model_state_dict(direct.model, state["model"])
    with export_placement("cpu"):
        set_optimizer_state_dict(direct.model, direct.opt, saved, options=options)
    assert_same_run(direct, reference, f"{where}: direct load")

    # 1: three more steps, resumed and uninterrupted (or TE-resumed), agree bit for bit.
    for resumed in {id(r): r for r in (run, fresh, reference)}.values():
        resumed.train(3, seed=5)
    assert_same_run(fresh, reference, f"{where}: after 3 more steps")
    return run


# 2: async saves with every stager, and what PassThroughStager does and does not copy.
class RecordingPassThrough(PassThroughStager):
    """Keeps what it was given and what it returned, for the identity checks."""

    given: dict[str, Any]
    staged: Any

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
        self.given = state_dict
        self.staged = super().stage(state_dict, **kwargs)
        return self.staged


def _wait(response: Any) -> None:
    if isinstance(response, Future):
        response.result()
    else:
        response.staging_completion.result()
        response.upload_completion.result()


def check_async(mesh: DeviceMesh, async_pg: Any, run: Run, root: Path) -> None:
    where = f"rank {dist.get_rank()} async"
    reader = Run(mesh, torch.bfloat16, "fp32", seed=9)
    state = reader.template(where)
    stagers: dict[str, Callable[[], AsyncStager | None]] = {
        "dcp_default": lambda: None,
        "default_stager_sync": lambda: DefaultStager(ASYNC_SAVE_DEFAULTS),
        "default_stager_thread": lambda: DefaultStager(StagingOptions(False, False, True, False)),
        # Pinning is ignored without CUDA (torch warns); shared memory works on the CPU.
        "default_stager_pinned_shared": lambda: DefaultStager(
            StagingOptions(True, True, False, False)
        ),
        "pass_through": RecordingPassThrough,
        "pass_through_thread": lambda: RecordingPassThrough(
            StagingOptions(False, True, True, False)
        ),
    }
    extra = torch.arange(6, dtype=torch.float32)  # a plain CPU tensor in the same state dict
    for name, make in stagers.items():
        run.train(1, seed=20)  # each checkpoint holds different values
        saved = {
            "model": get_model_state_dict(run.model),
            "optim": run.export(),
            "extra": {"t": extra},
        }
        assert_all_on_cpu(saved["optim"], f"{where} {name}")
        frozen = copy.deepcopy(saved)
        stager = make()
        response = dcp.async_save(
            saved, checkpoint_id=str(root / name), process_group=async_pg, async_stager=stager
        )
        _wait(response)
        if isinstance(stager, RecordingPassThrough):
            staged = resolve(stager.staged)
            assert stager.given["optim"] is saved["optim"]
            n_passed = 0
            for key, value in saved["optim"].items():
                if key.startswith("state."):
                    assert is_exported(value), f"{where} {name}: {key} not an export"
                    assert staged["optim"][key] is value, f"{where} {name}: {key} was copied"
                    assert local(staged["optim"][key]).data_ptr() == local(value).data_ptr()
                    n_passed += 1
            assert n_passed == 3 * len(list(run.model.parameters())), n_passed
            for key, value in saved["model"].items():
                assert not is_exported(value)
                copy_ = staged["model"][key]
                assert copy_ is not value, f"{where} {name}: weight {key} passed through"
                assert local(copy_).data_ptr() != local(value).data_ptr(), key
                assert_bit_equal(copy_, value, f"{where} {name}: staged {key}")
            assert staged["extra"]["t"].data_ptr() != extra.data_ptr(), "extra not copied"
        if stager is not None:
            stager.close()
        blank(state)
        dcp.load(state, checkpoint_id=str(root / name))
        assert_same_export(state["optim"], frozen["optim"], f"{where} {name}: optim")
        assert_same_export(state["model"], frozen["model"], f"{where} {name}: model")

    # Staging is what makes training during the write safe: stage, step, then write. The
    # exports passed through still hold the staged values (nothing else writes them), and the
    # weights were copied before the step changed them.
    stager = PassThroughStager()
    saved = {"model": get_model_state_dict(run.model), "optim": run.export()}
    frozen = copy.deepcopy(saved)
    staged = stager.stage(saved)
    run.train(1, seed=21)
    assert not torch.equal(
        bits(local(next(run.model.parameters()))), bits(local(frozen["model"]["0.weight"]))
    ), f"{where}: the step changed nothing"
    dcp.save(staged, checkpoint_id=str(root / "staged_then_step"))
    blank(state)
    dcp.load(state, checkpoint_id=str(root / "staged_then_step"))
    assert_same_export(state, frozen, f"{where}: stage, step, write")


# 3: resharding 2 -> 1 and 1 -> 2, then training against the other world size's run.
def check_resharding(mesh: DeviceMesh, root: Path) -> None:
    rank = dist.get_rank()
    where = f"rank {rank} reshard"
    moments, master = torch.bfloat16, "fp32"  # elementwise updates: any sharding, same bits
    # Every rank creates the 1-rank group (new_group is collective); only rank 0 uses it.
    solo = dist.new_group([0])

    # 2 -> 1: saved by 2 ranks, loaded by one rank of a 1-rank group and by a process with no
    # group; each continues 3 steps against the 2-rank run continued the same way.
    two = Run(mesh, moments, master, seed=30)
    two.train(3, seed=31)
    path21 = str(root / "two_to_one")
    dcp.save(
        {"model": get_model_state_dict(two.model), "optim": two.export()}, checkpoint_id=path21
    )
    saved_full = two.full()
    two.train(3, seed=32)
    after_full = two.full()
    if rank == 0:
        solo_mesh = DeviceMesh.from_group(solo, BACKEND.device)
        for label, target_mesh, group in (
            ("1-rank group", solo_mesh, solo),
            ("no group", None, None),
        ):
            one = Run(target_mesh, moments, master, seed=33)
            state = one.template(f"{where} {label}")
            if group is None:
                dcp.load(state, checkpoint_id=path21, no_dist=True)
            else:
                dcp.load(state, checkpoint_id=path21, process_group=group)
            one.restore(state)
            assert_same_full(one.full(), saved_full, f"{where} 2->1 {label}: loaded")
            one.train(3, seed=32)
            assert_same_full(one.full(), after_full, f"{where} 2->1 {label}: continued")

    # 1 -> 2: saved by a 1-rank group, loaded by 2 ranks.
    path12 = str(root / "one_to_two")
    payload: list[Any] = [None]
    if rank == 0:
        solo_mesh = DeviceMesh.from_group(solo, BACKEND.device)
        one = Run(solo_mesh, moments, master, seed=34)
        one.train(3, seed=35)
        saved = {"model": get_model_state_dict(one.model), "optim": one.export()}
        assert_all_on_cpu(saved["optim"], f"{where} 1-rank save")
        dcp.save(saved, checkpoint_id=path12, process_group=solo)
        saved_one = one.full()
        one.train(3, seed=36)
        payload = [(saved_one, one.full())]
    dist.broadcast_object_list(payload, src=0)
    saved_one, after_one = payload[0]
    two = Run(mesh, moments, master, seed=37)
    state = two.template(f"{where} 1->2")
    dcp.load(state, checkpoint_id=path12)
    two.restore(state)
    assert_same_full(two.full(), saved_one, f"{where} 1->2: loaded")
    two.train(3, seed=36)
    assert_same_full(two.full(), after_one, f"{where} 1->2: continued")


# 4: full_state_dict=True, without and with the policy.
def check_full_state_dict(mesh: DeviceMesh, run: Run) -> None:
    where = f"rank {dist.get_rank()} full_state_dict"
    sharded = run.export()
    gathered = {k: _gather(v) for k, v in sharded.items() if isinstance(v, DTensor)}
    for cpu_offload in (False, True):
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=cpu_offload, flatten_optimizer_state_dict=True
        )
        label = f"{where} cpu_offload={cpu_offload}"
        no_policy = get_optimizer_state_dict(run.model, run.opt, options=options)
        te_default = run.export(options, placement=None)
        ours = run.export(options)
        assert_same_export(no_policy, te_default, f"{label}: no policy vs TE default")
        assert_same_export(ours, no_policy, f"{label}: policy vs no policy")
        if cpu_offload and dist.get_rank() != 0:
            assert ours == {}, f"{label}: only rank 0 keeps a full state dict"
            continue
        if cpu_offload or BACKEND.device == "cpu":
            # Without cpu_offload, DCP gathers on the mesh's device and keeps the result there.
            assert_all_on_cpu(ours, label)
        for key, full in gathered.items():
            assert not isinstance(ours[key], DTensor), f"{label}: {key} not gathered"
            assert torch.equal(bits(ours[key]), bits(full)), f"{label}: {key}"

    # The full-state load path exports the target once more (one device, or "Device mismatch")
    # and distributes the full tensors into it. Not flattened: torch 2.13's full-state load of a
    # flattened dict fails with or without the policy (KeyError 'param_groups.0.params.0').
    options = StateDictOptions(full_state_dict=True)
    full = run.export(options)
    loaded = {}
    for placement in ("cpu", None):
        fresh = Run(mesh, torch.bfloat16, "fp32", seed=40)
        set_model_state_dict(fresh.model, get_model_state_dict(run.model))
        with export_placement(placement):
            set_optimizer_state_dict(fresh.model, fresh.opt, full, options=options)
        loaded[placement] = fresh
    assert_same_run(loaded["cpu"], loaded[None], f"{where}: full load, policy vs TE default")
    assert_same_run(loaded["cpu"], run, f"{where}: full load", tuples_as_lists=True)


# 7: the Stateful adapter, sync and async.
def check_stateful(mesh: DeviceMesh, async_pg: Any, run: Run, root: Path) -> None:
    where = f"rank {dist.get_rank()} Stateful"
    adapter = PlacedOptimizerState(run.model, run.opt)
    export = adapter.state_dict()
    assert_exports(export, where)
    assert_all_on_cpu(export, where)
    assert_same_export(export, run.export(placement=None), f"{where}: vs TE")
    dcp.save({"optim": adapter}, checkpoint_id=str(root / "sync"))
    run.train(1, seed=50)  # the async checkpoint holds other values than the sync one
    expected = run.export()
    stager = PassThroughStager()
    response = dcp.async_save(
        {"optim": adapter},
        checkpoint_id=str(root / "async"),
        process_group=async_pg,
        async_stager=stager,
    )
    _wait(response)
    stager.close()
    for label, ckpt, values in (("sync", "sync", export), ("async", "async", expected)):
        fresh = Run(mesh, torch.bfloat16, "fp32", seed=51)
        target = PlacedOptimizerState(fresh.model, fresh.opt)
        dcp.load({"optim": target}, checkpoint_id=str(root / ckpt))
        assert_same_export(fresh.export(), values, f"{where} {label}")
        assert all(
            g["step"] == values["param_groups.0.weight.step"] for g in fresh.opt.param_groups
        )
    assert_same_run(fresh, run, f"{where}: async load", params=False)  # optimizer only


SyncCase = tuple[torch.dtype, str, bool, str]  # moments, master, cpu_offload, checkpoint name
SYNC_CASES: list[SyncCase] = [
    (torch.bfloat16, "remainder", False, "sync_remainder"),
    (torch.float16, "fp32", False, "sync_fp16"),
]


def run_all_checks(
    mesh: DeviceMesh, async_pg: Any, base: Path, extra_sync: tuple[SyncCase, ...] = ()
) -> None:
    """Checks 1-7 on the current BACKEND; ``extra_sync`` adds sync round-trip cases."""
    for moments, master, cpu_offload, name in (*SYNC_CASES, *extra_sync):
        check_sync_round_trip(mesh, moments, master, cpu_offload, base / name)
    run = check_sync_round_trip(mesh, torch.bfloat16, "fp32", True, base / "sync_bf16")
    check_async(mesh, async_pg, run, base / "async")
    check_full_state_dict(mesh, run)
    check_stateful(mesh, async_pg, run, base / "stateful")
    check_resharding(mesh, base / "reshard")


def _worker(rank: int, port: int, root: str) -> None:
    mesh, async_pg = _init(rank, port)
    base = Path(root)
    try:
        run_all_checks(mesh, async_pg, base)
    finally:
        dist.destroy_process_group()


def test_dcp_on_two_ranks(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for ckpt in ("sync_bf16", "async/pass_through", "stateful/async", "reshard/one_to_two"):
        assert (tmp_path / ckpt / ".metadata").is_file(), f"{ckpt}: no checkpoint"
