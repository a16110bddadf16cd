"""``PlacedOptimizerState``: a DCP ``Stateful`` of optimizer state under an export policy.

Uses only APIs that torch 2.11 (the GPU machine's version) and 2.13 share.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from .. import _host_budget
from .._policy import Placement, as_placement, export_placement
from ._handshake import LoadSession, StreamingLoadWarning, StreamingTemplate, merge_part
from ._lazy_state import lazy_optimizer_state_dict, resolve_loaded

StateDict = dict[str, Any]

ModelParts = torch.nn.Module | Sequence[torch.nn.Module]
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
SAVE_MODES = ("export", "streaming")


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
        save: ``"export"`` (default): :meth:`state_dict` exports every state to host memory
            under the policy. ``"streaming"``: it returns lazy states
            (:func:`~te_ckpt_placement.dcp.lazy_optimizer_state_dict`) that DCP's writer
            produces one at a time when it writes them, so a save never holds the whole FP32
            export; pair it with :class:`~te_ckpt_placement.dcp.StreamingWriter` (docs/dcp.md).
            Loads work the same in both modes.

    Raises:
        ValueError: for a model, optimizer, placement, options or save value outside those above.

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
        save: Literal["export", "streaming"] = "export",
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
        if save not in SAVE_MODES:
            raise ValueError(
                f"unsupported save {save!r}: valid values are 'export' (state_dict() exports "
                "every state) or 'streaming' (lazy states that DCP's writer produces one at a time)"
            )
        if save == "streaming" and not self.placement.streams:
            raise ValueError(
                "unsupported save='streaming' with placement=None: valid placements for a "
                "streaming save are 'cpu' or a Placement(device='cpu', ...)"
            )
        self.options = options
        self.save = save
        # One (model, optimizers) pair per call of get_/set_optimizer_state_dict.
        if len(parts) == 1:
            self._pairs = [(parts[0], tuple(optims))]
        else:
            self._pairs = [(part, (opt,)) for part, opt in zip(parts, optims, strict=True)]
        # The streaming load (a StreamingLoadPlanner) whose template the next state_dict()
        # returns, and the one that wrote states but never finished (dcp.load raised part-way).
        self._armed: LoadSession | None = None
        self._unfinished: LoadSession | None = None

    def _each(self, fn: Callable[[torch.nn.Module, tuple[Any, ...]], Any]) -> list[Any]:
        # The policy covers the whole call: export, DCP's fake step on a fresh optimizer, load.
        with export_placement(self.placement):
            return [fn(model, optims) for model, optims in self._pairs]

    # --- the load handshake (._handshake): what a StreamingLoadPlanner calls -----------------
    def parts(self) -> list[tuple[torch.nn.Module, Any]]:
        """Each ``(model, optimizer)`` pair of the adapter, in order."""
        return [(model, optim) for model, optims in self._pairs for optim in optims]

    @property
    def unfinished_load(self) -> LoadSession | None:
        """The streaming load that wrote states into the optimizers and never finished, if any."""
        return self._unfinished

    def _arm(self, session: LoadSession) -> None:
        """The next :meth:`state_dict` returns ``session``'s template (the load's own call)."""
        self._armed = session

    def _disarm(self, session: LoadSession) -> bool:
        """Takes back ``session``'s arming; False when the adapter was not armed for it."""
        if self._armed is not session:
            return False
        self._armed = None
        return True

    def _load_started(self, session: LoadSession) -> None:
        """``session`` began writing states: until it finishes, they mix two checkpoints."""
        self._unfinished = session

    def _load_finished(self) -> None:
        """A complete load wrote every state."""
        self._unfinished = None

    def state_dict(self) -> StateDict:
        """The flattened optimizer state dict, exported under the policy.

        After ``StreamingLoadPlanner(self)`` was made, the next call returns that planner's
        streaming template instead (entries without data, for ``dcp.load``).

        Raises:
            ValueError: two model parts export the same key (their FQNs overlap).
        """
        session, self._armed = self._armed, None
        if session is not None:
            template = session.template_for(self)
            if template is not None:
                return template  # else: the planner warned, the template path loads
        elif self._unfinished is not None:
            warnings.warn(
                "the last streaming load of this optimizer stopped part-way "
                f"({self._unfinished.progress}): it mixes checkpoint and previous values",
                StreamingLoadWarning,
                stacklevel=2,
            )
        if self.save == "streaming":
            parts = [
                lazy_optimizer_state_dict(
                    model, optims, options=self.options, placement=self.placement
                )
                for model, optims in self._pairs
            ]
        else:
            if self.placement.streams:
                self._check_host_budget()
            parts = self._each(
                lambda model, optims: get_optimizer_state_dict(model, optims, options=self.options)
            )
        merged: StateDict = {}
        for part in parts:
            merge_part(merged, part)
        return merged

    def _check_host_budget(self) -> None:
        """Warns once when the host export would not fit in this rank's share of host memory."""
        export = _host_budget.export_bytes(
            state for _, optims in self._pairs for opt in optims for state in opt.state.values()
        )
        _host_budget.check(
            "export",
            export,
            fits=(
                f"A process-based dcp.async_save staged by torch's DefaultStager holds it twice "
                f"({2 * export} bytes). PlacedOptimizerState(save='streaming') saved with "
                "te_ckpt_placement.dcp.StreamingWriter holds about "
                f"{_host_budget.STREAMING_OVERHEAD_BYTES >> 30} GiB plus a few FP32 states; "
                "staged with te_ckpt_placement.dcp.SnapshotStager, the raw stored bytes"
            ),
        )

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Loads a flattened optimizer state dict into every optimizer, under the policy.

        A streaming template (see :class:`StreamingLoadPlanner`) already holds its states in
        the optimizers: this loads its ``param_groups``.
        """
        if isinstance(state_dict, StreamingTemplate):
            state_dict.finish()
            return
        # A save="streaming" template holds lazy states that DCP read into: their host tensors.
        state_dict = resolve_loaded(state_dict)
        # Each part picks its own keys from the merged dict (as torchtitan's container does).
        self._each(
            lambda model, optims: set_optimizer_state_dict(
                model, optims, optim_state_dict=state_dict, options=self.options
            )
        )
        self._load_finished()
