"""The streaming load's writes: checked :class:`~._te_load_check.Job` s into the live states.

Each state is written as TE FusedAdam's ``load_state_dict`` leaves it (TE 2.20.2 fused_adam.py
L532-548 with ``set_scaled_state`` L366-395 and ``_initialize_state`` L397-455,
https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py),
in place where the live storage fits (:func:`_reusable`), else into fresh memory; it reads TE's
private ``_scales`` (L214, L452). A failure part-way restores the previous state
(:class:`_Rollback`) or raises :class:`PartialLoadError`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from . import _convert, _te_cost, _tensors, _upload
from . import _reports as reports
from ._te_contract import StateFacts, check_live
from ._te_load_check import Job


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


def _reusable(optimizer: Any, facts: StateFacts, param: torch.Tensor, live: Any) -> Any:
    """The live state tensor to write into, or None when a new one must be allocated."""
    if live is None or isinstance(live, DTensor) != isinstance(param, DTensor):
        return None
    stored = facts.raw(live)
    if check_live(facts, stored) is not None:
        return None
    if _tensors.memory_order(stored) is None:
        return None
    if facts.te_dtype != torch.float32 and facts.name not in optimizer._scales.get(param, {}):
        return None
    return live


def _written_tensors(optimizer: Any, param: torch.Tensor, name: str, live: Any) -> list[Any]:
    """Every tensor a load writes for one state: its storage, FP8 metadata, and its scale."""
    local = _tensors.local(live)
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


def _aliased(optimizer: Any, jobs: list[Job]) -> set[int]:
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
        if live is None or _reusable(optimizer, job.facts, job.param, live) is None:
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
                live = _tensors.local(optimizer.state[job.param][job.name])
                if _tensors.identical(live, job.local):
                    continue
            clobbered.add(dst.job)
        active.append(span)
    return clobbered


def _raw_write(optimizer: Any, job: Job) -> bool:
    """Whether the state is stored as the checkpoint holds it (FP32 from FP32, int16)."""
    if job.facts.remainder:
        return True
    return bool(job.facts.te_dtype == torch.float32 and job.local.dtype == torch.float32)


@contextmanager
def _uploaders(round_as_device: bool) -> Iterator[Any]:
    """Uploaders by device, entered on first use; leaving waits for every copy."""
    with ExitStack() as stack:
        open_: dict[torch.device, _upload.Uploader] = {}

        def get(device: torch.device) -> _upload.Uploader:
            if device not in open_:
                open_[device] = stack.enter_context(
                    _upload.Uploader(device, round_as_device=round_as_device)
                )
            return open_[device]

        yield get


class Aside(NamedTuple):
    """A small host value set aside by :func:`_write_one`, uploaded with the others that share a
    staging slot (``Uploader.write_many``): into ``dst``, the live BF16, FP32 or int16 state, or,
    where ``dst`` is None (an FP16 or FP8 state, left as it is until then), into a device FP32
    copy of ``temporary`` bytes that TE then scales from (``set_scaled_state``)."""

    job: Job
    device: torch.device
    dst: torch.Tensor | None
    nbytes: int  # in the staging slot
    temporary: int  # device bytes of its piece of the shared FP32 temporary
    fresh: bool


#: A callable that uploads the states set aside unless one of ``nbytes`` in the slot, holding
#: ``temporary`` device bytes, can join them on ``device`` (None: it cannot).
Room = Callable[[torch.device | None, int, int], None]


def _write_one(
    optimizer: Any,
    job: Job,
    uploader: Any,
    undo: _Rollback | None,
    fresh: bool,
    room: Room,
) -> Aside | None:
    """Writes one state as TE's ``load_state_dict`` leaves it (L532-548 with L366-455).

    A small host value is not copied here but returned (:class:`Aside`), for :func:`_write_all`
    to upload with the others that share a staging slot: a dense BF16, FP32 or int16 state's
    live tensor made ready for it, an FP16 or FP8 state untouched until its copy has landed
    (:func:`_upload_together` then writes it as this would). Before it changes anything, any
    state first calls ``room``, which uploads those set aside unless this one joins them, so the
    states written when something fails are the first ones and the others are as they were.
    """
    param = job.param
    remainder = job.facts.remainder
    kind = job.facts.te_dtype
    value = job.local
    device = _tensors.local(param).device
    host = _plain(value) and value.device.type == "cpu"
    if host and job.facts.scaled and _unscaled_is_dense(value, device):
        numel = value.numel()
        live = optimizer.state[param].get(job.name)
        # A state TE must make first is written on its own: FP8's is quantized from FP32 zeros
        # (TE's _initialize_state, L397-455), a second FP32 copy next to the shared one.
        ready = (
            live is not None
            and not fresh
            and _reusable(optimizer, job.facts, param, live) is not None
        )
        if ready and uploader(device).takes(numel, 4):
            room(device, 4 * numel, 4 * numel)
            return Aside(job, device, None, 4 * numel, _aligned(4 * numel), fresh)
    size = 2 if remainder or kind == torch.bfloat16 else 4
    aside = (
        host
        and (remainder or kind in (torch.float32, torch.bfloat16))
        and uploader(device).takes(value.numel(), size)
    )
    room(device if aside else None, size * value.numel(), 0)
    live = _prepare(optimizer, job, undo, fresh)
    if aside:
        dst = _tensors.local(live)
        if uploader(dst.device).fits(dst):
            return Aside(job, dst.device, dst, size * value.numel(), 0, fresh)
        # A live state laid out densely in another order: written on its own (its scale, reset
        # above, is not read for a BF16 state, and a reusable state was not replaced).
        room(None, 0, 0)
    _write_value(optimizer, job, live, uploader)
    return None


def _prepare(optimizer: Any, job: Job, undo: _Rollback | None, fresh: bool) -> Any:
    """The live state ``job`` is written into, as TE's load makes it (L452, L387-388, L536): the
    reusable one (kept for ``undo``, its scale reset), else a new one."""
    param, name = job.param, job.name
    state = optimizer.state[param]
    live = state.get(name)
    if live is not None and (fresh or _reusable(optimizer, job.facts, param, live) is None):
        del state[name]
        live = None
    if live is not None:
        if undo is not None:
            undo.keep_state(optimizer, param, name, live)
        if job.facts.te_dtype != torch.float32:
            # TE's load starts every scale from a fresh torch.ones (L452).
            optimizer._scales[param][name].fill_(1.0)
        return live
    # What set_scaled_state does for a missing state (L387-388); TE's load gets there for
    # every state, as it empties the param's dict first (L536).
    optimizer._initialize_state(param, name, False, job.facts.remainder)
    return state[name]


def _unscaled_is_dense(value: torch.Tensor, device: torch.device) -> bool:
    """Whether the FP32 device copy TE scales a host FP16 or FP8 value from (see
    :func:`_write_value`) is contiguous, so that it can be a piece of one shared temporary."""
    if device.type != "cpu":
        return True
    if _tensors.memory_order(value) is None:  # TE's move keeps its gaps (_write_value)
        return False
    strides = _tensors.te_layout_like(value, torch.float32)
    return bool(torch.empty_strided(value.shape, strides, device="meta").is_contiguous())


#: Each FP16/FP8 state's piece of a shared FP32 temporary starts this aligned (cudaMalloc's
#: alignment): TE's kernels may load it in vectors, as they load a temporary of its own.
_PIECE_ALIGN = 256


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _PIECE_ALIGN) * _PIECE_ALIGN


def _largest_temporary(jobs: list[Job]) -> dict[torch.device, int]:
    """By device, the bytes of the largest FP32 copy that writing one of ``jobs`` there on its
    own would hold (TE scales a host FP16 or FP8 value from one)."""
    largest: dict[torch.device, int] = {}
    for j in jobs:
        if j.facts.scaled and _plain(j.local) and j.local.device.type == "cpu":
            device = _tensors.local(j.param).device
            largest[device] = max(largest.get(device, 0), 4 * j.local.numel())
    return largest


def _upload_together(
    optimizer: Any, batch: _Batch, uploader: Any, undo: _Rollback | None, scaling: list[Job]
) -> None:
    """Uploads the states set aside together, then has TE scale the FP16 and FP8 ones from
    their pieces of one device FP32 temporary, each written as :func:`_write_value` writes it
    (``scaling`` gets the job of each as its turn comes)."""
    up = uploader(batch.device)
    scaled = [a for a in batch.asides if a.dst is None]
    # The pieces start aligned; the last one ends the temporary (one piece alone: its own copy).
    nbytes = sum(a.temporary for a in scaled[:-1]) + (
        4 * scaled[-1].job.local.numel() if scaled else 0
    )
    unscaled = torch.empty(nbytes // 4, device=batch.device) if scaled else None
    starts = list(itertools.accumulate((a.temporary // 4 for a in scaled), initial=0))
    pieces = [
        unscaled[start : start + a.job.local.numel()].view(a.job.local.shape)
        for a, start in zip(scaled, starts, strict=False)
        if unscaled is not None
    ]
    values = iter(pieces)
    pairs = [(a.dst if a.dst is not None else next(values), a.job.local) for a in batch.asides]
    try:
        if scaled:
            reports.device_temporary(nbytes)
        up.write_many(pairs)
        if scaled:
            up.fence()  # the copies have landed before TE scales from them
            for i, a in enumerate(scaled):
                scaling.append(a.job)
                _prepare(optimizer, a.job, undo, a.fresh)
                optimizer.set_scaled_state(a.job.param, a.job.name, pieces[i])
    finally:
        # Freed on the current stream after the fence, so no copy still writes it; and not kept
        # alive by the traceback of a failure.
        del unscaled, pairs, pieces, values


def _write_value(optimizer: Any, job: Job, live: Any, uploader: Any) -> None:
    """Writes ``job``'s value into ``live``, the state :func:`_write_one` made room in."""
    param, name = job.param, job.name
    remainder = job.facts.remainder
    kind = job.facts.te_dtype
    value = job.local
    device = _tensors.local(param).device
    if not _plain(value):  # a tensor subclass: TE's own conversion, as TE's load runs it
        reports.device_temporary(_te_cost.te_state_device_bytes(value, device, kind, remainder))
        optimizer.set_scaled_state(param, name, value if remainder else value.float())
        return
    if remainder or kind in (torch.float32, torch.bfloat16):
        dst = _tensors.local(live)
        if value.device.type == "cpu":
            uploader(dst.device).write(dst, value)
        else:
            _convert.write_device(dst, value)
        return
    # FP16 and FP8: TE scales on the state's device (_apply_scale, L276-310), from one FP32 copy
    # of the state; it moves a value from elsewhere there itself (L296) and scales a value
    # already there where it is, FP16 in place (L307).
    if value.device.type == "cpu" and (
        device.type != "cpu" or _tensors.memory_order(value) is not None
    ):
        # The pinned pipeline. On a GPU into one contiguous FP32 copy: TE's scaling there is
        # elementwise plus an exact absmax, so the layout cannot change a bit, and a strided
        # copy would make aminmax allocate a second one. On the host (the CPU stand-in) into
        # the layout TE's move would give, as host arithmetic can depend on it.
        up = uploader(device)
        strides = (
            _tensors.te_layout_like(value, torch.float32)
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
    if _tensors.may_overlap(t):
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    else:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _note(exc: BaseException, message: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(message)


class _Batch(NamedTuple):
    """States set aside to be uploaded together, on one device."""

    device: torch.device
    asides: list[Aside]
    nbytes: int  # in the staging slot
    temporary: int  # device bytes of the FP16/FP8 states' FP32 copies


def _write_all(
    optimizer: Any,
    prepare: Callable[[], list[Job]],
    undo: _Rollback | None,
    *,
    round_as_device: bool = False,
) -> None:
    """Writes the jobs ``prepare`` sets up; on a failure restores (``undo``) or says exactly
    what was written. ``round_as_device``: host values stand in for values on their states'
    devices, BF16 ones rounded as there (:class:`._upload.Uploader`)."""
    jobs: list[Job] = []
    written = 0
    job: Job | None = None
    # Small host values set aside by _write_one, uploaded together once a slot's worth (or
    # another device's, or more FP32 copies than the largest state alone needs) comes; and the
    # batch being uploaded, while it is.
    batch: _Batch | None = None
    uploading: _Batch | None = None
    aside: Aside | None = None
    scaling: list[Job] = []  # the batch's FP16/FP8 states TE has started to scale
    try:
        jobs = prepare()
        fresh = _aliased(optimizer, jobs)
        # The FP16/FP8 states set aside together hold no more device memory than the largest
        # one written alone would.
        temporaries = _largest_temporary(jobs)
        with _uploaders(round_as_device) as uploader, torch.no_grad():

            def upload_batch() -> None:
                nonlocal batch, uploading, written
                if batch is None:
                    return
                uploading, batch = batch, None
                scaling.clear()
                _upload_together(optimizer, uploading, uploader, undo, scaling)
                written += len(uploading.asides)
                for _ in uploading.asides:
                    reports.state_written()
                uploading = None

            def room(device: torch.device | None, nbytes: int, temporary: int) -> None:
                if batch is not None and (
                    device != batch.device
                    or batch.nbytes + nbytes > uploader(batch.device).chunk_bytes
                    or (temporary and batch.temporary + temporary > temporaries[batch.device])
                ):
                    upload_batch()

            for i, job in enumerate(jobs):
                aside = _write_one(optimizer, job, uploader, undo, i in fresh, room)
                if aside is None:
                    written += 1
                    reports.state_written()
                    continue
                if batch is None:
                    batch = _Batch(aside.device, [], 0, 0)
                batch = batch._replace(
                    nbytes=batch.nbytes + aside.nbytes,
                    temporary=batch.temporary + aside.temporary,
                )
                batch.asides.append(aside)
                aside = None
            upload_batch()
    except BaseException as exc:
        # The failure names the batch being uploaded, if it was one, else the state being
        # written; nothing of a batch stays referenced by the traceback (device tensors too).
        first = uploading.asides[0].job if uploading is not None else None
        failed = (scaling[-1] if scaling else first) if uploading is not None else job
        pending = 0 if batch is None else len(batch.asides)
        count = 0 if uploading is None else len(uploading.asides)
        batch = uploading = aside = None
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
        if failed is None:
            where = "preparing the first write failed"
        elif count and scaling:
            assert first is not None
            where = (
                f"uploading the {count} states from state {first.name!r} of parameter "
                f"{first.index} on, TE's scaling of state {failed.name!r} of parameter "
                f"{failed.index} failed (the states of that upload before it were written)"
            )
        elif count:
            where = (
                f"uploading the {count} states from state {failed.name!r} of parameter "
                f"{failed.index} on failed"
            )
        elif pending:
            where = (
                f"state {failed.name!r} of parameter {failed.index} failed (the {pending} "
                "states before it, set aside to be uploaded together, were not written either)"
            )
        elif written < len(jobs):
            where = f"state {failed.name!r} of parameter {failed.index} failed"
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
            index=failed.index if failed is not None else None,
            name=failed.name if failed is not None else "",
        ) from exc
