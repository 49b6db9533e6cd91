"""Actor faults at every place the driver calls an actor, on the session's real trainer (vLLM
generator, HF scorers, PEFT learner): the run completes, and its per-step metrics, samples,
evaluations, checkpoints and final adapter equal an uninterrupted run's exactly. No step is
lost, doubled or restarted, and no checkpoint is read: recovery works from the driver's
object-store copy of the committed state (the runs write checkpoints only because a
checkpoint's state fetch is one of the places).

Two kinds of fault:
- in a step's phases (Fault, tests/fault_injection.py: role x phase x before/after, or an idle kill
  between calls): the actor dies inside its own call, as an OOM kill or a segfault would;
- at a place outside them (Kill, below: the evaluation, the sync check, a checkpoint's state
  fetch, the adapter's, a restore, the trainer's start, and a second death during a
  recovery): the actor is killed right before the driver's first call of a named Roles
  method in that place, so the call meets it restarting or restarted without its state.
Which places and calls exist is derived from the code: the straight runs record every Roles
call with the supervised place it was made in (ppo_ray.driver.supervisor.PLACES), and
test_every_actor_call_is_supervised_and_has_a_fault_case fails for a call made outside the
supervisor, for a Roles method that no case reaches, and for a place without a case.

One snapshot of the session trainer (a checkpoint written once, restored before each run),
then STEPS steps straight, in each mode (synchronous and max_staleness 1), as the
reference. Each case restores the snapshot, arms one fault and runs the same steps.
Tolerance: none in the synchronous step (float32 on the CPU, seeded sampling, seeded
shuffles, the learner's state restored bit for bit, old logprobs recomputed by the learner);
a case whose runs differ only in their last digits is run once more, and must then be exact
(tests/exact.py says why).
In overlap mode the PPO ratio's denominator is the generator's own logprob of each sample,
and vLLM's CPU kernels do not reproduce those bit for bit from one call to the next (the same
batch twice on one engine: up to 7e-7 apart, measured), so there the samples must be equal
and the numbers equal to what such rounding allows: each old logprob within one float32
logprob tolerance of the tiny model (TINY_LOGPROB_TOL, tests/tolerances.py), so a statistic
built from them within that tolerance times (1 + its size), and the adapter within 1% of one
Adam step (lr) per step (measured differences ~4e-8, i.e. ~1e-5 of a step). A lost or
doubled step moves both by orders of magnitude more.

The default run keeps the cases that cost no vLLM restart and prove a rule of their own (the
reference and the reward scorer in the synchronous step, the learner in and between
updates, the generator in an overlap-mode prefetch, the reward actor in the evaluation, the
learner in the sync check, at a checkpoint and during a recovery); the whole matrix is
marked slow (a generator restart starts a vLLM engine, a start case a whole trainer).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Optional

import pytest
import ray

from exact import rerun_if_last_digits_differ
from fault_injection import Fault, role_kind
from helpers import FAULT_EVERY as EVERY, FAULT_STEPS as STEPS, assert_same_fault_run, fault_run
from ppo_ray.data import bundled_prompts
from ppo_ray.driver.roles import Roles
from ppo_ray.driver.supervisor import PLACES

pytestmark = pytest.mark.usefixtures("ray_session")

RECOVERY = " recovery"  # a Kill's place suffix: the call made while recovering from an earlier failure there


# ----------------------------------------------------------------------------- driver-side kills
@dataclass(frozen=True)
class Kill:
    """Kill actor `role` right before the driver's first call of Roles.`method` in supervised
    place `where` (ppo_ray.driver.supervisor.PLACES; "<place> recovery" for the calls of its
    recovery) at step `offset` after the snapshot (the supervisor's step: the committed one
    outside the step). The kill is a SIGKILL of the actor's process (kill -9, as the issue's
    user did), at once, whatever the actor is doing (a call in flight dies with it), waited
    for until Ray's control store sees the death: the call then meets the actor restarting
    (or, if the restart is quicker than that, restarted without its state)."""

    role: str
    where: str
    method: str
    offset: int


class DriverFaults:
    """Test hook on one trainer (nothing in the product): wraps its supervisor's run, to know
    the place of each call, and every Roles method that calls actors, to record (place,
    method) and to fire armed Kills. `calls` is the record; remove() puts everything back."""

    def __init__(self, roles: Roles, supervisor):
        self.roles, self.supervisor = roles, supervisor
        self.places: list[tuple[str, int]] = []  # the supervised places the driver is in, innermost last
        self.calls: set[tuple[Optional[str], str]] = set()
        self.armed: list[tuple[Kill, int]] = []  # (kill, absolute step)
        self.fired: list[Kill] = []
        run = supervisor.run

        def tracked_run(attempt, *, where, step, recover):
            def inside(place, fn):
                def call(*args):
                    self.places.append((place, step))
                    try:
                        return fn(*args)
                    finally:
                        self.places.pop()
                return call
            return run(inside(where, attempt), where=where, step=step, recover=inside(where + RECOVERY, recover))

        supervisor.run = tracked_run
        for name in RECORDED:
            setattr(roles, name, self._wrap(name, getattr(Roles, name)
                                            if isinstance(inspect.getattr_static(Roles, name), staticmethod)
                                            else getattr(roles, name)))

    def _wrap(self, name: str, method):
        def call(*args, **kwargs):
            where, step = self.places[-1] if self.places else (None, None)
            self.calls.add((where, name))
            for kill, at in list(self.armed):
                if (kill.where, kill.method, at) == (where, name, step):
                    self.armed.remove((kill, at))
                    self._kill(kill.role)
                    self.fired.append(kill)
            return method(*args, **kwargs)
        return call

    def arm(self, kills: list[Kill], start: int) -> None:
        self.armed = [(k, start + k.offset) for k in kills]

    def _kill(self, role: str) -> None:
        kill_actor(self.roles.actor(role))

    def remove(self) -> None:
        del self.supervisor.run
        for name in RECORDED:
            delattr(self.roles, name)


# Every public Roles method is in exactly one of these, or RECORDED: adding a method fails
# test_every_actor_call_is_supervised_and_has_a_fault_case until it is placed.
NO_ACTOR_CALL = {"names": "role names", "all": "the handles", "actor": "a handle by role",
                 "role_of": "reads an error", "store": "ray.put of a driver-side value",
                 "restarted": "forgets a restarted actor's measured calls (ppo_ray.deadlines)",
                 "wait_any": "ray.wait on refs, nothing fetched (a death shows in the fetch after it)"}
TEARDOWN = {"release": "kills the actors at the end: nothing to redo"}
# Calls whose job is to see deaths: a death there is their answer, not a fault to recover from.
SEES_DEATHS = {"wait_for_actors": "waits for restarts (an actor that dies again is waited for again)",
               "intact": "whether a generation survived: a death makes it False"}
# Methods whose actor calls are other Roles methods (each recorded and killed on its own).
COMPOSED = {"bring_generators_to": ("generator_versions", "load_adapter")}


def public_methods() -> set[str]:
    return {name for name, attr in vars(Roles).items()
            if not name.startswith("_") and (isinstance(attr, staticmethod) or inspect.isfunction(attr))}


RECORDED = sorted(public_methods() - set(NO_ACTOR_CALL) - set(TEARDOWN))

# The step's places are covered by the Fault matrix (every role dying before and after its
# call in each phase, and between calls); these are the Fault phases' places.
FAULT_PLACES = {"generate": "step", "score": "step", "update": "step", "idle": "step", "prefetch": "prefetch",
                "sync": "sync"}
FAULT_METHODS = {"generate", "reference_logprobs", "score", "update", "learner_stats", "fetch", "load_adapter"}

# (mode, kills, default run?) — offsets: 2 = the second step after the snapshot (its
# evaluation, sync check and checkpoint), 0 = the restore of the snapshot, STEPS = after the
# last step (save_adapter); "start" cases build a trainer of their own.
KILL_CASES = [
    ("sync", [Kill("reward", "evaluation", "score", 2)], True),  # the kill -9 of the reward actor
    ("sync", [Kill("generator-0", "evaluation", "generate", 2)], False),
    ("sync", [Kill("generator-0", "evaluation", "fetch", 2)], False),  # dies while it samples
    ("sync", [Kill("learner", "evaluation", "attribution", 2)], False),  # the step's tensors are lost with it
    ("sync", [Kill("reference", "evaluation", "held_out", 2)], False),  # the eval samples' reference pass
    ("sync", [Kill("learner", "sync check", "sync_gaps", 2)], True),
    ("sync", [Kill("generator-0", "sync check", "sync_gaps", 2)], False),
    ("sync", [Kill("learner", "checkpoint", "fetch", 2)], True),
    ("sync", [Kill("learner", "adapter", "fetch", STEPS)], False),
    ("sync", [Kill("learner", "restore", "restore_learners", 0)], False),
    ("sync", [Kill("generator-0", "restore", "load_adapter", 0)], False),
    # a second death while recovering from the first
    ("sync", [Kill("reward", "evaluation", "score", 2),
              Kill("learner", "evaluation" + RECOVERY, "restore_learners", 2)], True),
    ("sync", [Kill("reward", "evaluation", "score", 2),
              Kill("generator-0", "evaluation" + RECOVERY, "generator_versions", 2)], False),
    ("sync", [Kill("generator-0", "evaluation", "generate", 2),
              Kill("generator-0", "evaluation" + RECOVERY, "load_adapter", 2)], False),
    ("overlap", [Kill("generator-0", "evaluation", "generate", 2)], False),
    ("overlap", [Kill("reward", "evaluation", "score", 2)], False),
]
START_CASES = [Kill("learner", "start", "learner_state", 0), Kill("learner", "start", "current_weights", 0)]

# (role, phase, when, which step after the snapshot: 1..STEPS)
SYNC_CASES = [
    *[("generator-0", phase, when, 2) for phase in ("generate", "sync") for when in ("before", "after")],
    *[(role, "score", when, 2) for role in ("reference", "reward") for when in ("before", "after")],
    ("learner", "update", "before", 2), ("learner", "update", "after", 2),
    *[(role, "idle", "before", 2) for role in ("generator-0", "reference", "reward", "learner")],
]
OVERLAP_CASES = [
    ("generator-0", "generate", "before", 1), ("generator-0", "generate", "after", 1),  # the first step's own batch
    ("generator-0", "prefetch", "before", 2), ("generator-0", "prefetch", "after", 2),
    *[case for case in SYNC_CASES if case[1] != "generate"],
]
DEFAULT = {("sync", "reference", "score", "after"), ("sync", "reward", "score", "before"),
           ("sync", "learner", "update", "after"), ("sync", "learner", "idle", "before"),
           ("overlap", "generator-0", "prefetch", "after")}


# The overlap-mode cases that repeat a synchronous case's role, phase and moment are marked matrix
# (`-m matrix`; CI leaves them out), except the generator's death before its sync: CI keeps
# the overlap mode's own cases (its prefetch, the first step's own batch) and that one.
OVERLAP_REPEATS = {("overlap", *case[:3]) for case in SYNC_CASES if case[1] != "generate"} - {
    ("overlap", "generator-0", "sync", "before")}


def _cases():
    for mode, cases in (("sync", SYNC_CASES), ("overlap", OVERLAP_CASES)):
        for role, phase, when, offset in cases:
            marks = () if (mode, role, phase, when) in DEFAULT else (pytest.mark.slow,)
            if (mode, role, phase, when) in OVERLAP_REPEATS:
                marks += (pytest.mark.matrix,)
            yield pytest.param(mode, role, phase, when, offset, marks=marks,
                               id=f"{mode}-{role}-{phase}" + ("" if phase == "idle" else f"-{when}"))


def _kill_cases():
    for mode, kills, default in KILL_CASES:
        yield pytest.param(mode, kills, marks=() if default else (pytest.mark.slow,),
                           id=f"{mode}-" + "-then-".join(f"{k.role}-{k.where}-{k.method}" for k in kills)
                           .replace(" ", "_"))


def kill_actor(actor, timeout_s: float = 120.0) -> None:
    """SIGKILL the actor's process now (on this node: the tests' Ray is local) and wait until
    Ray's control store has seen it die (its state leaves ALIVE or its restart count moves)."""
    import os
    import signal
    import time

    from ray._private.state import actors

    before = actors(actor._actor_id.hex())
    assert before["State"] == "ALIVE", before["State"]
    os.kill(before["Pid"], signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while True:
        now = actors(actor._actor_id.hex())
        if now["State"] != "ALIVE" or now["NumRestarts"] != before["NumRestarts"]:
            return
        assert time.monotonic() < deadline, f"Ray did not see the kill of pid {before['Pid']} within {timeout_s} s"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- one run and its outcome
def _configure(trainer, base, mode: str) -> None:
    trainer.config = base.replace(max_staleness=int(mode == "overlap"), eval_every=EVERY, checkpoint_every=EVERY,
                                  report_to=[])


def _threads(trainer) -> dict:
    """{actor: (pid, torch threads, cores it may run on)}, for a failure's message."""
    def probe(_host):
        import os

        import torch

        return os.getpid(), torch.get_num_threads(), len(os.sched_getaffinity(0))

    roles = trainer.roles
    actors = {"learner": roles.learner, "reference": roles.reference, "reward": roles.reward,
              **{f"generator-{i}": g for i, g in enumerate(roles.generators)}}
    return {name: ray.get(actor.__ray_call__.remote(probe)) for name, actor in actors.items()}


@pytest.fixture(scope="module")
def straight(tiny_trainer, tmp_path_factory):
    """(trainer, snapshot checkpoint, {mode: Outcome}, the Roles calls the straight runs made
    as {(place, method)})."""
    trainer = tiny_trainer
    base = trainer.config
    if trainer.step % EVERY:
        # the kill cases aim at the evaluation and the checkpoint of the snapshot's step + 2, which
        # come every EVERY steps counted from 0: the session trainer's earlier tests may leave it
        # at any step, so one step first brings the snapshot to a multiple of EVERY
        trainer.config = base.replace(eval_every=0, checkpoint_every=0, report_to=[])
        try:
            trainer.train(bundled_prompts(), steps=1, progress=False)
        finally:
            trainer.config = base
    assert trainer.step % EVERY == 0, trainer.step
    trainer.run_dir = tmp_path_factory.mktemp("fault-snapshot")
    snapshot = trainer.save_checkpoint()
    trainer.run_dir = None
    reference = {}
    hook = DriverFaults(trainer.roles, trainer.supervisor)
    try:
        for mode in ("sync", "overlap"):
            _configure(trainer, base, mode)
            trainer.restore(snapshot)
            reference[mode] = fault_run(trainer, tmp_path_factory.mktemp(f"straight-{mode}"))
    finally:
        hook.remove()
        trainer.config = base
    yield trainer, snapshot, reference, hook.calls
    trainer.config = base


@pytest.mark.parametrize("mode,role,phase,when,offset", list(_cases()))
@rerun_if_last_digits_differ
def test_a_fault_leaves_the_run_as_if_it_had_not_happened(straight, tmp_path, mode, role, phase, when, offset):
    trainer, snapshot, reference, _ = straight
    base = trainer.config
    _configure(trainer, base, mode)
    try:
        trainer.restore(snapshot)
        start = trainer.step
        fault = Fault(role, start + offset, phase, when)
        trainer.inject_faults([fault])
        before = len(trainer.retries)
        try:
            got = fault_run(trainer, tmp_path)
        finally:
            trainer.inject_faults([])
    finally:
        trainer.config = base
    failures = trainer.retries[before:]
    if phase != "idle" or role in ("generator-0", "learner"):
        # the fault fired, and its actor is the one the trainer saw fail (a restarted
        # generator or learner has lost its adapter: it must be noticed, not used)
        assert failures and failures[0]["role"] == role and failures[0]["step"] == start + offset, failures
    try:
        assert_same_fault_run(got, reference[mode], mode == "sync", fault, trainer.config.learning_rate)
    except AssertionError as error:  # what a float difference can come from: each actor's process and threads
        raise type(error)(f"{error}\n(actors now: {_threads(trainer)})") from None
    # every generator holds the committed version (a restarted one was brought back to it)
    assert ray.get([g.version.remote() for g in trainer.roles.generators]) == [trainer.version]


@pytest.mark.parametrize("mode,kills", list(_kill_cases()))
@rerun_if_last_digits_differ
def test_an_actor_lost_outside_the_steps_phases_leaves_the_run_as_if_it_had_not_happened(straight, tmp_path, mode,
                                                                                         kills):
    """The kill fires where it is aimed, the place that called the actor redoes its call, and
    everything the run produced equals the straight run's."""
    trainer, snapshot, reference, _ = straight
    base = trainer.config
    _configure(trainer, base, mode)
    before = len(trainer.retries)
    start = json.loads((snapshot / "trainer.json").read_text())["step"]
    hook = DriverFaults(trainer.roles, trainer.supervisor)
    try:
        hook.arm(kills, start)
        trainer.restore(snapshot)
        got = fault_run(trainer, tmp_path, live=kills[0].where != "adapter")
    finally:
        hook.remove()
        trainer.config = base
        trainer.roles.wait_for_actors()  # the next case finds every actor up (after save_adapter's kill too)
    assert hook.fired == kills, f"aimed {kills}, fired {hook.fired}"
    failures = trainer.retries[before:]
    first = kills[0]
    if first.where == "checkpoint":  # the state's fetch reads the object store: the next step finds the learner lost
        assert failures[:1] == [{"step": start + first.offset + 1, "role": first.role, "where": "step"}], failures
    elif first.where != "adapter":  # nothing calls the learner after save_adapter: no failure is seen
        assert failures[:1] == [{"step": start + first.offset, "role": first.role, "where": first.where}], failures
        assert len(failures) == len(kills), failures  # a death during the recovery costs a retry too
    assert_same_fault_run(got, reference[mode], mode == "sync", kills, trainer.config.learning_rate)
    assert ray.get([g.version.remote() for g in trainer.roles.generators]) == [trainer.version]


@pytest.mark.slow
@pytest.mark.parametrize("kill", START_CASES, ids=lambda k: f"learner-start-{k.method}")
@rerun_if_last_digits_differ
def test_a_learner_lost_while_the_trainer_starts(straight, tmp_path, monkeypatch, kill):
    """A trainer of its own (the shared one has started): its learner is killed in the
    constructor's calls; its first STEPS steps equal the shared trainer's from its initial
    state (same config: the learner's initialisation is seeded)."""
    import ppo_ray.trainer as trainer_module
    from helpers import tiny_test_config
    from ppo_ray.trainer import PPOTrainer

    shared, _, _, _ = straight
    base = shared.config
    hooks, supervisor_class = [], trainer_module.Supervisor

    def supervised(roles, metrics, max_retries):  # the trainer's Supervisor, with the hook armed
        supervisor = supervisor_class(roles, metrics, max_retries)
        hook = DriverFaults(roles, supervisor)
        hook.arm([kill], 0)
        hooks.append(hook)
        return supervisor

    monkeypatch.setattr(trainer_module, "Supervisor", supervised)
    trainer = PPOTrainer(tiny_test_config(max_actor_restarts=100))
    try:
        hook = hooks[0]
        assert hook.fired == [kill]
        assert trainer.retries == [{"step": 0, "role": "learner", "where": "start"}]
        assert None not in {where for where, _ in hook.calls}, hook.calls
        _configure(trainer, base, "sync")
        got = fault_run(trainer, tmp_path / "killed")
    finally:
        trainer.shutdown()
    _configure(shared, base, "sync")
    try:
        shared.restore(shared.initial_checkpoint)
        want = fault_run(shared, tmp_path / "straight")
    finally:
        shared.config = base
    assert_same_fault_run(got, want, True, kill, base.learning_rate)


# ----------------------------------------------------------------------------- the list, from the code
def test_every_actor_call_is_supervised_and_has_a_fault_case(straight):
    """Every Roles call of the straight runs (steps, prefetches, syncs, sync checks,
    evaluations, checkpoints, save_adapter, restores) was made inside a supervised place;
    every Roles method that calls actors is reached by a fault case (or sees deaths by
    design); every place the runs called actors in, and every place of PLACES, has one."""
    _, _, _, calls = straight
    outside = sorted(method for where, method in calls if where is None)
    assert not outside, f"Roles calls made outside the supervisor (a death there would end the run): {outside}"
    public = {name for name, attr in vars(Roles).items() if not name.startswith("_")
              and (isinstance(attr, staticmethod) or inspect.isfunction(attr))}
    assert public == set(RECORDED) | set(NO_ACTOR_CALL) | set(TEARDOWN)
    kills = [k for _, ks, _ in KILL_CASES for k in ks] + START_CASES
    killed = {(k.where, k.method) for k in kills}
    reached = FAULT_METHODS | {k.method for k in kills}
    reached |= {m for m, parts in COMPOSED.items() if set(parts) <= reached}
    uncovered = sorted(m for m in RECORDED if m not in SEES_DEATHS and m not in reached)
    assert not uncovered, f"Roles methods that no fault case reaches: {uncovered}"
    fault_places = set(FAULT_PLACES.values())
    missing = sorted((where, method) for where, method in calls if method not in SEES_DEATHS
                     and where not in fault_places and (where, method) not in killed
                     and not any((where, part) in killed for part in COMPOSED.get(method, ())))
    assert not missing, f"(place, Roles call) of the straight runs without a fault case: {missing}"
    assert set(PLACES) <= fault_places | {k.where for k in kills}, "a supervised place without a fault case"
    assert set(RECORDED) - set(SEES_DEATHS) - set(COMPOSED) <= set(CALLS_ROLES)
    for kill in kills:  # each kills an actor that the call talks to
        assert role_kind(kill.role) in CALLS_ROLES[kill.method], kill


# the role kinds each Roles method calls or waits for (fetch: whatever made the refs)
CALLS_ROLES = {"generate": {"generator"}, "reference_logprobs": {"reference"}, "score": {"reward"},
               "update": {"learner"}, "learner_stats": {"learner"}, "load_adapter": {"generator"},
               "sync_gaps": {"generator", "learner"}, "generator_versions": {"generator"},
               "current_weights": {"learner"}, "learner_state": {"learner"}, "attribution": {"learner"}, "held_out": {"reference"},
               "restore_learners": {"learner"}, "fetch": {"generator", "reference", "reward", "learner"}}


def test_fault_specs_are_checked():
    with pytest.raises(ValueError, match="takes part in"):
        Fault("reference", 1, "update")
    with pytest.raises(ValueError, match="not one of"):
        Fault("critic", 1, "update")
    with pytest.raises(ValueError, match="when"):
        Fault("learner", 1, "update", "during")
    assert Fault("learner-1", 3, "update", "after").method == "update"
    assert Fault("generator-0", 3, "idle").method is None


def test_fault_injection_lives_in_the_tests():
    """The product carries no fault injection: the trainer, Roles and the hosts have none of
    its names; tests/fault_injection.py's classes are subclasses of the product's, one per
    role kind, whose fault points keep each method's Ray options (num_returns)."""
    from fault_injection import FAULTY_HOSTS, FaultyTrainer
    from ppo_ray.driver.hosts import HOSTS
    from ppo_ray.trainer import PPOTrainer

    hooks = {"inject_faults", "_prepare_faults", "arm_fault", "arm_bad_sync", "kill_now", "exit_now"}
    for cls in (PPOTrainer, Roles, *HOSTS.values()):
        assert not hooks & set(dir(cls)), f"{cls.__name__} has {sorted(hooks & set(dir(cls)))}"
    assert PPOTrainer.hosts is HOSTS and FaultyTrainer.hosts is FAULTY_HOSTS
    assert FAULTY_HOSTS.keys() == HOSTS.keys()
    for kind, faulty in FAULTY_HOSTS.items():
        assert issubclass(faulty, HOSTS[kind])
        for name, method in vars(faulty).items():
            parent = getattr(HOSTS[kind], name, None)
            if callable(method) and parent is not None:
                assert getattr(method, "__ray_num_returns__", None) == getattr(parent, "__ray_num_returns__", None), name
