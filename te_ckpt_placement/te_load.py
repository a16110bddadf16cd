"""The streaming import: TE FusedAdam's ``load_state_dict`` without its bulk cast, pipelined.

TE's own load (fused_adam.py L515-548 in TE 2.20.2,
https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py)
first lets torch cast every state of the checkpoint to the parameter's device and dtype, all at
once, then ignores those casts and converts each checkpoint value again through
``set_scaled_state`` (L366-395): for a BF16 state ``_apply_scale`` (L276-310) rounds the FP32
value to BF16 on the checkpoint's device (the host, for a host checkpoint) and copies it to the
GPU; FP32 and int16 states are a plain copy; FP16 and FP8 states are scaled on the GPU.

This module validates the whole checkpoint first, then writes every state into the live one, in
place where its storage fits (:func:`_reusable`): BF16, FP32 and int16 states from host tensors
through the pinned pipeline of :mod:`te_ckpt_placement.upload` (host conversion of chunk k+1
overlapped with the copy of chunk k, no GPU memory), FP16 and FP8 states through TE's own
``set_scaled_state`` on one FP32 device copy of the state, and device-resident checkpoints on the
device, one state at a time. The result is TE's load bit for bit. It reads TE's private
``_scales`` (L214, L452) and calls ``_initialize_state`` (L397-455) where TE's load would create a
state, and uses the storage rule of :mod:`te_ckpt_placement.te_contract`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from . import _ring, _te_cost, engine, reports, upload
from .te_contract import (
    STATE_NAMES,
    check_contract,
    is_remainder,
    local_of,
    raw_storage,
    stored_dtype,
)

__all__ = [
    "PartialLoadError",
    "check_states",
    "check_value",
    "group_steps",
    "initialize_states",
    "initialized_for_load",
    "load_state",
    "load_states",
    "note_loaded",
    "plan_load",
    "post_hooks_deferred",
    "stream_load_state_dict",
    "take_back_initial_states",
]


class PartialLoadError(RuntimeError):
    """A streaming load failed after it had started writing states (``rollback=False``).

    The optimizer then holds a mix of the checkpoint's states and its previous ones. Loading the
    same checkpoint again repairs it completely (the checkpoint itself is never written).

    Attributes:
        written: How many states had been written completely.
        total: How many states the load writes.
        index: The checkpoint key (or parameter position) of the state that failed.
        name: The name of the state that failed.
    """

    def __init__(self, message: str, *, written: int, total: int, index: object, name: str):
        super().__init__(message)
        self.written = written
        self.total = total
        self.index = index
        self.name = name


def _load_error(index: object, name: str | None, problem: str) -> ValueError:
    what = f"state {name!r} of parameter {index}" if name else f"parameter {index}"
    return ValueError(
        f"cannot load the optimizer checkpoint: {what}: {problem}. Nothing was loaded; the "
        "optimizer is unchanged."
    )


def _structure_error(problem: str) -> ValueError:
    return ValueError(
        f"cannot load the optimizer checkpoint: {problem}, as FusedAdam.state_dict() returns. "
        "Nothing was loaded; the optimizer is unchanged."
    )


def _check_structure(optimizer: Any, state_dict: Any) -> None:
    """The shape of the checkpoint dict, before anything reads into it."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise _structure_error("expected a dict with 'state' and 'param_groups'")
    if not isinstance(state_dict["state"], dict):
        found = type(state_dict["state"]).__name__
        raise _structure_error(f"'state' is a {found}; expected a dict of per-parameter dicts")
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, (list, tuple)):
        found = type(saved_groups).__name__
        raise _structure_error(f"'param_groups' is a {found}; expected a list of dicts")
    for i, group in enumerate(saved_groups):
        if not isinstance(group, dict):
            raise _structure_error(
                f"param_groups[{i}] is a {type(group).__name__}; expected a dict with 'params'"
            )
        if "params" not in group:
            raise _structure_error(f"param_groups[{i}] has no 'params'; expected a list of ids")
        ids = group["params"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(k, Hashable) for k in ids):
            raise _structure_error(
                f"param_groups[{i}]['params'] is {type(ids).__name__} {ids!r:.60}; expected a "
                "list of parameter ids"
            )
    groups = optimizer.param_groups
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has a different number of parameter groups ({len(saved_groups)}, "
            f"the optimizer has {len(groups)}). Nothing was loaded."
        )
    for i, (g, s) in enumerate(zip(groups, saved_groups, strict=True)):
        if len(g["params"]) != len(s["params"]):
            raise ValueError(
                f"loaded state dict contains a parameter group ({i}) that doesn't match the size "
                f"of optimizer's group ({len(s['params'])} != {len(g['params'])}). "
                "Nothing was loaded."
            )


