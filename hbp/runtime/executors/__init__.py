"""hbp.runtime.executors: run a captured graph's training step under a plan.

`segments` runs a plan of segments (checkpoints, pins, compiled segments, module calls);
`schedule` runs an explicit schedule (`hbp.planner.schedules`).
"""
