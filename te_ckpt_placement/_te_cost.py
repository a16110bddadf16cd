"""TE's own device cost of the work a report counts: what its load would have allocated.

Computed from the states' shapes, dtypes and devices (TE 2.20.2 fused_adam.py), for
:class:`~te_ckpt_placement._reports.TransferReport`'s ``te_gpu_bytes`` of a load.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._tensors import local as _local


def te_state_device_bytes(
    value: torch.Tensor, device: torch.device, stored: torch.dtype, remainder: bool
) -> int:
    """Device bytes TE allocates at once to write one checkpoint value into a state.

    TE 2.20.2 fused_adam.py: ``load_state_dict`` passes ``value.float()`` (L548; the int16
    remainder as it is, L546), a new FP32 tensor where the value was not FP32, on the value's
    device. ``set_scaled_state`` (L358-395) copies an FP32 state in place; ``_apply_scale``
    (L268-308) rounds a BF16 state on the value's device (L280, ``.bfloat16()``, 2 B per
    element) and moves an FP16/FP8 state's FP32 value to the state's device (L296, 4 B per
    element) unless it is there, then scales it in place. Only allocations on ``device`` (the
    parameter's) count; ``_initialize_state``'s are left out, as in :class:`TransferReport`.

    Args:
        value: The checkpoint's local tensor.
        device: The parameter's (local) device.
        stored: TE's ``name_to_dtype_map`` entry of the state (``torch.uint8`` for FP8).
        remainder: Whether the state is an int16 master remainder.
    """
    n = value.numel()
    here = value.device == device
    made = 4 * n if here and not remainder and value.dtype != torch.float32 else 0
    if remainder or stored == torch.float32:
        return made
    if stored == torch.bfloat16:
        return made + (2 * n if here else 0)
    return made + (0 if here else 4 * n)


LoadPlan = Sequence[tuple[torch.Tensor, Sequence[tuple[torch.Tensor, torch.dtype, bool]]]]


def te_load_device_bytes(plan: LoadPlan, *, bulk_cast: bool) -> int:
    """The peak device memory of TE's ``load_state_dict`` temporaries for a checkpoint.

    ``plan`` is ``[(param, [(value, stored dtype, remainder)])]`` in checkpoint order. TE 2.20.2
    fused_adam.py L515-548 first runs torch's ``Optimizer.load_state_dict``, which casts every
    state value to the parameter's dtype and device (``value.to(dtype=param.dtype,
    device=param.device)``; a new tensor of ``numel x param.element_size()`` bytes unless the
    value has both already) and keeps all the casts until it returns. TE then walks the
    parameters in checkpoint order: ``self.state[param] = {}`` (L536) frees that parameter's
    casts, and each state is written through :func:`te_state_device_bytes`, one at a time. With
    ``C_k`` the casts of parameter ``k`` and ``T_k`` its largest per-state temporaries, the peak
    is ``max(sum(C), max_k(sum(C_j for j > k) + T_k))``; without ``bulk_cast`` (states written
    one by one, as ``set_scaled_state`` writes them) it is ``max_k(T_k)``.
    """
    casts: list[int] = []
    temps: list[int] = []
    for param, states in plan:
        local_param = _local(param)
        cast = temp = 0
        for value, stored, remainder in states:
            local = _local(value)
            if param.is_floating_point():
                same = local.dtype == param.dtype and local.device == local_param.device
                size = param.element_size()
            else:
                same, size = local.device == local_param.device, local.element_size()
            cast += 0 if same else local.numel() * size
            temp = max(temp, te_state_device_bytes(local, local_param.device, stored, remainder))
        casts.append(cast)
        temps.append(temp)
    if not bulk_cast:
        return max(temps, default=0)
    peak, later = sum(casts), sum(casts)
    for cast, temp in zip(casts, temps, strict=True):
        later -= cast
        peak = max(peak, later + temp)
    return peak
