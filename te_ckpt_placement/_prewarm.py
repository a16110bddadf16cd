"""``prewarm``: the host buffers of an optimizer's next export, sized and faulted in at setup.

A first export writes into never-touched memory, and its page faults, not the copies, bound it.
``Placement(reuse_buffers=True)`` keeps the buffers for the next export; this makes them before
the first one, one per state as that export will take them (:data:`._pool.EXPORTS`), faults
them in on the host workers, starts the workers' team and makes each device's staging ring. The raw
snapshot's buffers are made by ``dcp.SnapshotStager.prewarm``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _convert, _pool, _ring, _workers
from ._policy import Placement, current_placement
from ._te_contract import Contract
from ._te_initial_states import initialized_for_load


def _placement(optimizer: Any, placement: Placement | None) -> Placement:
    chosen = placement or current_placement() or getattr(optimizer, "state_dict_placement", None)
    if not isinstance(chosen, Placement) or not chosen.streams or not chosen.reuse_buffers:
        raise ValueError(
            f"prewarm makes the host buffers that exports with Placement(reuse_buffers=True) "
            f"reuse, but the policy here is {chosen!r}. Pass "
            "placement=Placement(device='cpu', reuse_buffers=True) (and export under that "
            "policy), or call it inside that export_placement block."
        )
    return chosen


def export_buffers(optimizer: Any, placement: Placement) -> list[tuple[torch.Size, torch.dtype]]:
    """The shape and dtype of each host buffer an export of ``optimizer`` takes, in order.

    An optimizer without states yet (before its first step) is given TE's initial states for
    the count and has them taken back (:func:`._te_initial_states.initialized_for_load`).
    """
    contract = Contract.of(optimizer)
    shapes: list[tuple[torch.Size, torch.dtype]] = []
    with initialized_for_load(optimizer):
        params = (p for group in optimizer.param_groups for p in group["params"])
        for index, param in enumerate(params):
            for name, value in optimizer.state.get(param, {}).items():
                source = contract.describe(param, name, value, placement, index)
                if source.kind == "device":  # TE's FP32 result of the state's local shape
                    facts = contract.facts(param, name)
                    assert facts is not None
                    shapes.append((torch.Size(facts.local_shape), torch.float32))
                else:
                    assert source.data is not None
                    shapes.append((source.data.shape, _convert.convert_fn(source)[0]))
                del source
    return shapes


def prewarm(optimizer: Any, *, placement: Placement | None = None) -> int:
    """Makes and faults in the host buffers of ``optimizer``'s next export; returns their bytes.

    Call it once at setup, after the optimizer is built: the first export under a
    ``Placement(reuse_buffers=True)`` policy then writes into warm memory and is as fast as the
    next. ``placement`` defaults to the active policy, else the optimizer's own
    ``state_dict_placement``; it must stream with ``reuse_buffers=True`` (``ValueError``
    otherwise). It costs the host memory of one export, held until ``release_buffers()`` (4
    bytes per element of each FP32, BF16, FP16 or FP8 state and 2 per int16 remainder), plus a
    48 MiB pinned staging ring per device and the host workers' threads.
    """
    placement = _placement(optimizer, placement)
    with _workers.sized(placement.host_workers) as workers:
        shapes = export_buffers(optimizer, placement)
        if workers > 1:
            _workers.start(workers)
        devices = {param.device for g in optimizer.param_groups for param in g["params"]}
        for device in devices:
            with _ring.lend(device):  # made now and pooled for the export
                pass
        round_ = object()
        buffers = [_pool.EXPORTS.take(shape, dtype, round=round_) for shape, dtype in shapes]
        for buffer in buffers:
            _pool.touch_pages(buffer)
        _pool.EXPORTS.end_round(round_)
        return sum(b.numel() * b.element_size() for b in buffers)
