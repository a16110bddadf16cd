"""``PassThroughStager``: async DCP saves that do not copy what a streaming export produced.

Uses only APIs that torch 2.11 (the GPU machine's version) and 2.13 share.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from .._export import is_exported
from .._tree import map_tree

StateDict = dict[str, Any]
# What an AsyncStager.stage returns: the staged dict, or a Future of it (asynchronous staging).
Staged = StateDict | Future[StateDict]

# dcp.async_save's own stager when it is given none (torch 2.11 and 2.13 state_dict_saver.py,
# ``DefaultStager(StagingOptions(False, False, False, False))``): no pinning, no shared memory,
# staging in the caller's thread, blocking copies.
ASYNC_SAVE_DEFAULT_OPTIONS = (False, False, False, False)

# Where the exported tensors were: their paths (keys and indices from the root), in order.
_Kept = dict[tuple[Any, ...], torch.Tensor]


def _split(obj: Any) -> tuple[Any, _Kept]:
    """Separates exported tensors from the rest.

    Returns ``(skeleton, kept)``: ``skeleton`` is ``obj`` with every exported tensor replaced by
    ``None`` (containers on those paths are shallow copies; untouched subtrees are the original
    objects, so the inner stager sees the same identities and sharing as without us), and
    ``kept`` maps the path of each exported tensor to it (empty when there were none).
    """
    kept: _Kept = {}

    def keep(value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor) and is_exported(value):
            kept[path] = value
            return None
        return value

    return map_tree(obj, keep, copy_changed=True), kept


def _changed_structure(staged: Any, kept: _Kept) -> RuntimeError | None:
    """The error for the first kept path that ``staged`` lacks, or None."""
    for path in kept:
        node = staged
        for depth, key in enumerate(path):
            try:
                if not isinstance(node, (dict, list, tuple)):
                    raise TypeError(type(node).__name__)
                node = node[key]
            except (KeyError, IndexError, TypeError):
                where = ".".join(str(k) for k in path[: depth + 1])
                return RuntimeError(
                    f"the inner stager changed the state dict's structure at {where!r}: "
                    "PassThroughStager needs a stager that keeps nested dicts, lists and tuples "
                    "as they are (torch's DefaultStager and BlockingAsyncStager do)"
                )
    return None


def _merge(staged: Any, kept: _Kept) -> Any:
    """Puts the kept tensors back into the staged structure, copying containers, not mutating."""
    error = _changed_structure(staged, kept)
    if error is not None:
        raise error
    return map_tree(staged, lambda value, path: kept.get(path, value), copy_changed=True)


class PassThroughStager(AsyncStager):
    """An async-save stager that does not copy what a streaming export produced.

    ``dcp.async_save`` stages the state dict before writing it in the background, so training
    can change the originals meanwhile; torch's stagers copy every tensor for that, CPU tensors
    included. A tensor made by ``FusedAdam.state_dict()`` inside ``export_placement("cpu")`` is
    already such a copy: a private host snapshot that owns its storage and that nothing else
    references or writes (the optimizer keeps its own live states, and a later export makes new
    tensors). Copying it again would only double the host memory and time of the save, so this
    stager passes those tensors (and DTensors wrapping them) through as they are. It recognises
    them with :func:`te_ckpt_placement._export.is_exported`; a view of one, a model weight, a GPU
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
        if not kept:
            return staged
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
