"""The Qwen3-0.6B-Base preset's PPO step on one GPU, phase by phase, in one process.

    python -m benchmarks.gpu_step [--batch_sizes 64,512] [--max_new_tokens 53] [--steps 3] [--warmup 1]
        [--prompt_len 300:512] [--model qwen3-0.6b|test] [--time_budget_s 420] [--out FILE.json]
        [--<PPOConfig field> VALUE ...]     e.g. --learner_layout masked (the plain learner path)

Why a separate script: the lent GPU machines have torch, transformers and peft but no Ray
and no vLLM, and reach no model hub. So this measures, on the GPU, every phase of our step
that does not need vLLM, with the code our actors run:

    generate         HF ``generate`` with the PEFT-LoRA policy (the in-run baseline's
                     generator, ``benchmarks.step.Baseline.generate``; vLLM is absent there).
                     Also ``generate_merged``: the same with the LoRA merged into the base
                     weights (what ``lora_sync: merged`` does inside vLLM), one step.
    reference        the baseline's reference pass (policy with the adapter disabled), and
                     ``reference_actor``: ``actors.reference.ReferenceScorer`` on its own model
                     (what our reference actor runs), one step
    reward           ``actors.reward.RewardScorer`` with a sequence-classification reward model
    learner_forward  ``learner.learner.Learner.update``'s no-grad pass (old logprobs, values)
    update           the rest of ``Learner.update``: KL, GAE, ppo_epochs x minibatches x micro-batches
    lora_export      ``Learner.lora_weights()`` (GPU -> CPU copies of the adapter, what the
                     learner actor puts in the object store every step), and its size
    lora_merge       PEFT ``merge_adapter()`` + ``unmerge_adapter()`` on the GPU (the merge
                     arithmetic W0 + (alpha/r) B A that merged sync does in the engine)

Each phase boundary synchronises the GPU; ``mem/<phase>_peak_gib`` is
``torch.cuda.max_memory_allocated`` during the phase (reset before it).

The model: randomly initialised weights with Qwen3-0.6B-Base's architecture (the config
below: 28 layers, hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, vocabulary 151936,
tied embeddings), in the preset's dtype (bfloat16). Speed does not depend on the weights,
except that random weights almost never sample EOS, so every response runs to
max_new_tokens (the longest, slowest case). The reward model and the value model's backbone
are a Qwen3ForSequenceClassification of the same size (the preset's value model starts from
the reward model). The tokenizer is a word-level one with Qwen3's special-token ids (EOS
151643, pad ``<|fim_pad|>`` 151662): texts are never tokenised here; prompts are random
token ids with lengths drawn uniformly from ``--prompt_len`` (the TL;DR queries are cut to
fit 512 tokens).

Config: ``configs/qwen3-0.6b-tldr.yaml`` with model paths replaced and batch_size per run
(ppo_epochs 4, one minibatch, the preset's micro-batch unless ``--micro_batch_size``, LoRA
r=16 on all 7 projections, temperature 0.7).

Learner efficiency, per step: ``padded_token_ratio`` (token positions the learner's forwards
computed / real tokens, over its no-grad pass and PPO epochs; Learner.update's stat) and
``mfu_update`` / ``mfu_learner``: model FLOPs of the real tokens (``learner_flops``, learner/flops.py: the count the
learner reports every step; forward
2 N per token and model with N the decoder's 440M matmul parameters, backward 2 N (frozen
base: input gradients only), plus LoRA, causal attention and the policy's lm_head on response
tokens; padding and recomputation not counted) over the update's (the PPO epochs') or the
whole learner's seconds, over the card's dense bf16 peak (``peak_flops``, learner.flops.PEAK_FLOPS:
989.4 TFLOP/s for the H100 SXM and the H200). ``floor_fraction_update``: the update's FLOPs at the
device's own measured matmul rate (``gemm``, measured at the start: an 8192^3 bf16 GEMM on a
GPU, 2048^3 fp32 on the CPU) over its seconds. Other ``--field value`` options go to the config (the
learner speed options of ppo_ray.config; the preset turns them on).

JSON on stdout and in ``--out`` (rewritten after every measurement, so a run stopped by a
time limit keeps what it measured). ``--model test`` is a 2-layer miniature for CPU tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.clock import DeviceClock
# The product's counts and GPU peaks (learner.flops: one copy; the learner's learner_mfu divides
# by the same table). A large bf16 matmul measures ~790-800 TFLOP/s on an H100/H200, so 100% MFU
# is out of reach by construction; 40% is ~50% of what cuBLAS attains. benchmarks.learner_profile
# imports learner_flops and peak_flops from here.
from learner.flops import gemm_rate, learner_flops, peak_flops  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "configs" / "qwen3-0.6b-tldr.yaml"

# Qwen/Qwen3-0.6B-Base's architecture (its config.json's shape fields).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                  attention_bias=False, bos_token_id=151643, eos_token_id=151643)
# A miniature with the same special-token ids, for tests on the CPU.
TEST_MODEL = dict(QWEN3_0_6B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
# The miniature at Qwen3-0.6B's depth (28 layers): compile-time probes on the CPU (a whole-decoder
# compile's cost follows the layer count, not the width).
TEST_DEEP_MODEL = dict(TEST_MODEL, num_hidden_layers=28)
MODELS = {"qwen3-0.6b": QWEN3_0_6B, "test": TEST_MODEL, "test-deep": TEST_DEEP_MODEL}
EOS_ID, PAD_ID = 151643, 151662  # <|endoftext|>, <|fim_pad|>


def write_models(root: Path, shape: dict, dtype: str, device: str) -> tuple[Path, Path]:
    """Random-weight policy base (CausalLM) and reward model (SequenceClassification, 1
    label) with `shape`, saved as safetensors with a word-level tokenizer -> (lm_dir, rm_dir)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast, \
        Qwen3Config

    from ppo_ray.modeling import DTYPES

    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    vocab["<|endoftext|>"], vocab["<|fim_pad|>"] = EOS_ID, PAD_ID
    del vocab[f"t{EOS_ID}"], vocab[f"t{PAD_ID}"]
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|fim_pad|>")
    out = []
    for name, cls, extra in (("lm", AutoModelForCausalLM, {}),
                             ("rm", AutoModelForSequenceClassification, {"num_labels": 1, "pad_token_id": PAD_ID})):
        cfg = Qwen3Config(**shape, **extra)
        torch.manual_seed(0)
        with torch.device(device):
            model = cls.from_config(cfg, dtype=DTYPES[dtype])
        path = root / name
        model.save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
        del model
        out.append(path)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out[0], out[1]


