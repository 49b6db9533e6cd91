"""Environment workers (issue 58, ppo_ray.driver.env_pool.EnvWorkerPool) on real Ray actors:

- the pool's outcomes equal LocalEnvRunner's on the same calls, round after round, and every
  episode finds its live instance (no worker replays a history);
- a step that hangs is cut at env_timeout_s (failure "timeout"), its worker replaced, and the
  other episodes that lived there go on, rebuilt by the replacement, with the local outcomes;
- a worker killed from outside between two rounds changes no outcome, and nothing fails;
- a step that kills its own worker is run twice (the second time on a replacement), then fails;
- release closes the environments (each records its close in a file the test reads);
- a spec that does not load fails the pool's start, naming the spec.

The workers import this module by its spec (f"{__name__}:Walker"): the session's Ray puts
tests/ on the workers' PYTHONPATH (conftest.ray_session). Outcomes are compared exactly, the
seconds aside: they are strings, and rewards that are small integers, exact in float64.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time

import pytest

from ppo_ray.driver.cluster import ClusterError
from ppo_ray.driver.env_pool import EnvWorkerPool, slot_of
from ppo_ray.environments import EnvCall, LocalEnvRunner

SPEC = f"{__name__}:Walker"
START_S = 120.0  # the workers' start-up limit (placement_timeout_s): generous on a busy 2-core machine
WAIT_S = 60.0    # the conditions the tests wait on (a close recorded, a kill landed)


class Walker:
    """Deterministic given (row, seed) and the actions: each observation is a digest of the
    whole history, so an instance that missed a step (or was rebuilt wrongly) answers otherwise.
    The action "hang" sleeps far past any env_timeout_s here, "exit" ends the worker's process;
    close() appends the episode's name to the file row["closes"] names, where the row has one."""

    def reset(self, row: dict, seed: int) -> str:
        self.row, self.turns, self.state = row, 0, f"{row['name']}:{seed}"
        return f"start {self.state}"

    def step(self, action: str) -> tuple[str, float, bool]:
        if action == "hang":
            time.sleep(600)  # the pool kills the worker long before
        if action == "exit":
            os._exit(1)
        self.turns += 1
        self.state = hashlib.blake2b(f"{self.state}|{action}".encode(), digest_size=6).hexdigest()
        return f"obs {self.state}", float(len(action) * self.turns), self.turns >= 3

    def close(self) -> None:
        if self.row.get("closes"):
            with open(self.row["closes"], "a") as f:
                f.write(self.row["name"] + "\n")


def round_calls(keys: list[str], turn: int, closes: str = "", last: dict | None = None) -> list[EnvCall]:
    """Every episode's call of round `turn`: its reset (turn 0), else a step on its turn-th action
    with the actions before it (`last[key]` instead of an episode's turn-th, where given)."""
    calls = []
    for key in keys:
        actions = tuple(f"{key}-act{t}" for t in range(1, turn + 1))
        if key in (last or {}):
            actions = (*actions[:-1], last[key])
        # an episode's seed is its own (by its key), whichever episodes share the round
        calls.append(EnvCall(key, {"name": key, "closes": closes}, seed=100 + KEYS.index(key), actions=actions))
    return calls


def timeless(outcomes) -> list:
    """The outcomes without their seconds (the only field that is not deterministic)."""
    return [dataclasses.replace(o, seconds=0.0) for o in outcomes]


def replays(ray, pool: EnvWorkerPool) -> list[int]:
    """Each worker's count of instances rebuilt from a history, in slot order."""
    return ray.get([w.replays.remote() for w in pool.workers])


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S:g} s"
        time.sleep(0.05)  # the polling interval, not a timing assumption


@pytest.fixture
def pool_of(ray_session):
    """make(timeout_s, **kw): an EnvWorkerPool of 2 workers over Walker that reserve no CPU (the
    session's Ray has other tests' actors on its CPUs), closed at the end."""
    made = []

    def make(timeout_s: float = 60.0) -> EnvWorkerPool:
        made.append(EnvWorkerPool(SPEC, 2, timeout_s, 0.0, START_S))
        return made[-1]

    yield make
    for pool in made:
        pool.close()


KEYS = [f"ep{i}" for i in range(8)]


def test_keys_spread_over_both_workers():
    """The tests' episodes: at least two on each worker (blake2b is the same on every machine)."""
    slots = [slot_of(k, 2) for k in KEYS]
    assert min(slots.count(0), slots.count(1)) >= 2


def test_pool_outcomes_equal_the_local_runners(ray_session):
    from helpers import tiny_test_config

    config = tiny_test_config(environment=SPEC, env_workers=2, env_worker_num_cpus=0, placement_timeout_s=START_S)
    pool = EnvWorkerPool.from_config(config)
    try:
        assert (pool.spec, pool.size, pool.timeout_s) == (SPEC, 2, config.env_timeout_s)
        local = LocalEnvRunner(Walker)
        for turn in range(4):
            calls = round_calls(KEYS, turn)
            outcomes = pool.run(calls)
            assert timeless(outcomes) == timeless(local.run(calls)), turn
            assert {o.failure for o in outcomes} == {""}
        assert replays(ray_session, pool) == [0, 0]  # every call found its episode's live instance
        assert (pool.timeouts, pool.replacements, pool.reruns) == (0, 0, 0)
    finally:
        pool.close()


