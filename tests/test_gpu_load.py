"""The streaming load with real Transformer Engine FusedAdam on a GPU.

Bit-exactness against TE's own ``load_state_dict`` of the same checkpoint (every storage mode,
special values, odd layouts, chunked and not), the GPU memory bounds, aliasing checkpoints,
GPU-resident checkpoints, checkpoint values whose elements share memory (expanded tensors),
faults part-way with and without rollback, and host values rounded as the device would round them
(Megatron's load templates): every FP32 pattern against the device's cast, and ``load_states``
against TE's ``set_scaled_state`` of device values.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from te_ckpt_placement import _ring, _te_load_write, export_placement, install
from te_ckpt_placement import _te_load as te_load

from .support.faults import nth_call_raises
from .support.helpers import bits, peak_extra
from .support.load_cases import (
    OVERLAPPING,
    densified,
    raw_bits,
    vary_checkpoint,
    with_overlapping_values,
)
from .support.te_cases import MODES, Mode, make_params, make_te_optimizer, train

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hooked() -> Iterator[None]:
    install()
    yield
    torch.cuda.synchronize()


def live_bits(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every live state's stored bytes (FP8: data and scale_inv) and every scale, in order."""
    out = []
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            for name, value in opt.state.get(p, {}).items():
                v = value._local_tensor if hasattr(value, "_local_tensor") else value
                if hasattr(v, "_data"):
                    out.append((f"{i}.{name}", torch.cat([bits(v._data), bits(v._scale_inv)])))
                else:
                    out.append((f"{i}.{name}", bits(v)))
                if p in opt._scales and name in opt._scales[p]:
                    out.append((f"{i}.{name}.scale", bits(opt._scales[p][name])))
    return out


def assert_same_live(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer) -> None:
    mine, theirs = live_bits(ours), live_bits(ref)
    assert [k for k, _ in mine] == [k for k, _ in theirs], "different states"
    for (key, a), (_, b) in zip(mine, theirs, strict=True):
        assert torch.equal(a, b), f"live {key} differs from TE's load"


def state_ptrs(opt: torch.optim.Optimizer) -> list[int]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for value in opt.state.get(p, {}).values():
                v = value._local_tensor if hasattr(value, "_local_tensor") else value
                out.append(getattr(v, "_data", v).data_ptr())
    return out


def twins(mode: Mode, seed: int, scale: int = 16) -> tuple[Any, Any]:
    """Two identical trained optimizers (the target and TE's reference)."""
    out = []
    for _ in range(2):
        opt = make_te_optimizer(mode, make_params(mode, seed=seed, scale=scale))
        train(opt, seed=seed)
        out.append(opt)
    return out[0], out[1]


def host_checkpoint(mode: Mode, scale: int = 16, **vary: Any) -> dict[str, Any]:
    source = make_te_optimizer(mode, make_params(mode, seed=1, scale=scale))
    train(source, seed=1)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    return vary_checkpoint(checkpoint, **vary) if vary else checkpoint


