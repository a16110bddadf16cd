"""A CPU stand-in for Transformer Engine's FusedAdam that keeps TE 2.20.2's storage contract.

It stores exp_avg/exp_avg_sq/master_param exactly as TE does (fp32, bf16, fp16 with a per-tensor
FP32 scale in ``_scales``, FP8 as a Float8-like object with ``_data``/``_scale_inv``/``_fp8_dtype``,
and int16 master remainders), wraps states of DTensor parameters as DTensors, and exports and
loads with TE's own ``state_dict``/``load_state_dict`` code (fused_adam.py L268-548, copied with
only the CUDA-only parts removed). The step is a plain FP32 Adam that goes through TE's
unscale/scale protocol, so states hold realistic scaled values.

``tests/test_gpu_te.py::test_standin_matches_te`` checks this contract against real TE on a GPU.
"""

from __future__ import annotations

import math
from copy import deepcopy
from itertools import chain
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .storage import storage_kwargs

FP8_E4M3 = SimpleNamespace(name="kFloat8E4M3")


class StandInFloat8:
    """TE's Float8Tensor storage contract: uint8 ``_data``, FP32 ``_scale_inv``, ``_fp8_dtype``."""

    def __init__(self, shape: torch.Size, device: torch.device) -> None:
        self._data = torch.zeros(shape, dtype=torch.uint8, device=device)
        self._scale_inv = torch.ones([1], dtype=torch.float32, device=device)
        self._fp8_dtype = FP8_E4M3
        self._quantizer = SimpleNamespace(scale=torch.ones([1], dtype=torch.float32, device=device))
        self.dtype = torch.float32  # TE's nominal dtype
        self.shape = self._data.shape
        self.device = self._data.device

    def dequantize(self, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # TE's CPU fallback in _FromFloat8Func.forward
        return (self._data.view(torch.float8_e4m3fn).float() * self._scale_inv).to(dtype)

    def float(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.float32)

    def copy_(self, src: torch.Tensor) -> StandInFloat8:
        """Quantizes ``src`` with the quantizer's scale, like TE's ``quantize_``."""
        scale = self._quantizer.scale
        scaled = (src.float() * scale).clamp(-448.0, 448.0)
        self._data.copy_(scaled.to(torch.float8_e4m3fn).view(torch.uint8))
        self._scale_inv.copy_(torch.reciprocal(scale))
        return self

    def quantize_(self, src: torch.Tensor) -> StandInFloat8:
        return self.copy_(src)


class StandInFusedAdam(torch.optim.Optimizer):
    """TE FusedAdam's constructor, storage and export/import, runnable on the CPU."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "bias_correction": True,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self.dtype_to_range_map = {
            torch.float16: torch.full([1], torch.finfo(torch.float16).max / 2.0),
            torch.uint8: torch.full([1], 448.0),
        }
        self._scales: dict[Any, dict[str, torch.Tensor]] = {}
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )

    # --- TE L268-308 -------------------------------------------------------------------------
    def _apply_scale(
        self, state_name: str, unscaled_state: torch.Tensor, scaled_state: Any, scale: torch.Tensor
    ) -> None:
        assert unscaled_state.dtype == torch.float32
        if scaled_state.dtype == torch.bfloat16:
            scaled_state.copy_(unscaled_state.bfloat16())
            return
        dtype = self.name_to_dtype_map[state_name]
        if dtype != torch.uint8:
            assert scaled_state.dtype == dtype
        max_range = self.dtype_to_range_map[dtype].to(scaled_state.device)
        if unscaled_state.device != scaled_state.device:
            unscaled_state = unscaled_state.to(scaled_state.device)
        min_val, max_val = torch.aminmax(unscaled_state)
        absmax = torch.maximum(-min_val, max_val).to(dtype=torch.float32)
        torch.div(absmax, max_range, out=scale)
        if isinstance(scaled_state, StandInFloat8):
            scaled_state._quantizer.scale.copy_(1 / scale)
            scaled_state.copy_(unscaled_state)
        else:
            rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
            unscaled_state.mul_(rscale)
            scaled_state.copy_(unscaled_state)

    # --- TE L310-356 -------------------------------------------------------------------------
    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        state = self.state[param]
        dtype = self.name_to_dtype_map[state_name]
        local = state[state_name]
        if isinstance(local, DTensor):
            local = local._local_tensor
        if dtype == torch.uint8:
            return _cuda_nan(local.float())
        if dtype == torch.float16:
            assert local.dtype == torch.float16
            unscaled = local.float()
            unscaled.mul_(self._scales[param][state_name])
            return _cuda_nan(unscaled)
        if dtype == torch.float32:
            if self._is_remainder(param, state_name):
                assert local.dtype == torch.int16
            else:
                assert local.dtype == torch.float32
            return local
        if dtype == torch.bfloat16:
            assert local.dtype == torch.bfloat16
            return local.float()
        raise RuntimeError(f"Dtype of {state_name} can only be fp8/fp16/bf16/fp32.")

    def _is_remainder(self, param: torch.Tensor, state_name: str) -> bool:
        return bool(
            self.store_param_remainders
            and state_name == "master_param"
            and param.dtype == torch.bfloat16
        )

    # --- TE L358-395 -------------------------------------------------------------------------
    def set_scaled_state(
        self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor
    ) -> None:
        remainder = self._is_remainder(param, state_name)
        assert unscaled_state.dtype == (torch.int16 if remainder else torch.float32)
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, False, remainder)
        local = state[state_name]
        if isinstance(local, DTensor):
            local = local._local_tensor
        dtype = self.name_to_dtype_map[state_name]
        if dtype != torch.float32:
            self._apply_scale(state_name, unscaled_state, local, self._scales[param][state_name])
        else:
            local.copy_(unscaled_state)

    # --- TE L397-480 -------------------------------------------------------------------------
    def _initialize_state(
        self, param: torch.Tensor, state_name: str, zero_buffer: bool, remainder: bool = False
    ) -> None:
        dtype = self.name_to_dtype_map[state_name]
        local_param = param._local_tensor if isinstance(param, DTensor) else param
        if remainder:
            data = torch.zeros_like(local_param, dtype=torch.int16)
        else:
            data = torch.empty_like(local_param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        if dtype == torch.uint8:
            if isinstance(param, DTensor):
                raise NotImplementedError("the stand-in keeps FP8 states of plain tensors only")
            fp8 = StandInFloat8(data.shape, data.device)
            fp8.copy_(data.float())
            self.state[param][state_name] = fp8
        else:
            self.state[param][state_name] = data
        if isinstance(param, DTensor):
            self.state[param][state_name] = DTensor.from_local(
                self.state[param][state_name],
                device_mesh=param.device_mesh,
                placements=param.placements,
                shape=param.size(),
                stride=param.stride(),
            )
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones(
                [1], dtype=torch.float32, device=param.device
            )

    def initialize_state(self, param: torch.Tensor, remainder: bool) -> None:
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", False, remainder)
            if not remainder:
                local = param._local_tensor if isinstance(param, DTensor) else param
                self.set_scaled_state(param, "master_param", local.clone().detach().float())

    def _id_map(self, state_dict: dict[str, Any]) -> dict[int, torch.Tensor]:
        saved_groups = deepcopy(state_dict["param_groups"])
        return dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=False,
            )
        )

    # --- TE L482-513 -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        id_map = self._id_map(state_dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                new_v = {}
                for name in v:
                    new_v[name] = self.get_unscaled_state(param, name)
                    if isinstance(param, DTensor):
                        new_v[name] = DTensor.from_local(
                            new_v[name],
                            device_mesh=param.device_mesh,
                            placements=param.placements,
                            shape=param.size(),
                            stride=param.stride(),
                        )
                state_dict["state"][k] = new_v
        return state_dict

    # --- TE L515-548 -------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        id_map = self._id_map(state_dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is None:
                        continue
                    state = v[name]
                    if isinstance(state, DTensor):
                        state = state._local_tensor
                    if self._is_remainder(param, name):
                        self.set_scaled_state(param, name, state)
                    else:
                        self.set_scaled_state(param, name, state.float())

    # --- a plain FP32 Adam through TE's unscale/scale protocol -------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                remainder = bool(self.store_param_remainders and p.dtype == torch.bfloat16)
                if len(state) == 0:
                    self.initialize_state(p, remainder)
                if p.grad is None:
                    continue
                local_p = p._local_tensor if isinstance(p, DTensor) else p
                grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                m = self.get_unscaled_state(p, "exp_avg").clone()
                v = self.get_unscaled_state(p, "exp_avg_sq").clone()
                if self.master_weights and remainder:
                    rem = self.get_unscaled_state(p, "master_param")
                    master = _join_remainder(local_p, rem)
                elif self.master_weights:
                    master = self.get_unscaled_state(p, "master_param").clone()
                else:
                    master = local_p.float()
                g = grad.float()
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                t = group["step"]
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                master.mul_(1 - group["lr"] * group["weight_decay"])
                master.addcdiv_(m / (1 - beta1**t), denom, value=-group["lr"])
                self.set_scaled_state(p, "exp_avg", m)
                self.set_scaled_state(p, "exp_avg_sq", v)
                if self.master_weights and remainder:
                    high, rem = _split_remainder(master)
                    local_p.copy_(high)
                    self.set_scaled_state(p, "master_param", rem)
                elif self.master_weights:
                    self.set_scaled_state(p, "master_param", master)
                    local_p.copy_(master.to(local_p.dtype))
                else:
                    local_p.copy_(master.to(local_p.dtype))
        return None


def _cuda_nan(t: torch.Tensor) -> torch.Tensor:
    """NaNs as TE's GPU multiply writes them (0x7FFFFFFF); an x86 multiply keeps payloads."""
    if t.device.type == "cpu":
        t.view(torch.int32)[t.isnan()] = 0x7FFFFFFF
    return t


def _split_remainder(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 master into its high half (a BF16 param) and its low 16 bits (int16), by truncation."""
    bits = master.contiguous().view(torch.int32)
    high = (bits & ~0xFFFF).view(torch.float32).bfloat16()
    low = (bits & 0xFFFF).to(torch.int16)
    return high, low.view(master.shape)


def _join_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    high = param.float().contiguous().view(torch.int32)
    low = remainder.to(torch.int32) & 0xFFFF
    return (high | low).view(torch.float32).view(param.shape)


def make_optimizer(
    params: Any,
    *,
    moments: torch.dtype = torch.bfloat16,
    master: str = "fp32",
    lr: float = 1e-2,
) -> StandInFusedAdam:
    """A stand-in configured like one of TE's storage modes (:mod:`.storage` names them)."""
    return StandInFusedAdam(params, lr=lr, **storage_kwargs(moments=moments, master=master))


def train(optimizer: torch.optim.Optimizer, steps: int = 2, seed: int = 0) -> None:
    """Runs ``steps`` steps with random gradients on every parameter that requires grad."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for group in optimizer.param_groups:
            for p in group["params"]:
                local = p._local_tensor if isinstance(p, DTensor) else p
                g = torch.randn(local.shape, generator=gen).to(local.dtype)
                g = g * math.exp(float(torch.randn(1, generator=gen)) * 3)
                if isinstance(p, DTensor):
                    p.grad = DTensor.from_local(
                        g, p.device_mesh, p.placements, shape=p.size(), stride=p.stride()
                    )
                else:
                    p.grad = g.to(p.device)
        optimizer.step()
