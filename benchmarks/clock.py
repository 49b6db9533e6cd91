"""The benchmarks' one timer: wall seconds that wait for the device, and the device's peak memory.

    clock = DeviceClock(device)
    t0 = clock.now(); ...; seconds = clock.now() - t0      # a phase boundary waits for queued GPU work
    value, seconds, peak_gib = clock(fn, *args)             # one phase, with its own memory peak

On the CPU `now` is perf_counter and the peaks are None. benchmarks/step.py, gpu_step.py and
learner_profile.py all time with it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional


class DeviceClock:
    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, str(device).startswith("cuda")

    def now(self) -> float:
        """perf_counter() after the device's queued work is done (no wait on the CPU)."""
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def reset_peak(self, empty_cache: bool = False) -> None:
        """Start a new memory peak (empty_cache: drop the cached blocks of what ran before,
        so the peak is this phase's alone)."""
        if self.cuda:
            if empty_cache:
                self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> Optional[float]:
        """The caching allocator's peak since reset_peak, GiB (None on the CPU)."""
        return self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float, Optional[float]]:
        """fn(*args, **kwargs) as one phase: (its value, its seconds, its peak GiB or None)."""
        self.now()  # the queued work before the phase is not the phase's
        self.reset_peak(empty_cache=True)
        t0 = time.perf_counter()
        value = fn(*args, **kwargs)
        return value, self.now() - t0, self.peak_gib()
