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
* ``ray_session``, ``tiny_trainer`` (session): one local Ray, one PPOTrainer on it.
* ``tiny_path``, ``special``, ``attention_dropout_path`` (module): the learner tests' model
  directory, its (eos, pad) ids, and a copy of it with attention dropout on.
* marker ``slow``: long tests; deselect with ``-m "not slow"``.
* marker ``fast``, derived here at collection, and its guard around each fast test's setup
  and call (tests/fast_tier.py): the tests that need no Ray, no vLLM and no model run;
  ``@heavy_fixture`` marks the fixtures that keep a test out of it.
* ``old_run``, ``no_ray_address``: for the tests of several modules that a rejected launch.py
  command leaves a run directory as it was (with helpers.snapshot and helpers.launch_ppo).
* ``local_hub``: a stand-in for the Hugging Face hub on 127.0.0.1 serving local model
  directories in the hub's file layout, for the code paths that fetch from the hub.

Helpers that are not fixtures are in tests/helpers.py: test modules import them from there,
never from this file.

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

import fast_tier  # noqa: E402
from fast_tier import heavy_fixture  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")
    for line in fast_tier.MARKERS:
        config.addinivalue_line("markers", line)


@pytest.hookimpl(tryfirst=True)  # before -m selects: the fast marker must be there by then
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    fast_tier.mark(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with fast_tier.guard(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with fast_tier.guard(item, "call"):
        return (yield)


@pytest.fixture(scope="session")
@heavy_fixture("the tiny model, which the tests that use it run (learner, scorers, stages)")
def tiny_model_dir() -> pathlib.Path:
    from ppo_ray.tiny_model import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
@heavy_fixture("a vLLM engine")
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


# --------------------------------------------------------------------------- the learner's model
@pytest.fixture(scope="module")
@heavy_fixture("the tiny model, which the learner tests that use it run")
def tiny_path() -> str:
    from helpers import TINY_MODEL
    from ppo_ray.paths import resolve_model_path

    return resolve_model_path(TINY_MODEL)


@pytest.fixture(scope="module")
def special(tiny_path) -> tuple[int, int]:
    """(eos_token_id, pad_token_id) of the tiny model."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_path)
    assert cfg.pad_token_id != cfg.eos_token_id
    return cfg.eos_token_id, cfg.pad_token_id


@pytest.fixture(scope="module")
def attention_dropout_path(tiny_path, tmp_path_factory) -> str:
    """The tiny model with attention_dropout 0.3 in its config.json: HF's Qwen3 attention then
    drops attention weights in train mode, with no nn.Dropout layer anywhere (functional
    dropout: dropout=self.attention_dropout if self.training)."""
    import json
    import shutil

    dest = tmp_path_factory.mktemp("attention-dropout")
    shutil.copytree(tiny_path, dest, dirs_exist_ok=True)
    config = json.loads((dest / "config.json").read_text())
    assert config["attention_dropout"] == 0.0
    (dest / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    return str(dest)


# --------------------------------------------------------------------------- rejected commands
@pytest.fixture
def old_run(tmp_path) -> pathlib.Path:
    """A run directory with a previous run's files, which a rejected command must not touch."""
    run = tmp_path / "old-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config-ppo.yaml").write_text("kl_coef: 0.1\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    return run


@pytest.fixture
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture(scope="session")
@heavy_fixture("a local Ray")
def ray_session():
    """ONE local Ray instance for the whole session (no dashboard: it costs start-up time
    and tests don't read it). The tests folder is put on the workers' PYTHONPATH so reward
    functions defined in tests/reward_fns.py import inside actors, as a user's own module
    would on their cluster."""
    import os

    import ray

    from helpers import TESTS_DIR

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


@pytest.fixture(scope="session")
def tiny_trainer(ray_session, tiny_model_dir, tmp_path_factory):
    """ONE PPOTrainer (one vLLM generator actor, reference, reward and learner actors) over
    the tiny model, shared by the Ray tests of a session. Tests that step it must not
    assume a particular starting step. A FaultyTrainer (tests/fault_injection.py): unarmed it
    runs as a PPOTrainer; test_faults.py and test_sync_check.py arm its faults."""
    from fault_injection import FaultyTrainer
    from helpers import tiny_test_config

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
