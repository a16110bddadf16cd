"""torch.distributed.checkpoint (DCP) helpers for streamed optimizer exports.

- :class:`PassThroughStager`: an ``AsyncStager`` for ``dcp.async_save`` that hands tensors produced
  by a streaming export to the writer as they are, and stages everything else with torch's stager.
- :class:`PlacedOptimizerState`: a ``Stateful`` over (model, optimizers), the way torchtitan and
  NeMo Automodel wrap them, whose ``state_dict``/``load_state_dict`` run under an export policy.

Both use only APIs that torch 2.11 (the GPU machine's version) and 2.13 share. Importing this
module imports torch.distributed.checkpoint, not Transformer Engine.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from .engine import is_exported
from .policy import Placement, as_placement, export_placement

__all__ = ["PassThroughStager", "PlacedOptimizerState"]

StateDict = dict[str, Any]
# What an AsyncStager.stage returns: the staged dict, or a Future of it (asynchronous staging).
Staged = StateDict | Future[StateDict]

# dcp.async_save's own stager when it is given none (torch 2.11 and 2.13 state_dict_saver.py,
# ``DefaultStager(StagingOptions(False, False, False, False))``): no pinning, no shared memory,
# staging in the caller's thread, blocking copies.
ASYNC_SAVE_DEFAULT_OPTIONS = (False, False, False, False)

# A kept subtree: for each key (or index) on a path to an exported tensor, either the tensor
# itself or the subtree below that key.
_Kept = dict[Any, Any]


def _rebuild(container: Any, items: dict[Any, Any]) -> Any:
    """A shallow copy of ``container`` with ``items`` replaced; the original is never mutated."""
    if isinstance(container, tuple):
        values = list(container)
        for index, value in items.items():
            values[index] = value
        if hasattr(container, "_fields"):  # a namedtuple takes its fields positionally
            return type(container)(*values)
        return type(container)(values)
    new = copy.copy(container)
    for key, value in items.items():
        new[key] = value
    return new


def _split(obj: Any) -> tuple[Any, _Kept | torch.Tensor | None]:
    """Separates exported tensors from the rest.

    Returns ``(skeleton, kept)``: ``skeleton`` is ``obj`` with every exported tensor replaced by
    ``None`` (containers on those paths are shallow copies; untouched subtrees are the original
    objects, so the inner stager sees the same identities and sharing as without us), and
    ``kept`` says where the exported tensors were, or is ``None`` when there were none.
    """
    if isinstance(obj, torch.Tensor):
        return (None, obj) if is_exported(obj) else (obj, None)
    if isinstance(obj, dict):
        entries: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        entries = enumerate(obj)
    else:
        return obj, None
    kept: _Kept = {}
    replaced: dict[Any, Any] = {}
    for key, value in entries:
        skeleton, below = _split(value)
        if below is not None:
            kept[key] = below
            replaced[key] = skeleton
    if not kept:
        return obj, None
    return _rebuild(obj, replaced), kept


def _merge(staged: Any, kept: _Kept, path: str = "") -> Any:
    """Puts the kept tensors back into the staged structure, copying containers, not mutating."""
    replaced: dict[Any, Any] = {}
    for key, value in kept.items():
        where = f"{path}.{key}" if path else str(key)
        try:
            staged_value = staged[key]
        except (KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(
                f"the inner stager changed the state dict's structure at {where!r}: "
                "PassThroughStager needs a stager that keeps nested dicts, lists and tuples "
                "as they are (torch's DefaultStager and BlockingAsyncStager do)"
            ) from exc
        if isinstance(value, torch.Tensor):
            replaced[key] = value
        else:
            replaced[key] = _merge(staged_value, value, where)
    return _rebuild(staged, replaced)


class PassThroughStager(AsyncStager):
    """An async-save stager that does not copy what a streaming export produced.

    ``dcp.async_save`` stages the state dict before writing it in the background, so training
    can change the originals meanwhile; torch's stagers copy every tensor for that, CPU tensors
    included. A tensor made by ``FusedAdam.state_dict()`` inside ``export_placement("cpu")`` is
    already such a copy: a private host snapshot that owns its storage and that nothing else
    references or writes (the optimizer keeps its own live states, and a later export makes new
    tensors). Copying it again would only double the host memory and time of the save, so this
    stager passes those tensors (and DTensors wrapping them) through as they are. It recognises
    them with :func:`te_ckpt_placement.engine.is_exported`; a view of one, a model weight, a GPU
    tensor or any other CPU tensor is not exported and is staged by the inner stager as usual.
    The nested structure of the state dict is kept.

    Args:
        options: ``StagingOptions`` for the inner ``DefaultStager``. With neither ``options`` nor
            ``inner``, each ``stage`` call uses what ``dcp.async_save`` uses when given no
            stager: a fresh ``DefaultStager(StagingOptions(False, False, False, False))``,
            staging in the caller's thread, closed right after. With ``options``, one
            ``DefaultStager(options)`` serves every call and caches its staging buffers across
            saves as torch's does: as with any reused stager, let a save's upload finish before
            the next ``async_save``.
        inner: Any other ``AsyncStager`` for the non-exported part. It must keep nested dicts,
            lists and tuples (torch's stagers do). :meth:`close` closes it.

    Raises:
        ValueError: ``options`` is not a ``StagingOptions``, ``inner`` is not an ``AsyncStager``,
            or both are given.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> stager = PassThroughStager()
        >>> with export_placement("cpu"):
        ...     optim = get_optimizer_state_dict(model, opt, options=options)  # doctest: +SKIP
        >>> response = dcp.async_save(
        ...     {"model": get_model_state_dict(model), "optim": optim},
        ...     checkpoint_id=path,
        ...     async_stager=stager,
        ... )  # doctest: +SKIP
        >>> response.result()  # the write; training may continue meanwhile  # doctest: +SKIP
        >>> stager.close()  # after the last save  # doctest: +SKIP
    """

    def __init__(
        self, options: StagingOptions | None = None, *, inner: AsyncStager | None = None
    ) -> None:
        if options is not None and not isinstance(options, StagingOptions):
            raise ValueError(
                f"unsupported options {options!r}: valid values are None (the defaults of "
                "dcp.async_save) or a torch.distributed.checkpoint.staging.StagingOptions"
            )
        if inner is not None and not isinstance(inner, AsyncStager):
            raise ValueError(
                f"unsupported inner stager {inner!r}: valid values are None (torch's "
                "DefaultStager) or an AsyncStager such as DefaultStager or BlockingAsyncStager"
            )
        if options is not None and inner is not None:
            raise ValueError(
                "pass either options (for the inner DefaultStager) or inner (a ready stager), "
                "not both: options would be ignored"
            )
        if inner is None and options is not None:
            inner = DefaultStager(options)
        self._inner = inner
        self._future: Future[StateDict] | None = None

    @property
    def inner(self) -> AsyncStager | None:
        """The stager of the non-exported part (``None``: a fresh default one per call)."""
        return self._inner

    @property
    def should_synchronize_after_execute(self) -> bool:
        """The inner stager's answer: ``dcp.async_save`` then calls :meth:`synchronize_staging`."""
        if self._inner is None:
            return True
        return bool(self._inner.should_synchronize_after_execute)

    def stage(self, state_dict: StateDict, **kwargs: Any) -> Staged:
        """Stages ``state_dict``: exported tensors as they are, the rest through the inner stager.

        Args:
            state_dict: What ``dcp.async_save`` stages (``Stateful`` values already replaced by
                their ``state_dict()``).
            **kwargs: Passed to the inner stager's ``stage``.

        Returns:
            The staged dict, or a ``Future`` of it when the inner stager stages asynchronously.
        """
        self._future = None  # synchronize_staging waits for this call's staging only
        skeleton, kept = _split(state_dict)
        if self._inner is None:
            stager = DefaultStager(StagingOptions(*ASYNC_SAVE_DEFAULT_OPTIONS))
            try:
                staged: Staged = stager.stage(skeleton, **kwargs)
            finally:
                # Synchronous staging is complete here; closing drops the storage cache, so no
                # later save can write into buffers this one still uploads (what dcp.async_save
                # does with the stager it creates).
                stager.close()
        else:
            staged = self._inner.stage(skeleton, **kwargs)
        if kept is None:
            return staged
        assert isinstance(kept, dict)  # the top level of a state dict is a container
        if not isinstance(staged, Future):
            return _merge(staged, kept)

        # Asynchronous inner staging: our future completes after the inner one, with the merge.
        # ``kept`` holds the exported tensors themselves, so the merge never reads the caller's
        # dict, which the caller may change once stage() has returned.
        out: Future[StateDict] = Future()

        def finish(done: Future[StateDict], kept: _Kept = kept) -> None:
            try:
                out.set_result(_merge(done.result(), kept))
            except BaseException as exc:
                out.set_exception(exc)

        staged.add_done_callback(finish)
        self._future = out
        return out

    def synchronize_staging(self) -> None:
        """Waits until the last asynchronous staging is complete; a no-op for synchronous ones."""
        future, self._future = self._future, None
        if future is not None:
            future.result()
        elif self._inner is not None:
            self._inner.synchronize_staging()

    def close(self) -> None:
        """Closes the inner stager (after the last save, as for any stager given to DCP)."""
        if self._inner is not None:
            self._inner.close()


ModelParts = torch.nn.Module | Sequence[torch.nn.Module]
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def _as_list(value: Any, kind: type, what: str, hint: str) -> list[Any]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(item, kind) for item in items):
        raise ValueError(f"unsupported {what} {value!r}: valid values are {hint}")
    return items


