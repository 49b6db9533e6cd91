#!/usr/bin/env bash
# Issue 16's checks on a lent GPU, in one call: named stages (a lent GPU has no Ray or vLLM, so
# each stage runs benchmarks.gpu_step or benchmarks.learner_profile), and groups of them.
#   bash benchmarks/gpu.sh next                   # the next check: the former benchmarks/gpu_next.sh
#   bash benchmarks/gpu.sh step_shared profile    # these stages, in this order
#   bash benchmarks/gpu.sh --list                 # every stage and group, one line each
# `gpu.sh next` is what gpu_next.sh ran: the B=512 step with the compiled head, shared trunk
# then separate value model (the 20 s step target), then where the kernel time goes (the 40% MFU
# target). The other groups are the other former one-call checks, each with its stages,
# micro-batch and timeouts: gpu.sh head|host|merged|decoder|shared|speed = gpu_<group>.sh
# (benchmarks/RESULTS.md's sessions name the old scripts).
#
# Each stage runs under `timeout`: its bound is the stage table's or its group's, T_<STAGE>
# overrides it (T_STEP_SHARED=300). A stage with a "before" bound starts only while fewer seconds
# than that have passed since the call began (BEFORE_<STAGE> overrides). A failed stage does not
# stop the call; the exit status is 1 if one failed (2: an unknown stage, before anything ran).
# Environment: OUT (benchmarks/results/gpu: the JSON, profiles, the card in gpu.txt and the log in
# log.txt), PYTHON (python3), MODEL (qwen3-0.6b), MB (the micro-batch: the group's, else 64),
# B_STEP (gpu_step's batch sizes: 64,512; step_fast 64,64,512), B_PROFILE (64), B_PROFILE_NEXT
# (128), B_BIG (512), MBS ("32 64": the decoder stages' micro-batches), PYTORCH_CUDA_ALLOC_CONF
# (expandable_segments:True; set it empty for PyTorch's default, as gpu_shared/gpu_speed ran).
# Dry run on the CPU (the test model, small batches), from the repository root:
#   MODEL=test B_STEP=4,8 MB=8 B_PROFILE=8 B_PROFILE_NEXT=8 B_BIG=8 MBS="2 8" \
#       OUT=/tmp/gpu_dry bash benchmarks/gpu.sh next
set -uo pipefail

