"""End to end DCP save, async save and load of TE FusedAdam under FSDP2 on 2 GPUs.

For each operation it compares the path users run today with the policy:

- ``dcp_save``: ``get_optimizer_state_dict`` + ``dcp.save`` of ``{"model", "optim"}``.
  ``te_default`` uses ``StateDictOptions(cpu_offload=True)`` (TE builds every FP32 copy on the GPU,
  then DCP offloads); ``placement_cpu`` runs the same inside ``export_placement("cpu")``.
- ``dcp_async_save``: the same dict through ``dcp.async_save`` on a ``cpu:gloo,cuda:nccl`` group.
  ``te_default`` and ``placement_cpu`` use DCP's default stager (it copies every tensor again,
  CPU ones included); ``placement_cpu_passthrough_stager`` passes the export's tensors through
  ``te_ckpt_placement.PassThroughStager`` and stages only the model weights.
- ``full_state_dict``: ``get_optimizer_state_dict`` with ``full_state_dict=True`` and
  ``cpu_offload=True`` (every state all-gathered to rank 0's host), without and with the policy;
  the two results must be equal bit for bit. ``largest_state_bytes`` is one global FP32 state,
  the unit the policy's GPU peak is bounded by.
- ``dcp_load``: the usual template (``get_optimizer_state_dict``), ``dcp.load``, then
  ``set_model_state_dict`` + ``set_optimizer_state_dict``; ``te_default`` without a policy (TE's
  load casts every state onto the GPU at once), ``placement_cpu`` inside the policy.
  ``placement_cpu_streaming`` has no template: ``dcp.load`` of a ``PlacedOptimizerState`` with
  ``planner=StreamingLoadPlanner(state)`` reads every item straight into the live states
  (:func:`streaming_load`).

Every checkpoint is read back and compared bit for bit with an export first checked against
TE's own ``get_unscaled_state``, and every load must leave the optimizer exactly as it was when
the checkpoint was written; numbers are kept only after that. ``seconds`` is the time the training
loop is blocked (for ``dcp_async_save``: until ``async_save`` returns, i.e. export plus staging);
``seconds_total`` includes the background write. ``peak_extra_gpu_bytes`` is
``torch.cuda.max_memory_allocated`` above the start, ``peak_extra_host_bytes`` the peak RSS growth
(sampled every millisecond) until the write has finished.

Usage (from the repository root, on a machine with 2 GPUs and Transformer Engine):
    torchrun --nproc_per_node=2 benchmarks/dcp_e2e.py --out FILE.json
    python benchmarks/dcp_e2e.py --out FILE.json        # spawns the 2 ranks itself

Without 2 CUDA GPUs and Transformer Engine it says what it needs and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
MOMENTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "fp32": torch.float32}
OPS = ("dcp_save", "dcp_async_save", "dcp_load", "full_state_dict")
MODES = {
    "dcp_save": ("te_default", "placement_cpu"),
    "full_state_dict": ("te_default", "placement_cpu"),
    "dcp_async_save": ("te_default", "placement_cpu", "placement_cpu_passthrough_stager"),
    # placement_cpu_streaming before placement_cpu: its host peak is measured from a heap that
    # has not just held the template path's host template.
    "dcp_load": ("te_default", "placement_cpu_streaming", "placement_cpu"),
}
# (layers, hidden): bf16 Linear(hidden, hidden) layers without bias, fully_shard'ed per layer.
SIZES = {"small": (4, 4096), "default": (16, 8192), "large": (32, 8192)}


def _ensure_root_on_path() -> None:
    # Run as a script (python or torchrun), sys.path[0] is benchmarks/, not the repository root.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def _measured(result: dict[str, Any]) -> Any:
    _ensure_root_on_path()
    from benchmarks.export_memory import measured

    return measured(result)


def requirements_missing() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch {torch.__version__}"
    if torch.cuda.device_count() < WORLD:
        return f"it needs {WORLD} CUDA GPUs, torch sees {torch.cuda.device_count()}"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:
        return f"Transformer Engine for PyTorch does not import ({type(exc).__name__}: {exc})"
    return None


# --- model, optimizer and comparisons -----------------------------------------------------------
def build(
    layers: int, hidden: int, moments: torch.dtype, seed: int, *, remainders: bool = True
) -> tuple[Any, Any]:
    """A fully_shard'ed stack of bf16 Linear layers and a TE FusedAdam that has stepped twice.

    FP32 masters are kept as int16 remainders for BF16 moments, unless ``remainders=False``.
    """
    from torch.distributed.fsdp import fully_shard
    from transformer_engine.pytorch.optimizers import FusedAdam

    torch.manual_seed(seed)  # the same full weights on every rank; fully_shard keeps its shard
    model = torch.nn.Sequential(
        *[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]
    ).to(device="cuda", dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = FusedAdam(
        model.parameters(),
        lr=1e-4,
        master_weights=True,
        store_param_remainders=remainders and moments == torch.bfloat16,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
    )
    for _ in range(2):
        train_step(model, opt, hidden)
    return model, opt


def train_step(model: Any, opt: Any, hidden: int) -> None:
    x = torch.randn(8, hidden, device="cuda", dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def host_bits(t: Any) -> torch.Tensor:
    return local(t).detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)


def verify_against_te(export: dict[str, Any], model: Any, opt: Any) -> None:
    """The flattened export equals TE's ``get_unscaled_state`` state by state, all on the CPU."""
    by_fqn = dict(model.named_parameters())
    count = 0
    devices = set()
    for key, value in export.items():
        if not key.startswith("state."):
            continue
        fqn, name = key[len("state.") :].rsplit(".", 1)
        ref = opt.get_unscaled_state(by_fqn[fqn], name)
        ours = local(value)
        devices.add(ours.device.type)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, key
        assert torch.equal(
            ours.to(ref.device).reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)
        ), f"export of {key} differs from TE's get_unscaled_state"
        count += 1
        del ref
    assert count == len(by_fqn) * len(opt.state[next(iter(by_fqn.values()))]), count
    assert devices == {"cpu"}, f"export on {devices}: all states of an export on one device"


