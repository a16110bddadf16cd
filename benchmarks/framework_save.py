"""A framework's own save of TE FusedAdam, one GPU: the way NeMo Automodel and torchtitan save.

Records ``op="framework_save"`` for each ``framework`` x ``async_mode`` x ``mode`` and
``save_index`` 1..``--saves``:

- ``framework="automodel"``: ``dcp.async_save(..., async_stager=DefaultStager(),
  async_checkpointer_type=PROCESS)``, the stager closed after every save (Automodel 0.7.0
  ``_do_save``); ``framework="torchtitan"``: PROCESS with one
  ``DefaultStager(StagingOptions(True, True, True, True))`` kept for the run
  (``async_with_pinned_mem``); ``async_mode="sync"``: ``dcp.save``.
- ``mode``: ``te_default`` (TE's export, no policy), ``placement_cpu`` (the export under
  ``export_placement("cpu")``, ``PlacedOptimizerState``), and the bounded paths: ``snapshot``
  (``PlacedOptimizerState(save="streaming")`` staged by one ``SnapshotStager`` for the run,
  written by ``StreamingWriter`` in DCP's writer process, ``async_mode`` process and thread),
  ``snapshot_prewarmed`` (the same on PROCESS, with a stager of its own made at setup by
  ``SnapshotStager.prewarm``, outside the record: ``prewarm_bytes`` says what it kept) and
  ``streaming`` (the same, ``dcp.save``, sync).

Each record: ``peak_extra_gpu_bytes`` (this process's CUDA allocator peak over the save),
``peak_extra_host_bytes`` (the PSS of this process and its children, DCP's writer process
included, sampled every 5 ms from the save's start to its completion, above the start; shared
memory counted once), ``blocked_seconds`` (from building the state dict until ``dcp.async_save``
returns, or the whole ``dcp.save``), ``raw_bytes`` (stored optimizer bytes and scales plus the
weights), ``bound_seconds`` (``raw_bytes`` over the measured pinned device-to-host bandwidth),
``equals_te_export`` (the checkpoint, read back, against TE's export at the save point, while
training stepped in between). Run as ``torchrun --nproc_per_node=1 benchmarks/framework_save.py``
(``OMP_NUM_THREADS=1``, torchrun's default) or standalone; ``--cpu-smoke`` runs the CPU stand-in
of TE at a tiny size.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import dcp_e2e as e2e  # noqa: E402

GIB = 1 << 30
MODES = ("te_default", "placement_cpu", "snapshot", "snapshot_prewarmed", "streaming")


# --- host memory of this process and its children -----------------------------------------------
def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss() -> int:
    """PSS of this process and all its descendants: shared pages split among their mappers."""
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += _pss(pid)
        todo += _children(pid)
    return total


class TreePeak:
    """Samples :func:`tree_pss` in a thread until stopped."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s, self.peak, self.base = period_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss())
            self._stop.wait(self.period_s)

    def __enter__(self) -> TreePeak:
        self.base = self.peak = tree_pss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_pss())


