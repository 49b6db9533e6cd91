"""All Ray plumbing: connecting to a cluster, the thin actor hosts, their placement and creation.

The role classes (actors.generator.Generator, actors.reference.ReferenceScorer,
actors.reward.RewardScorer, learner.learner.Learner) know nothing of Ray; the hosts below
wrap each in a Ray actor and keep its methods' results as ObjectRefs; each call's seconds
come back in its typed result (ppo_ray.stats: one timing convention). The
driver's calls to the running actors are ppo_ray.roles.Roles' methods. Only this module and
ppo_ray.roles import ray.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ppo_ray.batch import RolloutBatch, RowPick, gather
from ppo_ray.config import ConfigSlice, PPOConfig
from ppo_ray.deadlines import Deadlines
from ppo_ray.faults import StateLostError
from ppo_ray.logs import (ACTOR_MARK, actor_logger, level_number, log_off_console, quiet_env, quiet_libraries,
                          ray_logging_level, without_actor_lines)
from ppo_ray.roles import EXIT_TIMEOUT_S, Roles, call_label, end_actors, form_learner_group, role_names
from ppo_ray.stats import GenerationSummary, ReferenceStats, RewardStats, SyncReport

if TYPE_CHECKING:
    from torch import Tensor

    from ppo_ray.data import PromptColumns
    from ppo_ray.modeling import LoraWeights
    from ppo_ray.stats import LearnerState

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached or cannot host the requested actors."""


def init_ray(address: str | None = None, connect_timeout_s: float = 5.0, log_level: str = "info",
             metrics_report_interval_ms: int | None = None) -> None:
    """Attach to RAY_ADDRESS (or `address`) when set, else start a local Ray.

    `log_level` (config.log_level): Ray's own driver-side messages only at debug; one line
    of ours names the cluster, its dashboard and the metrics export interval.
    `metrics_report_interval_ms` (config.metrics_report_interval_ms): how often this
    process's metrics reach the node's Prometheus endpoint, set through Ray's
    RAY_metrics_report_interval_ms before ray.init (a local Ray started here inherits it);
    None leaves Ray's (10 s by default).
    The local default binds the dashboard to 127.0.0.1 only. Under `ray job submit` Ray
    sets RAY_ADDRESS for the entrypoint, so the same call attaches to the cluster. An
    address where nothing listens is a ClusterError naming it within `connect_timeout_s`
    (check_ray_address): ray.init itself retries such an address for minutes (measured:
    still waiting after 300 s for a closed port on 127.0.0.1, Ray 2.60).
    """
    if ray.is_initialized():
        keep_actor_lines_off_the_console(log_level)
        return
    if metrics_report_interval_ms is not None:
        os.environ["RAY_metrics_report_interval_ms"] = str(int(metrics_report_interval_ms))
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = ray_logging_level(log_level)
    # ray.init replaces the process's SIGTERM handler with its own (sys.exit(15), after the core
    # worker prints a stack): a handler the caller installed is put back afterwards, SIGINT's
    # too (Ray 2.60 leaves it), so that launch.py's (ppo_ray.interrupts: Ctrl-C and `ray job
    # stop` unwind: exit 130, actors shut down) still runs
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if address:
        check_ray_address(address, connect_timeout_s)
        try:
            context = ray.init(address=address, log_to_driver=True, logging_level=quiet)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ClusterError(f"cannot connect to the Ray cluster at RAY_ADDRESS={address!r}: {e}") from e
    else:
        context = ray.init(dashboard_host="127.0.0.1", log_to_driver=True, logging_level=quiet)
    if threading.current_thread() is threading.main_thread():
        for s, handler in handlers.items():
            if callable(handler) and signal.getsignal(s) is not handler:
                signal.signal(s, handler)
    keep_actor_lines_off_the_console(log_level)
    dashboard = getattr(context, "dashboard_url", None)
    log.info("Ray %s: %s%s; metrics exported every %s", ray.__version__,
             f"cluster at {address}" if address else "a local instance",
             f", dashboard http://{dashboard}" if dashboard else "", _metrics_interval())


def _metrics_interval() -> str:
    """The export interval this process's Ray runs with, as read back from Ray ("?" where it
    cannot be read)."""
    try:
        return f"{max(int(ray._config.metrics_report_interval_ms()), 1000) / 1000:g} s"
    except Exception:  # a Ray without ray._config
        return "?"


