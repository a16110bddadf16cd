"""prewarm: the next reuse_buffers export's host buffers made before it, and nothing else."""

from __future__ import annotations

import pytest
import torch

from te_ckpt_placement import Placement, _pool, export_placement, prewarm, release_buffers

from .support.helpers import exported_tensors
from .support.standin import make_optimizer, train

pytestmark = pytest.mark.usefixtures("hooked_standin")
REUSE = Placement(device="cpu", reuse_buffers=True)


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float16, torch.uint8], ids=str)
def test_the_first_export_after_prewarm_takes_only_prewarmed_buffers(
    monkeypatch: pytest.MonkeyPatch, moments: torch.dtype
) -> None:
    release_buffers()
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(3000,), (40, 70)]]
    opt = make_optimizer(params, moments=moments, master="remainder")
    train(opt, steps=1)
    made = prewarm(opt, placement=REUSE)
    assert made == _pool.EXPORTS.nbytes > 0
    fresh: list[torch.Size] = []
    allocate = _pool.empty_host
    monkeypatch.setattr(
        _pool, "empty_host", lambda *a, **k: fresh.append(a[0]) or allocate(*a, **k)
    )
    with export_placement(REUSE):
        state = opt.state_dict()
    assert fresh == []  # no fresh host memory: every output is a prewarmed buffer
    kept = {id(k.storage) for group in _pool.EXPORTS._kept.values() for k in group}
    outputs = {id(t.untyped_storage()) for t in exported_tensors(state)}
    assert outputs <= kept and _pool.EXPORTS.nbytes == made
    release_buffers()


def test_prewarm_sizes_a_fresh_optimizer_and_leaves_it_fresh() -> None:
    release_buffers()
    opt = make_optimizer([torch.nn.Parameter(torch.randn(5000))], moments=torch.bfloat16)
    with export_placement(REUSE):
        made = prewarm(opt)
    assert made == 5000 * 4 * 3  # two moments and the FP32 master, exported as FP32
    assert not opt.state  # TE's initial states, made for the count, were taken back
    release_buffers()


@pytest.mark.parametrize("placement", [None, Placement(device="cpu"), Placement(device=None)])
def test_prewarm_without_a_reuse_buffers_policy_says_what_to_pass(placement: object) -> None:
    opt = make_optimizer([torch.nn.Parameter(torch.randn(10))])
    with pytest.raises(
        ValueError, match=r"placement=Placement\(device='cpu', reuse_buffers=True\)"
    ):
        prewarm(opt, placement=placement)  # type: ignore[arg-type]
