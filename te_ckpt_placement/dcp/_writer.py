"""``StreamingWriter``: a DCP file writer that drops every tensor once it is written.

torch's ``FileSystemWriter`` asks the planner for each tensor lazily, but keeps every tensor it
wrote to a file in a dict (used only for safetensors) until the file is closed: with the default
``single_file_per_rank=True`` every lazily produced state of a rank stays alive to the end (torch
2.11 and 2.13 ``filesystem.py`` ``_write_files_from_queue``, identical in both). This writer writes
the same files and metadata (the same ``torch.save`` records and ``_StorageInfo`` entries, read by
the stock ``FileSystemReader``), but releases each tensor as soon as it is written, and produces
the next one while the current one is written.

Uses only APIs that torch 2.11 (the GPU machine's version) and 2.13 share.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
import uuid
from collections.abc import Iterator
from io import UnsupportedOperation
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    SerializationFormat,
    _write_item,
)
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _export as engine
from .. import _host_budget
from .. import _reports as reports
from ._lazy_state import _Ledger, released_after_write
from ._snapshot import SnapshotStager

_POLL_SECONDS = 0.1
_TAG_DIGITS = 12
# The names write_data gives data files: torch's rank prefix, the save's tag, the file's number.
_DATA_FILE = re.compile(rf"__(\d+)_[0-9a-f]{{{_TAG_DIGITS}}}_\d+{re.escape(DEFAULT_SUFFIX)}")


def _item_bytes(item: WriteItem) -> int:
    """The bytes this rank writes for an item: its chunk, not the global tensor."""
    data = item.tensor_data
    if data is None:
        return 0
    sizes = data.chunk.sizes if data.chunk is not None else data.size
    numel = 1
    for size in sizes:
        numel *= size
    return numel * data.properties.dtype.itemsize


def _buckets(count: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """Items spread over ``count`` files: byte items round robin, tensors largest first onto the
    lightest file (torch's rule, by local bytes)."""
    buckets: list[list[WriteItem]] = [[] for _ in range(count)]
    loads = [0] * count
    byte_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
    tensor_items = [item for item in items if item.type != WriteItemType.BYTE_IO]
    tensor_items.sort(key=_item_bytes, reverse=True)
    for i, item in enumerate(byte_items):
        buckets[i % count].append(item)
    for item in tensor_items:
        lightest = loads.index(min(loads))
        buckets[lightest].append(item)
        loads[lightest] += _item_bytes(item)
    return [bucket for bucket in buckets if bucket]


def _own_data_files(path: str | os.PathLike[str], rank: int | None) -> set[str]:
    """The regular files in ``path`` named as this writer names data files (of ``rank`` only,
    unless None)."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return set()
    out = set()
    for entry in entries:
        match = _DATA_FILE.fullmatch(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        if rank is None or int(match.group(1)) == rank:
            out.add(entry.name)
    return out


def _host_tensor(data: torch.Tensor, stream: Any) -> torch.Tensor:
    """A host tensor that owns exactly its bytes (``torch.save`` writes a view's whole storage).

    A CUDA tensor is read on ``stream`` (the caller's of ``dcp.save``, on its device), so the
    copy comes after what that stream queued.
    """
    data = data.detach()
    if data.device.type != "cpu":
        # Through the engine's pinned ring: no device memory, a fresh host tensor.
        on_stream = stream is not None and stream.device == data.device
        context = torch.cuda.stream(stream) if on_stream else contextlib.nullcontext()
        device = torch.cuda.device(data.device) if data.device.type == "cuda" else None
        with context, device if device is not None else contextlib.nullcontext():
            return engine.materialize(engine.StateSource(kind="copy", data=data))
    if data.untyped_storage().nbytes() != data.numel() * data.element_size():
        return data.clone()
    return data


class _AbortedError(Exception):
    """Another file of the same save failed: this one stops."""


class _Production:
    """Produces one file's tensors in order, ahead of the writer, within the shared budget."""

    def __init__(
        self,
        planner: SavePlanner,
        items: list[WriteItem],
        budget: threading.Semaphore,
        lookahead: int,
        abort: threading.Event,
        stream: Any,
        ledger: _Ledger | None = None,
        recorder: Any = None,
    ) -> None:
        self.planner = planner
        self.stream = stream
        self.ledger = ledger
        self.recorder = recorder
        self.items = items
        self.budget = budget
        self.mine = threading.Semaphore(1 + lookahead)
        self.abort = abort
        self.ready: queue.Queue[tuple[WriteItem, torch.Tensor] | BaseException] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="te-ckpt-produce", daemon=True)

    def _acquire(self) -> bool:
        """Takes this file's and the shared permit for one tensor; False once aborted."""
        for semaphore in (self.mine, self.budget):
            while not semaphore.acquire(timeout=_POLL_SECONDS):
                if self.abort.is_set():
                    if semaphore is self.budget:
                        self.mine.release()
                    return False
        return True

    def _release(self) -> None:
        self.mine.release()
        self.budget.release()

    def _run(self) -> None:
        with released_after_write(self.ledger), reports.attach(self.recorder):
            for item in self.items:
                if not self._acquire():
                    return
                try:
                    data = self.planner.resolve_data(item)
                    if not isinstance(data, torch.Tensor):
                        raise TypeError(
                            f"the planner resolved tensor item {item.index.fqn!r} to "
                            f"{type(data).__name__}, not a tensor"
                        )
                    self.ready.put((item, _host_tensor(data, self.stream)))
                    del data
                except BaseException as exc:
                    self._release()
                    self.ready.put(exc)
                    return

    def __iter__(self) -> Iterator[tuple[WriteItem, torch.Tensor]]:
        self.thread.start()
        for _ in self.items:
            while True:
                try:
                    got = self.ready.get(timeout=_POLL_SECONDS)
                    break
                except queue.Empty:
                    if self.abort.is_set():
                        raise _AbortedError from None
            if isinstance(got, BaseException):
                raise got
            yield got
            del got
            self._release()  # the writer dropped the tensor before asking for the next one

    def drain(self) -> None:
        """After an abort: waits for the producer and releases what it left unwritten."""
        self.thread.join()
        while True:
            try:
                got = self.ready.get_nowait()
            except queue.Empty:
                return
            if not isinstance(got, BaseException):
                del got
                self._release()


class StreamingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that holds at most a few produced tensors at a time.

    With the lazy states of ``PlacedOptimizerState(save="streaming")`` (or
    :func:`~te_ckpt_placement.dcp.lazy_optimizer_state_dict`), each optimizer state is produced
    when this writer asks for it and released right after it is written, so a rank holds at most
    ``thread_count + lookahead`` produced tensors: ``(thread_count + lookahead) * 4 * M`` bytes
    for FP32 states of at most M local elements, where torch's writer holds the whole export.
    Tensors on the GPU (model weights in a synchronous save) come to the host through the
    engine's pinned ring, also one at a time. The files are those of torch's writer (one per
    thread with ``single_file_per_rank``, else one per item) and load with the stock
    ``FileSystemReader``.

    Data files get names unique to each save (``__<rank>_<12 hex digits>_<n>.distcp``), so a save
    into a directory that already holds a checkpoint overwrites nothing of it until the new
    ``.metadata`` replaces the old (torch's rename). After that, the files of that name pattern
    that were in the directory when the save began (earlier saves of this writer, and files that
    a failed or killed save left behind) are deleted; the directory's old ``.metadata`` is never
    read, and no other file is touched. A failed save leaves the previous checkpoint loadable: a
    rank whose write fails deletes the files it wrote, and files that other ranks completed stay
    behind until the next successful save. One save at a time per directory, as for torch's
    writer.

    For ``dcp.async_save`` this writer is also the stager (as torch's ``FileSystemWriter`` is): it
    stages with a :class:`~te_ckpt_placement.dcp.SnapshotStager`, which copies only the raw stored
    bytes, and the FP32 conversion runs here, in the background write. Call :meth:`close` after
    the last save to release the stager's pinned buffers.

    Each write leaves a :class:`~te_ckpt_placement.TransferReport` (``path="streaming_save"``)
    in :attr:`last_report` (in the process that wrote: DCP's writer process for a process-based
    async save) and in ``last_report()`` of the thread that ran ``write_data`` (the caller of a
    synchronous ``dcp.save``); its ``details`` hold ``produced`` (lazy states produced) and
    ``peak_alive`` (the most of them alive at once).

    Args:
        path: The checkpoint directory.
        single_file_per_rank: One file per writer thread (default) or one file per item.
        sync_files: ``fsync`` each file before the save completes.
        thread_count: Writer threads (and files, with ``single_file_per_rank``).
        overwrite: Allow a save into a directory that holds a checkpoint.
        lookahead: Tensors produced ahead of the writers (in addition to the one each writer
            thread is writing), so that producing the next state overlaps writing this one.
        stager: The stager for ``dcp.async_save`` (default: a new ``SnapshotStager``).

    Raises:
        ValueError: for a ``thread_count`` below 1, a negative ``lookahead``, or
            ``serialization_format=SAFETENSORS`` (it needs every tensor of a file at once).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        overwrite: bool = True,
        *,
        lookahead: int = 1,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        stager: SnapshotStager | None = None,
    ) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(
                f"unsupported thread_count {thread_count!r}: valid values are ints >= 1"
            )
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"unsupported lookahead {lookahead!r}: valid values are ints >= 0")
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise ValueError(
                f"unsupported serialization_format {serialization_format!r}: valid values are "
                "SerializationFormat.TORCH_SAVE; safetensors files need every tensor of a file at "
                "once, which is what this writer avoids"
            )
        if stager is not None and not isinstance(stager, SnapshotStager):
            raise ValueError(
                f"unsupported stager {stager!r}: valid values are None or a SnapshotStager"
            )
        super().__init__(
            path,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            overwrite=overwrite,
        )
        self.lookahead = lookahead
        self._stager = stager if stager is not None else SnapshotStager()
        self._replaced: set[str] = set()  # data files of earlier saves, listed before writing
        self.last_report: reports.TransferReport | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._replaced = set()

    # --- AsyncStager: dcp.async_save stages with the snapshot stager ----------------------------
    @property
    def stager(self) -> SnapshotStager:
        """The stager ``dcp.async_save`` uses when it is given no ``async_stager``."""
        return self._stager

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:  # type: ignore[override]
        """A raw snapshot of ``state_dict`` (see :class:`SnapshotStager`)."""
        return self._stager.stage(state_dict)

    def close(self) -> None:
        """Releases the stager's pinned buffers (after the last save)."""
        self._stager.close()

    # --- writing ---------------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        largest = max((_item_bytes(item) for item in plan.items), default=0)
        alive = self.thread_count + self.lookahead
        _host_budget.check(
            "streaming_save",
            _host_budget.STREAMING_OVERHEAD_BYTES + alive * largest,
            fits=(
                f"It holds up to thread_count + lookahead = {alive} produced states of at most "
                f"{largest} bytes: lower thread_count or lookahead"
            ),
        )
        ledger = _Ledger()
        try:
            with reports.operation("export", path="streaming_save"):
                recorder = reports.active()
                try:
                    return self._write_streamed(plan, planner, ledger, recorder)
                finally:
                    if recorder is not None:
                        counts = ledger.counts()
                        recorder.detail("produced", counts["produced"])
                        recorder.detail("peak_alive", counts["peak_alive"])
        finally:
            self.last_report = reports.last_report()

    def _write_streamed(
        self, plan: SavePlan, planner: SavePlanner, ledger: _Ledger, recorder: Any
    ) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        tag = uuid.uuid4().hex[:_TAG_DIGITS]  # this write's own file names (see _DATA_FILE)
        groups = (
            _buckets(self.thread_count, list(plan.items))
            if self.single_file_per_rank
            else [[item] for item in plan.items]
        )
        files: queue.Queue[tuple[str, list[WriteItem]]] = queue.Queue()
        for n, items in enumerate(groups):
            files.put((f"{prefix}{tag}_{n}{DEFAULT_SUFFIX}", items))

        budget = threading.Semaphore(self.thread_count + self.lookahead)
        abort = threading.Event()
        # GPU tensors in the plan are read after what the caller's stream has queued.
        stream = (
            torch.cuda.current_stream()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        results: list[WriteResult] = []
        errors: list[BaseException] = []
        created: list[str | os.PathLike[str]] = []
        lock = threading.Lock()

        def work() -> None:
            with reports.attach(recorder):
                work_files()

        def work_files() -> None:
            while not abort.is_set():
                try:
                    name, items = files.get_nowait()
                except queue.Empty:
                    return
                with lock:
                    created.append(self.fs.concat_path(self.path, name))
                try:
                    written = self._write_file(
                        name, items, planner, budget, abort, stream, ledger, recorder
                    )
                except BaseException as exc:
                    abort.set()
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    results.extend(written)

        threads = [
            threading.Thread(target=work, name="te-ckpt-write", daemon=True)
            for _ in range(min(self.thread_count, len(groups)) - 1)
        ]
        try:
            for thread in threads:
                thread.start()
            work()
            for thread in threads:
                thread.join()
            if errors:
                real = [exc for exc in errors if not isinstance(exc, _AbortedError)]
                raise (real or errors)[0]
        except BaseException:
            abort.set()
            for thread in threads:
                if thread.ident is not None:
                    thread.join()
            # No file of a failed write stays behind on this rank, finished or not.
            for path in created:
                with contextlib.suppress(OSError):
                    self.fs.rm_file(path)
            raise
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(
        self,
        name: str,
        items: list[WriteItem],
        planner: SavePlanner,
        budget: threading.Semaphore,
        abort: threading.Event,
        stream: Any,
        ledger: _Ledger | None = None,
        recorder: Any = None,
    ) -> list[WriteResult]:
        written: list[WriteResult] = []
        byte_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
        tensor_items = [item for item in items if item.type != WriteItemType.BYTE_IO]
        production = _Production(
            planner, tensor_items, budget, self.lookahead, abort, stream, ledger, recorder
        )
        path = self.fs.concat_path(self.path, name)
        try:
            with self.fs.create_stream(path, "wb") as stream:
                for item in byte_items:
                    data = planner.resolve_data(item)
                    written.append(
                        _write_item(
                            self.transforms, stream, data, item, name, self.serialization_format
                        )
                    )
                for item, tensor in production:
                    written.append(
                        _write_item(
                            self.transforms, stream, tensor, item, name, self.serialization_format
                        )
                    )
                    del tensor
                if self.sync_files:
                    try:
                        os.fsync(stream.fileno())
                    except (AttributeError, UnsupportedOperation):
                        os.sync()
        except BaseException:
            abort.set()
            if production.thread.ident is not None:  # started: let it stop before we return
                production.drain()
            raise
        production.thread.join()
        return written

    # --- finishing -------------------------------------------------------------------------------
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """torch's prefixes, and the data files of earlier saves that :meth:`finish` deletes.

        Runs where ``finish`` runs (the coordinator, or each rank without collectives), after
        every rank made the directory and before any rank writes, so it lists no file of this
        save and none that a save started later writes.
        """
        plans = super().prepare_global_plan(plans)
        own_rank = None if self.use_collectives or self.rank is None else self.rank
        self._replaced = _own_data_files(self.path, own_rank)
        return plans

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        current = {result.storage_data.relative_path for group in results for result in group}
        replaced, self._replaced = self._replaced, set()
        for name in sorted(replaced - current):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.fs.concat_path(self.path, name))
