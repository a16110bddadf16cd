"""Process-based async saves with the raw snapshot: the check the CPU and GPU tests share.

``dcp.async_save(..., async_checkpointer_type=PROCESS)`` pickles the staged dict and the storage
writer to DCP's writer process. The writers here wait for a gate file before writing, so the
test trains (and drops its own references) first: the checkpoint must still hold TE's export at
the save point. They are picklable (a path, not an event) and import little, since the writer
process imports this module to unpickle them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from te_ckpt_placement.dcp import StreamingWriter


def _wait_for(gate: str | os.PathLike[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never opened the gate {gate}")
        time.sleep(0.01)


class _Gated:
    """A file writer (mixed in before it) that writes once the file ``gate`` exists."""

    def __init__(self, path: Path, gate: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)  # type: ignore[call-arg]
        self.gate = str(gate)

    def write_data(self, plan: Any, planner: Any) -> Any:
        _wait_for(self.gate)
        return super().write_data(plan, planner)  # type: ignore[misc]


class GatedStreamingWriter(_Gated, StreamingWriter):
    """A StreamingWriter that writes once the file ``gate`` exists."""


class GatedFileSystemWriter(_Gated, FileSystemWriter):
    """torch's FileSystemWriter, writing once the file ``gate`` exists."""
