#!/usr/bin/env bash
# Issue 16's GPU check of 2026-11-27 (RESULTS.md: "fifth session", 3.), in one call (stages
# bounded by `timeout`). A profile before it found the micro-batch-64 update GPU-bound (kernel
# time ~ wall time, torch.profiler) with ~8% of its kernel time in float32 passes over the
# (c, V) logits; learner_compile now compiles the lm_head + logprob math too
# (learner.learner.head_token_stats). B=512, 4 epochs (the preset's shape), lora_kernel merged,
# learner_compile, the speed options on, micro-batch 64:
#   1. separate value model: the head eager (before) then compiled (after), one process;
#   2. the shared trunk, head compiled;
#   3. separate, head compiled, cuDNN's SDPA off (PyTorch's flash kernel).
# JSON and the log under $OUT (default benchmarks/results/gpu). MODEL=test B_BIG=8 MB=8 for a
# dry run on the CPU (micro-batches: learner_profile.VARIANTS).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 512
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
B_BIG=${B_BIG:-512}
MB=${MB:-64}
profile() {  # $1 timeout s, $2 value model, $3 JSON name, $4 variants, then extra flags
    local t=$1 value=$2 name=$3 variants=$4; shift 4
    timeout "$t" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_BIG" --ppo_epochs 4 \
        --value_model "$value" --variants "$variants" --profile none --split none \
        --time_budget_s $(( t - 30 )) --out "$OUT/$name.json" "$@" 2>&1 | quiet
}
{
profile "${T1:-180}" separate b512_separate_head "merged_compile_eagerhead_mb$MB,merged_compile_mb$MB"
echo "[gpu_head] stage 1 done ($(( $(date +%s) - start )) s so far)"
profile "${T2:-100}" shared b512_shared_head "merged_compile_mb$MB"
echo "[gpu_head] stage 2 done ($(( $(date +%s) - start )) s so far)"
profile "${T3:-120}" separate b512_separate_flash "merged_compile_mb$MB" --no_cudnn_sdpa
echo "[gpu_head] done ($(( $(date +%s) - start )) s)"
} 2>&1 | tee "$OUT/log.txt"
