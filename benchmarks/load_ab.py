"""A/B of the streaming load's staging chunk and host thread count against T*_load.

The load pipeline (``te_ckpt_placement._upload.Uploader``) converts each chunk of the checkpoint on
the host into a pinned staging buffer of ``_ring.CHUNK_BYTES`` while the previous chunk is copied to
the GPU. This times ``load_state_dict`` under ``export_placement("cpu")`` of one host checkpoint
with each staging chunk size and torch thread count, in interleaved rounds, and checks every
load bit for bit against TE's own load of the same checkpoint. T*_load = max(R / B_h2d,
I / B_host_read) with both bandwidths measured in the same run (``export_memory.bandwidths``).

Usage (from the repository root; GPU and TE required, or ``--device cpu`` on the stand-in):
    python benchmarks/load_ab.py --out FILE.json [--sizes 0.5,1] [--chunks 16,64] [--threads 0,16]

A thread count of 0 keeps torch's default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _measure as em
from benchmarks.export_memory import bandwidths, cpu_bandwidths  # (not moved yet)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", default="0.5,1", help="N in G local elements, comma-separated")
    parser.add_argument("--chunks", default="16,64", help="staging chunk sizes in MiB")
    parser.add_argument("--threads", default="0,16", help="torch threads (0: torch's default)")
    parser.add_argument("--rings", default="3", help="staging buffers in the ring (_ring.RING)")
    parser.add_argument("--moments", choices=tuple(em.MOMENTS), default="bf16")
    parser.add_argument("--master", choices=em.MASTERS, default="remainder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time the host conversion alone, the copies alone, and both at once",
    )
    args = parser.parse_args(argv)
    if args.phases and args.device != "cuda":
        parser.error("--phases times host-to-device copies: it needs --device cuda")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: valid values are >= 1")
    return args


def variants(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(chunk MiB, threads, ring) triples, in the order each round runs them."""
    chunks = [int(c) for c in args.chunks.split(",") if c]
    threads = [int(t) for t in args.threads.split(",") if t]
    rings = [int(r) for r in args.rings.split(",") if r]
    if not chunks or min(chunks) < 1 or not threads or min(threads) < 0:
        raise SystemExit("--chunks: MiB >= 1; --threads: >= 0 (0: torch's default)")
    if not rings or min(rings) < 2:
        raise SystemExit("--rings: >= 2 (one buffer fills while another is copied)")
    return [(c, t, r) for c in chunks for t in threads for r in rings]


def set_ring(depth: int) -> None:
    """Sets _ring.RING; stagers are built with RING buffers, so the idle ones are dropped."""
    from te_ckpt_placement import _ring

    if depth != _ring.RING:
        _ring.release_idle()
        _ring.RING = depth


