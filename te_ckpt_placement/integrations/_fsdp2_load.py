"""An FSDP2 optimizer load whose collectives and data stay in host memory (no framework imports).

:func:`host_group` gives the load a gloo group; :func:`load_sharded` is accelerate's
``SHARDED_STATE_DICT`` optimizer load with its collectives on that group; :func:`load_full` is a
``FULL_STATE_DICT`` load that slices each rank's shard from the memory-mapped checkpoint instead
of broadcasting every state from rank 0 through GPU memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._tensors import local as local_tensor
from . import _resume


@contextlib.contextmanager
def host_group(*, timeout: datetime.timedelta | None = None) -> Iterator[Any]:
    """A gloo process group over the default group's ranks, for collectives on host memory.

    Object collectives and barriers on a NCCL group stage their payload in GPU memory; these
    run on the host. Its collectives give up after ``timeout``, by default the default group's
    (the job's ``init_process_group(timeout=...)``): a new group would otherwise get torch's
    30-minute default, and a stuck rank would hold the others that long. Collective: every rank
    must enter it. The group is destroyed on exit.
    """
    import torch.distributed as dist

    if timeout is None:
        timeout = default_group_timeout()
    group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def default_group_timeout() -> datetime.timedelta | None:
    """The default process group's timeout, or None where this torch does not expose it (a new
    group then gets torch's default).

    torch has no public getter; its backends keep the timeout they were made with in their
    options (``ProcessGroup._get_backend(device).options._timeout``, which
    ``init_process_group`` and ``_set_pg_timeout`` set). The host (gloo) backend's is preferred.
    """
    import torch.distributed as dist

    try:
        group = dist.distributed_c10d._get_default_group()
        devices = sorted(group._device_types, key=lambda device: device.type != "cpu")
        for device in devices:
            options = getattr(group._get_backend(device), "options", None)
            timeout = getattr(options, "_timeout", None)
            if isinstance(timeout, datetime.timedelta):
                return timeout
    except (AttributeError, RuntimeError, ValueError):  # another torch's internals
        pass
    return None


def host_barrier(group: Any) -> None:
    """A barrier on the gloo ``group`` that touches no GPU memory.

    ``dist.barrier`` gives the backend a one-byte tensor on the group's bound device (the default
    group's ``device_id``, which a gloo group created from it inherits), so even on gloo it
    allocates a 512-byte CUDA block; an all-reduce of a host tensor synchronizes the same ranks.
    """
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1), group=group)


def load_sharded(model: Any, optimizer: Any, checkpoint_id: str, options: Any, group: Any) -> None:
    """accelerate's FSDP2 ``SHARDED_STATE_DICT`` optimizer load with its collectives on ``group``.

    The same calls as ``accelerate.utils.fsdp_utils.load_fsdp_optimizer`` (a template from
    ``get_optimizer_state_dict``, ``dcp.load`` into it, ``set_optimizer_state_dict``), with
    DCP's planning collectives and the barriers on the host group.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    host_barrier(group)
    state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    dcp_load(
        state,
        storage_reader=FileSystemReader(checkpoint_id),
        planner=DefaultLoadPlanner(),
        process_group=group,
    )
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    del state
    host_barrier(group)


def load_full(model: Any, optimizer: Any, path: str, options: Any, group: Any) -> bool:
    """An FSDP2 ``FULL_STATE_DICT`` optimizer load that slices each rank's shard on the host.

    torch's full-state load broadcasts every state from rank 0 through GPU memory, one whole
    (unsharded) state at a time. Here every rank maps ``path`` into memory, copies its own
    shard of each state into a local template (``get_optimizer_state_dict`` without
    ``full_state_dict``) and loads that template. Needs ``path`` readable on every rank (a
    shared checkpoint directory); returns False, having loaded nothing, when some rank cannot
    read it.

    The ranks agree before any of them changes its optimizer: if reading or checking the
    checkpoint fails on one rank, every rank raises and none has loaded anything. A TE
    FusedAdam's states are checked as its streaming load checks them
    (:func:`te_ckpt_placement._te_load.check_value`: int16 master remainders against FP32
    masters, integer or complex states, ...), before the copy into the template would cast
    them. The ranks also compare a fingerprint of what they read
    (:func:`~te_ckpt_placement.integrations._fingerprint.fingerprint`: steps, structure, dtypes,
    shapes and sampled bytes), since torch's load gives every rank rank 0's values: ranks
    whose files at ``path`` differ raise, naming each rank's step. If loading the checked
    template fails on some rank, every rank raises too, and the error names the ranks that
    loaded the checkpoint and those that failed.

    Raises:
        ValueError: a state's global shape differs from the checkpoint's, or the streaming
            load would refuse a state (on every rank where it does); the optimizer is
            unchanged.
        RuntimeError: on the ranks where nothing failed, when another rank failed; on every
            rank, when the ranks read different checkpoints (nothing loaded).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from ._fingerprint import fingerprint

    readable = os.path.isfile(path) and os.access(path, os.R_OK)
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, readable, group=group)
    if not all(seen):
        return False
    local = dataclasses.replace(options, full_state_dict=False, broadcast_from_rank0=False)
    plan: _FullLoad | None = None
    read: str | None = None
    failure: BaseException | None = None
    try:
        full = _resume.host_load(path, mmap=True)
        read = fingerprint(full)
        template = get_optimizer_state_dict(model, optimizer, options=local)
        plan = _check_full(template, full, path, check=_state_check(model, optimizer))
        del template, full
    except BaseException as exc:  # every rank learns of it below, before any rank loads
        failure = exc
    unchanged = (
        "Nothing was loaded on any rank; the optimizer holds what it held before (an optimizer "
        "that had no state may hold its initial states, as torch's template gives it)."
    )
    reads = _agree(failure, group, f"cannot load the optimizer checkpoint {path}", unchanged, read)
    if len(set(reads)) > 1:
        by_read: dict[str, list[int]] = {}
        for rank, each in enumerate(reads):
            by_read.setdefault(each, []).append(rank)
        listed = "; ".join(f"{_ranks(ranks)}: {each}" for each, ranks in by_read.items())
        raise RuntimeError(
            f"the ranks read different checkpoints at {path} ({listed}). {unchanged} A "
            "full-state resume needs the same file on every rank: put the checkpoint on a "
            "directory every rank shares, or copy the one checkpoint to every node."
        )
    assert plan is not None  # this rank failed otherwise, and _agree raised
    try:
        set_optimizer_state_dict(model, optimizer, plan.apply(), options=local)
    except BaseException as exc:  # also an interrupt: the other ranks must not wait for it
        failure = exc
    del plan
    _agree(
        failure,
        group,
        f"loading the optimizer checkpoint {path} failed on some ranks",
        "The ranks not listed loaded the checkpoint; the failed ranks' optimizers may be "
        "partly loaded, so the ranks now differ: resume again from a checkpoint.",
    )
    return True


def _agree(
    failure: BaseException | None, group: Any, what: str, consequence: str, share: Any = None
) -> list[Any]:
    """Raises on every rank of ``group`` when ``failure`` is set on any (a collective); returns
    every rank's ``share`` otherwise, in rank order.

    A failed rank re-raises its own error, with the outcome as a note (Python >= 3.11) or, on
    3.10, logged; the others raise a RuntimeError naming each failed rank (its rank in
    ``group``) and its error, ranks with the same error together. The exchange is also the
    ranks' synchronization point, on the host.
    """
    import torch.distributed as dist

    outcome = None if failure is None else _describe(failure)
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (outcome, share), group=group)
    by_message: dict[str, list[int]] = {}
    for rank, (message, _) in enumerate(seen):
        if message is not None:
            by_message.setdefault(message, []).append(rank)
    if not by_message:
        return [each for _, each in seen]
    listed = "; ".join(f"{_ranks(ranks)}: {message}" for message, ranks in by_message.items())
    summary = f"{what} ({listed}). {consequence}"
    if failure is not None:
        if hasattr(failure, "add_note"):
            failure.add_note(f"te_ckpt_placement: {summary}")
        else:  # pragma: no cover - Python 3.10
            logging.getLogger("te_ckpt_placement").error("%s", summary)
        raise failure
    raise RuntimeError(summary)


def _state_check(model: Any, optimizer: Any) -> Callable[[str, str, Any], None] | None:
    """``check(fqn, name, value)``: the streaming load's check of a checkpoint value as state
    ``name`` of the parameter ``fqn`` of a TE FusedAdam (:func:`te_load.check_value`, the same
    rule and message); None for another optimizer, whose own load casts its states."""
    from .._te_contract import has_contract

    inner = _resume._unwrap(optimizer)
    if not has_contract(inner):
        return None
    from torch.distributed.checkpoint.state_dict import _get_fqns

    from .._te_load import check_value

    # The FQNs torch's get_optimizer_state_dict names the optimizer's parameters by.
    params = {
        fqn: param
        for name, param in model.named_parameters(remove_duplicate=False)
        for fqn in _get_fqns(model, name)
    }

    def check(fqn: str, name: str, value: Any) -> None:
        param = params.get(fqn)
        if param is None:
            raise ValueError(
                f"cannot load the optimizer checkpoint: state {name!r} of {fqn}: the model has "
                "no parameter of that name. Nothing was loaded; the optimizer is unchanged."
            )
        check_value(inner, param, fqn, name, value)

    return check


def _describe(failure: BaseException) -> str:
    """``"Type: message"``, or the type alone where the message itself cannot be made."""
    try:
        return f"{type(failure).__name__}: {failure}"
    except Exception:
        return type(failure).__name__


def _ranks(ranks: list[int]) -> str:
    """``"rank 3"`` or ``"ranks 0-2, 5"``."""
    spans: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


@dataclasses.dataclass
class _FullLoad:
    """A checked full-state load: the template flattened, and each shard copy still to make.

    The template's tensors can be the optimizer's live states (FSDP2's sharded FP32 states
    without ``cpu_offload`` are), so nothing is copied before :meth:`apply`.
    """

    flat: dict[str, Any]
    paths: dict[str, Any]
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (template tensor, its shard of the file)

    def apply(self) -> dict[str, Any]:
        """Copies each rank's shard into the template; returns the state dict to load."""
        from torch.distributed._state_dict_utils import _unflatten_state_dict

        for value, shard in self.copies:
            local_tensor(value).copy_(shard)
        merged: dict[str, Any] = _unflatten_state_dict(self.flat, self.paths)
        for group in merged.get("param_groups", []):
            group.setdefault("params", [])  # torch's too: flattening drops empty lists
        return merged


def _shard_of(value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The part of the checkpoint's (global) ``source`` that this rank's ``value`` holds: a view
    of the mapped file, read only when copied."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(value, DTensor):
        return source
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return source[tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))]


