"""Fault injection for the tests: a trainer and actor classes that can be made to fail at named
points of a step. Nothing of it is in the product: PPOTrainer, Roles and the hosts
(ppo_ray.driver.hosts) carry none of it; FaultyTrainer names its own actor classes through
PPOTrainer.hosts (subclasses of the hosts, importable by Ray's workers because the test
session puts this folder on their PYTHONPATH: conftest.ray_session).

``Fault(role, step, phase, when)`` makes the actor ``role`` die at a named point of step
``step`` (1-based, as PPOTrainer.step counts):

    phase       the call that dies (role)                      when
    generate    generator-i.generate of this step's rollouts   before / after its work
    prefetch    generator-i.generate of the NEXT step's        before / after (max_staleness >= 1)
                rollouts, submitted during this step
    score       reference.logprobs, reward.score               before / after
    update      learner(-i).update                             before / after
    sync        generator-i.load_adapter of the new version    before / after
    idle        any role, killed by the driver at the start of the step, between calls
                (the step's first call finds it restarted, without state)

"before" dies as the call arrives (nothing done), "after" once its work is done but before
the result is returned (an update applied in a process that is then lost); "hang" never
returns from the call (an actor that stops answering: the driver's deadline kills it,
ppo_ray.deadlines). The death is a
hard exit of the actor's process (``os._exit``), as an OOM kill or a segfault would be; Ray
restarts the actor (``max_actor_restarts``: the same class, so the fault points are there
again) and the armed fault is gone with the process, so it fires once.

``BadSync(step, kind, replica)`` makes generator ``replica``'s sync after step ``step`` go
wrong without an error, once: ``previous`` keeps the old weights while reporting the new
version (a lost sync, verl #7495), ``perturbed`` loads the new weights with one LoRA B matrix
nudged (a corrupted transfer). The trainer's sync check must catch it in that step and re-sync.

    trainer = FaultyTrainer(config)          # a PPOTrainer; unarmed, it runs as one
    trainer.inject_faults([Fault("learner", 2, "update", "after")])
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import ray

from ppo_ray.driver.hosts import GeneratorHost, LearnerHost, ReferenceHost, RewardHost
from ppo_ray.driver.roles import ACTOR_ERRORS, Roles
from ppo_ray.stats import SyncReport
from ppo_ray.trainer import PPOTrainer, Rollouts

PHASES = ("generate", "prefetch", "score", "update", "sync", "idle")
BAD_SYNCS = ("previous", "perturbed")
WHENS = ("before", "after", "hang")
# The phases each role takes part in (idle: any role).
ROLE_PHASES = {"generator": ("generate", "prefetch", "sync", "idle"), "reference": ("score", "idle"),
               "reward": ("score", "idle"), "learner": ("update", "idle")}
# phase -> the host method that dies, per role kind
PHASE_METHODS = {("generator", "generate"): "generate", ("generator", "prefetch"): "generate",
                 ("generator", "sync"): "load_adapter", ("reference", "score"): "logprobs",
                 ("reward", "score"): "score", ("learner", "update"): "update"}


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
    def method(self) -> Optional[str]:
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


# ----------------------------------------------------------------------------- in the actors
class FaultPoints:
    """Mixed into the faulty hosts: ``arm_fault`` and ``exit_now`` from the driver, and
    ``fault_point(method)`` around the methods a fault can hit. Unarmed, a fault point costs
    one attribute lookup."""

    def arm_fault(self, method: str, when: str, call: int = 1) -> None:
        """Die `when` ("before"/"after"), or hang, in the `call`-th call of `method` from now."""
        self._armed_faults = {**getattr(self, "_armed_faults", {}), (method, when): call}
        self._fault_calls = {**getattr(self, "_fault_calls", {}), method: 0}

    def exit_now(self) -> None:
        """Die now (an idle fault): the call never returns, the caller sees the actor's death."""
        os._exit(17)

    def _fault_check(self, method: str, when: str, call: int) -> None:
        if getattr(self, "_armed_faults", {}).get((method, when)) == call:
            if when == "hang":
                threading.Event().wait()  # forever: the call never returns
            os._exit(17)  # a hard crash: no cleanup, no exception back to the caller


def fault_point(method):
    """The host method `method` (a function; a parent's keeps its ``@ray.method`` options:
    functools.wraps copies them), made to die before or after its work when armed."""
    name = method.__name__

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        faults = getattr(self, "_armed_faults", None)
        if not faults:
            return method(self, *args, **kwargs)
        self._fault_calls[name] = call = self._fault_calls.get(name, 0) + 1
        self._fault_check(name, "hang", call)
        self._fault_check(name, "before", call)
        out = method(self, *args, **kwargs)
        self._fault_check(name, "after", call)
        return out

    return wrapped


