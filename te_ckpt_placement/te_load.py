"""The streaming import: TE FusedAdam's ``load_state_dict`` one state at a time.

TE's own load (fused_adam.py L515-548 in TE 2.20.2,
https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py)
first lets torch cast every state of the checkpoint to the parameter's device and dtype, all at
once, then converts each state again through ``set_scaled_state`` (L400-419). This module
validates the whole checkpoint first, then writes each state into the live one through the same
``set_scaled_state``, so the result is TE's bit for bit without the bulk cast. It reads TE's
private ``_scales`` (L214, L452) and the storage rule of :mod:`te_ckpt_placement.te_contract`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import engine
from .te_contract import (
    STATE_NAMES,
    check_contract,
    is_remainder,
    local_of,
    raw_storage,
    stored_dtype,
)

__all__ = ["initialize_states", "plan_load", "stream_load_state_dict"]


def _load_error(index: object, name: str | None, problem: str) -> ValueError:
    what = f"state {name!r} of parameter {index}" if name else f"parameter {index}"
    return ValueError(
        f"cannot load the optimizer checkpoint: {what}: {problem}. Nothing was loaded; the "
        "optimizer is unchanged."
    )


def plan_load(
    optimizer: Any, state_dict: Any
) -> list[tuple[Any, torch.Tensor, dict[str, torch.Tensor]]]:
    """Validates a checkpoint against the optimizer without touching either.

    Checks what torch's and TE's ``load_state_dict`` would check, and what they would silently get
    wrong: group layout, state names, local shapes, and int16 remainders against FP32 masters.

    Returns:
        ``[(index, param, {name: value})]``: every state to load, in checkpoint order.
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(
            "cannot load the optimizer checkpoint: expected a dict with 'state' and "
            "'param_groups', as FusedAdam.state_dict() returns. Nothing was loaded."
        )
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has a different number of parameter groups ({len(saved_groups)}, "
            f"the optimizer has {len(groups)}). Nothing was loaded."
        )
    for i, (g, s) in enumerate(zip(groups, saved_groups, strict=True)):
        if len(g["params"]) != len(s["params"]):
            raise ValueError(
                f"loaded state dict contains a parameter group ({i}) that doesn't match the size "
                f"of optimizer's group ({len(s['params'])} != {len(g['params'])}). "
                "Nothing was loaded."
            )
    id_map = engine.indexed_params(saved_groups, groups)
    plan = []
    for index, states in state_dict["state"].items():
        if index not in id_map:
            continue  # kept as is, like torch; TE ignores it
        param = id_map[index]
        if not isinstance(states, dict):
            raise _load_error(index, None, f"expected a dict of states, found {type(states)}")
        entries: dict[str, torch.Tensor] = {}
        for name, value in states.items():
            if value is None:
                continue
            if name not in optimizer.name_to_dtype_map:
                raise _load_error(index, name, f"TE FusedAdam keeps only {', '.join(STATE_NAMES)}")
            if not isinstance(value, torch.Tensor):
                raise _load_error(index, name, f"expected a tensor, found {type(value).__name__}")
            if (
                isinstance(value, DTensor)
                and isinstance(param, DTensor)
                and tuple(value.placements) != tuple(param.placements)
            ):
                raise _load_error(
                    index,
                    name,
                    f"sharded as {tuple(value.placements)}, the parameter as "
                    f"{tuple(param.placements)}; load it through DCP, which reshards",
                )
            local = local_of(value)
            expected = tuple(local_of(param).shape)
            if tuple(local.shape) != expected:
                raise _load_error(
                    index,
                    name,
                    f"local shape {tuple(local.shape)} does not match the parameter's {expected}",
                )
            remainder = is_remainder(optimizer, param, name)
            if remainder and local.dtype != torch.int16:
                raise _load_error(
                    index,
                    name,
                    f"stored as {local.dtype}, but this optimizer keeps int16 remainders "
                    "(store_param_remainders=True); load with the setting the checkpoint was "
                    "saved with",
                )
            if not remainder and not local.is_floating_point():
                raise _load_error(
                    index,
                    name,
                    f"stored as {local.dtype}, but this optimizer keeps floating-point states"
                    + (
                        " (an int16 master_param comes from store_param_remainders=True)"
                        if local.dtype == torch.int16
                        else ""
                    ),
                )
            entries[name] = value
        plan.append((index, param, entries))
    return plan


def _reusable(optimizer: Any, param: torch.Tensor, name: str, live: Any) -> Any:
    """The live state tensor to write into, or None when TE must allocate a new one."""
    if live is None or isinstance(live, DTensor) != isinstance(param, DTensor):
        return None
    stored = raw_storage(optimizer, param, name, live)
    if not isinstance(stored, torch.Tensor):
        return None
    if stored.dtype != stored_dtype(optimizer, param, name):
        return None
    if tuple(stored.shape) != tuple(local_of(param).shape):
        return None
    if optimizer.name_to_dtype_map[name] != torch.float32 and name not in optimizer._scales.get(
        param, {}
    ):
        return None
    return live