def test_a_hanging_step_is_cut_and_its_workers_other_episodes_go_on(ray_session, pool_of):
    pool = pool_of(timeout_s=2.0)
    hang = KEYS[0]
    slot = slot_of(hang, 2)
    neighbours = [k for k in KEYS[1:] if slot_of(k, 2) == slot]
    local = LocalEnvRunner(Walker)
    for turn in (0, 1):
        calls = round_calls(KEYS, turn)
        assert timeless(pool.run(calls)) == timeless(local.run(calls))
    before = pool.worker_ids()

    calls = round_calls(KEYS, 2, last={hang: "hang"})
    outcomes = pool.run(calls)
    assert outcomes[0].failure == "timeout"
    assert "ran past env_timeout_s=2 s" in outcomes[0].message
    assert timeless(outcomes[1:]) == timeless(local.run(calls[1:]))
    after = pool.worker_ids()
    assert after[slot] != before[slot] and after[1 - slot] == before[1 - slot]
    assert (pool.timeouts, pool.replacements, pool.reruns) == (1, 1, 0)
    pool.release([hang])
    local.release([hang])

    rest = KEYS[1:]
    for turn in (3, 4):  # later rounds: the replacement holds the rebuilt instances
        calls = round_calls(rest, turn)
        outcomes = pool.run(calls)
        assert timeless(outcomes) == timeless(local.run(calls)), turn
        assert {o.failure for o in outcomes} == {""}
    # the hanging episode's neighbours were rebuilt once each, on the replacement, in round 2
    assert replays(ray_session, pool)[slot] == len(neighbours)
    assert pool.worker_ids() == after


def test_a_worker_killed_between_rounds_changes_nothing(ray_session, pool_of):
    pool = pool_of()
    local = LocalEnvRunner(Walker)
    for turn in (0, 1):
        calls = round_calls(KEYS, turn)
        assert timeless(pool.run(calls)) == timeless(local.run(calls))
    before, victim = pool.worker_ids(), pool.workers[0]
    ray_session.kill(victim, no_restart=True)

    def dead() -> bool:
        try:
            ray_session.get(victim.__ray_ready__.remote(), timeout=WAIT_S)
        except ray_session.exceptions.RayActorError:
            return True
        return False

    wait_for(dead, "the killed worker is dead")
    for turn in (2, 3):
        calls = round_calls(KEYS, turn)
        outcomes = pool.run(calls)
        assert timeless(outcomes) == timeless(local.run(calls)), turn
        assert {o.failure for o in outcomes} == {""}
    after = pool.worker_ids()
    assert after[0] != before[0] and after[1] == before[1]
    # the first call for slot 0 met the dead worker and ran again on its replacement, which
    # rebuilt each of its episodes once
    assert (pool.timeouts, pool.replacements, pool.reruns) == (0, 1, 1)
    assert replays(ray_session, pool) == [sum(slot_of(k, 2) == 0 for k in KEYS), 0]


def test_a_step_that_kills_its_worker_fails_after_two_tries(pool_of):
    """The step that ends its worker's process is run again on a replacement (a worker killed
    from outside looks the same), ends that one too, and fails; its neighbours are unharmed."""
    pool = pool_of()
    local = LocalEnvRunner(Walker)
    for turn in (0, 1):
        calls = round_calls(KEYS, turn)
        assert timeless(pool.run(calls)) == timeless(local.run(calls))
    calls = round_calls(KEYS, 2, last={KEYS[0]: "exit"})
    outcomes = pool.run(calls)
    assert outcomes[0].failure == "exception"
    assert "its environment worker died under it 2 times" in outcomes[0].message
    assert timeless(outcomes[1:]) == timeless(local.run(calls[1:]))
    assert (pool.timeouts, pool.replacements, pool.reruns) == (0, 2, 1)


def test_release_closes_the_environments(pool_of, tmp_path):
    closes = tmp_path / "closes.txt"
    closes.touch()
    pool = pool_of()
    for turn in (0, 1):
        pool.run(round_calls(KEYS, turn, closes=str(closes)))

    def closed() -> list[str]:
        return sorted(closes.read_text().split())

    pool.release(KEYS[:3])
    wait_for(lambda: closed() == KEYS[:3], "the first three episodes closed")
    pool.release(KEYS[3:])
    wait_for(lambda: closed() == KEYS, "every episode closed")


@pytest.mark.parametrize("spec", [f"{__name__}:Nope", "no_such_module_for_env_pool:Env"])
def test_a_spec_that_does_not_load_fails_the_start(ray_session, spec):
    with pytest.raises(ClusterError, match=re.escape(f"an environment worker failed to start (environment {spec!r})")):
        EnvWorkerPool(spec, 2, 60.0, 0.0, START_S)
