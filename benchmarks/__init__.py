"""Scripts that print figures (speed, memory, exactness), not tests, and their helper modules (gpu_steps, reach_runs).
Run the scripts from the repository root, e.g. `python -m benchmarks.embed`."""
