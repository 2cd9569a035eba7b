"""What a run ran on: versions, device, threads, git SHA, hostname (recorded with every run)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def git_revision(root: Path = REPO_ROOT) -> tuple[str | None, bool | None]:
    """(commit SHA, working tree has uncommitted changes to tracked files) of the checkout at
    `root`; (None, None) when it is not a git checkout or git is missing."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None
    return sha, dirty


def hbp_version() -> str | None:
    """The installed hbp distribution's version (None when hbp runs uninstalled)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hbp")
    except PackageNotFoundError:
        return getattr(sys.modules.get("hbp"), "__version__", None)


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name on CUDA, else the CPU's processor string."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def capture_environment(device: torch.device | str) -> dict:
    """Flat, JSON-serialisable description of the software and hardware of this process."""
    device = torch.device(device)
    sha, dirty = git_revision()
    env = {
        "hbp_version": hbp_version(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "git_sha": sha,
        "git_dirty": dirty,
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        env["cuda_version"] = torch.version.cuda
        env["gpu_count"] = torch.cuda.device_count()
    return env


def model_libraries(model) -> dict:
    """`<library>_version` of the library the model's class comes from (transformers,
    diffusers, timm, peft...) and of those of its submodules: a figure depends on the
    library's version of the model. Nothing for hbp's own models."""
    names = {type(m).__module__.partition(".")[0] for m in model.modules()}
    out = {}
    for name in sorted(names - {"hbp", "torch", "builtins", "__main__"}):
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None)
        if version is not None:
            out[f"{name}_version"] = version
    return out
