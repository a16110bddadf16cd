"""The streaming import: TE FusedAdam's ``load_state_dict`` without its bulk cast, pipelined.

TE's own load (fused_adam.py L515-548 in TE 2.20.2,
https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py)
first lets torch cast every state of the checkpoint to the parameter's device and dtype, all at
once, then ignores those casts and converts each checkpoint value again through
``set_scaled_state`` (L366-395): for a BF16 state ``_apply_scale`` (L276-310) rounds the FP32
value to BF16 on the checkpoint's device (the host, for a host checkpoint) and copies it to the
GPU; FP32 and int16 states are a plain copy; FP16 and FP8 states are scaled on the GPU.

This module validates the whole checkpoint first, then writes every state into the live one, in
place where its storage fits (``_te_load_write._reusable``): BF16, FP32 and int16 states from host
tensors through the pinned pipeline of :class:`te_ckpt_placement._upload.Uploader` (host
conversion of chunk k+1 overlapped with the copy of chunk k, many small states per chunk, no GPU
memory), FP16 and FP8 states through TE's own
``set_scaled_state`` on an FP32 device copy of the state (small ones pieces of one shared copy no
larger than the largest state's), and device-resident checkpoints on the device, one state at a
time. The result is TE's load bit for bit. It reads TE's private
``_scales`` (L214, L452) and calls ``_initialize_state`` (L397-455) where TE's load would create a
state, and uses the storage rule of :mod:`te_ckpt_placement._te_contract`, whose facts about each
state (:class:`~te_ckpt_placement._te_contract.Contract`) are computed once per load.

This module holds the entry points; the checks are in :mod:`._te_load_check`, the writes in
:mod:`._te_load_write`, a fresh optimizer's initial states in :mod:`._te_initial_states`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import _convert, _te_cost, _te_load_check, _tensors
from . import _reports as reports
from ._te_contract import Contract
from ._te_initial_states import group_steps as group_steps
from ._te_initial_states import initialize_states as initialize_states
from ._te_initial_states import initialized_for_load as initialized_for_load
from ._te_initial_states import note_loaded
from ._te_initial_states import take_back_initial_states as take_back_initial_states
from ._te_load_check import Job, checked_jobs, job
from ._te_load_check import check_value as check_value
from ._te_load_check import plan_load as plan_load
from ._te_load_write import PartialLoadError as PartialLoadError
from ._te_load_write import _Rollback, _write_all


@contextmanager
def post_hooks_deferred(optimizer: Any) -> Iterator[OrderedDict[Any, Any]]:
    """Holds back torch's load post-hooks while torch's part of the load runs.

    Yields the hooks to run, with torch's arguments (the optimizer), once the states are written.
    """
    hooks = getattr(optimizer, "_optimizer_load_state_dict_post_hooks", None)
    if not isinstance(hooks, OrderedDict):
        yield OrderedDict()  # a torch without them: nothing to defer
        return
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        yield hooks
    finally:
        optimizer._optimizer_load_state_dict_post_hooks = hooks


@reports.operation("load")
def stream_load_state_dict(
    optimizer: Any, state_dict: Any, owner: type, *, rollback: bool = False
) -> None:
    """TE's ``load_state_dict`` (L515-548) without torch's bulk cast of every state to the GPU.

    The whole checkpoint is validated first (:func:`plan_load`): a checkpoint that does not fit
    raises ``ValueError`` before anything changes. torch's ``Optimizer.load_state_dict`` then
    loads the groups and unknown keys, every state goes from the checkpoint into the live state
    (see the module docstring), and torch's load post-hooks run last, with the states in place.
    The checkpoint is never modified.

    A failure part-way (an allocation, a device error, a KeyboardInterrupt) puts the previous
    state back when ``rollback`` is set (see _Rollback); otherwise it raises
    :class:`PartialLoadError` (a KeyboardInterrupt propagates with a note) saying how many states
    were written, and loading the same checkpoint again repairs the optimizer.
    """
    contract = Contract.of(optimizer)
    plan = _te_load_check.plan(contract, state_dict)
    _count_te_cost(contract, plan, bulk_cast=True)
    # The live states, before torch replaces optimizer.state.
    live = {param: dict(optimizer.state.get(param, {})) for _, param, _ in plan}
    planned = {index for index, _, _ in plan}
    # torch handles param_groups, pre-hooks and unknown keys; each param's entry is an empty
    # dict, so it casts nothing but keeps the entry order TE's load would produce.
    stripped = dict(state_dict)
    stripped["state"] = {k: ({} if k in planned else v) for k, v in state_dict["state"].items()}
    undo = _Rollback(optimizer) if rollback else None
    with post_hooks_deferred(optimizer) as post_hooks:
        # Changes nothing if it fails (torch sets the new state last).
        super(owner, optimizer).load_state_dict(stripped)  # type: ignore[arg-type]

    def prepare() -> list[Job]:
        jobs = []
        for index, param, entries in plan:
            # TE empties each param's states (L536); the live tensors stay for in-place writes.
            optimizer.state[param] = {
                name: live[param][name] for name in entries if name in live[param]
            }
            jobs += [job(contract, index, param, name, v) for name, v in entries.items()]
        live.clear()  # the states TE's load drops are freed before anything is allocated
        return jobs

    _write_all(optimizer, prepare, undo)
    for _, param, entries in plan:
        state = optimizer.state[param]
        if list(state) != list(entries):  # TE's order: the checkpoint's (new states went last)
            optimizer.state[param] = {name: state[name] for name in entries}
    for hook in post_hooks.values():
        hook(optimizer)
    note_loaded(optimizer)


@reports.operation("load")
def reload_in_place(
    optimizer: Any,
    state_dict: Any,
    owner: type,
    params: list[torch.Tensor],
    *,
    later: list[tuple[torch.Tensor, str]] | None = None,
) -> None:
    """TE's ``load_state_dict(optimizer.state_dict())`` without exporting anything.

    For a ``state_dict`` whose states are the live ones (``params`` in its order), as Megatron's
    ``DistributedOptimizer.load_state_dict`` hands TE's own export back to TE's load. TE's round
    trip leaves each state as ``set_scaled_state(param, name, get_unscaled_state(param, name))``
    (L515-548 with L327-395): FP32 and int16 states as they were, BF16 states rounded back (a
    NaN becomes the canonical one), FP16 and FP8 states rescaled from their absmax. torch's load
    takes the groups, then each FP16/FP8 state is set from its own unscaled value by TE's two
    calls, on the device, one FP32 copy at a time, and each BF16 state by TE's two elementwise
    conversions a piece at a time, into the live storage. A failure part-way
    leaves every state valid: those already set as TE's round trip leaves them, the rest as they
    were.

    ``later``: the BF16 and FP16 states are not set here but listed in it, ``(param, name)``,
    for :func:`round_trip` (unless torch's load post-hooks are registered, which must see them
    set). A caller about to overwrite some of them (Megatron's load writes the checkpoint's
    states next) then sets only the others: what TE's round trip leaves in those two kinds is a
    function of the state alone, which an overwrite replaces completely (a BF16 copy; FP16's
    data and scale, ``_apply_scale`` L276-310). FP8 states are set here: TE's FP8 copy can keep
    something of the old value in its quantizer's amax.
    """
    contract = Contract.of(optimizer)
    live = {param: optimizer.state[param] for param in params}
    if reports.active() is not None:  # TE's round trip: its export, then its load's bulk cast
        plan = [
            (
                contract.position(param),
                param,
                {n: _device_fp32(v) for n, v in states.items() if isinstance(v, torch.Tensor)},
            )
            for param, states in live.items()
        ]
        _count_te_cost(contract, plan, bulk_cast=True)
    stripped = dict(state_dict)
    stripped["state"] = {k: {} for k in state_dict["state"]}
    try:
        with post_hooks_deferred(optimizer) as post_hooks:
            super(owner, optimizer).load_state_dict(stripped)  # type: ignore[arg-type]
    finally:  # torch's load empties each param's states: the live ones go back, whatever happens
        optimizer.state.update(live)
    for param, states in live.items():
        for name in states:
            facts = contract.facts(param, name)
            if facts is None or facts.te_dtype == torch.float32:
                continue  # TE's round trip copies FP32 states and int16 remainders as they are
            if later is not None and not post_hooks and facts.te_dtype != torch.uint8:
                later.append((param, name))
            else:
                _round_trip(optimizer, param, name, facts.te_dtype)
    for hook in post_hooks.values():
        hook(optimizer)
    note_loaded(optimizer)


def round_trip(optimizer: Any, states: Iterable[tuple[torch.Tensor, str]]) -> None:
    """Sets each ``(param, name)`` state as TE's ``load_state_dict(state_dict())`` leaves it:
    the states :func:`reload_in_place` listed in ``later``."""
    contract = Contract.of(optimizer)
    for param, name in states:
        facts = contract.facts(param, name)
        assert facts is not None
        _round_trip(optimizer, param, name, facts.te_dtype)


def _round_trip(optimizer: Any, param: torch.Tensor, name: str, kind: torch.dtype) -> None:
    local = _tensors.local(optimizer.state[param][name])
    if kind == torch.bfloat16 and local.is_contiguous():
        _round_bf16_in_place(local)
    else:
        optimizer.set_scaled_state(param, name, optimizer.get_unscaled_state(param, name))
    reports.state_written()


#: Elements per piece of :func:`_round_bf16_in_place`: 2 MiB of FP32 on the device at a time.
_ROUND_PIECE = 1 << 19


def _round_bf16_in_place(stored: torch.Tensor) -> None:
    """A BF16 state set from its own ``get_unscaled_state``: ``stored.float()`` (L348-353), then
    ``_apply_scale``'s ``copy_(unscaled.bfloat16())`` (L279-281). Both are elementwise, so it is
    done a piece at a time, with TE's two conversions, instead of on one FP32 copy of the state."""
    flat = stored.view(-1)
    for start in range(0, flat.numel(), _ROUND_PIECE):
        piece = flat[start : start + _ROUND_PIECE]
        piece.copy_(piece.float().bfloat16())


