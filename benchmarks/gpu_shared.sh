#!/usr/bin/env bash
# Issue 16's second GPU check, in one call (stages bounded by `timeout`), the speed options on:
#   1. benchmarks.learner_profile, B=64, 1 PPO epoch, separate value model: micro-batch 32
#      with and without learner_compile (compile was measured only at 16 before);
#   2. the same with value_model: shared (one trunk forward gives logprobs and values),
#      micro-batch 32 and 64, and 32 with compile;
#   3. benchmarks.gpu_step with value_model: shared at the fastest shared variant's settings:
#      B=64 (warm-up) then B=512, no one-off phases (generate_merged ran out of memory before).
# JSON and logs under $OUT (default benchmarks/results/gpu). MODEL=test B_STEP=4,8 for a dry run on the CPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 64,512

timeout "${T1:-140}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_PROFILE" --ppo_epochs 1 \
    --variants all_mb32,all_compile_mb32 --profile none --split none --time_budget_s 120 \
    --out "$OUT/separate.json" 2>&1 | quiet
echo "[gpu_shared] separate done ($(( $(date +%s) - start )) s so far)"
timeout "${T2:-150}" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$B_PROFILE" --ppo_epochs 1 \
    --value_model shared --variants all_mb32,all_mb64,all_compile_mb32 --profile none --split none \
    --time_budget_s 130 --out "$OUT/shared.json" 2>&1 | quiet
echo "[gpu_shared] shared done ($(( $(date +%s) - start )) s so far)"
read -r MB COMPILE < <($PY - "$OUT/shared.json" <<'PYEOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["variants"]
except Exception:
    rows = {}
ok = sorted((r["update_s"] + r["learner_forward_s"], r["options"]["micro_batch_size"],
             str(r["options"].get("learner_compile", False)).lower()) for r in rows.values() if "update_s" in r)
print(*(ok[0][1:] if ok else (32, "false")))
PYEOF
)
echo "[gpu_shared] step with micro-batch $MB, learner_compile $COMPILE"
timeout "${T3:-200}" $PY -m benchmarks.gpu_step --model "$MODEL" --batch_sizes "$B_STEP" --steps 1 --warmup 0 \
    --extras false --micro_batch_size "$MB" "${FAST[@]}" --learner_compile "$COMPILE" --value_model shared \
    --value_model_name null --time_budget_s 180 --out "$OUT/step_shared.json" 2>&1 | quiet | grep "^\[gpu_step\]\|Error"
echo "[gpu_shared] done ($(( $(date +%s) - start )) s)"
