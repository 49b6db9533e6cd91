"""Exact comparisons of two runs, and the one rerun a case gets when they differ only in
the last digits.

The fault, resume and sync-check cases compare a run with a straight one exactly: float32 on
the CPU is deterministic, and a tolerance would hide a lost optimiser state. CI has twice seen
such a comparison fail in float values alone, without a fault at the place that differed:
- one process's pass of a run computed logprobs up to 2e-4 off its other passes of the same
  weights (step 1's no-grad pass of a learner that nothing had killed; another time a
  generator's first batch);
- every sampled token, length and text stayed equal, and the floats after it differed by
  about 1e-5 relative.
The cause is not found (benchmarks/RESULTS.md, "Float differences between runs that must be
equal"). So a case whose runs differ only that way (every difference a float, or a float
tensor, within LAST_DIGITS; texts, tokens, steps and versions all equal) is run once more,
and that run must be exact. A deterministic bug fails it twice. A difference in what was
sampled, or a larger one, fails at once. The first try's differences are printed and
recorded as a pytest warning, so CI's summary shows every rerun.
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from typing import Any, Callable, Iterator

import pytest

# |a - b| <= LAST_DIGITS * (1 + max(|a|, |b|)): far above float32 rounding (6e-8 relative),
# far below what a lost step, optimiser state or sample moves (>= 1e-2 on the tiny runs)
LAST_DIGITS = 1e-3


class RunsDiffer(AssertionError):
    """Two runs that must be equal differ in float values only, each within LAST_DIGITS."""


class RerunWarning(pytest.PytestWarning):
    """A case's runs differed in their last digits on the first try; it was run again."""


def _leaves(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """(path, a, b) for each leaf where a and b differ (dicts, lists and tuples walked; NaN
    equals NaN; tensors compared whole)."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                yield f"{path}.{key}", a.get(key, "<missing>"), b.get(key, "<missing>")
            else:
                yield from _leaves(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _leaves(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            yield path, a, b
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    elif type(a) is not type(b) or a != b:
        yield path, a, b


def _last_digits(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
            return False
        a, b = a.double(), b.double()
        bound = LAST_DIGITS * (1 + torch.maximum(a.abs(), b.abs()))
        return bool(((a - b).abs() <= bound).all())
    if type(a) is float and type(b) is float and math.isfinite(a) and math.isfinite(b):
        return abs(a - b) <= LAST_DIGITS * (1 + max(abs(a), abs(b)))
    return False


def _show(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return repr(value)


def assert_same(got: Any, want: Any, what: str = "", derived: dict[str, tuple[Any, Any]] | None = None) -> None:
    """got == want exactly. Raises RunsDiffer when every difference is in the last digits,
    AssertionError otherwise. `derived` ({name: (got, want)}): values that follow from the
    floats (a checkpoint's file hashes): a difference there is in the last digits when the
    floats differ that way, and a plain failure when they are equal."""
    import torch

    diffs = list(_leaves(got, want, "run"))
    extra = [(name, a, b) for name, (a, b) in (derived or {}).items() if a != b]
    if not diffs and not extra:
        return
    lines = []
    for path, a, b in diffs + extra:
        gap = ""
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.is_floating_point():
            gap = f" (up to {(a.double() - b.double()).abs().max().item():.3g})"
        lines.append(f"{path}: {_show(a)} vs {_show(b)}{gap}")
    message = f"{what}: " + "; ".join(lines[:60]) + (f"; and {len(lines) - 60} more" if len(lines) > 60 else "")
    if diffs and all(_last_digits(a, b) for _, a, b in diffs):
        raise RunsDiffer(message)
    raise AssertionError(message)


def rerun_if_last_digits_differ(test: Callable) -> Callable:
    """Run `test` again, once, when it raises RunsDiffer. A `tmp_path` argument becomes a fresh
    directory under it for the second try."""
    takes_tmp = "tmp_path" in inspect.signature(test).parameters

    @functools.wraps(test)
    def again(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except RunsDiffer as first:
            note = f"the runs differed in their last digits; running the case again ({str(first)[:3000]})"
            print(note)
            warnings.warn(RerunWarning(note))
            if takes_tmp:
                kwargs["tmp_path"] = kwargs["tmp_path"] / "rerun"
                kwargs["tmp_path"].mkdir()
            return test(*args, **kwargs)

    return again
