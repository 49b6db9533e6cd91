#!/usr/bin/env bash
# The learner-speed check of issue 16 on a lent GPU, in one call (stages bounded by `timeout`):
#   1. benchmarks.learner_profile: the learner alone at B=64, 1 PPO epoch: the plain path
#      ("base") vs the speed options ("all", learner_profile.FAST) at micro-batch 8/16/32/64;
#   2. benchmarks.gpu_step with the speed options at the fastest micro-batch whose learner
#      peak stays <= 40 GiB: B=64 twice (the first is the warm-up) and B=512 once;
#   3. learner_profile with learner_compile at that micro-batch (the compile's cost is the warm-up).
# JSON and logs under $OUT (default benchmarks/results/gpu). MODEL=test and small B* for a dry run on the CPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 64,64,512

timeout "${T1:-90}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_PROFILE" --ppo_epochs 1 \
    --variants base,all,all_mb16,all_mb32,all_mb64,all_gc_mb64 --profile none --split none \
    --time_budget_s "${T1_BUDGET:-75}" --out "$OUT/learner.json" 2>&1 | grep -v "Loading weights\|Writing model"
MB=$($PY - "$OUT/learner.json" <<'PYEOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["variants"]
except Exception:
    rows = {}
ok = [(r["update_s"] + r["learner_forward_s"], r["options"].get("micro_batch_size", 8)) for n, r in rows.items()
      if n.startswith("all") and "update_s" in r and "gc" not in n and (r.get("peak_gib") or 0) <= 40]
print(min(ok)[1] if ok else 16)
PYEOF
)
echo "[gpu_speed] micro-batch for the step: $MB ($(( $(date +%s) - start )) s so far)"

timeout "${T2:-150}" $PY -m benchmarks.gpu_step --model "$MODEL" --batch_sizes "$B_STEP" --steps 1 --warmup 0 \
    --micro_batch_size "$MB" "${FAST[@]}" --time_budget_s "${T2_BUDGET:-70}" --out "$OUT/step_fast.json" 2>&1 \
    | grep -v "Loading weights\|Writing model" | grep "^\[gpu_step\]\|Error"
echo "[gpu_speed] step done ($(( $(date +%s) - start )) s so far)"

timeout "${T3:-100}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_PROFILE" --ppo_epochs 1 \
    --variants "all_compile_mb$MB" --profile none --split none --time_budget_s 60 \
    --out "$OUT/compile.json" 2>&1 | grep -v "Loading weights\|Writing model"
echo "[gpu_speed] done ($(( $(date +%s) - start )) s)"
