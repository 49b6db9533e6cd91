#!/usr/bin/env bash
# Issue 16's fifth GPU check, in one call (stages bounded by `timeout`): the host's per-layer
# cost (gpu_host.sh: ~1.1-1.3 ms of guards and wrapper per compiled layer call, the GPU idle
# ~40% at B=64) against learner_compile_scope: decoder (one graph per model's forward and
# backward), and a bigger micro-batch now that a separate value model's backward no longer
# overlaps the policy's activations. lora_kernel merged, the speed options on, B=512, 4 epochs
# (the preset's shape), separate value model:
#   1. learner_compile_scope layer (before): micro-batch 32, then 64;
#   2. learner_compile_scope decoder (own process: a learner's scope is fixed once compiled):
#      micro-batch 32, then 64;
#   3. stage 2 with value_model shared, if time is left.
# JSON and the log under $OUT (default benchmarks/results/gpu). MODEL=test B_BIG=8 MBS="2 8" for a
# dry run on the CPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 512
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
B_BIG=${B_BIG:-512}
read -r MB1 MB2 <<< "${MBS:-32 64}"
profile() {  # $1 timeout s, $2 variant prefix, $3 value model, $4 JSON name
    timeout "$1" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_BIG" --ppo_epochs 4 \
        --value_model "$3" --variants "${2}_mb$MB1,${2}_mb$MB2" --profile none --split none \
        --time_budget_s $(( $1 - 40 )) --out "$OUT/$4.json" 2>&1 | quiet
}
{
profile "${T1:-150}" merged_compile separate b512_layer
echo "[gpu_decoder] stage 1 done ($(( $(date +%s) - start )) s so far)"
profile "${T2:-300}" merged_dcompile separate b512_decoder
echo "[gpu_decoder] stage 2 done ($(( $(date +%s) - start )) s so far)"
if (( $(date +%s) - start < ${T3_BEFORE:-390} )); then
    profile "${T3:-140}" merged_dcompile shared b512_decoder_shared
fi
echo "[gpu_decoder] done ($(( $(date +%s) - start )) s)"
} 2>&1 | tee "$OUT/log.txt"
