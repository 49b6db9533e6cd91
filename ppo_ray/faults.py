"""Actor faults: what the trainer recovers from, and a deterministic way to cause them in tests.

Recovery (ppo_ray.trainer) needs to know two things about a failed step: that an actor died
(Ray's ``RayActorError``: ``ActorDiedError`` for a call that was running, ``ActorUnavailableError``
for a call to an actor that is restarting) or that an actor came back from a restart without
its state (``StateLostError`` below: a restarted generator still on the base model, a restarted
learner at version 0). Both are retried from the last committed step; anything else (a bug, a
stale sync of a live actor, bad input) is not.

Fault injection, for tests: ``Fault(role, step, phase, when)`` makes the actor ``role`` die at a
named point of step ``step`` (1-based, as PPOTrainer.step counts):

    phase       the call that dies (role)                      when
    generate    generator-i.generate of this step's rollouts   before / after its work
    prefetch    generator-i.generate of the NEXT step's        before / after (overlap_generation)
                rollouts, submitted during this step
    score       reference.logprobs, reward.score               before / after
    update      learner(-i).update                             before / after
    sync        generator-i.load_adapter of the new version    before / after
    idle        any role, killed by the driver at the start of the step, between calls
                (the step's first call finds it restarted, without state)

"before" dies as the call arrives (nothing done), "after" once its work is done but before
the result is returned (an update applied in a process that is then lost). The death is a
hard exit of the actor's process (``os._exit``), as an OOM kill or a segfault would be; Ray
restarts the actor (``max_actor_restarts``) and the armed fault is gone with the process, so
it fires once.

A bad sync, for the sync check's tests: ``BadSync(step, kind, replica)`` makes generator
``replica``'s sync after step ``step`` go wrong without an error, once: ``previous`` keeps
the old weights while reporting the new version (a lost sync, verl #7495), ``perturbed``
loads the new weights with one LoRA B matrix nudged (a corrupted transfer). The trainer's
sync check must catch it in that step and re-sync.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

PHASES = ("generate", "prefetch", "score", "update", "sync", "idle")
BAD_SYNCS = ("previous", "perturbed")
WHENS = ("before", "after")
# The phases each role takes part in (idle: any role).
ROLE_PHASES = {"generator": ("generate", "prefetch", "sync", "idle"), "reference": ("score", "idle"),
               "reward": ("score", "idle"), "learner": ("update", "idle")}
# phase -> the host method that dies, per role kind
PHASE_METHODS = {("generator", "generate"): "generate", ("generator", "prefetch"): "generate",
                 ("generator", "sync"): "load_adapter", ("reference", "score"): "logprobs",
                 ("reward", "score"): "score", ("learner", "update"): "update"}


class StateLostError(RuntimeError):
    """A restarted actor was asked for work that needs the state it lost (an adapter version,
    the learner's weights). The trainer treats it like the actor's death: restore, retry."""

    def __init__(self, role: str, message: str):
        super().__init__(role, message)  # args as the constructor takes them: Ray pickles it across processes
        self.role = role

    def __str__(self) -> str:
        return f"{self.args[0]}: {self.args[1]}"


def role_kind(role: str) -> str:
    """generator-0 -> generator, learner-1 -> learner, reference -> reference."""
    return role.split("-")[0]


@dataclass(frozen=True)
class Fault:
    """Make actor `role` (as Roles.names() spells it) die at `phase` of step `step` (1-based)."""

    role: str
    step: int
    phase: str
    when: str = "before"

    def __post_init__(self) -> None:
        kind = role_kind(self.role)
        if kind not in ROLE_PHASES:
            raise ValueError(f"fault role {self.role!r}: not one of generator-N, reference, reward, learner(-N)")
        if self.phase not in ROLE_PHASES[kind]:
            raise ValueError(f"fault phase {self.phase!r}: {self.role} takes part in {list(ROLE_PHASES[kind])}")
        if self.when not in WHENS:
            raise ValueError(f"fault when {self.when!r}: one of {list(WHENS)}")
        if self.step < 1:
            raise ValueError(f"fault step {self.step}: steps count from 1")

    @property
    def method(self) -> str | None:
        """The host method that dies; None for an idle kill (done by the driver)."""
        return PHASE_METHODS.get((role_kind(self.role), self.phase))


@dataclass(frozen=True)
class BadSync:
    """Make generator `replica`'s sync after step `step` (1-based) a silent bad one, once."""

    step: int
    kind: str = "previous"
    replica: int = 0

    def __post_init__(self) -> None:
        if self.kind not in BAD_SYNCS:
            raise ValueError(f"bad sync kind {self.kind!r}: one of {list(BAD_SYNCS)}")
        if self.step < 1:
            raise ValueError(f"bad sync step {self.step}: steps count from 1")

    @property
    def role(self) -> str:
        return f"generator-{self.replica}"


def perturbed(weights):
    """LoRA weights with the first B matrix nudged by 1e-2 of its own scale (BadSync "perturbed")."""
    import torch

    tensors = dict(weights.tensors)
    key = next(k for k in sorted(tensors) if k.endswith("lora_B.weight"))
    b = tensors[key]
    tensors[key] = b + 1e-2 * (b.abs().max() + 1.0) * torch.ones_like(b)
    return type(weights)(tensors, weights.spec)


class FaultPoints:
    """Mixed into the actor hosts (ppo_ray.placement): ``arm_fault`` from the driver, and
    ``fault_point(method)`` on the methods a fault can hit. Unarmed (every real run), a fault
    point costs one dictionary lookup."""

    def arm_fault(self, method: str, when: str, call: int = 1) -> None:
        """Die `when` ("before"/"after") in the `call`-th call of `method` from now."""
        self._ppo_faults = {**getattr(self, "_ppo_faults", {}), (method, when): call}
        self._ppo_calls = {**getattr(self, "_ppo_calls", {}), method: 0}

    def exit_now(self) -> None:
        """Die now (an idle fault): the call never returns, the caller sees the actor's death."""
        os._exit(17)

    def _ppo_fault_check(self, method: str, when: str, call: int) -> None:
        if getattr(self, "_ppo_faults", {}).get((method, when)) == call:
            os._exit(17)  # a hard crash: no cleanup, no exception back to the caller


def fault_point(method):
    """Decorator: the wrapped host method can be made to die before or after its work.
    Put it above ``@ray.method``: Ray reads num_returns from the unwrapped function."""
    name = method.__name__

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        faults = getattr(self, "_ppo_faults", None)
        if not faults:
            return method(self, *args, **kwargs)
        self._ppo_calls[name] = call = self._ppo_calls.get(name, 0) + 1
        self._ppo_fault_check(name, "before", call)
        out = method(self, *args, **kwargs)
        self._ppo_fault_check(name, "after", call)
        return out

    return wrapped