def check_value(optimizer: Any, param: torch.Tensor, index: object, name: str, value: Any) -> None:
    """One checkpoint value against the optimizer's storage of that state, as the streaming load
    checks it: raises the load's ``ValueError`` (naming ``index`` and ``name``) where it would
    refuse ``value``, before anything is written. Loaders that build the values to load from a
    checkpoint of their own (a full-state file sliced per rank) check the checkpoint's value
    with it before any copy: the copy would cast away its dtype."""
    if name not in optimizer.name_to_dtype_map:
        raise _load_error(index, name, f"TE FusedAdam keeps only {', '.join(STATE_NAMES)}")
    if not isinstance(value, torch.Tensor):
        raise _load_error(index, name, f"expected a tensor, found {type(value).__name__}")
    if (
        isinstance(value, DTensor)
        and isinstance(param, DTensor)
        and tuple(value.placements) != tuple(param.placements)
    ):
        raise _load_error(
            index,
            name,
            f"sharded as {tuple(value.placements)}, the parameter as "
            f"{tuple(param.placements)}; load it through DCP, which reshards",
        )
    local = local_of(value)
    if local.is_nested:
        raise _load_error(index, name, "is a nested tensor; expected a dense tensor")
    if local.layout != torch.strided:
        raise _load_error(
            index, name, f"has layout {local.layout}; expected a dense tensor (.to_dense())"
        )
    if local.is_meta:
        raise _load_error(
            index,
            name,
            "is on the meta device and holds no values; load the checkpoint's data "
            "(e.g. torch.load(..., map_location='cpu'))",
        )
    if local.is_quantized:
        raise _load_error(index, name, "is a quantized tensor; dequantize it first")
    if local.is_complex():
        raise _load_error(index, name, f"has complex dtype {local.dtype}; TE keeps real states")
    expected = tuple(local_of(param).shape)
    if tuple(local.shape) != expected:
        raise _load_error(
            index,
            name,
            f"local shape {tuple(local.shape)} does not match the parameter's {expected}",
        )
    remainder = is_remainder(optimizer, param, name)
    if remainder and local.dtype != torch.int16:
        raise _load_error(
            index,
            name,
            f"stored as {local.dtype}, but this optimizer keeps int16 remainders "
            "(store_param_remainders=True); load with the setting the checkpoint was "
            "saved with",
        )
    if not remainder and not local.is_floating_point():
        raise _load_error(
            index,
            name,
            f"stored as {local.dtype}, but this optimizer keeps floating-point states"
            + (
                " (an int16 master_param comes from store_param_remainders=True)"
                if local.dtype == torch.int16
                else ""
            ),
        )
    if optimizer.name_to_dtype_map[name] in (torch.float16, torch.uint8) and local.numel() == 0:
        # TE's _apply_scale takes the aminmax of the state (L298), which fails on no elements.
        raise _load_error(index, name, "TE cannot scale an empty FP16/FP8 state")


