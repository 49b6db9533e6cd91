"""The two-node scenario of tests/test_cluster.py, run as its own process.

A Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster: a head with the
custom resource node_a, a worker with node_b; each its own raylet and object store). It
cannot share a process with the test session's local Ray, hence a script:

    python tests/cluster_scenario.py [fail-fast|train|all]   # prints: CLUSTER_RESULT {json}

1. fail-fast (seconds) (before any actor starts): a custom resource no node has; an actor larger than
   every node; STRICT_PACK of more CPUs than one node has; STRICT_SPREAD of more bundles
   than nodes.
2. train (about a minute on 2 cores: two vLLM engines start): the SFT and reward-model
   stages as Ray tasks pinned to node B (stage_resources), their outputs written into the
   run directory by the driver on node A; then a PPOTrainer on those models (policy and
   reference = sft/, reward and value = rm/) with 2 generator replicas pinned to node B, 2
   learners and both scorers pinned to node A (generator_resources / learner_resources /
   scorer_resources), 2 steps; then where every actor runs and which directory it loaded its
   model from, the versions, prompt order across replicas, the generators' logprobs against
   the learners', and where a restarted actor comes back.

Each node has its own model cache (PPO_RAY_MODEL_CACHE in its raylet's environment): a
model directory reaches a node other than the driver's only through Ray's object store
(model_transfer: ray), so what node B loads comes from node B's cache, never from the
run directory, as on a cluster without shared storage.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # helpers.tiny_test_config

PROMPTS = 8
SEED_STEP = 123_456  # a sampling seed no training step uses


def node_of(actor) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def fail_fast_cases(PPOTrainer, ClusterError, config) -> list[dict]:
    cases = {
        "missing custom resource": config(generator_resources={"node_c": 1}),
        "an actor larger than every node": config(generator_num_cpus=3.0),
        "STRICT_PACK over one node": config(placement_strategy="STRICT_PACK", generator_num_cpus=1.5,
                                            learner_num_cpus=1.5),
        "STRICT_SPREAD over too few nodes": config(placement_strategy="STRICT_SPREAD", num_learners=2,
                                                   learner_num_cpus=0.5, generator_num_cpus=0.5),
    }
    out = []
    for case, cfg in cases.items():
        t0 = time.perf_counter()
        try:
            PPOTrainer(cfg).shutdown()
            error, message = None, ""
        except ClusterError as e:
            error, message = type(e).__name__, str(e)
        out.append({"case": case, "error": error, "message": message,
                    "elapsed_s": time.perf_counter() - t0, "timeout_s": cfg.placement_timeout_s})
    return out


def main(mode: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from helpers import tiny_test_config
    from ppo_ray.driver.cluster import ClusterError
    from ppo_ray.trainer import PPOTrainer

    t_start = time.perf_counter()
    caches = {name: tempfile.mkdtemp(prefix=f"ppo-cache-{name}-") for name in ("node_a", "node_b")}
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, resources={"node_a": 10}, include_dashboard=False, object_store_memory=300 << 20,
        env_vars={"PPO_RAY_MODEL_CACHE": caches["node_a"]}))
    cluster.add_node(num_cpus=2, resources={"node_b": 10}, object_store_memory=300 << 20,
                     env_vars={"PPO_RAY_MODEL_CACHE": caches["node_b"]})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    result: dict = {}
    try:
        labels = {}
        for node in ray.nodes():
            for key in ("node_a", "node_b"):
                if key in node["Resources"]:
                    labels[node["NodeID"]] = key
        result["nodes"] = sorted(labels.values())

        def config(**changes):
            return tiny_test_config(**{"placement_timeout_s": 2.0, **changes})

        if mode in ("fail-fast", "all"):
            result["fail_fast"] = fail_fast_cases(PPOTrainer, ClusterError, config)
            result["fail_fast_s"] = time.perf_counter() - t_start
        if mode in ("train", "all"):
            result.update(train(PPOTrainer, config, labels, caches))
    finally:
        ray.shutdown()
        cluster.shutdown()
        for path in caches.values():
            shutil.rmtree(path, ignore_errors=True)
    result["total_s"] = time.perf_counter() - t_start
    return result


def stages(config, run_dir: Path) -> dict:
    """SFT then the reward model, each a Ray task pinned to node B by stage_resources, on a
    few bundled prompts (a plumbing check: 16 examples, one epoch)."""
    from learner.stages import TrainSettings
    from ppo_ray.data import bundled_prompts, encode_prompts
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.paths import resolve_model_path
    from ppo_ray.driver.stage_tasks import run_stage

    cfg = config(stage_resources={"node_b": 1}, stage_num_cpus=1.0)
    base = resolve_model_path(cfg.model_name)
    tok = load_tokenizer(base)
    queries = encode_prompts(tok, bundled_prompts()[:16], 64, "left")
    eos = tok.eos_token_id
    good = [tok(" a short summary", add_special_tokens=False)["input_ids"] + [eos]] * len(queries)
    bad = [tok(" no", add_special_tokens=False)["input_ids"] + [eos]] * len(queries)
    settings = TrainSettings(epochs=1, learning_rate=1e-3, batch_size=8, seed=0)
    t0 = time.perf_counter()
    sft = run_stage(cfg, "sft", base, (queries, good), settings, run_dir / "sft")
    rm = run_stage(cfg, "rm", str(run_dir / "sft"), (queries, good, bad), settings, run_dir / "rm")
    return {"stages_s": time.perf_counter() - t0, "sft_steps": sft["sft_steps"], "rm_steps": rm["rm_steps"],
            "stage_outputs": sorted(p.name for p in run_dir.iterdir() if (p / "config.json").is_file())}


def cache_entries(caches: dict[str, str]) -> dict[str, int]:
    """Complete model entries in each node's cache."""
    return {name: sum(1 for p in Path(path).iterdir() if (p / ".complete").is_file()) for name, path in caches.items()}


