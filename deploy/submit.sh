#!/usr/bin/env bash
# Submit launch.py to a running Ray cluster as a Ray job (`ray job submit`).
#
#   deploy/submit.sh [--no-wait] [--] [launch.py arguments ...]
#   deploy/submit.sh --wait <submission id>
#
#   ray start --head --dashboard-host 127.0.0.1          # a local head (dashboard 127.0.0.1:8265)
#   deploy/submit.sh ppo --config configs/tiny.yaml --steps 20 --run_dir "$PWD/runs/tiny"
#   RAY_ADDRESS=http://127.0.0.1:8265 deploy/submit.sh --no-wait --run_dir /shared/runs/a
#
# The repository root is the job's working dir: Ray uploads it (deploy/runtime_env.yaml
# lists what it leaves out) and runs `python launch.py <arguments>` in a copy of it on the
# head node. The nodes must already have the dependencies (README set-up, `ray start` from
# the project's .venv). Without --no-wait it streams the job's logs, then waits for the job's
# end and exits with its final status: 0 SUCCEEDED, 1 FAILED, 5 STOPPED (Ray's own `ray job
# submit` exits 0 for a stopped job, and for one still running when its log stream ends; a
# stream that ends early is said, and the wait goes on). --no-wait prints the submission id
# and returns (`ray job status|logs|stop <id>` then). --wait <id> only waits for a submitted
# job's end (after --no-wait, or a lost connection) and exits with its status, as above.
#
# The job's submission id is ppo-ray-<stage>-<run tag> (e.g. ppo-ray-ppo-ppo-1a2b3c4d): the
# run tag is the trainer's (its actors' names <run tag>/<role>, the `run` label of its
# Prometheus series, run.json), chosen here and passed to the job as PPO_RAY_RUN_TAG, so the
# Jobs page's Submission ID column links the job to its actors and series.
#
# Environment:
#   RAY_ADDRESS           the head's dashboard/job API, default http://127.0.0.1:8265
#                         (RAY_API_SERVER_ADDRESS wins when set, as for `ray job submit`)
#   RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token
#                         Ray 2.60 token auth. The job client sends a token only when
#                         RAY_AUTH_MODE=token, so when RAY_AUTH_MODE is unset and one of these
#                         exists, this script sets it. RAY_AUTH_MODE=disabled is respected.
#   ENTRYPOINT_NUM_CPUS, ENTRYPOINT_NUM_GPUS
#                         resources reserved for the driver, default 0: Ray then runs it on
#                         the head node (where relative paths and the run dir live); > 0 lets
#                         Ray place it on any node that has them.
#   SUBMISSION_ID         the job's id (default ppo-ray-<stage>-<run tag>)
#   PPO_RAY_RUN_TAG       the run tag (default ppo-<8 hex>, new for each submission)
#   STATUS_POLL_S         seconds between status queries while waiting without a log stream (10)
#   JOB_NAME              the job's name, the Name column of the dashboard's Jobs page (its
#                         `job_name` metadata); default "ppo-ray <stage> <run dir>", e.g.
#                         "ppo-ray ppo /shared/runs/a" ("ppo-ray all" without --run_dir)
#   RUNTIME_ENV           runtime env file (default deploy/runtime_env.yaml)
#   PREFLIGHT_TIMEOUT     seconds the reachability check waits (default 5)
#   PREFLIGHT             1 (default): before uploading anything, run a small job (named
#                         "ppo-ray preflight" on the Jobs page, id ppo-ray-preflight-<hex>) that checks
#                         the cluster's entrypoint `python` imports the project's dependencies,
#                         and so does the Python of the Ray processes on every other node (one
#                         zero-CPU task pinned to each); 0 skips it
#   PREFLIGHT_MODULES     the modules it imports (default: torch transformers peft vllm ray yaml
#                         safetensors tensorboard)
#
# Before submitting, a check fails fast (exit 3) with one line naming the problem when
# RAY_ADDRESS points nowhere, at something that is not a Ray dashboard, or at a cluster that
# refuses the token; and (exit 4) when the job's `python` on the cluster lacks a dependency:
# the job runs whatever `python` the head's PATH gives the Ray processes (e.g. a system
# Python when `ray start` was run as .venv/bin/ray without activating the venv), which
# would otherwise fail with "No module named 'torch'" only after the upload.
set -euo pipefail
cd "$(dirname "$0")/.."

