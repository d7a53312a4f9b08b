"""Training: the loop and its components (checkpoints and resume, run-dir lock, final weights, metrics, preemption, faults)."""
