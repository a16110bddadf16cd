"""The streaming export against the CPU stand-in of TE FusedAdam's storage contract."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from te_ckpt_placement import Placement, _pool, _ring, _wrap, export_placement, pinned_pool_bytes
from te_ckpt_placement import _export as engine
from te_ckpt_placement import _te_contract as te_contract
from te_ckpt_placement import _te_hooks as te_hooks
from te_ckpt_placement._export import StateSource, materialize

from .support.helpers import (
    aliases_live,
    assert_owns_storage,
    assert_same_export,
    assert_snapshot_equal,
    bits,
    exported_tensors,
    live_storages,
    snapshot,
)
from .support.standin import StandInFusedAdam, make_optimizer, train

MOMENTS = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]
MASTERS = ["none", "fp32", "fp16", "remainder"]


pytestmark = pytest.mark.usefixtures("hooked_standin")


def model_params(
    param_dtype: torch.dtype, seed: int = 0, *, empty: bool = True
) -> list[torch.nn.Parameter]:
    # TE cannot keep scaled (FP16/FP8) states of 0-element params: its _apply_scale calls
    # aminmax on an empty tensor (fused_adam.py L298), so those modes get no empty param.
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (1,), (0,) if empty else (2,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(param_dtype)) for s in shapes]


def reference(opt: StandInFusedAdam) -> dict:
    with export_placement(None):
        return opt.state_dict()


@pytest.mark.parametrize(("moments", "master"), list(itertools.product(MOMENTS, MASTERS)))
def test_bit_exact_against_te_export_every_storage_mode(moments: torch.dtype, master: str) -> None:
    param_dtype = torch.bfloat16 if master == "remainder" else torch.float32
    if master == "fp16":
        param_dtype = torch.float16
    scaled = moments in (torch.float16, torch.uint8) or master == "fp16"
    params = model_params(param_dtype, empty=not scaled)
    opt = make_optimizer(
        [{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}], moments=moments, master=master
    )
    train(opt, steps=3)
    before = snapshot(opt)
    ref = reference(opt)
    with export_placement("cpu"):
        ours = opt.state_dict()
    assert_same_export(ours, ref)
    assert_snapshot_equal(before, snapshot(opt))
    for t in exported_tensors(ours):
        assert t.device.type == "cpu"
        assert_owns_storage(t)
    if master == "remainder":
        assert all(s["master_param"].dtype == torch.int16 for s in ours["state"].values())


@pytest.mark.parametrize("moments", [torch.float16, torch.uint8])
def test_device_conversion_matches(moments: torch.dtype) -> None:
    opt = make_optimizer(model_params(torch.float32, empty=False), moments=moments)
    train(opt)
    with export_placement("cpu", conversion="device"):
        ours = opt.state_dict()
    assert_same_export(ours, reference(opt))


def test_exported_tensors_never_alias_live_state() -> None:
    # TE's own export returns the live FP32 tensors themselves; ours must be private copies.
    opt = make_optimizer(model_params(torch.float32), moments=torch.float32)
    train(opt)
    live = live_storages(opt)
    ref = reference(opt)
    assert any(aliases_live(t, live) for t in exported_tensors(ref))
    with export_placement("cpu"):
        ours = opt.state_dict()
    assert not any(aliases_live(t, live) for t in exported_tensors(ours))
    frozen = [t.clone() for t in exported_tensors(ours)]
    train(opt, steps=1, seed=5)
    for a, b in zip(exported_tensors(ours), frozen, strict=True):
        assert torch.equal(a, b), "a later step changed an exported tensor"


def test_params_without_state_and_groups_added_later() -> None:
    params = model_params(torch.float32)
    opt = make_optimizer([{"params": params[:3]}], moments=torch.bfloat16)
    train(opt)
    extra = torch.nn.Parameter(torch.randn(4, 4))
    opt.add_param_group({"params": [extra, *params[3:]], "lr": 0.5})
    opt.state[params[3]]
    ref = reference(opt)
    with export_placement("cpu"):
        ours = opt.state_dict()
    assert_same_export(ours, ref)
    assert len(ours["param_groups"]) == 2
    # indices: group 0 holds 0-2; group 1 holds extra (3), params[3] (4), params[4] (5)
    assert ours["state"][4] == {}
    assert 3 not in ours["state"] and 5 not in ours["state"]


def test_fresh_optimizer_exports_empty_state() -> None:
    opt = make_optimizer(model_params(torch.float32))
    with export_placement("cpu"):
        ours = opt.state_dict()
    assert_same_export(ours, reference(opt))
    assert ours["state"] == {}


def test_default_export_is_te_export_outside_a_policy() -> None:
    opt = make_optimizer(model_params(torch.float32), moments=torch.float32)
    train(opt)
    hooked = opt.state_dict()
    te_hooks.unpatch_class(StandInFusedAdam)
    plain = opt.state_dict()
    assert_same_export(hooked, plain)
    # TE's own behaviour, aliasing included, is what runs when no policy is active.
    for a, b in zip(exported_tensors(hooked), exported_tensors(plain), strict=True):
        assert a.data_ptr() == b.data_ptr()


def test_policy_none_inside_cpu_runs_te_export() -> None:
    opt = make_optimizer(model_params(torch.float32), moments=torch.float32)
    train(opt)
    live = live_storages(opt)
    with export_placement("cpu"), export_placement(None):
        sd = opt.state_dict()
    assert all(aliases_live(t, live) for t in exported_tensors(sd) if t.numel())


def test_optimizer_default_placement_and_active_policy_wins() -> None:
    opt = make_optimizer(model_params(torch.float32), moments=torch.float32)
    train(opt)
    live = live_storages(opt)
    original = _wrap.original(StandInFusedAdam, "state_dict")

    def export() -> dict:
        # What te_ckpt_placement.FusedAdam.state_dict does with its state_dict_placement.
        return te_hooks.placed_state_dict(
            opt, StandInFusedAdam, original, default=Placement(device="cpu")
        )

    def aliased(sd: dict) -> bool:
        return all(aliases_live(t, live) for t in exported_tensors(sd) if t.numel())

    assert not aliased(export())
    with export_placement(None):
        assert aliased(export())


def test_unknown_state_name_fails_before_any_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    opt = make_optimizer(model_params(torch.float32), moments=torch.bfloat16)
    train(opt)
    p = opt.param_groups[0]["params"][1]
    opt.state[p]["step"] = torch.tensor(3.0)
    copies: list[object] = []
    monkeypatch.setattr(engine, "materialize", lambda s: copies.append(s) or materialize(s))
    with export_placement("cpu"), pytest.raises(ValueError, match=r"'step' of parameter 1"):
        opt.state_dict()
    assert copies == []


@pytest.mark.parametrize(
    ("name", "dtype"), [("exp_avg", torch.float32), ("exp_avg_sq", torch.float16)]
)
def test_state_with_unexpected_dtype_is_named(name: str, dtype: torch.dtype) -> None:
    opt = make_optimizer(model_params(torch.float32), moments=torch.bfloat16)
    train(opt)
    p = opt.param_groups[0]["params"][0]
    opt.state[p][name] = opt.state[p][name].to(dtype)
    with export_placement("cpu"), pytest.raises(ValueError) as info:
        opt.state_dict()
    assert f"{name!r} of parameter 0" in str(info.value)
    assert "expected torch.bfloat16" in str(info.value)


def test_missing_te_attribute_names_version_and_attribute() -> None:
    opt = make_optimizer(model_params(torch.float32), moments=torch.bfloat16)
    train(opt)
    del opt._scales
    with export_placement("cpu"), pytest.raises(te_contract.ContractError) as info:
        opt.state_dict()
    message = str(info.value)
    assert "_scales" in message and "transformer_engine" in message
    assert "export_placement(None)" in message


def test_has_contract_is_check_contracts_verdict() -> None:
    opt = make_optimizer(model_params(torch.float32), moments=torch.bfloat16)
    assert te_contract.has_contract(opt)
    te_contract.check_contract(opt)
    assert not te_contract.has_contract(torch.optim.Adam(model_params(torch.float32)))
    del opt._scales
    assert not te_contract.has_contract(opt)
    with pytest.raises(te_contract.ContractError, match="_scales"):
        te_contract.check_contract(opt)


def test_materialize_copy_owns_storage_of_views() -> None:
    base = torch.arange(40, dtype=torch.float32)
    view = base[10:30].view(4, 5)
    out = materialize(StateSource(kind="copy", data=view))
    assert torch.equal(out, view)
    assert_owns_storage(out)
    assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_materialize_scaled_and_fp8_arithmetic() -> None:
    gen = torch.Generator().manual_seed(1)
    raw16 = torch.randn(1000, generator=gen).half()
    scale = torch.tensor([3.0e-5])
    out = materialize(StateSource(kind="scaled", data=raw16, scale=scale))
    assert torch.equal(out, raw16.float() * scale)
    raw8 = torch.randint(0, 256, (1000,), generator=gen, dtype=torch.uint8)
    raw8[raw8 & 0x7F == 0x7F] = 0  # drop e4m3 NaN encodings for a plain equality
    out8 = materialize(
        StateSource(kind="fp8", data=raw8, scale=scale, fp8_dtype=torch.float8_e4m3fn)
    )
    assert torch.equal(out8, raw8.view(torch.float8_e4m3fn).float() * scale)


FP8_SCALES = [1.0, 0.5, 3.0, 1.7e-3, 448.0 / 3, 1e-30, 1e30, 2.0**-126, 2.0**-140, 3.4e38]
FP8_SCALES += [0.0, -2.5, math.inf, math.nan]


@pytest.mark.parametrize("block", [1, 7, 1 << 20])
def test_fp8_e4m3_bit_decode_equals_tes_formula_for_every_byte(
    monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """The vectorized decode against TE's CPU formula (widen, * scale_inv) with CUDA's NaN."""
    from te_ckpt_placement import _convert

    monkeypatch.setattr(_convert, "BLOCK_ELEMENTS", block)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3)  # NaNs in every block
    for value in FP8_SCALES:
        scale = torch.tensor([value])
        ours = materialize(
            StateSource(kind="fp8", data=every, scale=scale, fp8_dtype=torch.float8_e4m3fn)
        )
        expected = every.view(torch.float8_e4m3fn).float() * scale
        expected.view(torch.int32)[expected.isnan()] = _convert.CANONICAL_NAN_BITS
        assert torch.equal(bits(ours), bits(expected)), f"scale {value}"


@pytest.mark.parametrize("chunk_bytes", [4, 36, 1000])
def test_chunked_pipeline_every_boundary(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    # Chunks smaller than one state, across ring wrap-around, with ragged last chunks.
    monkeypatch.setattr(_ring, "CHUNK_BYTES", chunk_bytes)
    for moments in MOMENTS:
        opt = make_optimizer(model_params(torch.float32, empty=False), moments=moments)
        train(opt)
        with export_placement("cpu"):
            ours = opt.state_dict()
        assert_same_export(ours, reference(opt))


def test_pool_is_reused_and_survives_a_failing_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    from te_ckpt_placement import _convert

    opt = make_optimizer(model_params(torch.float32), moments=torch.bfloat16)
    train(opt)
    with export_placement("cpu"):
        opt.state_dict()
    held = pinned_pool_bytes()
    for _ in range(3):
        with export_placement("cpu"):
            opt.state_dict()
    assert pinned_pool_bytes() == held, "steady-state exports allocated staging memory"

    calls = 0
    real = _convert.convert_fn

    def failing(source: StateSource):  # type: ignore[no-untyped-def]
        dtype, convert = real(source)

        def boom(raw: torch.Tensor, out: torch.Tensor, scratch: object) -> None:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise MemoryError("injected")
            convert(raw, out, scratch)

        return dtype, boom

    monkeypatch.setattr(_convert, "convert_fn", failing)
    before = snapshot(opt)
    with export_placement("cpu"), pytest.raises(MemoryError):
        opt.state_dict()
    monkeypatch.setattr(_convert, "convert_fn", real)
    assert_snapshot_equal(before, snapshot(opt))
    assert pinned_pool_bytes() == held, "the failed export leaked a stager"
    with export_placement("cpu"):
        assert_same_export(opt.state_dict(), reference(opt))


def test_reused_buffers_only_once_released() -> None:
    from te_ckpt_placement import release_buffers

    release_buffers()
    opt = make_optimizer(model_params(torch.float32), moments=torch.bfloat16)
    train(opt)
    ref = reference(opt)

    def export() -> dict:
        with export_placement("cpu", reuse_buffers=True):
            return opt.state_dict()

    def ptrs(sd: dict) -> set[int]:
        return {t.data_ptr() for t in exported_tensors(sd) if t.numel()}

    first = export()
    held = ptrs(first)
    first_bits = [t.clone() for t in exported_tensors(first)]
    # A save in flight still holds `first`: the next export must not write into it.
    second = export()
    assert not held & ptrs(second)
    assert all(torch.equal(a, b) for a, b in zip(exported_tensors(first), first_bits, strict=True))
    assert_same_export(second, ref)
    # A view is a user too.
    view = exported_tensors(second)[0][:1]
    del first
    third = export()
    assert ptrs(third) <= held, "released buffers were not reused"
    assert_same_export(third, ref)
    second_ptrs = ptrs(second)
    del second
    fourth = export()
    assert view.untyped_storage().data_ptr() not in ptrs(fourth), "a viewed buffer was reused"
    assert ptrs(fourth) & second_ptrs, "second's released buffers were not reused"
    assert_same_export(fourth, ref)
    for t in exported_tensors(fourth):
        assert_owns_storage(t)
    assert _pool.EXPORTS.nbytes > 0
    del view, third, fourth
    release_buffers()
    assert _pool.EXPORTS.nbytes == 0


def test_reuse_buffers_must_be_bool() -> None:
    with pytest.raises(ValueError, match="valid values are True"):
        export_placement("cpu", reuse_buffers="yes")  # type: ignore[arg-type]