NO_WAIT=()
WAIT_FOR=""
while [ $# -gt 0 ]; do
    case "$1" in
        --no-wait) NO_WAIT=(--no-wait); shift ;;
        --wait) WAIT_FOR=${2:?--wait needs a submission id}; shift 2 ;;
        --) shift; break ;;
        *) break ;;
    esac
done

ADDRESS=${RAY_API_SERVER_ADDRESS:-${RAY_ADDRESS:-http://127.0.0.1:8265}}
RUNTIME_ENV=${RUNTIME_ENV:-deploy/runtime_env.yaml}

if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -n "${RAY_AUTH_TOKEN_PATH:-}" ] \
        || [ -s "$HOME/.ray/auth_token" ]; }; then
    export RAY_AUTH_MODE=token
fi

# Reachability and auth, with the token the job client will send (stdlib only).
python3 - "$ADDRESS" "${PREFLIGHT_TIMEOUT:-5}" <<'PY' || exit 3
import os, socket, sys, urllib.error, urllib.parse, urllib.request

address, timeout = sys.argv[1], float(sys.argv[2])

def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)

start_hint = ("start a head with `ray start --head --dashboard-host 127.0.0.1`, or set RAY_ADDRESS "
              "to the head's dashboard, http://<head>:8265 (from a laptop: an SSH tunnel or "
              "`ray dashboard deploy/cluster.yaml`)")
if address.startswith("ray://"):
    fail(f"RAY_ADDRESS={address} is a Ray Client address; `ray job submit` talks to the "
         "dashboard: use http://<head>:8265")
if "://" not in address:
    # A GCS address (host:6379) or "auto": Ray looks the dashboard up through the GCS itself;
    # check only that something listens there.
    if address != "auto":
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except (OSError, ValueError) as e:
            fail(f"no Ray cluster at RAY_ADDRESS={address} ({e}); {start_hint}")
    sys.exit(0)

token, source = None, None
if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
    if os.environ.get("RAY_AUTH_TOKEN"):
        token, source = os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    else:
        for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), os.path.expanduser("~/.ray/auth_token")):
            if path and os.path.isfile(path):
                token, source = open(path).read().strip(), path
                break
url = address.rstrip("/") + "/api/version"
headers = {"Authorization": f"Bearer {token}"} if token else {}
try:
    urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout).read()
except urllib.error.HTTPError as e:
    if e.code == 401:
        fail(f"the Ray cluster at {address} requires token authentication and no token was found: "
             "set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or copy the head's ~/.ray/auth_token here "
             "(`ray get-auth-token` on the head prints it)")
    if e.code == 403:
        fail(f"the Ray cluster at {address} rejected the auth token from {source}: use that "
             "cluster's token (`ray get-auth-token` on the head prints it)")
    if e.code == 404:
        fail(f"{address} answers HTTP but is not a Ray dashboard (no /api/version): point "
             "RAY_ADDRESS at the head's dashboard port (default 8265)")
    fail(f"{url} answered HTTP {e.code} {e.reason}")
except (urllib.error.URLError, OSError) as e:
    fail(f"no Ray cluster at RAY_ADDRESS={address} ({getattr(e, 'reason', e)}); {start_hint}")
PY

