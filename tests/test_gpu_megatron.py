"""Real Megatron-Core 0.19.2 with real TE on 1 and 2 GPUs, and the CPU stand-in checked against it.

- ``test_the_stand_in_is_megatrons_code``: every method ``tests/support/megatron_verbatim.py``
  copies has exactly the installed ``DistributedOptimizer``'s source, and the integration
  recognizes the installed class (so the CPU tests ran Megatron's own code).
- ``test_megatron_*``: ``benchmarks/megatron_ckpt.py --size test`` under torchrun (a BF16
  GPTModel from Megatron-LM's own setup, ``get_megatron_optimizer`` with BF16, FP16 and FP8
  moments on one GPU, ``dist_checkpointing`` torch_dist saves and loads of every sharding type on
  two), which checks: the placed checkpoints equal Megatron's bit for bit; resuming from them,
  and N steps after, equal resuming from Megatron's; the placed saves' GPU peaks (0 beyond a
  small slack for dp_reshardable, Megatron's own gather buffers for dp_zero_gather_scatter and
  fully_reshardable: ``gather_buffer_bytes``, which for fully_reshardable counts torch's flat
  NCCL ``all_gather`` output, (2·DP + 1) shards of the bucket) and loads' (the loaded states);
  no GPU block alive at a placed save's peak asked for by te_ckpt_placement or TE (the CUDA
  allocator's history, recorded as ``gpu_peak_live`` in every record); a placed dp_reshardable
  save's peak the same, within 32 KiB, for a model of half the width (its metadata collectives
  do not grow with N). Their records are the measurements of docs/megatron.md.

Without megatron-core these skip, unless ``TE_CKPT_REQUIRE_MEGATRON=1`` (the GPU session sets
it), which turns a missing Megatron into a failure. ``TE_CKPT_MEGATRON_OUT=DIR`` keeps each run's
JSON (records and checks) and log in ``DIR``.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from .support import megatron_driver as md
from .support import megatron_standin as ms


def megatron_or_skip() -> Any:
    api = ms.megatron_api()
    if api is None:
        reason = "megatron-core 0.19.2 does not import (install the [megatron] extra)"
        if os.environ.get("TE_CKPT_REQUIRE_MEGATRON") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return api


@pytest.mark.gpu
def test_the_stand_in_is_megatrons_code() -> None:
    from te_ckpt_placement.integrations import megatron

    api = megatron_or_skip()
    real = api.DistributedOptimizer
    megatron.check_megatron(real)
    for name in ms.VERBATIM_METHODS:
        ours = inspect.getattr_static(ms.StandInDistributedOptimizer, name)
        theirs = inspect.getattr_static(real, name)
        if isinstance(ours, property):
            ours, theirs = ours.fget, theirs.fget
        assert inspect.getsource(ours) == inspect.getsource(theirs), name
    assert (
        ms.StandInDistributedOptimizer.checkpoint_fully_reshardable_formats
        == real.checkpoint_fully_reshardable_formats
    )
    assert megatron.megatron_version() == "0.19.2"


# A hung run is stopped here (its JSON, rewritten after every case, and its log are kept), so the
# two runs together stay within a 4-minute GPU session.
TIMEOUT_S = 100


@pytest.mark.gpu
def test_megatron_on_one_gpu(tmp_path: Path) -> None:
    megatron_or_skip()
    result = md.run(1, tmp_path, cpu=False, size="test", timeout=TIMEOUT_S)
    md.assert_cases_ran(result, 1)


@pytest.mark.multigpu
def test_megatron_on_two_gpus(tmp_path: Path) -> None:
    megatron_or_skip()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    result = md.run(2, tmp_path, cpu=False, size="test", timeout=TIMEOUT_S)
    md.assert_cases_ran(result, 2)
