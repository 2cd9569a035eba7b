"""hbp.planner."""
