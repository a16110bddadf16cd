"""Hugging Face Trainer with TE FusedAdam: checkpoints and resume stream through host memory.

Needs a CUDA GPU, Transformer Engine (pip install 'transformer-engine[pytorch]') and this package
with its [hf] extra (pip install -e '.[hf]' in the checkout); without one of them it exits saying
which. Run it on one GPU or under DDP:

    python examples/hf_minimal.py [OUTPUT_DIR]
    torchrun --nproc_per_node=2 examples/hf_minimal.py [OUTPUT_DIR]

It trains a small Llama for 4 steps with a checkpoint every 2, then builds a fresh model and
optimizer and resumes from the last checkpoint for 2 more steps. The one change to a plain
Trainer script is `PlacementTrainer` in place of `Trainer`. tests/test_gpu_examples.py runs it.
"""

import os
import sys

import torch

NEEDS = (
    "examples/hf_minimal.py needs a CUDA GPU, Transformer Engine "
    "(pip install 'transformer-engine[pytorch]') and this package with its [hf] extra "
    "(pip install -e '.[hf]')"
)
try:
    from transformer_engine.pytorch.optimizers import FusedAdam
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from te_ckpt_placement.integrations.hf import PlacementTrainer
except ImportError as exc:
    sys.exit(f"{NEEDS}; here: {exc}")
if not torch.cuda.is_available():
    sys.exit(f"{NEEDS}; here torch {torch.__version__} sees no CUDA GPU")

OUTPUT_DIR = sys.argv[1] if len(sys.argv) > 1 else "hf_minimal_out"
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 1024, (64,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def build(max_steps: int) -> PlacementTrainer:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    # TE's optimizer needs the parameters on the GPU when it is built.
    model = LlamaForCausalLM(config).to(DEVICE, torch.bfloat16)
    optimizer = FusedAdam(
        model.parameters(),
        lr=1e-4,
        master_weights=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        store_param_remainders=True,
    )
    args = TrainingArguments(
        output_dir=OUTPUT_DIR,
        max_steps=max_steps,
        save_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        logging_steps=1,
    )
    return PlacementTrainer(  # a transformers.Trainer
        model=model, args=args, train_dataset=RandomTokens(), optimizers=(optimizer, None)
    )


build(max_steps=4).train()  # checkpoints at steps 2 and 4 stream to host memory
resumed = build(max_steps=6)
resumed.train(resume_from_checkpoint=True)  # the resume streams too
if resumed.args.process_index == 0:
    print(f"hf_minimal: resumed and trained to step {resumed.state.global_step}", flush=True)