def _check_full(
    template: dict[str, Any],
    full: dict[str, Any],
    path: str,
    *,
    check: Callable[[str, str, Any], None] | None = None,
) -> _FullLoad:
    """What torch's full-state load hands the optimizer, with each rank's shard copied on the host.

    torch (``_load_optim_state_dict`` with ``full_state_dict``) matches the saved groups to the
    optimizer's by parameter FQN, flattens the saved and the local state dicts into paths
    (``_flatten_state_dict``: dicts, lists and tuples), lets each saved value replace the local
    one and unflattens the local dict, so a group's tuples come back as lists (``betas``). This
    does the same, except that a state tensor's shard is sliced from the mapped checkpoint into
    the template's tensor instead of broadcast from rank 0 through GPU memory. Values the
    checkpoint lacks keep the template's; saved tensors the template has no state for are left
    out (every rank but 0 drops them in torch's broadcast load). Checks every state first, each
    saved state value that the load takes also with ``check(fqn, name, value)`` (a tensor as
    this rank's shard of it); the returned plan copies when applied.

    Raises:
        ValueError: a state's global shape differs from the checkpoint's; what ``check``
            raises.
    """
    from torch.distributed._state_dict_utils import _flatten_state_dict

    saved_states = full.get("state", {})
    saved = {
        "state": {fqn: saved_states[fqn] for fqn in template["state"] if fqn in saved_states},
        "param_groups": _groups_by_fqn(template["param_groups"], full.get("param_groups", [])),
    }
    flat_saved, saved_paths = _flatten_state_dict(saved)
    flat, paths = _flatten_state_dict(template)
    copies = []

    def checked(where: tuple[Any, ...], value: Any) -> None:
        # None: a state TE's load and te_load skip (te_load.plan_load), so not checked either.
        if check is not None and where[0] == "state" and len(where) >= 3 and value is not None:
            check(where[1], where[2], value)

    for key, source in flat_saved.items():
        where = saved_paths[key]
        if where[0] == "state" and len(where) > 3:  # a container where a state tensor goes
            checked(where, saved_states[where[1]][where[2]])
        if not (isinstance(source, torch.Tensor) and source.dim() > 0):
            # torch: a 0-dim tensor moves to the CPU, anything else is taken as it is.
            checked(where, source)
            flat[key] = source.clone() if isinstance(source, torch.Tensor) else source
            paths.setdefault(key, where)
            continue
        value = flat.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if tuple(source.shape) != tuple(value.shape):
            *_, fqn, name = where
            raise ValueError(
                f"cannot load the optimizer checkpoint {path}: state {name!r} of {fqn} has "
                f"shape {tuple(source.shape)}, the model's {tuple(value.shape)}. Nothing "
                "was loaded; the optimizer is unchanged."
            )
        shard = _shard_of(value, source)
        checked(where, shard)
        copies.append((value, shard))
    return _FullLoad(flat, paths, copies)


def _groups_by_fqn(
    groups: list[dict[str, Any]], saved: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The template's groups with the hyperparameters of the saved groups that hold their
    parameters, as torch's ``_split_optim_state_dict`` matches them: a saved group goes to the
    last template group sharing a parameter FQN with it, or, holding none, to the one template
    group without parameters."""
    owner = {fqn: i for i, group in enumerate(groups) for fqn in group["params"]}
    empty = [i for i, group in enumerate(groups) if not group["params"]]
    out: list[dict[str, Any]] = [{"params": list(group["params"])} for group in groups]
    for group in saved:
        fqns = group.get("params", [])
        hits = [owner[fqn] for fqn in fqns if fqn in owner]
        if hits:
            index = max(hits)
        elif not fqns and len(empty) == 1:
            index = empty[0]
        else:
            continue
        out[index].update((key, value) for key, value in group.items() if key != "params")
    return out
