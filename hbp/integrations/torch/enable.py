"""`hbp.enable(model, budget=...)` / `hbp.disable(model)`: hbp turned on in place."""

from __future__ import annotations


def enable(model, budget=None, **options):
    raise NotImplementedError


def disable(model):
    raise NotImplementedError
