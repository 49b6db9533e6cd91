#!/usr/bin/env bash
# Issue 16's third GPU check, in one call (stages bounded by `timeout`), the speed options and
# learner_compile on, micro-batch 32 (the fastest before):
#   1. benchmarks.learner_profile, B=64, 1 PPO epoch, separate value model: lora_kernel fused
#      vs merged on the same machine, each also under torch.profiler (top kernels to $OUT);
#   2. the same at B=512, 4 PPO epochs (the preset's shape) with lora_kernel merged;
#   3. benchmarks.gpu_step with value_model shared + merged: B=64 (warm-up, the compile) then
#      B=512, HF generate (the stand-in for vLLM) with a static KV cache, no one-off phases;
#   4. stage 2 with value_model shared, if time is left.
# JSON, profiles and the log under $OUT (default benchmarks/results/gpu). MODEL=test B_PROFILE=8
# B_BIG=8 B_STEP=4,8 for a dry run on the CPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 64,512
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
B_BIG=${B_BIG:-512}
MB=${MB:-32}
{
timeout "${T1:-170}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_PROFILE" --ppo_epochs 1 \
    --variants "all_compile_mb$MB,merged_compile_mb$MB" --profile "all_compile_mb$MB,merged_compile_mb$MB" \
    --split none --trace_dir "$OUT" --time_budget_s 150 --out "$OUT/b64.json" 2>&1 | quiet
echo "[gpu_merged] stage 1 done ($(( $(date +%s) - start )) s so far)"
timeout "${T2:-120}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_BIG" --ppo_epochs 4 \
    --variants "merged_compile_mb$MB" --profile none --split none --time_budget_s 100 \
    --out "$OUT/b512_separate.json" 2>&1 | quiet
echo "[gpu_merged] stage 2 done ($(( $(date +%s) - start )) s so far)"
timeout "${T3:-150}" $PY -m benchmarks.gpu_step --model "$MODEL" --batch_sizes "$B_STEP" --steps 1 --warmup 0 \
    --extras false --generate_cache static --micro_batch_size "$MB" "${FAST[@]}" --lora_kernel merged \
    --learner_compile true --value_model shared --value_model_name null --time_budget_s 130 \
    --out "$OUT/step_shared.json" 2>&1 | quiet | grep "^\[gpu_step\]\|Error"
echo "[gpu_merged] stage 3 done ($(( $(date +%s) - start )) s so far)"
if (( $(date +%s) - start < ${T4_BEFORE:-390} )); then
    timeout "${T4:-80}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_BIG" --ppo_epochs 4 \
        --value_model shared --variants "merged_compile_mb$MB" --profile none --split none --time_budget_s 60 \
        --out "$OUT/b512_shared.json" 2>&1 | quiet
fi
echo "[gpu_merged] done ($(( $(date +%s) - start )) s)"
} 2>&1 | tee "$OUT/log.txt"