def assert_same_bits(ours: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    assert ours.keys() == ref.keys(), f"{where}: keys differ"
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(host_bits(ours[key]), value), f"{where}: {key} differs"
        else:
            assert ours[key] == value, f"{where}: {key}: {ours[key]!r} != {value!r}"


def fingerprint(model: Any, opt: Any) -> dict[str, Any]:
    """Host bytes of every param, stored optimizer state, scale and param_group entry."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = host_bits(p).clone()
    names = {p: n for n, p in model.named_parameters()}
    for p, states in opt.state.items():
        for state, value in states.items():
            stored = local(value)
            stored = getattr(stored, "_data", stored)
            out[f"state.{names[p]}.{state}"] = host_bits(stored).clone()
        for state, scale in opt._scales.get(p, {}).items():
            out[f"scale.{names[p]}.{state}"] = host_bits(scale).clone()
    for i, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if k != "params":
                out[f"group.{i}.{k}"] = float(v) if isinstance(v, torch.Tensor) else v
    return out


@torch.no_grad()
def blank(tree: Any) -> None:
    """Overwrites a load template, so that a load that skips a tensor cannot pass verification."""
    for t in tensors(tree):
        loc = local(t)
        loc.fill_(float("nan") if loc.is_floating_point() else -7)


# --- measurement --------------------------------------------------------------------------------
def counting_pass_through() -> Any:
    """A PassThroughStager that counts the exported tensors it handed on without a copy."""
    from te_ckpt_placement import PassThroughStager
    from te_ckpt_placement.engine import is_exported

    class Counting(PassThroughStager):
        passed = 0
        exported = 0

        def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
            staged = super().stage(state_dict, **kwargs)
            result = staged.result() if hasattr(staged, "result") else staged
            for key, value in state_dict["optim"].items():
                if is_exported(value):
                    self.exported += 1
                    self.passed += result["optim"][key] is value
            return staged

    return Counting()


def streaming_load(model: Any, opt: Any, path: str) -> dict[str, Any]:
    """The ``placement_cpu_streaming`` load of the model and optimizer at ``path``.

    Returns what the planner reports (assembly buffers, fallbacks) and the versions it ran on.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from te_ckpt_placement.dcp import PlacedOptimizerState, StreamingLoadPlanner
    from te_ckpt_placement.te_contract import te_version

    adapter = PlacedOptimizerState(model, opt)
    state = {"model": get_model_state_dict(model), "optim": adapter}
    planner = StreamingLoadPlanner(adapter)
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_model_state_dict(model, state["model"])
    return {
        "peak_assembly_bytes": planner.peak_assembly_bytes,
        "fallbacks": planner.fallbacks,
        "versions": {"torch": torch.__version__, "transformer_engine": te_version()},
    }


def wait(response: Any) -> None:
    # torch 2.13 returns AsyncSaveResponse when staging is asynchronous, else a Future (2.11 too).
    if hasattr(response, "upload_completion"):
        response.staging_completion.result()
        response.upload_completion.result()
    else:
        response.result()


def run_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from te_ckpt_placement import export_placement, install, release_buffers

    rank = dist.get_rank()
    install()
    layers, hidden = SIZES[args.size]
    moments = MOMENTS[args.moments]
    model, opt = build(layers, hidden, moments, seed=0)
    n_local = sum(local(p).numel() for p in model.parameters())
    m_local = max(local(p).numel() for p in model.parameters())
    async_pg = dist.new_group(backend="gloo")  # the background write's collectives, apart
    placed = StateDictOptions(flatten_optimizer_state_dict=True)
    today = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
    root = Path(args.dir)

    def checkpoint_dir(name: str) -> str:
        path = root / name
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return str(path)

    def cleanup(path: str) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        release_buffers()
        gc.collect()
        torch.cuda.empty_cache()
        dist.barrier()

    # The reference: the policy's export, checked against TE's own conversion, and the weights.
    with export_placement("cpu"):
        reference_export = get_optimizer_state_dict(model, opt, options=placed)
    verify_against_te(reference_export, model, opt)
    reference = {f"optim.{k}": host_bits(v).clone() if isinstance(v, torch.Tensor) else v
                 for k, v in reference_export.items()}  # fmt: skip
    reference.update(
        {f"model.{k}": host_bits(v).clone() for k, v in get_model_state_dict(model).items()}
    )
    del reference_export
    before = fingerprint(model, opt)

    def read_back(path: str, where: str) -> None:
        """The checkpoint at ``path`` holds the reference bits (read into a host template)."""
        with export_placement("cpu"):
            template = get_optimizer_state_dict(model, opt, options=placed)
        # Host copies of the sharded weights (CPU-local DTensors on the CUDA mesh) as targets.
        model_template = {k: v.to("cpu") for k, v in get_model_state_dict(model).items()}
        state = {"model": model_template, "optim": template}
        blank(state)
        dcp.load(state, checkpoint_id=path)
        flat = {f"optim.{k}": v for k, v in state["optim"].items()}
        flat.update({f"model.{k}": v for k, v in state["model"].items()})
        assert_same_bits(flat, reference, where)
        del state, flat, template, model_template

    base = {
        "moments": args.moments,
        "masters": "remainder" if moments == torch.bfloat16 else "fp32",
        "n_elements": n_local,
        "max_elements": m_local,
        "rank": rank,
        "world_size": WORLD,
        "parallelism": "fsdp2",
        "layers": layers,
        "hidden": hidden,
    }
    records: list[dict[str, Any]] = []

    def keep(op: str, mode: str, result: dict[str, Any], **extra: Any) -> None:
        rec = {"op": op, "mode": mode, **base, **result, **extra}
        rec["gpu_bytes_per_n"] = rec["peak_extra_gpu_bytes"] / n_local
        rec["host_bytes_per_n"] = rec["peak_extra_host_bytes"] / n_local
        records.append(rec)
        if args.out is not None:  # per rank, after each measurement: a cut-off run keeps them
            Path(f"{args.out}.rank{rank}").write_text(json.dumps(records, indent=1) + "\n")
        if rank == 0:
            print(
                f"{op:<15} {mode:<33} GPU {rec['peak_extra_gpu_bytes'] / 2**30:7.2f} GiB "
                f"({rec['gpu_bytes_per_n']:5.2f} B/N)  "
                f"host {rec['peak_extra_host_bytes'] / 2**30:7.2f} GiB  "
                f"{rec['seconds']:7.2f} s  (total {rec['seconds_total']:.2f} s)",
                flush=True,
            )

    # Warm-up: DCP's writer threads and file system set-up are not charged to the first mode.
    warm = checkpoint_dir("warmup")
    dcp.save({"x": torch.ones(4)}, checkpoint_id=warm)
    cleanup(warm)

    ops = [op for op in args.ops.split(",") if op]
    if "dcp_save" in ops:
        for mode in MODES["dcp_save"]:
            path = checkpoint_dir(f"save_{mode}")
            result: dict[str, Any] = {}
            with _measured(result):
                policy = (
                    export_placement("cpu") if mode == "placement_cpu" else contextlib.nullcontext()
                )
                with policy:
                    optim = get_optimizer_state_dict(
                        model, opt, options=placed if mode == "placement_cpu" else today
                    )
                dcp.save({"model": get_model_state_dict(model), "optim": optim}, checkpoint_id=path)
                del optim
            read_back(path, f"dcp_save {mode}")  # before the numbers are kept
            keep("dcp_save", mode, result, cpu_offload=mode == "te_default")
            cleanup(path)

    if "dcp_async_save" in ops:
        for mode in MODES["dcp_async_save"]:
            path = checkpoint_dir(f"async_{mode}")
            stager = counting_pass_through() if mode.endswith("passthrough_stager") else None
            result = {}
            with _measured(result):
                policy = (
                    export_placement("cpu") if mode != "te_default" else contextlib.nullcontext()
                )
                with policy:
                    optim = get_optimizer_state_dict(
                        model, opt, options=today if mode == "te_default" else placed
                    )
                response = dcp.async_save(
                    {"model": get_model_state_dict(model), "optim": optim},
                    checkpoint_id=path,
                    process_group=async_pg,
                    async_stager=stager,
                )
                del optim
                if hasattr(response, "staging_completion"):
                    response.staging_completion.result()
                result["seconds"] = time.perf_counter() - result["_start"]
                wait(response)
            extra: dict[str, Any] = {"cpu_offload": mode == "te_default"}
            if stager is not None:
                stager.close()
                assert stager.exported > 0 and stager.passed == stager.exported, (
                    f"PassThroughStager copied {stager.exported - stager.passed} exports"
                )
                extra["exports_passed_through"] = stager.passed
            read_back(path, f"dcp_async_save {mode}")
            keep("dcp_async_save", mode, result, **extra)
            cleanup(path)

    if "dcp_load" in ops:
        path = checkpoint_dir("load_source")
        with export_placement("cpu"):
            optim = get_optimizer_state_dict(model, opt, options=placed)
        dcp.save({"model": get_model_state_dict(model), "optim": optim}, checkpoint_id=path)
        del optim
        read_back(path, "dcp_load source")
        loaded: dict[str, dict[str, Any]] = {}
        for mode in MODES["dcp_load"]:  # te_default first: the reference of FP16/FP8 loads
            train_step(model, opt, hidden)  # the load has to undo this step
            assert fingerprint(model, opt).keys() == before.keys()
            result = {}
            extra = {}
            with _measured(result):
                if mode == "placement_cpu_streaming":
                    extra = streaming_load(model, opt, path)
                else:
                    policy = (
                        export_placement("cpu")
                        if mode == "placement_cpu"
                        else contextlib.nullcontext()
                    )
                    with policy:
                        state = {
                            "model": get_model_state_dict(model),
                            "optim": get_optimizer_state_dict(model, opt, options=placed),
                        }
                        dcp.load(state, checkpoint_id=path)
                        set_model_state_dict(model, state["model"])
                        set_optimizer_state_dict(model, opt, state["optim"], options=placed)
                    del state
            loaded[mode] = fingerprint(model, opt)
            # BF16/FP32 states load back exactly as saved. FP16/FP8 ones are rescaled by TE's
            # own load, so for them the policy's load must equal TE's load instead.
            expected = before if args.moments in ("bf16", "fp32") else loaded["te_default"]
            for key, value in expected.items():
                got = loaded[mode][key]
                same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
                assert same, f"dcp_load {mode}: {key} differs from the expected state"
            keep("dcp_load", mode, result, **extra)
        cleanup(path)

    if "full_state_dict" in ops:
        # DCP all-gathers each state onto rank 0's host. Under the policy each CPU-local shard
        # goes back to the GPU for its all-gather, one state at a time.
        full = StateDictOptions(
            full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
        )
        # NCCL cannot all-gather int16, so DCP's full gather of int16 master remainders fails
        # with or without the policy ("Input tensor data type is not supported for NCCL process
        # group: Short", seen on 2xH200 with TE's own export first). FP32 masters here.
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
        model, opt = build(layers, hidden, moments, seed=0, remainders=False)
        base = {**base, "masters": "fp32"}
        largest = max(p.numel() for p in model.parameters()) * 4  # one global FP32 state
        te_full: dict[str, Any] = {}
        for mode in MODES["full_state_dict"]:
            result = {}
            with _measured(result):
                policy = (
                    export_placement("cpu") if mode == "placement_cpu" else contextlib.nullcontext()
                )
                with policy:
                    gathered = get_optimizer_state_dict(model, opt, options=full)
            if rank != 0:
                assert gathered == {}, f"full_state_dict {mode}: rank {rank} kept a state dict"
            elif mode == "te_default":
                te_full = gathered
            else:  # rank 0: the policy's gathered dict is TE's, bit for bit
                assert gathered.keys() == te_full.keys(), "full_state_dict: keys differ"
                for key, value in te_full.items():
                    if isinstance(value, torch.Tensor):
                        assert local(gathered[key]).device.type == "cpu", key
                        assert torch.equal(host_bits(gathered[key]), host_bits(value)), key
                    else:
                        assert gathered[key] == value, key
            del gathered
            keep("full_state_dict", mode, result, cpu_offload=True, largest_state_bytes=largest)
            gc.collect()
        del te_full
    return records


def _worker() -> None:
    import torch.distributed as dist

    args = parse(sys.argv[1:])
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    torch.cuda.set_device(local_rank)
    # async_save needs a CPU backend next to NCCL.
    dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(minutes=30))
    try:
        assert dist.get_world_size() == WORLD, f"run with {WORLD} ranks"
        records = run_rank(args)
        gathered: list[Any] = [None] * WORLD
        dist.gather_object(records, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() == 0:
            from benchmarks.export_memory import machine

            out = {"machine": machine(), "records": [r for rank in gathered for r in rank]}
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(out, indent=1) + "\n")
                print(f"wrote {args.out}", flush=True)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.argv = [sys.argv[0], *argv]
    _ensure_root_on_path()
    _worker()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: none)")
    parser.add_argument("--size", choices=tuple(SIZES), default="default")
    parser.add_argument("--moments", choices=tuple(MOMENTS), default="bf16")
    parser.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated subset of " + ", ".join(OPS)
    )
    parser.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "dcp_e2e"),
        help="where checkpoints are written (each is deleted after it is checked)",
    )
    args = parser.parse_args(argv)
    for op in args.ops.split(","):
        if op and op not in OPS:
            parser.error(f"unknown op {op!r}; valid: {', '.join(OPS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parse(argv)  # --help and bad options answer before anything else
    missing = requirements_missing()
    if missing:
        print(
            "This benchmark measures DCP save, async_save and load of real Transformer Engine\n"
            f"FusedAdam state under FSDP2 on {WORLD} NVIDIA GPUs. It cannot run here: {missing}.\n"
            f"It needs: {WORLD} CUDA GPUs, torch with CUDA and NCCL, and Transformer Engine "
            "(pip install 'transformer-engine[pytorch]').\n"
            "The CPU test suite runs anywhere: python -m pytest -q tests/test_dcp.py",
            file=sys.stderr,
        )
        return 2
    _ensure_root_on_path()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        _worker()
        return 0
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_spawned, args=(port, argv), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
