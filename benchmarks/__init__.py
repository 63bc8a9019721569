"""Scripts that print figures (speed, memory, exactness), not tests. Run them from the repository root, e.g.
`python -m benchmarks.embed`."""
