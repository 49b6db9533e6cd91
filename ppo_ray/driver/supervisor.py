"""Fault recovery around every call the driver makes to an actor: one retry rule.

    supervisor.run(attempt, where="evaluation", step=n, recover=back_to_committed_state)

`attempt(i)` runs the work (i = the failures survived so far: 0, 1, ...); an actor that dies
in it (or comes back from a restart without the state the call needs: StateLostError) costs
one retry, after `recover()`, up to max_retries; an actor that dies during `recover()` costs
one too; an actor killed past a call's deadline (CallTimeout, ppo_ray.deadlines: a hung call)
counts as one that died; any other error is the caller's. Every retry is counted in the Prometheus counter
(by role), logged, and kept in `retries` ({"step", "role", "where"}). What a retry redoes,
and why that computes exactly what the first attempt would have, is the trainer's business
(ppo_ray.trainer: the commit point, and what each place redoes); the supervisor only counts
and repeats.

Every Roles call the trainer makes runs inside one of PLACES (tests/test_faults.py records a
run's calls and checks it, and has a fault case for each place). Before each attempt the
supervisor raises a stop that was asked for and lost on the way (ppo_ray.driver.interrupts).
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from ppo_ray.driver.interrupts import raise_if_stopped
from ppo_ray.driver.metrics import TrainingMetrics
from ppo_ray.driver.roles import RETRYABLE, Roles

log = logging.getLogger("ppo_ray.trainer")
T = TypeVar("T")

# Where the driver calls actors, and what a retry there redoes (ppo_ray.trainer).
PLACES = {
    "start": "the learner's first state and weights (PPOTrainer's constructor)",
    "restore": "a checkpoint's state loaded into the learners and its adapter into the generators (and the "
               "committed state into the learners after a step failed for another reason than an actor)",
    "step": "the step, up to its commit point",
    "prefetch": "the next steps' rollouts, generated during this one (max_staleness >= 1)",
    "sync": "the committed adapter loaded into the generators",
    "sync check": "the probe after every sync",
    "evaluation": "sampling with the committed policy (the eval samples, PPOTrainer.generate)",
    "checkpoint": "the committed learner state, fetched for a checkpoint",
    "adapter": "the committed adapter, fetched for save_adapter",
}


class Supervisor:
    def __init__(self, roles: Roles, metrics: TrainingMetrics, max_retries: int):
        self.roles = roles
        self.metrics = metrics
        self.max_retries = max_retries
        self.retries: list[dict] = []  # every actor failure survived

    def run(self, attempt: Callable[[int], T], *, where: str, step: int, recover: Callable[[], None]) -> T:
        if where not in PLACES:
            raise ValueError(f"supervised place {where!r}: not one of {list(PLACES)}")
        failures = 0
        while True:
            raise_if_stopped()
            try:
                if failures:
                    recover()
                return attempt(failures)
            except RETRYABLE as error:
                if failures == self.max_retries:
                    raise
                failures += 1
                self.record(error, where, step)

    def record(self, error: BaseException, where: str, step: int) -> None:
        role = self.roles.role_of(error)
        self.roles.restarted(role)  # its next calls' deadlines allow for its start-up again
        self.metrics.record_retry(role)
        self.retries.append({"step": step, "role": role, "where": where})
        log.warning("%s %d: the %s actor failed in the %s (%s); waiting for its restart and %s",
                    "step" if where == "step" else "after step", step, role, where, type(error).__name__,
                    "retrying the step" if where == "step" else f"redoing the {where}")
