"""The old home of the Ray plumbing, kept so that `from ppo_ray.placement import X` still works
(launch scripts, users' code): every public name it had, re-exported from the module that now
holds it, one per subject:

    ppo_ray/driver/cluster.py      connecting to the cluster (init_ray, check_ray_address), the console
                            filter for the actors' lines, ClusterError, what the nodes have
    ppo_ray/driver/shipping.py     model directories to other nodes (ShippedModel, ModelStore, prepare_models)
    ppo_ray/driver/hosts.py        the actor hosts (GeneratorHost, ReferenceHost, RewardHost, LearnerHost,
                            HOSTS) and their CPU rule (cpu_share_env)
    ppo_ray/driver/reward_pool.py  the reward workers (RewardWorkerPool)
    ppo_ray/driver/creation.py     bundles and actor creation (Demand, role_demands, plan_bundles, reserve,
                            create_roles, wait_ready)
    ppo_ray/driver/stage_tasks.py  the SFT / RM stages as Ray tasks (stage_settings, run_stage)

The project imports from those modules, not from here. The names are the same objects: a class
pickles under its new module's path (nothing persisted names this module: checkpoints hold
tensors and plain states only, ppo_ray.driver.checkpoint).
"""

from __future__ import annotations

from ppo_ray.driver.cluster import ClusterError, check_ray_address, init_ray, keep_actor_lines_off_the_console
from ppo_ray.driver.creation import Demand, create_roles, plan_bundles, reserve, role_demands, wait_ready
from ppo_ray.driver.hosts import (CPU_SHARE_ENV, HOSTS, MALLOC_ENV, GeneratorHost, LearnerHost, ReferenceHost, RewardHost,
                           cpu_share_env)
from ppo_ray.driver.reward_pool import RewardWorkerPool
from ppo_ray.driver.shipping import ModelStore, ShippedModel, group_nodes, local_model_dir, prepare_models, ship_model
from ppo_ray.driver.stage_tasks import run_stage, stage_settings

__all__ = [
    "ClusterError", "init_ray", "check_ray_address", "keep_actor_lines_off_the_console",
    "ShippedModel", "ModelStore", "ship_model", "local_model_dir", "group_nodes", "prepare_models",
    "GeneratorHost", "ReferenceHost", "RewardHost", "LearnerHost", "HOSTS", "CPU_SHARE_ENV", "MALLOC_ENV",
    "cpu_share_env",
    "RewardWorkerPool",
    "Demand", "role_demands", "plan_bundles", "reserve", "create_roles", "wait_ready",
    "stage_settings", "run_stage",
]
