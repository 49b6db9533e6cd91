#!/usr/bin/env bash
# Issue 16's next GPU check, in one call (stages bounded by `timeout`): the B=512 step with
# learner_compile's compiled lm_head + logprob math (gpu_head.sh measured the update alone:
# 13.37 -> 12.21 s), lora_kernel merged, the speed options on, micro-batch 64:
#   1. benchmarks.gpu_step, value_model shared: B=64 (warm-up, the compile) then B=512, HF
#      generate (the stand-in for vLLM) with a static KV cache, no one-off phases; the 20 s target;
#   2. the same with the preset's separate value model;
#   3. where the kernel time goes now (the compiled head): the fifth session's profile again
#      (B=128, 1 epoch, micro-batch 64, torch.profiler), with learner_profile's kernel
#      categories (GEMMs, the LoRA factors' small GEMMs, attention, Inductor, eager ATen,
#      copies) in the JSON and the log, the top kernels in $OUT/profile_*.txt; if time is left.
# JSON and the log under $OUT (default benchmarks/results/gpu). MODEL=test B_STEP=4,8 MB=8
# B_PROFILE_NEXT=8 for a dry run on the CPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 64,512
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
MB=${MB:-64}
step() {  # $1 timeout s, $2 JSON name, then the value model's flags
    local t=$1 name=$2; shift 2
    timeout "$t" $PY -m benchmarks.gpu_step --model "$MODEL" --batch_sizes "$B_STEP" --steps 1 --warmup 0 \
        --extras false --generate_cache static --micro_batch_size "$MB" "${FAST[@]}" --lora_kernel merged \
        --learner_compile true "$@" --time_budget_s $(( t - 20 )) --out "$OUT/$name.json" 2>&1 | quiet \
        | grep "^\[gpu_step\]\|Error"
}
{
step "${T1:-200}" step_shared --value_model shared --value_model_name null
echo "[gpu_next] stage 1 done ($(( $(date +%s) - start )) s so far)"
step "${T2:-200}" step_separate
echo "[gpu_next] stage 2 done ($(( $(date +%s) - start )) s so far)"
if (( $(date +%s) - start < ${T3_BEFORE:-400} )); then
    timeout "${T3:-150}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "${B_PROFILE_NEXT:-128}" \
        --ppo_epochs 1 --variants "merged_compile_mb$MB" --profile "merged_compile_mb$MB" --split none \
        --trace_dir "$OUT" --time_budget_s 120 --out "$OUT/profile_mb$MB.json" 2>&1 | quiet
fi
echo "[gpu_next] done ($(( $(date +%s) - start )) s)"
} 2>&1 | tee "$OUT/log.txt"