def _device_fp32(value: Any) -> torch.Tensor:
    """A stand-in for TE's FP32 export of ``value`` (same shape and device, no memory)."""
    local = _tensors.local(value)
    return torch.empty((), dtype=torch.float32, device=local.device).expand(local.shape)


def load_states(
    optimizer: Any,
    states: Iterable[tuple[torch.Tensor, str, Any]],
    *,
    rollback: bool = False,
    round_as_device: bool = False,
) -> None:
    """Writes ``(param, name, value)`` states into a TE FusedAdam exactly as its load would.

    Every triple is validated first (the parameter belongs to the optimizer, the name is a
    FusedAdam state, the value fits its storage); a problem raises ``ValueError`` before anything
    changes. Each state is then written as TE's ``load_state_dict`` writes it (a fresh scale for
    FP16/FP8, TE's rounding), into the live tensor where it fits, through the same pipeline as
    :func:`stream_load_state_dict`. Values may be host or device tensors, or DTensors with the
    parameter's placements. Other states, the groups and the hooks are left alone.

    Args:
        optimizer: A TE ``FusedAdam``.
        states: ``(param, name, value)`` triples; ``param`` is one of ``optimizer``'s parameters.
        rollback: On a failure part-way, put the written states back (a host copy of each
            overwritten state, made as the load goes); otherwise raise :class:`PartialLoadError`.
        round_as_device: The host values stand in for values on the states' devices (Megatron's
            load templates): BF16 states get the bits TE's rounding gives there, which differ
            from the host's in NaNs only (:func:`._convert.device_bf16_nan`).
    """
    with reports.operation("load", path="load_states"):
        _load_states(
            Contract.of(optimizer), states, rollback=rollback, round_as_device=round_as_device
        )


