"""fused_adam.py of a TE release whose FusedAdam has no get_unscaled_state."""

import torch


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    def state_dict(self):
        return super().state_dict()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)

    def set_scaled_state(self, param, state_name, unscaled_state):
        self.state[param][state_name] = unscaled_state

    def _initialize_state(self, param, state_name, zero_buffer, store_param_remainders=False):
        self.state[param][state_name] = torch.zeros_like(param)

    def initialize_state(self, param, store_param_remainders):
        for name in ("exp_avg", "exp_avg_sq"):
            self._initialize_state(param, name, True)


ORIGINALS = {name: FusedAdam.__dict__[name] for name in ("state_dict", "load_state_dict")}
