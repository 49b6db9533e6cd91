# Sourced by the one-call GPU checks (gpu_speed.sh, gpu_shared.sh): their common settings.
# OUT (default benchmarks/results/gpu), PYTHON, MODEL, B_PROFILE from the environment; B_STEP's
# default is the caller's ($1). Records the card in $OUT/gpu.txt and sets FAST (the speed options).
OUT=${OUT:-benchmarks/results/gpu}
PY=${PYTHON:-python3}
MODEL=${MODEL:-qwen3-0.6b}
B_PROFILE=${B_PROFILE:-64}
B_STEP=${B_STEP:-$1}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
FAST=(--learner_layout causal --learner_sort_by_length true --lora_kernel fused --rms_norm_kernel fused
      --logprob_chunk_size 1024)
quiet() { grep -v "Loading weights\|Writing model"; }
