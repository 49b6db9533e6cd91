"""The learner's update alone, on the Qwen3-0.6B preset's shape, under named option sets.

    python -m benchmarks.learner_profile [--model qwen3-0.6b|test] [--batch_size 64] [--ppo_epochs 1]
        [--variants base,fused,...] [--profile base,all] [--prompt_len 300:512] [--response_len 53:53]
        [--time_budget_s 240] [--out FILE.json] [--trace_dir DIR]

Where the learner's time goes, without generation: one Learner (random weights in the
model's shape, the preset's config: bf16, LoRA r=16 on 7 projections, micro-batch 8,
temperature 0.7, no top-k/top-p) and one synthetic RolloutBatch (random prompt tokens with
lengths uniform in --prompt_len, left-padded; responses of --response_len tokens, an EOS
ending the shorter ones). Each variant is a set of config changes (the learner speed
options of ppo_ray.config, micro_batch_size) to the plain path (PLAIN: every speed option
off, whatever the preset says) applied to the same learner
(``Learner.reconfigure``); it runs one warm-up update, then one timed update (no-grad
pass + ppo_epochs over the batch), and reports the phases, the MFU (benchmarks.gpu_step's
learner_flops over the card's bf16 peak), the padded-vs-real token ratio and peak memory.
``split`` times one micro-batch's policy and value forward+backward separately. Variants in
--profile also run under torch.profiler: the top CUDA kernels and the top CPU ops go to
--trace_dir as text, and the kernel time by category (kernel_breakdown: GEMMs, the LoRA
factors' small GEMMs, attention, Inductor, eager ATen, copies) to the JSON and the log.
JSON (rewritten after every variant) in --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.clock import DeviceClock
from benchmarks.gpu_step import MODELS, PAD_ID, EOS_ID, PRESET, learner_flops, machine, peak_flops, write_models

# The plain path (every learner speed option off; the preset turns them on) and the
# options that keep the math (ppo_ray.config), the "all" variants. Variants are changes to PLAIN.
PLAIN = dict(learner_layout="masked", learner_sort_by_length=False, lora_kernel="peft", rms_norm_kernel="hf",
             logprob_chunk_size=0, gradient_checkpointing=False, learner_compile=False)
FAST = dict(learner_layout="causal", learner_sort_by_length=True, lora_kernel="fused", rms_norm_kernel="fused",
            logprob_chunk_size=1024)
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "fused": dict(lora_kernel="fused"),
    "rmsnorm": dict(rms_norm_kernel="fused"),
    "causal": dict(learner_layout="causal"),
    "sort": dict(learner_sort_by_length=True),
    "causal_sort": dict(learner_layout="causal", learner_sort_by_length=True),
    "chunk": dict(logprob_chunk_size=1024),
    "all": FAST,
}
EAGER_HEAD: set[str] = set()  # variants whose learner keeps learner.speed.head_token_stats eager
for _mb in (2, 8, 16, 32, 64, 128):
    VARIANTS[f"base_mb{_mb}"] = dict(micro_batch_size=_mb)
    VARIANTS[f"all_mb{_mb}"] = dict(FAST, micro_batch_size=_mb)
    VARIANTS[f"all_gc_mb{_mb}"] = dict(FAST, micro_batch_size=_mb, gradient_checkpointing=True)
    VARIANTS[f"all_compile_mb{_mb}"] = dict(FAST, micro_batch_size=_mb, learner_compile=True)
    # lora_kernel: merged instead of fused (one GEMM with W + s B A per projection)
    VARIANTS[f"merged_mb{_mb}"] = dict(FAST, lora_kernel="merged", micro_batch_size=_mb)
    VARIANTS[f"merged_compile_mb{_mb}"] = dict(FAST, lora_kernel="merged", micro_batch_size=_mb, learner_compile=True)
    # ... with the lm_head + logprob math left eager (as before learner_compile compiled it): A/B
    VARIANTS[f"merged_compile_eagerhead_mb{_mb}"] = dict(VARIANTS[f"merged_compile_mb{_mb}"])
    EAGER_HEAD.add(f"merged_compile_eagerhead_mb{_mb}")
    # ... with gradient checkpointing: one more forward of work, for micro-batches that fit only then
    VARIANTS[f"merged_compile_gc_mb{_mb}"] = dict(FAST, lora_kernel="merged", micro_batch_size=_mb, learner_compile=True,
                                                  gradient_checkpointing=True)
    # the whole decoder compiled as one graph (a learner's compile scope is fixed once compiled:
    # run these in their own process, not after a layer-compiled variant)
    VARIANTS[f"merged_dcompile_mb{_mb}"] = dict(FAST, lora_kernel="merged", micro_batch_size=_mb, learner_compile=True,
                                                learner_compile_scope="decoder")


def synthetic_batch(batch_size: int, prompt_len: tuple[int, int], response_len: tuple[int, int], vocab: int,
                    seed: int = 0):
    """Random left-padded prompts and right-padded responses (rows shorter than the longest
    end with EOS), gen_logprobs 0."""
    import torch

    from ppo_ray.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    high = min(EOS_ID, vocab)
    plen = torch.randint(prompt_len[0], prompt_len[1] + 1, (batch_size,), generator=g)
    rlen = torch.randint(response_len[0], response_len[1] + 1, (batch_size,), generator=g)
    p, t = int(plen.max()), int(rlen.max())
    prompt_mask = torch.arange(p) >= (p - plen)[:, None]  # (B, P)
    prompt_ids = torch.where(prompt_mask, torch.randint(0, high, (batch_size, p), generator=g), PAD_ID)
    response_mask = torch.arange(t) < rlen[:, None]  # (B, T)
    response_ids = torch.where(response_mask, torch.randint(0, high, (batch_size, t), generator=g), PAD_ID)
    short = (rlen < t).nonzero().flatten()
    response_ids[short, rlen[short] - 1] = EOS_ID
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(batch_size, t), 0,
                        pad_token_id=PAD_ID, eos_token_id=EOS_ID)


def run_update(learner, batch, ref, scores, sync: DeviceClock) -> tuple[dict, Any]:
    """One timed update: its timings and stats, and its Experience (Learner.experience_hook)."""
    kept: list = []
    learner.experience_hook = kept.append
    sync.now()
    sync.reset_peak()
    t0 = time.perf_counter()
    stats, _ = learner.update(replace(batch, adapter_version=learner.version), ref, scores)
    total = sync.now() - t0
    return {"learner_forward_s": stats.learner_forward_s, "update_s": total - stats.learner_forward_s,
            "total_s": total, "peak_gib": sync.peak_gib(), "padded_token_ratio": stats.padded_token_ratio,
            "policy_loss": stats.policy_loss, "first_minibatch_ratio_mean": stats.first_minibatch_ratio_mean}, kept[-1]


def split_timing(learner, exp, sync: DeviceClock, reps: int = 3) -> dict:
    """One micro-batch of `exp` (an update's Experience; the first of a sorted/unsorted minibatch): policy loss fwd+bwd and
    value fwd+bwd, timed apart (median of reps)."""
    import statistics

    import torch

    from learner.buffer import ExperienceBuffer
    from ppo_ray.batch import TrimPlan
    from ppo_ray.logprobs import logprobs_from_logits
    from ppo_ray.modeling import response_logits

    cfg = learner.config
    buffer = ExperienceBuffer(exp, len(exp), cfg.micro_batch_size, TrimPlan.of(exp.rollouts),
                              sort=cfg.learner_sort_by_length)
    rows = buffer.micro_rows(torch.arange(len(exp)))[0]
    mb = buffer.micro_batch(rows)
    learner.policy.train()
    learner.value_model.train()

    def policy() -> None:
        if learner.speed.plain_logits:
            logits = response_logits(learner.policy, mb.rollouts)
            logp = logprobs_from_logits(logits, mb.rollouts.response_ids, cfg.temperature, cfg.top_k, cfg.top_p,
                                        mask=mb.mask)
        else:
            (logp,) = learner.speed.policy_token_stats(mb.rollouts, mb.seq_len, mb.response_tokens, truncated=True)
        logp.sum().backward()

    def value() -> None:
        learner.speed.values(mb.rollouts, mb.seq_len).float().sum().backward()

    out = {}
    for name, fn in (("policy", policy), ("value", value)):
        times = []
        for _ in range(reps + 1):
            t0 = sync.now()
            fn()
            times.append(sync.now() - t0)
        out[f"{name}_fwd_bwd_s"] = statistics.median(times[1:])
    learner.policy.zero_grad(set_to_none=True)
    learner.value_model.zero_grad(set_to_none=True)
    learner.policy.eval()
    learner.value_model.eval()
    out["micro_batch_rows"] = len(rows)
    out["micro_batch_tokens"] = sum(buffer.plan.length(i) for i in rows)
    return out


def sync_report(learner, batch, ref, scores, path: Path) -> dict:
    """One update with CUDA's sync debug mode on: every operation that makes the host wait
    for the GPU (an .item(), a device-to-host copy, ...) warns; the distinct Python stacks
    and their counts go to `path` (a host that waits cannot queue work ahead of the GPU)."""
    import collections
    import traceback
    import warnings

    import torch

    stacks: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            frames = [f for f in traceback.format_stack()[:-1] if "/warnings.py" not in f]
            stacks["".join(frames[-12:])] += 1

    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            learner.update(replace(batch, adapter_version=learner.version), ref, scores)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"{sum(stacks.values())} synchronizing calls in one update, {len(stacks)} distinct stacks"]
    for stack, n in stacks.most_common(25):
        lines += [f"\n===== {n} x", stack]
    path.write_text("\n".join(lines))
    return {"sync_calls": sum(stacks.values()), "sync_stacks": len(stacks)}


# GPU kernel names -> what they are (torch 2.11 / CUDA 13 on an H100: cuBLASLt's nvjet GEMMs,
# cuDNN's fused attention, Inductor's triton_* kernels, ATen's own eager kernels)
_NVJET_TILE = re.compile(r"nvjet_\w*?_tst_(\d+)x(\d+)_")


def kernel_category(name: str) -> str:
    """The category of one CUDA kernel, by its name: gemm (cuBLAS / CUTLASS), gemm_small (a
    GEMM with a tile side <= 64 or split-K: the LoRA factors' memory-bound (N, r) products,
    by a heuristic on cuBLASLt's tile names that held in the fifth session's trace),
    attention (cuDNN / flash SDPA and their helper kernels), inductor (triton_*: the compiled
    graphs' fused elementwise and reductions), aten (eager ATen kernels: casts, the logits'
    float32 passes when the head is not compiled), copy (memcpy / memset), other."""
    low = name.lower()
    if low.startswith("triton_"):
        return "inductor"
    if low.startswith("memcpy") or low.startswith("memset"):
        return "copy"
    if "sdpa" in low or "fmha" in low or "flash" in low or "attention" in low or low.startswith("void cudnn::"):
        return "attention"
    tile = _NVJET_TILE.search(low)
    if tile or "gemm" in low or "cutlass" in low or "xmma" in low or "cublas" in low:
        small = "splitk" in low or (tile is not None and min(int(tile[1]), int(tile[2])) <= 64)
        return "gemm_small" if small else "gemm"
    if "at::native::" in low:
        return "aten"
    return "other"


def kernel_breakdown(kernels: Sequence[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """(kernel name, seconds) pairs -> {category: {"s": seconds, "share": of all kernel time}},
    largest first (kernel_category)."""
    total = sum(s for _, s in kernels) or 1.0
    sums: dict[str, float] = {}
    for name, seconds in kernels:
        cat = kernel_category(name)
        sums[cat] = sums.get(cat, 0.0) + seconds
    return {cat: {"s": round(s, 4), "share": round(s / total, 4)}
            for cat, s in sorted(sums.items(), key=lambda kv: -kv[1])}


def profile_update(learner, batch, ref, scores, path: Path) -> dict:
    """One update under torch.profiler: top CUDA kernels and top CPU ops to `path`; the
    sum of kernel time vs the wall time (how busy the GPU is)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        learner.update(replace(batch, adapter_version=learner.version), ref, scores)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = [(e.key, e.self_device_time_total / 1e6) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    kernel_us = sum(s for _, s in kernels) * 1e6
    shares = kernel_breakdown(kernels)
    text = [f"wall {wall:.3f} s (with profiler overhead), GPU kernel time {kernel_us / 1e6:.3f} s",
            "kernel time by category: " + ", ".join(f"{c} {v['s']:.3f} s ({v['share']:.1%})" for c, v in shares.items()),
            events.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90),
            events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90)]
    path.write_text("\n\n".join(text))
    # kernels only (the ops that launch them, e.g. aten::mm, are in the text's tables)
    top = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)[:25]
    return {"profiled_wall_s": wall, "kernel_s": kernel_us / 1e6, "kernel_shares": shares,
            "top_kernels": [[e.key[:120], round(e.self_device_time_total / 1e6, 4), e.count] for e in top]}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.learner_profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--ppo_epochs", type=int, default=1)
    p.add_argument("--value_model", default="separate", choices=("separate", "shared"),
                   help="shared: the value head on the policy's trunk (one forward per micro-batch)")
    p.add_argument("--variants", default="base,fused,causal,sort,chunk,all,all_mb16,all_mb32,all_mb64,all_gc_mb64")
    p.add_argument("--profile", default="base,all", help="variants to also run under torch.profiler (CUDA only)")
    p.add_argument("--split", default="base,all", help="variants whose policy/value micro-batch is timed apart")
    p.add_argument("--prompt_len", default="300:512")
    p.add_argument("--response_len", default="53:53")
    p.add_argument("--device", default=None)
    p.add_argument("--time_budget_s", type=float, default=240.0)
    p.add_argument("--sync_report", default="", help="variants whose host-GPU syncs are listed (CUDA only; "
                   "to --trace_dir as syncs_<variant>.txt)")
    p.add_argument("--skip_guards", default="", help="variants also timed under torch.compiler.set_stance("
                   "skip_guard_eval_unsafe=True) (the compiled layers' guard checks skipped after the warm-up)")
    p.add_argument("--no_cudnn_sdpa", action="store_true",
                   help="torch.backends.cuda.enable_cudnn_sdp(False): SDPA's flash kernel instead of cuDNN's")
    p.add_argument("--out", default=None)
    p.add_argument("--trace_dir", default=None)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:  # before any model loads: a one-call device budget cannot afford a late KeyError
        p.error(f"unknown --variants {unknown}; known: {', '.join(VARIANTS)}")
    for name in ("prompt_len", "response_len"):
        lo, _, hi = getattr(args, name).partition(":")
        setattr(args, name, (int(lo), int(hi or lo)))
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    import torch

    from learner.learner import Learner
    from learner.speed import head_token_stats
    from ppo_ray.config import parse_overrides
    from ppo_ray.modeling import pick_device

    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.time_budget_s
    device = str(pick_device(args.device))
    sync = DeviceClock(device)
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    shape = MODELS[args.model]
    info = machine(device)
    peak = peak_flops(info.get("gpu", ""))
    result: dict[str, Any] = {"command": "python -m benchmarks.learner_profile " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": info, "peak_bf16_flops": peak,
        "cudnn_sdpa": not args.no_cudnn_sdpa, "variants": {}}

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="ppo_ray_learner_profile_") as tmp:
        lm_dir, rm_dir = write_models(Path(tmp), shape, "bfloat16", device)
        config, _ = parse_overrides(["--config", str(PRESET), "--model_name", str(lm_dir),
                                     "--reward_model_name", str(rm_dir), "--batch_size", str(args.batch_size),
                                     "--ppo_epochs", str(args.ppo_epochs), "--value_model", args.value_model,
                                     "--value_model_name", str(rm_dir) if args.value_model == "separate" else "null",
                                     # built without compiling: the variants say whether to compile
                                     "--learner_compile", "false"])
        learner = Learner(config, str(lm_dir), str(rm_dir), device=device)
        result["attn_implementation"] = {"policy": learner.policy.config._attn_implementation}
        if args.value_model == "separate":
            result["attn_implementation"]["value"] = learner.value_model.backbone.config._attn_implementation
        batch = synthetic_batch(args.batch_size, args.prompt_len, args.response_len, shape["vocab_size"])
        ref = torch.zeros(batch.response_ids.shape)
        scores = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
        plens, rlens = batch.prompt_mask.sum(1).tolist(), batch.response_mask.sum(1).tolist()
        flops = learner_flops(shape, plens, rlens, config.ppo_epochs, config.lora_r, config.lora_target_modules,
                              models=1 if args.value_model == "shared" else 2,
                              value_pass=not learner.values_in_update(len(batch)))
        result.update(value_model=args.value_model, setup_s=time.perf_counter() - t_start, flops=flops, batch_size=args.batch_size,
                      ppo_epochs=config.ppo_epochs, mean_prompt=sum(plens) / len(plens),
                      mean_response=sum(rlens) / len(rlens))
        save()
        print(f"[learner_profile] {info.get('gpu', device)} attn={result['attn_implementation']} "
              f"update FLOP {flops['update']:.3e}", file=sys.stderr, flush=True)
        for name in args.variants.split(","):
            if time.perf_counter() > deadline:
                result["variants"][name] = {"skipped": "time budget"}
                continue
            row: dict[str, Any] = {"options": VARIANTS[name]}
            result["variants"][name] = row
            try:
                learner.reconfigure(config.replace(**{**PLAIN, **VARIANTS[name]}))
                if name in EAGER_HEAD:
                    learner.speed.head_stats = head_token_stats
                t0 = time.perf_counter()
                row["warmup"], _ = run_update(learner, batch, ref, scores, sync)
                row["warmup_wall_s"] = time.perf_counter() - t0
                save()  # a later time limit keeps the warm-up (e.g. a compile's cost)
                timed, experience = run_update(learner, batch, ref, scores, sync)
                row.update(timed)
                if peak:
                    row["mfu_update"] = flops["update"] / row["update_s"] / peak
                    row["mfu_learner"] = (flops["update"] + flops["learner_forward"]) / row["total_s"] / peak
                    row["tflops_update"] = flops["update"] / row["update_s"] / 1e12
                if name in args.skip_guards.split(","):
                    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                        skip, _ = run_update(learner, batch, ref, scores, sync)
                    row.update({f"skip_guards_{k}": v for k, v in skip.items() if k.endswith("_s")})
                if name in args.sync_report.split(",") and device.startswith("cuda") and args.trace_dir:
                    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                    row.update(sync_report(learner, batch, ref, scores, Path(args.trace_dir) / f"syncs_{name}.txt"))
                if name in args.split.split(","):
                    row["split"] = split_timing(learner, experience, sync)
                if name in args.profile.split(",") and device.startswith("cuda") and args.trace_dir:
                    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                    row["profile"] = profile_update(learner, batch, ref, scores,
                                                    Path(args.trace_dir) / f"profile_{name}.txt")
            except torch.OutOfMemoryError as e:
                row["error"] = f"OOM: {str(e)[:200]}"
            except Exception as e:  # report and go on to the next variant
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            print(f"[learner_profile] {name}: " + " ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                if k in ("learner_forward_s", "update_s", "peak_gib", "padded_token_ratio", "mfu_update",
                         "mfu_learner", "warmup_wall_s", "skip_guards_update_s", "skip_guards_learner_forward_s",
                         "sync_calls", "error")), file=sys.stderr, flush=True)
            if "profile" in row:
                print(f"[learner_profile] {name} kernel time {row['profile']['kernel_s']:.3f} s: " + ", ".join(
                    f"{c} {v['share']:.1%}" for c, v in row["profile"]["kernel_shares"].items()),
                    file=sys.stderr, flush=True)
            save()
    result["total_s"] = time.perf_counter() - t_start
    save()
    summary = [f"{'variant':<18}{'fwd s':>8}{'upd s':>8}{'MFU upd':>9}{'MFU all':>9}{'pad':>7}{'GiB':>7}"]
    for name, row in result["variants"].items():
        if "update_s" in row:
            summary.append(f"{name:<18}{row['learner_forward_s']:>8.3f}{row['update_s']:>8.3f}"
                           f"{row.get('mfu_update', float('nan')):>9.3f}{row.get('mfu_learner', float('nan')):>9.3f}"
                           f"{row['padded_token_ratio']:>7.3f}{row['peak_gib'] or 0:>7.1f}")
        else:
            summary.append(f"{name:<18}{row.get('error') or row.get('skipped')}"[:200])
    print("\n".join(summary))
    return result


if __name__ == "__main__":
    main()
