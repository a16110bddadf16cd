"""TE's initial states for a fresh optimizer, and taking them back when no load follows.

torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` give a fresh optimizer its
states with a fake ``step()``; these build TE FusedAdam's states with TE's own calls instead
(``initialize_state`` and ``_initialize_state``, TE 2.20.2 fused_adam.py L397-480,
https://github.com/NVIDIA/TransformerEngine/blob/v2.20.2/transformer_engine/pytorch/optimizers/fused_adam.py),
and count each completed load so that states made for a load that never came go back.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import _tensors
from ._te_contract import Contract, StateFacts
from ._te_load_write import _plain

# How many loads each optimizer has completed (streaming or TE's own, through the hooks), so that
# initial states built for a load that then loads nothing can be taken back.
_loads: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def note_loaded(optimizer: Any) -> None:
    """Counts a completed load of ``optimizer`` (see :func:`initialized_for_load`)."""
    _loads[optimizer] = _loads.get(optimizer, 0) + 1


@contextmanager
def initialized_for_load(optimizer: Any) -> Iterator[bool]:
    """:func:`initialize_states` for a load that may or may not happen inside the block.

    Frameworks call their resume method also when there is nothing to resume from (a fresh run,
    ``strict=False`` without optimizer state). Initial states built for such a call would change
    training: TE's first step would count as its second. So unless a load of this optimizer
    completes inside the block, the states, scales and step counts it built are taken back on
    exit, and the optimizer is as fresh as before. Yields what ``initialize_states`` returned.
    """
    steps = group_steps(optimizer)
    loads = _loads.get(optimizer, 0)
    created = initialize_states(optimizer)
    try:
        yield created
    finally:
        if created and _loads.get(optimizer, 0) == loads:
            take_back_initial_states(optimizer, steps)


_NO_STEP = object()


def group_steps(optimizer: Any) -> list[Any]:
    """Each param group's ``"step"`` now, for :func:`take_back_initial_states` to restore."""
    return [group.get("step", _NO_STEP) for group in optimizer.param_groups]


def take_back_initial_states(optimizer: Any, steps: list[Any]) -> None:
    """Undoes :func:`initialize_states`: its states and scales, and the groups' step counts as
    ``steps`` (:func:`group_steps` before it) had them."""
    _take_back_states(optimizer)
    for group, step in zip(optimizer.param_groups, steps, strict=True):
        if step is _NO_STEP:
            group.pop("step", None)
        else:
            group["step"] = step


def _take_back_states(optimizer: Any) -> None:
    """Removes every parameter's states and their scales (TE L214: made with the states)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state.pop(param, None)
            optimizer._scales.pop(param, None)


def initialize_states(optimizer: Any, *, contract: Contract | None = None) -> bool:
    """Gives every parameter of a fresh optimizer TE's initial states, without a step.

    torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` initialize an optimizer
    that has no state with a fake step (``_init_optim_state``): zero gradients for every
    parameter, then ``step()`` with its temporaries, all on the GPU. TE can build its states
    directly (``initialize_state``, TE 2.20.2 fused_adam.py L456-480, the call its own ``step``
    makes at L630-634), and torch skips its fake step for an optimizer that has state. The
    states are made by TE's own calls, except that an FP32 master is copied from its parameter
    in place, without the FP32 copy of the parameter that TE's initializer makes first
    (:func:`_initialize_param`). Each group's ``"step"`` is counted as TE's step counts it
    (L571-587): a flattened ``set_optimizer_state_dict`` loads only the group keys the live
    groups have, so without the key the checkpoint's step count would be dropped.

    If making a state fails (out of memory, an interrupt), every state and scale made so far is
    taken back before the error propagates, so the optimizer is as fresh as before.

    Args:
        optimizer: A TE ``FusedAdam``.
        contract: The contract of ``optimizer`` for the operation this is part of (a planner
            load); by default, checked here.

    Returns:
        True if states were created; False (and nothing done) when the optimizer already has
        state or any parameter has a gradient, the cases where torch skips its fake step too.
    """
    if contract is None:
        contract = Contract.of(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return False
    masters = bool(getattr(optimizer, "master_weights", False))
    try:
        with torch.no_grad():
            for param in params:
                _initialize_param(optimizer, contract.facts(param, "master_param"), param, masters)
    except BaseException:
        # An optimizer with some states would look initialized to the next attempt and to
        # TE's step: take back every state and scale made so far.
        _take_back_states(optimizer)
        raise
    for group in optimizer.param_groups:
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


def _initialize_param(
    optimizer: Any, master: StateFacts | None, param: torch.Tensor, masters: bool
) -> None:
    """TE's ``initialize_state(param, ...)`` with the same calls, minus its copy of the parameter.

    TE's initializer (TE 2.20.2 fused_adam.py L456-480) makes the moments with
    ``_initialize_state(zero_buffer=True)`` (L463-464), an int16 remainder master with
    ``_initialize_state`` alone (zeros, L465-471 and L418-419), and any other master as an empty
    state filled from ``local_param.clone().detach().float()`` through ``set_scaled_state``
    (L472-480): for a 16-bit parameter a temporary of 6 bytes per element (the clone, then its
    FP32 copy), whatever the moments' dtypes. Here the same calls make every state in the same
    order; an FP32 master is then filled by ``copy_`` from the parameter (the same exact widening,
    no temporary), and an FP16 master, which TE scales by its absmax, from one FP32 copy of the
    parameter (``.float()``, a new tensor for a 16-bit parameter, a clone for an FP32 one, since
    TE's scaling multiplies it in place at L306-308). A quantized parameter, which TE dequantizes
    for its master (L476-477), goes through TE's ``initialize_state`` itself. The result is TE's
    initial state bit for bit.
    """
    assert master is not None  # TE keeps a master_param entry always (L203-207)
    remainder = master.remainder
    local = _tensors.local(param)
    if masters and not remainder and not _plain(local):
        optimizer.initialize_state(param, remainder)
        return
    optimizer._initialize_state(param, "exp_avg", True)
    optimizer._initialize_state(param, "exp_avg_sq", True)
    if not masters:
        return
    optimizer._initialize_state(param, "master_param", False, remainder)
    if remainder:
        return
    if master.te_dtype == torch.float16:
        source = local.detach()
        value = source.clone() if source.dtype == torch.float32 else source.float()
        optimizer.set_scaled_state(param, "master_param", value)
    else:
        _tensors.local(optimizer.state[param]["master_param"]).copy_(local.detach())
