"""Real Transformer Engine FusedAdam on a GPU: bit-exactness, memory bounds, stand-in parity."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from te_ckpt_placement import Placement, _wrap, export_placement, install
from te_ckpt_placement import _te_contract as te_contract
from te_ckpt_placement._export import materialize

from .support.helpers import (
    aliases_live,
    assert_owns_storage,
    assert_same_export,
    assert_snapshot_equal,
    bits,
    exported_tensors,
    live_storages,
    peak_extra,
    snapshot,
)
from .support.storage import storage_kwargs
from .support.te_cases import (
    FP8,
    FP16,
    MODES,
    Mode,
    live_bits,
    make_params,
    make_te_optimizer,
    train,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hooked() -> Iterator[None]:
    install()
    yield
    torch.cuda.synchronize()


def te_reference(opt: torch.optim.Optimizer) -> dict[str, Any]:
    with export_placement(None):
        return opt.state_dict()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_bit_exact_against_te_and_zero_gpu_bytes(mode: Mode) -> None:
    opt = make_te_optimizer(mode, make_params(mode))
    train(opt)
    before = snapshot(opt)
    ref = te_reference(opt)
    with export_placement("cpu"):
        ours, extra = peak_extra(opt.state_dict)
    assert extra == 0, f"{mode.name}: the export allocated {extra} GPU bytes"
    assert_same_export(ours, ref)
    assert_snapshot_equal(before, snapshot(opt))
    assert len(ours["state"]) == sum(len(g["params"]) for g in opt.param_groups[:-1])
    for t in exported_tensors(ours):
        assert t.device.type == "cpu"
        assert_owns_storage(t)
    live = live_storages(opt)
    assert not any(aliases_live(t, live) for t in exported_tensors(ours))


@pytest.mark.parametrize("mode", [m for m in MODES if m.scaled], ids=lambda m: m.name)
def test_device_conversion_is_exact_and_bounded_by_4m(mode: Mode) -> None:
    params = make_params(mode, scale=64)
    opt = make_te_optimizer(mode, params)
    train(opt)
    ref = te_reference(opt)
    with export_placement("cpu", conversion="device"):
        ours, extra = peak_extra(opt.state_dict)
    assert_same_export(ours, ref)
    largest = max(p.numel() for p in params)
    rounded = -(-4 * largest // 512) * 512  # the caching allocator's 512-byte granularity
    assert 0 < extra <= rounded, f"{extra} > 4*M = {4 * largest}"


# Scale factors that reach every class of FP32 result: normal, subnormal, zero and overflow.
SCALES = [1.0, 3.0517578e-05, 7.1e-3, 1.3e-30, 1.1754944e-38, 2.0e-41, 3.0e35, 0.0]
SCALES += [float("inf"), float("nan"), -2.5]


def test_bf16_upcast_exhaustive_against_te() -> None:
    from transformer_engine.pytorch.optimizers import FusedAdam

    bf16 = torch.bfloat16
    param = torch.nn.Parameter(torch.zeros(1 << 16, device="cuda", dtype=bf16))
    opt = FusedAdam([param], **storage_kwargs(moments=bf16, master="none"))
    opt.initialize_state(param, False)
    state = opt.state[param]["exp_avg"]
    every = torch.arange(-(1 << 15), 1 << 15, device="cuda", dtype=torch.int32)
    state.copy_(every.to(torch.int16).view(bf16))
    expected = opt.get_unscaled_state(param, "exp_avg")
    source = te_contract.describe_state(opt, param, "exp_avg", state, Placement(), index=0)
    assert source.kind == "upcast"
    assert torch.equal(bits(materialize(source)), bits(expected))


@pytest.mark.parametrize("kind", ["fp16", "fp8"])
def test_host_conversion_exhaustive_against_te_kernels(kind: str) -> None:
    """Every stored bit pattern times every scale class: host result == TE's GPU conversion."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    moment = FP16 if kind == "fp16" else FP8
    patterns = 1 << 16 if kind == "fp16" else 1 << 8
    param = torch.nn.Parameter(torch.zeros(patterns, device="cuda", dtype=torch.bfloat16))
    opt = FusedAdam([param], **storage_kwargs(moments=moment, master="none"))
    opt.initialize_state(param, False)
    state = opt.state[param]["exp_avg"]
    if kind == "fp16":
        every = torch.arange(-(1 << 15), 1 << 15, device="cuda", dtype=torch.int32)
        state.copy_(every.to(torch.int16).view(torch.float16))
    else:
        every = torch.arange(0, 1 << 8, device="cuda", dtype=torch.int32)
        state._data.copy_(every.to(torch.uint8))
    for scale in SCALES:
        if kind == "fp16":
            opt._scales[param]["exp_avg"].fill_(scale)
        else:
            state._scale_inv.fill_(scale)
        expected = opt.get_unscaled_state(param, "exp_avg")
        source = te_contract.describe_state(
            opt, param, "exp_avg", state, Placement(device="cpu"), index=0
        )
        assert source.kind == ("scaled" if kind == "fp16" else "fp8")
        ours = materialize(source)
        ours_bits, te_bits = bits(ours).view(torch.int32), bits(expected).view(torch.int32)
        same = ours_bits == te_bits
        differ = (~same).nonzero().flatten()[:4].tolist()
        assert bool(same.all()), (
            f"{kind} scale={scale}: {int((~same).sum())} of {patterns} patterns differ, e.g. "
            f"stored {differ}: ours {[hex(int(ours_bits[i]) & 0xFFFFFFFF) for i in differ]} "
            f"TE {[hex(int(te_bits[i]) & 0xFFFFFFFF) for i in differ]}"
        )