def train(PPOTrainer, config, labels: dict[str, str], caches: dict[str, str]) -> dict:
    import ray

    from ppo_ray.data import bundled_prompts, encode_prompts
    from ppo_ray.stats import GenerateRequest

    result: dict = {}
    run_dir = Path(tempfile.mkdtemp(prefix="ppo-run-"))
    result.update(stages(config, run_dir))
    # node B received the base model (for SFT) and sft/ (for RM): its cache holds both
    result["cache_after_stages"] = cache_entries(caches)
    # Fractional CPUs: 2 x 0.5 on each node of 2 (virtual) CPUs.
    t0 = time.perf_counter()
    trainer = PPOTrainer(config(
        model_name=str(run_dir / "sft"), reward_model_name=str(run_dir / "rm"), value_model_name=str(run_dir / "rm"),
        reward_funcs=[], reward_weights=[],
        num_generators=2, num_learners=2, generator_num_cpus=0.5, learner_num_cpus=0.5,
        generator_resources={"node_b": 1}, learner_resources={"node_a": 1}, scorer_resources={"node_a": 0.1},
        placement_timeout_s=60.0))
    result["start_s"] = time.perf_counter() - t0
    try:
        roles = trainer.roles
        result["actor_nodes"] = {name: labels[node_of(actor)] for name, actor in zip(roles.names(), roles.all())}

        def loaded_from(actor) -> str:
            path = ray.get(actor.__ray_call__.remote(lambda self: self.model_dir))
            for name, cache in caches.items():
                if str(path).startswith(cache):
                    return f"cache:{name}"
            return "run_dir" if str(path).startswith(str(run_dir)) else str(path)

        result["loaded_from"] = {name: loaded_from(actor) for name, actor in zip(roles.names(), roles.all())}
        result["cache_after_start"] = cache_entries(caches)

        prompts = bundled_prompts()[:PROMPTS]
        t0 = time.perf_counter()
        steps = [trainer.ppo_step(prompts) for _ in range(2)]
        result["steps_s"] = time.perf_counter() - t0
        result["step_texts"] = [len(s["generated_texts"]) for s in steps]
        result["first_minibatch_ratio_mean"] = [s["first_minibatch_ratio_mean"] for s in steps]
        result["versions"] = {
            "trainer": trainer.version,
            "generators": ray.get([g.version.remote() for g in roles.generators]),
            "learners": ray.get([learner.version.remote() for learner in roles.learners]),
        }

        # Prompt order: the trainer splits prompts 0-3 / 4-7 over replicas 0 / 1 and joins
        # the texts in prompt order. Each half generated on the OTHER replica (same seeds:
        # they follow the prompt's global index) gives the same texts in the same places.
        together = trainer.generate(prompts, seed_step=SEED_STEP).texts
        ids = encode_prompts(trainer.tokenizer, prompts, trainer.config.max_prompt_length, "error")
        half = PROMPTS // 2
        swapped = ray.get([roles.generators[1].generate.remote(ids[:half], GenerateRequest(SEED_STEP, 0))[1],
                           roles.generators[0].generate.remote(ids[half:], GenerateRequest(SEED_STEP, half))[1]])
        result["order"] = {"same": together == swapped[0].texts + swapped[1].texts,
                           "distinct_texts": len(set(together))}

        # Generator (node B) vs learner (node A) logprobs of the generator's sampled tokens;
        # the rollout travels between the nodes' object stores as an ObjectRef.
        diffs = {}
        for i, gen in enumerate(roles.generators):
            batch_ref, _ = gen.generate.remote(ids, GenerateRequest(SEED_STEP + 1, 0))
            batch = ray.get(batch_ref)
            for rank, learner in enumerate(roles.learners):
                learner_lp = ray.get(learner.__ray_call__.remote(lambda host, b: host.learner.rollout_scores(b, logprobs=True).logprobs.cpu(), batch_ref))
                diff = (learner_lp - batch.gen_logprobs).abs()[batch.response_mask]
                diffs[f"generator-{i}/learner-{rank}"] = float(diff.max()) if diff.numel() else None
        result["logprob_max_abs_diff"] = diffs

        # A restarted actor (max_restarts) goes back into its bundle: a new process on the
        # same node, in the same placement group.
        def where(actor) -> dict:
            def probe(self):
                ctx = ray.get_runtime_context()
                return {"pid": os.getpid(), "node": labels[ctx.get_node_id()],
                        "group": ctx.get_placement_group_id()}
            return ray.get(actor.__ray_call__.remote(probe))

        before = where(roles.reward)
        ray.kill(roles.reward, no_restart=False)
        deadline = time.monotonic() + 60
        while True:
            try:
                after = where(roles.reward)
                if after["pid"] != before["pid"]:
                    break
            except ray.exceptions.RayActorError:  # restarting
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the reward actor did not come back within 60 s")
            time.sleep(0.5)
        result["restarted_reward"] = {"before": before, "after": after,
                                      "group_id": roles.placement_group.id.hex()}
    finally:
        trainer.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    # shutdown removed the placement group (and so freed its reservations); the removal is
    # asynchronous: wait for it (up to 30 s), then report what is left
    deadline = time.monotonic() + 30
    while True:
        states = [t["state"] for t in ray.util.placement_group_table().values()]
        result["groups_left"] = [s for s in states if s != "REMOVED"]
        if not result["groups_left"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return result


if __name__ == "__main__":
    print("CLUSTER_RESULT " + json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "all")), flush=True)
