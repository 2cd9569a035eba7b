"""hbp's own profiler windows print none of Kineto's start/stop lines (NOTE [ Quiet profiler
windows ]) and lose nothing else written to stderr around them."""

import os

import torch

from hbp.allocator import allocator_peak, quiet_profile, without_kineto_lines

KINETO = (
    b"USDT:2026-01-01 10:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    b"STAGE:2026-01-01 10:00:00 1:1 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n"
)


def test_kineto_lines_are_dropped_and_other_stderr_is_kept(capfd):
    with without_kineto_lines():
        os.write(2, KINETO + b"a warning hbp must not swallow\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "STAGE" not in err
    assert "a warning hbp must not swallow" in err


def test_allocator_measurements_print_nothing(capfd):
    for _ in range(3):
        _, peak = allocator_peak(lambda: torch.ones(1024, 1024).sum())
        assert peak >= 4 * 1024 * 1024
    with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8) * 2
    assert prof.events() is not None
    captured = capfd.readouterr()
    assert "profiler_start" not in captured.err and "profiler_stop" not in captured.err
    assert captured.out == ""
