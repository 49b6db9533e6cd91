#!/usr/bin/env bash
# Install the ppo-ray Grafana dashboard into the provisioning folder Ray writes for its session.
#
#   deploy/grafana/install.sh [--temp-dir DIR]   # DIR: as `ray start --temp-dir`; default as Ray's:
#                                                # $RAY_TMPDIR/ray, else $TMPDIR/ray (Linux), else /tmp/ray
#
# `ray start --head` (its dashboard process) writes a Grafana set-up for its session under
# <temp dir>/session_latest/metrics/grafana/: grafana.ini (anonymous viewers, embedding allowed,
# provisioning from the folder below), provisioning/ (a data source "Prometheus" at
# $RAY_PROMETHEUS_HOST, default http://localhost:9090) and dashboards/ (Ray's own), which
# Grafana started with that grafana.ini loads. That folder belongs to the session: the next
# `ray start` makes a new one without ppo-ray.json (and the dashboard process empties it when it
# starts), so run this after each `ray start`. Grafana rescans the folder by itself; restart it
# after a new `ray start` (the provisioning names the session's own folder). Run it on the head.
# The Ray dashboard's Metrics page embeds Grafana only if the head was started with
# RAY_GRAFANA_HOST (where the dashboard process reaches Grafana, default http://localhost:3000)
# and RAY_PROMETHEUS_HOST (where it and Grafana's data source reach Prometheus, default
# http://localhost:9090) right; RAY_GRAFANA_IFRAME_HOST is the address the *browser* loads
# Grafana from when it differs (an SSH tunnel, a proxy). Source: ray/dashboard/modules/metrics/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${RAY_TMPDIR:-}" ]; then
    temp_dir=$RAY_TMPDIR/ray
elif [ "$(uname -s)" = Linux ] && [ -n "${TMPDIR:-}" ]; then
    temp_dir=${TMPDIR%/}/ray
else
    temp_dir=/tmp/ray
fi
while [ $# -gt 0 ]; do
    case "$1" in
        --temp-dir) temp_dir=${2:?--temp-dir needs a value}; shift 2 ;;
        --temp-dir=*) temp_dir=${1#--temp-dir=}; shift ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1 (usage: $0 [--temp-dir DIR])" >&2; exit 2 ;;
    esac
done
session="$temp_dir/session_latest"
grafana="$session/metrics/grafana"
if [ ! -d "$grafana/dashboards" ]; then
    echo "error: no Ray session's Grafana folder at $grafana/dashboards: run \`ray start --head\`" \
         "first (with --temp-dir, pass the same --temp-dir here)" >&2
    exit 1
fi
cp "$here/ppo-ray.json" "$grafana/dashboards/ppo-ray.json"
echo "installed $grafana/dashboards/ppo-ray.json (session $(basename "$(readlink -f "$session")"))"
prom=$(sed -n 's/^ *url: *//p' "$grafana/provisioning/datasources/default.yml" 2>/dev/null | head -n 1 || true)
[ -n "$prom" ] && echo "this session's Grafana data source reads Prometheus at $prom (RAY_PROMETHEUS_HOST at \`ray start\`)"
home="<Grafana's share dir, e.g. /usr/share/grafana>"
for d in /usr/share/grafana /usr/local/share/grafana /opt/homebrew/share/grafana; do
    if [ -d "$d/conf" ]; then home=$d; break; fi
done
echo "start Grafana with Ray's configuration (restart it if it runs from an earlier session):"
echo "  grafana-server --config $grafana/grafana.ini --homepath $home web"
echo "for the Ray dashboard's Metrics page to embed Grafana, start Ray with (before \`ray start\`):"
echo "  RAY_GRAFANA_HOST=http://127.0.0.1:3000 RAY_PROMETHEUS_HOST=http://127.0.0.1:9090 ray start --head ..."
echo "  (RAY_GRAFANA_IFRAME_HOST=<Grafana's URL as the browser sees it>, when that differs)"
