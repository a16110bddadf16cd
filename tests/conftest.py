"""Skips GPU tests cleanly where CUDA, Transformer Engine or enough GPUs are missing."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

#: GPUs a ``multigpu`` test needs unless it says more (``@pytest.mark.multigpu(4)``).
MULTIGPU_DEFAULT = 2


@functools.cache
def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA/TE install
        return f"needs Transformer Engine for PyTorch ({type(exc).__name__}: {exc})"
    return None


def required_gpus(marker: pytest.Mark) -> int:
    """The GPUs a ``multigpu`` marker asks for: 2 bare, ``n`` as ``multigpu(n)``."""
    if not marker.args and not marker.kwargs:
        return MULTIGPU_DEFAULT
    n = marker.args[0] if len(marker.args) == 1 and not marker.kwargs else None
    if not isinstance(n, int) or isinstance(n, bool) or n < MULTIGPU_DEFAULT:
        raise pytest.UsageError(
            f"unsupported marker {marker.name}{marker.args or ''}{marker.kwargs or ''}: valid "
            f"values are @pytest.mark.multigpu ({MULTIGPU_DEFAULT} GPUs) or "
            f"@pytest.mark.multigpu(n) with an int n >= {MULTIGPU_DEFAULT}"
        )
    return n


def skip_reason(item: pytest.Item, device_count: int) -> str | None:
    """Why ``item`` cannot run with ``device_count`` GPUs (None: it can, or it needs none)."""
    multi = item.get_closest_marker("multigpu")
    if multi is None and item.get_closest_marker("gpu") is None:
        return None
    needed = 1 if multi is None else required_gpus(multi)  # a bad marker fails without a GPU too
    reason = gpu_skip_reason()
    if reason is None and device_count < needed:
        reason = f"needs {needed} CUDA GPUs"
    return reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        reason = skip_reason(item, count)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def hooked_standin() -> Iterator[None]:
    """The CPU stand-in's state_dict/load_state_dict follow the policy, as TE's do once hooked."""
    from te_ckpt_placement import _te_hooks as te_hooks

    from .support.standin import StandInFusedAdam

    te_hooks.patch_class(StandInFusedAdam)
    yield
    te_hooks.unpatch_class(StandInFusedAdam)
