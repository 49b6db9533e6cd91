"""All Ray plumbing: connecting to a cluster, the thin actor hosts, and their creation.

The role classes (actors.generator.Generator, actors.reference.ReferenceScorer,
actors.reward.RewardScorer, learner.learner.Learner) know nothing of Ray; the hosts below
wrap each in a Ray actor, keep its methods' results as ObjectRefs, and time them. Only this
module and ppo_ray.trainer import ray.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from ppo_ray.batch import RolloutBatch
from ppo_ray.config import PPOConfig


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached or cannot host the requested actors."""


def init_ray(address: str | None = None, connect_timeout_s: float = 5.0) -> None:
    """Attach to RAY_ADDRESS (or `address`) when set, else start a local Ray.

    The local default binds the dashboard to 127.0.0.1 only. Under `ray job submit` Ray
    sets RAY_ADDRESS for the entrypoint, so the same call attaches to the cluster. An
    address where nothing listens is a ClusterError naming it within `connect_timeout_s`
    (check_ray_address): ray.init itself retries such an address for minutes (measured:
    still waiting after 300 s for a closed port on 127.0.0.1, Ray 2.60).
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_ray_address(address, connect_timeout_s)
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ClusterError(f"cannot connect to the Ray cluster at RAY_ADDRESS={address!r}: {e}") from e
    else:
        ray.init(dashboard_host="127.0.0.1", log_to_driver=True)


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


# ----------------------------------------------------------------------------- hosts
class GeneratorHost:
    def __init__(self, config: PPOConfig, model_dir: str):
        from actors.generator import Generator

        self.generator = Generator.from_config(config, model_dir)

    @ray.method(num_returns=2)
    def generate(self, prompt_ids: list[list[int]], step: int, offset: int) -> tuple[RolloutBatch, dict]:
        t0 = time.perf_counter()
        batch = self.generator.generate(prompt_ids, step=step, prompt_offset=offset)
        summary = {
            "texts": batch.responses, "finish_reasons": batch.finish_reasons,
            "version": batch.adapter_version, "tokens": int(batch.response_mask.sum()),
            "generate_s": time.perf_counter() - t0,
        }
        return batch, summary

    def load_adapter(self, version: int, weights: dict, restore: bool = False) -> dict:
        return {"version": version, **self.generator.load_adapter(version, weights, restore=restore)}

    def sequence_logprobs(self, prompt_ids: list[int], continuation_ids: list[int]):
        return self.generator.sequence_logprobs(prompt_ids, continuation_ids)

    def version(self) -> int:
        return self.generator.version


class ReferenceHost:
    def __init__(self, config: PPOConfig, model_dir: str):
        from actors.reference import ReferenceScorer

        self.scorer = ReferenceScorer(model_dir, temperature=config.temperature, dtype=config.dtype,
                                      micro_batch_size=config.micro_batch_size)

    def logprobs(self, *parts: RolloutBatch):
        return self.scorer.logprobs(RolloutBatch.cat(parts))

    def last_seconds(self) -> float:
        return self.scorer.last_seconds


class RewardHost:
    def __init__(self, config: PPOConfig, reward_model_dir: str | None):
        from actors.reward import RewardScorer

        self.scorer = RewardScorer(
            reward_model_dir, config.reward_funcs, config.reward_weights,
            missing_eos_penalty=config.missing_eos_penalty, nonfinite=config.nonfinite_reward,
            dtype=config.dtype, micro_batch_size=config.micro_batch_size)

    @ray.method(num_returns=2)
    def score(self, *parts: RolloutBatch):
        return self.scorer.score(RolloutBatch.cat(parts))


class LearnerHost:
    def __init__(self, config: PPOConfig, model_dir: str, value_model_dir: str | None):
        from learner.learner import Learner

        self.learner = Learner(config, model_dir, value_model_dir)

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

    def current_weights(self) -> tuple[int, dict]:
        """(version, LoRA weights) of the policy now: what a (re)started generator needs."""
        return self.learner.version, self.learner.lora_weights()

    @ray.method(num_returns=2)
    def update(self, ref_logprobs, scores, *parts: RolloutBatch):
        return self.learner.update(RolloutBatch.cat(parts), ref_logprobs, scores)

    def logprobs(self, *parts: RolloutBatch):
        return self.learner.logprobs(RolloutBatch.cat(parts))

    def full_logprobs(self, *parts: RolloutBatch):
        return self.learner.full_logprobs(RolloutBatch.cat(parts))

    def version(self) -> int:
        return self.learner.version

    def state_dict(self) -> dict:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict) -> int:
        self.learner.load_state_dict(state)
        return self.learner.version

    def save_adapter(self, path: str) -> str:
        """The policy's LoRA in PEFT format (adapter_config.json + adapter_model.safetensors)."""
        self.learner.policy.save_pretrained(path)
        return path


