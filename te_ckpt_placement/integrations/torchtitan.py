"""torchtitan: its ``OptimizersContainer`` and ``CheckpointManager`` on the bounded DCP paths.

Importing this module does not import ``torchtitan``; asking for a ready-made class
(:data:`PLACEMENT_CLASSES`: ``PlacementOptimizersContainer``, ``PlacementCheckpointManager``)
does, at that moment. Two mixins, meant to be used together:

- :class:`PlacementOptimizersMixin` (an ``OptimizersContainer``): ``state_dict()`` returns the
  placed, streaming states (lazy states that DCP's writer produces one at a time) under
  torchtitan's own keys, and ``load_state_dict()`` loads under the policy; a fresh TE optimizer
  gets TE's initial states directly instead of torchtitan's zero-gradient ``init_optim_state``
  step. The optimizer name ``"TEFusedAdam"`` builds :class:`te_ckpt_placement.FusedAdam`.
- :class:`PlacementCheckpointMixin` (a ``CheckpointManager``): ``dcp_save`` is the streaming
  save (``async_mode="disabled"``) or the raw snapshot, staged by one
  :class:`~te_ckpt_placement.dcp.SnapshotStager` kept for the run and closed by ``_close``
  (``"async"``: thread executor; ``"async_with_pinned_mem"``: process executor, shared memory);
  ``dcp_load`` reads the optimizer through
  :class:`~te_ckpt_placement.dcp.StreamingLoadPlanner` (no FP32 template, no fake step).

The checkpoint has torchtitan 0.3.0's keys (``optimizer.state.<fqn>.<state>``,
``optimizer.param_groups.<fqn>.<key>``, no ``param_names``: its ``get_flat_optim_state_dict``)
and TE's FP32/int16 values, so placed and unplaced runs resume from each other's checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from te_ckpt_placement._policy import as_placement
from te_ckpt_placement.integrations import _bounded
from te_ckpt_placement.integrations._methods import Framework, PlacementLike

__all__ = [
    "PLACEMENT_CLASSES",
    "TE_FUSED_ADAM",
    "TORCHTITAN",
    "PlacementCheckpointMixin",
    "PlacementOptimizersMixin",
]

MODULE = "te_ckpt_placement.integrations.torchtitan"
TORCHTITAN = Framework("torchtitan", ("torchtitan", "torchtitan"), tested="0.3.0")

#: The ``ParamGroupConfig.optimizer_name`` that builds :class:`te_ckpt_placement.FusedAdam`.
TE_FUSED_ADAM = "TEFusedAdam"

# torchtitan 0.3.0 components/checkpointer/base.py: the keys of CheckpointManager.states.
_OPTIMIZER, _MODEL = "optimizer", "model"


def _names_key(key: str) -> bool:
    # torch's flattened export keeps each group's "param_names" (param_groups.<fqn>.param_names);
    # torchtitan 0.3.0's get_flat_optim_state_dict drops it (optimizer/utils.py
    # _optim_state_dict_to_fqn_keys) and its load takes the live group's names.
    return key.startswith("param_groups.") and key.endswith(".param_names")


def _titan_state(parts: list[Any], optimizers: list[Any], placement: Any) -> Any:
    """A ``PlacedOptimizerState(save="streaming")`` with torchtitan's keys (see :class:`_State`)."""
    from te_ckpt_placement._te_contract import has_contract
    from te_ckpt_placement._te_load import initialize_states
    from te_ckpt_placement.dcp import PlacedOptimizerState

    class _State(PlacedOptimizerState):
        """torch's flattened export of the container's optimizers without ``param_names``,
        which are put back from the live groups for the load."""

        def __init__(self) -> None:
            if len(parts) == 1:
                model: Any = parts[0]
            elif len(optimizers) == len(parts):
                model = parts
            else:
                raise ValueError(
                    f"{len(parts)} model parts and {len(optimizers)} optimizers: the placed "
                    "torchtitan checkpoint supports one model part, or one optimizer (one "
                    "optimizer_name) per model part; give every ParamGroupConfig the same "
                    "optimizer_name or set optimizer_export_placement = None"
                )
            super().__init__(model, optimizers, placement=placement, save="streaming")
            self._names: dict[str, Any] = {}

        def state_dict(self) -> dict[str, Any]:
            if self._armed is None:  # a StreamingLoadPlanner makes initial states itself
                for optimizer in optimizers:
                    if has_contract(optimizer):
                        initialize_states(optimizer)  # instead of init_optim_state's step
            state = super().state_dict()
            for key in [k for k in state if _names_key(k)]:
                self._names[key] = state.pop(key)
            return state

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            for key, names in self._names.items():
                state_dict.setdefault(key, names)
            super().load_state_dict(state_dict)

    return _State()


