"""The reward workers (config.reward_workers): a pool of Ray actors that runs the reward
functions' guarded calls, each under reward_timeout_s, a stuck or dead worker replaced
(RewardWorkerPool, started by the reward actor's host, ppo_ray.driver.hosts.RewardHost).
"""

from __future__ import annotations

import time
from typing import Optional

import ray

from ppo_ray.driver.cluster import ClusterError, format_resources, user_resources
from ppo_ray.config import ConfigSlice, PPOConfig
from ppo_ray.driver.roles import EXIT_TIMEOUT_S, end_actors


def calling_actor() -> tuple[Optional[str], Optional[str]]:
    """(name, namespace) of the Ray actor this runs in, (None, None) outside one (a test's or a
    benchmark's driver): a pool names its workers after the actor that owns them."""
    context = ray.get_runtime_context()
    try:
        return context.get_actor_name(), context.namespace
    except Exception:  # noqa: BLE001 - outside an actor
        return None, None


class RewardWorkerPool:
    """The reward workers (config.reward_workers): `size` Ray actors, each a
    ppo_ray.rewards.RewardWorker running one call at a time, started by the reward actor (so
    they end with it) outside the run's placement group, reward_worker_num_cpus each. `run`
    hands a round of calls to idle workers as they free up; a call still running
    reward_timeout_s after it was handed out is a timeout: its worker is killed (ray.kill: a
    Python function that sleeps or spins cannot be interrupted in its thread) and a fresh one
    started, which takes calls once it is ready, so its start-up does not count against a
    call's limit. A worker whose process dies mid-call is replaced the same way (the call is an
    exception). The runner of actors.reward.RewardScorer's guarded calls."""

    def __init__(self, reward_funcs: list[str], size: int, timeout_s: float, num_cpus: float,
                 start_timeout_s: float, verifier_options: Optional[dict] = None):
        from ppo_ray.rewards import RewardWorker

        self.funcs, self.size, self.timeout_s, self.num_cpus = list(reward_funcs), size, timeout_s, num_cpus
        self.start_timeout_s, self.verifier = start_timeout_s, dict(verifier_options or {})
        self.worker_class = ray.remote(RewardWorker)
        self.prefix, self.namespace = calling_actor()
        self.started = 0  # workers started so far (names stay unique across replacements)
        self.workers = [self._start() for _ in range(size)]
        self.starting: dict = {}  # ready ref -> (worker, deadline) of replacements not yet ready
        deadline = time.monotonic() + start_timeout_s
        try:
            self._ready([w.__ray_ready__.remote() for w in self.workers], deadline)
        except BaseException:
            for worker in self.workers:
                ray.kill(worker)
            raise

    @classmethod
    def from_config(cls, config: "ConfigSlice | PPOConfig") -> "RewardWorkerPool":
        return cls(config.reward_funcs, config.reward_workers, config.reward_timeout_s, config.reward_worker_num_cpus,
                   config.placement_timeout_s, dict(timeout_s=config.reward_timeout_s,
                                                    retries=config.reward_verifier_retries,
                                                    backoff_s=config.reward_verifier_backoff_s,
                                                    batch_size=config.reward_verifier_batch_size,
                                                    proxy=config.reward_verifier_proxy))

    def _start(self):
        self.started += 1
        name = f"{self.prefix}-worker-{self.started}" if self.prefix else None
        return self.worker_class.options(num_cpus=self.num_cpus, max_restarts=0, max_task_retries=0, name=name,
                                         namespace=self.namespace if name else None).remote(self.funcs, **self.verifier)

    def _ready(self, refs: list, deadline: float) -> None:
        """Wait for workers' constructors; ClusterError naming the demand when they do not finish in time."""
        try:
            ray.get(refs, timeout=max(deadline - time.monotonic(), 0.0))
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"reward workers did not start within placement_timeout_s={self.start_timeout_s:g} s: each asks for "
                f"reward_worker_num_cpus={self.num_cpus:g} CPUs (reward_workers={self.size}); free now in all: "
                f"{format_resources(user_resources(ray.available_resources()))}") from None
        except ray.exceptions.RayActorError as e:
            raise ClusterError(f"a reward worker failed to start (reward_funcs {self.funcs}): {e}") from e

    def _replace(self, worker) -> None:
        """Kill `worker` and start its replacement (ready for calls once its constructor finished)."""
        ray.kill(worker, no_restart=True)
        fresh = self._start()
        self.workers[self.workers.index(worker)] = fresh
        self.starting[fresh.__ray_ready__.remote()] = (fresh, time.monotonic() + self.start_timeout_s)

    def close(self) -> None:
        """End every worker (roles.end_actors: each exits on its own, or is killed after
        EXIT_TIMEOUT_S), replacements still starting included."""
        end_actors([*self.workers, *(w for w, _ in self.starting.values())], EXIT_TIMEOUT_S)
        self.workers, self.starting = [], {}

    def worker_ids(self) -> list[str]:
        """The workers' Ray actor ids, in pool order (a replaced worker's slot holds its successor's)."""
        return [w._actor_id.hex() for w in self.workers]

    def run(self, calls: list) -> list:
        """Each call's (ppo_ray.rewards.RewardCall) CallResult, in order; waits for all."""
        from collections import deque

        from ppo_ray.rewards import EXCEPTION, TIMEOUT, CallResult

        results: list = [None] * len(calls)
        queue = deque(range(len(calls)))
        busy_workers = {w for w, _ in self.starting.values()}
        idle = deque(w for w in self.workers if w not in busy_workers)
        busy: dict = {}  # call ref -> (call index, worker, deadline)
        while queue or busy:
            while queue and idle:
                i, worker = queue.popleft(), idle.popleft()
                busy[worker.call.remote(calls[i])] = (i, worker, time.monotonic() + self.timeout_s)
            deadlines = [d for _, _, d in busy.values()] + [d for _, d in self.starting.values()]
            wait = max(min(deadlines) - time.monotonic(), 0.0)
            ready, _ = ray.wait([*busy, *self.starting], num_returns=1, timeout=wait)
            for ref in ready:
                if ref in self.starting:
                    worker, _ = self.starting.pop(ref)
                    self._ready([ref], time.monotonic())
                    idle.append(worker)
                    continue
                i, worker, _ = busy.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    idle.append(worker)
                except ray.exceptions.RayActorError as e:
                    results[i] = CallResult(None, EXCEPTION, f"its reward worker died ({type(e).__name__}: {e}); "
                                                             "a fresh one was started")
                    self._replace(worker)
            now = time.monotonic()
            for ref, (i, worker, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[ref]
                    results[i] = CallResult(None, TIMEOUT, f"ran past reward_timeout_s={self.timeout_s:g} s (its "
                                                           "reward worker was killed and a fresh one started)")
                    self._replace(worker)
            for ref, (worker, deadline) in list(self.starting.items()):
                if now >= deadline:
                    raise ClusterError(f"a replacement reward worker did not start within placement_timeout_s="
                                       f"{self.start_timeout_s:g} s (reward_worker_num_cpus={self.num_cpus:g})")
        return results