# The stages: timeout s; "before" s ("-": always starts); the JSON under $OUT ({MB}: the
# micro-batch); what it measures (--list prints it). Each has a function stage_<name>.
STAGES=$(cat <<'EOF'
step_shared            200  -    step_shared           gpu_step B_STEP (64 then 512), shared trunk: lora merged, learner_compile, static KV cache, no one-off phases
step_separate          200  -    step_separate         the same step with the separate value model (the preset default)
profile                150  400  profile_mb{MB}        learner_profile B_PROFILE_NEXT (128), 1 epoch, merged+compile under torch.profiler: kernel time by category, top kernels to $OUT
host                   110  -    host                  learner_profile B_PROFILE, 1 epoch, merged+compile: timed under skip_guard_eval_unsafe, host-GPU syncs to $OUT/syncs_*.txt
host_flash             100  -    flash                 the host stage with cuDNN SDPA off (PyTorch flash attention), no sync report
b64_merged             170  -    b64                   learner_profile B_PROFILE, 1 epoch: lora fused vs merged (both compiled), each also under torch.profiler
b512_separate          120  -    b512_separate         learner_profile B_BIG (512), 4 epochs, separate value model, merged+compile
b512_shared             80  390  b512_shared           the same with the shared trunk
b512_separate_head     180  -    b512_separate_head    B_BIG, 4 epochs, separate: the lm_head + logprob math eager, then compiled (one process)
b512_shared_head       100  -    b512_shared_head      B_BIG, 4 epochs, shared trunk, head compiled
b512_separate_flash    120  -    b512_separate_flash   B_BIG, 4 epochs, separate, head compiled, cuDNN SDPA off (PyTorch flash attention)
b512_layer             150  -    b512_layer            B_BIG, 4 epochs, separate: learner_compile_scope layer at the micro-batches MBS
b512_decoder           300  -    b512_decoder          the same with learner_compile_scope decoder (one graph per forward and backward; own process)
b512_decoder_shared    140  390  b512_decoder_shared   the decoder scope with the shared trunk
compile_separate       140  -    separate              learner_profile B_PROFILE, 1 epoch, speed options, separate: micro-batch 32 with and without learner_compile
compile_shared         150  -    shared                the same with the shared trunk: micro-batch 32 and 64, and 32 compiled
step_shared_best       200  -    step_shared           gpu_step B_STEP, shared trunk, lora fused, at compile_shared's fastest micro-batch and compile
speed_options           90  -    learner               learner_profile B_PROFILE, 1 epoch: the plain path vs the speed options at micro-batch 8-64 (and 64 checkpointed)
step_fast              150  -    step_fast             gpu_step B_STEP (64,64,512), speed options, at speed_options' fastest micro-batch under 40 GiB
compile_best           100  -    compile               learner_profile B_PROFILE, 1 epoch: learner_compile at that micro-batch
EOF
)
# The groups, the former benchmarks/gpu_<group>.sh: micro-batch ("-": the stages pick or fix
# theirs), stages in order (stage:T runs it with timeout T), what it was for.
GROUPS_TABLE=$(cat <<'EOF'
next      64  step_shared,step_separate,profile                        the next check: the B=512 step (20 s target) and the compiled head's kernel time (40% MFU target)
head      64  b512_separate_head,b512_shared_head,b512_separate_flash  fifth session: the compiled lm_head + logprob math at B=512
decoder   -   b512_layer,b512_decoder,b512_decoder_shared              the decoder compile scope vs per-layer at B=512, micro-batches MBS
host      32  host,host_flash,step_separate:150                        fourth session: the host's share of the update, then the B=512 step
merged    32  b64_merged,b512_separate,step_shared:150,b512_shared     third session: lora merged vs fused, B=512 update, the step
shared    -   compile_separate,compile_shared,step_shared_best         second session: learner_compile at micro-batch 32 and the shared trunk
speed     -   speed_options,step_fast,compile_best                     first session: the speed options' micro-batch sweep, the step, compile
EOF
)

OUT=${OUT:-benchmarks/results/gpu}
PY=${PYTHON:-python3}
MODEL=${MODEL:-qwen3-0.6b}
B_PROFILE=${B_PROFILE:-64}
B_BIG=${B_BIG:-512}
MB_ENV=${MB:-}  # the micro-batch from the environment wins over the group's
# gpu_step's speed options (learner_profile's FAST variants are the same set)
FAST=(--learner_layout causal --learner_sort_by_length true --lora_kernel fused --rms_norm_kernel fused
      --logprob_chunk_size 1024)
quiet() { grep -v "Loading weights\|Writing model"; }
elapsed() { echo $(( $(date +%s) - start )); }

