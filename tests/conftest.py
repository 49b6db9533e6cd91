"""Shared pytest fixtures and markers.

* ``tiny_model_dir`` (session): the embedded tiny Qwen3 model, built once into the
  default cache (``$PPO_RAY_CACHE`` or ``~/.cache/ppo_ray``) and reused by later
  runs (and by Ray workers that call ``build_tiny_model()``). No network.
* ``vllm_llm`` (session): ONE vLLM engine over the tiny model for the whole
  session (engine start is ~25 s on 2 CPU cores), float32, built by
  ``actors.vllm_engine.build_llm`` with ``enable_lora=True, max_lora_rank=16`` so
  LoRA tests can share it (without a LoRARequest it matches the base model).
  ``logprobs_mode="processed_logprobs"``. Tests must not change engine-wide state
  they do not restore (e.g. remove the LoRA adapters they add).
* marker ``slow``: long tests; deselect with ``-m "not slow"``.
* ``old_run``, ``no_ray_address``, ``snapshot``, ``launch_ppo``: for the tests of several
  modules that a rejected launch.py command leaves a run directory as it was.
* ``tagged_processes``, ``wait_for``: a launch.py subprocess's processes (found by an
  environment marker) and waiting on a condition, for the tests that stop a run.
* ``read_events``, ``text_at``: TensorBoard's reader over a run's event files
  (test_tracking.py, test_monitoring.py).
* ``local_hub``: a stand-in for the Hugging Face hub on 127.0.0.1 serving local model
  directories in the hub's file layout, for the code paths that fetch from the hub.

No test reaches a hub: the whole session (and its subprocesses and Ray workers, which
inherit the environment) runs with HF_HUB_OFFLINE=1, set here before anything imports
huggingface_hub; a test that exercises a download points a subprocess at ``local_hub``.

vLLM spawns its engine processes, so engines are only ever built inside fixtures,
never at import time.
"""

from __future__ import annotations

import os
import pathlib

# Before any import of huggingface_hub (it reads these once): the same for every test.
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_name] = "1"

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")


@pytest.fixture(scope="session")
def tiny_model_dir() -> pathlib.Path:
    from ppo_ray.tiny_model import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def vllm_llm(tiny_model_dir: pathlib.Path):
    from actors.vllm_engine import build_llm

    # one engine for the adapter and tensor sync modes (the tensor mode's worker extension
    # changes nothing for the adapter mode's requests)
    llm = build_llm(tiny_model_dir, dtype="float32", seed=0, enable_lora=True, max_lora_rank=16, max_loras=1,
                    worker_extension_cls="actors.vllm_lora.TensorLoRAWorker")
    yield llm
    try:  # stop the engine-core and worker processes now rather than at exit
        llm.llm_engine.engine_core.shutdown(timeout=10)
    except Exception:  # pragma: no cover - best effort
        pass


TESTS_DIR = pathlib.Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
TINY = ROOT / "configs" / "tiny.yaml"


