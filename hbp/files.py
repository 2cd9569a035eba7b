"""Files written whole or not at all: readers (a report, another job sharing a cache
directory) see the old file or the whole new one, never a part."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

from hbp.errors import CacheWarning

__all__ = ["atomic_write", "kept_or_warned", "write_text"]


def atomic_write(path: Path, write) -> Path:
    """Call `write(tmp)` on a temporary path beside `path`, then rename it to `path`. The
    file's mode is 0o666 minus the umask, as a plain `open()` gives (mkstemp alone would leave
    it 0600, unreadable to another user sharing the directory)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str, *, make_parents: bool = False) -> Path:
    """Write `text` to `path` atomically (creating its folder with `make_parents`)."""
    if make_parents:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def kept_or_warned(folder: Path, write) -> bool:
    """Call `write()`, which writes an entry of the cache in `folder`; where the file system refuses (a
    read-only or full disk, a file where the folder should be), warn once per cache and go
    on: a cache is never a reason for a training step to fail."""
    try:
        write()
        return True
    except OSError as err:
        folder = Path(folder)
        # once per cache: a plan cache and its `scratch` folder are one
        if not any(folder.is_relative_to(w) or w.is_relative_to(folder) for w in _WARNED):
            _WARNED.add(folder)
            warnings.warn(
                f"hbp could not write to its cache under {folder} ({type(err).__name__}: "
                f"{err}); the run goes on, and what was not kept is planned or measured again "
                "the next time",
                CacheWarning,
                stacklevel=2,
            )
        return False


_WARNED: set[Path] = set()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
