"""Trainer integrations without any framework: lazy imports, method wrapping, Automodel recipes.

The framework-specific tests are ``test_integrations_hf.py`` and
``test_integrations_lightning.py``; these run everywhere.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from te_ckpt_placement import Placement, current_placement
from te_ckpt_placement.integrations import automodel
from te_ckpt_placement.integrations._methods import (
    Framework,
    FrameworkMethodError,
    Method,
    hook_class_method,
    methods_owner,
    place_methods,
    placed_methods,
    placement_of,
    placing,
    unplace_methods,
)

from .support.integration_probe import CPU

REPO_ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = (
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "nemo_automodel",
    "transformer_engine",
)


def test_importing_integrations_imports_no_framework() -> None:
    code = (
        "import sys\n"
        "import te_ckpt_placement\n"
        "import te_ckpt_placement.integrations\n"
        "import te_ckpt_placement.integrations._methods\n"
        "import te_ckpt_placement.integrations._lightning\n"
        "import te_ckpt_placement.integrations.automodel\n"
        "from te_ckpt_placement import export_placement\n"
        "with export_placement('cpu'):\n"
        "    pass\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# --- method wrapping ---------------------------------------------------------------------------

FAKE = Framework("FakeFramework", ("fake-framework-not-installed",), tested="1.0")


class Saver:
    def save(self, x: int) -> tuple[int, Placement | None]:
        return x, current_placement()

    def load(self) -> Placement | None:
        return current_placement()

    def fail(self) -> None:
        assert current_placement() == CPU
        raise KeyError("boom")

    def train_step(self) -> Placement | None:
        return current_placement()


def specs(*names: str, optional: tuple[str, ...] = ()) -> tuple[Method, ...]:
    return tuple(Method(n, f"the {n} path", required=n not in optional) for n in names)


def place(obj: object, methods: tuple[Method, ...], placement: Any, **kwargs: Any) -> Any:
    return place_methods(obj, methods, placement, framework=FAKE, what="a saver", **kwargs)


def test_place_methods_scopes_exactly_and_restores() -> None:
    saver, bystander = Saver(), Saver()

    def previous_load() -> str:
        return "theirs"

    saver.load = previous_load  # type: ignore[method-assign]
    names = place(saver, specs("save", "load", "fail"), "cpu", owner="me")
    assert names == ("save", "load", "fail")
    assert methods_owner(saver) == "me"
    assert placement_of(saver) == CPU
    assert saver.save(3) == (3, CPU)
    assert saver.load() == "theirs"  # the previous instance attribute, now wrapped
    assert saver.train_step() is None
    with pytest.raises(KeyError):
        saver.fail()
    assert current_placement() is None  # the policy closed although the method raised
    assert bystander.save(1) == (1, None)
    assert placement_of(bystander) is None
    assert saver.save.__name__ == "save"

    wrappers = dict(vars(saver))
    other = Placement(device="cpu", conversion="device")
    assert place(saver, specs("save"), other, owner="someone else") == names
    assert {k: vars(saver)[k] for k in names} == {k: wrappers[k] for k in names}
    assert methods_owner(saver) == "me"
    assert saver.save(4) == (4, other)

    assert unplace_methods(saver)
    assert placed_methods(saver) == () and methods_owner(saver) is None
    assert saver.load is previous_load
    assert "save" not in vars(saver) and "fail" not in vars(saver)
    assert saver.save(5) == (5, None)
    assert not unplace_methods(saver)


def test_unplace_leaves_a_later_replacement() -> None:
    saver = Saver()
    place(saver, specs("save"), "cpu")

    def later(x: int) -> str:
        return "later"

    saver.save = later  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="replaced after the placement wrapper"):
        assert unplace_methods(saver)
    assert saver.save is later
    assert placed_methods(saver) == ()


def test_place_methods_rejects_bad_placement() -> None:
    saver = Saver()
    with pytest.raises(ValueError, match="unsupported export device"):
        place(saver, specs("save"), "cuda:7")
    assert placed_methods(saver) == () and "save" not in vars(saver)


def test_missing_required_method_is_an_error_naming_method_and_version() -> None:
    saver = Saver()
    with pytest.raises(FrameworkMethodError) as info:
        place(saver, specs("save", "absent"), "cpu")
    message = str(info.value)
    assert "absent (the absent path)" in message
    assert "FakeFramework unknown" in message and "FakeFramework 1.0" in message
    assert placed_methods(saver) == () and "save" not in vars(saver)  # nothing changed


def test_missing_optional_method_warns_naming_method_and_version() -> None:
    saver = Saver()
    with pytest.warns(RuntimeWarning, match=r"no absent \(the absent path\).*FakeFramework 1.0"):
        names = place(saver, specs("save", "absent", optional=("absent",)), "cpu")
    assert names == ("save",)
    assert saver.save(1) == (1, CPU)


def test_around_runs_inside_the_policy_with_the_original() -> None:
    seen: list[Any] = []

    def around(obj: Any, original: Any, x: int) -> Any:
        seen.append((obj, current_placement()))
        return original(x + 1)

    saver = Saver()
    place(saver, (Method("save", "saving", around=around),), "cpu")
    assert saver.save(1) == (2, CPU)
    assert seen == [(saver, CPU)]


class Pickled(Saver):
    """A picklable module-level class, as Lightning strategies are."""


def test_placed_instance_survives_pickling() -> None:
    # Lightning's ddp_spawn and Fabric's spawn launcher pickle the placed strategy.
    saver = Pickled()
    place(saver, specs("save", "load"), Placement(device="cpu", conversion="device"))
    copy = pickle.loads(pickle.dumps(saver))
    assert placed_methods(copy) == ("save", "load")
    assert copy.save(2) == (2, Placement(device="cpu", conversion="device"))
    assert vars(copy)["save"].target is copy  # bound to the copy, not the original
    assert unplace_methods(copy)
    assert copy.save(3) == (3, None)
    assert saver.save(4) == (4, Placement(device="cpu", conversion="device"))


def test_placing_decorator_and_mixin_placement() -> None:
    @placing(specs("save"))
    class Mixin:
        optimizer_export_placement: Any = "cpu"

    class Placed(Mixin, Saver):
        pass

    placed = Placed()
    assert placed.save(1) == (1, CPU)
    assert placed.load() is None
    assert placement_of(placed) == CPU
    placed.optimizer_export_placement = None  # TE's own behaviour: an explicit None policy
    assert placed.save(2) == (2, Placement(device=None))
    assert Placed.save.__qualname__.endswith("<locals>.Mixin.save")
    own = type("Own", (), {"save": lambda self: None})
    with pytest.raises(TypeError, match="already defines save"):
        placing(specs("save"))(own)


def test_hook_class_method_follows_the_instance_policy() -> None:
    class Target:
        def __init__(self, placement: Placement | None) -> None:
            self.placement = placement

        def load(self) -> Placement | None:
            return current_placement()

    method = Method("load", "loading")
    assert hook_class_method(Target, method, lambda obj: obj.placement)
    assert not hook_class_method(Target, method, lambda obj: obj.placement)  # once
    assert Target(CPU).load() == CPU
    assert Target(None).load() is None


# --- Automodel recipes -------------------------------------------------------------------------


class FakeBaseRecipe:
    """Automodel's BaseRecipe surface: save_checkpoint and load_checkpoint, called by the loop."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def save_checkpoint(self, epoch: int, step: int, train_loss: float, **kwargs: Any) -> str:
        self.seen["save"] = current_placement()
        return f"saved {epoch} {step}"

    def load_checkpoint(self, restore_from: str | None = None) -> None:
        self.seen["load"] = current_placement()

    def run_train_validation_loop(self) -> None:
        self.seen["train"] = current_placement()
        self.load_checkpoint()
        self.save_checkpoint(0, 1, 0.5)


