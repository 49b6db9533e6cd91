"""tests/exact.py: which differences between two runs get a rerun, and the rerun itself."""
from __future__ import annotations

import math

import pytest
import torch

from exact import LAST_DIGITS, RerunWarning, RunsDiffer, assert_same, rerun_if_last_digits_differ

STEP = {"step": 1, "kl": 7.909606, "tokens": 118.0, "generated_texts": ["a b", "c"], "nan": math.nan,
        "adapter": torch.ones(2, 3)}


def test_equal_runs_pass_and_nan_equals_nan():
    assert_same([dict(STEP)], [dict(STEP)], "same")


def test_float_differences_in_the_last_digits_are_runs_differ():
    got = {**STEP, "kl": 7.909635, "adapter": torch.ones(2, 3) + 1e-6}
    with pytest.raises(RunsDiffer, match=r"adapter: tensor\(2, 3\) vs tensor\(2, 3\) \(up to 9.5.e-07\); run\[0\].kl: 7.909635 vs 7.909606"):
        assert_same([got], [STEP], "case")


@pytest.mark.parametrize("change", [
    {"generated_texts": ["a b", "d"]},  # another sample
    {"step": 2},  # another step (an int)
    {"tokens": 119.0},  # a token more: beyond the last digits
    {"kl": 7.909606 * (1 + 3 * LAST_DIGITS)},
    {"adapter": torch.ones(2, 3) * 1.1},
    {"adapter": torch.ones(3, 2)},
    {"kl": math.inf},
], ids=lambda c: next(iter(c)))
def test_any_other_difference_is_a_plain_failure(change):
    with pytest.raises(AssertionError) as failure:
        assert_same([{**STEP, **change}], [STEP], "case")
    assert not isinstance(failure.value, RunsDiffer)


def test_a_derived_difference_reruns_only_with_a_float_one():
    hashes = ({"step-2": "ab"}, {"step-2": "cd"})
    with pytest.raises(RunsDiffer):
        assert_same({**STEP, "kl": 7.9096}, STEP, "case", derived={"files": hashes})
    with pytest.raises(AssertionError) as failure:  # the state's files differ, every float equal: a bug
        assert_same(STEP, STEP, "case", derived={"files": hashes})
    assert not isinstance(failure.value, RunsDiffer)


def test_the_rerun_happens_once_in_a_fresh_directory(tmp_path):
    calls = []

    @rerun_if_last_digits_differ
    def case(tmp_path, fail):
        calls.append(tmp_path)
        (tmp_path / "run").mkdir()  # a second try in the same directory would find it
        if len(calls) <= fail:
            raise RunsDiffer("kl: 1.0 vs 1.0000001")

    with pytest.warns(RerunWarning, match="last digits"):
        case(tmp_path=tmp_path, fail=1)
    assert calls == [tmp_path, tmp_path / "rerun"]
    calls.clear()
    other = tmp_path / "other"
    other.mkdir()
    with pytest.warns(RerunWarning), pytest.raises(RunsDiffer):  # a second difference fails the case
        case(tmp_path=other, fail=2)
    assert len(calls) == 2


def test_a_plain_failure_is_not_rerun():
    calls = []

    @rerun_if_last_digits_differ
    def case():
        calls.append(1)
        raise AssertionError("other samples")

    with pytest.raises(AssertionError, match="other samples"):
        case()
    assert calls == [1]
