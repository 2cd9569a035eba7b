"""Byte units, defined once: `n * MIB` is n mebibytes, `x / MIB` is x bytes in mebibytes."""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30

__all__ = ["GIB", "KIB", "MIB"]