@pytest.mark.parametrize("moments", [torch.bfloat16, FP16, FP8, torch.float32])
def test_memory_te_default_8n_ours_zero(moments: torch.dtype) -> None:
    mode = Mode("mem", torch.bfloat16, moments, moments, "fp32")
    sizes = [16 << 20, 4 << 20, 4 << 20, 1 << 20]
    params = [torch.nn.Parameter(torch.randn(n, device="cuda").bfloat16()) for n in sizes]
    opt = make_te_optimizer(mode, params)
    train(opt, steps=1)
    n = sum(p.numel() for p in opt.param_groups[0]["params"] + opt.param_groups[1]["params"])
    ref, te_extra = peak_extra(lambda: te_reference(opt))
    converted = 0 if moments == torch.float32 else 8  # TE aliases FP32 states, converts others
    assert te_extra >= converted * n
    del ref
    with export_placement("cpu"):
        _, ours_extra = peak_extra(opt.state_dict)
    assert ours_extra == 0


def test_outside_policy_te_export_is_unchanged() -> None:
    mode = MODES[1]  # FP32 moments: TE returns the live tensors themselves
    opt = make_te_optimizer(mode, make_params(mode))
    train(opt)
    hooked_sd = opt.state_dict()
    te_sd = _wrap.original(type(opt), "state_dict")(opt)
    assert_same_export(hooked_sd, te_sd)
    for a, b in zip(exported_tensors(hooked_sd), exported_tensors(te_sd), strict=True):
        assert a.device.type == "cuda" and a.data_ptr() == b.data_ptr()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_standin_matches_te(mode: Mode) -> None:
    """The CPU stand-in keeps TE's storage contract: same layout, same export, same load."""
    from .support.standin import StandInFloat8, StandInFusedAdam

    params = make_params(mode)
    opt = make_te_optimizer(mode, params)
    train(opt)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = make_te_optimizer(mode, twin_params, cls=_standin_factory(StandInFusedAdam))
    assert twin.name_to_dtype_map == opt.name_to_dtype_map
    assert twin.store_param_remainders == opt.store_param_remainders
    for p, q in zip(params, twin_params, strict=True):
        if not opt.state.get(p):  # .get: indexing the defaultdict would add an empty state
            continue
        remainder = bool(opt.store_param_remainders and p.dtype == torch.bfloat16)
        twin.initialize_state(q, remainder)
        assert list(twin.state[q]) == list(opt.state[p])
        for name, te_value in opt.state[p].items():
            mine = twin.state[q][name]
            if opt.name_to_dtype_map[name] == FP8:
                assert isinstance(mine, StandInFloat8)
                for attr in ("_data", "_scale_inv"):
                    a, b = getattr(te_value, attr), getattr(mine, attr)
                    assert (a.dtype, a.shape) == (b.dtype, b.shape), attr
                    b.copy_(a)
                assert te_value._fp8_dtype.name == mine._fp8_dtype.name
            else:
                assert (te_value.dtype, te_value.shape) == (mine.dtype, mine.shape)
                mine.copy_(te_value)
        assert (p in opt._scales) == (q in twin._scales)
        if p in opt._scales:
            assert list(opt._scales[p]) == list(twin._scales[q])
            for name, scale in opt._scales[p].items():
                twin._scales[q][name].copy_(scale)
    for g, h in zip(opt.param_groups, twin.param_groups, strict=True):
        h["step"] = g.get("step")
        if h["step"] is None:
            del h["step"]
    assert_same_export(twin.state_dict(), opt.state_dict())
    # Load parity: both load TE's own export and end with the same storage. Each gets its own
    # copy: TE's load scales FP16 states in place in the caller's FP32 tensors (L307, L548).
    exported = opt.state_dict()
    twin.load_state_dict(copy.deepcopy(exported))
    opt.load_state_dict(exported)
    for p, q in zip(params, twin_params, strict=True):
        for name in opt.state[p]:
            assert_same_export(twin.get_unscaled_state(q, name), opt.get_unscaled_state(p, name))


def _standin_factory(standin: type) -> Any:
    def build(groups: Any, lr: float, **kwargs: Any) -> Any:
        return standin(groups, lr=lr, **kwargs)

    return build