def keep_actor_lines_off_the_console(log_level: str = "info") -> None:
    """Ray forwards every line an actor writes to the driver, which prints it; the actors'
    own line per call (ppo_ray.logs.actor_logger) is for their logs (the dashboard's
    Actors page), so the driver leaves those lines out of what it prints (they go to the
    launch log: logs.log_off_console), and its console stays one line per step. At `debug`
    they are printed too. Uses Ray's stream dispatcher (Ray
    2.60's ray._private.ray_logging): where a Ray version has none, the lines are printed,
    nothing else changes. Idempotent."""
    if level_number(log_level) <= logging.DEBUG:
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    handlers = getattr(dispatcher, "handlers", None)
    if not isinstance(handlers, list):
        return

    def filtered(handle):
        def handler(data):
            lines = data.get("lines") if isinstance(data, dict) else None
            if lines is None:
                return handle(data)
            kept = without_actor_lines(lines)
            if len(kept) < len(lines):
                log_off_console(data, [line for line in lines if ACTOR_MARK in line])
            if kept:
                handle(data if len(kept) == len(lines) else {**data, "lines": kept})
        handler._ppo_ray = True  # type: ignore[attr-defined]
        return handler

    # one assignment: emit() iterates the list it read under its lock
    dispatcher.handlers = [(name, h if name != "ray_print_logs" or getattr(h, "_ppo_ray", False) else filtered(h))
                           for name, h in handlers]


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """ClusterError, naming the address, unless something accepts a TCP connection at the
    host:port of a Ray address ("host:port" or "ray://host:port"). "auto" and "local" are
    left to ray.init (it finds the local cluster or says there is none). An http(s):// address
    is the dashboard's (for `ray job submit`), not one ray.init can attach to. Only that a
    port is open is checked: a port held by something that is not Ray is not caught here."""
    import socket
    from urllib.parse import urlsplit

    if address in ("auto", "local"):
        return
    if address.startswith(("http://", "https://")):
        raise ClusterError(
            f"RAY_ADDRESS={address!r} is a dashboard / job-submission address; ray.init needs the cluster's "
            "address (host:6379 or ray://host:10001). To run on that cluster use deploy/submit.sh "
            "(ray job submit), which sets RAY_ADDRESS for the job itself")
    client = address.startswith("ray://")
    parts = urlsplit(address if client else f"//{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:  # a port that is not a number
        raise ClusterError(f"RAY_ADDRESS={address!r} is not a host:port address: {e}") from e
    if client and port is None:
        port = 10001  # the Ray client server's default port
    if not host or port is None:
        raise ClusterError(f"RAY_ADDRESS={address!r} is not a host:port address (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:  # refused, unreachable, no such host, or no answer within timeout_s
        raise ClusterError(
            f"no Ray cluster at RAY_ADDRESS={address!r}: cannot connect to {host}:{port} ({e or 'timed out'}); "
            "start one there (ray start --head) or unset RAY_ADDRESS to start a local Ray") from e


# ----------------------------------------------------------------------------- model transfer
@dataclass(frozen=True)
class ShippedModel:
    """A model directory on the driver's node, readable by actors and tasks on any node: its
    files in Ray's object store (one ObjectRef per file), named by a content digest. A task
    gets the ObjectRefs themselves; an actor gets the name of the run's ModelStore actor
    that holds them instead (`store`), because Ray does not keep an actor's constructor
    arguments alive for its restarts (ray-project/ray#53727): the store does, for the run."""

    path: str                # the directory on the driver's node
    node_id: str             # the driver's node
    digest: str              # ppo_ray.transfer.content_digest
    files: dict              # relative path -> ObjectRef[np.ndarray (uint8)]; {} for an actor
    store: Optional[tuple[str, str]] = None  # (name, namespace) of the ModelStore holding the files


class ModelStore:
    """A run's holder of shipped model files (ObjectRefs, by digest), on the driver's node:
    actors created or restarted on other nodes fetch the references from it."""

    def __init__(self):
        self.models: dict[str, dict] = {}

    def add(self, digest: str, files: dict) -> None:
        self.models[digest] = files  # nested ObjectRefs: borrowed, so kept alive while this actor lives

    def files(self, digest: str) -> dict:
        return self.models[digest]


def ship_model(path: str) -> ShippedModel:
    """Put a local model directory's files into the object store, a file at a time."""
    from ppo_ray.transfer import content_digest, list_files, read_file

    files = {name: ray.put(read_file(path, name)) for name in list_files(path)}
    return ShippedModel(str(path), ray.get_runtime_context().get_node_id(), content_digest(path), files)


def local_model_dir(model: "str | ShippedModel | None") -> "str | None":
    """In an actor or a task: where to load a model from. A hub id or a path is used as it is;
    a ShippedModel is its own path on the driver's node, and elsewhere this node's cache entry
    of its digest, written from the object store on first use (ppo_ray.transfer)."""
    if not isinstance(model, ShippedModel):
        return model
    if ray.get_runtime_context().get_node_id() == model.node_id and os.path.isdir(model.path):
        return model.path
    from ppo_ray.transfer import cached, write_cache_entry

    hit = cached(model.digest)
    if hit is None:
        files = model.files
        if not files:  # an actor: the references are held by the run's ModelStore
            name, namespace = model.store
            files = ray.get(ray.get_actor(name, namespace=namespace).files.remote(model.digest))
        names = list(files)
        t0 = time.perf_counter()
        hit = write_cache_entry(dict(zip(names, ray.get([files[n] for n in names]))), model.digest)
        log.info("model %s (digest %s) received from the driver's node into %s in %.1f s", model.path,
                 model.digest, hit, time.perf_counter() - t0)
    return str(hit)


def _probe_paths(paths: list[str]) -> list[str]:
    """On one node: the paths of `paths` whose config.json this node cannot read."""
    return [p for p in paths if not os.path.isfile(os.path.join(p, "config.json"))]


def group_nodes(pg: PlacementGroup) -> set[str]:
    """Node ids that hold a bundle of the (ready) placement group."""
    table = ray.util.placement_group_table(pg)
    return set(table.get("bundles_to_node_id", {}).values())


def prepare_models(config: PPOConfig, models: dict[str, Optional[str]], nodes: set[str]) -> dict:
    """What the actors / tasks get for each model of `models` (role -> resolved path or hub
    id), given the nodes they will run on. Local directories, when some node is not the
    driver's: with model_transfer "ray" a ShippedModel (one per directory, shared by the roles
    that name it); with "path" the path itself, after a check on every such node that it can
    read it (ClusterError naming the nodes and paths, before any actor starts). Hub ids and
    single-node runs: unchanged."""
    here = ray.get_runtime_context().get_node_id()
    remote = sorted(n for n in nodes if n != here)
    local = sorted({p for p in models.values() if p and os.path.isdir(p)})
    if not remote or not local:
        return dict(models)
    if config.model_transfer == "path":
        probes = [ray.remote(_probe_paths).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node, soft=False)).remote(local) for node in remote]
        missing = {node: bad for node, bad in zip(remote, ray.get(probes)) if bad}
        if missing:
            where = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
            detail = "; ".join(f"node {where.get(node, '?')} ({node[:8]}) cannot read {', '.join(bad)}"
                               for node, bad in missing.items())
            raise ClusterError(
                "model_transfer: path needs every node that runs an actor or a stage to read the model directories "
                f"at the same path as the driver's node, but {detail}. Mount the run directory's storage at the "
                "same path on every node, or set model_transfer: ray (the files then go through Ray's object store)")
        return dict(models)
    shipped: dict[str, ShippedModel] = {}
    for path in local:
        t0 = time.perf_counter()
        shipped[path] = ship_model(path)
        log.info("model %s: %d files into Ray's object store for the actors on other nodes (%.1f s)", path,
                 len(shipped[path].files), time.perf_counter() - t0)
    return {role: shipped.get(p, p) if p else p for role, p in models.items()}


