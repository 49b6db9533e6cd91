"""PPOTrainer: the driver-side orchestration of one PPO step (seed steps 1-11) on Ray.

    trainer = PPOTrainer(PPOConfig(...))
    out = trainer.ppo_step(prompts)        # one step: generated_texts, rewards, losses, kl, ...
    history = trainer.train(prompts, steps=100)

Data between actors travels as ObjectRefs; the driver pulls only small things (texts,
B scores, stats). The generator reports the adapter version it sampled with and the
learner refuses rollouts from any other version, so a lost LoRA sync is an error, never
a silent off-policy step.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

import ray
import torch

from ppo_ray.config import PPOConfig
from ppo_ray.data import encode_prompts
from ppo_ray.metrics import TrainingMetrics
from ppo_ray.modeling import load_tokenizer, resolve_model_path
from ppo_ray.placement import Roles, create_roles, init_ray, split_evenly


class StaleAdapterError(RuntimeError):
    """A generator sampled with a LoRA version other than the learner's."""


class PPOTrainer:
    def __init__(self, config: PPOConfig, *, run_dir: str | Path | None = None):
        self.config = config
        # Everything that can fail cheaply fails before any actor starts.
        from actors.reward import import_reward_fn

        for spec in config.reward_funcs:
            import_reward_fn(spec)
        if config.reward_model_name is None and not config.reward_funcs:
            raise ValueError("no reward source: set reward_model_name and/or reward_funcs in the config")
        self.model_dir = resolve_model_path(config.model_name)
        self.ref_model_dir = resolve_model_path(config.ref_model_name or config.model_name)
        self.reward_model_dir = resolve_model_path(config.reward_model_name) if config.reward_model_name else None
        self.value_model_dir = resolve_model_path(config.value_model_name) if config.value_model_name else None
        self.tokenizer = load_tokenizer(self.model_dir)
        self.run_dir = Path(run_dir) if run_dir else None

        init_ray()
        self.namespace = f"ppo-{uuid.uuid4().hex[:8]}"
        self.metrics = TrainingMetrics(run=self.namespace)  # Prometheus gauges, tagged run=namespace
        self.roles: Roles = create_roles(
            config, model_dir=self.model_dir, ref_model_dir=self.ref_model_dir,
            reward_model_dir=self.reward_model_dir, value_model_dir=self.value_model_dir,
            namespace=self.namespace)
        self.version = ray.get(self.roles.learner.version.remote())
        self.step = 0

    # ------------------------------------------------------------------ one step
    def ppo_step(self, prompts: Sequence[str]) -> dict:
        """One PPO step on `prompts` (one rollout each). Returns texts, scores, losses,
        KL, the PPO diagnostics and per-phase seconds (all small Python values)."""
        cfg, roles = self.config, self.roles
        t_start = time.perf_counter()
        prompt_ids = encode_prompts(self.tokenizer, list(prompts), cfg.max_prompt_length, cfg.prompt_truncation)

        # 1-2. Generate on every replica (prompt order kept; seeds follow the global index).
        chunks = [(s, e) for s, e in split_evenly(len(prompt_ids), len(roles.generators)) if e > s]
        parts, summaries = [], []
        for gen, (s, e) in zip(roles.generators, chunks):
            batch_ref, summary_ref = gen.generate.remote(prompt_ids[s:e], self.step, s)
            parts.append(batch_ref)
            summaries.append(summary_ref)

        # 3-4. Reference logprobs and rewards, concurrently, straight from the object store.
        ref_logprobs = roles.reference.logprobs.remote(*parts)
        scores_ref, reward_stats_ref = roles.reward.score.remote(*parts)

        # 5-11. The learner: old logprobs/values, KL, shaped rewards, TD, GAE, returns, PPO.
        stats_ref, weights_ref = roles.learner.update.remote(ref_logprobs, scores_ref, *parts)

        summaries = ray.get(summaries)
        versions = {s["version"] for s in summaries}
        if versions != {self.version}:
            raise StaleAdapterError(f"generators sampled with adapter versions {sorted(versions)} "
                                    f"but the learner is at version {self.version}")
        stats = ray.get(stats_ref)  # raises the learner's own error (e.g. stale rollouts)
        t_update_done = time.perf_counter()

        # Sync: the new LoRA goes from the learner's object store entry to every replica.
        new_version = int(stats["version"])
        loads = ray.get([g.load_adapter.remote(new_version, weights_ref) for g in roles.generators])
        bad = [r["version"] for r in loads if r["version"] != new_version]
        if bad:
            raise StaleAdapterError(f"generators report adapter versions {bad} after loading {new_version}")
        sync_s = time.perf_counter() - t_update_done
        self.version = new_version

        scores, reward_stats = ray.get([scores_ref, reward_stats_ref])
        ref_s = ray.get(roles.reference.last_seconds.remote())
        self.step += 1
        wall = time.perf_counter() - t_start
        tokens = sum(s["tokens"] for s in summaries)
        out = {
            "step": self.step,
            "generated_texts": [t for s in summaries for t in s["texts"]],
            "finish_reasons": [f for s in summaries for f in s["finish_reasons"]],
            "rewards": scores.tolist(),
            "reward_mean": _nanmean(scores),
            # the learner's reward_mean is the shaped (score - beta*KL) return per sequence
            **{("shaped_reward_mean" if k == "reward_mean" else k): v for k, v in stats.items()
               if not isinstance(v, (list, dict))},
            **{k: v for k, v in reward_stats.items() if k != "reward_s"},
            "adapter_version": self.version,
            "time/generate_s": max(s["generate_s"] for s in summaries),
            "time/reference_s": ref_s,
            "time/reward_s": reward_stats["reward_s"],
            "time/learner_forward_s": stats.get("learner_forward_s", math.nan),
            "time/update_s": stats.get("update_s", math.nan),
            "time/sync_s": sync_s,
            # the sync's parts on the generator side (the rest of sync_s is the object-store
            # transfer of the LoRA tensors and the actor call)
            "time/sync_write_s": max(r["write_s"] for r in loads),
            "time/sync_register_s": max(r["register_s"] + r["retire_s"] for r in loads),
            "lora_sync_bytes": loads[0]["bytes"],
            "time/step_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else math.nan,
            "response_tokens": tokens,
        }
        return out

    # ------------------------------------------------------------------ evaluation
    def generate(self, prompts: Sequence[str], seed_step: int = 10**9) -> dict:
        """Sample one response per prompt with the current policy (no training). A fixed
        `seed_step` gives every prompt the same sampling seed before and after training,
        so comparisons of two policies use common random numbers."""
        cfg, gens = self.config, self.roles.generators
        prompt_ids = encode_prompts(self.tokenizer, list(prompts), cfg.max_prompt_length, cfg.prompt_truncation)
        chunks = [(s, e) for s, e in split_evenly(len(prompt_ids), len(gens)) if e > s]
        refs = [gen.generate.remote(prompt_ids[s:e], seed_step, s)[1] for gen, (s, e) in zip(gens, chunks)]
        summaries = ray.get(refs)
        return {"texts": [t for s in summaries for t in s["texts"]],
                "finish_reasons": [f for s in summaries for f in s["finish_reasons"]],
                "version": summaries[0]["version"]}

    def save_adapter(self, path: str | Path) -> Path:
        """Write the policy's LoRA adapter (PEFT format: PeftModel.from_pretrained and vLLM load it).
        The path must be reachable from the learner's node (local runs: any path)."""
        return Path(ray.get(self.roles.learner.save_adapter.remote(str(path))))

    # ------------------------------------------------------------------ many steps
    def train(self, prompts: Sequence[str], steps: Optional[int] = None, *, progress: bool = True,
              metrics_path: str | Path | None = None,
              evaluate: Optional[Callable[["PPOTrainer", int], dict]] = None) -> list[dict]:
        """Run `steps` PPO steps (default config.steps) on batches of config.batch_size prompts
        drawn without replacement from `prompts`, reshuffled every epoch with the run seed.
        `evaluate(trainer, step)`, if given, runs every config.eval_every steps and at the
        end; its (small) dict is merged into that step's metrics."""
        from tqdm.auto import tqdm

        steps = steps or self.config.steps
        if not prompts:
            raise ValueError("train() needs a non-empty list of prompts")
        bs = self.config.batch_size
        gen = torch.Generator().manual_seed(self.config.seed)
        order: list[int] = []
        history = []
        metrics_file = open(metrics_path, "a") if metrics_path else None
        bar = tqdm(range(steps), desc="PPO", disable=not progress, dynamic_ncols=True)
        try:
            for _ in bar:
                while len(order) < bs:
                    order += torch.randperm(len(prompts), generator=gen).tolist()
                batch, order = [prompts[i] for i in order[:bs]], order[bs:]
                out = self.ppo_step(batch)
                every = self.config.eval_every
                if evaluate and ((every and out["step"] % every == 0) or len(history) + 1 == steps):
                    out.update(evaluate(self, out["step"]))
                history.append(out)
                self.metrics.record_step(out)
                small = {k: v for k, v in out.items() if not isinstance(v, list)}
                if metrics_file:
                    metrics_file.write(json.dumps(small) + "\n")
                    metrics_file.flush()
                bar.set_postfix(reward=f"{out['reward_mean']:.3f}", kl=f"{out.get('kl', math.nan):.3f}",
                                step_s=f"{out['time/step_s']:.1f}")
        finally:
            if metrics_file:
                metrics_file.close()
        return history

    def shutdown(self) -> None:
        for actor in self.roles.all():
            ray.kill(actor)


def _nanmean(x: torch.Tensor) -> float:
    finite = x[torch.isfinite(x)]
    return float(finite.mean()) if len(finite) else math.nan
