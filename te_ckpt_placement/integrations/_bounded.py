"""The bounded DCP routes a framework's own checkpoint code is pointed to (no framework imports).

- :func:`save`: a synchronous save is the streaming save (lazy states written by
  :class:`~te_ckpt_placement.dcp.StreamingWriter`, a few FP32 states at a time); an asynchronous
  one stages the raw stored bytes with one :class:`~te_ckpt_placement.dcp.SnapshotStager` that the
  caller keeps for the run, so the pinned buffers are reused from save to save;
- :func:`load`: ``dcp.load`` through :class:`~te_ckpt_placement.dcp.StreamingLoadPlanner`, with
  no FP32 template;
- :class:`SchedulerState`: the LR schedulers beside the optimizer state, as a ``Stateful``.

The checkpoints are those the frameworks write themselves (the same keys, FP32 and int16
values), so a run without te_ckpt_placement resumes from them and the other way round.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from ..dcp import PlacedOptimizerState, SnapshotStager, StreamingLoadPlanner, StreamingWriter

#: The executors a framework's asynchronous save may ask for.
EXECUTORS = (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS)


class SchedulerState(Stateful):
    """LR schedulers that share one state dict (Automodel's and torchtitan's convention): the
    first one's ``state_dict()`` is saved, and a load sets it on every one."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state_dict)


def save(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    executor: AsyncCheckpointerType | None = None,
    stager: SnapshotStager | None = None,
    planner: Any = None,
) -> Any:
    """Saves ``state`` (a ``PlacedOptimizerState(save="streaming")`` among its values) to
    ``path``: ``dcp.save`` with a :class:`StreamingWriter` for ``executor=None``, else
    ``dcp.async_save`` on that executor, staged by ``stager``. Returns ``dcp.async_save``'s
    response (an ``AsyncSaveResponse`` for ``async_stager`` saves), or None.

    Raises:
        ValueError: ``executor`` is not None or one of :data:`EXECUTORS`, or an async save has
            no ``stager``.
    """
    if executor is None:
        writer = StreamingWriter(path)
        try:
            dcp.save(state, storage_writer=writer, process_group=process_group, planner=planner)
        finally:
            writer.close()  # this writer's own (unused) stager
        return None
    if executor not in EXECUTORS:
        raise ValueError(
            f"unsupported executor {executor!r}: valid values are None (a synchronous save) or "
            f"one of {[e.value for e in EXECUTORS]}"
        )
    if not isinstance(stager, SnapshotStager):
        raise ValueError(
            f"unsupported stager {stager!r} for an asynchronous save: valid values are a "
            "SnapshotStager, kept for the run so its buffers are reused"
        )
    return dcp.async_save(
        state,
        storage_writer=StreamingWriter(path, stager=stager),
        process_group=process_group,
        async_stager=stager,
        async_checkpointer_type=executor,
        planner=planner,
    )


def as_response(result: Any) -> Any:
    """``dcp.async_save``'s result as an ``AsyncSaveResponse``: a snapshot is complete when
    ``async_save`` returns, so torch gives a bare upload ``Future``; frameworks that wait for
    ``staging_completion`` (Automodel, torchtitan's pinned-memory mode) get a done one."""
    from concurrent.futures import Future

    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    if isinstance(result, AsyncSaveResponse):
        return result
    staged: Future[None] = Future()
    staged.set_result(None)
    return AsyncSaveResponse(staging_completion=staged, upload_completion=result)


def load(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    adapter: PlacedOptimizerState,
    *,
    process_group: Any = None,
) -> None:
    """``dcp.load(state)`` from ``path``, the states of ``adapter`` (one of ``state``'s values)
    read straight into the live optimizer by a :class:`StreamingLoadPlanner`."""
    dcp.load(
        state,
        checkpoint_id=path,
        planner=StreamingLoadPlanner(adapter),
        process_group=process_group,
    )


_warned: set[str] = set()


def warn_once(reason: str, message: str, *, stacklevel: int) -> None:
    """Warns ``message`` (a ``RuntimeWarning``) the first time ``reason`` keeps a framework's own,
    unbounded checkpoint code."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def framework_class(owner: str, target: str, install: str) -> Any:
    """The framework class ``target`` (``"module.Class"``) that ``owner``'s ready-made class
    extends, imported now; the error says what to install when the framework is missing."""
    module_name, base_name = target.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module_name), base_name)
    except ImportError as exc:
        raise ImportError(f"{owner} extends {target}, which needs {install}: {exc}") from exc
