#!/usr/bin/env bash
# Issue 16's sixth GPU check, in one call (stages bounded by `timeout`), for the levers the
# fifth left: lora_kernel merged, learner_compile, the speed options on, B=512, 4 epochs (the
# preset's shape):
#   1. learner_compile_scope decoder at micro-batch 64, separate value model, with the time
#      its compile needs (the fifth check's 300 s ended inside the first update);
#   2. the shared trunk at micro-batch 128 under gradient checkpointing (layer scope): one
#      more forward of work, half the host's calls per token.
# JSON and the log under $OUT (default benchmarks/results/gpu). MODEL=test B_BIG=8 MB_D=2
# MB_GC=8 T1=150 T2=100 for a dry run on the CPU (micro-batches: learner_profile.VARIANTS).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 512
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
B_BIG=${B_BIG:-512}
profile() {  # $1 timeout s, $2 variant, $3 value model, $4 JSON name
    timeout "$1" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_BIG" --ppo_epochs 4 \
        --value_model "$3" --variants "$2" --profile none --split none \
        --time_budget_s $(( $1 - 40 )) --out "$OUT/$4.json" 2>&1 | quiet
}
{
profile "${T1:-400}" "merged_dcompile_mb${MB_D:-64}" separate b512_decoder_mb${MB_D:-64}
echo "[gpu_next] stage 1 done ($(( $(date +%s) - start )) s so far)"
profile "${T2:-150}" "merged_compile_gc_mb${MB_GC:-128}" shared b512_shared_gc_mb${MB_GC:-128}
echo "[gpu_next] done ($(( $(date +%s) - start )) s)"
} 2>&1 | tee "$OUT/log.txt"
