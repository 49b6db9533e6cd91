"""Deadlines of the driver's calls to the actors: no call hangs a run.

Every call the driver makes to an actor (ppo_ray.driver.roles) is of one of CALL_KINDS, and has a
deadline, counted from the moment it can start: it was submitted, the calls whose results it
takes have finished and, on an actor that runs its calls one at a time, the call before it
has finished. The deadline is

    max(call_timeout_min_s, call_timeout_factor x the slowest seconds per row of its kind so far x its rows)

where an actor's first call of a kind since it started (which loads, warms up or compiles) is
held to the slowest first call of its kind, a later one to the slowest later one (or, before
there is one, the slowest first one), and the run's first call of a kind, before anything is
measured, to call_timeout_first_s. Past its deadline
the actor is deemed hung: Roles kills it (Ray restarts it, within max_actor_restarts) and
raises CallTimeout, which the supervisor treats as the actor's death (ppo_ray.driver.supervisor: the
state recovered, the call retried, at most max_step_retries times; then the run stops with
the CallTimeout, which names the call and the actor). A reward function that hangs in the
reward actor, which cannot be stopped in its thread, is cut by this rule.

Bottom layer: the standard library only (the waiting and the kill are in ppo_ray.driver.roles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# What each kind of call is; ppo_ray.driver.roles tags every call it makes with one.
CALL_KINDS = {
    "generate": "a training batch's rollouts (a generator)",
    "evaluation": "sampling with the committed policy, outside the training steps (a generator)",
    "reference": "the reference logprobs of a batch (the reference actor)",
    "score": "the scores of a batch (the reward actor: reward model and reward functions)",
    "update": "the PPO update of a batch (each learner)",
    "sync": "an adapter version loaded (a generator)",
    "probe": "the sync check: the probe sampled (a generator) and its logprobs recomputed (the learner)",
    "state": "the learner's state or weights: asked for, or loaded (a restore, a checkpoint, the start)",
    "query": "a small question: the versions a generator holds, a few rows of the learner's last update",
}


class CallTimeout(RuntimeError):
    """An actor did not finish a call within its deadline: it was killed (and is restarted).
    Retryable, like an actor's death; `role` names the actor (Supervisor.record reads it)."""

    def __init__(self, kind: str, roles: list[str], waited_s: float, limit_s: float, rule: str):
        self.kind, self.roles, self.waited_s, self.limit_s = kind, list(roles), waited_s, limit_s
        self.role = self.roles[0]
        who = ", ".join(self.roles)
        super().__init__(f"the {who} actor{'s' if len(self.roles) > 1 else ''} did not finish {kind} call "
                         f"({CALL_KINDS.get(kind, kind)}) within its deadline of {limit_s:.0f} s ({rule}): deemed "
                         "hung and killed (restarted by Ray within max_actor_restarts)")


@dataclass
class Deadlines:
    """The deadline rule (the module doc) and what it has measured: per kind, the slowest
    seconds per row of a first call on an actor (start-up included) and of a later call; per
    (kind, role), whether the role has made a call of that kind since it (re)started."""

    factor: float = 10.0
    min_s: float = 300.0
    first_s: float = 1800.0
    rates: dict[str, float] = field(default_factory=dict)        # kind -> slowest seconds per row, later calls
    first_rates: dict[str, float] = field(default_factory=dict)  # kind -> the same of first calls
    warm: set[tuple[str, str]] = field(default_factory=set)      # (kind, role) that finished a call

    def __post_init__(self) -> None:
        for name in ("factor", "min_s", "first_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Deadlines.{name} must be a finite number > 0, got {value!r}")

    def limit(self, kind: str, role: str, rows: int) -> tuple[float, str]:
        """(seconds, the rule that gave them) for a call of `kind` on `role` over `rows` rows:
        a first call on the role, by the slowest first call of the kind (call_timeout_first_s
        before there was one); a later call by the slowest later call (or, before there was
        one, the slowest first call)."""
        if kind not in CALL_KINDS:
            raise ValueError(f"call kind {kind!r}: not one of {list(CALL_KINDS)}")
        first = (kind, role) not in self.warm
        rate = self.first_rates.get(kind) if first else self.rates.get(kind, self.first_rates.get(kind))
        if rate is None:
            return self.first_s, f"call_timeout_first_s {self.first_s:g}: the run's first {kind} call"
        which = "first call of an actor" if first or kind not in self.rates else "call"
        rule = (f"call_timeout_factor {self.factor:g} x the slowest {kind} {which} so far ({rate:.3g} s per row) x "
                f"{max(rows, 1)} rows, at least call_timeout_min_s {self.min_s:g}")
        return max(self.min_s, self.factor * rate * max(rows, 1)), rule

    def record(self, kind: str, role: str, seconds: float, rows: int) -> None:
        """A call of `kind` on `role` finished after `seconds`: it sets the pace of first or
        of later calls."""
        pace = self.rates if (kind, role) in self.warm else self.first_rates
        pace[kind] = max(pace.get(kind, 0.0), max(seconds, 0.0) / max(rows, 1))
        self.warm.add((kind, role))

    def restarted(self, role: str) -> None:
        """`role`'s actor (re)started ("unknown": any): its next calls are first calls again."""
        self.warm = {(k, r) for k, r in self.warm if r != role and role != "unknown"}
