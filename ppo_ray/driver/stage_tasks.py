"""The SFT and reward-model stages as Ray tasks: each with the config's stage resources, in a
placement group of its own, its base model shipped as the PPO actors' are, its output directory
brought back to the driver's node (run_stage); stage_settings builds the stages' training
settings (learner.stages.TrainSettings) so the pipeline does not import learner/.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ppo_ray.driver.cluster import init_ray
from ppo_ray.config import PPOConfig
from ppo_ray.driver.creation import Demand, reserve
from ppo_ray.driver.hosts import cpu_share_env, set_torch_threads
from ppo_ray.logs import quiet_env, quiet_libraries
from ppo_ray.driver.shipping import ShippedModel, group_nodes, local_model_dir, prepare_models

log = logging.getLogger(__name__)


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
              val: Optional[tuple] = None, env_masks: Optional[list] = None) -> dict:
    """Train the SFT ("sft") or reward-model ("rm") stage (learner.stages.train_sft /
    train_reward_model on `base_model`, the token-id lists `data` and `val`) as a Ray task
    with the config's stage resources (stage_num_cpus / stage_num_gpus / stage_resources,
    each defaulting to the learner's), reserved in a placement group first, so a demand the
    cluster cannot hold fails fast (ClusterError) and a GPU stage runs on a GPU worker, not
    on the driver's node. The base model reaches the task as the PPO actors get theirs
    (prepare_models), and the stage's output directory comes back to `out_dir` on the
    driver's node through the object store (written there directly when the task ran on
    the driver's node). `env_masks` (SFT of a multi-turn task's transcripts): each response's
    environment tokens, out of the loss. Returns the stage's statistics."""
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
                                                 str(Path(out_dir).resolve()), here, env_masks))
        if files is not None:
            t0 = time.perf_counter()
            write_files(files, out_dir)
            log.info("stage %s: its output came from node %s through the object store into %s (%.1f s)", stage,
                     node[:8], out_dir, time.perf_counter() - t0)
        return stats
    finally:
        remove_placement_group(pg)


def _stage_task(stage: str, log_level: str, model: "str | ShippedModel", data: tuple, settings,
                val: Optional[tuple], out_dir: str, driver_node: str,
                env_masks: Optional[list] = None) -> tuple[dict, Optional[dict], str]:
    """The stage's Ray task: (stats, the output directory's files or None when it wrote
    `out_dir` itself on the driver's node, this node's id)."""
    import shutil
    import tempfile

    from ppo_ray.logs import setup_logging
    from ppo_ray.transfer import read_files

    setup_logging(log_level)
    quiet_libraries(log_level)
    set_torch_threads()
    from learner.stages import train_reward_model, train_sft

    node = ray.get_runtime_context().get_node_id()
    local = node == driver_node
    out = out_dir if local else tempfile.mkdtemp(prefix=f"ppo-ray-{stage}-")
    train = {"sft": train_sft, "rm": train_reward_model}[stage]
    try:
        extra = {"env_masks": env_masks} if env_masks is not None else {}  # SFT of transcripts only
        stats = train(local_model_dir(model), *data, out, settings, val=val, **extra)
        return stats, (None if local else read_files(out)), node
    finally:
        if not local:
            shutil.rmtree(out, ignore_errors=True)
