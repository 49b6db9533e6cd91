#!/usr/bin/env bash
# Issue 16's sixth GPU check, in one call (stages bounded by `timeout`): micro-batch 128 under
# gradient checkpointing (one more forward of work, half the host's calls per token; the fifth
# check found the host's ~1.1-1.3 ms per compiled layer call the limit), lora_kernel merged,
# learner_compile (layer scope), the speed options on, B=512, 4 epochs (the preset's shape):
#   1. the preset's separate value model;
#   2. the shared trunk.
# Not the decoder compile scope: on the CPU at Qwen3-0.6B's depth (the test-deep model) one
# model's whole-decoder forward + backward took 277 s to compile against 17 s per layer, and
# the learner needs four such graphs, more than one device call (benchmarks/RESULTS.md).
# JSON and the log under $OUT (default benchmarks/results/gpu). MODEL=test B_BIG=8 MB=8 for a
# dry run on the CPU (micro-batches: learner_profile.VARIANTS).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 512
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
B_BIG=${B_BIG:-512}
MB=${MB:-128}
profile() {  # $1 timeout s, $2 value model, $3 JSON name
    timeout "$1" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_BIG" --ppo_epochs 4 \
        --value_model "$2" --variants "merged_compile_gc_mb$MB" --profile none --split none \
        --time_budget_s $(( $1 - 40 )) --out "$OUT/$3.json" 2>&1 | quiet
}
{
profile "${T1:-270}" separate b512_separate_gc_mb$MB
echo "[gpu_next] stage 1 done ($(( $(date +%s) - start )) s so far)"
profile "${T2:-200}" shared b512_shared_gc_mb$MB
echo "[gpu_next] done ($(( $(date +%s) - start )) s)"
} 2>&1 | tee "$OUT/log.txt"