class FaultyGeneratorHost(FaultPoints, GeneratorHost):
    generate = fault_point(GeneratorHost.generate)

    @fault_point
    def load_adapter(self, version, weights, restore: bool = False, retire_below=None) -> SyncReport:
        bad, self._bad_sync = getattr(self, "_bad_sync", None), None
        if bad == "previous":  # the sync is lost: the old weights stay, the new version is reported
            sync = self.generator.sync
            if hasattr(sync, "_held"):  # adapter / tensor: the newest registration held under the new version too
                sync._held[version] = sync.lora_request
            else:  # merged
                sync._version = version
            return SyncReport(version=version, write_s=0.0, register_s=0.0, retire_s=0.0, nbytes=0.0)
        if bad == "perturbed":
            weights = perturbed(weights)
        return super().load_adapter(version, weights, restore, retire_below)

    def arm_bad_sync(self, kind: str) -> None:
        """Make the next load_adapter a bad sync of `kind` (BadSync), once."""
        self._bad_sync = kind


class FaultyReferenceHost(FaultPoints, ReferenceHost):
    logprobs = fault_point(ReferenceHost.logprobs)


class FaultyRewardHost(FaultPoints, RewardHost):
    score = fault_point(RewardHost.score)


class FaultyLearnerHost(FaultPoints, LearnerHost):
    update = fault_point(LearnerHost.update)


FAULTY_HOSTS = {"generator": FaultyGeneratorHost, "reference": FaultyReferenceHost, "reward": FaultyRewardHost,
                "learner": FaultyLearnerHost}


# ----------------------------------------------------------------------------- from the driver
def kill_now(roles: Roles, role: str) -> None:
    """An idle fault: make `role`'s process exit now, and wait for its restart."""
    try:
        ray.get(roles.actor(role).exit_now.remote())
    except ACTOR_ERRORS:
        pass  # it died, as asked
    roles.wait_for_actors()


def arm_fault(roles: Roles, role: str, method: str, when: str, call: int) -> None:
    ray.get(roles.actor(role).arm_fault.remote(method, when, call))


def arm_bad_sync(roles: Roles, role: str, kind: str) -> None:
    ray.get(roles.actor(role).arm_bad_sync.remote(kind))


class FaultyTrainer(PPOTrainer):
    """A PPOTrainer whose actors have fault points, and which arms them: inject_faults."""

    hosts = FAULTY_HOSTS
    _faults: Sequence[Fault] = ()
    _bad_syncs: Sequence[BadSync] = ()

    def inject_faults(self, faults: Sequence[Fault | BadSync]) -> None:
        """Make actors die at named points of named steps, or a sync go silently wrong. Each
        fault fires once, when its step runs."""
        names = set(self.roles.names())
        for fault in faults:
            if fault.role not in names:
                raise ValueError(f"fault role {fault.role!r}: this run's roles are {sorted(names)}")
        self._faults = [f for f in faults if isinstance(f, Fault)]
        self._bad_syncs = [f for f in faults if isinstance(f, BadSync)]

    def _run_step(self, current: Rollouts):
        self._prepare_faults(self.step + 1, current)
        return super()._run_step(current)

    def _sync_generators(self, version: int):
        # the committed step's sync (_run_step's only call of it): a silent bad sync if armed
        for bad in [b for b in self._bad_syncs if b.step == self.step]:
            arm_bad_sync(self.roles, bad.role, bad.kind)
        return super()._sync_generators(version)

    def _prepare_faults(self, step: int, current: Rollouts) -> None:
        """Arm this step's faults in their actors (they die in the named call); an idle fault
        kills its actor now and waits for Ray to restart it, so that the step's first call to
        it finds a fresh process."""
        prefetched = current.generation is not None
        for fault in [f for f in self._faults if f.step == step]:
            if fault.phase == "idle":
                kill_now(self.roles, fault.role)
                continue
            if fault.phase == "generate" and prefetched:
                raise ValueError(f"{fault}: step {step}'s rollouts were generated during step {step - 1} "
                                 f"(max_staleness >= 1): use phase 'prefetch' at step {step - 1}")
            # this step's own generate call comes first when its rollouts are not prefetched
            call = 2 if fault.phase == "prefetch" and not prefetched else 1
            arm_fault(self.roles, fault.role, fault.method, fault.when, call)
