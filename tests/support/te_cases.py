"""Real TE FusedAdam optimizers in every storage mode, for the GPU tests (imports TE lazily)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .helpers import bits
from .storage import BF16, FP8, FP16, FP32, storage_kwargs


@dataclass(frozen=True)
class Mode:
    """One TE storage configuration."""

    name: str
    param_dtype: torch.dtype
    exp_avg: torch.dtype
    exp_avg_sq: torch.dtype
    master: str  # one of storage.MASTERS

    @property
    def scaled(self) -> bool:
        # TE cannot initialize scaled states of 0-element params (aminmax on empty, L298).
        moments = (self.exp_avg, self.exp_avg_sq)
        return FP16 in moments or FP8 in moments or self.master == "fp16"

    def te_kwargs(self) -> dict[str, Any]:
        return storage_kwargs(moments=self.exp_avg, exp_avg_sq=self.exp_avg_sq, master=self.master)


MODES = [
    Mode("fp32-params/fp32", FP32, FP32, FP32, "none"),
    Mode("bf16/fp32-master", BF16, FP32, FP32, "fp32"),
    Mode("bf16/bf16/fp32-master", BF16, BF16, BF16, "fp32"),
    Mode("bf16/bf16/remainder", BF16, BF16, BF16, "remainder"),
    Mode("bf16/bf16/no-master", BF16, BF16, BF16, "none"),
    Mode("bf16/fp16/fp32-master", BF16, FP16, FP16, "fp32"),
    Mode("bf16/fp16/fp16-master", BF16, FP16, FP16, "fp16"),
    Mode("bf16/fp8/fp32-master", BF16, FP8, FP8, "fp32"),
    Mode("bf16/fp8/remainder", BF16, FP8, FP8, "remainder"),
    Mode("bf16/fp8+bf16/fp16-master", BF16, FP8, BF16, "fp16"),
    Mode("fp32-params/fp16+fp8", FP32, FP16, FP8, "none"),
]


def make_params(mode: Mode, seed: int = 0, scale: int = 1) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(64 * scale, 33), (1000 * scale,), (1,), (5, 7, 3), (257,), (31, 17)]
    if not mode.scaled:
        shapes.append((0,))
    return [
        torch.nn.Parameter(
            torch.randn(s, generator=gen, device="cuda", dtype=torch.float32).to(mode.param_dtype)
        )
        for s in shapes
    ]


def make_te_optimizer(
    mode: Mode, params: list[torch.nn.Parameter], cls: type | None = None, **extra: Any
) -> torch.optim.Optimizer:
    if cls is None:
        from transformer_engine.pytorch.optimizers import FusedAdam

        cls = FusedAdam
    groups = [{"params": params[:3]}, {"params": params[3:-1], "lr": 3e-3, "weight_decay": 0.1}]
    opt = cls(groups, lr=1e-2, **mode.te_kwargs(), **extra)
    # The last param joins later, so it has no state until its first step.
    opt.add_param_group({"params": params[-1:], "lr": 1e-3})
    return opt


def fill_grads(opt: torch.optim.Optimizer, seed: int, skip_last_group: bool = False) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    groups = opt.param_groups[:-1] if skip_last_group else opt.param_groups
    for group in groups:
        for p in group["params"]:
            g = torch.randn(p.shape, generator=gen, device="cuda")
            # Magnitudes spread over decades, so scaled states use their range.
            g *= torch.exp(torch.randn(p.shape, generator=gen, device="cuda") * 3)
            p.grad = g.to(p.dtype)


def train(opt: torch.optim.Optimizer, steps: int = 3, seed: int = 0) -> None:
    """Steps with random grads; the last group gets no grads, so its params keep no state.

    TE initializes state for every param of a stepped group, grad or not (fused_adam.py L633),
    so stateless params exist only in groups never stepped.
    """
    last = opt.param_groups.pop()
    try:
        for i in range(steps):
            fill_grads(opt, seed * 1000 + i)
            opt.step()
    finally:
        opt.param_groups.append(last)
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def live_bits(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every live state's bytes and every scale, in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for name, value in opt.state.get(p, {}).items():
                out.append(snapshot_one(value))
                if p in opt._scales and name in opt._scales[p]:
                    out.append(bits(opt._scales[p][name]))
    return out


def snapshot_one(value: Any) -> torch.Tensor:
    v = value._local_tensor if hasattr(value, "_local_tensor") else value
    if hasattr(v, "_data"):
        return torch.cat([bits(v._data), bits(v._scale_inv)])
    return bits(v)
