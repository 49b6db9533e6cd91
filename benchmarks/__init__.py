"""Benchmarks of the PPO step (issue 6): ``python -m benchmarks.step`` and ``python -m benchmarks.scaling``."""