class PlacedOptimizerState(Stateful):
    """A DCP ``Stateful`` of optimizer state, exported and loaded under an export policy.

    ``dcp.save({"optim": state})`` calls :meth:`state_dict`, which returns
    ``get_optimizer_state_dict(model, optimizer, options=...)`` with
    ``flatten_optimizer_state_dict=True`` computed inside ``export_placement(placement)``: TE
    FusedAdam states stream to host memory instead of piling up on the GPU. ``dcp.load`` calls
    :meth:`state_dict` for the load template (so the template is on the host too), reads the
    checkpoint into it, and calls :meth:`load_state_dict`, which runs ``set_optimizer_state_dict``
    under the same policy (one state at a time, without torch's bulk cast to the GPU).

    Like torchtitan's ``OptimizersContainer`` and Automodel's ``OptimizerState``, it accepts one
    model with its optimizer(s), or model parts (pipeline stages) with one optimizer each; the
    parts' flattened dicts are merged into one.

    Args:
        model: A ``torch.nn.Module``, or a list of model parts.
        optimizers: An optimizer (or a list of optimizers) of ``model``; for a list of model
            parts, a list with one optimizer per part.
        placement: The export policy: ``"cpu"`` (default), a :class:`~te_ckpt_placement.Placement`
            (for its options), or ``None`` for Transformer Engine's own export.
        options: ``StateDictOptions`` for ``get_/set_optimizer_state_dict``; it must keep
            ``flatten_optimizer_state_dict=True`` (the default here), which merging model parts
            and DCP resharding rely on.

    Raises:
        ValueError: for a model, optimizer, placement or options value outside those above.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> state = PlacedOptimizerState(model, optimizer)  # doctest: +SKIP
        >>> dcp.save({"optim": state}, checkpoint_id=path)  # doctest: +SKIP
        >>> dcp.load({"optim": state}, checkpoint_id=path)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelParts,
        optimizers: Optimizers,
        *,
        placement: Placement | str | torch.device | None = "cpu",
        options: StateDictOptions | None = None,
    ) -> None:
        parts = _as_list(
            model,
            torch.nn.Module,
            "model",
            "a torch.nn.Module or a non-empty list of them (model parts)",
        )
        optims = _as_list(
            optimizers,
            torch.optim.Optimizer,
            "optimizers",
            "a torch.optim.Optimizer or a non-empty list of them",
        )
        if len(parts) > 1 and len(optims) != len(parts):
            raise ValueError(
                f"{len(parts)} model parts but {len(optims)} optimizers: valid values are one "
                "optimizer per model part, in the same order"
            )
        if options is None:
            options = StateDictOptions(flatten_optimizer_state_dict=True)
        elif not isinstance(options, StateDictOptions):
            raise ValueError(
                f"unsupported options {options!r}: valid values are None or a "
                "torch.distributed.checkpoint.state_dict.StateDictOptions"
            )
        elif not options.flatten_optimizer_state_dict:
            raise ValueError(
                "unsupported options: flatten_optimizer_state_dict=False; valid values are "
                "StateDictOptions(flatten_optimizer_state_dict=True, ...), which DCP resharding "
                "and merging model parts need"
            )
        elif options.full_state_dict:
            # Saving would work, but torch 2.13 cannot load a flattened full state dict
            # (set_optimizer_state_dict raises KeyError 'param_groups.0.params.0', for
            # torch.optim.Adam too; the code is the same in 2.11). Refusing here beats failing
            # at resume time; DCP reshards sharded checkpoints by itself, so full_state_dict buys
            # nothing here.
            raise ValueError(
                "unsupported options: full_state_dict=True; valid values are "
                "StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True or False). "
                "torch cannot load a flattened full optimizer state dict, and DCP reshards "
                "sharded checkpoints itself"
            )
        self.placement = as_placement(placement)  # raises ValueError naming the valid values
        self.options = options
        # One (model, optimizers) pair per call of get_/set_optimizer_state_dict.
        if len(parts) == 1:
            self._pairs = [(parts[0], tuple(optims))]
        else:
            self._pairs = [(part, (opt,)) for part, opt in zip(parts, optims, strict=True)]

    def _each(self, fn: Callable[[torch.nn.Module, tuple[Any, ...]], Any]) -> list[Any]:
        # The policy covers the whole call: export, DCP's fake step on a fresh optimizer, load.
        with export_placement(self.placement):
            return [fn(model, optims) for model, optims in self._pairs]

    def state_dict(self) -> StateDict:
        """The flattened optimizer state dict, exported under the policy.

        Raises:
            ValueError: two model parts export the same key (their FQNs overlap).
        """
        merged: StateDict = {}
        for part in self._each(
            lambda model, optims: get_optimizer_state_dict(model, optims, options=self.options)
        ):
            overlap = merged.keys() & part.keys()
            if overlap:
                raise ValueError(
                    f"model parts export the same keys {sorted(overlap)[:3]}: give each part "
                    "distinct parameter names"
                )
            merged.update(part)
        return merged

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Loads a flattened optimizer state dict into every optimizer, under the policy."""
        # Each part picks its own keys from the merged dict (as torchtitan's container does).
        self._each(
            lambda model, optims: set_optimizer_state_dict(
                model, optims, optim_state_dict=state_dict, options=self.options
            )
        )
