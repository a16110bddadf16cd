"""``StreamingLoadPlanner``: ``dcp.load`` of TE FusedAdam state without an FP32 template.

``dcp.load`` reads a checkpoint into a template. For an optimizer that template is
``get_optimizer_state_dict(...)``: one FP32 (or int16) tensor per state, all alive at once, which
``set_optimizer_state_dict`` then converts into the live states. This planner reads every
checkpoint item of a TE FusedAdam state straight into the live state instead, through the
``LoadPlanner`` extension points DCP documents (``resolve_tensor`` hands the reader the tensor to
fill, ``commit_tensor`` says it was filled):

- BF16, FP32 and int16 (master remainder) states are elementwise: an item is copied into the
  region of the live state it covers as it arrives. To a GPU state the reader's copy goes into a
  pinned host slot lent by :class:`.._ring.SlotLender` (converted there, in the state's dtype),
  then copied to the live region asynchronously while the reader reads the next item; items
  larger than a slot are copied straight into the live region. Either way an FP32 item for a
  BF16 state is rounded to nearest even on the host with the bits torch's own host-to-device
  ``copy_`` would leave (see :class:`_Slot`), as TE's load does with ``.bfloat16()``;
- FP16 and FP8 states are scaled by the absmax of the whole local state, and an elementwise
  state whose saved pieces are strided regions of it (a reshard along a later dimension) cannot
  take them in place either: their items are assembled in a host buffer of the local state (FP32;
  int16 for master remainders, see :mod:`.assembly`), written whole through ``te_load`` (the one
  per-state write, :func:`._load_targets._write_state`) when the last item has arrived, and
  freed.

The template that ``dcp.load`` sees holds, for each state, a :class:`._load_targets._Target` that
describes the state's local chunk (what ``DTensor.__create_chunk_list__`` would say) without any
data, and the optimizer's ``param_groups`` entries as torch's flattened export holds them. Keys
and FQNs follow ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` (torch's
``_get_fqns``), and ``param_groups`` are loaded through torch's own
``_unflatten_optim_state_dict`` and ``Optimizer.load_state_dict``, so the result equals
``set_optimizer_state_dict``'s.

Uses only APIs that torch 2.11 (the GPU machine's version) and 2.13 share; the private helpers of
``torch.distributed.checkpoint`` it and :mod:`._load_targets` import (``_get_fqns``,
``_verify_options``, ``_unflatten_optim_state_dict``, ``_create_chunk_from_dtensor``,
``_create_chunk_from_tensor``) have the same code in both.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import _init_state_dict

from .. import _reports as reports
from .. import _ring
from .. import _te_load as te_load
from .._convert import Slot as _Slot
from . import _load_guard as load_guard
from . import _load_targets
from ._assembly import Assembly
from ._handshake import StreamingLoadWarning, StreamingTemplate, merge_part
from ._load_targets import (
    _MIXED,
    _build_load,
    _CannotStreamError,
    _check_streamable,
    _OptimizerLoad,
    _Target,
)
from ._state import PlacedOptimizerState

#: Pinned host bytes of the upload ring of one device, all slots together; items larger than a
#: slot are copied straight into the live state.
UPLOAD_RING_BYTES = 256 << 20
#: Slots of the upload ring: the reader fills one while the previous one uploads.
UPLOAD_SLOTS = 2
#: Device types whose live states are loaded through the upload ring (a seam for CPU tests).
RING_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
#: The report's details (docs/api.md): seconds inside resolve_tensor and commit_tensor of
#: optimizer states, items through the upload ring (and bytes uploaded from it) or copied straight
#: into the live state, the rings' pinned host bytes, and the assembly buffers' peak.
_DETAILS = ("resolve_s", "commit_s", "ring_items", "ring_bytes", "direct_items", "ring_host_bytes")


def _note(exc: BaseException, message: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"te_ckpt_placement: {message}")


class _StreamingTemplate(StreamingTemplate):
    """A planner's streaming template: :meth:`finish` is the planner's ``_finish``."""

    planner: StreamingLoadPlanner
    state: PlacedOptimizerState
    loads: list[_OptimizerLoad]

    def finish(self) -> None:
        self.planner._finish(self)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _take_back(made: list[tuple[Any, list[Any]]]) -> None:
    """Takes back the initial states made for a load refused before any write (and the steps)."""
    for optimizer, steps in made:
        te_load.take_back_initial_states(optimizer, steps)


class StreamingLoadPlanner(DefaultLoadPlanner):
    """A ``dcp.load`` planner that streams TE FusedAdam states into the live optimizer.

    Give it the :class:`~te_ckpt_placement.dcp.PlacedOptimizerState` adapters of the state dict
    that ``dcp.load`` loads. Making the planner arms each adapter: the adapter's next
    ``state_dict()`` (the one ``dcp.load`` calls for its template) returns per-state entries that
    hold no data instead of an FP32 export, and this planner reads each checkpoint item into the
    live state: elementwise states (BF16, FP32, int16 remainders) in place as they arrive, FP16
    and FP8 states (and elementwise states whose saved pieces are strided regions of the local
    state, from a reshard along a later dimension) through one host buffer of the local state
    each (FP32; int16 for master remainders), written as TE's load writes them once complete.
    ``dcp.load`` then calls the adapter's ``load_state_dict``, which loads the ``param_groups``
    as ``set_optimizer_state_dict`` does.
    Everything else in the state dict (model weights, other entries) loads as with
    ``DefaultLoadPlanner``. The result equals the template path's (``state_dict()`` under the
    policy, then ``set_optimizer_state_dict``), with no template: see docs/dcp-load.md.

    Make the planner in the ``dcp.load`` call that uses it (it is single-use, like the template
    it arms).

    Before any state is written, every state is checked against the checkpoint's metadata (key,
    global shape, dtype: int16 remainders for ``store_param_remainders=True``, floating point
    otherwise, and that the saved pieces cover the local shard): a mismatch raises ``ValueError``
    with no state written, and a fresh optimizer loses the initial states made for the load (on
    the rank that refused; docs/dcp-load.md says what other ranks keep). A
    failure after writing began (an I/O error of the reader, an allocation, an interrupt) leaves
    the states partly loaded and the ``param_groups`` as they were: the optimizer's ``step()``
    then raises, saying how many states were overwritten, until a complete load (loading again
    writes every state); :attr:`progress` says how far the load got.

    Where it cannot stream an adapter's optimizers (not TE FusedAdam's storage contract, or an
    FSDP1 model), it warns (:class:`StreamingLoadWarning`) and that adapter loads through the
    template path.

    Args:
        *states: The ``PlacedOptimizerState`` adapters to stream (each must be in the state dict
            given to ``dcp.load``).
        max_assembly_bytes: Host bytes of assembly buffers held at once before the planner
            warns (:class:`StreamingLoadWarning`); ``None`` (default): the largest buffer the
            load needs (one state's), which is what a load at the saved sharding needs. Loading
            on a different world size can need more (the saved pieces of a state sit in
            different files, and DCP reads file by file): the load then holds what it must,
            warns once, and completes; the buffers never exceed the size of the assembled
            states in FP32 (int16 for remainders), what their template would take.
        allow_partial_load: As ``DefaultLoadPlanner``'s, for entries other than optimizer
            states; a state missing from the checkpoint always raises.

    Raises:
        ValueError: no adapter, something else than a ``PlacedOptimizerState``, or a negative
            ``max_assembly_bytes``.

    Example:
        >>> state = {"model": get_model_state_dict(model),
        ...          "optim": PlacedOptimizerState(model, optimizer)}  # doctest: +SKIP
        >>> dcp.load(state, checkpoint_id=path,
        ...          planner=StreamingLoadPlanner(state["optim"]))  # doctest: +SKIP
        >>> set_model_state_dict(model, state["model"])  # doctest: +SKIP
    """

    def __init__(
        self,
        *states: PlacedOptimizerState,
        max_assembly_bytes: int | None = None,
        allow_partial_load: bool = False,
    ) -> None:
        if not states or not all(isinstance(s, PlacedOptimizerState) for s in states):
            raise ValueError(
                f"unsupported states {states!r}: valid values are one or more "
                "te_ckpt_placement.dcp.PlacedOptimizerState adapters"
            )
        if len({id(s) for s in states}) != len(states):
            raise ValueError("the same PlacedOptimizerState is given twice")
        if max_assembly_bytes is not None and (
            isinstance(max_assembly_bytes, bool)
            or not isinstance(max_assembly_bytes, int)
            or max_assembly_bytes < 0
        ):
            raise ValueError(
                f"unsupported max_assembly_bytes {max_assembly_bytes!r}: valid values are None "
                "(one FP32 state) or an int >= 0"
            )
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=True,
            allow_partial_load=allow_partial_load,
        )
        self._states: tuple[PlacedOptimizerState, ...] = states
        self._assembly = Assembly(max_assembly_bytes, StreamingLoadWarning)
        self._lock = threading.Lock()
        self._planning = False
        self._loads: list[_OptimizerLoad] = []
        self._targets: dict[str, _Target] = {}
        #: Why an adapter loaded through the template path instead (empty: none did).
        self.fallbacks: list[str] = []
        self._slot_bytes = 0
        self._failed: str | None = None  # the first state whose read or write failed
        # Fresh optimizers this load gave TE's initial states, with their groups' steps before.
        self._initial: list[tuple[Any, list[Any]]] = []
        self._rings: dict[torch.device, _ring.SlotLender] = {}
        self._pending: dict[ReadItem, tuple[_ring.SlotLender, int, torch.Tensor]] = {}
        #: The load's :class:`~te_ckpt_placement.TransferReport` (path ``"planner"``), made when
        #: the load completes or fails (also :func:`~te_ckpt_placement.last_report` in the
        #: thread that ran ``dcp.load``); None before.
        self.report: reports.TransferReport | None = None
        self._recorder = reports.start("load", path="planner")
        for key in _DETAILS:
            self._recorder.detail(key, 0)
        self._templates = 0  # streaming templates made, and not finished yet
        for state in states:
            stale = state.unfinished_load
            if stale is not None:
                # A load the reader stopped between resolve_tensor and commit_tensor: no planner
                # call saw it, and the adapter keeps that planner for its warning. Its uploads
                # end here, and its pinned slots go back before this load takes its own.
                stale.abandon()
            state._arm(self)

    # --- the template (PlacedOptimizerState.state_dict) ------------------------------------
    def template_for(self, state: PlacedOptimizerState) -> dict[str, Any] | None:
        """The streaming template of ``state``, or None (warned) for the template path."""
        pairs = state.parts()
        template = _StreamingTemplate()
        loads = []
        made: list[tuple[Any, list[Any]]] = []  # fresh optimizers given TE's initial states
        try:
            checked = [_check_streamable(model, optim, state.options) for model, optim in pairs]
            for (model, optim), (info, contract) in zip(pairs, checked, strict=True):
                # A fresh optimizer gets TE's initial states (and each group's step count)
                # instead of DCP's fake step, before any check of its shards can refuse it: the
                # template path it may fall back to then skips that step.
                steps = te_load.group_steps(optim)
                if te_load.initialize_states(optim, contract=contract):
                    made.append((optim, steps))
                part, load = _build_load(self, state, model, info, contract)
                load.fresh = any(optim is opt for opt, _ in made)
                merge_part(template, part)
                loads.append(load)
        except _CannotStreamError as exc:
            self._initial += made  # the template path loads them, unless the load is refused
            reason = str(exc)
            self.fallbacks.append(reason)
            warnings.warn(
                f"StreamingLoadPlanner cannot stream this optimizer: {reason}. It loads through "
                "the template path instead (the adapter's state_dict() as the template, then "
                "set_optimizer_state_dict, under the adapter's placement)",
                StreamingLoadWarning,
                stacklevel=3,
            )
            return None
        except BaseException as exc:
            # Refused before any write ("No state was written"), and dcp.load stops: the
            # initial states made for it so far, this adapter's and the others', go.
            made, self._initial = self._initial + made, []
            _take_back(made)
            self._end(exc)
            raise
        self._initial += made
        self._templates += 1
        template.planner, template.state, template.loads = self, state, loads
        self._loads.extend(loads)
        return template

    # --- planning -------------------------------------------------------------------------
    @contextmanager
    def _before_any_write(self) -> Iterator[None]:
        """A planning step: if it fails, the initial states this load made are taken back."""
        try:
            yield
        except BaseException as exc:
            # Nothing was read yet ("No state was written"): fresh optimizers are fresh again.
            made, self._initial = self._initial, []
            _take_back(made)
            self._end(exc)
            raise

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        with self._before_any_write():
            self._set_up_planner(state_dict, metadata, is_coordinator)

    def _set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None, is_coordinator: bool
    ) -> None:
        unused = [s for s in self._states if s._disarm(self)]
        if unused:
            raise ValueError(
                "StreamingLoadPlanner: a PlacedOptimizerState it was made for is not in the state "
                "dict given to dcp.load (dcp.load never asked it for its template). No state was "
                "written."
            )
        self._planning = True
        # DefaultLoadPlanner.set_up_planner, except that _init_state_dict (which materializes meta
        # tensors, and replaces in place every value that is not a tensor, number, string,
        # container or None with None) does not see the streaming templates.
        for key, value in state_dict.items():
            if not isinstance(value, _StreamingTemplate):
                holder = {key: value}
                _init_state_dict(holder)
                state_dict[key] = holder[key]
        self.original_state_dict = state_dict
        if self.flatten_sharded_tensors:
            state_dict = _flatten_sharded_tensors(state_dict)
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._targets = {}
        for key, value in self.state_dict.items():
            if isinstance(value, _Target):
                if value.planner is not self:
                    raise ValueError(
                        f"{key} belongs to the template of another StreamingLoadPlanner. No "
                        "state was written."
                    )
                value.dcp_key = key
                self._targets[key] = value
        expected = {id(t) for load in self._loads for t in load.targets}
        if {id(t) for t in self._targets.values()} != expected:
            raise ValueError(
                "StreamingLoadPlanner: the state dict given to dcp.load does not hold its "
                "adapters' templates as the adapters returned them. No state was written."
            )
        if metadata is not None:
            _load_targets._validate(self._targets, metadata)

    def create_local_plan(self) -> LoadPlan:
        with self._before_any_write():
            plan = super().create_local_plan()
            self._plan_reads(plan.items)
        return plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        with self._before_any_write():
            plan = super().finish_plan(new_plan)
            self._plan_reads(plan.items)
        self._planning = False
        return plan

    def _plan_reads(self, items: Sequence[ReadItem]) -> None:
        """Checks that the reads cover every local element of every state exactly once."""
        covered = dict.fromkeys(self._targets, 0)
        problems = []
        slot_cap = UPLOAD_RING_BYTES // UPLOAD_SLOTS
        self._slot_bytes = 0
        for item in items:
            target = self._targets.get(item.dest_index.fqn)
            if target is None:
                continue
            if target.chunk is None or item.dest_index.offset != target.chunk.offsets:
                problems.append(f"{target.dcp_key}: a read for another chunk")
            covered[target.dcp_key] += math.prod(item.lengths)
            if (
                target.live is not None
                and not self.transform_tensor(item, target.live).is_contiguous()
            ):
                # A strided region (a shard along a later dimension): torch's copy into it would
                # stage on the GPU and round with the kernel of the piece's layout, not the
                # whole state's. The state is assembled on the host and written whole instead,
                # from a buffer in its export's dtype (int16 for remainders: .assembly).
                target.live = None
            if target.live is not None and target.live.device.type in RING_DEVICE_TYPES:
                nbytes = math.prod(item.lengths) * target.live.element_size()
                if nbytes <= slot_cap:
                    self._slot_bytes = max(self._slot_bytes, nbytes)
        for key, target in self._targets.items():
            if covered[key] != target.numel:
                problems.append(
                    f"{key}: the checkpoint's pieces cover {covered[key]} of the {target.numel} "
                    "local elements"
                )
        if problems:
            raise ValueError(
                f"cannot load the optimizer checkpoint: {'; '.join(problems[:8])}. No state was "
                "written."
            )
        # Every write of an assembled state checked before any read; the default budget.
        self._assembly.plan(self._targets.values())
        for target in self._targets.values():
            target.remaining = target.numel

    # --- reading --------------------------------------------------------------------------
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets.get(read_item.dest_index.fqn)
        if target is None:
            return super().resolve_tensor(read_item)
        with self._lock:
            start = time.perf_counter()
            try:
                self._stop_after_failure()
                self._start(target)
                if target.live is not None:
                    # The reader copies the item into the live region, or into a ring slot
                    # uploaded there by commit_tensor; the copy converts as TE's load does: any
                    # float into FP32 is .float(), into BF16 it is .float().bfloat16() (c10
                    # rounds through float, to nearest even).
                    region = self.transform_tensor(read_item, target.live)
                    slot = self._take_slot(read_item, region)
                    self._recorder.detail("direct_items" if slot is None else "ring_items", 1)
                    return region if slot is None else slot
                if target.buffer is None:
                    target.buffer = self._assembly.allocate(target)
                    self._recorder.holding(_nbytes(target.buffer))
                return self.transform_tensor(read_item, target.buffer)
            except BaseException as exc:
                self._raise_failure(target, exc)
            finally:
                self._recorder.detail("resolve_s", time.perf_counter() - start)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        target = self._targets.get(read_item.dest_index.fqn)
        if target is None:
            super().commit_tensor(read_item, tensor)
            return
        with self._lock:
            start = time.perf_counter()
            try:
                self._stop_after_failure()
                assert target.remaining is not None
                pending = self._pending.pop(read_item, None)
                if pending is not None:
                    ring, slot, region = pending
                    ring.upload(slot, region, tensor)
                    self._recorder.detail("ring_bytes", _nbytes(region))
                left = target.remaining - math.prod(read_item.lengths)
                if target.live is not None:  # read into the live state: counted here
                    self._recorder.uploaded(
                        math.prod(read_item.lengths) * target.live.element_size(), 0
                    )
                    if left == 0:
                        self._recorder.state_written()
                elif left == 0 and target.buffer is not None:
                    with reports.attach(self._recorder):  # te_load counts the write
                        _load_targets._write_state(
                            target.contract, target.param, target.name, target.buffer
                        )
                    self._assembly.release(target)
                    self._recorder.holding(-_nbytes(target.buffer))
                    target.buffer = None
                target.remaining = left  # a failed write above leaves the state "partly written"
            except BaseException as exc:
                self._raise_failure(target, exc)
            finally:
                self._recorder.detail("commit_s", time.perf_counter() - start)

    def _take_slot(self, read_item: ReadItem, region: torch.Tensor) -> torch.Tensor | None:
        """A ring slot the reader fills in place of the live ``region``; None: fill it directly."""
        nbytes = region.numel() * region.element_size()
        device = region.device
        if device.type not in RING_DEVICE_TYPES or not 0 < nbytes <= self._slot_bytes:
            return None
        ring = self._rings.get(device)
        if ring is None:
            ring = self._rings[device] = _ring.SlotLender(
                device, slot_bytes=self._slot_bytes, slots=UPLOAD_SLOTS, view_as=_Slot
            )
            self._recorder.detail("ring_host_bytes", ring.nbytes)
            self._recorder.staging(device, ring.nbytes)
        slot = ring.take()
        if slot is None:
            return None  # a reader that resolves several items before it commits them
        self._pending[read_item] = (ring, slot, region)
        return ring.view(slot, tuple(region.shape), region.dtype)

    def abandon(self) -> None:
        """Ends a load that stopped part-way (a new planner for its adapter): ``_close_rings``."""
        self._close_rings()

    def _close_rings(self) -> None:
        """Waits for every upload and lets the rings go (the load's end, or an error path)."""
        rings, self._rings = list(self._rings.values()), {}
        self._pending.clear()
        try:
            for ring in rings:
                try:
                    ring.close()
                finally:
                    self._recorder.waited(ring.wait_s)
        finally:
            rings.clear()

    def _start(self, target: _Target) -> None:
        if not target.started:
            target.started = True
            target.owner._load_started(self)  # until the load finishes
            # The optimizer's step() refuses to run until a load of every state completes.
            optimizer = target.optimizer
            load_guard.arm(
                optimizer, [ld.stopped() for ld in self._loads if ld.optimizer is optimizer]
            )

    @property
    def peak_assembly_bytes(self) -> int:
        """Host bytes of assembly buffers held at once, at most (0: every state read in place)."""
        return self._assembly.peak_bytes

    # --- state ----------------------------------------------------------------------------
    @property
    def progress(self) -> str:
        """How far the load got: states complete, partly written, not started."""
        targets = list(self._targets.values()) or [t for ld in self._loads for t in ld.targets]
        loaded = sum(1 for t in targets if t.remaining == 0)
        partly = sum(1 for t in targets if t.started and t.remaining != 0)
        return (
            f"{loaded} of {len(targets)} optimizer states loaded, {partly} partly written, "
            f"{len(targets) - loaded - partly} not started"
        )

    def _stop_after_failure(self) -> None:
        """Refuses every read after a failure: a reader on several threads may still resolve or
        commit items, and the failure let the rings go, so their uploads could not happen."""
        if self._failed is not None:
            raise RuntimeError(f"the load already failed at {self._failed}")

    def _failure(self, target: _Target, exc: BaseException) -> RuntimeError:
        first = self._failed is None
        if first:
            self._failed = str(target.dcp_key)
        also = ""
        try:
            self._close_rings()  # no upload outlives the failed load
        except Exception as close_exc:  # the failure at hand is the one to report
            also = f"; waiting for the queued uploads failed too ({close_exc!r})"
        if first:
            self._end(exc)
        return RuntimeError(
            f"loading the optimizer checkpoint failed part-way, at {target.dcp_key} "
            f"({type(exc).__name__}: {exc}{also}). {self.progress}; the param_groups are the "
            f"previous ones. {_MIXED}"
        )

    def _raise_failure(self, target: _Target, exc: BaseException) -> NoReturn:
        """Raises what a failure inside the planner leaves: a ``RuntimeError`` from ``exc``, or
        ``exc`` itself with that message as a note for an interrupt (which must propagate)."""
        error = self._failure(target, exc)
        if isinstance(exc, Exception):
            raise error from exc
        _note(exc, str(error))
        raise exc

    def _finish(self, template: _StreamingTemplate) -> None:
        """``param_groups`` as ``set_optimizer_state_dict`` loads them, then the live states.

        The states stay attached throughout (torch's part of the load detaches them, and they
        are put back in a ``finally``); torch's load post-hooks run last, with the states in
        place, as TE's load leaves them. The last template's finish ends the load's report.
        """
        try:
            self._finish_template(template)
        except BaseException as exc:
            self._end(exc)
            raise
        self._templates -= 1
        if self._templates == 0:
            self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        """Makes the load's report, once: when it completed, or at its first failure."""
        if self.report is None:
            self._recorder.detail("peak_assembly_bytes", self._assembly.peak_bytes, peak=True)
            self.report = reports.finish(self._recorder, exc)

    def _finish_template(self, template: _StreamingTemplate) -> None:
        self._close_rings()  # every upload has landed
        incomplete = [t.dcp_key for ld in template.loads for t in ld.targets if t.remaining != 0]
        if incomplete:
            raise RuntimeError(
                f"StreamingLoadPlanner: dcp.load returned before {len(incomplete)} optimizer "
                f"states were read ({incomplete[:3]}). {self.progress}; the param_groups are the "
                f"previous ones. {_MIXED}"
            )
        loaded = [
            (load.optimizer, _load_targets.load_groups(template, load)) for load in template.loads
        ]
        template.state._load_finished()  # a complete load wrote every state
        for optimizer, post_hooks in loaded:
            for hook in post_hooks.values():
                hook(optimizer)
