"""transformer_engine/pytorch/optimizers/fused_adam.py of TE 2.20.2, on the CPU stand-in."""

import os
import time

import torch

from tests.support.standin import StandInFusedAdam

# A slow import (TE's takes seconds): meanwhile another thread finds this module in sys.modules,
# without FusedAdam yet.
time.sleep(float(os.environ.get("FAKE_TE_IMPORT_DELAY_S", "0")))


class _StandInStorage(StandInFusedAdam):
    # TE's FusedAdam derives from torch.optim.Optimizer directly: super(FusedAdam, opt)
    # .state_dict() and .load_state_dict(), which the adapter calls, are torch's, not TE's.
    state_dict = torch.optim.Optimizer.state_dict
    load_state_dict = torch.optim.Optimizer.load_state_dict


class FusedAdam(_StandInStorage):
    """TE 2.20.2's constructor signature; TE's export and import defined on the class."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        bias_correction=True,
        adam_w_mode=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        use_decoupled_grad=False,
        store_param_remainders=False,
        set_grad_none=None,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            master_weights=master_weights,
            master_weight_dtype=master_weight_dtype,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            store_param_remainders=store_param_remainders,
        )
        # What the constructor received, so tests can check that subclasses pass it through.
        self.te_init_args = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            bias_correction=bias_correction,
            adam_w_mode=adam_w_mode,
            capturable=capturable,
            master_weights=master_weights,
            master_weight_dtype=master_weight_dtype,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            use_decoupled_grad=use_decoupled_grad,
            store_param_remainders=store_param_remainders,
            set_grad_none=set_grad_none,
        )

    # TE L482-548 (the stand-in's copies; their zero-argument super() reaches torch's).
    state_dict = StandInFusedAdam.state_dict
    load_state_dict = StandInFusedAdam.load_state_dict


# For the tests: TE's own functions, which the hooks wrap and uninstall() restores.
ORIGINALS = {name: FusedAdam.__dict__[name] for name in ("state_dict", "load_state_dict")}
