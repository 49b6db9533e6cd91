"""How far apart the generator (vLLM) and the learner (PEFT) are at the same weights, in a
given dtype: the measurement behind logprob_gap_tolerance's per-dtype default.

    python -m benchmarks.sync_gap [--dtype bfloat16] [--lora_sync adapter|merged] [--versions 3]
                                  [--model qwen3-0.6b|test] [--out FILE.json]

The model: randomly initialised weights with Qwen3-0.6B-Base's exact architecture
(benchmarks.gpu_step.write_models; the gap comes from the arithmetic, not the weights), the
qwen3-0.6b-tldr preset's settings (temperature 0.7, untruncated, max_new_tokens 53). For
each of `--versions` adapter versions (LoRA B matrices drawn N(0, 0.02^2), so the adapter
moves the logits), the adapter is synced into the generator as a training run syncs it, then:

* the sync check's probe (ppo_ray.trainer.sync_probe_prompts: 4 random-token prompts of 16
  tokens, 4 new tokens untruncated; 3 probe seeds): Learner.sync_gap, the statistic the
  check compares with the tolerance;
* rollouts like the preset's (4 prompts of 300-512 random tokens, 53 new tokens): the
  largest |generator - learner| logprob of a sampled token, the rollout check's statistic.

Prints one JSON object: every gap, and their maxima. CPU: ~10 min at full size in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from ppo_ray.config import LORA_SYNC_MODES

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sync_gap", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--lora_sync", default="adapter", choices=tuple(LORA_SYNC_MODES))
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--model", default="qwen3-0.6b", choices=("qwen3-0.6b", "test"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process

    import torch

    from actors.generator import Generator
    from benchmarks.gpu_step import MODELS, prompt_ids, write_models
    from learner.learner import Learner
    from ppo_ray.config import PPOConfig
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.trainer import sync_probe_prompts

    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="sync-gap-"))
    lm_dir, _ = write_models(root, MODELS[args.model], args.dtype, "cpu")
    cfg = PPOConfig.from_yaml(REPO / "configs" / "qwen3-0.6b-tldr.yaml", model_name=str(lm_dir), value_model_name=None,
                              dtype=args.dtype, lora_sync=args.lora_sync, learner_compile=False, batch_size=4,
                              micro_batch_size=4, vllm_kv_cache_gib=1.0)
    generator = Generator.from_config(cfg, lm_dir)
    learner = Learner(cfg, str(lm_dir))
    tok = load_tokenizer(str(lm_dir))
    rollout_prompts = prompt_ids(4, (300, 512), seed=0)
    out: dict = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                 "model": args.model, "dtype": args.dtype, "lora_sync": args.lora_sync, "versions": []}
    for version in range(1, args.versions + 1):
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, param in learner.policy.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=g).to(param.dtype))
        learner.version = version
        generator.load_adapter(version, learner.lora_weights())
        probes = []
        for seed in range(3):
            batch = generator.probe(sync_probe_prompts(tok, seed, cfg.max_prompt_length))
            probes.append(learner.sync_gap(batch))
        rollouts = generator.generate(rollout_prompts, step=version)
        mine = learner.rollout_scores(rollouts, logprobs=True).logprobs.cpu()
        mask = rollouts.response_mask & torch.isfinite(mine)
        rollout_gap = float(torch.where(mask, (rollouts.gen_logprobs - mine).abs(), 0.0).amax())
        row = {"version": version, "probe_gaps": probes, "rollout_gap": rollout_gap,
               "rollout_tokens": int(rollouts.response_mask.sum())}
        out["versions"].append(row)
        print(json.dumps(row), flush=True)
    out["max_probe_gap"] = max(g for v in out["versions"] for g in v["probe_gaps"])
    out["max_rollout_gap"] = max(v["rollout_gap"] for v in out["versions"])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