def prompt_ids(batch_size: int, lengths: tuple[int, int], seed: int,
               vocab: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Random prompt token ids (no special tokens), lengths uniform in [lo, hi]: ids below the
    Qwen3 models' EOS, or drawn from `vocab` (another model's ordinary token ids)."""
    rng = random.Random(seed)
    draw = (lambda: rng.randrange(0, EOS_ID)) if vocab is None else (lambda: rng.choice(vocab))
    return [[draw() for _ in range(rng.randint(*lengths))] for _ in range(batch_size)]


def machine(device: str) -> dict:
    import torch

    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__}
    for mod in ("transformers", "peft"):
        info[mod] = __import__(mod).__version__
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    return info


def measure_batch(baseline, reference, batch_size: int, args, timer: DeviceClock, deadline: float) -> dict:
    """warmup + steps full steps at `batch_size`, then the one-off phases; stops starting
    new steps after `deadline` (perf_counter)."""
    per_step: list[dict] = []
    extras: dict[str, Any] = {}
    n = args.warmup + args.steps
    last = None
    for i in range(n):
        if time.perf_counter() > deadline:
            extras["stopped_early"] = f"time budget reached after {i} of {n} steps"
            break
        ids = prompt_ids(batch_size, args.prompt_len, seed=i)
        texts = [" ".join(f"t{x}" for x in row[:4]) for row in ids]  # only carried along, never tokenised
        row: dict[str, float] = {}
        batch, row["generate"], row["mem/generate_peak_gib"] = timer(baseline.generate, texts, i, ids)
        ref, row["reference"], row["mem/reference_peak_gib"] = timer(baseline.reference_logprobs, batch)
        (scores, _), row["reward"], row["mem/reward_peak_gib"] = timer(baseline.reward.score, batch)
        (stats, _), upd, row["mem/update_peak_gib"] = timer(baseline.learner.update, batch, ref, scores)
        row["learner_forward"] = stats.learner_forward_s
        row["update"] = upd - row["learner_forward"]
        row["padded_token_ratio"] = stats.padded_token_ratio
        cfg = baseline.learner.config
        flops = learner_flops(args.shape, batch.prompt_mask.sum(1).tolist(), batch.response_mask.sum(1).tolist(),
                              cfg.ppo_epochs, cfg.lora_r, cfg.lora_target_modules,
                              models=1 if cfg.value_model == "shared" else 2,
                              value_pass=not baseline.learner.values_in_update(len(batch)))
        row.update(update_flop=flops["update"], learner_forward_flop=flops["learner_forward"])
        # the fraction of the FLOP floor: the update's FLOPs at the device's measured matmul rate
        row["floor_fraction_update"] = flops["update"] / row["update"] / args.gemm["flops_per_s"]
        if args.peak:
            row["mfu_update"] = flops["update"] / row["update"] / args.peak
            row["mfu_learner"] = (flops["update"] + flops["learner_forward"]) / upd / args.peak
        weights, row["lora_export"], _ = timer(baseline.learner.lora_weights)
        row["step"] = sum(row[k] for k in ("generate", "reference", "reward", "learner_forward", "update",
                                           "lora_export"))
        tokens = float(batch.response_mask.sum())
        row.update(response_tokens=tokens, prompt_tokens=float(batch.prompt_mask.sum()),
                   tokens_per_s=tokens / row["step"], generate_tokens_per_s=tokens / row["generate"],
                   samples_per_s=batch_size / row["step"], eos_fraction=float(batch.has_eos.float().mean()),
                   lora_mib=weights.nbytes / 2**20)
        print(f"[gpu_step] B={batch_size} step {i + 1}/{n}{' (warm-up)' if i < args.warmup else ''}: "
              + " ".join(f"{k}={row[k]:.3f}" for k in ("generate", "reference", "reward", "learner_forward",
                                                         "update", "lora_export", "step", "padded_token_ratio",
                                                         "floor_fraction_update", "mfu_update", "mfu_learner")
                         if k in row),
              file=sys.stderr, flush=True)
        if i >= args.warmup:
            per_step.append(row)
        last = (texts, ids, batch)
    if last and args.extras and time.perf_counter() < deadline:
        texts, ids, batch = last
        policy = baseline.learner.policy
        _, extras["reference_actor_s"], extras["mem/reference_actor_peak_gib"] = timer(reference.logprobs, batch)
        _, extras["lora_merge_s"], _ = timer(lambda: (policy.merge_adapter(), policy.unmerge_adapter()))
        policy.merge_adapter()
        try:
            _, extras["generate_merged_s"], _ = timer(baseline.generate, texts, 0, ids)
        finally:
            policy.unmerge_adapter()
    return {"batch_size": batch_size, "per_step": per_step, **extras,
            "summary": summarise(per_step) if per_step else {}}


def summarise(rows: list[dict]) -> dict:
    import statistics

    keys = [k for k in rows[0] if all(r[k] is not None for r in rows)]  # no GPU: no memory peaks
    return {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in keys}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_step", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    p.add_argument("--batch_sizes", default="64", help="comma-separated prompts per step, measured in this order")
    p.add_argument("--max_new_tokens", type=int, default=53)
    p.add_argument("--micro_batch_size", type=int, default=None, help="default: the preset's")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompt_len", default="300:512", help="LO:HI prompt lengths in tokens (uniform)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--time_budget_s", type=float, default=420.0,
                   help="start no new step after this many seconds (the JSON keeps what was measured)")
    p.add_argument("--generate_cache", default="dynamic", choices=("dynamic", "static"),
                   help="HF generate's KV cache: dynamic (its default: grown by concatenation every token) or "
                        "static (allocated once for prompt + max_new_tokens)")
    p.add_argument("--extras", default="true", choices=("true", "false"),
                   help="after the steps, the one-off phases (reference actor, LoRA merge, generate_merged)")
    p.add_argument("--out", default=None)
    args, args.config_overrides = p.parse_known_args(argv)  # the rest: --field value for PPOConfig
    lo, _, hi = args.prompt_len.partition(":")
    args.prompt_len = (int(lo), int(hi or lo))
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.extras = args.extras == "true"
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    from actors.reference import ReferenceScorer
    from benchmarks.step import Baseline
    from ppo_ray.config import parse_overrides
    from ppo_ray.modeling import pick_device

    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.time_budget_s
    device = str(pick_device(args.device))
    result: dict[str, Any] = {
        "command": "python -m benchmarks.gpu_step " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "device": device,
        "machine": machine(device), "model": args.model, "model_shape": MODELS[args.model],
        "prompt_len": list(args.prompt_len), "runs": []}
    args.shape = MODELS[args.model]
    args.peak = peak_flops(result["machine"].get("gpu", ""))
    result.update(peak_bf16_flops=args.peak, mfu="model FLOPs of the real tokens (learner_flops) / seconds / peak_bf16_flops")
    # the device's measured matmul rate (benchmarks.flops.gemm_rate: an 8192^3 bf16 GEMM on a GPU,
    # 2048^3 fp32 on the CPU): the floor that floor_fraction_update is measured against
    gpu = device.startswith("cuda")
    args.gemm = result["gemm"] = gemm_rate(8192 if gpu else 2048, "bfloat16" if gpu else "float32", device)

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="ppo_ray_gpu_step_") as tmp:
        t0 = time.perf_counter()
        lm_dir, rm_dir = write_models(Path(tmp), MODELS[args.model], "bfloat16", device)
        config, _ = parse_overrides(["--config", str(PRESET), "--model_name", str(lm_dir),
                                     "--reward_model_name", str(rm_dir), "--value_model_name", str(rm_dir),
                                     "--max_new_tokens", str(args.max_new_tokens),
                                     "--batch_size", str(args.batch_sizes[0]),
                                     *(["--micro_batch_size", str(args.micro_batch_size)]
                                       if args.micro_batch_size else []), *args.config_overrides])
        baseline = Baseline(config, device=device)
        baseline.generate_cache = None if args.generate_cache == "dynamic" else args.generate_cache
        reference = ReferenceScorer.from_config(config, str(lm_dir), device=device)
        n_params = sum(p.numel() for p in reference.model.parameters())
        result.update(setup_s=time.perf_counter() - t0, parameters=n_params,
                      config={k: getattr(config, k) for k in ("dtype", "ppo_epochs", "mini_batch_size",
                                                              "micro_batch_size", "lora_r", "lora_alpha",
                                                              "lora_target_modules", "temperature", "top_k",
                                                              "top_p", "max_new_tokens", "learner_layout",
                                                              "learner_sort_by_length", "logprob_chunk_size",
                                                              "lora_kernel", "rms_norm_kernel",
                                                              "gradient_checkpointing", "learner_compile",
                                                              "learner_compile_scope", "value_model")}, generate_cache=args.generate_cache)
        save()
        timer = DeviceClock(device)
        for b in args.batch_sizes:
            if time.perf_counter() > deadline:
                result["runs"].append({"batch_size": b, "skipped": "time budget reached"})
                break
            baseline.config = baseline.learner.config = config.replace(batch_size=b)
            result["runs"].append(measure_batch(baseline, reference, b, args, timer, deadline))
            save()
    result["total_s"] = time.perf_counter() - t_start
    save()
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