# --------------------------------------------------------------------------- rejected commands
def snapshot(directory: pathlib.Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory`: relative path -> (bytes, mtime_ns)."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def old_run(tmp_path) -> pathlib.Path:
    """A run directory with a previous run's files, which a rejected command must not touch."""
    run = tmp_path / "old-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config-ppo.yaml").write_text("kl_coef: 0.1\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    return run


def launch_ppo(run: pathlib.Path, *args: str) -> int:
    """launch.py ppo on configs/tiny.yaml (a programmatic reward) in `run`, RAY_ADDRESS unset."""
    import launch

    return launch.main(["ppo", "--config", str(TINY), "--run_dir", str(run), *args])


@pytest.fixture
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


# --------------------------------------------------------------------------- a run's processes
RUN_MARKER = "PPO_RAY_RUN_TEST"  # set in a launched run's environment: Ray's processes and workers inherit it


def tagged_processes(tag: str) -> list[int]:
    """Pids of the processes whose environment has RUN_MARKER=tag (a launch.py subprocess and
    the Ray processes it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"{RUN_MARKER}={tag}".encode() in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def wait_for(condition, timeout_s: float, what: str, proc=None) -> None:
    """Wait until condition() holds (AssertionError naming `what` after timeout_s, or as soon as
    the subprocess `proc` exits)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.5)


# --------------------------------------------------------------------------- TensorBoard
def read_events(log_dir: pathlib.Path):
    """TensorBoard's own reader over every event file of a run (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def text_at(acc, tag: str) -> dict[int, str]:
    """Text summaries (add_text) by step: TensorBoard stores them as string tensors."""
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}


@pytest.fixture(scope="session")
def ray_session():
    """ONE local Ray instance for the whole session (no dashboard: it costs start-up time
    and tests don't read it). The tests folder is put on the workers' PYTHONPATH so reward
    functions defined in tests/reward_fns.py import inside actors, as a user's own module
    would on their cluster."""
    import os

    import ray

    # The workers' environment only (the job's runtime_env, which every actor's own env_vars
    # extend): this process's os.environ stays as it was, so a subprocess test sees the same
    # environment whichever tests ran before it.
    env_vars = {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p),
                # vLLM's INFO lines from inside the generator actor drown the test output.
                "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if not ray.is_initialized():
        # address="local": always a new instance of its own, never a cluster that another
        # process (a `ray start` of a test, a developer's head) left on this machine
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": env_vars})
    yield ray
    ray.shutdown()


def tiny_test_config(**overrides):
    """configs/tiny.yaml with small, fast settings for tests."""
    from ppo_ray.config import PPOConfig

    # logprob_gap_check: error: a generator that samples from another policy than the
    # learner's (stale KV, a lost sync) fails the test instead of a warning in its log.
    base = dict(batch_size=8, max_new_tokens=12, ppo_epochs=2, micro_batch_size=4,
                prompt_truncation="error", max_prompt_length=400, vllm_kv_cache_gib=0.25,
                logprob_gap_check="error")
    base.update(overrides)
    return PPOConfig.from_yaml(TESTS_DIR.parent / "configs" / "tiny.yaml", **base)


@pytest.fixture(scope="session")
def tiny_trainer(ray_session, tiny_model_dir, tmp_path_factory):
    """ONE PPOTrainer (one vLLM generator actor, reference, reward and learner actors) over
    the tiny model, shared by the Ray tests of a session. Tests that step it must not
    assume a particular starting step. A FaultyTrainer (tests/fault_injection.py): unarmed it
    runs as a PPOTrainer; test_faults.py and test_sync_check.py arm its faults."""
    from fault_injection import FaultyTrainer

    # max_actor_restarts: tests/test_faults.py's matrix (-m slow) restarts each role up to
    # a dozen times on this one trainer; the default 3 would leave it with a dead generator.
    trainer = FaultyTrainer(tiny_test_config(max_actor_restarts=100))
    # Its state before any step, for tests whose claim needs a fresh policy whatever ran
    # before them on this shared trainer: trainer.restore(trainer.initial_checkpoint).
    trainer.run_dir = tmp_path_factory.mktemp("tiny-trainer-initial")
    trainer.initial_checkpoint = trainer.save_checkpoint()
    trainer.run_dir = None
    yield trainer
    trainer.shutdown()


# --------------------------------------------------------------------------- a stand-in hub
class LocalHub:
    """Serves ``root/<org>/<name>/<file>`` at ``<endpoint>/<org>/<name>/resolve/<revision>/<file>``,
    with the headers huggingface_hub's downloads read (X-Repo-Commit, ETag, Content-Length),
    on 127.0.0.1. ``requests`` records the paths asked for. Point a subprocess at it with
    ``env(...)`` (HF_ENDPOINT, online, a private cache)."""

    def __init__(self, root: pathlib.Path, cache: pathlib.Path):
        import hashlib
        import http.server
        import threading

        self.root, self.cache, self.requests = root, cache, []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _file(self):
                hub.requests.append(self.path)
                parts = self.path.split("?")[0].strip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return None
                path = hub.root.joinpath(parts[0], parts[1], *parts[4:])
                return path if path.is_file() else None

            def _head(self, path):
                if path is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", "0" * 40)
                self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest())
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return data

            def do_HEAD(self):  # noqa: N802 - http.server's names
                self._head(self._file())

            def do_GET(self):  # noqa: N802
                data = self._head(self._file())
                if data is not None:
                    self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env[name] = "0"
        env.update(HF_ENDPOINT=self.endpoint, HF_HUB_CACHE=str(self.cache), HF_HUB_DISABLE_TELEMETRY="1")
        return env

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def local_hub(tmp_path):
    hub = LocalHub(tmp_path / "hub", tmp_path / "hub-cache")
    yield hub
    hub.close()