def bound(mode: Mode, opt: torch.optim.Optimizer) -> int:
    """0 for BF16/FP32/int16 storage; for FP16/FP8, TE's own scaling on one FP32 copy of the
    largest state plus its one-element temporaries (512-byte blocks)."""
    if not mode.scaled:
        return 0
    largest = max(p.numel() for g in opt.param_groups for p in g["params"])
    return -(-4 * largest // 512) * 512 + 16 * 512


@pytest.mark.parametrize("chunk", ["default", "64KiB"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "stepped"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_host_checkpoint_load_is_te_bit_for_bit_and_bounded(
    monkeypatch: pytest.MonkeyPatch, mode: Mode, layout: str, chunk: str
) -> None:
    if chunk != "default":  # states of up to 33 K elements cross several chunks
        monkeypatch.setattr(_ring, "CHUNK_BYTES", 64 << 10)
    checkpoint = host_checkpoint(mode, layout=layout, special=True)
    frozen = copy.deepcopy(checkpoint)
    target, reference = twins(mode, seed=2)
    ptrs = state_ptrs(target)

    def ours() -> None:
        with export_placement("cpu"):
            target.load_state_dict(checkpoint)

    _, extra = peak_extra(ours)
    _, te_extra = peak_extra(lambda: reference.load_state_dict(copy.deepcopy(checkpoint)))
    assert_same_live(target, reference)
    assert state_ptrs(target) == ptrs, "live storage was not reused"
    assert extra <= bound(mode, target), f"{mode.name}: load allocated {extra} GPU bytes"
    assert te_extra > extra
    for states, kept in zip(checkpoint["state"].values(), frozen["state"].values(), strict=True):
        for name in states:  # the checkpoint is untouched, NaN payloads included
            a, b = states[name], kept[name]
            assert torch.equal(raw_bits(a), raw_bits(b)), name


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_gpu_resident_checkpoint_loads_like_te_on_the_device(mode: Mode) -> None:
    """HF Trainer's DDP path torch.loads the optimizer checkpoint onto the GPU."""
    checkpoint = vary_checkpoint(
        host_checkpoint(mode), layout="contiguous", special=True, device="cuda"
    )
    frozen = copy.deepcopy(checkpoint)
    target, reference = twins(mode, seed=2)
    copies = [0]
    real = _ring.Ring.copy

    def counting(*args: Any) -> Any:
        copies[0] += 1
        return real(*args)

    def ours() -> None:
        with export_placement("cpu"):
            target.load_state_dict(checkpoint)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_ring.Ring, "copy", counting)
        _, extra = peak_extra(ours)
    # TE scales FP16 states of a device checkpoint in place in the caller's tensors (L307).
    reference.load_state_dict(copy.deepcopy(checkpoint))
    assert_same_live(target, reference)
    assert copies[0] == 0, "a device checkpoint went through host staging"
    assert extra <= bound(mode, target), f"{mode.name}: {extra} GPU bytes"
    for states, kept in zip(checkpoint["state"].values(), frozen["state"].values(), strict=True):
        for name in states:
            assert torch.equal(raw_bits(states[name]), raw_bits(kept[name])), f"{name} changed"


@pytest.mark.parametrize("how", ["permuted_params", "views"])
@pytest.mark.parametrize("mode", [MODES[0], MODES[1], MODES[3], MODES[7]], ids=lambda m: m.name)
def test_te_own_aliasing_export_loads_like_te(mode: Mode, how: str) -> None:
    """TE's ``get_unscaled_state`` returns FP32 and int16 states themselves: loading that export
    with another parameter mapping must not clobber a live tensor that is read later."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    gen = torch.Generator(device="cuda").manual_seed(4)
    values = [torch.randn(512, 96, device="cuda", generator=gen) for _ in range(4)]
    grads = [torch.randn(512, 96, device="cuda", generator=gen) for _ in range(4)]

    def build() -> Any:
        params = [torch.nn.Parameter(v.to(mode.param_dtype)) for v in values]
        opt = FusedAdam([{"params": params[:2]}, {"params": params[2:]}], **mode.te_kwargs())
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
        return opt

    target, reference = build(), build()

    def aliasing(opt: Any) -> dict[str, Any]:
        with export_placement(None):
            sd = opt.state_dict()
        if how == "permuted_params":
            sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][::-1]
        else:
            sd["state"][0], sd["state"][1] = (
                {k: v.view(v.shape) for k, v in sd["state"][1].items()},
                {k: v[:] for k, v in sd["state"][0].items()},
            )
        return sd

    ours = aliasing(target)
    live = {
        (v._local_tensor if hasattr(v, "_local_tensor") else v).untyped_storage().data_ptr()
        for states in target.state.values()
        for v in states.values()
        if isinstance(v, torch.Tensor) and not hasattr(v, "_data")
    }
    shared = [
        v
        for states in ours["state"].values()
        for v in states.values()
        if v.untyped_storage().data_ptr() in live
    ]
    if mode.exp_avg == torch.float32 or mode.master in ("fp32", "remainder"):
        assert shared, "the export does not alias the live states; the test tests nothing"
    expected = copy.deepcopy(aliasing(reference))
    with export_placement(None):
        reference.load_state_dict(expected)
    with export_placement("cpu"):
        target.load_state_dict(ours)
    assert_same_live(target, reference)


FAULT_POINTS = {"state": (_te_load_write, "_write_one"), "chunk": (_ring.Ring, "copy")}


@pytest.mark.parametrize("rollback", [True, False])
@pytest.mark.parametrize("where", list(FAULT_POINTS))
@pytest.mark.parametrize("exc", [torch.cuda.OutOfMemoryError("injected"), KeyboardInterrupt()])
@pytest.mark.parametrize("mode", [MODES[3], MODES[6], MODES[7]], ids=lambda m: m.name)
def test_fault_part_way_with_and_without_rollback(
    monkeypatch: pytest.MonkeyPatch, mode: Mode, exc: BaseException, where: str, rollback: bool
) -> None:
    monkeypatch.setattr(_ring, "CHUNK_BYTES", 64 << 10)  # states span several chunks
    checkpoint = host_checkpoint(mode)
    target, reference = twins(mode, seed=2)
    before = live_bits(target)
    groups = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in target.param_groups]
    )
    gc.collect()  # garbage of earlier tests must not be freed inside the measured window
    torch.cuda.synchronize()
    gpu_base = torch.cuda.memory_allocated()
    owner, attr = FAULT_POINTS[where]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, attr, nth_call_raises(4, exc, getattr(owner, attr)))
        expected = type(exc) if rollback or isinstance(exc, KeyboardInterrupt) else None
        with pytest.raises(expected or te_load.PartialLoadError) as caught:
            with export_placement("cpu", rollback=rollback):
                target.load_state_dict(checkpoint)
    error = caught.value
    del caught  # its traceback would keep the failed call's frames alive
    torch.cuda.synchronize()
    assert _ring.in_use() == 0
    if rollback:
        after = live_bits(target)
        assert [k for k, _ in after] == [k for k, _ in before]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(before, after, strict=True))
        assert groups == [
            {k: v for k, v in g.items() if k != "params"} for g in target.param_groups
        ]
    elif isinstance(exc, KeyboardInterrupt):
        assert "states were written" in "\n".join(getattr(error, "__notes__", []))
    else:
        assert isinstance(error, te_load.PartialLoadError) and error.__cause__ is exc
        assert 0 <= error.written < error.total
    error.__traceback__ = None
    if error.__cause__ is not None:
        error.__cause__.__traceback__ = None
    del error
    exc.__traceback__ = None
    gc.collect()
    assert torch.cuda.memory_allocated() == gpu_base, "the failed load left GPU memory behind"
    # Either way, loading again gives exactly TE's result, with no memory left behind.
    with export_placement("cpu"):
        target.load_state_dict(checkpoint)
    reference.load_state_dict(copy.deepcopy(checkpoint))
    assert_same_live(target, reference)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == gpu_base


def test_load_states_entry_point_equals_te_load() -> None:
    from te_ckpt_placement._te_load import load_state, load_states

    mode = MODES[7]  # FP8 moments, FP32 masters: both pipelines
    checkpoint = host_checkpoint(mode)
    target, reference = twins(mode, seed=2)
    reference.load_state_dict(copy.deepcopy(checkpoint))
    params = [p for g in target.param_groups for p in g["params"]]
    triples = [(params[k], n, v) for k, s in checkpoint["state"].items() for n, v in s.items()]
    gpu = [(p, n, v.cuda()) for p, n, v in triples[::2]]  # device values too
    _, extra = peak_extra(lambda: load_states(target, triples[1::2][1:] + gpu))
    load_state(target, *triples[1])
    for g, h in zip(target.param_groups, reference.param_groups, strict=True):
        params = g["params"]  # load_states leaves the groups alone; TE's load set them
        g.clear()
        g.update({**h, "params": params})
    assert_same_live(target, reference)
    assert extra <= bound(mode, target)


def test_rounding_as_the_device_is_the_devices_cast_for_every_fp32_pattern() -> None:
    """The host rounding with the device's NaN bits (``_convert.device_bf16_nan``) equals the
    device's own ``.bfloat16()`` for all 2**32 FP32 patterns, in blocks of 2**26."""
    from te_ckpt_placement import _convert

    nan_bits = _convert.device_bf16_nan(torch.device("cuda"))
    assert nan_bits is not None
    block = 1 << 26
    out = torch.empty(block, dtype=torch.bfloat16)
    mismatched = 0
    for start in range(-(1 << 31), 1 << 31, block):
        patterns = torch.arange(start, start + block, dtype=torch.int32, device="cuda")
        values = patterns.view(torch.float32)
        device = values.bfloat16().view(torch.int16).cpu()
        _convert.to_bf16(out, values.cpu(), True, nan_bits=nan_bits)
        mismatched += int((out.view(torch.int16) != device).sum())
    assert mismatched == 0


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_load_states_rounding_as_the_device_equals_tes_set_scaled_state_of_device_values(
    mode: Mode, layout: str
) -> None:
    """What Megatron's own load does with its device template (``set_scaled_state`` of each
    state, TE rounding on the GPU), from host values standing in for it: NaN payloads too."""
    from te_ckpt_placement._te_load import load_states

    checkpoint = host_checkpoint(mode, layout=layout, special=True)
    target, reference = twins(mode, seed=2)
    params = [p for g in target.param_groups for p in g["params"]]
    theirs = [p for g in reference.param_groups for p in g["params"]]
    triples = [(k, n, v) for k, s in checkpoint["state"].items() for n, v in s.items()]
    for k, name, value in triples:
        reference.set_scaled_state(theirs[k], name, value.cuda())
    with export_placement("cpu"):
        load_states(target, [(params[k], n, v) for k, n, v in triples], round_as_device=True)
    assert_same_live(target, reference)
    if torch.bfloat16 in (mode.exp_avg, mode.exp_avg_sq):
        # The special values' NaNs: the host's own rounding gives other bits.
        host, _ = twins(mode, seed=2)
        mine = [p for g in host.param_groups for p in g["params"]]
        load_states(host, [(mine[k], n, v) for k, n, v in triples])
        pairs = zip(live_bits(host), live_bits(target), strict=True)
        assert any(not torch.equal(a, b) for (_, a), (_, b) in pairs)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("layout", OVERLAPPING)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_overlapping_values_load_as_te_loads_their_dense_copies(
    mode: Mode, layout: str, device: str
) -> None:
    """Expanded (stride-0) or overlapping checkpoint values: TE's result for the same values.

    TE loads such host values (it reads them: a copy, a BF16 cast, its move to the GPU, L296)
    and fails on a device value of an FP16 state, which it scales in place (L307).
    """
    checkpoint = with_overlapping_values(host_checkpoint(mode), layout, device=device)
    frozen = [raw_bits(v) for s in checkpoint["state"].values() for v in s.values()]
    target, reference = twins(mode, seed=2)
    with export_placement("cpu"):
        target.load_state_dict(checkpoint)
    reference.load_state_dict(densified(checkpoint))
    assert_same_live(target, reference)
    after = [raw_bits(v) for s in checkpoint["state"].values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(frozen, after, strict=True)), "changed"
    if device == "cpu":  # TE's own load of the same host checkpoint gives the same states
        _, te_own = twins(mode, seed=2)
        te_own.load_state_dict(copy.deepcopy(checkpoint))
        assert_same_live(target, te_own)
