"""Fault recovery around the trainer's calls: one retry rule for the step, the prefetch and
the sync.

    supervisor.run(attempt, where="step", step=n, recover=back_to_committed_state)

`attempt(i)` runs the work (i = 0, 1, ...); an actor that dies in it (or comes back from a
restart without the state the call needs: StateLostError) costs one retry, after
`recover()`, up to max_retries; any other error is the caller's. Every retry is counted in
the Prometheus counter (by role), logged, and kept in `retries` ({"step", "role", "where"}).
What a retry redoes, and why that computes exactly what the first attempt would have, is
the trainer's business (ppo_ray.trainer: the commit point); the supervisor only counts
and repeats.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from ppo_ray.interrupts import raise_if_stopped
from ppo_ray.metrics import TrainingMetrics
from ppo_ray.roles import RETRYABLE, Roles

log = logging.getLogger("ppo_ray.trainer")
T = TypeVar("T")


class Supervisor:
    def __init__(self, roles: Roles, metrics: TrainingMetrics, max_retries: int):
        self.roles = roles
        self.metrics = metrics
        self.max_retries = max_retries
        self.retries: list[dict] = []  # every actor failure survived

    def run(self, attempt: Callable[[int], T], *, where: str, step: int, recover: Callable[[], None]) -> T:
        for i in range(self.max_retries + 1):
            raise_if_stopped()  # a stop signal whose KeyboardInterrupt was dropped (ppo_ray.interrupts)
            try:
                return attempt(i)
            except RETRYABLE as error:
                if i == self.max_retries:
                    raise
                self.record(error, where, step)
                recover()
        raise AssertionError("unreachable")  # pragma: no cover

    def record(self, error: BaseException, where: str, step: int) -> None:
        role = self.roles.role_of(error)
        self.metrics.record_retry(role)
        self.retries.append({"step": step, "role": role, "where": where})
        log.warning("step %d: the %s actor failed in the %s (%s); waiting for its restart and %s",
                    step, role, where, type(error).__name__,
                    "retrying the step" if where == "step" else "redoing the committed step's " + where)
