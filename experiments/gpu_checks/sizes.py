"""What each check runs: the shapes and time limits on a CUDA device, and with `--cpu` the same
checks on CPU with tiny shapes (the script's logic; most of their time is capture and planning).

NOTE [ Fitting the lease ]
A lent GPU comes for about 15 minutes, minutes of which go to starting the machine; the whole
run must fit 8 minutes with its installs. Each check runs in its own process under its own time
limit (`Check.limit_s`), and the run as a whole has a deadline (`RUN_LIMIT_S`): a check that
would start with less than `MIN_START_S` left is recorded as not run. Checks run cheapest and
most telling first; GPT-2 124M (profile medium: 8192 tokens, logits of 1.6 GB) is the biggest
model and gets the largest limit; torch.compile, whose first compile of every segment can take
minutes, runs last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The hbp budgets every model check runs: fractions of the naive step's peak, "min", and
#: hbp's default ("50%act": the least peak plus half of what checkpointing can save).
BUDGETS: tuple[float | str, ...] = (0.5, 0.3, "min", "50%act")
#: Untimed steps before measuring (the first hbp step captures, calibrates and plans; on CUDA
#: the second may plan again from the allocator's measurement).
WARMUP_STEPS = 2
#: A check that would start with less than this left of the run's deadline is not started.
MIN_START_S = 15.0


@dataclass(frozen=True)
class ModelSpec:
    """A model check: `hbp.workloads.build(workload, profile, seed=0, **overrides)`.

    hf: a transformers model, trained as its users do (`model(**batch).loss.backward()` on the
        library model itself, not hbp's workload wrapper)."""

    workload: str
    profile: str
    overrides: dict = field(default_factory=dict)
    hf: bool = False

    def describe(self) -> str:
        name = self.overrides.get("arch", self.workload) if self.hf else self.workload
        extra = ", ".join(f"{k}={v}" for k, v in self.overrides.items() if k != "arch")
        return f"{name} ({self.profile}{', ' + extra if extra else ''})"


@dataclass(frozen=True)
class Check:
    """One check, run in its own process: `kind` picks the function (models.py, extras.py),
    `model` the workload where it takes one, `limit_s` its time limit in seconds."""

    name: str
    kind: str
    limit_s: float
    model: ModelSpec | None = None
    options: dict = field(default_factory=dict)


#: The run's deadline in seconds (all checks; the installs and the start come on top).
RUN_LIMIT_S = {"cuda": 450.0, "cpu": 1800.0}
#: Checks run at once: one on CUDA (each check has the device to itself: clean peaks and
#: timings); on CPU two (the test's shapes are tiny and most of a check is capture and planning).
JOBS = {"cuda": 1, "cpu": 2}
#: Timed steps per measurement (the median is reported). On CUDA the small models' steps are
#: host-bound and their medians of 5 moved by up to 2x between two runs (docs/results.md
#: "CUDA"); 20 cost a few seconds per check.
TIMED_STEPS = {"cuda": 20, "cpu": 2}


def checks(device: str) -> list[Check]:
    """The checks in the order they run, sized for `device` ("cuda" or "cpu")."""
    if device == "cuda":
        gpt2_small = ModelSpec("gpt2", "small")
        gpt2_medium = ModelSpec("gpt2", "medium")
        unet = ModelSpec("unet", "medium")
        llama = ModelSpec("hf", "medium", {"arch": "llama", "batch_size": 4}, hf=True)
        ce = {"tokens": 8192, "dim": 768, "vocab": 50257}
        # The limits add up to more than the run's deadline: most checks end well inside
        # theirs, and the deadline cuts the last ones (compile first) if they do not.
        limits = dict(pytest=60, small=45, unet=200, llama=100, ce=30, bf16=45, medium=150, ddp=60)
        limits.update(trainer=120, compile=120)
    else:
        gpt2_small = ModelSpec("gpt2", "tiny", {"batch_size": 8, "seq_len": 64})
        gpt2_medium = ModelSpec("gpt2", "tiny", {"n_layer": 1, "batch_size": 8, "seq_len": 64})
        unet = ModelSpec("unet", "tiny", {"batch_size": 8})
        llama = ModelSpec("hf", "tiny", {"arch": "llama", "batch_size": 8, "seq_len": 32}, hf=True)
        ce = {"tokens": 512, "dim": 32, "vocab": 2048}
        # Generous: on CPU the limits only stop a hang (a shared machine may be slow).
        limits = dict(pytest=600, small=600, unet=600, llama=600, ce=300, bf16=600, medium=600)
        limits.update(ddp=60, trainer=600, compile=600)
    return [
        Check("pytest_gpu", "pytest", limits["pytest"]),
        Check("gpt2_small", "model", limits["small"], gpt2_small),
        Check("unet", "model", limits["unet"], unet),
        Check("llama", "model", limits["llama"], llama),
        Check("chunked_ce", "chunked_ce", limits["ce"], options=ce),
        Check("bf16_autocast", "bf16", limits["bf16"], gpt2_small),
        Check("ddp", "ddp", limits["ddp"], gpt2_small),
        Check("trainer", "trainer", limits["trainer"], llama),
        Check("gpt2_medium", "model", limits["medium"], gpt2_medium),
        Check("compile", "compile", limits["compile"], gpt2_small),
    ]