# ----------------------------------------------------------------------------- hosts
def _check_version(role_object, expected: int | None, what: str) -> None:
    """The version the driver expects this actor to hold. An actor that Ray restarted comes
    back at version 0 (its constructor ran again): a StateLostError, which the trainer
    recovers from. A live actor at another version is a lost or doubled sync: a bug, raised
    as such."""
    held = getattr(role_object, "versions", None) or [role_object.version]  # a generator may hold several
    if expected is None or expected in held:
        return
    context = ray.get_runtime_context()
    role = (context.get_actor_name() or "actor").rsplit("/", 1)[-1]  # <run tag>/<role>
    if context.was_current_actor_reconstructed:
        raise StateLostError(role, f"restarted at version {role_object.version}; the driver expects {expected} "
                                   f"for {what}")
    raise RuntimeError(f"{role} holds version {role_object.version} but the driver expects {expected} for {what} "
                       "(a lost or repeated sync)")


class _Host:
    """The actor hosts' base: Ray labels an actor's lines with repr(actor), in its log files
    (`:actor_name:`) and where they are forwarded; the class name by default, here the actor's
    Ray name (<run tag>/<role>), so two runs' or two replicas' lines are told apart."""

    def __repr__(self) -> str:
        try:
            return ray.get_runtime_context().get_actor_name() or type(self).__name__
        except Exception:  # outside an actor
            return type(self).__name__

    def torch_threads(self) -> int:
        """torch's CPU threads in this actor (the CPU rule's result: _set_torch_threads)."""
        import torch

        return torch.get_num_threads()


class GeneratorHost(_Host):
    def __init__(self, config: ConfigSlice, model_dir: "str | ShippedModel"):
        quiet_libraries(config.log_level)
        from actors.generator import Generator

        _set_torch_threads()  # before the engine: vLLM's CPU worker then freezes torch.set_num_threads
        self.log = actor_logger(config.log_level)
        self.model_dir = local_model_dir(model_dir)
        self.generator = Generator.from_config(config, self.model_dir)

    @ray.method(num_returns=2)
    def generate(self, prompt_ids: list[list[int]], step: int, offset: int,
                 expected_version: int | None = None, samples_per_prompt: int = 1,
                 segment_versions: list[int] | None = None,
                 segment_tokens: int = 0, greedy: bool = False) -> tuple[RolloutBatch, GenerationSummary]:
        _check_version(self.generator, expected_version, f"step {step + 1}'s rollouts")
        t0 = time.perf_counter()
        batch = self.generator.generate(prompt_ids, step=step, prompt_offset=offset,
                                        samples_per_prompt=samples_per_prompt, version=expected_version,
                                        segment_versions=segment_versions, segment_tokens=segment_tokens,
                                        greedy=greedy)
        summary = GenerationSummary.of(batch, seconds=time.perf_counter() - t0)
        tokens = sum(summary.lengths)
        self.log.info("%s: %d rollouts with adapter v%d, %d response tokens, %.2f s (%.0f tok/s)",
                      call_label(step), len(summary.lengths),
                      summary.version, tokens, summary.seconds, tokens / max(summary.seconds, 1e-9))
        return batch, summary

    def load_adapter(self, version: int, weights: LoraWeights, restore: bool = False,
                     retire_below: int | None = None) -> SyncReport:
        report = self.generator.load_adapter(version, weights, restore=restore, retire_below=retire_below)
        self.log.info("adapter v%d loaded%s: %.2f MB, write %.2f s, register %.2f s", report.version,
                      " (restore)" if restore else "", report.nbytes / 1e6, report.write_s, report.register_s)
        return report

    def close(self) -> None:
        """Before the actor exits (Roles.release): retire the adapter, delete its files."""
        self.generator.close()

    def probe(self, prompt_ids: list[list[int]], expected_version: int) -> RolloutBatch:
        """The sync check's probe rollouts, sampled with adapter `expected_version` (one this
        replica holds: the one just loaded, or an older one loaded again)."""
        _check_version(self.generator, expected_version, "the sync check")
        return self.generator.probe(prompt_ids, version=expected_version)

    def version(self) -> int:
        return self.generator.version

    def versions(self) -> list[int]:
        """The adapter versions held (max_staleness: those of the batches in flight, and the newest)."""
        return self.generator.versions


