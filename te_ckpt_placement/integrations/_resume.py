"""What a placed resume does besides running under the policy (no framework imports).

A streaming policy makes TE FusedAdam's ``load_state_dict`` take each state from host memory
one at a time. The framework around it can still put the checkpoint on the GPU first (a
``torch.load`` with a device ``map_location``, a checkpoint kept on the device it was saved
from), or run torch's fake optimizer step before a distributed load. These helpers are the
integrations' answers:

- :func:`host_load`: ``torch.load`` into host memory, memory-mapped where torch allows;
- :func:`initialize`: TE's initial states built directly, so torch's
  ``get_optimizer_state_dict``/``set_optimizer_state_dict`` skip their fake step (zero
  gradients for every parameter plus the step's temporaries, all on the GPU);
- an FSDP2 optimizer load whose collectives and data stay in host memory: in
  :mod:`._fsdp2_load`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .._policy import current_placement


def streaming() -> bool:
    """True inside a policy that streams (``export_placement("cpu")``)."""
    placement = current_placement()
    return placement is not None and placement.streams


def host_load(path: str | os.PathLike[str], *, mmap: bool, weights_only: bool | None = True) -> Any:
    """``torch.load(path)`` into host memory.

    With ``mmap``, tensors are views of the file mapped into memory: the streaming load reads
    each state from there, so the checkpoint is never copied into fresh host memory as a whole.
    A file in torch's legacy (non-zip) format cannot be mapped and is read normally.
    """
    if mmap:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def _unwrap(optimizer: Any) -> Any:
    # accelerate's AcceleratedOptimizer and Fabric's wrapper expose `.optimizer`; Lightning's
    # LightningOptimizer `._optimizer`.
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def optimizers_in(value: Any) -> list[Any]:
    """The optimizers in ``value``: an optimizer, or a mapping/sequence holding some."""
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.optim.Optimizer)]
    return []


@contextlib.contextmanager
def initialized(optimizers: Iterable[Any]) -> Iterator[None]:
    """Gives each fresh TE FusedAdam in ``optimizers`` its initial states for the load in the
    block, inside a streaming policy only.

    torch then skips its fake step. The states are TE's own initial values (zero moments,
    masters copied from the parameters, the group's step counted), made by
    :func:`te_ckpt_placement._te_load.initialized_for_load`, which takes them back if the block
    loads nothing into that optimizer (a fresh run: frameworks call their resume method then
    too), so training starts as it would without the integration. Optimizers that are not TE
    FusedAdam, or that already have state or gradients, are left alone (torch's own behaviour
    applies).
    """
    with contextlib.ExitStack() as stack:
        if streaming():
            from .._te_contract import has_contract
            from .._te_load import initialized_for_load

            for optimizer in optimizers:
                inner = _unwrap(optimizer)
                if has_contract(inner):
                    stack.enter_context(initialized_for_load(inner))
        yield