# --- one save -------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.args = args
        layers = max(1, round(args.elements / args.hidden**2))
        self.model, self.opt = e2e.build(layers, args.hidden, torch.bfloat16, seed=0)
        self.elements = sum(e2e.local(p).numel() for p in self.model.parameters())
        self.async_pg = dist.new_group(backend="gloo")
        self.root = Path(args.root or tempfile.mkdtemp(prefix="framework_save_"))
        self.bandwidth = e2e.d2h_bytes_per_s()
        self.snapshot_stager: Any = None
        self.prewarmed_stager: Any = None
        self.prewarm_bytes = 0
        self.titan_stager: Any = None
        self.records: list[dict[str, Any]] = []

    def raw_bytes(self) -> int:
        return e2e.optimizer_raw_bytes(self.opt) + e2e.model_raw_bytes(self.model)

    def default_stager(self, pinned: bool) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if e2e.SMOKE:  # no accelerator: pinned memory and non-blocking copies are refused
            return DefaultStager(StagingOptions(False, True, False, False))
        return DefaultStager(StagingOptions(True, True, True, True)) if pinned else DefaultStager()

    def state(self, mode: str) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement
        from te_ckpt_placement.dcp import PlacedOptimizerState

        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        model = get_model_state_dict(self.model)
        if mode == "te_default":
            with export_placement(None):
                optim: Any = get_optimizer_state_dict(self.model, self.opt, options=flat)
        elif mode == "placement_cpu":
            optim = PlacedOptimizerState(self.model, self.opt, options=flat)
        else:
            optim = PlacedOptimizerState(self.model, self.opt, options=flat, save="streaming")
        return {"model": model, "optim": optim}

    def reference(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        with export_placement(None):
            te = get_optimizer_state_dict(
                self.model, self.opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
        return {k: e2e.host_bits(v).clone() for k, v in te.items() if isinstance(v, torch.Tensor)}

    def equals(self, path: Path, ref: dict[str, torch.Tensor]) -> bool:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        from te_ckpt_placement import export_placement

        with export_placement("cpu"):
            template = get_optimizer_state_dict(
                self.model, self.opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
        dcp.load({"optim": template}, checkpoint_id=str(path))
        same = all(torch.equal(e2e.host_bits(template[k]), v) for k, v in ref.items())
        del template
        gc.collect()
        return same

    def save(self, framework: str, async_mode: str, mode: str, index: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        from te_ckpt_placement import _workers
        from te_ckpt_placement.dcp import SnapshotStager, StreamingWriter

        threads = self.args.writer_threads
        path = self.root / f"{framework}_{async_mode}_{mode}_{index}"
        # TE's export at the save point, to compare the files with: every bounded save, and the
        # first of the others (--verify-all: every save).
        verify = self.args.verify and (
            self.args.verify_all
            or mode in ("snapshot", "snapshot_prewarmed", "streaming")
            or index == 1
        )
        ref = self.reference() if verify else None
        e2e.synchronize()
        gc.collect()
        cuda = not e2e.SMOKE
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            gpu_base = torch.cuda.memory_allocated()
        bounded = mode in ("snapshot", "snapshot_prewarmed", "streaming")
        writer: Any = (
            StreamingWriter(path, thread_count=threads)
            if bounded
            else dcp.FileSystemWriter(path, thread_count=threads)
        )
        stager: Any = None
        if async_mode != "sync":
            if mode == "snapshot_prewarmed":
                if self.prewarmed_stager is None:  # at setup, outside the record
                    self.prewarmed_stager = SnapshotStager()
                    self.prewarm_bytes = self.prewarmed_stager.prewarm(self.state(mode))
                    e2e.synchronize()
                    gc.collect()
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                        gpu_base = torch.cuda.memory_allocated()
                stager = self.prewarmed_stager
            elif bounded:
                if self.snapshot_stager is None:
                    self.snapshot_stager = SnapshotStager()
                stager = self.snapshot_stager
            elif framework == "torchtitan":
                if self.titan_stager is None:
                    self.titan_stager = self.default_stager(pinned=True)
                stager = self.titan_stager
            else:
                stager = self.default_stager(pinned=False)  # a fresh one per save, as Automodel
        kind = (
            AsyncCheckpointerType.PROCESS
            if async_mode == "process"
            else AsyncCheckpointerType.THREAD
        )
        with TreePeak() as host:
            start = time.perf_counter()
            state = self.state(mode)
            if async_mode == "sync":
                dcp.save(state, storage_writer=writer)
                blocked = time.perf_counter() - start
            else:
                response = dcp.async_save(
                    state,
                    storage_writer=writer,
                    async_stager=stager,
                    async_checkpointer_type=kind,
                    process_group=self.async_pg,
                )
                if hasattr(response, "staging_completion"):
                    response.staging_completion.result()
                blocked = time.perf_counter() - start
                del state
                # The save's GPU bytes: its own phases, not the training step between them.
                gpu_peak = torch.cuda.max_memory_allocated() if cuda else 0
                e2e.train_step(self.model, self.opt, self.args.hidden)  # training goes on
                if cuda:
                    e2e.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    gpu_base_after = torch.cuda.memory_allocated()
                e2e.wait(response)
                if cuda:
                    gpu_peak = max(
                        gpu_peak, gpu_base + torch.cuda.max_memory_allocated() - gpu_base_after
                    )
                if framework == "automodel" and not bounded:
                    stager.close()  # Automodel's _release_async_stager
            seconds = time.perf_counter() - start
        if cuda and async_mode == "sync":
            gpu_peak = torch.cuda.max_memory_allocated()
        gpu = gpu_peak - gpu_base if cuda else 0
        raw = self.raw_bytes()
        record: dict[str, Any] = {
            "op": "framework_save",
            "framework": framework,
            "async_mode": async_mode,
            "mode": mode,
            "save_index": index,
            "elements": self.elements,
            "writer_threads": threads,
            "peak_extra_gpu_bytes": gpu,
            "peak_extra_host_bytes": host.peak - host.base,
            "blocked_seconds": blocked,
            "seconds": seconds,
            "raw_bytes": raw,
            "d2h_bytes_per_s": self.bandwidth,
            "bound_seconds": raw / self.bandwidth,
            "intra_op_threads": torch.get_num_threads(),
            "host_workers": _workers.count(),
            "host_cpus": len(os.sched_getaffinity(0)),
        }
        if mode == "snapshot_prewarmed":
            record["prewarm_bytes"] = self.prewarm_bytes
        if ref is not None:
            record["equals_te_export"] = self.equals(path, ref)
        self.records.append(record)
        print(json.dumps(record), flush=True)
        if not self.args.keep:
            import shutil

            shutil.rmtree(path, ignore_errors=True)

    def warm_up(self) -> None:
        """Starts DCP's writer process (a spawn and a torch import) outside every record."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        e2e.wait(
            dcp.async_save(
                {"x": torch.zeros(1)},
                checkpoint_id=str(self.root / "warm_up"),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                process_group=self.async_pg,
            )
        )

    def run(self) -> None:
        self.warm_up()
        plan = []
        for framework in ("automodel", "torchtitan"):
            for mode in ("te_default", "placement_cpu", "snapshot"):
                plan.append((framework, "process", mode))
        plan += [("automodel", "process", "snapshot_prewarmed")]
        plan += [("torchtitan", "thread", "snapshot")]
        plan += [("none", "sync", m) for m in ("te_default", "placement_cpu", "streaming")]
        wanted = set(self.args.modes.split(","))
        for framework, async_mode, mode in plan:
            if mode not in wanted:
                continue
            for index in range(1, self.args.saves + 1):
                try:
                    self.save(framework, async_mode, mode, index)
                except Exception as exc:  # recorded, and the next row runs
                    record = {
                        "op": "framework_save",
                        "framework": framework,
                        "async_mode": async_mode,
                        "mode": mode,
                        "save_index": index,
                        "error": f"{type(exc).__name__}: {exc}"[:500],
                    }
                    self.records.append(record)
                    print(json.dumps(record), flush=True)
                    break


def targets(records: list[dict[str, Any]], threads: int, max_state_bytes: int) -> list[str]:
    lines = []
    for r in records:
        where = f"{r['framework']} {r['async_mode']} {r['mode']} save {r['save_index']}"
        if "error" in r:
            lines.append(f"{where}: failed: {r['error']}")
            continue
        if r["mode"] in ("snapshot", "snapshot_prewarmed") and r["async_mode"] == "process":
            host_ok = r["peak_extra_host_bytes"] <= r["raw_bytes"] + 1.25 * GIB
            gpu_ok = r["peak_extra_gpu_bytes"] == 0
            first = r["save_index"] == 1 and r["mode"] == "snapshot"  # allocates and pins
            blocked_ok = first or r["blocked_seconds"] <= 1.5 * r["bound_seconds"]
            eq = r.get("equals_te_export", "not verified")
            lines.append(
                f"{where}: GPU +{r['peak_extra_gpu_bytes']} B (target 0: {gpu_ok}); host "
                f"+{r['peak_extra_host_bytes'] / GIB:.2f} GiB (target <= raw + 1.25 GiB = "
                f"{(r['raw_bytes'] + 1.25 * GIB) / GIB:.2f}: {host_ok}); blocked "
                f"{r['blocked_seconds']:.3f} s vs D2H bound {r['bound_seconds']:.3f} s (target "
                f"<= 1.5x{' from save 2' if r['mode'] == 'snapshot' else ''}: {blocked_ok}); "
                f"equals TE's export: {eq}"
            )
        elif r["mode"] == "streaming":
            bound = 1.25 * GIB + (threads + 1) * max_state_bytes
            ok = r["peak_extra_host_bytes"] <= bound
            lines.append(
                f"{where}: host +{r['peak_extra_host_bytes'] / GIB:.2f} GiB (target <= 1.25 GiB "
                f"+ (writer threads + 1) FP32 states = {bound / GIB:.2f}: {ok}); equals TE's "
                f"export: {r.get('equals_te_export', 'not verified')}"
            )
    return lines


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--elements", type=float, default=0.5e9, help="local parameter elements N")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--writer-threads", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--no-verify", dest="verify", action="store_false")
    p.add_argument("--verify-all", action="store_true", help="compare every save, not the first")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--root", default=None, help="checkpoint directory (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the records as JSON")
    p.add_argument("--cpu-smoke", action="store_true", help="the CPU stand-in, tiny N")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = parse(sys.argv[1:] if argv is None else argv)
    e2e.SMOKE = args.cpu_smoke
    if args.cpu_smoke:
        args.elements, args.hidden, args.saves = min(args.elements, 3 * 64 * 64), 64, 2
        from te_ckpt_placement import _te_hooks
        from tests.support.standin import StandInFusedAdam

        _te_hooks.patch_class(StandInFusedAdam)
    else:
        missing = e2e.requirements_missing()
        if missing is not None and "CUDA GPUs" not in missing:
            print(f"framework_save: cannot run: {missing}", file=sys.stderr)
            return 2
        import te_ckpt_placement

        te_ckpt_placement.install()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from tests.support.distributed import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    timeout = datetime.timedelta(minutes=30)
    if args.cpu_smoke:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
    try:
        assert dist.get_world_size() == 1, "one rank: DCP world size 1"
        bench = Bench(args)
        bench.run()
        max_state = max(
            e2e.local(p).numel() * 4 for p in bench.model.parameters()
        )  # one FP32 state of the largest parameter
        lines = targets(bench.records, args.writer_threads, max_state)
        if args.cpu_smoke:
            lines.append(
                "(--cpu-smoke: the CPU stand-in of TE at a tiny N; the paths run, the "
                "bounds are for the GPU run)"
            )
        print("\n".join(lines), flush=True)
        if args.out is not None:
            from benchmarks.export_memory import machine

            info = e2e.smoke_machine() if args.cpu_smoke else machine()
            info["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            out = {"machine": info, "records": bench.records, "targets": lines}
            args.out.write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {args.out}", flush=True)
    finally:
        if bench_stager := getattr(locals().get("bench"), "snapshot_stager", None):
            bench_stager.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