CPU_SHARE_ENV = "PPO_RAY_CPU_SHARE"


# glibc malloc keeping what it frees (config.cpu_malloc_keep), so a micro-batch's tensors reuse
# the last one's pages instead of faulting in new, zeroed ones; what each variable bounds of the
# memory a process keeps beyond its live allocations (man mallopt; glibc's malloc/arena.c):
# - MALLOC_TRIM_THRESHOLD_ 1 GiB: once a free leaves more than this free at the top of a heap,
#   glibc gives the top back down to the top pad; at most 1 GiB stays there;
# - MALLOC_TOP_PAD_ 16 MiB: what a heap grows by beyond a request and keeps after a trim; under
#   the 64 MiB of a thread arena's heap, so a thread arena can unmap a heap it emptied (with a pad
#   of 64 MiB or more it never does);
# - MALLOC_MMAP_THRESHOLD_ 32 MiB (glibc's largest; fixed from the start, where glibc's default
#   starts at 128 KiB and rises as it frees): an allocation this large that the heap's free top
#   cannot hold is mmapped and unmapped when freed.
# Free chunks between live ones stay in the process under any setting (glibc's defaults too), so
# a process's resident memory stays near its own peak either way; measured per actor, on and
# off, in benchmarks/RESULTS.md (issue 43: cpu_malloc_keep's memory).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30),
              "MALLOC_TOP_PAD_": str(16 * 2**20)}


def _set_torch_threads(threads: int = 0) -> None:
    """torch.set_num_threads(threads) when > 0; at 0 the CPU rule (PPOConfig.cpu_share) that
    the actor's or stage task's environment carries: its node's cores // PPO_RAY_CPU_SHARE
    (at least 1), or, without that variable, Ray's OMP_NUM_THREADS from the CPUs it reserves."""
    share = int(os.environ.get(CPU_SHARE_ENV, "0") or 0)
    if threads <= 0 and share > 0:
        threads = max(1, len(os.sched_getaffinity(0)) // share)
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def cpu_share_env(config: PPOConfig, role: str) -> dict[str, str]:
    """The environment of `role`'s actor or stage task on a CPU-only run: the variable that
    carries its CPU rule (none under Ray's rule) and, with cpu_malloc_keep, glibc malloc's
    settings (MALLOC_ENV; the driver's own values win)."""
    share = config.cpu_share(role)
    env = {CPU_SHARE_ENV: str(share)} if share else {}
    if config.cpu_malloc_keep and not config.uses_gpus:
        env.update({key: os.environ.get(key, value) for key, value in MALLOC_ENV.items()})
    return env


class ReferenceHost(_Host):
    def __init__(self, config: ConfigSlice, model_dir: "str | ShippedModel"):
        quiet_libraries(config.log_level)
        from actors.reference import ReferenceScorer

        _set_torch_threads(config.scorer_torch_threads)
        self.log = actor_logger(config.log_level)
        self.model_dir = local_model_dir(model_dir)
        self.scorer = ReferenceScorer.from_config(config, self.model_dir)

    @ray.method(num_returns=2)
    def logprobs(self, *parts: RolloutBatch, pick: RowPick | None = None) -> tuple["Tensor", ReferenceStats]:
        batch = gather(parts, pick)  # pick: dynamic sampling's rows of its rounds (ppo_ray.batch.RowPick)
        logprobs, stats = self.scorer.logprobs(batch)
        self.log.info("reference logprobs: %d rollouts of adapter v%d, %d response tokens, %.2f s",
                      batch.response_ids.shape[0], batch.adapter_version, int(batch.response_mask.sum()),
                      stats.seconds)
        return logprobs, stats


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
        context = ray.get_runtime_context()
        try:
            self.prefix, self.namespace = context.get_actor_name(), context.namespace
        except Exception:  # noqa: BLE001 - outside an actor (a test's or a benchmark's driver)
            self.prefix, self.namespace = None, None
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
                f"{_fmt(_user_resources(ray.available_resources()))}") from None
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


class RewardHost(_Host):
    def __init__(self, config: ConfigSlice, reward_model_dir: "str | ShippedModel | None"):
        quiet_libraries(config.log_level)
        from actors.reward import RewardScorer

        _set_torch_threads(config.scorer_torch_threads)
        self.log = actor_logger(config.log_level)
        self.model_dir = local_model_dir(reward_model_dir)
        self.pool = RewardWorkerPool.from_config(config) if config.reward_workers else None
        self.scorer = RewardScorer.from_config(config, self.model_dir, runner=self.pool)

    @ray.method(num_returns=2)
    def score(self, *parts: RolloutBatch, label: str = "",
              columns: Optional[PromptColumns] = None) -> tuple["Tensor", RewardStats]:
        """The rollouts' combined scores and stats; `columns`: the dataset's columns of their
        prompts, for the reward functions (ppo_ray.data.PromptColumns: by group id). The log
        line: `label` (roles.call_label: "step N", "eval", "samples"), then the mean of the
        combined scores, which is the console's `reward` of a training step (weighted, with the
        penalties), then each source's own mean (with its weight when not 1)."""
        import torch

        batch = RolloutBatch.cat(parts)
        scores, stats = self.scorer.score(batch, columns)
        weights = dict(zip(stats.source_means, self.scorer.weights))
        means = "  ".join(f"{source} {mean:+.4f}" + (f" x{weights[source]:g}" if weights.get(source, 1) != 1 else "")
                          for source, mean in stats.source_means.items())
        finite = scores[torch.isfinite(scores)]
        failed = {k: v for k, v in (stats.failures.parts() if stats.failures else {}).items() if v}
        self.log.info("%sscored %d rollouts of adapter v%d: reward %+.4f (%s)%s%s, %.2f s",
                      f"{label}: " if label else "", batch.response_ids.shape[0], batch.adapter_version,
                      float(finite.mean()) if len(finite) else math.nan, means,
                      f", {stats.dropped_nonfinite:g} not finite" if stats.dropped_nonfinite else "",
                      "".join(f", {k} {v:g}" for k, v in failed.items()), stats.seconds)
        return scores, stats

    def close(self) -> None:
        """Before the actor exits (Roles.release): end the reward workers it started."""
        if self.pool is not None:
            self.pool.close()

    def reward_workers(self) -> list[str]:
        """The reward workers' Ray actor ids (RewardWorkerPool.worker_ids; [] without workers)."""
        return self.pool.worker_ids() if self.pool is not None else []


