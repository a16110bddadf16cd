"""Real TE on a GPU: host exports equal TE's GPU ``get_unscaled_state`` bit for bit while the
host flushes denormals (FTZ/DAZ) in the calling thread and in torch's intra-op workers.

CUDA does not flush FP32 subnormals by default, so TE's GPU result keeps them; the host
conversion must too, whatever the mode of the thread that converts a block.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from te_ckpt_placement import Placement, export_placement, install
from te_ckpt_placement import _te_contract as te_contract
from te_ckpt_placement._export import materialize

from .support import denormals
from .support.helpers import assert_same_export, bits, exported_tensors
from .support.storage import storage_kwargs
from .support.te_cases import FP8, FP16, Mode, make_params, make_te_optimizer, train

pytestmark = pytest.mark.gpu

# "workers" alone is covered on the CPU; here the calling thread only (what
# torch.set_flush_denormal(True) does) and every thread.
GPU_MODES = ["calling", "all"]


@pytest.fixture(autouse=True)
def hooked() -> Iterator[None]:
    install()
    yield
    torch.cuda.synchronize()


@pytest.fixture(params=GPU_MODES)
def flush_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    with denormals.flushing(request.param):
        yield request.param


def te_export(opt: torch.optim.Optimizer) -> dict:
    with export_placement(None):
        return opt.state_dict()


def mismatch(ours: torch.Tensor, te: torch.Tensor, what: str) -> str | None:
    a, b = bits(ours).view(torch.int32), bits(te).view(torch.int32)
    same = a == b
    if bool(same.all()):
        return None
    where = (~same).nonzero().flatten()[:4].tolist()
    return (
        f"{what}: {int((~same).sum())} of {same.numel()} differ, e.g. at {where}: ours "
        f"{[hex(int(a[i]) & 0xFFFFFFFF) for i in where]} TE "
        f"{[hex(int(b[i]) & 0xFFFFFFFF) for i in where]}"
    )


# Tiny FP32 scale patterns: normal scales whose products can be subnormal, subnormal scales.
TINY_FP8 = [0x05000000, 0x04D55555, 0x01234567, 0x00400001, 0x00000005]
TINY_FP16 = [0x0C800000, 0x0C7FFFFF, 0x08ABCDEF, 0x00123456, 0x00000003]

TRAINED = [
    Mode("bf16/fp8/fp32-master", torch.bfloat16, FP8, FP8, "fp32"),
    Mode("bf16/fp16/fp32-master", torch.bfloat16, FP16, FP16, "fp32"),
]


@pytest.mark.parametrize("mode", TRAINED, ids=lambda m: m.name)
def test_trained_te_states_exact_under_flush(flush_mode: str, mode: Mode) -> None:
    # Large enough (540 K elements) that conversion passes run on every intra-op thread.
    opt = make_te_optimizer(mode, make_params(mode, scale=256))
    train(opt)
    with export_placement("cpu"):
        ours = opt.state_dict()
    assert_same_export(ours, te_export(opt))
    del ours
    # The same states with scales moved to the tiny range, where products are subnormal.
    fp8 = mode.exp_avg == FP8
    for base in TINY_FP8 if fp8 else TINY_FP16:
        k = 0
        for group in opt.param_groups:
            for p in group["params"]:
                for name in ("exp_avg", "exp_avg_sq"):
                    if name not in opt.state.get(p, {}):
                        continue
                    scale = opt.state[p][name]._scale_inv if fp8 else opt._scales[p][name]
                    scale.view(torch.int32).fill_(base + k)  # a few ulps apart, same class
                    k += 1
        assert k > 0
        ref = te_export(opt)
        with export_placement("cpu"):
            ours = opt.state_dict()
        for i, (a, b) in enumerate(zip(exported_tensors(ours), exported_tensors(ref), strict=True)):
            failure = mismatch(a, b, f"state {i}, scales from {hex(base)}")
            assert failure is None, failure


@pytest.mark.parametrize("kind", ["fp8", "fp16"])
def test_every_pattern_times_every_scale_class_against_te(flush_mode: str, kind: str) -> None:
    """Every FP8 byte (FP16 pattern), repeated so that every thread converts some, times every
    scale class of tests/support/denormals.py: host export == TE's GPU conversion."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    moment = FP16 if kind == "fp16" else FP8
    width = 16 if kind == "fp16" else 8
    numel = max(1 << 20, torch.get_num_threads() << 16)
    param = torch.nn.Parameter(torch.zeros(numel, device="cuda", dtype=torch.bfloat16))
    opt = FusedAdam([param], **storage_kwargs(moments=moment, master="none"))
    opt.initialize_state(param, False)
    state = opt.state[param]["exp_avg"]
    every = torch.arange(numel, device="cuda", dtype=torch.int32) & ((1 << width) - 1)
    if kind == "fp16":
        every = torch.where(every >= 1 << 15, every - (1 << 16), every)  # as int16 patterns
        state.copy_(every.to(torch.int16).view(torch.float16))
    else:
        state._data.copy_(every.to(torch.uint8))
    failures = []
    for scale in denormals.SCALES:
        target = opt._scales[param]["exp_avg"] if kind == "fp16" else state._scale_inv
        target.view(torch.int32).fill_(scale - (1 << 32) if scale >> 31 else scale)
        expected = opt.get_unscaled_state(param, "exp_avg")
        source = te_contract.describe_state(
            opt, param, "exp_avg", state, Placement(device="cpu"), index=0
        )
        assert source.kind == ("scaled" if kind == "fp16" else "fp8")
        failure = mismatch(materialize(source), expected, f"{kind} scale {hex(scale)}")
        if failure:
            failures.append(failure)
    assert not failures, "\n".join(failures)