@contextmanager
def stager_method(name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """Inside the block, ``_ring.Ring.<name>`` is ``wrap(<the original method>)``."""
    from te_ckpt_placement import _ring

    real = getattr(_ring.Ring, name)
    setattr(_ring.Ring, name, wrap(real))
    try:
        yield
    finally:
        setattr(_ring.Ring, name, real)


class WaitClock:
    """Adds the time the host spends waiting for staging buffers to ``seconds``, where
    :meth:`timing` wraps ``_ring.Ring.wait`` (a buffer's previous copy to the device)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timing(self, real: Any) -> Any:
        def wait(stager: Any, i: int) -> None:
            start = time.perf_counter()
            real(stager, i)
            self.seconds += time.perf_counter() - start

        return wait


def measure_size(
    n: int, args: argparse.Namespace, bw: dict[str, float], cuda: bool
) -> list[dict[str, Any]]:
    """Every variant's loads of one host checkpoint of N = ``n``, checked against TE's load."""
    from te_ckpt_placement import _ring, export_placement

    m = min(64 * em.MI, n // 8)
    _, opt = em.build(n, m, em.MOMENTS[args.moments], master=args.master, device=args.device)
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    read_bytes = em.checkpoint_bytes(checkpoint)
    written, _ = em.state_bytes(opt)
    bound = em.load_bound(written, read_bytes, bw)
    with export_placement(None):
        _, te = em.timed(lambda: opt.load_state_dict(checkpoint), host="high_water", cuda=cuda)
    reference = em.live_snapshot(opt)
    default_threads, default_chunk, default_ring = (
        torch.get_num_threads(),
        _ring.CHUNK_BYTES,
        _ring.RING,
    )
    records = []
    waited = WaitClock()
    try:
        for round_ in range(args.rounds):
            for chunk_mib, threads, ring in variants(args):
                _ring.CHUNK_BYTES = chunk_mib * em.MI
                set_ring(ring)
                torch.set_num_threads(threads or default_threads)
                waited.seconds = 0.0
                with export_placement("cpu"), stager_method("wait", waited.timing):
                    _, result = em.timed(
                        lambda: opt.load_state_dict(checkpoint), host="high_water", cuda=cuda
                    )
                assert em.same_bits(em.live_snapshot(opt), reference), "differs from TE's load"
                records.append(
                    {
                        "op": "load",
                        "mode": "placement_cpu",
                        "moments": args.moments,
                        "master": args.master,
                        "n_elements": n,
                        "max_elements": m,
                        "round": round_,
                        "chunk_mib": chunk_mib,
                        "torch_threads": torch.get_num_threads(),
                        "ring": ring,
                        "host_wait_seconds": waited.seconds,
                        "read_bytes": read_bytes,
                        "written_bytes": written,
                        "bound_seconds": bound,
                        "te_seconds": te["seconds"],
                        **result,
                        "seconds_over_bound": result["seconds"] / bound,
                    }
                )
                r = records[-1]
                print(
                    f"N={n / em.G:.2f}G round {round_} chunk {chunk_mib:4d} MiB threads "
                    f"{r['torch_threads']:3d} ring {ring}: {r['seconds']:.3f} s = "
                    f"{r['seconds_over_bound']:.2f} x T* ({bound:.3f} s), host waited "
                    f"{waited.seconds:.3f} s",
                    flush=True,
                )
    finally:
        _ring.CHUNK_BYTES = default_chunk
        set_ring(default_ring)
        torch.set_num_threads(default_threads)
    return records


def copy_sizes(opt: Any, checkpoint: dict[str, Any]) -> list[int]:
    """The byte count of every host-to-device copy one placed load issues, in order."""
    from te_ckpt_placement import export_placement

    sizes: list[int] = []

    def counting(real: Any) -> Any:
        def copy_async(stager: Any, i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
            sizes.append(src.numel() * src.element_size())
            real(stager, i, dst, src)

        return copy_async

    with stager_method("copy", counting), export_placement("cpu"):
        opt.load_state_dict(checkpoint)
    return sizes


def measure_phases(n: int, args: argparse.Namespace, bw: dict[str, float]) -> list[dict[str, Any]]:
    """Whether the load's host conversion and its copies overlap, at the default chunk.

    Times, in each round: the placed load (``pipeline``); the same load with every copy dropped
    (``convert_only``: the host work alone); the load's copies alone, replayed from pinned buffers
    into a device buffer (``copy_only``); and that replay queued on its own stream while the
    ``convert_only`` load runs (``both``); and the load with each copy waited for before the
    next conversion (``serial``: no overlap at all). ``both`` near max(convert, copy) means the
    two can share the host; near their sum, that they contend for it. The pipeline is then
    checked bit for bit against TE's load.
    """
    from te_ckpt_placement import _ring, export_placement

    m = min(64 * em.MI, n // 8)
    _, opt = em.build(n, m, em.MOMENTS[args.moments], master=args.master)
    with export_placement("cpu"):
        checkpoint = opt.state_dict()
    written, _ = em.state_bytes(opt)
    bound = em.load_bound(written, em.checkpoint_bytes(checkpoint), bw)
    with export_placement(None):
        opt.load_state_dict(checkpoint)
    reference = em.live_snapshot(opt)
    sizes = copy_sizes(opt, checkpoint)
    chunk = _ring.CHUNK_BYTES
    pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(_ring.RING)]
    target = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def replay() -> None:
        with torch.cuda.stream(stream):
            for i, nbytes in enumerate(sizes):
                target[:nbytes].copy_(pinned[i % _ring.RING][:nbytes], non_blocking=True)

    def load() -> None:
        with export_placement("cpu"):
            opt.load_state_dict(checkpoint)

    def convert_only() -> None:
        with stager_method("copy", lambda real: lambda *a: None):
            load()

    def both() -> None:
        replay()
        convert_only()

    def waiting_after(real: Any) -> Any:
        def copy_async(stager: Any, i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
            real(stager, i, dst, src)
            stager.synchronize()

        return copy_async

    def serial() -> None:
        with stager_method("copy", waiting_after):
            load()

    def clock(fn: Any) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    records = []
    for round_ in range(args.rounds):
        for phase, fn in (
            ("pipeline", load),
            ("convert_only", convert_only),
            ("copy_only", replay),
            ("both", both),
            ("serial", serial),
        ):
            seconds = clock(fn)
            records.append(
                {
                    "op": "load_phase",
                    "phase": phase,
                    "moments": args.moments,
                    "master": args.master,
                    "n_elements": n,
                    "round": round_,
                    "chunk_mib": chunk // em.MI,
                    "torch_threads": torch.get_num_threads(),
                    "copies": len(sizes),
                    "copied_bytes": sum(sizes),
                    "bound_seconds": bound,
                    "seconds": seconds,
                    "seconds_over_bound": seconds / bound,
                }
            )
            print(
                f"N={n / em.G:.2f}G round {round_} {phase:12s}: {seconds:.3f} s = "
                f"{seconds / bound:.2f} x T* ({bound:.3f} s)",
                flush=True,
            )
    load()
    assert em.same_bits(em.live_snapshot(opt), reference), "differs from TE's load"
    return records


def phase_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (N, phase): the median seconds, and over the bound."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["n_elements"], r["phase"]), []).append(r)
    rows = []
    for (n, phase), group in sorted(groups.items()):
        median = statistics.median(r["seconds"] for r in group)
        bound = group[0]["bound_seconds"]
        rows.append(
            {
                "n_elements": n,
                "phase": phase,
                "loads": len(group),
                "median_seconds": median,
                "bound_seconds": bound,
                "median_over_bound": median / bound,
            }
        )
    return rows


def summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (N, chunk, threads, ring): best and median time over the bound, median host wait."""
    groups: dict[tuple[int, int, int, int], list[dict[str, Any]]] = {}
    for r in records:
        key = (r["n_elements"], r["chunk_mib"], r["torch_threads"], r["ring"])
        groups.setdefault(key, []).append(r)
    return [
        {
            "n_elements": n,
            "chunk_mib": c,
            "torch_threads": t,
            "ring": ring,
            "loads": len(v),
            "best_over_bound": min(r["seconds_over_bound"] for r in v),
            "median_over_bound": statistics.median(r["seconds_over_bound"] for r in v),
            "median_host_wait_seconds": statistics.median(r["host_wait_seconds"] for r in v),
        }
        for (n, c, t, ring), v in sorted(groups.items())
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and (missing := em.requirements_missing()):
        print(missing, file=sys.stderr)
        return 2
    bw = bandwidths() if cuda else cpu_bandwidths()
    sizes = [
        int(float(s) * em.G) if cuda else int(float(s) * 4 * em.MI) for s in args.sizes.split(",")
    ]
    records = [r for n in sizes for r in measure_size(n, args, bw, cuda)]
    phases = [r for n in sizes for r in measure_phases(n, args, bw)] if args.phases else []
    out = {
        "machine": em.machine() if cuda else {"device": "cpu"},
        "bandwidths_bytes_per_s": bw,
        "records": records + phases,
        "summary": summary(records) + phase_summary(phases),
    }
    for row in out["summary"]:
        print(row, flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