class LearnerHost(_Host):
    def __init__(self, config: ConfigSlice, model_dir: "str | ShippedModel", value_model_dir: "str | ShippedModel | None"):
        quiet_libraries(config.log_level)
        from learner.learner import Learner

        _set_torch_threads()
        self.log = actor_logger(config.log_level)
        self.model_dir, self.value_model_dir = local_model_dir(model_dir), local_model_dir(value_model_dir)
        self.learner = Learner(config, self.model_dir, self.value_model_dir)
        import torch

        # the count decides the float32 sums' order: a restarted learner must compute as its predecessor
        self.log.info("learner (pid %d): %d torch threads, %d cores this process may run on", os.getpid(),
                      torch.get_num_threads(), len(os.sched_getaffinity(0)))

    def rendezvous_address(self) -> str:
        """tcp://<this node's IP>:<a free port>: where rank 0 of the learner group listens."""
        import socket

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def join_group(self, init_method: str, rank: int, world_size: int, timeout_s: float) -> int:
        self.learner.join_group(init_method, rank, world_size, timeout_s)
        return rank

    @ray.method(num_returns=2)
    def current_weights(self) -> tuple[int, LoraWeights]:
        """(version, LoRA weights with their spec) of the policy now: what a (re)started
        generator needs."""
        return self.learner.version, self.learner.lora_weights()

    @ray.method(num_returns=3)
    def update(self, ref_logprobs, scores, *parts: RolloutBatch, expected_version: int | None = None,
               max_staleness: int | None = None, planned_steps: int | None = None, gap_limit: float | None = None,
               pick: RowPick | None = None):
        """(stats, new LoRA weights, learner state after the update). The state (LearnerState:
        adapters, value head, both Adam states, RNG; rank 0's only, every member holds the
        same; None from the others) stays in the object store as the driver's copy of the step's commit: a learner
        that dies later is restored from it, with no checkpoint needed. `pick`: dynamic
        sampling's rows of its rounds' parts (ppo_ray.batch.RowPick), the batch trained on."""
        _check_version(self.learner, expected_version, "the update")
        stats, weights = self.learner.update(gather(parts, pick), ref_logprobs, scores, max_staleness,
                                             planned_steps, gap_limit=gap_limit)
        value = "" if stats.value_loss is None else f"  value_loss {stats.value_loss:.4f}"
        self.log.info("update to adapter v%d: %d response tokens  policy_loss %+.4f%s  approx_kl %.4f  clipfrac %.3f"
                      "  kl %.4f  %.2f s", stats.version, stats.tokens, stats.policy_loss, value, stats.approx_kl,
                      stats.clipfrac, stats.kl, stats.update_s)
        return stats, weights, (self.learner.state_dict() if self.learner.rank == 0 else None)

    def sync_gaps(self, *parts: RolloutBatch, expected_version: int,
                  weights: "LoraWeights | None" = None) -> list[float]:
        """The sync check: per generator replica, the largest |generator - learner| logprob
        of its probe tokens, both at `expected_version` (Learner.sync_gap); `weights`: that
        version's adapter, older than the learner's."""
        if weights is None:
            _check_version(self.learner, expected_version, "the sync check")
        elif expected_version >= self.learner.version:
            raise RuntimeError(f"the learner is at version {self.learner.version}: the sync check of version "
                                    f"{expected_version} takes its own weights, not older ones")
        return [self.learner.sync_gap(part, weights) for part in parts]

    def version(self) -> int:
        return self.learner.version

    def state_dict(self) -> "LearnerState":
        return self.learner.state_dict()

    def load_state_dict(self, state: "LearnerState") -> int:
        self.learner.load_state_dict(state)
        return self.learner.version


# The Ray actor class of each role kind. create_roles takes another mapping (PPOTrainer.hosts),
# e.g. subclasses of these; every replica of a kind, and every restart, runs the same class.
HOSTS: Mapping[str, type] = {"generator": GeneratorHost, "reference": ReferenceHost, "reward": RewardHost,
                             "learner": LearnerHost}


# ----------------------------------------------------------------------------- creation
@dataclass(frozen=True)
class Demand:
    """What one actor reserves: CPUs, GPUs (fractions allowed) and custom resources."""
    role: str
    cpus: float
    gpus: float
    resources: dict[str, float]

    def bundle(self) -> dict[str, float]:
        """Its placement-group bundle; empty when it reserves nothing."""
        out = {"CPU": self.cpus, "GPU": self.gpus, **self.resources}
        return {k: v for k, v in out.items() if v > 0}


