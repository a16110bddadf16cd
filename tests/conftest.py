"""Skips GPU tests cleanly where CUDA or Transformer Engine is missing."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch


@functools.cache
def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA/TE install
        return f"needs Transformer Engine for PyTorch ({type(exc).__name__}: {exc})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("multigpu"):
            reason = gpu_skip_reason()
            multi = item.get_closest_marker("multigpu") is not None
            if reason is None and multi and torch.cuda.device_count() < 2:
                reason = "needs 2 CUDA GPUs"
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def hooked_standin() -> Iterator[None]:
    """The CPU stand-in's state_dict/load_state_dict follow the policy, as TE's do once hooked."""
    from te_ckpt_placement import te_hooks

    from .support.standin import StandInFusedAdam

    te_hooks.patch_class(StandInFusedAdam)
    yield
    te_hooks.unpatch_class(StandInFusedAdam)