def test_recipe_mixin_and_factory() -> None:
    class Recipe(automodel.PlacementRecipeMixin, FakeBaseRecipe):
        pass

    recipe = Recipe()
    recipe.run_train_validation_loop()
    assert recipe.seen == {"train": None, "load": CPU, "save": CPU}
    assert recipe.save_checkpoint(2, 3, train_loss=0.1) == "saved 2 3"
    assert current_placement() is None

    other = Placement(device="cpu", conversion="device")
    built = automodel.placement_recipe(FakeBaseRecipe, other)
    assert built.__name__ == "PlacementFakeBaseRecipe"
    assert issubclass(built, automodel.PlacementRecipeMixin) and issubclass(built, FakeBaseRecipe)
    instance = built()
    instance.run_train_validation_loop()
    assert instance.seen == {"train": None, "load": other, "save": other}
    with pytest.raises(ValueError, match="unsupported export device"):
        automodel.placement_recipe(FakeBaseRecipe, "cuda")


def test_recipe_without_a_wrapped_method_is_an_error() -> None:
    class NoLoad:  # a recipe base of an Automodel version that renamed load_checkpoint
        def save_checkpoint(self) -> None:
            pass

    with pytest.raises(FrameworkMethodError, match=r"has no load_checkpoint \(resume"):
        automodel.placement_recipe(NoLoad)


def test_recipe_load_initializes_fresh_te_states_first() -> None:
    # torch's get/set_optimizer_state_dict (Automodel's load_optimizer) would otherwise run a
    # fake step with zero gradients on the GPU for a fresh optimizer.
    from .support.standin import make_optimizer

    class WithOptimizer(FakeBaseRecipe):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Linear(4, 3)
            self.optimizer = [make_optimizer(self.model.parameters())]

        def load_checkpoint(self, restore_from: str | None = None) -> None:
            self.seen["states_at_load"] = len(self.optimizer[0].state)
            self.seen["names"] = set(self.optimizer[0].state.get(self.model.weight, {}))

    plain = WithOptimizer()
    plain.load_checkpoint()
    assert plain.seen["states_at_load"] == 0
    placed = automodel.placement_recipe(WithOptimizer)()
    placed.load_checkpoint()
    assert placed.seen["states_at_load"] == 2
    assert placed.seen["names"] == {"exp_avg", "exp_avg_sq", "master_param"}
    # This fake loads nothing, as a fresh run's load_checkpoint: the states are taken back.
    assert not placed.optimizer[0].state
    off = automodel.placement_recipe(WithOptimizer, None)()  # TE's own behaviour
    off.load_checkpoint()
    assert off.seen["states_at_load"] == 0


