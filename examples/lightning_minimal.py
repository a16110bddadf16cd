"""Lightning Trainer with TE FusedAdam: checkpoints and resume stream through host memory.

Needs a CUDA GPU, Transformer Engine (pip install 'transformer-engine[pytorch]') and this package
with its [lightning] extra (pip install -e '.[lightning]' in the checkout); without one of them it
exits saying which. Run it with

    python examples/lightning_minimal.py [CHECKPOINT_DIR] [DEVICES]

DEVICES (default 1) greater than 1 runs DDP. It trains for 4 steps with a checkpoint every 2,
then resumes from the last checkpoint in a new Trainer for 2 more steps. The one change to a plain
Lightning script is `PlacementCallback()` in the callbacks. tests/test_gpu_examples.py runs it.
"""

import sys

import torch

NEEDS = (
    "examples/lightning_minimal.py needs a CUDA GPU, Transformer Engine "
    "(pip install 'transformer-engine[pytorch]') and this package with its [lightning] extra "
    "(pip install -e '.[lightning]')"
)
try:
    import lightning as L  # noqa: N812 - Lightning's own spelling
    from lightning.pytorch.callbacks import ModelCheckpoint
    from transformer_engine.pytorch.optimizers import FusedAdam

    from te_ckpt_placement.integrations.lightning import PlacementCallback
except ImportError as exc:
    sys.exit(f"{NEEDS}; here: {exc}")
if not torch.cuda.is_available():
    sys.exit(f"{NEEDS}; here torch {torch.__version__} sees no CUDA GPU")

CKPT_DIR = sys.argv[1] if len(sys.argv) > 1 else "lightning_minimal_ckpt"
DEVICES = int(sys.argv[2]) if len(sys.argv) > 2 else 1


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 1))
        self.net.to(torch.bfloat16)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> FusedAdam:
        # Lightning has moved the model to the GPU by now, as TE's optimizer needs.
        return FusedAdam(
            self.parameters(),
            lr=1e-3,
            master_weights=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
        )


def data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=gen).to(torch.bfloat16)
    return torch.utils.data.DataLoader(
        list(zip(x, torch.randn(64, 1, generator=gen), strict=True)), 8
    )


def trainer(max_steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="gpu",
        devices=DEVICES,
        max_steps=max_steps,
        callbacks=[
            PlacementCallback(),  # the one-line change
            ModelCheckpoint(dirpath=CKPT_DIR, every_n_train_steps=2, save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


torch.manual_seed(0)
trainer(max_steps=4).fit(Regressor(), data())  # checkpoints stream to host memory
resumed = trainer(max_steps=6)
resumed.fit(Regressor(), data(), ckpt_path="last")  # the resume streams too
if resumed.global_rank == 0:
    print(f"lightning_minimal: resumed and trained to step {resumed.global_step}", flush=True)
