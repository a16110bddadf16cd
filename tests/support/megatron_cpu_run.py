"""``benchmarks/megatron_ckpt.py`` on the CPU, on Megatron-Core's real code, for 1 or more ranks.

Megatron's own ``GPTModel`` (local spec) in ``Float16Module`` and ``DistributedDataParallel``,
``get_megatron_optimizer`` and ``dist_checkpointing`` run as the GPU benchmark runs them, on gloo,
with TE's ``FusedAdam`` replaced by the CPU stand-in of ``tests/support/standin.py`` (taking the
arguments Megatron passes to TE). Tensors Megatron puts on ``"cuda"`` stay on the CPU (a
``TorchFunctionMode``) and its few other CUDA calls (device, streams, RNG) are pointed at the CPU;
with ``--device cpu`` the driver runs on gloo and its GPU memory checks run without judging
anything ("not measured on the CPU"). Everything else, the BF16 forward and backward, the saves
and loads of every case, the bit-for-bit comparisons and the resumes, runs as on the GPUs; FP8
moments are left out (see :func:`main`).

Usage (repository root, megatron-core 0.19.2 importable)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/support/megatron_cpu_run.py --size test --out FILE.json
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[2]


class _CudaOnCpu(TorchFunctionMode):
    """Tensors that Megatron creates or moves to ``"cuda"`` (or a device index) stay on the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers accept only "torch.cuda.*Tensor" parameters.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_cuda() -> None:
    """Points the CUDA calls on Megatron's path at the CPU."""
    cuda: Any = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: None
    cuda.current_stream = lambda *a, **k: _NoStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()

    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[attr-defined]
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[attr-defined]


class _NoStream:
    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _standin_te() -> None:
    """Megatron's optimizer modules as they are where TE is installed, with the stand-in.

    Megatron's modules are imported first, without TE; only then does a ``transformer_engine``
    package with the stand-in ``FusedAdam`` appear, for ``OptimizerConfig``'s import check.
    """
    import types

    import megatron.core.dist_checkpointing.serialization
    import megatron.core.dist_checkpointing.strategies.fully_parallel
    import megatron.core.dist_checkpointing.strategies.torch
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer as optimizer_module
    import megatron.core.transformer.module  # noqa: F401
    from megatron.core import utils
    from megatron.core.optimizer import distrib_optimizer
    from packaging.version import Version

    from te_ckpt_placement import _te_hooks as te_hooks
    from tests.support.standin import StandInFusedAdam, _join_remainder, _split_remainder

    class MegatronStandInFusedAdam(StandInFusedAdam):
        """The stand-in, taking what Megatron gives TE's FusedAdam (fused_adam.py L116-135)."""

        def __init__(
            self,
            params: Any,
            *,
            capturable: bool = False,
            adam_w_mode: bool = True,
            use_decoupled_grad: bool = False,
            master_weight_dtype: torch.dtype = torch.float32,
            exp_avg_dtype: torch.dtype = torch.float32,
            exp_avg_sq_dtype: torch.dtype = torch.float32,
            **kwargs: Any,
        ) -> None:
            assert not capturable and adam_w_mode
            super().__init__(
                params,
                master_weight_dtype=master_weight_dtype,
                exp_avg_dtype=exp_avg_dtype,
                exp_avg_sq_dtype=exp_avg_sq_dtype,
                **kwargs,
            )
            self.capturable = capturable
            self.use_decoupled_grad = use_decoupled_grad

        def zero_grad(self, set_to_none: bool = True) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if self.use_decoupled_grad:
                        p.decoupled_grad = None
                    else:
                        p.grad = None

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            """The stand-in's FP32 Adam on ``.decoupled_grad`` (TE fused_adam.py L636-637)."""
            assert self.use_decoupled_grad and self.master_weights
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                beta1, beta2 = group["betas"]
                t = group["step"]
                for p in group["params"]:
                    remainder = bool(self.store_param_remainders and p.dtype == torch.bfloat16)
                    if len(self.state[p]) == 0:
                        self.initialize_state(p, remainder)
                    grad = getattr(p, "decoupled_grad", None)
                    if grad is None:
                        continue
                    m = self.get_unscaled_state(p, "exp_avg").clone()
                    v = self.get_unscaled_state(p, "exp_avg_sq").clone()
                    if remainder:
                        master = _join_remainder(p, self.get_unscaled_state(p, "master_param"))
                    else:
                        master = self.get_unscaled_state(p, "master_param").clone()
                    g = grad.float()
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                    master.mul_(1 - group["lr"] * group["weight_decay"])
                    master.addcdiv_(m / (1 - beta1**t), denom, value=-group["lr"])
                    self.set_scaled_state(p, "exp_avg", m)
                    self.set_scaled_state(p, "exp_avg_sq", v)
                    if remainder:
                        high, rem = _split_remainder(master)
                        p.copy_(high)
                        self.set_scaled_state(p, "master_param", rem)
                    else:
                        self.set_scaled_state(p, "master_param", master)
                        p.copy_(master.to(p.dtype))
            return None

    te_hooks.patch_class(StandInFusedAdam)
    te: Any = types.ModuleType("transformer_engine")
    te.__version__ = "2.20.2"
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    te.pytorch.optimizers.FusedAdam = MegatronStandInFusedAdam
    sys.modules.update(
        {
            "transformer_engine": te,
            "transformer_engine.pytorch": te.pytorch,
            "transformer_engine.pytorch.optimizers": te.pytorch.optimizers,
        }
    )
    optimizer_module.Adam = MegatronStandInFusedAdam  # type: ignore[attr-defined]
    optimizer_module.USING_PYTORCH_OPTIMIZER = False  # type: ignore[attr-defined]
    distrib_optimizer.Adam = MegatronStandInFusedAdam  # type: ignore[attr-defined]
    distrib_optimizer.HAVE_APEX_OR_TE = True
    distrib_optimizer.USING_TE_OPTIMIZER = True
    utils._te_version = Version("2.20.2")  # type: ignore[attr-defined]


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import megatron_ckpt

    _cpu_cuda()
    _standin_te()
    # The stand-in's FP8 state is not a torch.Tensor (TE's Float8Tensor is), so Megatron's own
    # _get_main_param_and_optimizer_states (L1100) would leave it out of every checkpoint.
    all_cases = megatron_ckpt.cases
    megatron_ckpt.cases = lambda world: [  # type: ignore[assignment]
        case for case in all_cases(world) if case.moments != torch.uint8
    ]
    with _CudaOnCpu():
        return megatron_ckpt.main([*argv, "--device", "cpu"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
