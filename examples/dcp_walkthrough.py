"""DCP walkthrough: save and load a TE FusedAdam optimizer under FSDP2 with 0 extra GPU bytes.

Needs 2 CUDA GPUs, Transformer Engine (pip install 'transformer-engine[pytorch]') and this
package (pip install -e . in the checkout), and runs under torchrun; without one of them it exits
saying which:

    torchrun --nproc_per_node=2 examples/dcp_walkthrough.py [CHECKPOINT_DIR]

It saves and loads synchronously, saves asynchronously with PassThroughStager, does both through
the PlacedOptimizerState adapter, and finally checks that the optimizer and weights it loaded last
equal the ones it saved. docs/dcp.md explains each step; tests/test_gpu_dcp.py runs this file.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

NEEDS = (
    "examples/dcp_walkthrough.py needs 2 CUDA GPUs, Transformer Engine "
    "(pip install 'transformer-engine[pytorch]') and this package (pip install -e .), "
    "and runs as: torchrun --nproc_per_node=2 examples/dcp_walkthrough.py [CHECKPOINT_DIR]"
)
try:
    from transformer_engine.pytorch.optimizers import FusedAdam

    from te_ckpt_placement import export_placement
    from te_ckpt_placement.dcp import PassThroughStager, PlacedOptimizerState
except ImportError as exc:
    sys.exit(f"{NEEDS}; here: {exc}")
if not torch.cuda.is_available():
    sys.exit(f"{NEEDS}; here torch {torch.__version__} sees no CUDA GPU")
if "LOCAL_RANK" not in os.environ:
    sys.exit(f"{NEEDS}; here it was not started by torchrun (no LOCAL_RANK)")

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else "ckpt")

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("cpu:gloo,cuda:nccl")  # dcp.async_save needs a CPU backend
# The background write runs collectives while training runs its own: give it a group of its own.
CKPT_GROUP = dist.new_group(backend="gloo")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def build() -> tuple[torch.nn.Module, FusedAdam]:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    model = model.to("cuda", torch.bfloat16)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = FusedAdam(
        model.parameters(),
        lr=1e-4,
        master_weights=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    return model, optimizer


def train(model: torch.nn.Module, optimizer: FusedAdam, steps: int = 2) -> None:
    for _ in range(steps):
        x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


model, optimizer = build()
train(model, optimizer)

# 1. Save: the export streams to host memory (0 extra GPU bytes), then DCP writes it.
with export_placement("cpu"):
    optim = get_optimizer_state_dict(model, optimizer, options=OPTIONS)
dcp.save({"model": get_model_state_dict(model), "optim": optim}, checkpoint_id=ROOT / "sync")
del optim

# 2. Load into a fresh model and optimizer: the template, the read and the load all run under the
#    policy, so the template is on the host and the load goes one state at a time.
model2, optimizer2 = build()
with export_placement("cpu"):
    state = {
        "model": get_model_state_dict(model2),
        "optim": get_optimizer_state_dict(model2, optimizer2, options=OPTIONS),
    }
    dcp.load(state, checkpoint_id=ROOT / "sync")
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, optimizer2, state["optim"], options=OPTIONS)
del state

# 3. Async save: PassThroughStager hands the export's tensors to the writer without a second copy
#    and stages only the rest (here the model weights, copied off the GPU before training goes on).
stager = PassThroughStager()
with export_placement("cpu"):
    optim = get_optimizer_state_dict(model, optimizer, options=OPTIONS)
pending = dcp.async_save(
    {"model": get_model_state_dict(model), "optim": optim},
    checkpoint_id=ROOT / "async",
    process_group=CKPT_GROUP,
    async_stager=stager,
)
del optim
train(model, optimizer)  # training goes on while the checkpoint is written
pending.result()  # wait for the write before the next save
stager.close()  # after the last save

# 4. The Stateful adapter: dcp.save / dcp.load call its state_dict() / load_state_dict() under the
#    policy (export_placement("cpu") by default), for sync and async saves alike.
optim_state = PlacedOptimizerState(model, optimizer)
dcp.save(
    {"model": get_model_state_dict(model), "optim": optim_state}, checkpoint_id=ROOT / "stateful"
)
stager = PassThroughStager()
pending = dcp.async_save(
    {"model": get_model_state_dict(model), "optim": optim_state},
    checkpoint_id=ROOT / "stateful_async",
    process_group=CKPT_GROUP,
    async_stager=stager,
)
pending.result()
stager.close()

model3, optimizer3 = build()
state = {"model": get_model_state_dict(model3), "optim": PlacedOptimizerState(model3, optimizer3)}
dcp.load(state, checkpoint_id=ROOT / "stateful_async")  # also loads the optimizer
set_model_state_dict(model3, state["model"])

# 5. Check: the optimizer and weights loaded last are the ones saved, bit for bit.
with export_placement("cpu"):
    expected = get_optimizer_state_dict(model, optimizer, options=OPTIONS)
    loaded = get_optimizer_state_dict(model3, optimizer3, options=OPTIONS)
assert expected.keys() == loaded.keys(), "loaded optimizer state has other keys"
for key, value in expected.items():
    if isinstance(value, torch.Tensor):
        a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (value, loaded[key]))
        same_bits = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        assert a.dtype == b.dtype and same_bits, key
    else:
        assert value == loaded[key], key
for (name, p), q in zip(model.named_parameters(), model3.parameters(), strict=True):
    assert torch.equal(p.full_tensor(), q.full_tensor()), name
print(f"dcp_walkthrough: rank {dist.get_rank()} loaded exactly what it saved", flush=True)

dist.destroy_process_group()
