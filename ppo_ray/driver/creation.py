"""Bundles and actor creation: what each actor reserves (Demand, role_demands), one placement
group with a bundle per actor (plan_bundles, reserve: a demand the cluster can never hold, or
cannot place in time, is a ClusterError naming it), and the actors created in it, named
<run tag>/<role> (create_roles, wait_ready), which the driver then calls through
ppo_ray.driver.roles.Roles.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Mapping, NamedTuple, Optional

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ppo_ray.driver.cluster import ClusterError, alive_nodes, format_resources, user_resources
from ppo_ray.config import PPOConfig
from ppo_ray.deadlines import Deadlines
from ppo_ray.driver.hosts import HOSTS, cpu_share_env
from ppo_ray.logs import quiet_env
from ppo_ray.modeling import check_context_length
from ppo_ray.paths import resolve_model_path
from ppo_ray.driver.roles import Roles, form_learner_group, role_names
from ppo_ray.driver.shipping import ModelStore, ShippedModel, group_nodes, prepare_models

log = logging.getLogger(__name__)


class ModelDirs(NamedTuple):
    """The local directories of the run's models: model_name's (the policy's base), the
    reference's, the reward model's and the value model's (None: not configured)."""

    model: str
    ref: str
    reward: Optional[str]
    value: Optional[str]

    @classmethod
    def of(cls, config: PPOConfig) -> "ModelDirs":
        """Each configured model as a local directory (ppo_ray.paths.resolve_model_path: a hub id
        or a GGUF file is converted or fetched once), checked before any actor starts: the vLLM
        engine would refuse a max_model_len over a model's window (ContextLengthError naming it)."""
        dirs = cls(resolve_model_path(config.model_name),
                   resolve_model_path(config.ref_model_name or config.model_name),
                   resolve_model_path(config.reward_model_name) if config.reward_model_name else None,
                   resolve_model_path(config.value_model_name) if config.value_model_name else None)
        check_context_length(config.max_prompt_length, config.max_new_tokens, {
            "model_name": dirs.model, "ref_model_name": dirs.ref, "reward_model_name": dirs.reward,
            "value_model_name": dirs.value})
        return dirs


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


def _describe(demands: list[Demand], nodes: list[tuple[str, dict[str, float]]]) -> str:
    roles = "; ".join(f"ppo/{d.role} {format_resources(d.bundle()) if d.bundle() else '{} (reserves nothing)'}"
                      for d in demands)
    return f"The actors ask for: {roles}. The cluster's nodes: " + "; ".join(f"{n} {format_resources(r)}" for n, r in nodes)


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
    nodes = alive_nodes()
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
                               f"{format_resources(d.bundle())}. " + _describe(demands, nodes))


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
            + _describe(demands, alive_nodes())
            + f"; free now in all: {format_resources(user_resources(ray.available_resources()))}. Lower the demands, "
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