def check_round_as_device(params: Iterable[Any]) -> None:
    """Raises ``RuntimeError`` if the device of one of ``params`` rounds to BF16 in a way that
    ``load_states(round_as_device=True)`` cannot give on the host (checked before a write)."""
    for device in {_tensors.local(p).device for p in params}:
        _convert.device_bf16_nan(device)


def _load_states(
    contract: Contract,
    states: Iterable[tuple[torch.Tensor, str, Any]],
    *,
    rollback: bool,
    round_as_device: bool = False,
) -> None:
    jobs = checked_jobs(contract, states)
    if round_as_device:
        check_round_as_device(j.param for j in jobs)
    _write_jobs(contract, jobs, rollback=rollback, round_as_device=round_as_device)


def _write_jobs(
    contract: Contract, jobs: list[Job], *, rollback: bool, round_as_device: bool = False
) -> None:
    optimizer = contract.optimizer
    _count_te_cost(contract, [(j.index, j.param, {j.name: j.value}) for j in jobs], bulk_cast=False)
    undo = _Rollback(optimizer) if rollback else None
    _write_all(optimizer, lambda: jobs, undo, round_as_device=round_as_device)
    note_loaded(optimizer)


def check_states(
    optimizer: Any,
    states: Iterable[tuple[torch.Tensor, str, Any]],
    *,
    contract: Contract | None = None,
) -> None:
    """Raises the ``ValueError`` that :func:`load_state` would raise for one of ``states``.

    Writes nothing. For a loader that writes each state when its last piece has arrived: checked
    before the first piece is read, a value that ``load_state`` would refuse stops the load before
    any state is written. Only each value's kind, dtype and shape matter (a zero-stride expanded
    tensor of them will do); failures of a write itself (an allocation, a device error) remain
    possible. ``contract`` is the operation's (:func:`write_prepared` then writes the states
    without checking them again); by default, checked here.
    """
    checked_jobs(Contract.of(optimizer) if contract is None else contract, states)