# ----------------------------------------------------------------------------- creation
@dataclass
class Roles:
    generators: list[ActorHandle]
    reference: ActorHandle
    reward: ActorHandle
    learners: list[ActorHandle]  # rank order; rank 0 exports the LoRA weights

    @property
    def learner(self) -> ActorHandle:
        """Rank 0 of the learner group (the only learner when num_learners is 1)."""
        return self.learners[0]

    def names(self) -> list[str]:
        """Role names in all()'s order, as in the actor names ppo/<role>."""
        learners = ["learner"] if len(self.learners) == 1 else [f"learner-{i}" for i in range(len(self.learners))]
        return [f"generator-{i}" for i in range(len(self.generators))] + ["reference", "reward", *learners]

    def all(self) -> list[ActorHandle]:
        return [*self.generators, self.reference, self.reward, *self.learners]


def _check_capacity(config: PPOConfig) -> None:
    """Fail fast, naming the shortfall, instead of hanging on actors that cannot be placed."""
    need_cpu = (config.num_generators * config.generator_num_cpus + config.num_learners * config.learner_num_cpus
                + 2 * config.scorer_num_cpus)
    need_gpu = (config.num_generators * config.generator_num_gpus + config.num_learners * config.learner_num_gpus
                + 2 * config.scorer_num_gpus)
    have = ray.cluster_resources()
    for name, need, key in (("CPUs", need_cpu, "CPU"), ("GPUs", need_gpu, "GPU")):
        if need > have.get(key, 0.0) + 1e-9:
            raise ClusterError(
                f"the config asks for {need:g} {name} in all (num_generators={config.num_generators} x "
                f"generator_num_{key.lower()}s, num_learners={config.num_learners} x learner_num_{key.lower()}s, "
                f"2 scorers) but the Ray cluster has "
                f"{have.get(key, 0.0):g}; lower the *_num_{key.lower()}s fields or add nodes")


def create_roles(config: PPOConfig, *, model_dir: str, ref_model_dir: str, reward_model_dir: str | None,
                 value_model_dir: str | None, namespace: str) -> Roles:
    """Create the actors, named ppo/<role> in `namespace` (as the dashboard shows them)."""
    _check_capacity(config)

    def opts(name: str, cpus: float, gpus: float) -> dict:
        # vLLM logs every request at INFO from inside the generator; WARNING unless the user
        # asked for more (VLLM_LOGGING_LEVEL in the driver's environment wins).
        env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        # max_restarts: Ray re-runs a dead actor's constructor (the trainer then re-syncs its
        # adapter / restores the learner's checkpoint and retries the step); calls are not
        # retried by Ray itself (max_task_retries=0): the trainer decides what is safe to redo.
        return dict(name=f"ppo/{name}", namespace=namespace, num_cpus=cpus, num_gpus=gpus,
                    max_concurrency=1, runtime_env={"env_vars": env},
                    max_restarts=config.max_actor_restarts, max_task_retries=0)

    gens = [
        ray.remote(GeneratorHost).options(**opts(f"generator-{i}", config.generator_num_cpus,
                                                 config.generator_num_gpus)).remote(config, model_dir)
        for i in range(config.num_generators)
    ]
    ref = ray.remote(ReferenceHost).options(**opts("reference", config.scorer_num_cpus,
                                                   config.scorer_num_gpus)).remote(config, ref_model_dir)
    rew = ray.remote(RewardHost).options(**opts("reward", config.scorer_num_cpus,
                                                config.scorer_num_gpus)).remote(config, reward_model_dir)
    learner_names = (["learner"] if config.num_learners == 1
                     else [f"learner-{i}" for i in range(config.num_learners)])
    learners = [ray.remote(LearnerHost).options(**opts(name, config.learner_num_cpus, config.learner_num_gpus)).remote(
        config, model_dir, value_model_dir) for name in learner_names]
    roles = Roles(gens, ref, rew, learners)
    wait_ready(roles)
    form_learner_group(roles)
    return roles


def form_learner_group(roles: Roles, timeout_s: float = 120.0) -> None:
    """Join the learners into one torch.distributed group (rank = position in roles.learners;
    rank 0's node hosts the rendezvous). Also re-forms it after a learner was restarted (each
    member leaves its old group first). No-op for a single learner."""
    if len(roles.learners) == 1:
        return
    address = ray.get(roles.learners[0].rendezvous_address.remote())
    ray.get([actor.join_group.remote(address, rank, len(roles.learners), timeout_s)
             for rank, actor in enumerate(roles.learners)])


def wait_ready(roles: Roles) -> None:
    """Block until every actor's constructor finished (engine start, model loads), so step 1
    is timed honestly and a role that cannot start is named instead of surfacing mid-step."""
    for name, actor in zip(roles.names(), roles.all()):
        try:
            ray.get(actor.__ray_ready__.remote())
        except ray.exceptions.RayActorError as e:
            for other in roles.all():
                ray.kill(other)
            raise ClusterError(f"actor ppo/{name} failed to start: {e}") from e


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges that split n items into `parts` contiguous chunks (prompt order kept)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out
