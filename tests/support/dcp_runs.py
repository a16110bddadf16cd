"""A small model with its optimizer on a backend, and the comparisons of the DCP tests.

:class:`Run` is what the DCP save/load checks (:mod:`.dcp_checks`) and the streaming-load checks
(:mod:`.dcp_load_checks`) train, checkpoint and compare: ``Linear(3, 5), Linear(5, 4)``, under
``fully_shard`` on a mesh or plain without one, with the backend's FusedAdam.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from te_ckpt_placement import export_placement
from te_ckpt_placement._export import is_exported
from te_ckpt_placement.dcp import PlacedOptimizerState

from .backends import Backend
from .distributed import (
    by_position,
    column_sharded,
    fully_sharded,
    gather,
    hyperparams,
    param_dtype,
)
from .helpers import assert_bit_equal, assert_snapshot_equal, bits, blank, local, tensors

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def set_global_grads(params: list[torch.Tensor], gen: torch.Generator) -> None:
    """Gives each parameter a gradient drawn from ``gen`` in parameter order, at the global shape
    (scaled over several orders of magnitude), sharded like the parameter: every world size and
    rank sees the same global gradients."""
    for p in params:
        g = torch.randn(p.shape, generator=gen) * math.exp(float(torch.randn(1, generator=gen)) * 3)
        g = g.to(p.dtype)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = g.to(p.device)


class Run:
    """A model (``fully_shard`` on ``mesh``, or plain without one) with its optimizer.

    ``groups=2`` puts the second layer's parameters in a group of their own (lr 3e-3).
    ``columns=True`` builds :func:`.distributed.column_sharded`'s model instead: its weights
    sharded along their columns (``Shard(1)``).
    """

    def __init__(
        self,
        backend: Backend,
        mesh: DeviceMesh | None,
        moments: torch.dtype,
        master: str,
        seed: int,
        *,
        groups: int = 1,
        columns: bool = False,
    ) -> None:
        if groups not in (1, 2):
            raise ValueError(f"groups={groups!r}: valid values are 1 and 2")
        self.backend, self.moments, self.master = backend, moments, master
        self.model: torch.nn.Module
        self.opt: Any  # TE's FusedAdam or its stand-in: _scales, name_to_dtype_map, ...
        dtype = param_dtype(master)
        if columns:
            self.model = column_sharded(mesh, dtype, seed, backend.device)
        elif mesh is None:  # one process, no DTensors: what an offline consolidation would use
            torch.manual_seed(seed)  # the same weights as fully_sharded's
            model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 4))
            self.model = model.to(device=backend.device, dtype=dtype)
        else:  # fully_shard places the parameters on the mesh's device
            self.model = fully_sharded(mesh, dtype, seed)
        params = list(self.model.parameters())
        split = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]
        self.opt = backend.make_optimizer(
            split if groups == 2 else params, moments=moments, master=master
        )

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.opt.param_groups for p in group["params"]]

    def train(self, steps: int, seed: int) -> None:
        """Global gradients drawn in parameter order, so every world size sees the same ones."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            set_global_grads(self.params(), gen)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def export(self, options: StateDictOptions = FLAT, placement: Any = "cpu") -> dict[str, Any]:
        with export_placement(placement):
            return get_optimizer_state_dict(self.model, self.opt, options=options)

    def state(self, **kwargs: Any) -> PlacedOptimizerState:
        return PlacedOptimizerState(self.model, self.opt, **kwargs)

    def template(self, where: str) -> dict[str, Any]:
        """DCP's load template under the policy, blanked so the load has to fill it."""
        state = {"model": get_model_state_dict(self.model), "optim": self.export()}
        assert_all_on_cpu(state["optim"], f"{where} template")
        assert_exports(state["optim"], f"{where} template")
        blank(state)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"])
        with export_placement("cpu"):
            set_optimizer_state_dict(self.model, self.opt, state["optim"], options=FLAT)

    def largest_state(self) -> int:
        """M: the largest local state, in elements."""
        return max(local(p).numel() for p in self.params())

    def full(self) -> dict[str, Any]:
        """Global weights, exported states and hyperparameters (a collective under a mesh)."""
        out: dict[str, Any] = {}
        for key, value in {**get_model_state_dict(self.model), **self.export()}.items():
            if isinstance(value, DTensor):
                value = gather(value)
            out[key] = bits(value).clone() if isinstance(value, torch.Tensor) else value
        return out


def _groups(opt: torch.optim.Optimizer, tuples_as_lists: bool) -> list[dict[str, Any]]:
    groups = hyperparams(opt)
    if tuples_as_lists:
        groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]
    return groups


def assert_same_run(
    ours: Run, ref: Run, where: str, *, params: bool = True, tuples_as_lists: bool = False
) -> None:
    """Params, live states by position, FP16/FP8 scales and param_groups (step included).

    ``tuples_as_lists``: torch's full-state load returns ``betas`` as a list, policy or not.
    """
    if params:
        names = {id(p): name for name, p in ref.model.named_parameters()}
        for i, (p, q) in enumerate(zip(ref.params(), ours.params(), strict=True)):
            assert_bit_equal(q, p, f"{where}: param {names.get(id(p), i)}")
    assert_snapshot_equal(by_position(ours.opt), by_position(ref.opt))
    for i, (p, q) in enumerate(zip(ref.params(), ours.params(), strict=True)):
        scales, scales2 = ref.opt._scales.get(p, {}), ours.opt._scales.get(q, {})
        assert scales.keys() == scales2.keys(), f"{where}: param {i}: scaled states differ"
        for name in scales:
            assert torch.equal(bits(scales[name]), bits(scales2[name])), f"{where}: {i} {name}"
    groups, ref_groups = _groups(ours.opt, tuples_as_lists), _groups(ref.opt, tuples_as_lists)
    assert groups == ref_groups, f"{where}: param_groups {groups} != {ref_groups}"


def assert_all_on_cpu(export: Any, where: str) -> None:
    """One device for every state of an export, the CPU (DCP's full-state load demands one)."""
    devices = set()
    for t in tensors(export):
        if t.dim() > 0:
            devices.add(t.device.type)
            devices.add(local(t).device.type)
    assert devices == {"cpu"}, f"{where}: export on {devices}"


def assert_exports(export: dict[str, Any], where: str) -> None:
    """Every optimizer state of a flattened export is a registered export tensor."""
    states = [v for k, v in export.items() if k.startswith("state.")]
    assert states, f"{where}: no states"
    assert all(is_exported(v) for v in states), f"{where}: not every state is an export"


def resolve(staged: Any) -> Any:
    """What a stager staged, waiting for it where it staged in the background."""
    return staged.result() if isinstance(staged, Future) else staged


def wait(response: Any) -> None:
    """Waits for a ``dcp.async_save``: its future, or its staging and upload."""
    # torch 2.13 returns AsyncSaveResponse when staging is asynchronous, else a Future (2.11 too).
    if isinstance(response, Future):
        response.result()
    else:
        response.staging_completion.result()
        response.upload_completion.result()
