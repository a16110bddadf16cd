"""The Megatron-Core integration on the CPU: DistributedOptimizer checkpoints under the policy.

Every check runs on ``tests/support/megatron_standin.py``'s optimizer, whose checkpoint methods are
megatron-core 0.19.2's own (copied byte for byte), and again on Megatron's real
``DistributedOptimizer`` class wherever megatron-core imports (Python >= 3.12; the GPU machine).
TE is the CPU stand-in of ``tests/support/standin.py``, hooked like TE's class.
``TE_CKPT_REQUIRE_MEGATRON=1`` (the GPU session) turns a megatron-core that does not import into a
failure instead of a skip.

What they prove: placed, every parameter state Megatron reads for a save is a fresh host tensor
with exactly the dtype and bits of TE's ``get_unscaled_state``, produced without calling it (no
device conversion), and a load's template is the live FP32 and int16 states and fresh host tensors
for the others; ``state_dict()`` exports nothing; a fresh optimizer loads without
Megatron's dummy states; checkpoints and loaded states equal Megatron's own; nothing changes
outside the policy; an unknown Megatron is refused before anything changes.
"""

from __future__ import annotations

import datetime
import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import te_ckpt_placement
from te_ckpt_placement import (
    ContractError,
    Placement,
    _te_load_write,
    export_placement,
    last_report,
)
from te_ckpt_placement import _export as engine
from te_ckpt_placement.integrations import megatron
from te_ckpt_placement.integrations._methods import placed_methods

from .support import megatron_driver as md
from .support import megatron_standin as ms
from .support.faults import nth_call_raises
from .support.helpers import bits
from .support.standin import StandInFusedAdam

pytestmark = pytest.mark.usefixtures("hooked_standin")

REPO_ROOT = Path(__file__).resolve().parents[1]
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}
FS_MODEL_SPACE = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
# (moments, master): TE's storage modes under --use-precision-aware-optimizer. FP8 moments are
# left to the GPU test: TE's Float8Tensor is a torch.Tensor, the CPU stand-in's FP8 state is not,
# and Megatron skips states that are not tensors (distrib_optimizer.py L1104).
STORAGE = [
    (torch.bfloat16, "remainder"),
    (torch.bfloat16, "fp32"),
    (torch.float16, "fp32"),
    (torch.float32, "fp32"),
]
STORAGE_IDS = ["bf16-remainder", "bf16-fp32", "fp16-fp32", "fp32-fp32"]


@functools.cache
def _real_api() -> SimpleNamespace | None:
    return ms.megatron_api()