class PlacementOptimizersMixin:
    """Put it first in an ``OptimizersContainer`` subclass's bases.

    ``state_dict()`` returns the container's optimizer states as lazy streaming states under
    ``export_placement(optimizer_export_placement)``, keyed as torchtitan keys them, and
    ``load_state_dict()`` loads under the same policy; a fresh TE ``FusedAdam`` gets TE's initial
    states (and its step count) instead of torchtitan's zero-gradient step. Save through
    :class:`PlacementCheckpointMixin`: torch's own writers hold every state of a streaming
    save at once, and torch's ``FileSystemWriter`` refuses them in an ``"async"`` save.
    ``ParamGroupConfig(optimizer_name="TEFusedAdam", ...)`` builds
    :class:`te_ckpt_placement.FusedAdam` (which imports Transformer Engine).

    Attributes:
        optimizer_export_placement: ``"cpu"`` by default, or a ``Placement``; ``None`` runs
            torchtitan's own ``state_dict``/``load_state_dict``.
    """

    optimizer_export_placement: PlacementLike = "cpu"

    @classmethod
    def _resolve_optimizer_factory(cls, name: str) -> Any:
        if name == TE_FUSED_ADAM:
            from te_ckpt_placement import FusedAdam

            return FusedAdam
        return super()._resolve_optimizer_factory(name)  # type: ignore[misc]

    def placed_state(self) -> Any:
        """The container's ``PlacedOptimizerState`` (built once), or None without a placement.

        Raises:
            ValueError: several model parts with more than one optimizer each.
        """
        placement = as_placement(self.optimizer_export_placement)
        if placement is None:
            return None
        state = vars(self).get("_te_ckpt_placement_state")
        if state is None or state.placement != placement:
            container: Any = self
            state = _titan_state(list(container.model_parts), list(container.optimizers), placement)
            vars(self)["_te_ckpt_placement_state"] = state
        return state

    def state_dict(self) -> dict[str, Any]:
        state = self.placed_state()
        if state is None:
            return super().state_dict()  # type: ignore[misc,no-any-return]
        return state.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = self.placed_state()
        if state is None:
            super().load_state_dict(state_dict)  # type: ignore[misc]
            return
        state.load_state_dict(state_dict)


def _keep_torchtitan(reason: str) -> None:
    _bounded.warn_once(
        reason,
        f"te_ckpt_placement: {reason}: torchtitan's own dcp_save/dcp_load run (the whole "
        "optimizer export on the host); the bounded paths need an OptimizersContainer "
        "with PlacementOptimizersMixin (a placement set) and native DCP checkpoints",
        stacklevel=3,
    )


def _placed(state_dict: dict[str, Any]) -> Any:
    """The placed state of the container in ``state_dict``, or None (warned once) for
    torchtitan's own path."""
    container = state_dict.get(_OPTIMIZER)
    if container is None:
        return None  # a model-only save or load (step 0, last step): nothing to bound
    if not isinstance(container, PlacementOptimizersMixin):
        _keep_torchtitan(f"the optimizers are a {type(container).__qualname__}")
        return None
    state = container.placed_state()
    if state is None:
        _keep_torchtitan("the container's optimizer_export_placement is None")
    return state


