"""Faults, rollback and generated layouts with real TE FusedAdam on a GPU."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from te_ckpt_placement import _ring, current_placement, export_placement, install, pinned_pool_bytes

from .support.faults import FAULTS, nth_call_raises
from .support.helpers import assert_same_export, through_torch_save
from .support.te_cases import (
    BF16,
    FP8,
    FP16,
    FP32,
    MODES,
    Mode,
    live_bits,
    make_params,
    make_te_optimizer,
    train,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("mode", [MODES[3], MODES[6], MODES[7]], ids=lambda m: m.name)
def test_export_fault_leaves_state_memory_and_pool_clean(
    monkeypatch: pytest.MonkeyPatch, fault: str, mode: Mode
) -> None:
    install()
    opt = make_te_optimizer(mode, make_params(mode, scale=32))
    train(opt)
    with export_placement(None):
        reference = copy.deepcopy(opt.state_dict())  # detached from live FP32 states
    before = live_bits(opt)
    with export_placement("cpu"):
        opt.state_dict()  # warm the pool
    torch.cuda.synchronize()
    gpu_base, pool = torch.cuda.memory_allocated(), pinned_pool_bytes()
    owner, attr, exc = FAULTS[fault]
    monkeypatch.setattr(owner, attr, nth_call_raises(5, exc, getattr(owner, attr)))
    with pytest.raises(type(exc)), export_placement("cpu"):
        opt.state_dict()
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert current_placement() is None
    assert torch.cuda.memory_allocated() == gpu_base, "GPU memory did not return to baseline"
    assert _ring.in_use() == 0 and pinned_pool_bytes() == pool
    assert all(torch.equal(a, b) for a, b in zip(before, live_bits(opt), strict=True))
    with export_placement("cpu"):
        assert_same_export(opt.state_dict(), reference)


def sample_layouts(count: int, seed: int = 1234) -> list[tuple[Mode, list[tuple[int, ...]]]]:
    """A fixed sample of the CPU property test's layout space."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        exp_avg = rng.choice([FP32, BF16, FP16, FP8])
        exp_avg_sq = rng.choice([FP32, BF16, FP16, FP8])
        master = rng.choice(["none", "fp32", "fp16", "remainder"])
        param_dtype = BF16 if master == "remainder" else rng.choice([FP32, BF16])
        mode = Mode(f"sample{i}", param_dtype, exp_avg, exp_avg_sq, master)
        low = 1 if mode.scaled else 0
        shapes = [
            tuple(rng.randint(low, 9) for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(1, 6))
        ]
        out.append((mode, shapes))
    return out


@pytest.mark.parametrize(("mode", "shapes"), sample_layouts(12))
def test_generated_layouts_round_trip_with_te(mode: Mode, shapes: list[tuple[int, ...]]) -> None:
    from transformer_engine.pytorch.optimizers import FusedAdam

    install()

    def build(seed: int) -> Any:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        params = [
            torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).to(mode.param_dtype))
            for s in shapes
        ]
        opt = FusedAdam(params, lr=1e-2, **mode.te_kwargs())
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(p.dtype)
        opt.step()
        return opt

    source = build(1)
    with export_placement(None):
        te_export = copy.deepcopy(source.state_dict())
    with export_placement("cpu"):
        first = source.state_dict()
    assert_same_export(first, te_export)
    saved = through_torch_save(first)
    target, reference = build(2), build(2)
    with export_placement("cpu"):
        target.load_state_dict(saved)
    reference.load_state_dict(copy.deepcopy(saved))
    assert all(
        torch.equal(a, b) for a, b in zip(live_bits(target), live_bits(reference), strict=True)
    )
    with export_placement("cpu"):
        second = target.state_dict()
    with export_placement(None):
        assert_same_export(second, copy.deepcopy(reference.state_dict()))
    if not mode.scaled:  # TE re-derives FP16/FP8 scales on load: only TE's own result is exact
        assert_same_export(second, first)
