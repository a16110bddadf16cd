"""``te_ckpt_placement.FusedAdam``: TE's FusedAdam with a constructor default for the export policy.

For trainers that build the optimizer from YAML (``_target_: te_ckpt_placement.FusedAdam`` with
``state_dict_placement: cpu``). Importing this module imports Transformer Engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

try:
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam as _TEFusedAdam
except ImportError as exc:
    raise ImportError(
        "te_ckpt_placement.FusedAdam is a subclass of Transformer Engine's FusedAdam and needs "
        "Transformer Engine for PyTorch: pip install 'transformer-engine[pytorch]' (tested with "
        f"2.20.2). Importing it failed: {exc}. Without TE, export_placement and the rest of "
        "te_ckpt_placement import fine; they only act on TE's optimizer."
    ) from exc

from . import _te_hooks as te_hooks
from . import _wrap
from ._policy import Placement, as_placement


class FusedAdam(_TEFusedAdam):
    """Transformer Engine ``FusedAdam`` whose checkpoints follow ``state_dict_placement``.

    ``state_dict()`` and ``load_state_dict()`` stream through host memory when the policy in
    effect (an active :func:`export_placement`, else ``state_dict_placement``) says ``"cpu"``.

    The signature is TE 2.20.2's, spelled out with no ``**kwargs``: YAML trainers that see
    ``**kwargs`` inject ``foreach=False``, which TE rejects.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, bias_correction, adam_w_mode, capturable,
        master_weights, master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype, use_decoupled_grad,
        store_param_remainders, set_grad_none: passed to TE's ``FusedAdam`` unchanged.
        state_dict_placement: ``"cpu"`` to stream this optimizer's exports to host memory when no
            :func:`export_placement` is active, or ``None`` (default) for TE's own export. An
            active ``export_placement`` always wins, ``export_placement(None)`` included.

    Raises:
        ValueError: ``state_dict_placement`` is not ``"cpu"``, ``None`` or a ``Placement``.

    Example:
        >>> opt = FusedAdam(model.parameters(), lr=1e-4, master_weights=True,
        ...                 exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
        ...                 state_dict_placement="cpu")  # doctest: +SKIP
        >>> state = opt.state_dict()  # streamed to host memory  # doctest: +SKIP
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: bool | None = None,
        state_dict_placement: Placement | str | torch.device | None = None,
    ) -> None:
        # Validated first, so a bad value leaves no half-built optimizer behind.
        default = None if state_dict_placement is None else as_placement(state_dict_placement)
        super().__init__(
            params,
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
        self._te_ckpt_default_placement = default

    @property
    def state_dict_placement(self) -> Placement | None:
        """This optimizer's default policy (``None``: TE's own export)."""
        return self._te_ckpt_default_placement

    def state_dict(self) -> dict[str, Any]:
        """TE's ``state_dict()``, streamed to host memory when the policy in effect says so."""
        return te_hooks.placed_state_dict(
            self, _TEFusedAdam, _te_method("state_dict"), default=self._te_ckpt_default_placement
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """TE's ``load_state_dict()``, one state at a time when the policy in effect says so."""
        te_hooks.placed_load_state_dict(
            self,
            state_dict,
            _TEFusedAdam,
            _te_method("load_state_dict"),
            default=self._te_ckpt_default_placement,
        )


def _te_method(name: str) -> Any:
    # TE's method as TE wrote it, also when te_ckpt_placement.install() has hooked the class.
    return _wrap.original(_TEFusedAdam, name) or _TEFusedAdam.__dict__[name]
