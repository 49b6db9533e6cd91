#!/usr/bin/env bash
# Issue 16's fourth GPU check, in one call (stages bounded by `timeout`): the host's share of
# the learner's update (the profile of gpu_merged.sh: GPU kernels 0.61 s of a 1.06 s update at
# B=64), lora_kernel merged, learner_compile, micro-batch 32, the speed options on:
#   1. benchmarks.learner_profile, B=64, 1 epoch: the update timed again under
#      set_stance(skip_guard_eval_unsafe=True), and one update under CUDA's sync debug mode
#      (the stacks that make the host wait, to $OUT/syncs_*.txt);
#   2. the same with cuDNN's SDPA off (PyTorch's flash kernel);
#   3. benchmarks.gpu_step with the preset's separate value model: B=64 (warm-up) then B=512.
# MODEL=test B_PROFILE=8 B_STEP=4,8 MB=2 for a dry run on the CPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 64,512
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
MB=${MB:-32}
V="merged_compile_mb$MB"
{
timeout "${T1:-110}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_PROFILE" --ppo_epochs 1 \
    --variants "$V" --skip_guards "$V" --sync_report "$V" --profile none --split none --trace_dir "$OUT" \
    --time_budget_s 100 --out "$OUT/host.json" 2>&1 | quiet
echo "[gpu_host] stage 1 done ($(( $(date +%s) - start )) s so far)"
timeout "${T2:-100}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_PROFILE" --ppo_epochs 1 \
    --variants "$V" --skip_guards "$V" --no_cudnn_sdpa --profile none --split none --time_budget_s 90 \
    --out "$OUT/flash.json" 2>&1 | quiet
echo "[gpu_host] stage 2 done ($(( $(date +%s) - start )) s so far)"
timeout "${T3:-150}" $PY -m benchmarks.gpu_step --model "$MODEL" --batch_sizes "$B_STEP" --steps 1 --warmup 0 \
    --extras false --generate_cache static --micro_batch_size "$MB" "${FAST[@]}" --lora_kernel merged \
    --learner_compile true --time_budget_s 110 --out "$OUT/step_separate.json" 2>&1 | quiet \
    | grep "^\[gpu_step\]\|Error"
echo "[gpu_host] done ($(( $(date +%s) - start )) s)"
} 2>&1 | tee "$OUT/log.txt"
