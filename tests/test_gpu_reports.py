"""The per-operation reports against the CUDA allocator, with real TE."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from te_ckpt_placement import export_placement, last_report


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name",
    [
        "bf16/bf16/remainder",
        "bf16/fp32-master",
        "bf16/fp16/fp32-master",
        "bf16/fp8/remainder",
        "fp32-params/fp16+fp8",
    ],
)
def test_gpu_reports_match_the_allocator(name: str) -> None:
    from te_ckpt_placement import install

    from .support.helpers import peak_extra
    from .support.te_cases import MODES, make_params, make_te_optimizer
    from .support.te_cases import train as te_train

    install()
    mode = next(m for m in MODES if m.name == name)
    opt = make_te_optimizer(mode, make_params(mode))
    te_train(opt)

    def te_export_() -> Any:
        with export_placement(None):
            return opt.state_dict()

    def te_load_() -> None:
        with export_placement(None):
            opt.load_state_dict(copy.deepcopy(checkpoint))

    te_sd, te_export = peak_extra(te_export_)
    del te_sd
    with export_placement("cpu"):
        checkpoint, ours_export = peak_extra(opt.state_dict)
    report = last_report()
    assert report is not None and report.op == "export" and not report.failed
    assert report.gpu_bytes == ours_export == 0
    # TE's FP32 copies, each in whole 512-byte blocks.
    assert 0 <= te_export - report.te_gpu_bytes <= 512 * report.states
    _, te_load_peak = peak_extra(te_load_)
    with export_placement("cpu"):
        _, ours_load = peak_extra(lambda: opt.load_state_dict(checkpoint))
    report = last_report()
    assert report is not None and report.op == "load" and not report.failed
    # Our FP32 copy of the largest FP16/FP8 state, in 512-byte blocks, and TE's one-element
    # scaling temporaries.
    assert report.gpu_bytes <= ours_load <= -(-report.gpu_bytes // 512) * 512 + 16 * 512
    if not mode.scaled:
        # TE's peak is torch's bulk cast (each cast in whole 512-byte blocks).
        assert 0 <= te_load_peak - report.te_gpu_bytes <= 512 * report.states