def role_demands(config: PPOConfig) -> list[Demand]:
    """One Demand per actor, in Roles.all()'s order."""
    scorer = (config.num_cpus("reference"), config.scorer_num_gpus, config.scorer_resources)
    per_role = {"generator": (config.num_cpus("generator"), config.generator_num_gpus, config.generator_resources),
                "learner": (config.num_cpus("learner"), config.learner_num_gpus, config.learner_resources),
                "reference": scorer, "reward": scorer}
    out = []
    for name in role_names(config.num_generators, config.num_learners):
        cpus, gpus, resources = per_role[name.split("-")[0]]  # generator-0 -> generator
        out.append(Demand(name, cpus, gpus, dict(resources)))
    return out


def plan_bundles(demands: list[Demand]) -> tuple[list[dict[str, float]], list[int]]:
    """(bundles, bundle index of each actor): one bundle per actor that reserves something.

    Ray refuses a bundle that is empty or all zeros, and the scorers reserve nothing by
    default (scorer_num_cpus 0: they are idle while the others run). Such an actor gets no
    bundle of its own: it is scheduled into the group with bundle index -1 ("any bundle"),
    so it runs on a node the group holds (with STRICT_PACK the one node) and reserves
    nothing, as before placement groups. Only when no actor reserves anything does one
    bundle of 0.0001 CPU (Ray's smallest unit) anchor the group.
    """
    bundles, index = [], []
    for d in demands:
        bundle = d.bundle()
        if bundle:
            index.append(len(bundles))
            bundles.append(bundle)
        else:
            index.append(-1)
    return bundles or [{"CPU": 1e-4}], index


def _user_resources(resources: dict[str, float]) -> dict[str, float]:
    """CPU, GPU and custom resources; Ray's own bookkeeping (node:<ip>, memory, the
    CPU_group_<pg>... resources that placement groups create) left out."""
    return {k: v for k, v in resources.items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory") and "_group_" not in k}


def _alive_nodes() -> list[tuple[str, dict[str, float]]]:
    """(ip and short node id, total CPU/GPU/custom resources) of every alive node."""
    return [(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})", _user_resources(n["Resources"]))
            for n in ray.nodes() if n.get("Alive")]


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _describe(demands: list[Demand], nodes: list[tuple[str, dict[str, float]]]) -> str:
    roles = "; ".join(f"ppo/{d.role} {_fmt(d.bundle()) if d.bundle() else '{} (reserves nothing)'}"
                      for d in demands)
    return f"The actors ask for: {roles}. The cluster's nodes: " + "; ".join(f"{n} {_fmt(r)}" for n, r in nodes)


def _check_capacity(config: PPOConfig, demands: list[Demand]) -> None:
    """Fail fast, naming the shortfall, for what the cluster can never hold as it is now:
    more CPUs/GPUs/custom resources in all than it has, a custom resource no node has, an
    actor that fits on no single node. What fits in total but not under placement_strategy
    (STRICT_PACK onto one node, STRICT_SPREAD over too few nodes) or not next to other
    jobs is left to the placement group's timeout (reserve)."""
    have = ray.cluster_resources()
    for name, key in (("CPUs", "CPU"), ("GPUs", "GPU")):
        need = sum(d.bundle().get(key, 0.0) for d in demands)
        if need > have.get(key, 0.0) + 1e-9:
            unit = f"num_{key.lower()}s"
            if all(d.role.startswith("stage-") for d in demands):  # an SFT / reward-model stage's task
                asks = (f"for the {demands[0].role[len('stage-'):]} stage's task (stage_{unit}, by default "
                        f"learner_{unit})")
            else:
                asks = (f"in all (num_generators={config.num_generators} x generator_{unit}, "
                        f"num_learners={config.num_learners} x learner_{unit}, 2 scorers)")
            raise ClusterError(
                f"the config asks for {need:g} {name} {asks} but the Ray cluster has "
                f"{have.get(key, 0.0):g}; lower the *_{unit} fields or add nodes")
    nodes = _alive_nodes()
    custom: dict[str, float] = {}
    for d in demands:
        for key, amount in d.resources.items():
            custom[key] = custom.get(key, 0.0) + amount
    for key, need in sorted(custom.items()):
        roles = ", ".join(f"ppo/{d.role}" for d in demands if key in d.resources)
        if not any(key in r for _, r in nodes):
            raise ClusterError(
                f"no node of the Ray cluster has the custom resource {key!r} (asked for by {roles} in the "
                f"*_resources fields): start a node with it (ray start --resources '{{\"{key}\": 1}}') or drop "
                "it from the config. " + _describe(demands, nodes))
        if need > have.get(key, 0.0) + 1e-9:
            raise ClusterError(f"the config asks for {need:g} of the custom resource {key!r} in all ({roles}) but "
                               f"the Ray cluster has {have.get(key, 0.0):g}. " + _describe(demands, nodes))
    for d in demands:
        if d.bundle() and not any(all(r.get(k, 0.0) + 1e-9 >= v for k, v in d.bundle().items()) for _, r in nodes):
            raise ClusterError(f"no single node of the Ray cluster can hold ppo/{d.role} "
                               f"{_fmt(d.bundle())}. " + _describe(demands, nodes))


