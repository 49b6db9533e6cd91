"""ppo_ray/driver/supervisor.py: the one retry rule of every call the driver makes to an actor, with
stand-ins for the roles and the metrics (the real actor deaths, at every place, run in
test_faults.py)."""

from __future__ import annotations

import pytest

from helpers import FakeMetrics, FakeRoles
from ppo_ray.faults import StateLostError
from ppo_ray.driver.supervisor import Supervisor


def test_an_actor_failure_costs_one_retry_after_the_recovery():
    metrics, recovered, attempts = FakeMetrics(), [], []
    supervisor = Supervisor(FakeRoles(), metrics, max_retries=2)

    def attempt(i):
        attempts.append(i)
        if i < 2:
            raise StateLostError("generator-0", "came back without its adapter")
        return "done"

    assert supervisor.run(attempt, where="sync", step=4, recover=lambda: recovered.append(len(attempts))) == "done"
    assert attempts == [0, 1, 2] and recovered == [1, 2]
    assert supervisor.retries == [{"step": 4, "role": "generator-0", "where": "sync"}] * 2
    assert metrics.retried == ["generator-0", "generator-0"]


def test_out_of_retries_the_failure_is_raised():
    supervisor = Supervisor(FakeRoles(), FakeMetrics(), max_retries=1)

    def attempt(i):
        raise StateLostError("learner", f"attempt {i}")

    with pytest.raises(StateLostError, match="attempt 1"):
        supervisor.run(attempt, where="step", step=1, recover=lambda: None)
    assert len(supervisor.retries) == 1


def test_other_errors_are_the_callers():
    supervisor = Supervisor(FakeRoles(), FakeMetrics(), max_retries=3)
    recovered = []

    def attempt(i):
        raise ValueError("bad reward")

    with pytest.raises(ValueError, match="bad reward"):
        supervisor.run(attempt, where="step", step=1, recover=lambda: recovered.append(1))
    assert recovered == [] and supervisor.retries == []


def test_an_actor_lost_during_the_recovery_costs_a_retry_too():
    """A second death while recovering from the first (the restarted generator dies again while
    it is given the adapter) is survived like the first, within max_retries."""
    supervisor = Supervisor(FakeRoles(), FakeMetrics(), max_retries=2)
    recoveries, attempts = [], []

    def recover():
        recoveries.append(len(recoveries))
        if len(recoveries) == 1:
            raise StateLostError("generator-0", "died again while it loaded the adapter")

    def attempt(i):
        attempts.append(i)
        if i == 0:
            raise StateLostError("reward", "restarting")
        return "scored"

    assert supervisor.run(attempt, where="evaluation", step=5, recover=recover) == "scored"
    assert attempts == [0, 2] and recoveries == [0, 1]
    assert [r["role"] for r in supervisor.retries] == ["reward", "generator-0"]


def test_a_place_is_one_of_the_places():
    with pytest.raises(ValueError, match="supervised place 'evaluation loop'"):
        Supervisor(FakeRoles(), FakeMetrics(), max_retries=1).run(lambda i: None, where="evaluation loop", step=1,
                                                                  recover=lambda: None)