@pytest.fixture(params=["standin", "megatron"])
def api(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    if request.param == "standin":
        return ms.standin_api()
    real = _real_api()
    if real is None:
        reason = "megatron-core does not import here (it needs Python >= 3.12)"
        if os.environ.get("TE_CKPT_REQUIRE_MEGATRON") == "1":  # the GPU session sets it
            pytest.fail(reason)
        pytest.skip(reason)
    # As they are where TE is installed (distrib_optimizer.py L19-33).
    monkeypatch.setattr(real.module, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(real.module, "USING_TE_OPTIMIZER", True)
    return real


@pytest.fixture
def materialized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Kinds of every state the streaming engine produces on the host (any export)."""
    calls: list[str] = []
    original = engine.materialize

    def spy(source: engine.StateSource, **kwargs: Any) -> torch.Tensor:
        calls.append(source.kind)
        return original(source, **kwargs)

    monkeypatch.setattr(engine, "materialize", spy)
    return calls


@pytest.fixture
def unscale_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of every state TE's get_unscaled_state converts (the GPU copies, on TE)."""
    calls: list[str] = []
    original = StandInFusedAdam.get_unscaled_state

    def spy(self: Any, param: torch.Tensor, name: str) -> torch.Tensor:
        calls.append(name)
        return original(self, param, name)

    monkeypatch.setattr(StandInFusedAdam, "get_unscaled_state", spy)
    return calls


# --- comparisons ------------------------------------------------------------------------------


def assert_same(ours: Any, ref: Any, where: str = "") -> None:
    """Same structure, types, dtypes and bits (tensors, Megatron mapping objects, plain data)."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: {type(ours).__name__}"
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, f"{where}: dtype/shape"
        assert torch.equal(bits(ours), bits(ref)), f"{where}: values differ"
    elif isinstance(ref, dict):
        assert isinstance(ours, dict) and list(ours) == list(ref), f"{where}: keys differ"
        skip = _is_padding(ref)
        for key in ref:
            if skip and isinstance(ref[key], (torch.Tensor, *_sharded_tensor_types())):
                _assert_same_metadata(ours[key], ref[key], f"{where}.{key}")
            else:
                assert_same(ours[key], ref[key], f"{where}.{key}")
    elif isinstance(ref, list | tuple):
        assert type(ours) is type(ref) and len(ours) == len(ref), f"{where}: sequence"
        for i, (x, y) in enumerate(zip(ours, ref, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(ref, _sharded_tensor_types()):
        _assert_same_metadata(ours, ref, where)
        assert_same(ours.data, ref.data, f"{where}.data")
    elif type(ref).__name__ == "ShardedObject":
        assert type(ours) is type(ref) and ours.key == ref.key, f"{where}: ShardedObject"
        assert ours.replica_id == ref.replica_id, f"{where}: replica_id"
        assert_same(ours.data, ref.data, f"{where}.data")
    elif type(ref).__name__ == "LocalNonpersistentObject":
        assert type(ours) is type(ref), f"{where}: LocalNonpersistentObject"
        assert_same(ours.unwrap(), ref.unwrap(), f"{where}.obj")
    else:
        assert ours == ref, f"{where}: {ours!r} != {ref!r}"


def _sharded_tensor_types() -> tuple[type, ...]:
    types: tuple[type, ...] = (ms.megatron_support.ShardedTensor,)
    real = _real_api()
    return types if real is None else (*types, real.ShardedTensor)


def _is_padding(entry: dict[Any, Any]) -> bool:
    # dp_reshardable's padding entries hold torch.empty garbage (distrib_optimizer.py L1913).
    padding = entry.get("padding")
    obj = padding.unwrap() if hasattr(padding, "unwrap") else padding
    return obj is True


def _assert_same_metadata(ours: Any, ref: Any, where: str) -> None:
    assert type(ours) is type(ref), f"{where}: {type(ours).__name__}"
    if isinstance(ref, torch.Tensor):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, f"{where}: dtype/shape"
        return
    for attr in ("key", "dtype", "local_shape", "global_shape", "global_offset", "replica_id"):
        assert getattr(ours, attr) == getattr(ref, attr), f"{where}: {attr}"


def host_tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from host_tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from host_tensors(v)
    elif isinstance(tree, _sharded_tensor_types()):
        yield tree.data


def live_storages(built: ms.Built) -> set[int]:
    inner = built.inner
    out = {p.untyped_storage().data_ptr() for p in built.params}
    for states in inner.state.values():
        for value in states.values():
            local = getattr(value, "_data", value)
            if isinstance(local, torch.Tensor):
                out.add(local.untyped_storage().data_ptr())
    return out


def assert_fresh_host(tensors: Iterator[torch.Tensor], built: ms.Built) -> int:
    """Each tensor is on the CPU, owns exactly its bytes and shares nothing with live state."""
    live = live_storages(built)
    n = 0
    for t in tensors:
        assert t.device.type == "cpu"
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert t.untyped_storage().data_ptr() not in live
        n += 1
    return n


def raw_states(inner: Any) -> dict[tuple[int, int, str], torch.Tensor]:
    """Every stored state's raw local bytes (FP8 data and scales too), by (group, index, name)."""
    out = {}
    for g, group in enumerate(inner.param_groups):
        for i, p in enumerate(group["params"]):
            for name, value in inner.state[p].items():
                if hasattr(value, "_data"):
                    out[(g, i, name)] = value._data.clone()
                    out[(g, i, name + ".scale_inv")] = value._scale_inv.clone()
                else:
                    out[(g, i, name)] = value.clone()
                    scale = inner._scales.get(p, {}).get(name)
                    if scale is not None:
                        out[(g, i, name + ".scale")] = scale.clone()
    return out


def simulate_load(template: Any, saved: Any) -> Any:
    """What dist_checkpointing.load returns for ``template``, from a checkpoint of ``saved``:
    ShardedTensors read in place into the template's tensor, ShardedObjects and
    LocalNonpersistentObjects unwrapped (the same layout, so the structures match)."""
    if isinstance(template, dict):
        return {k: simulate_load(template[k], saved[k]) for k in template}
    if isinstance(template, list):
        return [simulate_load(t, s) for t, s in zip(template, saved, strict=True)]
    if isinstance(template, _sharded_tensor_types()):
        template.data.copy_(saved.data)
        return template.data
    if type(template).__name__ == "ShardedObject":
        return saved.data
    if type(template).__name__ == "LocalNonpersistentObject":
        return template.unwrap()
    return template


# --- recognizing Megatron ---------------------------------------------------------------------


def test_the_copied_methods_have_the_known_fingerprints() -> None:
    # megatron_verbatim.py is megatron-core 0.19.2's source: its hashes are FINGERPRINTS.
    for name, expected in megatron.FINGERPRINTS.items():
        assert megatron._fingerprint(getattr(ms.StandInDistributedOptimizer, name)) == expected
    megatron.check_megatron(ms.StandInDistributedOptimizer)


def test_importing_the_integration_imports_neither_megatron_nor_te() -> None:
    code = (
        "import sys\n"
        "import te_ckpt_placement.integrations.megatron\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('megatron', 'transformer_engine')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_an_unknown_megatron_is_refused_before_anything_changes() -> None:
    class Patched(ms.StandInDistributedOptimizer):
        def state_dict(self) -> Any:  # a Megatron release that changed this method
            return {}

    built = ms.build(ms.standin_api())
    built.optimizer.__class__ = Patched
    before = dict(vars(built.optimizer))
    with pytest.raises(megatron.UnsupportedMegatronError) as err:
        megatron.place_optimizer(ms.StandInChainedOptimizer([built.optimizer]))
    message = str(err.value)
    assert "0.19.0 and 0.19.2 in state_dict, which" in message
    assert f"(megatron-core {megatron.megatron_version()})" in message
    assert_unchanged(built.optimizer, before)


def test_a_missing_method_is_named() -> None:
    class Old(ms.StandInDistributedOptimizer):
        get_parameter_state_dp_reshardable = None  # type: ignore[assignment]

    with pytest.raises(megatron.UnsupportedMegatronError, match=r"dp_reshardable \(missing\)"):
        megatron.check_megatron(Old)


def test_only_distributed_optimizers_are_placed() -> None:
    with pytest.raises(ValueError, match="found none"):
        megatron.place_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
    built = ms.build(ms.standin_api())
    with pytest.raises(ValueError, match="valid values"):
        megatron.place_optimizer(built.optimizer, "cuda")
    assert not megatron.placed_optimizers(built.optimizer)


def test_a_te_optimizer_without_the_contract_is_refused() -> None:
    built = ms.build(ms.standin_api())
    del built.inner._scales
    before = dict(vars(built.optimizer))
    with pytest.raises(ContractError, match="_scales"):
        megatron.place_optimizer(built.optimizer)
    assert_unchanged(built.optimizer, before)


def assert_unchanged(obj: object, before: dict[str, Any]) -> None:
    after = vars(obj)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)


# --- saving -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("moments", "master"), STORAGE, ids=STORAGE_IDS)
def test_parameter_states_come_to_the_host_with_get_unscaled_states_bits(
    api: SimpleNamespace, moments: torch.dtype, master: str, unscale_calls: list[str]
) -> None:
    built = ms.build(api, moments=moments, master=master)
    unscale_calls.clear()  # (the training steps')
    before = last_report()
    default = built.optimizer.get_parameter_state_dp_reshardable()  # Megatron + TE, on "device"
    assert len(unscale_calls) == 3 * len(built.params), "Megatron reads each through TE"
    assert last_report() is before, "unplaced, nothing streams and nothing is reported"
    megatron.place_optimizer(built.optimizer)
    unscale_calls.clear()
    placed = built.optimizer.get_parameter_state_dp_reshardable()
    assert unscale_calls == [], "placed, no state goes through TE's device conversion"
    report = last_report()
    assert_same(placed, default)
    n = assert_fresh_host(host_tensors(placed), built)
    assert n == 3 * len(built.params)
    # One report for the call, counting every state as a streamed state_dict() of TE counts it.
    with export_placement("cpu"):
        built.inner.state_dict()
    te = last_report()
    assert report is not None and te is not None and report is not te
    assert (report.op, report.path, report.failed) == ("export", "megatron", False)
    assert report.states == n == te.states
    assert report.device_to_host_bytes == te.device_to_host_bytes > 0
    assert (
        report.host_bytes_written
        == te.host_bytes_written
        == sum(t.numel() * t.element_size() for t in host_tensors(placed))
    )
    assert report.te_gpu_bytes == te.te_gpu_bytes
    for model_param in built.params:
        tensors = built.optimizer._get_main_param_and_optimizer_states(model_param)
        assert list(tensors) == ["exp_avg", "exp_avg_sq", "param"]
        assert tensors["param"].dtype == (torch.int16 if master == "remainder" else torch.float32)
        assert tensors["exp_avg"].dtype == tensors["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize(("moments", "master"), STORAGE[:3], ids=STORAGE_IDS[:3])
def test_dp_reshardable_checkpoint_equals_megatrons(
    api: SimpleNamespace, moments: torch.dtype, master: str, unscale_calls: list[str]
) -> None:
    built = ms.build(api, moments=moments, master=master)
    model_sd = built.model_sharded_state_dict()
    default = built.optimizer.sharded_state_dict(model_sd, metadata=DP_RESHARDABLE)
    megatron.place_optimizer(ms.StandInChainedOptimizer([built.optimizer]))
    unscale_calls.clear()
    placed = built.optimizer.sharded_state_dict(model_sd, metadata=DP_RESHARDABLE)
    assert unscale_calls == []
    assert_same(placed, default)  # padding entries: metadata only (their data is torch.empty)
    assert assert_fresh_host(host_tensors(placed["param_state"]), built) > 3 * len(built.params)


def test_fully_sharded_model_space_fails_in_megatron_as_without_the_policy(
    api: SimpleNamespace,
) -> None:
    # megatron-core 0.19.2 rejects its own flattened ShardedTensors (mapping.py L134-135).
    built = ms.build(api)
    model_sd = built.model_sharded_state_dict()
    with pytest.raises(Exception, match="flattened_range is not supported") as default:
        built.optimizer.sharded_state_dict(model_sd, metadata=FS_MODEL_SPACE)
    megatron.place_optimizer(built.optimizer)
    with pytest.raises(default.type, match="flattened_range is not supported"):
        built.optimizer.sharded_state_dict(model_sd, metadata=FS_MODEL_SPACE)


def test_state_dict_exports_nothing(
    api: SimpleNamespace, unscale_calls: list[str], materialized: list[str]
) -> None:
    built = ms.build(api)
    unscale_calls.clear()  # (the training steps')
    default = built.optimizer.state_dict()
    assert len(unscale_calls) == 3 * len(built.params)  # TE's export, on the "device"
    with export_placement("cpu"):
        built.optimizer.state_dict()  # the policy alone: TE's export streamed, thrown away
    assert len(materialized) == 3 * len(built.params)
    megatron.place_optimizer(built.optimizer)
    unscale_calls.clear()
    materialized.clear()
    placed = built.optimizer.state_dict()
    assert unscale_calls == [] and materialized == []
    report = last_report()  # a report of the call, with no state exported
    assert report is not None and (report.path, report.op, report.states) == (
        "megatron",
        "export",
        0,
    )
    assert_same(placed, default)
    assert "state" not in placed["optimizer"] and placed["optimizer"]["param_groups"]
    # The diversion is scoped to that call: TE's own state_dict still exports, and streams.
    with export_placement("cpu"):
        exported = built.inner.state_dict()
    assert len(exported["state"]) == len(built.params)
    assert assert_fresh_host(host_tensors(exported["state"]), built) == 3 * len(built.params)


# --- loading ----------------------------------------------------------------------------------


def _resume(
    api: SimpleNamespace,
    saved_built: ms.Built,
    saved: Any,
    metadata: dict[str, str],
    *,
    place: bool,
    **build_kwargs: Any,
) -> ms.Built:
    """A fresh optimizer (other values, no state), its model loaded, then the optimizer."""
    fresh = ms.build(api, train_steps=0, seed=99, **build_kwargs)
    for p, q in zip(fresh.params, saved_built.params, strict=True):
        p.data.copy_(q)
    if place:
        megatron.place_optimizer(fresh.optimizer)
    template = fresh.optimizer.sharded_state_dict(
        fresh.model_sharded_state_dict(), is_loading=True, metadata=metadata
    )
    fresh.extras["templates"] = list(host_tensors(template["param_state"]))
    fresh.extras["template_report"] = last_report()
    fresh.optimizer.load_state_dict(simulate_load(template, saved))
    return fresh


def _drop(template: Any, name: str) -> Any:
    """``template`` without ``name`` in any parameter's tensors: what a non-strict Megatron load
    (StrictHandling.LOG_UNEXPECTED and others) reads and returns for a key the checkpoint lacks
    (dist_checkpointing/validation.py adjust_non_strict_load)."""
    if isinstance(template, dict):
        return {
            k: _drop(v, name) for k, v in template.items() if k != name or "padding" not in template
        }
    if isinstance(template, list):
        return [_drop(v, name) for v in template]
    return template


def _placed_template(api: SimpleNamespace, rollback: bool) -> tuple[ms.Built, Any, ms.Built, Any]:
    """A saved run's checkpoint, and another run placed with ``rollback`` and its load template."""
    built = ms.build(api, seed=3)
    saved = built.optimizer.sharded_state_dict(
        built.model_sharded_state_dict(), metadata=DP_RESHARDABLE
    )
    run = ms.build(api, seed=4)
    megatron.place_optimizer(run.optimizer, Placement(device="cpu", rollback=rollback))
    template = run.optimizer.sharded_state_dict(
        run.model_sharded_state_dict(), is_loading=True, metadata=DP_RESHARDABLE
    )
    return built, saved, run, template


@pytest.mark.parametrize("rollback", [False, True])
def test_a_load_writes_the_loaded_states_once_with_the_placements_rollback(
    api: SimpleNamespace, rollback: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    built, saved, run, template = _placed_template(api, rollback)
    calls: list[tuple[int, bool, bool]] = []
    real = megatron.te_load.load_states

    def spy(optimizer: Any, states: Any, *, rollback: bool, round_as_device: bool) -> None:
        states = list(states)
        calls.append((len(states), rollback, round_as_device))
        real(optimizer, states, rollback=rollback, round_as_device=round_as_device)

    monkeypatch.setattr(megatron.te_load, "load_states", spy)
    run.optimizer.load_state_dict(simulate_load(template, saved))
    # One call after Megatron's own load_state_dict: every parameter's three states with
    # rollback; without it the two BF16 moments, the int16 remainders having been read in place
    # (as Megatron's own template is their live tensor). Rounded as on the device, where
    # Megatron's own dp_reshardable template is.
    assert calls == [((3 if rollback else 2) * len(run.params), rollback, True)]
    report = last_report()
    assert report is not None and report.details.get("states_read_in_place", 0) == (
        0 if rollback else len(run.params)
    )
    assert_same_raw(run.inner, built.inner)


@pytest.mark.parametrize(
    ("sharding_type", "on_device"),
    [
        ("dp_reshardable", True),
        ("fully_sharded_model_space", True),
        ("dp_zero_gather_scatter", False),
        ("fully_reshardable", False),
    ],
)
def test_bf16_states_are_rounded_where_megatrons_own_template_is(
    sharding_type: str, on_device: bool
) -> None:
    # Megatron's own dp_reshardable and fully_sharded_model_space templates hold
    # get_unscaled_state's device tensors (L1090-1117), which TE rounds on the device; the other
    # two read into host buffers of Megatron's own (L1318-1341, L2310-2312) in both loads.
    from te_ckpt_placement.integrations._megatron_load import Deferred

    inner = SimpleNamespace(param_groups=[{"params": [torch.zeros(2)]}])
    loading = {"param_state": {}, "param_state_sharding_type": sharding_type}
    assert Deferred.for_load(inner, loading).round_as_device is on_device
    assert Deferred.for_load(inner, {}).round_as_device is False  # no parameter state


def _entries(tree: Any) -> Iterator[dict[str, Any]]:
    """Every parameter's entry (not padding) of a saved dp_reshardable ``param_state``."""
    if isinstance(tree, dict):
        if "padding" in tree:
            if not getattr(tree["padding"], "obj", tree["padding"]):  # LocalNonpersistentObject
                yield tree
            return
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            yield from _entries(item)


def test_a_placed_load_rounds_nans_as_the_device_would(
    api: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU, Megatron's own dp_reshardable load rounds the BF16 moments there (CUDA writes
    # 0x7FFF for every NaN; tests/test_gpu_load.py checks the host rounding against the device's
    # cast). Here the CPU "device" is given those NaN bits, so the placed load must write them.
    from te_ckpt_placement import _convert

    monkeypatch.setattr(_convert, "device_bf16_nan", lambda device: 0x7FFF)
    saved = _saved_bf16(api)
    entries = list(_entries(saved["param_state"]))
    assert entries
    for entry in entries:
        entry["exp_avg"].data.view(-1).view(torch.int32)[:3] = torch.tensor(
            [0x7FC00000, 0xFFC00000, 0x7FA01234], dtype=torch.int64
        ).to(torch.int32)
    run, template = _run_with_nan_payloads(api, "cpu")
    run.optimizer.load_state_dict(simulate_load(template, saved))
    firsts = [
        v.view(-1).view(torch.int16)[:3].tolist()
        for k, v in raw_states(run.inner).items()
        if k[2] == "exp_avg"
    ]
    assert firsts and all(f == [0x7FFF] * 3 for f in firsts), firsts


def test_a_device_whose_rounding_cannot_be_given_fails_the_load_before_it_starts(
    api: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from te_ckpt_placement import _convert

    def refuse(device: torch.device) -> int:
        return _convert.one_nan([0x7FC0, 0xFFC0], device)

    _built, saved, run, template = _placed_template(api, rollback=False)
    loaded = simulate_load(template, saved)  # the read (int16 remainders read in place)
    before = raw_states(run.inner)
    groups = [dict(g, params=None) for g in run.inner.param_groups]
    monkeypatch.setattr(_convert, "device_bf16_nan", refuse)
    cls, started = api.DistributedOptimizer, []
    load_from = cls.load_parameter_state_from_dp_reshardable
    monkeypatch.setattr(
        cls,
        "load_parameter_state_from_dp_reshardable",
        lambda self, state: started.append(1) or load_from(self, state),
    )
    with pytest.raises(RuntimeError, match="not as one NaN pattern"):
        run.optimizer.load_state_dict(loaded)
    assert not started, "Megatron's load ran before the refusal"
    after = raw_states(run.inner)
    assert after.keys() == before.keys()
    assert all(torch.equal(bits(after[k]), bits(before[k])) for k in before)
    assert [dict(g, params=None) for g in run.inner.param_groups] == groups


@pytest.mark.parametrize("rollback", [False, True])
def test_a_loaded_state_that_does_not_fit_changes_no_parameter_state(
    api: SimpleNamespace, rollback: bool
) -> None:
    built, saved, run, template = _placed_template(api, rollback)
    before = raw_states(run.inner)  # after the template's round trip (L965)
    loaded = simulate_load(template, saved)
    bucket = next(iter(next(iter(loaded["param_state"][0].values()))))
    entry = next(e for e in bucket if not e["padding"])
    entry["exp_avg"] = entry["exp_avg"][:-1]  # one element short: the last parameter's too
    with pytest.raises(ValueError) as caught:
        run.optimizer.load_state_dict(loaded)
    notes = "\n".join(caught.value.__notes__)
    assert "parameter states it hands over in host memory are unchanged" in notes
    after = raw_states(run.inner)
    assert after.keys() == before.keys()
    # Without rollback the int16 remainders were read into the live states, as Megatron's own
    # load reads them, and the note says so; with it, every state is as it was.
    read = {k for k in before if k[2] == "master_param"} if not rollback else set()
    assert (f"{len(read)} FP32 and int16 states hold the checkpoint's values" in notes) == bool(
        read
    )
    reference = raw_states(built.inner)
    for key in before:
        expected = reference[key] if key in read else before[key]
        assert torch.equal(bits(after[key]), bits(expected)), key


@pytest.mark.parametrize("missing", [None, "exp_avg_sq"], ids=["strict", "non-strict"])
@pytest.mark.parametrize(("moments", "master"), STORAGE, ids=STORAGE_IDS)
def test_load_into_a_trained_optimizer_equals_megatrons(
    api: SimpleNamespace, moments: torch.dtype, master: str, missing: str | None
) -> None:
    kwargs = {"moments": moments, "master": master}
    built = ms.build(api, seed=3, **kwargs)
    saved = built.optimizer.sharded_state_dict(
        built.model_sharded_state_dict(), metadata=DP_RESHARDABLE
    )
    runs = {}
    for place in (False, True):
        run = ms.build(api, seed=4, **kwargs)  # trained: Megatron round-trips its states (L965)
        if place:
            megatron.place_optimizer(run.optimizer)
        template = run.optimizer.sharded_state_dict(
            run.model_sharded_state_dict(), is_loading=True, metadata=DP_RESHARDABLE
        )
        if missing is not None:
            template = _drop(template, missing)
        run.optimizer.load_state_dict(simulate_load(template, saved))
        runs[place] = run
        if place:
            report = last_report()
            assert report is not None and report.device_to_host_bytes == 0
    # A state the load does not bring keeps what Megatron's round trip leaves, in both.
    assert_same_raw(runs[True].inner, runs[False].inner)
    if missing is None and moments in (torch.bfloat16, torch.float32):
        assert_same_raw(runs[True].inner, built.inner)


BF16_FP32 = {"moments": torch.bfloat16, "master": "fp32"}


def _saved_bf16(api: SimpleNamespace) -> Any:
    """A trained run's dp_reshardable checkpoint, BF16 moments and FP32 masters."""
    built = ms.build(api, seed=3, **BF16_FP32)
    return built.optimizer.sharded_state_dict(
        built.model_sharded_state_dict(), metadata=DP_RESHARDABLE
    )


def _run_with_nan_payloads(api: SimpleNamespace, placement: Any) -> tuple[ms.Built, Any]:
    """Another run (placed if ``placement`` is not None) and its load template (whose making
    round-trips the states, L1538), after which every BF16 ``exp_avg`` starts with a NaN with a
    payload: TE's round trip of the load (L965) canonicalizes it."""
    run = ms.build(api, seed=4, **BF16_FP32)
    if placement is not None:
        megatron.place_optimizer(run.optimizer, placement)
    template = run.optimizer.sharded_state_dict(
        run.model_sharded_state_dict(), is_loading=True, metadata=DP_RESHARDABLE
    )
    for states in run.inner.state.values():
        states["exp_avg"].view(-1).view(torch.int16)[0] = 0x7F81
    return run, template


def test_a_read_inside_the_load_sees_tes_round_trip_done(
    api: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # TE's round trip (L965) of the 16-bit moments is left out where the loaded states
    # overwrite them. A loader that reads the states before it sets them (as
    # dp_zero_gather_scatter's does, L2310) must read them as the round trip leaves them.
    saved = _saved_bf16(api)
    cls = api.DistributedOptimizer
    load_from = cls.load_parameter_state_from_dp_reshardable
    read: dict[bool, torch.Tensor] = {}

    def reading_first(self: Any, param_state: Any) -> Any:
        first = next(iter(self.model_param_group_index_map))
        value = self._get_main_param_and_optimizer_states(first)["exp_avg"]
        read[placing] = value.detach().cpu().clone().view(torch.int32)
        return load_from(self, param_state)

    monkeypatch.setattr(cls, "load_parameter_state_from_dp_reshardable", reading_first)
    runs = {}
    for placing in (False, True):
        run, template = _run_with_nan_payloads(api, "cpu" if placing else None)
        run.optimizer.load_state_dict(simulate_load(template, saved))
        runs[placing] = run
    assert torch.equal(read[True], read[False])
    assert int(read[False][0]) != 0x7F810000, "the round trip changed nothing to read"
    assert_same_raw(runs[True].inner, runs[False].inner)


@pytest.mark.parametrize("failing", ["megatron", "write, rolled back"])
def test_a_failed_load_leaves_tes_round_trip_done(api: SimpleNamespace, failing: str) -> None:
    # The BF16 moments' round trip (L965), left for the end of the load, still happens when
    # Megatron's own load fails after it, and when the write of the loaded states fails and is
    # rolled back: the moments end as Megatron's own load leaves them when it fails right after
    # its round trip.
    saved = _saved_bf16(api)
    cls = api.DistributedOptimizer
    moments: dict[bool, dict[tuple[int, int, str], torch.Tensor]] = {}
    for placing in (False, True):
        placement = Placement(device="cpu", rollback=failing != "megatron") if placing else None
        run, template = _run_with_nan_payloads(api, placement)
        with pytest.MonkeyPatch.context() as mp:
            owner, attr = (
                (_te_load_write, "_write_one")
                if placing and failing != "megatron"
                else (cls, "load_parameter_state_from_dp_reshardable")
            )
            mp.setattr(owner, attr, nth_call_raises(1, RuntimeError("x"), getattr(owner, attr)))
            with pytest.raises(RuntimeError, match="x"):
                run.optimizer.load_state_dict(simulate_load(template, saved))
        moments[placing] = {k: v for k, v in raw_states(run.inner).items() if "exp_avg" in k[2]}
    assert moments[True].keys() == moments[False].keys()
    assert all(torch.equal(bits(moments[True][k]), bits(moments[False][k])) for k in moments[False])
    firsts = [int(v.view(-1).view(torch.int16)[0]) for k, v in moments[False].items()]
    assert 0x7F81 not in firsts, "the round trip changed nothing"


@pytest.mark.parametrize(("moments", "master"), STORAGE, ids=STORAGE_IDS)
def test_resume_equals_megatrons_and_the_saved_run(
    api: SimpleNamespace, moments: torch.dtype, master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs = {"moments": moments, "master": master}
    built = ms.build(api, **kwargs)
    saved = built.optimizer.sharded_state_dict(
        built.model_sharded_state_dict(), metadata=DP_RESHARDABLE
    )
    # Megatron's fresh-optimizer load allocates dummy states on the current CUDA device
    # (L997); on the CPU they go to the host.
    dummies: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: dummies.append(1) or "cpu")
    default = _resume(api, built, saved, DP_RESHARDABLE, place=False, **kwargs)
    assert dummies, "Megatron's own load builds dummy states"
    dummies.clear()
    placed = _resume(api, built, saved, DP_RESHARDABLE, place=True, **kwargs)
    assert dummies == [], "placed, a fresh optimizer starts from TE's initial states"
    report = last_report()  # the load_state_dict, with its round trip through TE (L965, L1046)
    assert report is not None and (report.op, report.path, report.failed) == (
        "load",
        "megatron",
        False,
    )
    # The round trip through TE (L965, L1046) stays on the device: nothing is exported, and
    # only the FP8 moments are set again (the BF16 and FP16 ones are left out, as the loaded
    # states overwrite them); then each loaded state is written once, except the FP32 and
    # int16 ones, which the read put in place.
    reset = 2 if moments == torch.uint8 else 0
    in_place = 3 if moments == torch.float32 else 1
    assert report.states == (reset + 3 - in_place) * len(placed.params)
    assert report.details["states_read_in_place"] == in_place * len(placed.params)
    assert report.device_to_host_bytes == 0
    assert (report.host_to_device_bytes > 0) == (moments != torch.float32)
    # The template: the FP32 and int16 states are their live tensors, as Megatron's own template
    # is; the others empty host tensors of the exported dtypes, each owning exactly its bytes
    # (a view of a larger buffer would pickle all of it) and sharing nothing with the states.
    # Nothing is read from the states.
    templates = placed.extras["templates"]
    live = live_storages(placed)
    assert sum(t.untyped_storage().data_ptr() in live for t in templates) == in_place * len(
        placed.params
    )
    host = [t for t in templates if t.untyped_storage().data_ptr() not in live]
    assert assert_fresh_host(iter(host), placed) >= (3 - in_place) * len(placed.params)
    template_report = placed.extras["template_report"]
    assert template_report is not None and template_report.device_to_host_bytes == 0
    assert_same_raw(placed.inner, default.inner)
    assert_same(placed.optimizer.state_dict(), default.optimizer.state_dict())
    # BF16 and FP32 states survive a save and load exactly; FP16 and FP8 ones get new scales
    # (set_scaled_state), the same in both.
    exact = moments in (torch.bfloat16, torch.float32)
    if exact:
        assert_same_raw(placed.inner, built.inner)
    # Both train on identically (and, where the round trip is exact, like the saving run).
    for run in (built, default, placed):
        ms.train(run, steps=2, seed=7)
    assert_same_raw(placed.inner, default.inner)
    for p, q in zip(placed.params, default.params, strict=True):
        assert torch.equal(bits(p), bits(q))
    if exact:
        assert_same_raw(placed.inner, built.inner)
        for p, q in zip(placed.params, built.params, strict=True):
            assert torch.equal(bits(p), bits(q))


def assert_same_raw(inner: Any, ref_inner: Any) -> None:
    got, ref = raw_states(inner), raw_states(ref_inner)
    assert list(got) == list(ref)
    for key in ref:
        assert torch.equal(bits(got[key]), bits(ref[key])), key


def test_a_loaded_optimizer_with_state_loads_in_place(api: SimpleNamespace) -> None:
    built = ms.build(api)
    saved = built.optimizer.sharded_state_dict(
        built.model_sharded_state_dict(), metadata=DP_RESHARDABLE
    )
    other = ms.build(api, seed=5)  # trained: Megatron's "retrieve existing state" branch
    for p, q in zip(other.params, built.params, strict=True):
        p.data.copy_(q)
    megatron.place_optimizer(other.optimizer)
    before = {k: v.untyped_storage().data_ptr() for k, v in _live(other.inner).items()}
    template = other.optimizer.sharded_state_dict(
        other.model_sharded_state_dict(), is_loading=True, metadata=DP_RESHARDABLE
    )
    other.optimizer.load_state_dict(simulate_load(template, saved))
    after = {k: v.untyped_storage().data_ptr() for k, v in _live(other.inner).items()}
    assert after == before, "the live states were written in place"
    assert_same_raw(other.inner, built.inner)


def _live(inner: Any) -> dict[tuple[int, int, str], torch.Tensor]:
    return {
        (g, i, name): getattr(value, "_data", value)
        for g, group in enumerate(inner.param_groups)
        for i, p in enumerate(group["params"])
        for name, value in inner.state[p].items()
    }


# --- scope: what the policy touches, and what it does not -------------------------------------


def test_outside_the_checkpoint_methods_nothing_changes(
    api: SimpleNamespace, unscale_calls: list[str]
) -> None:
    built = ms.build(api)
    megatron.place_optimizer(built.optimizer)
    unscale_calls.clear()  # (the training steps')
    for model_param in built.params:
        # A direct call is not a checkpoint call: Megatron's own path, TE's conversion.
        tensors = built.optimizer._get_main_param_and_optimizer_states(model_param)
        g, i = built.optimizer.model_param_group_index_map[model_param]
        shard = built.inner.param_groups[g]["params"][i]
        assert tensors["param"] is built.inner.state[shard]["master_param"]  # TE's alias
    assert len(unscale_calls) == 3 * len(built.params)
    # export_placement(None) inside a placed call restores Megatron's behaviour.
    megatron.place_optimizer(built.optimizer, None)
    unscale_calls.clear()
    built.optimizer.get_parameter_state_dp_reshardable()
    assert len(unscale_calls) == 3 * len(built.params)


def test_a_step_inside_a_checkpoint_call_is_tes_own(
    api: SimpleNamespace, materialized: list[str]
) -> None:
    # Megatron can step inside checkpoint code (_init_optimizer_states_with_dummy_values);
    # get_unscaled_state is never replaced, so TE's step works on its own device states.
    twin_a, twin_b = ms.build(api), ms.build(api)
    megatron.place_optimizer(twin_a.optimizer)
    original = twin_a.optimizer.get_parameter_state_dp_reshardable

    def checkpoint_with_a_step() -> Any:
        inner = twin_a.inner
        p = inner.param_groups[0]["params"][0]
        assert inner.get_unscaled_state(p, "master_param") is inner.state[p]["master_param"]
        ms.train(twin_a, steps=1, seed=3)
        assert materialized == [], "the step produced nothing on the host"
        return original()

    twin_a.optimizer.get_parameter_state_dp_reshardable = checkpoint_with_a_step
    with export_placement("cpu"):
        twin_a.optimizer.get_parameter_state_dp_reshardable()
    assert len(materialized) == 3 * len(twin_a.params)
    ms.train(twin_b, steps=1, seed=3)
    assert_same_raw(twin_a.inner, twin_b.inner)


def test_without_precision_aware_states_megatrons_path_is_kept(
    api: SimpleNamespace, unscale_calls: list[str]
) -> None:
    # FP32 states of Megatron's FP32 main params: Megatron reads them raw, no conversion.
    built = ms.build(api, precision_aware=False)
    megatron.place_optimizer(built.optimizer)
    unscale_calls.clear()  # (the training steps')
    with export_placement("cpu"):
        for model_param in built.params:
            g, i = built.optimizer.model_param_group_index_map[model_param]
            main = built.inner.param_groups[g]["params"][i]
            tensors = built.optimizer._get_main_param_and_optimizer_states(model_param)
            assert tensors["param"] is main
            assert tensors["exp_avg"] is built.inner.state[main]["exp_avg"]
    assert unscale_calls == []


def test_conversion_on_device_and_reused_buffers(
    api: SimpleNamespace, unscale_calls: list[str]
) -> None:
    built = ms.build(api, moments=torch.float16, master="fp32")
    default = built.optimizer.get_parameter_state_dp_reshardable()
    megatron.place_optimizer(built.optimizer, Placement(device="cpu", conversion="device"))
    unscale_calls.clear()
    placed = built.optimizer.get_parameter_state_dp_reshardable()
    # TE's own conversion of the FP16 moments, one state at a time; FP32 masters are copied.
    assert sorted(set(unscale_calls)) == ["exp_avg", "exp_avg_sq"]
    assert_same(placed, default)
    megatron.place_optimizer(built.optimizer, Placement(device="cpu", reuse_buffers=True))
    first = [
        t.data_ptr() for t in host_tensors(built.optimizer.get_parameter_state_dp_reshardable())
    ]
    again = [
        t.data_ptr() for t in host_tensors(built.optimizer.get_parameter_state_dp_reshardable())
    ]
    assert first == again, "idle output buffers are reused"
    te_ckpt_placement.release_buffers()


# --- placing and unplacing --------------------------------------------------------------------


def test_a_chained_optimizer_places_its_distributed_optimizers(api: SimpleNamespace) -> None:
    a, b = ms.build(api), ms.build(api, seed=1)
    chain = ms.StandInChainedOptimizer([a.optimizer, ms.StandInChainedOptimizer([b.optimizer])])
    assert megatron.place_optimizer(chain) is chain
    assert megatron.placed_optimizers(chain) == (a.optimizer, b.optimizer)
    for opt in (a.optimizer, b.optimizer):
        # (The stand-in lacks the legacy torch-format save/load_parameter_state.)
        assert set(placed_methods(opt)) == {
            m for m in megatron.CHECKPOINT_METHODS if hasattr(type(opt), m)
        }
    assert megatron.unplace_optimizer(chain)
    assert megatron.placed_optimizers(chain) == ()
    assert not megatron.unplace_optimizer(chain)


def test_unplace_restores_exactly(api: SimpleNamespace, unscale_calls: list[str]) -> None:
    built = ms.build(api)
    pristine = dict(vars(built.optimizer))
    inner_pristine = dict(vars(built.inner))
    megatron.place_optimizer(built.optimizer)
    megatron.place_optimizer(built.optimizer)  # idempotent
    built.optimizer.state_dict()  # gives the inner optimizer its diverting state_dict
    assert "state_dict" in vars(built.inner)
    assert megatron.unplace_optimizer(built.optimizer)
    assert_unchanged(built.optimizer, pristine)
    assert_unchanged(built.inner, inner_pristine)
    unscale_calls.clear()
    built.optimizer.state_dict()
    with export_placement("cpu"):
        built.optimizer.get_parameter_state_dp_reshardable()
    assert len(unscale_calls) == 2 * 3 * len(built.params), "Megatron's and TE's own again"


def test_a_replaced_method_is_left_in_place_on_unplace(api: SimpleNamespace) -> None:
    built = ms.build(api)
    megatron.place_optimizer(built.optimizer)

    def mine() -> str:
        return "mine"

    built.optimizer.state_dict = mine
    with pytest.warns(RuntimeWarning, match="replaced"):
        megatron.unplace_optimizer(built.optimizer)
    assert built.optimizer.state_dict is mine


# --- two data-parallel ranks on gloo ----------------------------------------------------------


def _two_rank_worker(rank: int, port: int, with_real: bool) -> None:
    import torch.distributed as dist

    from te_ckpt_placement import _te_hooks as te_hooks

    te_hooks.patch_class(StandInFusedAdam)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        apis = [ms.standin_api()]
        if with_real:
            real = ms.megatron_api()
            assert real is not None
            real.module.HAVE_APEX_OR_TE = True
            real.module.USING_TE_OPTIMIZER = True
            apis.append(real)
        group = dist.new_group(backend="gloo")
        for api_ in apis:
            _check_two_ranks(api_, group)
    finally:
        dist.destroy_process_group()


def _check_two_ranks(api: SimpleNamespace, group: Any) -> None:
    # Every bucket splits across both ranks (Megatron refuses a rank's empty bucket, L1899).
    sizes = ((96, 40), (300,), (37, 5), (1000,), (300,))
    kwargs = {"group": group, "moments": torch.bfloat16, "master": "fp32", "sizes": sizes}
    built = ms.build(api, **kwargs)
    model_sd = built.model_sharded_state_dict()
    # Each rank owns part of a bucket, with padding between and after its parameters.
    default_zero = built.optimizer.get_parameter_state_dp_zero(use_gloo_comm=True)
    default_sd = built.optimizer.sharded_state_dict(model_sd, metadata=DP_RESHARDABLE)
    megatron.place_optimizer(built.optimizer)
    placed_zero = built.optimizer.get_parameter_state_dp_zero(use_gloo_comm=True)
    if group.rank() == 0:
        assert_same(placed_zero, default_zero)  # the gathered world tensors
    else:
        assert placed_zero is None and default_zero is None
    placed_sd = built.optimizer.sharded_state_dict(model_sd, metadata=DP_RESHARDABLE)
    assert_same(placed_sd, default_sd)
    resumed = _resume(api, built, placed_sd, DP_RESHARDABLE, place=True, **kwargs)
    assert_same_raw(resumed.inner, built.inner)


def test_two_data_parallel_ranks_on_gloo() -> None:
    from .support.distributed import spawn

    spawn(_two_rank_worker, _real_api() is not None)


@pytest.mark.parametrize("world", [1, 2])
def test_megatrons_own_training_setup_end_to_end(world: int, tmp_path: Path) -> None:
    """``benchmarks/megatron_ckpt.py`` on the CPU (``tests/support/megatron_cpu_run.py``).

    Megatron's own BF16 GPTModel (``Float16Module``), DDP, ``get_megatron_optimizer`` and
    ``dist_checkpointing`` on gloo, TE's stand-in as the FusedAdam: the forward and backward,
    the saves and loads of every case of the GPU run (FP8 aside, see ``STORAGE``), every check
    but the GPU memory bounds.
    """
    if _real_api() is None:
        reason = "megatron-core does not import here (it needs Python >= 3.12)"
        if os.environ.get("TE_CKPT_REQUIRE_MEGATRON") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    result = md.run(world, tmp_path, cpu=True, size="smoke", timeout=300)
    md.assert_cases_ran(result, world, fp8=False)


def _benchmark() -> Any:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import benchmarks.megatron_ckpt as bench

    return bench


def test_the_gather_bound_counts_torchs_flat_all_gather_output() -> None:
    """Megatron's own gather buffers, per DP rank, one state key of one bucket at a time: the
    receive tensors, the send copy and, for ``all_gather`` into a list on NCCL, torch's flat
    output (measured on 2 H200s: 160.6 MiB placed for one 16.8 M-element bucket, which the
    bound without it, (DP + 1) shards, missed)."""
    bench = _benchmark()
    world, bucket = 2, 1000
    shard = bucket // world * 4
    fully = bench.gather_buffer_bytes("fully_reshardable", world, bucket)
    gathered = bench.gather_buffer_bytes("dp_zero_gather_scatter", world, bucket)
    assert fully == world * shard + shard + world * shard  # receive list, send, flat output
    assert gathered == world * shard + shard  # NCCL gather receives into the list itself
    assert bench.gather_buffer_bytes("fully_reshardable", 4, 4000, mem_efficient=True) == 0
    assert bench.gather_buffer_bytes("dp_reshardable", world, bucket) == 0
    with pytest.raises(ValueError, match="valid values are dp_reshardable"):
        bench.gather_buffer_bytes("fully_sharded_model_space", world, bucket)


def _frames(*files: str) -> list[dict[str, Any]]:
    return [{"filename": f, "line": i + 1, "name": f"f{i}"} for i, f in enumerate(files)]


def test_the_gpu_peak_breakdown_replays_the_allocator_trace() -> None:
    """What the benchmark records about a GPU peak: the blocks alive at the replayed peak,
    charged to the innermost frame outside torch, and the bytes te_ckpt_placement asked for."""
    bench = _benchmark()
    torch_dir, ours = "/sp/torch/", "/repo/te_ckpt_placement/"
    gather = _frames(torch_dir + "distributed/c10d.py", "/sp/megatron/distrib_optimizer.py")
    mine = _frames(ours + "_export.py", torch_dir + "x.py")
    trace = [
        {"action": "free_requested", "addr": 9, "size": 40},  # allocated before the call
        {"action": "alloc", "addr": 1, "size": 100, "frames": gather},
        {"action": "segment_alloc", "addr": 1, "size": 4096},
        {"action": "alloc", "addr": 2, "size": 30, "frames": mine},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 50, "frames": gather},
    ]
    live = bench.peak_live(trace, torch_dir=torch_dir, owners={"te_ckpt_placement": ours})
    # -40, +100 -> 60, +30 -> 90 (the peak), -100 -> -10, +50 -> 40.
    assert live["replay_peak_bytes"] == 90
    assert live["live_bytes"] == 130
    assert live["owned_bytes"] == {"te_ckpt_placement": 30}
    assert [(s["site"], s["bytes"]) for s in live["by_site"]] == [
        ("/sp/megatron/distrib_optimizer.py:2 f1", 100),
        ("/repo/te_ckpt_placement/_export.py:1 f0", 30),
    ]
    assert [b["bytes"] for b in live["largest"]] == [100, 30]
    assert live["largest"][0]["frames"][0] == "/sp/torch/distributed/c10d.py:1 f0"
    # A block with no frame outside torch is named as such, and charged to nobody.
    only_torch = [{"action": "alloc", "addr": 4, "size": 8, "frames": _frames(torch_dir + "a.py")}]
    live = bench.peak_live(only_torch, torch_dir=torch_dir, owners={"te_ckpt_placement": ours})
    assert live["by_site"][0]["site"] == "(no Python frame outside torch)"
    assert live["owned_bytes"] == {"te_ckpt_placement": 0}


def test_the_size_probe_keeps_every_tensor_and_halves_the_width() -> None:
    bench = _benchmark()
    for size in bench.SIZES.values():
        half = bench.half_width(size)
        assert (half.layers, half.seq, half.batch) == (size.layers, size.seq, size.batch)
        assert half.hidden * 2 == size.hidden and half.vocab * 2 == size.vocab
        assert half.hidden % half.heads == 0
