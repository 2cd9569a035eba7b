"""The checks behind `make gpu-check` (experiments/gpu_check.py): every CUDA path of hbp in one
run, each check in its own process so that one failure or hang costs only its own row.

    sizes.py     what each check runs on a CUDA device and, with --cpu, on CPU (tiny shapes)
    step.py      one training step measured: allocator and reserved peaks, FLOPs, time, grads
    models.py    a model under naive, uniform, library and hbp checkpointing (+ kernel workspace)
    extras.py    bf16 autocast, torch.compile(hc), chunked cross-entropy, DDP
    report.py    the verdicts (tolerances, budget slack), the JSON file and the markdown table
"""
