#!/usr/bin/env bash
# Install the ppo-ray Grafana dashboard into the provisioning folder Ray writes for its session.
#
#   deploy/grafana/install.sh [--temp-dir DIR]     # DIR: `ray start --temp-dir`, default /tmp/ray
#
# `ray start --head` writes a Grafana set-up for its session under
# <temp dir>/session_latest/metrics/grafana/: grafana.ini (anonymous viewers, embedding allowed,
# provisioning from the folder below), provisioning/ (a Prometheus data source at
# $RAY_PROMETHEUS_HOST, default http://localhost:9090) and dashboards/ (Ray's own), which
# Grafana started with that grafana.ini loads. That folder belongs to the session: the next
# `ray start` makes a new one without ppo-ray.json, so run this after each `ray start`, then
# (re)start Grafana. Run it on the head node. The Ray dashboard's Metrics page embeds Grafana
# only when the head was started with RAY_GRAFANA_HOST (where the dashboard process reaches
# Grafana, default http://localhost:3000) and RAY_PROMETHEUS_HOST (where it reaches
# Prometheus, default http://localhost:9090) set; RAY_GRAFANA_IFRAME_HOST is the address the
# *browser* uses for Grafana when it differs (an SSH tunnel, a proxy).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
temp_dir=/tmp/ray
while [ $# -gt 0 ]; do
    case "$1" in
        --temp-dir) temp_dir=${2:?--temp-dir needs a value}; shift 2 ;;
        --temp-dir=*) temp_dir=${1#--temp-dir=}; shift ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
echo "start Grafana with Ray's configuration (restart it if it runs):"
echo "  grafana-server --config $grafana/grafana.ini --homepath <Grafana's share dir, e.g. /usr/share/grafana> web"