def reserve(config: PPOConfig, demands: list[Demand], name: str) -> tuple[PlacementGroup, list[int]]:
    """One placement group with a bundle per actor (plan_bundles), ready: (group, bundle
    index of each actor). Ray reserves all bundles or none (no half-started run), and an
    actor restarted after a crash (max_restarts) goes back into its bundle. Waits at most
    config.placement_timeout_s: a group that cannot be placed (strategy, other jobs, nodes
    that never come) is removed and a ClusterError names each actor's demand and each
    node's resources, instead of actors pending forever."""
    _check_capacity(config, demands)
    bundles, index = plan_bundles(demands)
    pg = placement_group(bundles, strategy=config.placement_strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=config.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        hint = {"STRICT_PACK": "all bundles on one node",
                "STRICT_SPREAD": f"{len(bundles)} bundles on {len(bundles)} different nodes"}.get(
                    config.placement_strategy, "the bundles wherever they fit")
        raise ClusterError(
            f"the Ray cluster could not reserve the actors' resources within placement_timeout_s="
            f"{config.placement_timeout_s:g} s (placement_strategy={config.placement_strategy}: {hint}). "
            + _describe(demands, _alive_nodes())
            + f"; free now in all: {_fmt(_user_resources(ray.available_resources()))}. Lower the demands, "
            "change placement_strategy or the *_resources fields, or add nodes") from None
    return pg, index


def create_roles(config: PPOConfig, *, model_dir: str, ref_model_dir: str, reward_model_dir: str | None,
                 value_model_dir: str | None, namespace: str, hosts: Mapping[str, type] = HOSTS) -> Roles:
    """Create the actors, each in its bundle of one placement group (reserve), named
    <run tag>/<role>, e.g. ppo-1a2b3c4d/learner: `namespace` is the run tag and also their Ray
    namespace, which the dashboard's Actors page does not show, so the name is what tells two
    runs on one cluster apart. `hosts`: the actor class of each role kind (HOSTS). An
    advantage estimator without a critic gets no value model: none is shipped or loaded."""
    from learner.algos import advantage_estimator

    estimator = advantage_estimator(config.advantage_estimator)  # its rules were checked with the config
    if not estimator.needs_critic:
        value_model_dir = None
    demands = role_demands(config)
    pg, index = reserve(config, demands, name=f"{namespace}/ppo")
    store = None
    try:
        models = prepare_models(config, {"model": model_dir, "ref": ref_model_dir, "reward": reward_model_dir,
                                         "value": value_model_dir}, group_nodes(pg))
        shipped = {m.digest: m for m in models.values() if isinstance(m, ShippedModel)}
        if shipped:  # the actors get the store's name; it keeps the files alive for restarts
            name = f"{namespace}/models"
            store = ray.remote(ModelStore).options(
                name=name, namespace=namespace, num_cpus=0, max_restarts=0, scheduling_strategy=
                NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)).remote()
            ray.get([store.add.remote(digest, m.files) for digest, m in shipped.items()])
            models = {role: replace(m, files={}, store=(name, namespace)) if isinstance(m, ShippedModel) else m
                      for role, m in models.items()}
    except BaseException:
        if store is not None:
            ray.kill(store)
        remove_placement_group(pg)
        raise
    model_dir, ref_model_dir = models["model"], models["ref"]
    reward_model_dir, value_model_dir = models["reward"], models["value"]

    def opts(i: int) -> dict:
        d = demands[i]
        # vLLM's, transformers' and torch's own messages cut to errors unless log_level is
        # debug (ppo_ray.logs.quiet_env; a variable set in the driver's environment wins).
        env = {**quiet_env(config.log_level), **cpu_share_env(config, d.role.split("-")[0])}
        if d.role.startswith("generator") and not d.gpus:
            # the vLLM engine core in the actor's own process (actors.vllm_engine: on 2 CPU
            # cores 1.5-1.9x faster generation, 4 s instead of 21 s to start); the driver's
            # environment wins
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # max_restarts: Ray re-runs a dead actor's constructor (the trainer then re-syncs its
        # adapter / restores the learner's checkpoint and retries the step); calls are not
        # retried by Ray itself (max_task_retries=0): the trainer decides what is safe to redo.
        # A streaming generator (max_staleness, actors.engine_loop) takes the calls of every batch
        # in flight at once (their engine work is queued to one thread); every other actor runs
        # its calls one after another, in the order they were made.
        concurrency = 2 * (config.max_staleness + 2) if d.role.startswith("generator") and config.streams_rollouts \
            else 1
        return dict(name=f"{namespace}/{d.role}", namespace=namespace, num_cpus=d.cpus, num_gpus=d.gpus,
                    resources=d.resources, max_concurrency=concurrency, runtime_env={"env_vars": env},
                    max_restarts=config.max_actor_restarts, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index[i]))

    # Each actor gets the config fields its role reads (each field declares its roles:
    # ppo_ray.config.knob), not the whole config.
    n_gen = config.num_generators
    gen_config = config.slice("generator")
    learner_config = config.slice("learner")
    gens = [ray.remote(hosts["generator"]).options(**opts(i)).remote(gen_config, model_dir) for i in range(n_gen)]
    ref = ray.remote(hosts["reference"]).options(**opts(n_gen)).remote(config.slice("reference"), ref_model_dir)
    rew = ray.remote(hosts["reward"]).options(**opts(n_gen + 1)).remote(config.slice("reward"), reward_model_dir)
    learners = [ray.remote(hosts["learner"]).options(**opts(n_gen + 2 + i)).remote(
        learner_config, model_dir, value_model_dir) for i in range(config.num_learners)]
    roles = Roles(gens, ref, rew, learners, pg, store,
                  deadlines=Deadlines(config.call_timeout_factor, config.call_timeout_min_s, config.call_timeout_first_s),
                  sequential_generators=not config.streams_rollouts)
    try:
        wait_ready(roles)
        form_learner_group(roles)
        threads = ray.get([actor.torch_threads.remote() for actor in (gens[0], ref, rew, learners[0])])
    except BaseException:
        roles.release()
        raise
    reserved = ", ".join(f"{d.role} {d.cpus:g}" for d in demands)
    rule = ("CPU-only: the phases take turns on the node's cores" if config.cpu_share("learner")
            else "Ray's rule: threads = CPUs reserved")
    log.info("CPUs reserved: %s; torch threads: generator %d, reference %d, reward %d, learner %d (%s)", reserved,
             *threads, rule)
    return roles