def test_subclass_with_real_te() -> None:
    import te_ckpt_placement

    mode = MODES[2]
    params = make_params(mode)
    opt = make_te_optimizer(
        mode, params, cls=te_ckpt_placement.FusedAdam, state_dict_placement="cpu"
    )
    from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam

    assert isinstance(opt, TEFusedAdam)
    train(opt)
    ref = te_reference(opt)
    assert all(t.device.type == "cuda" for t in exported_tensors(ref))
    ours, extra = peak_extra(opt.state_dict)
    assert extra == 0
    assert_same_export(ours, ref)
    assert all(t.device.type == "cpu" for t in exported_tensors(ours))
    sig = inspect.signature(te_ckpt_placement.FusedAdam.__init__)
    assert not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    te_params = set(inspect.signature(TEFusedAdam.__init__).parameters)
    assert te_params <= set(sig.parameters), te_params - set(sig.parameters)
    with pytest.raises(ValueError, match="valid values"):
        te_ckpt_placement.FusedAdam(params, state_dict_placement="cuda:0")


def state_ptrs(opt: torch.optim.Optimizer) -> list[int]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for value in opt.state.get(p, {}).values():
                v = value._local_tensor if hasattr(value, "_local_tensor") else value
                out.append(getattr(v, "_data", v).data_ptr())
    return out


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_load_bit_identical_to_te_and_bounded(mode: Mode) -> None:
    source = make_te_optimizer(mode, make_params(mode, seed=1, scale=16))
    train(source, seed=1)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    frozen = copy.deepcopy(checkpoint)
    target = make_te_optimizer(mode, make_params(mode, seed=2, scale=16))
    reference = make_te_optimizer(mode, make_params(mode, seed=2, scale=16))
    train(target, seed=2)
    train(reference, seed=2)
    ptrs = state_ptrs(target)

    def ours() -> None:
        with export_placement("cpu"):
            target.load_state_dict(checkpoint)

    _, extra = peak_extra(ours)
    _, te_extra = peak_extra(lambda: reference.load_state_dict(copy.deepcopy(checkpoint)))
    mine, theirs = live_bits(target), live_bits(reference)
    assert len(mine) == len(theirs)
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert torch.equal(a, b), f"live entry {i} differs from TE's load"
    with export_placement(None):
        assert_same_export(target.state_dict(), reference.state_dict())
    assert state_ptrs(target) == ptrs, "live storage was not reused"
    assert_same_export(checkpoint, frozen)  # the checkpoint is untouched
    largest = max(p.numel() for g in target.param_groups for p in g["params"])
    # FP16/FP8 states are scaled by TE's own _apply_scale on the GPU: one FP32 copy of the
    # state plus a few one-element scale temporaries (512-byte blocks).
    bound = 4 * largest + 8 * 512 if mode.scaled else 0
    assert extra <= bound, f"{mode.name}: load allocated {extra} > {bound}"
    assert te_extra > extra


def test_load_memory_te_adds_full_set_ours_zero() -> None:
    mode = Mode("mem", torch.bfloat16, torch.bfloat16, torch.bfloat16, "remainder")
    sizes = [16 << 20, 4 << 20, 4 << 20, 1 << 20]
    params = [torch.nn.Parameter(torch.randn(n, device="cuda").bfloat16()) for n in sizes]
    opt = make_te_optimizer(mode, params)
    train(opt, steps=1)
    n = sum(p.numel() for p in opt.param_groups[0]["params"] + opt.param_groups[1]["params"])
    with export_placement("cpu"):
        checkpoint = opt.state_dict()

    def ours() -> None:
        with export_placement("cpu"):
            opt.load_state_dict(checkpoint)

    _, te_extra = peak_extra(lambda: opt.load_state_dict(checkpoint))
    _, ours_extra = peak_extra(ours)
    # torch's cast puts all three states in the param dtype (2 bytes each) on the GPU at once.
    assert te_extra >= 3 * 2 * n, (te_extra, n)
    assert ours_extra == 0


def test_training_continues_identically_after_load() -> None:
    mode = Mode("resume", torch.bfloat16, torch.bfloat16, torch.bfloat16, "remainder")
    params = make_params(mode, seed=3)
    uninterrupted = make_te_optimizer(mode, params)
    train(uninterrupted, seed=3)
    with export_placement("cpu"):
        checkpoint = uninterrupted.state_dict()
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make_te_optimizer(mode, resumed_params)
    with export_placement("cpu"):
        resumed.load_state_dict(checkpoint)
    train(uninterrupted, steps=4, seed=8)
    train(resumed, steps=4, seed=8)
    for p, q in zip(params, resumed_params, strict=True):
        assert torch.equal(bits(p), bits(q))
    assert all(
        torch.equal(a, b) for a, b in zip(live_bits(uninterrupted), live_bits(resumed), strict=True)
    )