class _Rollback:
    """What a failed load must put back: the replaced containers and overwritten tensor bytes.

    The containers (``state``, ``param_groups``, ``_scales`` entries) are kept by reference; a
    tensor written in place is copied to host memory just before its write. So the rollback costs
    host memory equal to the live states the load overwrites (R bytes, never GPU memory) and one
    device-to-host copy of each, made as the load goes.
    """

    def __init__(self, optimizer: Any) -> None:
        self.state = optimizer.state
        self.param_groups = optimizer.param_groups
        self.scales = {p: dict(d) for p, d in optimizer._scales.items()}
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(self, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            self.saved.append((tensor, tensor.to("cpu", copy=True)))

    def keep_state(self, optimizer: Any, param: torch.Tensor, name: str, live: Any) -> None:
        local = local_of(live)
        if hasattr(local, "_data"):  # FP8: bytes, scale_inv, and the quantizer TE rewrites
            for attr in ("_data", "_scale_inv", "_transpose"):
                self.keep(getattr(local, attr, None))
            quantizer = getattr(local, "_quantizer", None)
            for attr in ("scale", "amax"):
                self.keep(getattr(quantizer, attr, None))
        else:
            self.keep(local)
        self.keep(optimizer._scales.get(param, {}).get(name))

    def restore(self, optimizer: Any) -> None:
        for tensor, host in reversed(self.saved):
            tensor.copy_(host)
        optimizer.state = self.state
        optimizer.param_groups = self.param_groups
        optimizer._scales.clear()
        optimizer._scales.update(self.scales)


def stream_load_state_dict(
    optimizer: Any, state_dict: Any, owner: type, *, rollback: bool = True
) -> None:
    """TE's ``load_state_dict`` (L515-548) without torch's bulk cast of every state to the GPU.

    Every state goes from the checkpoint into the live state one at a time, through TE's own
    ``set_scaled_state``, so the result is TE's bit for bit. Live tensors are written in place
    where shape and dtype match. The checkpoint is never modified. A checkpoint that does not fit
    fails validation before anything changes; a failure part-way (an allocation, a device error,
    a KeyboardInterrupt) puts the previous state back when ``rollback`` is set (see _Rollback).
    """
    check_contract(optimizer)
    plan = plan_load(optimizer, state_dict)
    # Capture the live states before torch replaces optimizer.state.
    live = {param: dict(optimizer.state.get(param, {})) for _, param, _ in plan}
    planned = {index for index, _, _ in plan}
    # torch handles param_groups, hooks and unknown keys; each param's entry is an empty dict, so
    # it casts nothing but keeps the entry order TE's load would produce.
    stripped = dict(state_dict)
    stripped["state"] = {k: ({} if k in planned else v) for k, v in state_dict["state"].items()}
    undo = _Rollback(optimizer) if rollback else None
    try:
        super(owner, optimizer).load_state_dict(stripped)  # type: ignore[arg-type]
        for _, param, entries in plan:
            state: dict[str, Any] = {}
            optimizer.state[param] = state
            for name, value in entries.items():
                reuse = _reusable(optimizer, param, name, live[param].get(name))
                if reuse is not None:
                    if undo is not None:
                        undo.keep_state(optimizer, param, name, reuse)
                    state[name] = reuse
                    if optimizer.name_to_dtype_map[name] != torch.float32:
                        # TE's load starts every scale from a fresh torch.ones (L452).
                        optimizer._scales[param][name].fill_(1.0)
                _load_one(optimizer, param, name, value)
    except BaseException:
        if undo is None:
            raise
        try:
            undo.restore(optimizer)
        except BaseException as again:
            raise RuntimeError(
                "loading the optimizer checkpoint failed part-way and restoring the previous "
                "state failed too: the optimizer is inconsistent; rebuild it before training"
            ) from again
        raise


def _load_one(optimizer: Any, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
    local = local_of(value)
    if is_remainder(optimizer, param, name):
        optimizer.set_scaled_state(param, name, local)
        return
    unscaled = local.float()
    if unscaled is local and unscaled.device == local_of(param).device:
        # TE scales FP16/FP8 inputs in place (L307); never in the caller's tensor.
        unscaled = unscaled.clone()
    optimizer.set_scaled_state(param, name, unscaled)


def initialize_states(optimizer: Any) -> bool:
    """Gives every parameter of a fresh optimizer TE's initial states, without a step.

    torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` initialize an optimizer
    that has no state with a fake step (``_init_optim_state``): zero gradients for every
    parameter, then ``step()`` with its temporaries, all on the GPU. TE can build its states
    directly (``initialize_state``, TE 2.20.2 fused_adam.py L456-480, the call its own ``step``
    makes at L630-634), and torch skips its fake step for an optimizer that has state. Each
    group's ``"step"`` is counted as TE's step counts it (L571-587): a flattened
    ``set_optimizer_state_dict`` loads only the group keys the live groups have, so without the
    key the checkpoint's step count would be dropped.

    Returns:
        True if states were created; False (and nothing done) when the optimizer already has
        state or any parameter has a gradient, the cases where torch skips its fake step too.
    """
    check_contract(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return False
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.initialize_state(
                param, bool(optimizer.store_param_remainders and param.dtype == torch.bfloat16)
            )
        # TE L571-587: the counter of a step, also for an empty group.
        if "step" in group:
            group["step"] += 1
        elif getattr(optimizer, "capturable", False):
            # An empty group takes the device of TE's scratch buffer, made on "cuda" (L193).
            device = group["params"][0].device if group["params"] else torch.device("cuda")
            group["step"] = torch.tensor([1], dtype=torch.int, device=device)
        else:
            group["step"] = 1
    return True