class PlacementCheckpointMixin:
    """Put it first in a ``CheckpointManager`` subclass's bases.

    With a :class:`PlacementOptimizersMixin` container, ``dcp_save`` writes the optimizer with
    :class:`~te_ckpt_placement.dcp.StreamingWriter` (a few FP32 states at a time), in every
    ``async_mode``: ``"disabled"`` saves synchronously, ``"async"`` stages the raw stored bytes
    with a :class:`~te_ckpt_placement.dcp.SnapshotStager` on the thread executor, and
    ``"async_with_pinned_mem"`` does so into shared memory on the process executor. The stager is
    ``self.stager``, made once for the run (torchtitan then makes no ``DefaultStager``) and closed
    by torchtitan's ``_close``. ``dcp_load`` reads through
    :class:`~te_ckpt_placement.dcp.StreamingLoadPlanner`. HF-format saves and loads, and
    containers without a placement, keep torchtitan's own code (warned once).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        manager: Any = self
        if getattr(manager, "enable", False) and manager.async_mode != "disabled":
            from te_ckpt_placement.dcp import SnapshotStager

            # Set before the first save: CheckpointManager._save makes a DefaultStager (pinned,
            # shared memory) when self.stager is None (torchtitan 0.3.0 checkpointer/dcp.py).
            shared = manager.async_mode == "async_with_pinned_mem"
            manager.stager = SnapshotStager(shared_memory=shared)

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: Any,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        placed = None if to_hf else _placed(state_dict)
        parent: Any = super()
        if placed is None:
            return parent.dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        manager: Any = self
        mode = str(getattr(async_mode, "value", async_mode))
        executors = {
            "async": AsyncCheckpointerType.THREAD,
            "async_with_pinned_mem": AsyncCheckpointerType.PROCESS,
        }
        executor = executors.get(mode)
        if executor is None and mode != "disabled":
            raise ValueError(
                f"unsupported async_mode {async_mode!r}: valid values are 'disabled', "
                f"{', '.join(repr(m) for m in executors)}"
            )
        if executor is None:
            # torchtitan's sync save is dcp.save(..., checkpoint_id) on the default group.
            result = _bounded.save(state_dict, checkpoint_id)
        else:
            result = _bounded.save(
                state_dict,
                checkpoint_id,
                process_group=manager.pg,
                executor=executor,
                stager=manager.stager,
            )
        if enable_garbage_collection:
            from torchtitan.tools.utils import GarbageCollection

            GarbageCollection.collect("GC collection invoked by checkpointer.")
        if executor is None:
            return None
        response = _bounded.as_response(result)
        if executor is AsyncCheckpointerType.PROCESS:
            return response  # CheckpointManager._save waits on staging_completion
        response.staging_completion.result()  # done: the snapshot completes in async_save
        return response.upload_completion  # "async": _save expects the upload Future

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        placed = None if from_hf else _placed(state_dict)
        parent: Any = super()
        if placed is None:
            parent.dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        # torchtitan 0.3.0 CheckpointManager.dcp_load, native branch: dcp.load, then the model's
        # load_state_dict from the same (flattened) dict.
        _bounded.load(state_dict, checkpoint_id, placed)
        manager: Any = self
        if _MODEL in manager.states:
            manager.states[_MODEL].load_state_dict(state_dict)


#: Ready-made classes by name -> (the torchtitan class they extend, the mixin put first).
PLACEMENT_CLASSES = {
    "PlacementOptimizersContainer": (
        "torchtitan.components.optimizer.OptimizersContainer",
        PlacementOptimizersMixin,
    ),
    "PlacementCheckpointManager": (
        "torchtitan.components.checkpoint.CheckpointManager",
        PlacementCheckpointMixin,
    ),
}


def _ready_made(name: str) -> type:
    target, mixin = PLACEMENT_CLASSES[name]
    base = _bounded.framework_class(
        f"{MODULE}.{name}", target, f"torchtitan (pip install torchtitan=={TORCHTITAN.tested})"
    )
    # torchtitan's Configurable builds the class that declares the nested Config, so each class
    # declares its own (a keyword-only, slotted dataclass, as Configurable checks).
    config: Any = dataclasses.dataclass(kw_only=True, slots=True)(
        type("Config", (base.Config,), {"__module__": MODULE, "__qualname__": f"{name}.Config"})
    )
    return type(name, (mixin, base), {"__module__": MODULE, "Config": config})


def __getattr__(name: str) -> Any:
    if name not in PLACEMENT_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _ready_made(name)
    globals()[name] = cls  # built once: the same class on every lookup
    return cls
