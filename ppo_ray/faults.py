"""Actor faults: what the trainer recovers from.

Recovery (ppo_ray.trainer) needs to know two things about a failed step: that an actor died
(Ray's ``RayActorError``: ``ActorDiedError`` for a call that was running, ``ActorUnavailableError``
for a call to an actor that is restarting) or that an actor came back from a restart without
its state (``StateLostError`` below: a restarted generator still on the base model, a restarted
learner at version 0). Both are retried from the last committed step; anything else (a bug, a
stale sync of a live actor, bad input) is not.

The tests cause such faults at named points of a step with their own trainer and actor
classes (tests/fault_injection.py); nothing here or in the hosts arms them.
"""

from __future__ import annotations


class StateLostError(RuntimeError):
    """A restarted actor was asked for work that needs the state it lost (an adapter version,
    the learner's weights). The trainer treats it like the actor's death: restore, retry."""

    def __init__(self, role: str, message: str):
        super().__init__(role, message)  # args as the constructor takes them: Ray pickles it across processes
        self.role = role

    def __str__(self) -> str:
        return f"{self.args[0]}: {self.args[1]}"