# The job's final status, polled with `ray job status` until it is one: exit 0 SUCCEEDED,
# 1 FAILED, 5 STOPPED; 6 when the status cannot be read (after a minute of tries).
wait_for_end() {
    local id=$1 out status said="" unread=0
    while :; do
        out=$(ray job status --address "$ADDRESS" "$id" 2>&1) || true
        case "$out" in
            *"Job '$id' succeeded"*) status=SUCCEEDED ;;
            *"Job '$id' failed"*) status=FAILED ;;
            *"Job '$id' was stopped"*) status=STOPPED ;;
            *"Status for job '$id': "*) status=${out##*"Status for job '$id': "}; status=${status%%[^A-Z]*} ;;
            *) status="" ;;
        esac
        case "$status" in
            SUCCEEDED) return 0 ;;
            FAILED) echo "job $id FAILED (ray job logs $id)" >&2; return 1 ;;
            STOPPED) echo "job $id was STOPPED" >&2; return 5 ;;
            PENDING|RUNNING)
                unread=0
                if [ -z "$said" ]; then
                    echo "job $id is $status: waiting for its end (Ctrl-C leaves it running; its logs: ray job logs --follow $id)" >&2
                    said=1
                fi ;;
            *)
                unread=$((unread + 1))
                if [ "$unread" -ge 6 ]; then
                    echo "error: cannot read the status of job $id: $out" >&2
                    return 6
                fi ;;
        esac
        sleep "${STATUS_POLL_S:-10}"
    done
}

if [ -n "$WAIT_FOR" ]; then
    wait_for_end "$WAIT_FOR"
    exit $?
fi

# The entrypoint's Python: the job runs `python launch.py`, and `python` is whatever the
# head's PATH gives the Ray processes. A tiny job (no working dir, no upload) imports the
# dependencies with that same `python` and names the ones missing.
if [ "${PREFLIGHT:-1}" != 0 ]; then
    modules=${PREFLIGHT_MODULES:-torch transformers peft vllm ray yaml safetensors tensorboard}
    check='import importlib, json, sys

def probe(names):
    missing = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:
            missing[name] = f"{type(e).__name__}: {e}"
    return {"python": sys.executable, "version": sys.version.split()[0], "missing": missing}

names = sys.argv[1:]
report = probe(names)
report["node"], report["nodes"] = "the head", {}
if not report["missing"]:
    # every other node: the actors there run the Python its raylet was started with
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as on
    ray.init(log_to_driver=False)
    here = ray.get_runtime_context().get_node_id()
    others = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    remote = ray.remote(num_cpus=0, max_retries=0)(probe)
    refs = [remote.options(scheduling_strategy=on(n["NodeID"], soft=False)).remote(names) for n in others]
    for node, ref in zip(others, refs):
        try:
            report["nodes"][node["NodeManagerAddress"]] = ray.get(ref, timeout=300)
        except Exception as e:  # the node could not run the probe at all
            report["nodes"][node["NodeManagerAddress"]] = {"python": "its Python", "version": "?",
                                                           "missing": {"(the probe)": f"{type(e).__name__}: {e}"}}
print("PPO_RAY_PREFLIGHT " + json.dumps(report))
sys.exit(1 if report["missing"] or any(r["missing"] for r in report["nodes"].values()) else 0)'
    pre_args=(--address "$ADDRESS" --entrypoint-num-cpus "${ENTRYPOINT_NUM_CPUS:-0}"
              --entrypoint-num-gpus "${ENTRYPOINT_NUM_GPUS:-0}"
              --submission-id "ppo-ray-preflight-$(python3 -c 'import uuid; print(uuid.uuid4().hex[:12])')"
              --metadata-json '{"job_name": "ppo-ray preflight"}')
    if ! out=$(ray job submit "${pre_args[@]}" -- python -c "$check" $modules 2>&1); then
        python3 - "$out" <<'PY'
import json, sys

out = sys.argv[1]
found = [line.split("PPO_RAY_PREFLIGHT ", 1)[1] for line in out.splitlines() if "PPO_RAY_PREFLIGHT " in line]
if not found:
    print("error: the preflight job (python -c 'import torch, ...' on the cluster) failed before it could report:\n"
          + "\n".join(out.splitlines()[-15:]), file=sys.stderr)
    sys.exit(0)
