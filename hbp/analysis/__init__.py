"""hbp.analysis: liveness, the memory simulator, frontier analysis and reports (pure Python).

`collect` (in `hbp.analysis.collect`, run tables) is imported lazily so that this package
imports without it and without pandas.
"""

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import Simulation, naive_peak, simulate

__all__ = ["GraphInfo", "Simulation", "collect", "naive_peak", "simulate"]


def __getattr__(name: str):
    if name == "collect":
        from hbp.analysis.collect import collect

        return collect
    raise AttributeError(f"module 'hbp.analysis' has no attribute {name!r}")