def test_ready_made_recipe_is_built_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    module_name, base_name = automodel.READY_MADE["PlacementFinetuneRecipe"].rsplit(".", 1)
    fake = types.ModuleType(module_name)
    setattr(fake, base_name, type(base_name, (FakeBaseRecipe,), {}))
    monkeypatch.setitem(sys.modules, module_name, fake)
    monkeypatch.delitem(vars(automodel), "PlacementFinetuneRecipe", raising=False)

    # As Automodel's CLI resolves `recipe: te_ckpt_placement.integrations.automodel.<Name>`.
    import importlib

    target = "te_ckpt_placement.integrations.automodel.PlacementFinetuneRecipe"
    path, name = target.rsplit(".", 1)
    cls = getattr(importlib.import_module(path), name)
    try:
        assert cls.__name__ == name and cls.__module__ == path
        assert cls.__mro__[1:3] == (automodel.PlacementRecipeMixin, getattr(fake, base_name))
        assert automodel.PlacementFinetuneRecipe is cls  # built once
        recipe = cls()
        recipe.run_train_validation_loop()
        assert recipe.seen == {"train": None, "load": CPU, "save": CPU}
    finally:
        vars(automodel).pop("PlacementFinetuneRecipe", None)


def test_ready_made_recipe_without_automodel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nemo_automodel", None)  # import fails, installed or not
    monkeypatch.delitem(vars(automodel), "PlacementVLMFinetuneRecipe", raising=False)
    with pytest.raises(ImportError, match="needs NeMo Automodel"):
        _ = automodel.PlacementVLMFinetuneRecipe
    assert "PlacementVLMFinetuneRecipe" not in vars(automodel)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = automodel.Nope


# --- Automodel's launchers: `python -m <recipe module> -c config.yaml` ---------------------------

# NeMo Automodel is not installed here: a stand-in package with the two entry points the
# launcher path uses (Automodel's argument parser and a recipe class), at the module paths and
# with the signatures of NVIDIA-NeMo/Automodel at 36044ad3.
FAKE_AUTOMODEL = {
    "nemo_automodel/__init__.py": "",
    "nemo_automodel/components/__init__.py": "",
    "nemo_automodel/components/config/__init__.py": "",
    "nemo_automodel/components/config/_arg_parser.py": """
import yaml

def parse_cli_argv(default_cfg_path=None, argv=None):
    cfg_path, overrides, i = default_cfg_path, [], 0
    while i < len(argv):
        if argv[i] in ("--config", "-c"):
            cfg_path = argv[i + 1]
            i += 2
        elif argv[i].startswith("--"):
            overrides.append(argv[i][2:] + "=" + argv[i + 1])
            i += 2
        else:
            i += 1
    if not cfg_path:
        raise ValueError("You must specify --config <path>")
    return cfg_path, overrides

def parse_args_and_load_config(default_cfg_path=None, argv=None):
    cfg_path, overrides = parse_cli_argv(default_cfg_path, argv=argv)
    with open(cfg_path) as f:
        cfg = yaml.safe_load(f)
    for kv in overrides:
        key, value = kv.split("=", 1)
        cfg[key] = value
    return cfg
""",
    "nemo_automodel/recipes/__init__.py": "",
    "nemo_automodel/recipes/llm/__init__.py": "",
    "nemo_automodel/recipes/llm/train_ft.py": """
import json
from te_ckpt_placement import current_placement

class TrainFinetuneRecipeForNextTokenPrediction:
    def __init__(self, cfg):
        self.cfg = cfg
        self.events = []

    def setup(self):
        self.events.append(["setup", current_placement() is not None])

    def save_checkpoint(self, epoch, step, train_loss):
        self.events.append(["save", repr(current_placement())])

    def load_checkpoint(self, restore_from=None):
        self.events.append(["load", repr(current_placement())])

    def run_train_validation_loop(self):
        self.load_checkpoint()
        self.events.append(["train", current_placement() is not None])
        self.save_checkpoint(0, 1, 0.5)
        with open(self.cfg["marker"], "w") as f:
            json.dump({"recipe": type(self).__name__, "cfg": self.cfg, "events": self.events}, f)
""",
}


def run_module(tmp_path: Path, argv: list[str], *, fake: bool = True) -> Any:
    site = tmp_path / "site"
    if fake:
        for rel, text in FAKE_AUTOMODEL.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO_ROOT)]))
    return subprocess.run(
        [sys.executable, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def write_config(tmp_path: Path, recipe: Any) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"recipe": recipe, "marker": str(tmp_path / "ran.json"), "lr": 1})
    )
    return config


@pytest.mark.parametrize(
    "recipe",
    [
        "te_ckpt_placement.integrations.automodel.PlacementFinetuneRecipe",
        {"_target_": "te_ckpt_placement.integrations.automodel.PlacementFinetuneRecipe"},
    ],
)
def test_nemo_run_module_launch_trains(tmp_path: Path, recipe: Any) -> None:
    # NeMo-Run's Script(path=<recipe module>, m=True): python -m <module> -c <config> [extra].
    config = write_config(tmp_path, recipe)
    module = "te_ckpt_placement.integrations.automodel"
    out = run_module(tmp_path, ["-m", module, "-c", str(config), "--lr", "2"])
    assert out.returncode == 0, out.stdout + out.stderr
    ran = json.loads((tmp_path / "ran.json").read_text())
    assert ran["recipe"] == "PlacementFinetuneRecipe"
    assert ran["cfg"]["lr"] == "2"  # the CLI override went through Automodel's parser
    cpu = repr(CPU)
    assert ran["events"] == [
        ["setup", False],
        ["load", cpu],
        ["train", False],
        ["save", cpu],
    ]


