"""Lazy optimizer states for DCP saves: each state is produced when the writer asks for it.

``lazy_optimizer_state_dict`` returns what ``get_optimizer_state_dict`` returns under
``export_placement("cpu")`` (same keys, param_groups, DTensor meshes, placements, global shapes,
dtypes), except that every TE FusedAdam state is a :class:`LazyState` placeholder instead of a
host tensor. DCP plans from the placeholders' metadata and, through its ``_Checkpointable``
protocol (``__create_write_items__``, ``__get_tensor_shard__``; a DTensor hands both to its local
tensor), asks each for its data only when the storage writer writes it: the raw bytes then go
through the engine's pinned pipeline and are converted on the host (``engine.materialize``), and
the result lives until the writer drops it.

Used as a ``dcp.load`` template instead, a placeholder holds a host tensor (the current value, as
the export template would) for DCP to read into, and :func:`resolve_loaded` turns the loaded
dict back into plain tensors for ``set_optimizer_state_dict``.

Uses only APIs that torch 2.11 (the GPU machine's version) and 2.13 share.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .. import _export as engine
from .. import _tensors, _workers
from .._policy import Placement, as_placement, export_placement
from .._te_contract import Contract, has_contract
from .._tensors import local
from .._tree import iter_tree, map_tree

StateDict = dict[str, Any]

#: A lazily produced state dict warns once when this many produced states, holding at least
#: ``WARN_ALIVE_BYTES``, are alive at once outside a writer that releases each after writing:
#: torch's ``FileSystemWriter`` with ``single_file_per_rank=True`` keeps every tensor of a file
#: until the file is closed, which is the whole export again.
WARN_ALIVE_ITEMS = 8
WARN_ALIVE_BYTES = 1 << 30

_released_after_write = threading.local()


@contextlib.contextmanager
def released_after_write(ledger: _Ledger | None = None) -> Iterator[None]:
    """Marks the current thread as a writer that drops each produced state once written; the
    states produced meanwhile are also counted in ``ledger`` (the writer's, for its report)."""
    previous = getattr(_released_after_write, "active", False)
    previous_ledger = getattr(_released_after_write, "ledger", None)
    _released_after_write.active = True
    _released_after_write.ledger = ledger
    try:
        yield
    finally:
        _released_after_write.active = previous
        _released_after_write.ledger = previous_ledger


class _Ledger:
    """Counts the produced states that are still alive, by weak references to their storages.

    Every lazy state dict has one (for the warning below); a ``StreamingWriter`` keeps one per
    write for its :class:`~te_ckpt_placement.TransferReport` (``produced``, ``peak_alive``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._alive: list[tuple[weakref.ref[Any], int]] = []
        self._produced = 0
        self._produced_bytes = 0
        self._peak = 0
        self._peak_bytes = 0
        self._warned = False

    def record(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        # A storage's Python object lives as long as any tensor uses the storage.
        ref = weakref.ref(tensor.untyped_storage())
        with self._lock:
            self._alive = [(r, n) for r, n in self._alive if r() is not None]
            self._alive.append((ref, nbytes))
            self._produced += 1
            self._produced_bytes += nbytes
            alive_bytes = sum(n for _, n in self._alive)
            self._peak = max(self._peak, len(self._alive))
            self._peak_bytes = max(self._peak_bytes, alive_bytes)
            warn = (
                not self._warned
                and not getattr(_released_after_write, "active", False)
                and len(self._alive) > WARN_ALIVE_ITEMS
                and alive_bytes >= WARN_ALIVE_BYTES
            )
            self._warned = self._warned or warn
        if warn:
            warnings.warn(
                f"{len(self._alive)} lazily produced optimizer states ({alive_bytes} bytes) are "
                "alive at once: the storage writer keeps what it wrote (torch's FileSystemWriter "
                "with single_file_per_rank=True keeps every tensor of a file until the file is "
                "closed), so this save holds the whole export in host memory. Use "
                "te_ckpt_placement.dcp.StreamingWriter, which drops each state once written.",
                RuntimeWarning,
                stacklevel=2,
            )

    def counts(self) -> dict[str, int]:
        """States produced, their bytes, and the most alive at once (seen when one was made)."""
        with self._lock:
            return {
                "produced": self._produced,
                "produced_bytes": self._produced_bytes,
                "peak_alive": self._peak,
                "peak_alive_bytes": self._peak_bytes,
            }


def _stream_context(stream: Any) -> contextlib.AbstractContextManager[Any]:
    # Production runs in writer threads, whose current CUDA device is 0 and whose current stream
    # is the default one. Producing on the stream that was current where the state dict was
    # made (with its device) orders the reads after the step that wrote the states, as the
    # export in that thread would.
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _output_dtype(source: engine.StateSource) -> torch.dtype:
    if source.kind == "copy":
        assert source.data is not None
        return source.data.dtype
    return torch.float32  # upcast, scaled, fp8 and device conversions export FP32


class LazyState(torch.Tensor):
    """A placeholder for one exported optimizer state (the local tensor, for a DTensor param).

    It has the exported tensor's metadata (shape, dtype FP32 or int16, device CPU) and no data;
    ``__get_tensor_shard__`` produces the data with ``engine.materialize`` each time DCP asks and
    keeps none of it. Torch operations on it raise ``TypeError``, and so does copying: torch's
    async stagers cannot stage it (use ``SnapshotStager``). A placeholder reading the live state
    refuses to be pickled; one that ``SnapshotStager`` made, reading a host snapshot, pickles as
    its snapshot tensors and conversion recipe (for ``torch.multiprocessing``, shared-memory
    handles: DCP's process-based async save sends it to its writer process without a copy).
    """

    _source: engine.StateSource
    _spec: DTensorSpec | None
    _stream: Any  # torch.cuda.Stream of the creating thread, for CUDA sources
    _reuse_buffers: bool
    _host_workers: int | None  # the policy's Placement.host_workers, for the conversion
    _ledger: _Ledger
    _target: torch.Tensor | None
    _snapshot: bool  # reads a host snapshot that nothing in training writes

    @staticmethod
    def __new__(
        cls,
        source: engine.StateSource,
        shape: torch.Size,
        dtype: torch.dtype,
        spec: DTensorSpec | None,
        *,
        device: torch.device,
        reuse_buffers: bool,
        ledger: _Ledger,
        snapshot: bool = False,
        host_workers: int | None = None,
    ) -> LazyState:
        self = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape, dtype=dtype, device=torch.device("cpu"), requires_grad=False
        )
        self._source = source
        self._spec = spec  # of the DTensor wrapping this local tensor, None for a plain one
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._reuse_buffers = reuse_buffers
        self._host_workers = host_workers
        self._ledger = ledger
        self._target = None
        self._snapshot = snapshot
        return self  # type: ignore[no-any-return]

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.is_pinned.default:
            return False
        raise TypeError(
            f"{func} on a te_ckpt_placement LazyState: a streaming-save placeholder holds no "
            "data until DCP's writer asks for it. Save it with dcp.save, or with "
            "dcp.async_save staged by te_ckpt_placement.dcp.SnapshotStager (torch's stagers "
            "copy every tensor and cannot stage it); export with "
            "PlacedOptimizerState(save='export') to get tensors."
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LazyState(kind={self._source.kind!r}, shape={tuple(self.shape)}, {self.dtype})"

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(
            "a te_ckpt_placement LazyState cannot be copied: torch's async stagers copy every "
            "tensor, and this placeholder has no data to copy. For dcp.async_save, stage with "
            "te_ckpt_placement.dcp.SnapshotStager (StreamingWriter stages with it by default)."
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not self._snapshot:
            raise TypeError(
                "a te_ckpt_placement LazyState reading the live optimizer state cannot be "
                "pickled (it references the optimizer's device storage): for dcp.async_save, "
                "in particular with AsyncCheckpointerType.PROCESS, stage with "
                "te_ckpt_placement.dcp.SnapshotStager, whose snapshot states pickle"
            )
        source = self._source
        return (
            _unpickled_snapshot,
            (source.kind, source.data, source.scale, source.fp8_dtype, self.shape, self.dtype,
             self._spec, self._host_workers),
        )  # fmt: skip

    @property
    def source(self) -> engine.StateSource:
        """Where the data comes from: the live stored state, or a host snapshot of it."""
        return self._source

    @property
    def twin(self) -> torch.Tensor:
        """A meta tensor (meta-local DTensor) with the exported tensor's metadata, for planning.

        Built when DCP plans, which an async save does in its background thread.
        """
        meta = torch.empty(self.shape, dtype=self.dtype, device="meta")
        if self._spec is None:
            return meta
        return DTensor(meta, self._spec, requires_grad=False)  # type: ignore[call-arg]

    def produce(self) -> torch.Tensor:
        """The exported host tensor, fresh on every call, as the streaming export makes it."""
        with _stream_context(self._stream), _workers.sized(self._host_workers):
            out = engine.materialize(self._source, reuse_buffers=self._reuse_buffers)
        self._ledger.record(out)
        writer = getattr(_released_after_write, "ledger", None)
        if writer is not None:
            writer.record(out)
        return out

    def with_source(self, source: engine.StateSource, ledger: _Ledger) -> LazyState:
        """The same placeholder reading from ``source`` (a host snapshot: picklable)."""
        return LazyState(
            source,
            self.shape,
            self.dtype,
            self._spec,
            device=torch.device("cpu"),
            reuse_buffers=self._reuse_buffers,
            ledger=ledger,
            snapshot=True,
            host_workers=self._host_workers,
        )

    # --- DCP's _Checkpointable protocol (DTensor forwards to its local tensor) ---------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        twin = self.twin
        if isinstance(twin, DTensor):
            return twin.__create_write_items__(fqn, twin)  # type: ignore[no-any-return]
        offsets = torch.Size([0] * self.dim())
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=self.size()),
                    properties=TensorProperties.create_from_tensor(twin),
                    size=self.size(),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        # Only load planning asks for chunks: from here on this is a load target, holding the
        # current value as the export template would (kept for keys a partial load skips).
        if self._target is None:
            self._target = self.produce()
        twin = self.twin
        if isinstance(twin, DTensor):
            return twin.__create_chunk_list__()  # type: ignore[no-any-return]
        return [ChunkStorageMetadata(offsets=torch.Size([0] * self.dim()), sizes=self.size())]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if self._target is not None:
            return self._target
        return self.produce()

    def loaded(self) -> torch.Tensor:
        """The load target DCP read into, or the current value when the load skipped this key."""
        target, self._target = self._target, None
        return target if target is not None else self.produce()


#: The ledger of the snapshot states unpickled in this process (DCP's async writer process).
_UNPICKLED: _Ledger | None = None


def _unpickled_snapshot(
    kind: engine.Kind,
    data: torch.Tensor,
    scale: torch.Tensor | None,
    fp8_dtype: torch.dtype | None,
    shape: torch.Size,
    dtype: torch.dtype,
    spec: DTensorSpec | None,
    host_workers: int | None = None,
) -> LazyState:
    """A snapshot state rebuilt from its pickle (its tensors: shared memory, not copies).

    Its outputs are fresh host tensors: the writer process keeps no buffers of its own.
    """
    global _UNPICKLED
    if _UNPICKLED is None:
        _UNPICKLED = _Ledger()
    source = engine.StateSource(kind=kind, data=data, scale=scale, fp8_dtype=fp8_dtype)
    return LazyState(
        source,
        shape,
        dtype,
        spec,
        device=torch.device("cpu"),
        reuse_buffers=False,
        ledger=_UNPICKLED,
        snapshot=True,
        host_workers=host_workers,
    )


def is_lazy(value: object) -> bool:
    """True for a :class:`LazyState` or a DTensor whose local tensor is one."""
    return isinstance(_tensors.local(value), LazyState)


def lazy_of(value: object) -> LazyState | None:
    """The :class:`LazyState` of a value (a DTensor's local tensor), or None."""
    value = _tensors.local(value)
    return value if isinstance(value, LazyState) else None


def iter_lazy(tree: Any) -> Iterator[LazyState]:
    """Every placeholder in a nested state dict."""
    return iter_tree(tree, lazy_of)


def ledger_of(state_dict: Any) -> _Ledger | None:
    """The ledger of the placeholders in ``state_dict`` (None when it holds none)."""
    for lazy in iter_lazy(state_dict):
        return lazy._ledger
    return None


def rewrap(local: torch.Tensor, like: Any) -> torch.Tensor:
    """``local`` in place of ``like``'s local tensor (a CPU-local DTensor) or as it is.

    ``like``'s spec is shared, not rebuilt (building one costs about 20 us, which adds up over
    thousands of states on the path an async save blocks training on).
    """
    if not isinstance(like, DTensor):
        return local
    meta = like._spec.tensor_meta
    if meta is not None and meta.dtype != local.dtype:
        return _tensors.to_cpu_dtensor(local, like)
    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[call-arg]


def resolve_loaded(state_dict: Any) -> Any:
    """``state_dict`` after a ``dcp.load`` with every placeholder replaced by its host tensor.

    Containers on the way are rebuilt, never mutated; a dict without placeholders comes back
    as it is.
    """
    return map_tree(state_dict, _loaded)


def _loaded(value: Any, path: tuple[Any, ...]) -> Any:
    lazy = lazy_of(value)
    return value if lazy is None else rewrap(lazy.loaded(), value)


# --- building the lazy state dict ---------------------------------------------------------------
def _placeholder(
    param: torch.Tensor,
    source: engine.StateSource,
    placement: Placement,
    ledger: _Ledger,
    specs: dict[torch.dtype, DTensorSpec],
) -> torch.Tensor:
    dtype = _output_dtype(source)
    local_param = local(param)
    shape = source.data.shape if source.data is not None else local_param.shape
    device = source.data.device if source.data is not None else local_param.device
    spec = specs.get(dtype)
    lazy = LazyState(
        source,
        shape,
        dtype,
        spec,
        device=device,
        reuse_buffers=placement.reuse_buffers,
        ledger=ledger,
        host_workers=placement.host_workers,
    )
    if not isinstance(param, DTensor):
        return lazy
    if spec is None:  # the export's spec for this dtype, shared by the param's other states
        wrapped = engine.to_cpu_dtensor(lazy, param)
        specs[dtype] = lazy._spec = wrapped._spec
        return wrapped
    return DTensor(lazy, spec, requires_grad=False)  # type: ignore[call-arg]


def _lazy_optimizer_state_dict(optimizer: Any, placement: Placement, ledger: _Ledger) -> StateDict:
    """TE's ``state_dict()`` (fused_adam.py L482-513) with placeholders for the states."""
    contract = Contract.of(optimizer)
    # The method TE's own state_dict calls as super(): param_groups and the live state entries.
    state_dict: StateDict = torch.optim.Optimizer.state_dict(optimizer)
    # Every state is described (and so validated) before any placeholder exists.
    plan = [
        (
            key,
            param,
            {
                name: contract.describe(param, name, value, placement, key)
                for name, value in stored.items()
            },
        )
        for key, param, stored in engine.iter_exportable(state_dict, optimizer.param_groups)
    ]
    for key, param, sources in plan:
        specs: dict[torch.dtype, DTensorSpec] = {}  # per param: one per exported dtype
        state_dict["state"][key] = {
            name: _placeholder(param, source, placement, ledger, specs)
            for name, source in sources.items()
        }
    return state_dict


class _Describing(torch.optim.Optimizer):
    """Stands in for one optimizer inside ``get_optimizer_state_dict``.

    It shares the optimizer's ``param_groups`` and ``state`` (torch maps parameters to FQNs
    through them), runs DCP's fake first step on the optimizer itself, and answers
    ``state_dict()`` with placeholders, so torch's own FQN mapping and flattening build the dict.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, placement: Placement, ledger: _Ledger):
        # Optimizer.__init__ is not called: nothing here owns parameters or state.
        self.optimizer = optimizer
        self.placement = placement
        self.ledger = ledger
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> StateDict:  # type: ignore[override]
        return _lazy_optimizer_state_dict(self.optimizer, self.placement, self.ledger)


def lazy_optimizer_state_dict(
    model: torch.nn.Module,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *,
    options: StateDictOptions | None = None,
    placement: Placement | str | None = "cpu",
) -> StateDict:
    """``get_optimizer_state_dict`` under ``placement``, with TE states left to be produced.

    The result has the keys, param_groups and tensor metadata of the export; each TE FusedAdam
    state is a :class:`LazyState` (wrapped in a CPU-local DTensor for DTensor params) that DCP's
    writer resolves one at a time. Optimizers without TE's storage contract are exported as
    ``get_optimizer_state_dict`` exports them. Nothing is produced until DCP asks; keep training
    from changing the optimizer until ``dcp.save`` returns (it blocks training anyway), or stage
    with ``SnapshotStager`` for ``dcp.async_save``.

    Args:
        model: The model the optimizers belong to, as for ``get_optimizer_state_dict``.
        optimizers: One optimizer or several.
        options: ``StateDictOptions`` (default: torch's defaults). ``full_state_dict=True`` is
            refused: gathering needs every state's data at once, and DCP reshards sharded
            checkpoints when it loads them.
        placement: The streaming policy (``"cpu"`` or a ``Placement`` with ``device="cpu"``):
            its ``conversion`` and ``reuse_buffers`` apply when the states are produced.

    Raises:
        ValueError: for ``full_state_dict=True``, a placement that does not stream, an FSDP1
            model, or a state the streaming export cannot describe (before anything is
            produced).
        te_ckpt_placement.ContractError: a TE optimizer lacks what the export relies on.
    """
    resolved = as_placement(placement)
    if not resolved.streams:
        raise ValueError(
            f"unsupported placement {placement!r} for a streaming save: valid values are 'cpu' "
            "or a Placement(device='cpu', ...); TE's own export (None) has nothing to stream"
        )
    if options is None:
        options = StateDictOptions()
    elif not isinstance(options, StateDictOptions):
        raise ValueError(
            f"unsupported options {options!r}: valid values are None or a "
            "torch.distributed.checkpoint.state_dict.StateDictOptions"
        )
    if options.full_state_dict:
        raise ValueError(
            "unsupported options: full_state_dict=True; a streaming save writes each rank's "
            "shards as they are produced (valid: full_state_dict=False). DCP reshards sharded "
            "checkpoints on load, to any world size"
        )
    from torch.distributed.fsdp import FullyShardedDataParallel

    if FullyShardedDataParallel.fsdp_modules(model):
        raise ValueError(
            "unsupported model: FSDP1 (FullyShardedDataParallel) rewrites the optimizer state "
            "dict through its flat parameters, which needs the states' data; valid models for "
            "a streaming save have FSDP2 (fully_shard), DTensor or plain parameters. Export with "
            "export_placement('cpu') instead"
        )
    optims = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    ledger = _Ledger()
    stand_ins = tuple(
        _Describing(opt, resolved, ledger) if has_contract(opt) else opt for opt in optims
    )
    with export_placement(resolved):
        return get_optimizer_state_dict(model, stand_ins, options=options)