# benchmarks.gpu_step, one step per batch size: $1 timeout s, $2 JSON, $3 time budget s, then its flags
step() {
    local t=$1 json=$2 budget=$3; shift 3
    timeout "$t" $PY -m benchmarks.gpu_step --model "$MODEL" --batch_sizes "${B_STEP:-64,512}" --steps 1 --warmup 0 \
        --micro_batch_size "$MB" "${FAST[@]}" "$@" --time_budget_s "$budget" --out "$json" 2>&1 | quiet \
        | grep "^\[gpu_step\]\|Error"
    return "${PIPESTATUS[0]}"
}
# benchmarks.learner_profile: $1 timeout s, $2 JSON, $3 time budget s, $4 batch size, $5 PPO epochs,
# $6 variants (learner_profile.VARIANTS), then its flags
profile() {
    local t=$1 json=$2 budget=$3 b=$4 epochs=$5 variants=$6; shift 6
    timeout "$t" $PY -m benchmarks.learner_profile --model "$MODEL" --batch_size "$b" --ppo_epochs "$epochs" \
        --variants "$variants" --profile none --split none "$@" --time_budget_s "$budget" --out "$json" 2>&1 | quiet
    return "${PIPESTATUS[0]}"
}
# learner_profile at the preset's shape (B_BIG, 4 epochs): $1 timeout s, $2 JSON, $3 seconds of the
# timeout left out of the time budget, $4 value model, $5 variants, then its flags
b512() {
    local t=$1 json=$2 margin=$3 value=$4 variants=$5; shift 5
    profile "$t" "$json" $(( t - margin )) "$B_BIG" 4 "$variants" --value_model "$value" "$@"
}
merged_step() {  # the step as the preset runs it on the GPU: lora merged, learner_compile, static KV cache
    local t=$1 json=$2; shift 2
    step "$t" "$json" $(( t - 20 )) --extras false --generate_cache static --lora_kernel merged \
        --learner_compile true "$@"
}
mb_variants() { local v=() mb; for mb in ${MBS:-32 64}; do v+=("${1}_mb$mb"); done; (IFS=,; echo "${v[*]}"); }