def test_module_runs_as_a_script_too(tmp_path: Path) -> None:
    # Automodel's interactive multi-GPU launch and SkyPilot run the module's file with torchrun.
    config = write_config(
        tmp_path, "te_ckpt_placement.integrations.automodel.PlacementFinetuneRecipe"
    )
    script = REPO_ROOT / "te_ckpt_placement" / "integrations" / "automodel.py"
    out = run_module(tmp_path, [str(script), "-c", str(config)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((tmp_path / "ran.json").read_text())["events"][1] == ["load", repr(CPU)]


@pytest.mark.parametrize(
    ("recipe", "fake", "message"),
    [
        ("nemo_automodel.recipes.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction", True,
         "not a recipe of this module"),
        (None, True, "names no recipe"),
        ("te_ckpt_placement.integrations.automodel.PlacementFinetuneRecipe", False,
         "needs NeMo Automodel"),
    ],
)  # fmt: skip
def test_module_launch_fails_clearly(tmp_path: Path, recipe: Any, fake: bool, message: str) -> None:
    config = write_config(tmp_path, recipe)
    module = "te_ckpt_placement.integrations.automodel"
    out = run_module(tmp_path, ["-m", module, "-c", str(config)], fake=fake)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert not (tmp_path / "ran.json").exists()


# --- resume: TE's initial states without GPU temporaries -----------------------------------------


@pytest.mark.parametrize("master", ["fp32", "remainder", "none"])
@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float32, torch.float16])
def test_resume_initialize_equals_te_initialize_state(
    moments: torch.dtype, master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The initial states built in place (TE's _initialize_state for every state, FP32 masters
    # copied from the parameters) are TE's initialize_state bit for bit, FP16 moments included.
    from te_ckpt_placement import _te_load as te_load
    from te_ckpt_placement import export_placement
    from te_ckpt_placement.integrations import _resume

    from .support.helpers import assert_snapshot_equal, snapshot
    from .support.standin import make_optimizer

    def build() -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(torch.bfloat16)
        return make_optimizer(model.parameters(), moments=moments, master=master)

    reference = build()
    for group in reference.param_groups:
        for param in group["params"]:
            reference.initialize_state(param, master == "remainder")
    ours = build()

    def on_gpu(param: Any, remainder: bool) -> None:  # not TE's initializer (GPU temporaries)
        raise AssertionError("TE's initialize_state used")

    monkeypatch.setattr(ours, "initialize_state", on_gpu)
    with _resume.initialized([ours]):
        assert not ours.state  # outside a streaming policy: nothing
    with export_placement("cpu"), _resume.initialized([ours]):
        snapped = snapshot(ours)
        te_load.note_loaded(ours)  # as a load in the block does: the states stay
    assert_snapshot_equal(
        {i: s for i, s in enumerate(snapped.values())},
        {i: s for i, s in enumerate(snapshot(reference).values())},
    )
    for p_ours, p_ref in zip(
        ours.param_groups[0]["params"], reference.param_groups[0]["params"], strict=True
    ):
        assert ours._scales.get(p_ours, {}).keys() == reference._scales.get(p_ref, {}).keys()
    with export_placement("cpu"), _resume.initialized([ours]):
        pass  # has state now: left alone
    assert_snapshot_equal(snapped, snapshot(ours))
    assert ours.param_groups[0].get("step") == 1


@pytest.mark.usefixtures("hooked_standin")  # TE's class is hooked once a policy is entered
@pytest.mark.parametrize("framework", ["automodel", "lightning"])
def test_a_resume_that_loads_nothing_leaves_the_optimizer_fresh(framework: str) -> None:
    # Frameworks call their resume method on a fresh run too (no checkpoint found, or a Fabric
    # load without optimizer state): states built for it would make TE's first step its second.
    from te_ckpt_placement import export_placement
    from te_ckpt_placement.integrations import _resume, automodel

    from .support.standin import make_optimizer, train

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(model.parameters())
    if framework == "automodel":

        class Recipe:
            def __init__(self) -> None:
                self.model, self.optimizer = model, [opt]

            def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
                pass

            def load_checkpoint(self, restore_from: Any = None) -> None:
                return  # BaseRecipe.load_checkpoint with no checkpoint to restore

        automodel.placement_recipe(Recipe)().load_checkpoint()
    else:
        with export_placement("cpu"), _resume.initialized([opt]):
            assert opt.state  # built for the load the block was expected to run
    assert not opt.state and not opt._scales
    assert all("step" not in group for group in opt.param_groups)
    # A load in the block keeps them (and the checkpoint's values).
    source = make_optimizer(torch.nn.Linear(4, 3).parameters())
    train(source)
    with export_placement("cpu"):
        checkpoint = source.state_dict()
    with export_placement("cpu"), _resume.initialized([opt]):
        opt.load_state_dict(checkpoint)
    assert opt.state


def test_place_methods_takes_bare_names_as_optional_methods() -> None:
    # Main's Megatron integration passes names; a missing one warns instead of passing silently.
    saver = Saver()
    with pytest.warns(RuntimeWarning, match=r"Saver has no absent"):
        assert place_methods(saver, ("save", "absent"), "cpu") == ("save",)
    assert saver.save(1) == (1, CPU)


# --- resume: an FSDP2 FULL_STATE_DICT load that equals torch's -----------------------------------


def _two_group_adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    optimizer = torch.optim.Adam(
        [
            {"params": model[0].parameters(), "lr": 1e-2},
            {"params": model[1].parameters(), "lr": 1e-3, "betas": (0.8, 0.99)},
        ]
    )
    return model, optimizer


def _loaded(optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    """Every state's bits and every hyperparameter's ``repr`` (types count: tuple vs list)."""
    from .support.helpers import bits

    sd = optimizer.state_dict()
    states = [
        (f"{i}.{name}", bytes(bits(value).numpy()), value.dtype, value.device, value.shape)
        for i, entry in sorted(sd["state"].items())
        for name, value in sorted(entry.items())
    ]
    groups = [(i, repr(sorted(group.items()))) for i, group in enumerate(sd["param_groups"])]
    return [("states", s) for s in states] + [("group", g) for g in groups]


def _no_barrier(*args: Any, **kwargs: Any) -> None:
    raise AssertionError(
        "dist.barrier stages a byte on the group's bound device (a CUDA block on a GPU run)"
    )


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-rank gloo default group in which ``dist.barrier`` fails: the resume's collectives
    must stay on the host."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs its own one-rank process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(dist, "barrier", _no_barrier)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_load_full_equals_torchs_full_state_load(tmp_path: Path) -> None:
    # accelerate's FULL_STATE_DICT resume is torch's set_optimizer_state_dict(full_state_dict,
    # broadcast_from_rank0); _fsdp2_load.load_full must give the optimizer exactly what that gives,
    # hyperparameters and their types included (torch hands back a group's tuples as lists),
    # with saved groups matched by parameter FQN, a key the checkpoint lacks kept from the
    # optimizer, one the checkpoint adds taken.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from te_ckpt_placement.integrations import _fsdp2_load

    full_options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    model, optimizer = _two_group_adam(seed=0)
    for _ in range(2):
        model(torch.randn(2, 5)).sum().backward()
        optimizer.step()
    saved = get_optimizer_state_dict(model, optimizer, options=full_options)
    saved["param_groups"].reverse()  # matched by FQN, not by position
    saved["param_groups"][0]["added"] = (1, "two")
    del saved["param_groups"][1]["maximize"]
    assert isinstance(saved["param_groups"][0]["betas"], tuple)
    path = tmp_path / "optimizer.bin"
    torch.save(saved, path)

    model, reference = _two_group_adam(seed=1)
    set_optimizer_state_dict(
        model, reference, torch.load(path, weights_only=True), options=full_options
    )
    model, ours = _two_group_adam(seed=1)
    with _fsdp2_load.host_group() as group:
        assert _fsdp2_load.load_full(model, ours, str(path), full_options, group)
    assert _loaded(ours) == _loaded(reference)
    assert isinstance(reference.param_groups[0]["betas"], list)  # what makes this test bite

    # A state of another shape: an error naming it, and the optimizer unchanged.
    bad = torch.load(path, weights_only=True)
    bad["state"]["1.weight"]["exp_avg"] = torch.zeros(3, 3)
    torch.save(bad, path)
    before = _loaded(ours)
    with _fsdp2_load.host_group() as group:
        with pytest.raises(ValueError, match=r"'exp_avg' of 1\.weight has shape \(3, 3\)"):
            _fsdp2_load.load_full(model, ours, str(path), full_options, group)
    assert _loaded(ours) == before


@pytest.mark.usefixtures("one_rank_group")
def test_load_sharded_equals_accelerates_sharded_load(tmp_path: Path) -> None:
    # accelerate's SHARDED_STATE_DICT resume (load_fsdp_optimizer): a template, dcp.load, then
    # set_optimizer_state_dict. _fsdp2_load.load_sharded runs the same calls with its collectives on
    # the host group, and no dist.barrier (which allocates on the group's bound device).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from te_ckpt_placement.integrations import _fsdp2_load

    options = StateDictOptions()
    model, optimizer = _two_group_adam(seed=0)
    for _ in range(2):
        model(torch.randn(2, 5)).sum().backward()
        optimizer.step()
    path = str(tmp_path / "optimizer_0")
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)

    model, reference = _two_group_adam(seed=1)
    template = {"optimizer": get_optimizer_state_dict(model, reference, options=options)}
    dcp.load(template, checkpoint_id=path)
    set_optimizer_state_dict(model, reference, template["optimizer"], options=options)
    model, ours = _two_group_adam(seed=1)
    with _fsdp2_load.host_group() as group:
        _fsdp2_load.load_sharded(model, ours, path, options, group)
    assert _loaded(ours) == _loaded(reference)


def _full_load_rank(rank: int, port: int, path: str, fail: str, out: str) -> None:
    """One rank of a 2-rank ``load_full`` in which rank 1 fails at ``fail`` ("read", "load")."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as sd

    from te_ckpt_placement.integrations import _fsdp2_load, _resume

    from .support.distributed import init_group

    init_group(rank, port, backend="gloo", timeout_s=30)
    dist.barrier = _no_barrier  # type: ignore[assignment]
    if rank == 1 and fail in ("read", "interrupt"):

        def unreadable(*args: Any, **kwargs: Any) -> Any:
            if fail == "interrupt":
                raise KeyboardInterrupt
            raise OSError("injected: the mapped file went away")

        _resume.host_load = unreadable  # type: ignore[assignment]
    if rank == 1 and fail == "load":

        def refused(*args: Any, **kwargs: Any) -> None:
            raise KeyError("injected: set_optimizer_state_dict failed")

        sd.set_optimizer_state_dict = refused  # type: ignore[assignment]
    model, optimizer = _two_group_adam(seed=1)
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()  # states of its own, which a load would replace
    before = _loaded(optimizer)
    options = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    error: BaseException | None = None
    try:
        with _fsdp2_load.host_group() as group:
            _fsdp2_load.load_full(model, optimizer, path, options, group)
    except BaseException as exc:
        error = exc
    notes = getattr(error, "__notes__", [])
    result = {
        "error": None if error is None else type(error).__name__,
        "message": "" if error is None else "\n".join([str(error), *notes]),
        "unchanged": _loaded(optimizer) == before,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("fail", ["read", "interrupt", "load"])
def test_load_full_fails_on_every_rank_when_one_fails(tmp_path: Path, fail: str) -> None:
    # Rank 1 cannot read the checkpoint ("read"), is interrupted there ("interrupt"), or fails
    # in set_optimizer_state_dict ("load").
    # Every rank must raise (none may wait for the other at a barrier); after a failed read no
    # rank has loaded anything, and after a failed load the error says which ranks loaded.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from .support.distributed import spawn

    model, optimizer = _two_group_adam(seed=0)
    for _ in range(2):
        model(torch.randn(2, 5)).sum().backward()
        optimizer.step()
    full = StateDictOptions(full_state_dict=True)
    path = tmp_path / "optimizer.bin"
    torch.save(get_optimizer_state_dict(model, optimizer, options=full), path)
    spawn(_full_load_rank, str(path), fail, str(tmp_path))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["error"] == "RuntimeError"
    if fail in ("read", "interrupt"):
        expected = "OSError" if fail == "read" else "KeyboardInterrupt"
        assert rank1["error"] == expected
        assert f"rank 1: {expected}" in rank0["message"]
        assert "Nothing was loaded on any rank" in rank0["message"]
        assert rank0["unchanged"] and rank1["unchanged"]
    else:
        assert rank1["error"] == "KeyError"
        assert "rank 1: KeyError" in rank0["message"]
        assert "The ranks not listed loaded the checkpoint" in rank0["message"]
        assert not rank0["unchanged"]  # rank 0 loaded, as its error says
    if sys.version_info >= (3, 11):  # the failed rank's own error carries the outcome as a note
        assert "rank 1:" in rank1["message"]


def test_agree_groups_ranks_with_the_same_error() -> None:
    from te_ckpt_placement.integrations import _fsdp2_load

    assert _fsdp2_load._ranks([3]) == "rank 3"
    assert _fsdp2_load._ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


# --- resume: a TE full-state load refuses what the streaming load refuses ---------------------


def _te_model() -> torch.nn.Module:
    """BF16 parameters (TE keeps int16 remainders of those), with the FQNs of
    ``support.distributed.fully_sharded``'s model."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 4)).to(torch.bfloat16)


def _te_checkpoint(master: str, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trained stand-in's full-state checkpoint, keyed by FQN (as accelerate saves it) and by
    position (as ``optimizer.state_dict()`` gives it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from .support.standin import make_optimizer, train

    model = _te_model()
    optimizer = make_optimizer(model.parameters(), master=master)
    train(optimizer, steps=steps)
    full = StateDictOptions(full_state_dict=True)
    return get_optimizer_state_dict(model, optimizer, options=full), optimizer.state_dict()


def _states_by_position(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    from .support.helpers import snapshot

    snap = snapshot(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [(f"{i}.{n}", v) for i, p in enumerate(params) for n, v in sorted(snap[p].items())]


def _same_states(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True)
    )


FQNS = {0: "0.weight", 1: "0.bias", 2: "1.weight", 3: "1.bias"}

# (saved masters, loaded masters, the state of 1.weight (position 2) changed in the checkpoint,
# whether te_load refuses it)
TE_LOAD_CASES = {
    "int16 remainders into FP32 masters": ("remainder", "fp32", None, True),
    "FP32 masters into int16 remainders": ("fp32", "remainder", None, True),
    "int32 moments": ("fp32", "fp32", ("exp_avg", torch.int32), True),
    "complex moments": ("fp32", "fp32", ("exp_avg_sq", torch.complex64), True),
    "BF16 moments": ("fp32", "fp32", ("exp_avg", torch.bfloat16), False),
    "FP16 moments": ("fp32", "fp32", ("exp_avg_sq", torch.float16), False),
    "FP64 masters": ("fp32", "fp32", ("master_param", torch.float64), False),
    "a None state": ("fp32", "fp32", ("master_param", None), False),  # skipped, as TE's load does
}


@pytest.mark.usefixtures("one_rank_group", "hooked_standin")
@pytest.mark.parametrize("case", list(TE_LOAD_CASES))
def test_load_full_refuses_what_te_load_refuses(tmp_path: Path, case: str) -> None:
    # The FSDP2 full-state resume copies each saved state into the template torch gives it,
    # which casts; it must refuse each checkpoint the streaming load refuses, with its message
    # (the parameter named by FQN instead of position) and nothing changed, and load the others
    # as it does, bit for bit.
    import re

    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from te_ckpt_placement import export_placement
    from te_ckpt_placement.integrations import _fsdp2_load

    from .support.standin import make_optimizer, train

    saved_master, master, change, refuses = TE_LOAD_CASES[case]
    by_fqn, by_position = _te_checkpoint(saved_master, steps=2)
    if change is not None:
        name, dtype = change
        for states in (by_fqn["state"]["1.weight"], by_position["state"][2]):
            states[name] = None if dtype is None else states[name].to(dtype)
    path = tmp_path / "optimizer.bin"
    torch.save(by_fqn, path)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = _te_model()
        optimizer = make_optimizer(model.parameters(), master=master)
        train(optimizer, steps=1, seed=1)  # states of its own, which a load would replace
        return model, optimizer

    _, reference = fresh()
    model, ours = fresh()
    before = _states_by_position(ours)
    refused: list[str] = []
    with export_placement("cpu"):
        try:
            reference.load_state_dict(by_position)
        except ValueError as exc:
            refused.append(
                re.sub(r"parameter (\d)", lambda m: f"parameter {FQNS[int(m[1])]}", str(exc))
            )
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        with _fsdp2_load.host_group() as group:
            if refused:
                with pytest.raises(ValueError) as caught:
                    _fsdp2_load.load_full(model, ours, str(path), options, group)
            else:
                assert _fsdp2_load.load_full(model, ours, str(path), options, group)
    if refused:
        assert str(caught.value) == refused[0]
        assert _same_states(_states_by_position(ours), before)
    else:
        assert _same_states(_states_by_position(ours), _states_by_position(reference))
    assert bool(refused) == refuses, refused


def _te_full_load_rank(rank: int, port: int, out: str, cases: dict[str, Any]) -> None:
    """One rank of 2-rank TE full-state loads (the stand-in, FSDP2 on a gloo mesh) under the
    streaming policy: ``cases`` maps a name to (the loaded masters, the checkpoint rank 0
    reads, the one rank 1 reads, both at rank 0's path)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from te_ckpt_placement import export_placement
    from te_ckpt_placement.integrations import _fsdp2_load, _resume

    from .support.distributed import fully_sharded, init_gloo_mesh
    from .support.standin import make_optimizer, train

    mesh = init_gloo_mesh(rank, port, timeout_s=60)
    dist.barrier = _no_barrier  # type: ignore[assignment]
    real_load = _resume.host_load
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    results: dict[str, Any] = {}
    for case, (master, path, other) in cases.items():
        if rank == 1:  # the file rank 1 finds at the path: another node's disk
            _resume.host_load = lambda _, o=other, **kw: real_load(o, **kw)  # type: ignore[assignment]
        model = fully_sharded(mesh, torch.bfloat16, seed=1)
        optimizer = make_optimizer(model.parameters(), master=master)
        train(optimizer, steps=1, seed=1)
        before = _states_by_position(optimizer)
        error: BaseException | None = None
        try:
            with export_placement("cpu"), _fsdp2_load.host_group() as group:
                _fsdp2_load.load_full(model, optimizer, path, options, group)
        except Exception as exc:
            error = exc
        results[case] = {
            "error": None if error is None else type(error).__name__,
            "message": ""
            if error is None
            else "\n".join([str(error), *getattr(error, "__notes__", [])]),
            "unchanged": _same_states(_states_by_position(optimizer), before),
        }
        _resume.host_load = real_load  # type: ignore[assignment]
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _spawn_te_full_loads(tmp_path: Path, cases: dict[str, Any]) -> list[dict[str, Any]]:
    from .support.distributed import spawn

    spawn(_te_full_load_rank, str(tmp_path), cases)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.usefixtures("one_rank_group", "hooked_standin")
def test_load_full_refuses_another_masters_storage_on_every_rank(tmp_path: Path) -> None:
    # int16 remainders loaded as FP32 masters (their integer values, ~1e4) or FP32 masters as
    # remainders (all 0): every rank raises te_load's error before any copy, none has changed.
    for master in ("remainder", "fp32"):
        torch.save(_te_checkpoint(master, steps=2)[0], tmp_path / f"{master}.bin")
    remainders, fp32 = str(tmp_path / "remainder.bin"), str(tmp_path / "fp32.bin")
    cases = {
        "into fp32": ("fp32", remainders, remainders),
        "into remainder": ("remainder", fp32, fp32),
    }
    problems = {
        "into fp32": "stored as torch.int16, but this optimizer keeps floating-point states",
        "into remainder": "stored as torch.float32, but this optimizer keeps int16 remainders",
    }
    for rank, results in enumerate(_spawn_te_full_loads(tmp_path, cases)):
        for case, problem in problems.items():
            result = results[case]
            assert result["error"] == "ValueError", (rank, case, result)
            assert problem in result["message"] and "parameter 0.weight" in result["message"]
            assert result["unchanged"], (rank, case)
            if sys.version_info >= (3, 11):
                assert "ranks 0-1: ValueError" in result["message"]


@pytest.mark.usefixtures("one_rank_group", "hooked_standin")
def test_load_full_refuses_ranks_that_read_different_checkpoints(tmp_path: Path) -> None:
    # Rank 1's file at the checkpoint path is another save (step 5, rank 0's step 3): torch's
    # load would give both rank 0's values; each rank loading its own would mix them. Every
    # rank raises, naming each rank's step, and none has changed. The same file loads.
    for steps in (3, 5):
        torch.save(_te_checkpoint("fp32", steps=steps)[0], tmp_path / f"step{steps}.bin")
    three, five = str(tmp_path / "step3.bin"), str(tmp_path / "step5.bin")
    cases = {"different": ("fp32", three, five), "same": ("fp32", three, three)}
    for rank, results in enumerate(_spawn_te_full_loads(tmp_path, cases)):
        different = results["different"]
        assert different["error"] == "RuntimeError", (rank, different)
        assert "the ranks read different checkpoints" in different["message"]
        assert "rank 0: step 3, content " in different["message"]
        assert "rank 1: step 5, content " in different["message"]
        assert "Nothing was loaded on any rank" in different["message"]
        assert different["unchanged"], rank
        assert results["same"]["error"] is None, (rank, results["same"])
        assert not results["same"]["unchanged"], rank


def test_fingerprint_is_the_checkpoints_content() -> None:
    from te_ckpt_placement.integrations._fingerprint import SAMPLES, fingerprint

    from .support.helpers import through_torch_save

    state = {
        "state": {"w": {"exp_avg": torch.randn(40, 3), "step": torch.tensor(7.0)}},
        "param_groups": [{"params": ["w"], "betas": (0.9, 0.99), "step": 7}],
    }
    assert fingerprint(state).startswith("step 7, content ")
    assert fingerprint(through_torch_save(state)) == fingerprint(state)
    changed = through_torch_save(state)
    changed["state"]["w"]["exp_avg"][-1, -1] += 1  # the last element is always sampled
    assert fingerprint(changed) != fingerprint(state)
    changed = through_torch_save(state)
    changed["param_groups"][0]["betas"] = [0.9, 0.99]
    assert fingerprint(changed) != fingerprint(state)
    changed = through_torch_save(state)
    changed["state"]["w"]["exp_avg"] = changed["state"]["w"]["exp_avg"].to(torch.bfloat16)
    assert fingerprint(changed) != fingerprint(state)
    assert SAMPLES < 40 * 3


def _stuck_peer_rank(rank: int, port: int, path: str, out: str) -> None:
    """Rank 1 stalls for ``STALL_S`` before it resumes; rank 0 times out the job's way."""
    import time
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as sd

    from te_ckpt_placement.integrations import _fsdp2_load

    from .support.distributed import init_group

    init_group(rank, port, backend="gloo", timeout_s=60)
    dist.all_reduce(torch.zeros(1))  # both ranks here: only the stall below is late
    # The job's timeout, short (init_process_group's timeout would also bound the rendezvous).
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=HOST_TIMEOUT_S))
    model, optimizer = _two_group_adam(seed=1)
    options = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    error: BaseException | None = None
    with _fsdp2_load.host_group() as group:
        if rank == 1:
            time.sleep(STALL_S)
        start = time.monotonic()
        try:
            _fsdp2_load.load_full(model, optimizer, path, options, group)
        except Exception as exc:
            error = exc
        elapsed = time.monotonic() - start
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"error": None if error is None else type(error).__name__, "elapsed": elapsed})
    )
    if rank == 0:  # rank 0 holds the store: it stays until rank 1 is done with the group
        for _ in range(200):
            if Path(out, "rank1.json").exists():
                break
            time.sleep(0.1)
    dist.destroy_process_group()


