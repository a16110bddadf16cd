"""TE's contract is asked once per operation: one ``Contract`` per export, load, ``load_states``
and planner optimizer, each state's facts computed once, and no per-state re-entry of te_load.

Before the contract was carried, one planner load into a fresh optimizer with FP16 moments
entered ``te_load`` once per assembled state (``load_state``: the contract check, the value
check and a rebuild of every parameter's position each time).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import te_ckpt_placement
from te_ckpt_placement import _te_contract as te_contract
from te_ckpt_placement import _te_load as te_load
from te_ckpt_placement import export_placement
from te_ckpt_placement.dcp import PlacedOptimizerState, StreamingLoadPlanner
from te_ckpt_placement.dcp import _lazy_state as lazy_state

from .support.backends import CPU
from .support.dcp_load_checks import load_run, no_template
from .support.standin import make_optimizer, train

pytestmark = pytest.mark.usefixtures("hooked_standin")


class Asked:
    """Every Contract made (by optimizer) and every state whose facts were computed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.contracts: list[Any] = []
        self.facts: list[tuple[int, str]] = []
        init, facts = te_contract.Contract.__init__, te_contract.state_facts

        def contract(self_: Any, optimizer: Any) -> None:
            self.contracts.append(optimizer)
            init(self_, optimizer)

        def state_facts(optimizer: Any, param: Any, name: Any) -> Any:
            self.facts.append((id(param), name))
            return facts(optimizer, param, name)

        monkeypatch.setattr(te_contract.Contract, "__init__", contract)
        monkeypatch.setattr(te_contract, "state_facts", state_facts)

    def clear(self) -> None:
        self.contracts.clear()
        self.facts.clear()


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> Asked:
    return Asked(monkeypatch)


@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def states_of(optimizer: Any) -> list[tuple[int, str]]:
    return [(id(p), name) for p, states in optimizer.state.items() for name in states]


def test_export_and_loads_make_one_contract_and_each_fact_once(asked: Asked) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    params = list(model.parameters())
    opt = make_optimizer(params, moments=torch.float16, master="fp32")
    train(opt)
    every_state = states_of(opt)
    assert len(every_state) == 12

    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    assert asked.contracts == [opt]
    assert sorted(asked.facts) == sorted(every_state)

    asked.clear()
    with export_placement("cpu"):
        opt.load_state_dict(checkpoint)
    assert asked.contracts == [opt]
    assert sorted(asked.facts) == sorted(states_of(opt))

    asked.clear()
    values = [
        (p, name, checkpoint["state"][i][name])
        for i, p in enumerate(params)
        for name in ("exp_avg", "exp_avg_sq")
    ]
    te_load.load_states(opt, values)
    assert asked.contracts == [opt]
    assert len(asked.facts) == len(values) == len(set(asked.facts))

    asked.clear()
    with export_placement("cpu"):
        lazy_state.lazy_optimizer_state_dict(model, opt)
    assert asked.contracts == [opt]
    assert sorted(asked.facts) == sorted(states_of(opt))


def test_only_contract_of_checks_the_contract() -> None:
    """Every check of an operation is its Contract's: no module calls check_contract itself."""
    modules = [m for name, m in sys.modules.items() if name.startswith("te_ckpt_placement.")]
    assert te_ckpt_placement._te_load in modules
    holding = sorted(
        m.__name__
        for m in modules
        if m is not te_contract and getattr(m, "check_contract", None) is not None
    )
    assert holding == []


@pytest.mark.usefixtures("quiet")
def test_a_planner_load_makes_one_contract_per_optimizer(
    tmp_path: Path, asked: Asked, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fresh optimizers with FP16 moments (initial states, assembled writes): one Contract
    each, every state's facts computed once, and te_load's per-state entry points never run."""
    runs = [
        load_run(CPU, None, torch.float16, master, seed)
        for master, seed in (("fp32", 1), ("remainder", 2))
    ]
    for i, run in enumerate(runs):  # distinct parameter names per part
        run.train(2, seed=10 + i)
        run.model = torch.nn.ModuleDict({f"part{i}": run.model})  # type: ignore[assignment]
    dcp.save(
        {"optim": PlacedOptimizerState([r.model for r in runs], [r.opt for r in runs])},
        checkpoint_id=str(tmp_path),
    )
    loaded = [
        load_run(CPU, None, torch.float16, master, 5 + i)
        for i, master in enumerate(("fp32", "remainder"))
    ]
    for i, run in enumerate(loaded):
        run.model = torch.nn.ModuleDict({f"part{i}": run.model})  # type: ignore[assignment]
        assert not run.opt.state  # fresh: the planner gives them TE's initial states

    def per_state(*args: Any) -> None:
        raise AssertionError("the planner re-entered te_load for one state")

    for name in ("load_state", "load_states", "check_value"):
        monkeypatch.setattr(te_load, name, per_state)
    asked.clear()
    target = PlacedOptimizerState([r.model for r in loaded], [r.opt for r in loaded])
    with no_template(*(r.opt for r in loaded)):
        planner = StreamingLoadPlanner(target)
        dcp.load({"optim": target}, checkpoint_id=str(tmp_path), planner=planner)

    assert planner.fallbacks == []
    assert [id(o) for o in asked.contracts] == [id(r.opt) for r in loaded]
    every_state = [s for r in loaded for s in states_of(r.opt)]
    assert len(every_state) == 2 * 4 * 3  # two parts of 4 parameters, 3 states each
    assert sorted(asked.facts) == sorted(every_state)
    assert planner.progress.startswith("24 of 24 optimizer states loaded")
