"""Measured kernel workspaces kept on disk, so that another process does not measure them again.

The scratch calibration (`hbp.graph.torch.calibrate`) measures each distinct op signature once
per process. On a CPU that is most of a large model's first step (an LM head's forward and
backward on the real shapes); a restarted job or another run of a sweep measures the same ops
on the same shapes again. A `ScratchStore` keeps each measurement under its op signature and
the environment that decides it (NOTE [ What a workspace depends on ]):

    store = ScratchStore("~/.cache/hbp/scratch")
    captured = capture(model, args, kwargs, calibrate=True, scratch_store=store)

`HCModule(..., plan_cache=dir)` keeps its measurements in `dir/scratch`. Entries are written
atomically (one JSON file each), so jobs sharing a directory read whole entries or none; an
unreadable entry is a miss.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
from pathlib import Path

import torch

from hbp.files import kept_or_warned, write_text

__all__ = ["SCRATCH_FORMAT", "ScratchStore", "Measured"]

#: Bumped whenever what a measurement means changes: entries of another format are not read.
SCRATCH_FORMAT = 2

#: (forward allocator peak, backward allocator peak, bytes; the strides of the gradient each
#: tensor leaf of the op's arguments got, or None)
Measured = tuple[int, int, tuple[tuple[int, ...] | None, ...]]

# NOTE [ What a workspace depends on ]
# A measurement is the allocator's peak of one op on tensors of given shapes, strides, dtypes
# and devices (the op signature, `op_signature.signature`, with the gradient layout), and it
# depends on the kernels chosen: the torch build, the device (a GPU's name and compute
# capability; a CPU's instruction set, which `ATEN_CPU_CAPABILITY` can lower, and model), the
# CPU threads (oneDNN sizes its buffers by them), cuDNN's flags, the
# deterministic-algorithms flag and the caching allocator's settings. All of these are in the
# key, and so is a digest of a Python function's or a module's `forward`'s code, so that an op
# edited between two runs is measured again (a function of `__main__` is named by its code).
# A signature that names an object by its address (a repr without a stable form) or a closure
# (a lambda, a function defined inside another: its behaviour follows the values it closes
# over, which no digest of its code sees) is measured in each process and never written.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|<lambda>|<locals>")


class ScratchStore:
    """Op workspace measurements on disk, one JSON file per (op signature, environment)."""

    def __init__(self, directory: str | os.PathLike, cache: str | os.PathLike | None = None):
        """`cache`: the folder a warning names where `directory` cannot be written (a plan
        cache whose `scratch` folder this is), else `directory` itself."""
        self.directory = Path(directory).expanduser()
        self.cache = self.directory if cache is None else Path(cache).expanduser()

    @classmethod
    def of_plan_cache(cls, directory: str | os.PathLike) -> ScratchStore:
        """The store of a plan cache in `directory` (`plan_cache=`): its `scratch` folder."""
        return cls(Path(directory) / "scratch", directory)

    def get(self, key: tuple, device: torch.device) -> Measured | None:
        """The measurement stored for `key` (calibration's op signature, gradient layout) on
        `device`, or None."""
        path = self._path(key, device)
        if path is None:
            return None
        try:
            forward, backward, strides = json.loads(path.read_text())["measured"]
            return (
                int(forward),
                int(backward),
                tuple(None if s is None else tuple(int(x) for x in s) for s in strides),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: tuple, device: torch.device, measured: Measured) -> None:
        self._write(key, device, {"measured": measured})

    def get_calibrated(self, key: tuple, device: torch.device) -> tuple[int, list] | None:
        """(nodes raised, each IR node's (forward, backward) scratch bytes) of a whole graph
        calibrated before under `key` (`op_signature.graph_key`), or None."""
        path = self._path(key, device)
        if path is None:
            return None
        try:
            entry = json.loads(path.read_text())
            fields = [(int(f), int(b)) for f, b in entry["fields"]]
            return int(entry["raised"]), fields
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put_calibrated(self, key: tuple, device: torch.device, raised: int, fields: list) -> None:
        self._write(key, device, {"raised": raised, "fields": fields})

    def _write(self, key: tuple, device: torch.device, entry: dict) -> None:
        path = self._path(key, device)
        if path is not None:
            text = json.dumps(entry)
            kept_or_warned(self.cache, lambda: write_text(path, text, make_parents=True))

    def _path(self, key: tuple, device: torch.device) -> Path | None:
        text = repr(key)
        if _ADDRESS.search(text):
            return None  # NOTE [ What a workspace depends on ]
        digest = hashlib.sha256(
            json.dumps([SCRATCH_FORMAT, _environment(device), text]).encode()
        ).hexdigest()
        return self.directory / digest[:2] / f"{digest}.json"


def _environment(device: torch.device) -> list:
    """What, beside the op signature, decides a workspace on `device` (NOTE [ What a
    workspace depends on ])."""
    env = [
        torch.__version__,
        device.type,
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
    ]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env += [
            torch.version.cuda,
            props.name,
            f"{props.major}.{props.minor}",
            torch.backends.cudnn.version(),
            torch.backends.cudnn.enabled,
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
            torch.backends.cuda.matmul.allow_tf32,
            os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            os.environ.get("PYTORCH_ALLOC_CONF", ""),
        ]
    else:
        env += [torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), _cpu_model()]
    return env


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (oneDNN blocks its kernels by the caches), or "" if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