HOST_TIMEOUT_S, STALL_S = 1.5, 5.0


@pytest.mark.usefixtures("one_rank_group")
def test_host_group_times_out_as_the_default_group_does(tmp_path: Path) -> None:
    # With a 30-minute host group, rank 0 waited for the stalled rank 1 however short the job's
    # timeout; it must give up after about the default group's timeout.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from .support.distributed import spawn

    model, optimizer = _two_group_adam(seed=0)
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    path = tmp_path / "optimizer.bin"
    full = StateDictOptions(full_state_dict=True)
    torch.save(get_optimizer_state_dict(model, optimizer, options=full), path)
    spawn(_stuck_peer_rank, str(path), str(tmp_path))
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["error"] is not None, rank0  # it waited for rank 1 and loaded
    assert rank0["elapsed"] < STALL_S - 1, rank0


@pytest.mark.usefixtures("hooked_standin")
def test_initialize_states_takes_back_what_it_made_when_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Out of memory (or an interrupt) part-way: no state or scale stays, so the next attempt
    # and TE's step see a fresh optimizer, not one with half its states.
    from te_ckpt_placement import _te_load as te_load

    from .support.faults import nth_call_raises
    from .support.standin import make_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(torch.bfloat16)
    optimizer = make_optimizer(model.parameters(), moments=torch.bfloat16, master="fp32")
    failing = nth_call_raises(5, torch.OutOfMemoryError("injected"), optimizer._initialize_state)
    monkeypatch.setattr(optimizer, "_initialize_state", failing)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        te_load.initialize_states(optimizer)
    assert not optimizer.state and not optimizer._scales
    assert "step" not in optimizer.param_groups[0]
    monkeypatch.undo()
    assert te_load.initialize_states(optimizer)
    assert len(optimizer.state) == 4 and optimizer.param_groups[0]["step"] == 1


# --- resume: the host's threads shared among its ranks --------------------------------------------
