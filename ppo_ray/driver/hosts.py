"""The actor hosts: one thin Ray actor class per role kind (HOSTS), each wrapping its plain role
class (actors.generator.Generator, actors.reference.ReferenceScorer, actors.reward.RewardScorer,
learner.learner.Learner), which knows nothing of Ray; a host checks the adapter version the
driver expects, times the call (its seconds come back in the typed result: ppo_ray.stats, one
timing convention) and logs one line per call. Also each actor's CPU rule: its torch threads
(set_torch_threads) and the environment that carries the rule and glibc malloc's settings
(cpu_share_env). With ppo_ray.driver.stage_tasks, the only driver module that imports the roles.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Mapping, Optional

import ray

from ppo_ray.attribution import AttributionRows, held_out_rows
from ppo_ray.batch import RolloutBatch, RowPick, gather
from ppo_ray.config import ConfigSlice, PPOConfig
from ppo_ray.faults import StateLostError
from ppo_ray.logs import actor_logger, quiet_libraries
from ppo_ray.driver.env_pool import EnvWorkerPool
from ppo_ray.driver.reward_pool import RewardWorkerPool
from ppo_ray.driver.roles import call_label
from ppo_ray.driver.shipping import ShippedModel, local_model_dir
from ppo_ray.stats import EpisodeSummary, GenerateRequest, GenerationSummary, ReferenceStats, RewardStats, SyncReport

if TYPE_CHECKING:
    from torch import Tensor

    from ppo_ray.data import PromptColumns
    from ppo_ray.modeling import LoraWeights
    from ppo_ray.stats import LearnerState


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
        """torch's CPU threads in this actor (the CPU rule's result: set_torch_threads)."""
        import torch

        return torch.get_num_threads()


class GeneratorHost(_Host):
    def __init__(self, config: ConfigSlice, model_dir: "str | ShippedModel"):
        quiet_libraries(config.log_level)
        from actors.generator import Generator

        set_torch_threads()  # before the engine: vLLM's CPU worker then freezes torch.set_num_threads
        self.log = actor_logger(config.log_level)
        self.model_dir = local_model_dir(model_dir)
        # the environment's workers (env_workers > 0): Ray actors of this one's, which end with it
        self.env_pool = EnvWorkerPool.from_config(config) if config.environment and config.env_workers else None
        try:
            self.generator = Generator.from_config(config, self.model_dir, env_runner=self.env_pool)
        except BaseException:
            if self.env_pool is not None:
                self.env_pool.close()
            raise

    @ray.method(num_returns=2)
    def generate(self, prompt_ids: list[list[int]],
                 request: GenerateRequest) -> tuple[RolloutBatch, GenerationSummary]:
        """Generator.generate with the request's options (ppo_ray.stats.GenerateRequest); with an
        environment, Generator.generate_episodes, the request's rows its environments'."""
        _check_version(self.generator, request.version, f"step {request.step + 1}'s rollouts")
        t0 = time.perf_counter()
        episodes = None
        if self.generator.environment is not None:
            batch, eps = self.generator.generate_episodes(prompt_ids, **request.options(), rows=request.rows)
            episodes = [EpisodeSummary.of(ep, score) for ep, score in zip(eps, batch.env_rewards.tolist())]
        else:
            batch = self.generator.generate(prompt_ids, **request.options())
        summary = GenerationSummary.of(batch, seconds=time.perf_counter() - t0, episodes=episodes)
        tokens = sum(summary.lengths)
        self.log.info("%s: %d rollouts with adapter v%d, %d response tokens, %.2f s (%.0f tok/s)",
                      call_label(request.step), len(summary.lengths),
                      summary.version, tokens, summary.seconds, tokens / max(summary.seconds, 1e-9))
        return batch, summary

    def load_adapter(self, version: int, weights: LoraWeights, restore: bool = False,
                     retire_below: int | None = None) -> SyncReport:
        report = self.generator.load_adapter(version, weights, restore=restore, retire_below=retire_below)
        self.log.info("adapter v%d loaded%s: %.2f MB, write %.2f s, register %.2f s", report.version,
                      " (restore)" if restore else "", report.nbytes / 1e6, report.write_s, report.register_s)
        return report

    def close(self) -> None:
        """Before the actor exits (Roles.release): retire the adapter, delete its files, end the
        environment workers."""
        try:
            self.generator.close()
        finally:
            if self.env_pool is not None:
                self.env_pool.close()

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


def set_torch_threads(threads: int = 0) -> None:
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

        set_torch_threads(config.scorer_torch_threads)
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

    def held_out(self, *parts: RolloutBatch, rows: list[int], kl_estimator: str) -> AttributionRows:
        """An evaluation's held-out samples `rows` (of its generation `parts`, in order), per
        token: the generator's and the reference's logprobs and KL_t (ppo_ray.attribution.
        held_out_rows). One reference pass over those rows only; the reference changes nothing."""
        from learner.algos import kl_penalty

        batch = gather(parts, RowPick((len(parts),), (tuple(rows),)))
        logprobs, _ = self.scorer.logprobs(batch)
        logprobs = logprobs.to(batch.gen_logprobs.device)
        kl = kl_penalty(batch.gen_logprobs.float(), logprobs.float(), kl_estimator, mask=batch.loss_mask)
        return held_out_rows(batch, logprobs, kl, rows)


class RewardHost(_Host):
    def __init__(self, config: ConfigSlice, reward_model_dir: "str | ShippedModel | None"):
        quiet_libraries(config.log_level)
        from actors.reward import RewardScorer

        set_torch_threads(config.scorer_torch_threads)
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

        set_torch_threads()
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

    def attribution(self, rows: list[int]):
        """The last update's per-token tensors of `rows` (Learner.attribution; None: none here)."""
        return self.learner.attribution(rows)

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