def load_state(optimizer: Any, param: torch.Tensor, name: str, value: Any) -> None:
    """Writes one checkpoint value into a TE FusedAdam state as its ``load_state_dict`` would.

    The per-state entry point for loaders that stream checkpoint items one at a time (a DCP
    load planner): ``value`` (host or device tensor, or a DTensor with ``param``'s placements)
    is validated against the state's storage and written in place where it fits, BF16/FP32/int16
    from the host through the pinned pipeline. A failure after validation leaves that one state
    partly written; writing it again repairs it. See :func:`load_states`. It reports nothing of
    its own (one report per state would drown a DCP load's): inside a running operation it
    counts towards that one (:mod:`te_ckpt_placement._reports`).
    """
    _load_states(Contract.of(optimizer), [(param, name, value)], rollback=False)


def write_prepared(contract: Contract, param: torch.Tensor, name: str, value: Any) -> None:
    """:func:`load_state` of a state that :func:`check_states` accepted with ``contract``.

    For a loader that checks every state before its first read and writes each one later (the
    DCP load planner's assembled states): the write as ``load_state`` makes it, without checking
    the value or looking up the parameter's position again. ``value`` must have the dtype and
    shape that were checked.
    """
    index = contract.position(param)
    _write_jobs(contract, [job(contract, index, param, name, value)], rollback=False)


def _count_te_cost(
    contract: Contract, plan: list[tuple[Any, Any, dict[str, Any]]], *, bulk_cast: bool
) -> None:
    """Reports what TE's own load of ``plan`` would allocate on the device (see reports)."""
    if reports.active() is not None:
        parts = [
            (
                param,
                [
                    (v, facts.te_dtype, facts.remainder)
                    for n, v in entries.items()
                    if (facts := contract.facts(param, n)) is not None
                ],
            )
            for _, param, entries in plan
        ]
        reports.te_cost(_te_cost.te_load_device_bytes(parts, bulk_cast=bulk_cast))