def wait_ready(roles: Roles) -> None:
    """Block until every actor's constructor finished (engine start, model loads), so step 1
    is timed honestly and a role that cannot start is named instead of surfacing mid-step;
    within the deadline of a run's first calls (call_timeout_first_s: a constructor that
    hangs is named too)."""
    limit = roles.deadlines.first_s
    deadline = time.monotonic() + limit
    for name, actor in zip(roles.names(), roles.all()):
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.0, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            for other in roles.all():
                ray.kill(other)
            why = (f"did not start within call_timeout_first_s ({limit:g} s)"
                   if isinstance(e, ray.exceptions.GetTimeoutError) else f"failed to start: {e}")
            raise ClusterError(f"actor ppo/{name} {why}") from e


# ----------------------------------------------------------------------------- SFT / RM stages
def stage_settings(config: PPOConfig, epochs: int, learning_rate: float):
    """learner.stages.TrainSettings for a stage of the pipeline (built here, the top layer,
    so that the pipeline does not import learner/): the config's stage batch size, seed and
    dtype. micro_batch_size: stage_micro_batch_size, else the PPO micro-batch, bounds the
    stages' forward/backward (RM: pairs; memory only: the stages accumulate gradients up to
    stage_batch_size); the device is TrainSettings' auto."""
    from learner.stages import TrainSettings

    return TrainSettings(epochs=epochs, learning_rate=learning_rate, batch_size=config.stage_batch_size,
                         seed=config.seed, dtype=config.stage_dtype or config.dtype, save_dtype=config.dtype,
                         micro_batch_size=config.stage_micro_batch_size or config.micro_batch_size)


def run_stage(config: PPOConfig, stage: str, base_model: str, data: tuple, settings, out_dir: str | os.PathLike,
              val: Optional[tuple] = None) -> dict:
    """Train the SFT ("sft") or reward-model ("rm") stage (learner.stages.train_sft /
    train_reward_model on `base_model`, the token-id lists `data` and `val`) as a Ray task
    with the config's stage resources (stage_num_cpus / stage_num_gpus / stage_resources,
    each defaulting to the learner's), reserved in a placement group first, so a demand the
    cluster cannot hold fails fast (ClusterError) and a GPU stage runs on a GPU worker, not
    on the driver's node. The base model reaches the task as the PPO actors get theirs
    (prepare_models), and the stage's output directory comes back to `out_dir` on the
    driver's node through the object store (written there directly when the task ran on
    the driver's node). Returns the stage's statistics."""
    import uuid

    from ppo_ray.transfer import write_files

    init_ray(log_level=config.log_level, metrics_report_interval_ms=config.metrics_report_interval_ms)
    cpus, gpus, resources = config.stage_demand
    demands = [Demand(f"stage-{stage}", cpus, gpus, resources)]
    pg, index = reserve(config, demands, name=f"ppo-ray-{stage}-{uuid.uuid4().hex[:8]}")
    try:
        model = prepare_models(config, {"base": base_model}, group_nodes(pg))["base"]
        here = ray.get_runtime_context().get_node_id()
        # max_calls=1: the worker process exits after the stage, so its GPU memory is free for PPO
        task = ray.remote(max_calls=1)(_stage_task).options(
            name=f"ppo/{stage}", num_cpus=cpus, num_gpus=gpus, resources=resources, max_retries=0,
            runtime_env={"env_vars": {**quiet_env(config.log_level), **cpu_share_env(config, "stage")}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=index[0]))
        stats, files, node = ray.get(task.remote(stage, config.log_level, model, data, settings, val,
                                                 str(Path(out_dir).resolve()), here))
        if files is not None:
            t0 = time.perf_counter()
            write_files(files, out_dir)
            log.info("stage %s: its output came from node %s through the object store into %s (%.1f s)", stage,
                     node[:8], out_dir, time.perf_counter() - t0)
        return stats
    finally:
        remove_placement_group(pg)


def _stage_task(stage: str, log_level: str, model: "str | ShippedModel", data: tuple, settings,
                val: Optional[tuple], out_dir: str, driver_node: str) -> tuple[dict, Optional[dict], str]:
    """The stage's Ray task: (stats, the output directory's files or None when it wrote
    `out_dir` itself on the driver's node, this node's id)."""
    import shutil
    import tempfile

    from ppo_ray.logs import setup_logging
    from ppo_ray.transfer import read_files

    setup_logging(log_level)
    quiet_libraries(log_level)
    _set_torch_threads()
    from learner.stages import train_reward_model, train_sft

    node = ray.get_runtime_context().get_node_id()
    local = node == driver_node
    out = out_dir if local else tempfile.mkdtemp(prefix=f"ppo-ray-{stage}-")
    train = {"sft": train_sft, "rm": train_reward_model}[stage]
    try:
        stats = train(local_model_dir(model), *data, out, settings, val=val)
        return stats, (None if local else read_files(out)), node
    finally:
        if not local:
            shutil.rmtree(out, ignore_errors=True)