info = json.loads(found[-1])
fix = ("start Ray from the environment that has the dependencies (`source .venv/bin/activate && ray start "
       "...`, or PATH=$PWD/.venv/bin:$PATH ray start ...; the README set-up makes .venv), or install them "
       "into that Python (pip install -e '.[gpu]' or '.[cpu]'); PREFLIGHT=0 skips this check")
if info["missing"]:
    missing = "; ".join(f"{name} ({why})" for name, why in info["missing"].items())
    print(f"error: the cluster's entrypoint Python, {info['python']} (Python {info['version']}), cannot import: "
          f"{missing}. The job runs `python launch.py` with the `python` on the PATH of the head's Ray processes: "
          + fix, file=sys.stderr)
for node, report in info["nodes"].items():
    if report["missing"]:
        missing = "; ".join(f"{name} ({why})" for name, why in report["missing"].items())
        print(f"error: the Python of the Ray processes on node {node}, {report['python']} (Python "
              f"{report['version']}), cannot import: {missing}. The actors placed there would fail: on that node, "
              + fix, file=sys.stderr)
PY
        exit 4
    fi
fi

# Relative paths resolve inside the job's copy of the working dir (in Ray's session dir).
# The run directory is --run_dir, or the one `--resume <run_dir or checkpoint>` names.
run_dir=""
prev=""
for arg in "$@"; do
    case "$arg" in
        --run_dir=*) run_dir=${arg#--run_dir=} ;;
        --resume=auto) ;;
        --resume=*) [ -n "$run_dir" ] || run_dir=${arg#--resume=} ;;
    esac
    if [ "$prev" = "--run_dir" ]; then run_dir=$arg; fi
    if [ "$prev" = "--resume" ] && [ "$arg" != auto ] && [ -z "$run_dir" ]; then run_dir=$arg; fi
    prev=$arg
done
case "$run_dir" in
    /*) ;;
    *) echo "note: no absolute --run_dir: the run's outputs go inside the job's copy of the working" \
            "dir in Ray's session dir on the head node" >&2 ;;
esac

# The Jobs page's Name column: the stage (launch.py's first argument, else "all") and the run
# dir; its Submission ID column: ppo-ray-<stage>-<run tag>.
stage=all
case "${1:-}" in all|sft|rm|ppo|eval|export) stage=$1 ;; esac
job_name=${JOB_NAME:-"ppo-ray $stage${run_dir:+ $run_dir}"}
run_tag=${PPO_RAY_RUN_TAG:-ppo-$(python3 -c 'import uuid; print(uuid.uuid4().hex[:8])')}
submission_id=${SUBMISSION_ID:-ppo-ray-$stage-$run_tag}
metadata=$(python3 -c 'import json, sys; print(json.dumps({"job_name": sys.argv[1], "run_tag": sys.argv[2]}))' \
           "$job_name" "$run_tag")

args=(--address "$ADDRESS" --working-dir . --runtime-env "$RUNTIME_ENV" --metadata-json "$metadata"
      --entrypoint-num-cpus "${ENTRYPOINT_NUM_CPUS:-0}" --entrypoint-num-gpus "${ENTRYPOINT_NUM_GPUS:-0}"
      --submission-id "$submission_id" --no-wait)
ray job submit "${args[@]}" -- env PPO_RAY_RUN_TAG="$run_tag" python launch.py "$@"
echo "run tag $run_tag, submission id $submission_id" >&2
if [ ${#NO_WAIT[@]} -gt 0 ]; then
    exit 0
fi
# The logs until the job ends or the stream does (a dropped connection, a restarted
# dashboard): the job's final status decides the exit code, not the stream.
ray job logs --address "$ADDRESS" --follow "$submission_id" || true
wait_for_end "$submission_id"