# Each stage: $1 its timeout s, $2 its JSON path.
stage_step_shared() { merged_step "$1" "$2" --value_model shared --value_model_name null; }
stage_step_separate() { merged_step "$1" "$2"; }
stage_profile() {
    profile "$1" "$2" $(( $1 - 30 )) "${B_PROFILE_NEXT:-128}" 1 "merged_compile_mb$MB" \
        --profile "merged_compile_mb$MB" --trace_dir "$OUT"
}
host_profile() {
    local t=$1 json=$2; shift 2
    profile "$t" "$json" $(( t - 10 )) "$B_PROFILE" 1 "merged_compile_mb$MB" --skip_guards "merged_compile_mb$MB" "$@"
}
stage_host() { host_profile "$1" "$2" --sync_report "merged_compile_mb$MB" --trace_dir "$OUT"; }
stage_host_flash() { host_profile "$1" "$2" --no_cudnn_sdpa; }
stage_b64_merged() {
    local v="all_compile_mb$MB,merged_compile_mb$MB"
    profile "$1" "$2" $(( $1 - 20 )) "$B_PROFILE" 1 "$v" --profile "$v" --trace_dir "$OUT"
}
stage_b512_separate() { b512 "$1" "$2" 20 separate "merged_compile_mb$MB"; }
stage_b512_shared() { b512 "$1" "$2" 20 shared "merged_compile_mb$MB"; }
stage_b512_separate_head() { b512 "$1" "$2" 30 separate "merged_compile_eagerhead_mb$MB,merged_compile_mb$MB"; }
stage_b512_shared_head() { b512 "$1" "$2" 30 shared "merged_compile_mb$MB"; }
stage_b512_separate_flash() { b512 "$1" "$2" 30 separate "merged_compile_mb$MB" --no_cudnn_sdpa; }
stage_b512_layer() { b512 "$1" "$2" 40 separate "$(mb_variants merged_compile)"; }
stage_b512_decoder() { b512 "$1" "$2" 40 separate "$(mb_variants merged_dcompile)"; }
stage_b512_decoder_shared() { b512 "$1" "$2" 40 shared "$(mb_variants merged_dcompile)"; }
stage_compile_separate() { profile "$1" "$2" $(( $1 - 20 )) "$B_PROFILE" 1 all_mb32,all_compile_mb32; }
stage_compile_shared() {
    profile "$1" "$2" $(( $1 - 20 )) "$B_PROFILE" 1 all_mb32,all_mb64,all_compile_mb32 --value_model shared
}
stage_step_shared_best() {  # micro-batch and learner_compile of compile_shared's fastest variant (32, false without it)
    local MB=32 compile=false
    read -r MB compile < <($PY - "$(json_path compile_shared)" <<'PYEOF'
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
    echo "[gpu] step_shared_best: micro-batch $MB, learner_compile $compile"
    step "$1" "$2" $(( $1 - 20 )) --extras false --learner_compile "$compile" --value_model shared --value_model_name null
}
speed_mb() {  # speed_options' fastest speed-option micro-batch whose peak stays <= 40 GiB (16 without it)
    $PY - "$(json_path speed_options)" <<'PYEOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["variants"]
except Exception:
    rows = {}
ok = [(r["update_s"] + r["learner_forward_s"], r["options"].get("micro_batch_size", 8)) for n, r in rows.items()
      if n.startswith("all") and "update_s" in r and "gc" not in n and (r.get("peak_gib") or 0) <= 40]
print(min(ok)[1] if ok else 16)
PYEOF
}
stage_speed_options() {
    profile "$1" "$2" $(( $1 - 15 )) "$B_PROFILE" 1 base,all,all_mb16,all_mb32,all_mb64,all_gc_mb64
}
stage_step_fast() {  # with the one-off phases (extras), dynamic KV cache
    local MB=16 B_STEP=${B_STEP:-64,64,512}
    MB=$(speed_mb)
    echo "[gpu] step_fast: micro-batch $MB"
    step "$1" "$2" $(( $1 - 80 ))
}
stage_compile_best() { local MB=16; MB=$(speed_mb); profile "$1" "$2" $(( $1 - 40 )) "$B_PROFILE" 1 "all_compile_mb$MB"; }

declare -A TIMEOUT BEFORE JSON DESC GROUP_MB GROUP_STAGES GROUP_DESC
STAGE_ORDER=() GROUP_ORDER=()
while read -r name t before json desc; do
    [[ -n $name ]] || continue
    STAGE_ORDER+=("$name") TIMEOUT[$name]=$t BEFORE[$name]=$before JSON[$name]=$json DESC[$name]=$desc
done <<< "$STAGES"
while read -r name mb stages desc; do
    [[ -n $name ]] || continue
    GROUP_ORDER+=("$name") GROUP_MB[$name]=$mb GROUP_STAGES[$name]=$stages GROUP_DESC[$name]=$desc
done <<< "$GROUPS_TABLE"

json_path() { local j=${JSON[$1]}; echo "$OUT/${j//\{MB\}/$MB}.json"; }  # $1 stage, at the current $MB

check_tables() {  # every stage has its function and every function its stage; groups name stages
    local s g tok bad=0
    for s in "${STAGE_ORDER[@]}"; do
        declare -F "stage_$s" > /dev/null || { echo "gpu.sh: stage $s has no function stage_$s" >&2; bad=1; }
    done
    for s in $(declare -F | awk '$3 ~ /^stage_/ {print substr($3, 7)}'); do
        [[ -n ${TIMEOUT[$s]+x} ]] || { echo "gpu.sh: function stage_$s is not in the stage table" >&2; bad=1; }
    done
    for g in "${GROUP_ORDER[@]}"; do
        for tok in ${GROUP_STAGES[$g]//,/ }; do
            [[ -n ${TIMEOUT[${tok%%:*}]+x} ]] || { echo "gpu.sh: group $g names no stage ${tok%%:*}" >&2; bad=1; }
        done
    done
    return $bad
}

list() {
    local s g
    echo "stages (timeout s, JSON under \$OUT, what it measures):"
    local when
    for s in "${STAGE_ORDER[@]}"; do
        when=; [[ ${BEFORE[$s]} == - ]] || when=" (starts only before ${BEFORE[$s]} s into the call)"
        printf '  %-20s %4s  %-25s %s%s\n' "$s" "${TIMEOUT[$s]}" "${JSON[$s]}.json" "${DESC[$s]}" "$when"
    done
    echo "groups (the former benchmarks/gpu_<group>.sh: what it was for [micro-batch: its stages]):"
    for g in "${GROUP_ORDER[@]}"; do
        printf '  %-8s %s [MB %s: %s]\n' "$g" "${GROUP_DESC[$g]}" "${GROUP_MB[$g]}" "${GROUP_STAGES[$g]//,/ }"
    done
}

PLAN=()  # "stage timeout micro-batch" per stage to run (timeout "-": the table's)
plan() {  # the arguments -> PLAN, or exit 2 naming the first unknown one
    local arg tok t mb=${MB_ENV:-64}
    for arg in "$@"; do
        if [[ -n $arg && -n ${GROUP_STAGES[$arg]+x} ]]; then
            for tok in ${GROUP_STAGES[$arg]//,/ }; do
                t=${tok#*:}; [[ $t != "$tok" ]] || t=-
                PLAN+=("${tok%%:*} $t ${MB_ENV:-${GROUP_MB[$arg]/#-/64}}")
            done
        elif [[ -n $arg && -n ${TIMEOUT[$arg]+x} ]]; then
            PLAN+=("$arg - $mb")
        else
            echo "gpu.sh: unknown stage or group '$arg' (bash benchmarks/gpu.sh --list names them)" >&2
            exit 2
        fi
    done
    local -A seen
    local entry name json
    for entry in "${PLAN[@]}"; do  # one file per stage: no stage overwrites another's JSON in one call
        read -r name t MB <<< "$entry"
        json=$(json_path "$name")
        if [[ ${seen[$json]:-} == "$name" ]]; then
            echo "gpu.sh: $name is asked for twice (a group may hold it): run it once per call" >&2
            exit 2
        elif [[ -n ${seen[$json]+x} ]]; then
            echo "gpu.sh: $name and ${seen[$json]} both write $json: run them in separate calls (or OUTs)" >&2
            exit 2
        fi
        seen[$json]=$name
    done
}

run_plan() {
    local entry name t before tvar bvar json rc failed=()
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
    for entry in "${PLAN[@]}"; do
        read -r name t MB <<< "$entry"
        tvar=T_${name^^} bvar=BEFORE_${name^^}
        [[ $t != - ]] || t=${TIMEOUT[$name]}
        t=${!tvar:-$t} before=${!bvar:-${BEFORE[$name]}} json=$(json_path "$name")
        if [[ $before != - ]] && (( $(elapsed) >= before )); then
            echo "[gpu] $name skipped: $(elapsed) s have passed, it starts only before $before s"
            continue
        fi
        echo "[gpu] $name (timeout $t s) -> $json"
        if "stage_$name" "$t" "$json"; then
            echo "[gpu] $name done ($(elapsed) s so far)"
        else
            rc=$?
            failed+=("$name")
            echo "[gpu] $name FAILED: exit $rc$( (( rc != 124 )) || echo ", its $t s timeout") ($(elapsed) s so far)"
        fi
    done
    echo "[gpu] done ($(elapsed) s)${failed[*]:+; failed: ${failed[*]}}"
    (( ${#failed[@]} == 0 ))
}

usage() { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; }  # the header above

main() {
    case ${1:-} in
        --list) check_tables && list; return ;;
        -h|--help) usage; return ;;
        "") usage >&2; return 2 ;;
    esac
    check_tables || return 1
    plan "$@"
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}
    [[ -n $PYTORCH_CUDA_ALLOC_CONF ]] || unset PYTORCH_CUDA_ALLOC_CONF
    mkdir -p "$OUT"
    start=$(date +%s)
    run_plan 2>&1 | tee "$OUT/log.txt"
    return "${PIPESTATUS[0]}"
}

[[ ${BASH_SOURCE[0]} != "$0" ]] || main "$@"