def plan_load(
    optimizer: Any, state_dict: Any
) -> list[tuple[Any, torch.Tensor, dict[str, torch.Tensor]]]:
    """Validates a checkpoint against the optimizer without touching either.

    Checks what torch's and TE's ``load_state_dict`` would check, and what they would fail on
    part-way or silently get wrong: the dict's structure, group layout, state names, local
    shapes, tensor kinds (meta, sparse, nested, quantized, complex), and int16 remainders against
    FP32 masters. Every problem is a ``ValueError`` naming it.

    Returns:
        ``[(index, param, {name: value})]``: every state to load, in checkpoint order.
    """
    _check_structure(optimizer, state_dict)
    id_map = engine.indexed_params(state_dict["param_groups"], optimizer.param_groups)
    plan = []
    for index, states in state_dict["state"].items():
        if index not in id_map:
            continue  # kept as is, like torch; TE ignores it
        param = id_map[index]
        if not isinstance(states, dict):
            raise _load_error(index, None, f"expected a dict of states, found {type(states)}")
        entries: dict[str, torch.Tensor] = {}
        for name, value in states.items():
            if value is None:
                continue
            check_value(optimizer, param, index, name, value)
            entries[name] = value
        plan.append((index, param, entries))
    return plan


def _reusable(optimizer: Any, param: torch.Tensor, name: str, live: Any) -> Any:
    """The live state tensor to write into, or None when a new one must be allocated."""
    if live is None or isinstance(live, DTensor) != isinstance(param, DTensor):
        return None
    stored = raw_storage(optimizer, param, name, live)
    if not isinstance(stored, torch.Tensor):
        return None
    if stored.dtype != stored_dtype(optimizer, param, name):
        return None
    if tuple(stored.shape) != tuple(local_of(param).shape):
        return None
    if upload.memory_order(stored) is None:
        return None
    if optimizer.name_to_dtype_map[name] != torch.float32 and name not in optimizer._scales.get(
        param, {}
    ):
        return None
    return live


def _written_tensors(optimizer: Any, param: torch.Tensor, name: str, live: Any) -> list[Any]:
    """Every tensor a load writes for one state: its storage, FP8 metadata, and its scale."""
    local = local_of(live)
    out: list[Any] = []
    if hasattr(local, "_data"):  # FP8: bytes, scale_inv, the transpose, the quantizer's tensors
        out += [getattr(local, attr, None) for attr in ("_data", "_scale_inv", "_transpose")]
        quantizer = getattr(local, "_quantizer", None)
        out += [getattr(quantizer, attr, None) for attr in ("scale", "amax")]
    else:
        out.append(local)
    out.append(optimizer._scales.get(param, {}).get(name))
    return [t for t in out if isinstance(t, torch.Tensor)]


