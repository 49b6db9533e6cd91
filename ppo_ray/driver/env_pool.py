"""The environment workers (config.env_workers): a pool of Ray actors that holds the episodes'
environments and runs their resets and steps, each under env_timeout_s, a stuck or dead worker
replaced (EnvWorkerPool, a ppo_ray.environments.EnvRunner, started by the generator's host).

An episode's calls always go to the same worker (its key's hash), so its environment lives on
between turns; a replaced worker's episodes are rebuilt on their next call, from the history
each call carries (EnvCall.actions), so a lost worker costs replays, never an episode.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque

import ray

from ppo_ray.config import ConfigSlice, PPOConfig
from ppo_ray.driver.cluster import ClusterError, format_resources, user_resources
from ppo_ray.driver.reward_pool import calling_actor
from ppo_ray.driver.roles import EXIT_TIMEOUT_S, end_actors
from ppo_ray.environments import EnvCall, EnvOutcome, EnvWorker

TRIES = 2  # runs of one call when its worker dies under it: the first, and one on the replacement


def slot_of(key: str, size: int) -> int:
    """The worker of the episode `key` among `size`: a stable hash (blake2b, not Python's hash(),
    which is salted per process), so every call of an episode finds its live instance."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % size


class EnvWorkerPool:
    """The environment workers (config.env_workers): `size` Ray actors, each a
    ppo_ray.environments.EnvWorker holding the environments of the episodes routed to it
    (slot_of their key) and running one call at a time, started by the generator's actor (so
    they end with it) outside the run's placement group, env_worker_num_cpus each.

    `run` hands each worker its calls in order, one at a time; a call still running env_timeout_s
    after it was handed out is a timeout (failure "timeout"): its worker is killed (ray.kill: a
    Python step that sleeps or spins cannot be interrupted in its thread) and a fresh one
    started, which takes calls once it is ready, so its start-up does not count against a call's
    limit. The other episodes that lived on a killed worker are rebuilt by its replacement on
    their next call (EnvHolder replays the history the call carries). A worker whose process dies
    mid-call (killed from outside, out of memory) is replaced the same way and the call run again
    on the replacement (TRIES runs in all, then failure "exception"): the episodes go on as if
    nothing had happened. The reward workers' pool (ppo_ray.driver.reward_pool) is its model."""

    def __init__(self, spec: str, size: int, timeout_s: float, num_cpus: float, start_timeout_s: float):
        if size < 1:
            raise ValueError(f"an environment-worker pool needs env_workers >= 1, got {size}")
        self.spec, self.size, self.timeout_s, self.num_cpus = spec, size, timeout_s, num_cpus
        self.start_timeout_s = start_timeout_s
        self.worker_class = ray.remote(EnvWorker)
        self.prefix, self.namespace = calling_actor()
        self.started = 0       # workers started so far (names stay unique across replacements)
        self.timeouts = 0      # calls cut at env_timeout_s
        self.replacements = 0  # workers killed and started afresh (timeouts and deaths)
        self.reruns = 0        # calls run again after their worker died under them
        self.workers = [self._start() for _ in range(size)]
        self.starting: dict = {}  # ready ref -> (slot, deadline) of replacements not yet ready
        deadline = time.monotonic() + start_timeout_s
        try:
            self._ready([w.__ray_ready__.remote() for w in self.workers], deadline)
        except BaseException:
            for worker in self.workers:
                ray.kill(worker)
            raise

    @classmethod
    def from_config(cls, config: "ConfigSlice | PPOConfig") -> "EnvWorkerPool":
        return cls(config.environment, config.env_workers, config.env_timeout_s, config.env_worker_num_cpus,
                   config.placement_timeout_s)

    def _start(self):
        self.started += 1
        name = f"{self.prefix}-env-{self.started}" if self.prefix else None
        return self.worker_class.options(num_cpus=self.num_cpus, max_restarts=0, max_task_retries=0, name=name,
                                         namespace=self.namespace if name else None).remote(self.spec)

    def _ready(self, refs: list, deadline: float) -> None:
        """Wait for workers' constructors; ClusterError naming the demand when they do not finish
        in time, or the spec when one fails (its environment does not load)."""
        try:
            ray.get(refs, timeout=max(deadline - time.monotonic(), 0.0))
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"environment workers did not start within placement_timeout_s={self.start_timeout_s:g} s: each asks "
                f"for env_worker_num_cpus={self.num_cpus:g} CPUs (env_workers={self.size}); free now in all: "
                f"{format_resources(user_resources(ray.available_resources()))}") from None
        except ray.exceptions.RayActorError as e:
            raise ClusterError(f"an environment worker failed to start (environment {self.spec!r}): {e}") from e

    def _replace(self, slot: int) -> None:
        """Kill the worker of `slot` and start its replacement (ready for calls once its
        constructor finished)."""
        ray.kill(self.workers[slot], no_restart=True)
        self.workers[slot] = self._start()
        self.starting[self.workers[slot].__ray_ready__.remote()] = (slot, time.monotonic() + self.start_timeout_s)
        self.replacements += 1

    def close(self) -> None:
        """End every worker (roles.end_actors: each exits on its own, or is killed after
        EXIT_TIMEOUT_S), replacements still starting included (they hold their slots already)."""
        end_actors(self.workers, EXIT_TIMEOUT_S)
        self.workers, self.starting = [], {}

    def worker_ids(self) -> list[str]:
        """The workers' Ray actor ids, in slot order (a replaced worker's slot holds its successor's)."""
        return [w._actor_id.hex() for w in self.workers]

    def release(self, keys: list[str]) -> None:
        """Each worker closes the environments of its episodes among `keys`. Not waited for: Ray
        runs one caller's calls to an actor in order, so a later call finds them released."""
        by_slot: dict[int, list[str]] = {}
        for key in keys if self.workers else ():  # closed: nothing is left to release
            by_slot.setdefault(slot_of(str(key), self.size), []).append(str(key))
        for slot, slot_keys in by_slot.items():
            self.workers[slot].release.remote(slot_keys)  # a dead worker's: its environments went with it

    def run(self, calls: list[EnvCall]) -> list[EnvOutcome]:
        """Each call's outcome, in order; waits for all. Calls of one worker run in their order."""
        outcomes: list = [None] * len(calls)
        queues = [deque() for _ in range(self.size)]  # per slot: indices of the calls waiting for it
        for i, call in enumerate(calls):
            queues[slot_of(call.key, self.size)].append(i)
        tries = [0] * len(calls)
        busy: dict = {}  # call ref -> (call index, slot, deadline)
        while any(queues) or busy:
            held = {slot for _, slot, _ in busy.values()} | {slot for slot, _ in self.starting.values()}
            for slot, queue in enumerate(queues):
                if queue and slot not in held:
                    i = queue.popleft()
                    tries[i] += 1
                    busy[self.workers[slot].call.remote(calls[i])] = (i, slot, time.monotonic() + self.timeout_s)
            deadlines = [d for _, _, d in busy.values()] + [d for _, d in self.starting.values()]
            wait = max(min(deadlines) - time.monotonic(), 0.0)
            ready, _ = ray.wait([*busy, *self.starting], num_returns=1, timeout=wait)
            for ref in ready:
                if ref in self.starting:
                    self.starting.pop(ref)
                    self._ready([ref], time.monotonic())  # a replacement whose constructor failed raises
                    continue
                i, slot, _ = busy.pop(ref)
                try:
                    outcomes[i] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._replace(slot)
                    if tries[i] < TRIES:  # again, first in its worker's line: the replacement replays its episode
                        self.reruns += 1
                        queues[slot].appendleft(i)
                    else:
                        outcomes[i] = EnvOutcome(failure="exception", message=(
                            f"its environment worker died under it {TRIES} times ({type(e).__name__}: {e}); "
                            "a fresh one was started"))
            now = time.monotonic()
            for ref, (i, slot, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[ref]
                    self.timeouts += 1
                    outcomes[i] = EnvOutcome(failure="timeout", seconds=self.timeout_s, message=(
                        f"ran past env_timeout_s={self.timeout_s:g} s (its environment worker was killed and a fresh "
                        "one started; the other episodes it held are rebuilt on their next call)"))
                    self._replace(slot)
            for slot, deadline in self.starting.values():
                if now >= deadline:
                    raise ClusterError(f"a replacement environment worker did not start within placement_timeout_s="
                                       f"{self.start_timeout_s:g} s (env_worker_num_cpus={self.num_cpus:g})")
        return outcomes