class _Rollback:
    """What a failed load must put back: the replaced containers and overwritten tensor bytes.

    The containers (``state``, ``param_groups``, ``_scales`` entries) are kept by reference; a
    tensor written in place is copied to host memory just before its write. So the rollback costs
    host memory equal to the live states the load overwrites (R bytes, never GPU memory) and one
    device-to-host copy of each, made as the load goes.
    """

    def __init__(self, optimizer: Any) -> None:
        self.state = optimizer.state
        # Each parameter's own dict and what it held: load_states writes into these dicts in
        # place (replacing or adding states), where torch's part of a load swaps the mapping.
        self.entries = {p: (d, dict(d)) for p, d in optimizer.state.items()}
        self.param_groups = optimizer.param_groups
        self.scales = {p: dict(d) for p, d in optimizer._scales.items()}
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(self, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            self.saved.append((tensor, tensor.to("cpu", copy=True)))
            reports.kept(tensor.numel() * tensor.element_size())

    def keep_state(self, optimizer: Any, param: torch.Tensor, name: str, live: Any) -> None:
        for tensor in _written_tensors(optimizer, param, name, live):
            self.keep(tensor)

    def restore(self, optimizer: Any) -> None:
        with torch.no_grad():
            for tensor, host in reversed(self.saved):
                tensor.copy_(host)
        for param in [p for p in self.state if p not in self.entries]:
            del self.state[param]
        for param, (entry, held) in self.entries.items():
            entry.clear()
            entry.update(held)
            self.state[param] = entry
        optimizer.state = self.state
        optimizer.param_groups = self.param_groups
        optimizer._scales.clear()
        optimizer._scales.update(self.scales)


@dataclass
class _Job:
    """One state to write: where it came from (for messages) and the checkpoint value."""

    index: object
    param: torch.Tensor
    name: str
    value: torch.Tensor

    @property
    def local(self) -> Any:
        return local_of(self.value)


def _plain(t: Any) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


class _Span(NamedTuple):
    """The bytes a tensor can touch, and whose they are (a job's source or its destination)."""

    device: tuple[str, int]
    first: int
    end: int
    written: bool
    job: int


def _span(t: Any, written: bool, job: int) -> _Span | None:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    try:
        base = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass
        return None
    size = t.element_size()
    first = base + int(t.storage_offset()) * size
    extent = sum((int(n) - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride(), strict=True))
    device = (t.device.type, -1 if t.device.index is None else t.device.index)
    return _Span(device, first, first + (extent + 1) * size, written, job)


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def _aliased(optimizer: Any, jobs: list[_Job]) -> set[int]:
    """The jobs whose live state shares memory with a checkpoint value.

    Writing such a state in place would change a value that this or a later write reads, and
    the caller's checkpoint (a view of a live state, a DTensor's local tensor, FP8 bytes). Those
    states get fresh memory instead, as TE's load gives every state, and the old tensor lives on
    as the checkpoint's value. A value that is exactly its own FP32 or int16 state (TE's own
    export returns those live tensors) is written onto itself unchanged and needs nothing.
    """
    spans: list[_Span] = []
    for j, job in enumerate(jobs):
        local = job.local
        span = _span(local if _plain(local) else getattr(local, "_data", None), False, j)
        if span is not None:
            spans.append(span)
        live = optimizer.state.get(job.param, {}).get(job.name)
        if live is None or _reusable(optimizer, job.param, job.name, live) is None:
            continue
        for tensor in _written_tensors(optimizer, job.param, job.name, live):
            span = _span(tensor, True, j)
            if span is not None:
                spans.append(span)
    spans.sort(key=lambda s: (s.device, s.first))
    clobbered: set[int] = set()
    active: list[_Span] = []
    for span in spans:
        active = [a for a in active if a.device == span.device and a.end > span.first]
        for other in active:
            if other.written == span.written:
                continue
            dst, src = (other, span) if other.written else (span, other)
            job = jobs[dst.job]
            if dst.job == src.job and _raw_write(optimizer, job) and _plain(job.local):
                live = local_of(optimizer.state[job.param][job.name])
                if _identical(live, job.local):
                    continue
            clobbered.add(dst.job)
        active.append(span)
    return clobbered


def _raw_write(optimizer: Any, job: _Job) -> bool:
    """Whether the state is stored as the checkpoint holds it (FP32 from FP32, int16)."""
    if is_remainder(optimizer, job.param, job.name):
        return True
    return bool(
        optimizer.name_to_dtype_map[job.name] == torch.float32 and job.local.dtype == torch.float32
    )


@contextmanager
def _uploaders() -> Iterator[Any]:
    """Uploaders by device, entered on first use; leaving waits for every copy."""
    with ExitStack() as stack:
        open_: dict[torch.device, _ring.Uploader] = {}

        def get(device: torch.device) -> _ring.Uploader:
            if device not in open_:
                open_[device] = stack.enter_context(_ring.Uploader(device))
            return open_[device]

        yield get


def _write_one(
    optimizer: Any, job: _Job, uploader: Any, undo: _Rollback | None, fresh: bool
) -> None:
    """Writes one state as TE's ``load_state_dict`` leaves it (L532-548 with L366-455)."""
    param, name = job.param, job.name
    state = optimizer.state[param]
    remainder = is_remainder(optimizer, param, name)
    kind = optimizer.name_to_dtype_map[name]
    live = state.get(name)
    if live is not None and (fresh or _reusable(optimizer, param, name, live) is None):
        del state[name]
        live = None
    if live is not None:
        if undo is not None:
            undo.keep_state(optimizer, param, name, live)
        if kind != torch.float32:
            # TE's load starts every scale from a fresh torch.ones (L452).
            optimizer._scales[param][name].fill_(1.0)
    else:
        # What set_scaled_state does for a missing state (L387-388); TE's load gets there for
        # every state, as it empties the param's dict first (L536).
        optimizer._initialize_state(param, name, False, remainder)
        live = state[name]
    value = job.local
    device = local_of(param).device
    if not _plain(value):  # a tensor subclass: TE's own conversion, as TE's load runs it
        reports.device_temporary(_te_cost.te_state_device_bytes(value, device, kind, remainder))
        optimizer.set_scaled_state(param, name, value if remainder else value.float())
        return
    if remainder or kind in (torch.float32, torch.bfloat16):
        dst = local_of(live)
        if value.device.type == "cpu":
            uploader(dst.device).write(dst, value)
        else:
            upload.write_device(dst, value)
        return
    # FP16 and FP8: TE scales on the state's device (_apply_scale, L276-310), from one FP32 copy
    # of the state; it moves a value from elsewhere there itself (L296) and scales a value
    # already there where it is, FP16 in place (L307).
    if value.device.type == "cpu" and (
        device.type != "cpu" or upload.memory_order(value) is not None
    ):
        # The pinned pipeline. On a GPU into one contiguous FP32 copy: TE's scaling there is
        # elementwise plus an exact absmax, so the layout cannot change a bit, and a strided
        # copy would make aminmax allocate a second one. On the host (the CPU stand-in) into
        # the layout TE's move would give, as host arithmetic can depend on it.
        up = uploader(device)
        strides = (
            upload.te_layout_like(value, torch.float32)
            if device.type == "cpu"
            else torch.empty(value.shape, device="meta").stride()
        )
        unscaled = torch.empty_strided(value.shape, strides, device=device)
        reports.device_temporary(4 * value.numel())
        try:
            up.write(unscaled, value)
            up.fence()
            optimizer.set_scaled_state(param, name, unscaled)
        finally:
            # Freed on the current stream after the fence, so no copy still writes it; and
            # not kept alive by the traceback of a failure.
            del unscaled
        return
    unscaled = value.float()
    if kind == torch.float16 and unscaled is value and value.device == device:
        unscaled = _copy_as_is(value)  # TE would scale the caller's tensor in place
    # On the state's device: this copy, or TE's move there of a value from elsewhere (L296).
    made = unscaled.untyped_storage().nbytes() if unscaled is not value else 0
    reports.device_temporary(made if unscaled.device == device else 4 * value.numel())
    try:
        optimizer.set_scaled_state(param, name, unscaled)
    finally:
        del unscaled


def _copy_as_is(t: torch.Tensor) -> torch.Tensor:
    """A copy with ``t``'s strides, gaps included (host arithmetic can depend on the layout).

    A ``t`` whose elements may share memory (an expanded tensor, which a hand-built checkpoint
    can hold) gets a contiguous copy instead: TE scales in place (L307), which torch refuses on
    such a tensor, and TE's move to the state's device (L296) makes the same dense copy.
    """
    if upload.may_overlap(t):
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    else:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _note(exc: BaseException, message: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(message)


def _write_all(optimizer: Any, prepare: Callable[[], list[_Job]], undo: _Rollback | None) -> None:
    """Writes the jobs ``prepare`` sets up; on a failure restores (``undo``) or says exactly
    what was written."""
    jobs: list[_Job] = []
    written = 0
    job: _Job | None = None
    try:
        jobs = prepare()
        fresh = _aliased(optimizer, jobs)
        with _uploaders() as uploader, torch.no_grad():
            for i, job in enumerate(jobs):
                _write_one(optimizer, job, uploader, undo, i in fresh)
                written += 1
                reports.state_written()
    except BaseException as exc:
        if undo is not None:
            try:
                undo.restore(optimizer)
            except BaseException as again:
                raise RuntimeError(
                    "loading the optimizer checkpoint failed part-way and restoring the previous "
                    "state failed too: the optimizer is inconsistent; rebuild it before training"
                ) from again
            _note(exc, "te_ckpt_placement: the optimizer's previous state was restored.")
            raise
        if job is None:
            where = "preparing the first write failed"
        elif written < len(jobs):
            where = f"state {job.name!r} of parameter {job.index} failed"
        else:
            where = "waiting for the last copies failed"
        message = (
            f"loading the optimizer checkpoint failed part-way: {written} of {len(jobs)} states "
            f"were written, then {where} ({type(exc).__name__}: {exc}). The optimizer now holds a "
            "mix of the checkpoint's states and its previous ones and must not be used as it is: "
            "call load_state_dict again with the same checkpoint (that repairs it completely; "
            "the checkpoint was not modified) or load another one. Placement(rollback=True) "
            "restores the previous state instead, at the cost of a host copy of the overwritten "
            "states."
        )
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: keep propagating
            _note(exc, message)
            raise
        raise PartialLoadError(
            message,
            written=written,
            total=len(jobs),
            index=job.index if job is not None else None,
            name=job.name if job is not None else "",
        ) from exc


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
    check_contract(optimizer)
    plan = plan_load(optimizer, state_dict)
    _count_te_cost(optimizer, plan, bulk_cast=True)
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

    def prepare() -> list[_Job]:
        jobs = []
        for index, param, entries in plan:
            # TE empties each param's states (L536); the live tensors stay for in-place writes.
            optimizer.state[param] = {
                name: live[param][name] for name in entries if name in live[param]
            }
            jobs += [_Job(index, param, name, value) for name, value in entries.items()]
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


def load_states(
    optimizer: Any, states: Iterable[tuple[torch.Tensor, str, Any]], *, rollback: bool = False
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
    """
    with reports.operation("load"):
        _load_states(optimizer, states, rollback=rollback)


def _load_states(
    optimizer: Any, states: Iterable[tuple[torch.Tensor, str, Any]], *, rollback: bool
) -> None:
    jobs = _checked_jobs(optimizer, states)
    _count_te_cost(
        optimizer, [(j.index, j.param, {j.name: j.value}) for j in jobs], bulk_cast=False
    )
    undo = _Rollback(optimizer) if rollback else None
    _write_all(optimizer, lambda: jobs, undo)
    note_loaded(optimizer)


def _checked_jobs(optimizer: Any, states: Iterable[tuple[torch.Tensor, str, Any]]) -> list[_Job]:
    """The writes of ``states``, each validated as :func:`load_states` documents."""
    check_contract(optimizer)
    position = {
        id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
    }
    jobs: list[_Job] = []
    seen: set[tuple[int, str]] = set()
    for param, name, value in states:
        index = position.get(id(param))
        if index is None:
            raise ValueError(
                f"cannot load state {name!r}: the tensor given as its parameter (shape "
                f"{tuple(getattr(param, 'shape', ()))}) is not a parameter of this optimizer. "
                "Nothing was loaded."
            )
        if (id(param), name) in seen:
            raise _load_error(index, name, "given twice")
        seen.add((id(param), name))
        check_value(optimizer, param, index, name, value)
        jobs.append(_Job(index, param, name, value))
    return jobs


def check_states(optimizer: Any, states: Iterable[tuple[torch.Tensor, str, Any]]) -> None:
    """Raises the ``ValueError`` that :func:`load_state` would raise for one of ``states``.

    Writes nothing. For a loader that writes each state when its last piece has arrived: checked
    before the first piece is read, a value that ``load_state`` would refuse stops the load before
    any state is written. Only each value's kind, dtype and shape matter (a zero-stride expanded
    tensor of them will do); failures of a write itself (an allocation, a device error) remain
    possible.
    """
    _checked_jobs(optimizer, states)


def load_state(optimizer: Any, param: torch.Tensor, name: str, value: Any) -> None:
    """Writes one checkpoint value into a TE FusedAdam state as its ``load_state_dict`` would.

    The per-state entry point for loaders that stream checkpoint items one at a time (a DCP
    load planner): ``value`` (host or device tensor, or a DTensor with ``param``'s placements)
    is validated against the state's storage and written in place where it fits, BF16/FP32/int16
    from the host through the pinned pipeline. A failure after validation leaves that one state
    partly written; writing it again repairs it. See :func:`load_states`. It reports nothing of
    its own (one report per state would drown a DCP load's): inside a running operation it
    counts towards that one (:mod:`te_ckpt_placement.reports`).
    """
    _load_states(optimizer, [(param, name, value)], rollback=False)


def _count_te_cost(
    optimizer: Any, plan: list[tuple[Any, Any, dict[str, Any]]], *, bulk_cast: bool
) -> None:
    """Reports what TE's own load of ``plan`` would allocate on the device (see reports)."""
    if reports.active() is not None:
        parts = [
            (
                param,
                [
                    (v, optimizer.name_to_dtype_map[n], is_remainder(optimizer, param, n))
                    for n, v in entries.items()
                ],
            )
            for _, param, entries in plan
        ]
        reports.te_cost(_te_cost.te_load_device_bytes(parts, bulk_cast=bulk_cast))


# How many loads each optimizer has completed (streaming or TE's own, through the hooks), so that
# initial states built for a load that then loads nothing can be taken back.
_loads: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def note_loaded(optimizer: Any) -> None:
    """Counts a completed load of ``optimizer`` (see :func:`initialized_for_load`)."""
    _loads[optimizer] = _loads.get(optimizer, 0) + 1


@contextmanager
def initialized_for_load(optimizer: Any) -> Iterator[bool]:
    """:func:`initialize_states` for a load that may or may not happen inside the block.

    Frameworks call their resume method also when there is nothing to resume from (a fresh run,
    ``strict=False`` without optimizer state). Initial states built for such a call would change
    training: TE's first step would count as its second. So unless a load of this optimizer
    completes inside the block, the states, scales and step counts it built are taken back on
    exit, and the optimizer is as fresh as before. Yields what ``initialize_states`` returned.
    """
    steps = group_steps(optimizer)
    loads = _loads.get(optimizer, 0)
    created = initialize_states(optimizer)
    try:
        yield created
    finally:
        if created and _loads.get(optimizer, 0) == loads:
            take_back_initial_states(optimizer, steps)


_NO_STEP = object()


def group_steps(optimizer: Any) -> list[Any]:
    """Each param group's ``"step"`` now, for :func:`take_back_initial_states` to restore."""
    return [group.get("step", _NO_STEP) for group in optimizer.param_groups]


def take_back_initial_states(optimizer: Any, steps: list[Any]) -> None:
    """Undoes :func:`initialize_states`: its states and scales, and the groups' step counts as
    ``steps`` (:func:`group_steps` before it) had them."""
    _take_back_states(optimizer)
    for group, step in zip(optimizer.param_groups, steps, strict=True):
        if step is _NO_STEP:
            group.pop("step", None)
        else:
            group["step"] = step


def _take_back_states(optimizer: Any) -> None:
    """Removes every parameter's states and their scales (TE L214: made with the states)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state.pop(param, None)
            optimizer._scales.pop(param, None)


def initialize_states(optimizer: Any) -> bool:
    """Gives every parameter of a fresh optimizer TE's initial states, without a step.

    torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` initialize an optimizer
    that has no state with a fake step (``_init_optim_state``): zero gradients for every
    parameter, then ``step()`` with its temporaries, all on the GPU. TE can build its states
    directly (``initialize_state``, TE 2.20.2 fused_adam.py L456-480, the call its own ``step``
    makes at L630-634), and torch skips its fake step for an optimizer that has state. The
    states are made by TE's own calls, except that an FP32 master is copied from its parameter
    in place, without the FP32 copy of the parameter that TE's initializer makes first
    (:func:`_initialize_param`). Each group's ``"step"`` is counted as TE's step counts it
    (L571-587): a flattened ``set_optimizer_state_dict`` loads only the group keys the live
    groups have, so without the key the checkpoint's step count would be dropped.

    If making a state fails (out of memory, an interrupt), every state and scale made so far is
    taken back before the error propagates, so the optimizer is as fresh as before.

    Returns:
        True if states were created; False (and nothing done) when the optimizer already has
        state or any parameter has a gradient, the cases where torch skips its fake step too.
    """
    check_contract(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return False
    masters = bool(getattr(optimizer, "master_weights", False))
    try:
        with torch.no_grad():
            for param in params:
                _initialize_param(optimizer, param, masters)
    except BaseException:
        # An optimizer with some states would look initialized to the next attempt and to
        # TE's step: take back every state and scale made so far.
        _take_back_states(optimizer)
        raise
    for group in optimizer.param_groups:
        # TE L571-587: the counter of a step, also for an empty group.
        if "step" in group:
            group["step"] += 1
        elif getattr(optimizer, "capturable", False):
            # An empty group takes the device of TE's scratch buffer, made on "cuda" (L193).
            device = group["params"][0].device if group["params"] else torch.device("cuda")
            group["step"] = torch.tensor([1], dtype=torch.int, device=device)
        else:
            group["step"] = 1
    return True


def _initialize_param(optimizer: Any, param: torch.Tensor, masters: bool) -> None:
    """TE's ``initialize_state(param, ...)`` with the same calls, minus its copy of the parameter.

    TE's initializer (TE 2.20.2 fused_adam.py L456-480) makes the moments with
    ``_initialize_state(zero_buffer=True)`` (L463-464), an int16 remainder master with
    ``_initialize_state`` alone (zeros, L465-471 and L418-419), and any other master as an empty
    state filled from ``local_param.clone().detach().float()`` through ``set_scaled_state``
    (L472-480): for a 16-bit parameter a temporary of 6 bytes per element (the clone, then its
    FP32 copy), whatever the moments' dtypes. Here the same calls make every state in the same
    order; an FP32 master is then filled by ``copy_`` from the parameter (the same exact widening,
    no temporary), and an FP16 master, which TE scales by its absmax, from one FP32 copy of the
    parameter (``.float()``, a new tensor for a 16-bit parameter, a clone for an FP32 one, since
    TE's scaling multiplies it in place at L306-308). A quantized parameter, which TE dequantizes
    for its master (L476-477), goes through TE's ``initialize_state`` itself. The result is TE's
    initial state bit for bit.
    """
    remainder = is_remainder(optimizer, param, "master_param")
    local = local_of(param)
    if masters and not remainder and not _plain(local):
        optimizer.initialize_state(param, remainder)
        return
    optimizer._initialize_state(param, "exp_avg", True)
    optimizer._initialize_state(param, "exp_avg_sq", True)
    if not masters:
        return
    optimizer._initialize_state(param, "master_param", False, remainder)
    if remainder:
        return
    if optimizer.name_to_dtype_map["master_param"] == torch.float16:
        source = local.detach()
        value = source.clone() if source.dtype == torch.float32 else source.float()
        optimizer.set_scaled_state(param, "master_param", value)
    else:
        local_of(optimizer.state[param]["master_param"]).copy_(local.detach())
