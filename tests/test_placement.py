"""The Ray plumbing without a cluster: the RAY_ADDRESS check (ppo_ray.driver.cluster: a closed port, a
dashboard URL, not host:port) that init_ray and launch.py run before ray.init, which would retry
a bad address for minutes; the bundle plan (ppo_ray.driver.creation); the stages' settings
(ppo_ray.driver.stage_tasks); ppo_ray.placement's old names, re-exported from the modules that hold
them now. Fast: no Ray session.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from helpers import ROOT, TINY, snapshot, tiny_test_config
from ppo_ray.driver.creation import plan_bundles, role_demands


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------- RAY_ADDRESS (issue 5, item 10)
def test_check_ray_address():
    from ppo_ray.driver.cluster import ClusterError, check_ray_address

    port = closed_port()
    with pytest.raises(ClusterError, match=rf"no Ray cluster at RAY_ADDRESS='127.0.0.1:{port}': cannot connect"):
        check_ray_address(f"127.0.0.1:{port}")
    with pytest.raises(ClusterError, match=rf"RAY_ADDRESS='ray://127.0.0.1:{port}': cannot connect to 127.0.0.1:{port}"):
        check_ray_address(f"ray://127.0.0.1:{port}")  # the Ray client's address
    with pytest.raises(ClusterError, match="no Ray cluster at RAY_ADDRESS='no-such-host.invalid:6379'"):
        check_ray_address("no-such-host.invalid:6379")
    with pytest.raises(ClusterError, match="is a dashboard / job-submission address"):
        check_ray_address("http://127.0.0.1:8265")
    for bad in ("127.0.0.1", "127.0.0.1:port"):
        with pytest.raises(ClusterError, match="is not a host:port address"):
            check_ray_address(bad)
    with socket.socket() as server:  # something listens: passes
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")


def test_init_ray_fails_fast_without_calling_ray_init(monkeypatch):
    """ray.init on a closed port retries for minutes (still waiting after 300 s here): init_ray
    must name the address without calling it."""
    import ray

    from ppo_ray.driver import cluster

    def no_init(*a, **k):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_init)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port()}")
    with pytest.raises(cluster.ClusterError, match="no Ray cluster at RAY_ADDRESS"):
        cluster.init_ray()


def test_launch_subprocess_ray_address_nowhere(tmp_path, old_run):
    port = closed_port()
    before = snapshot(old_run)
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    # timeout: a launch.py that fell through to ray.init would retry the address for minutes
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "ppo", "--config", str(TINY),
                           "--run_dir", str(old_run)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: no Ray cluster at RAY_ADDRESS='127.0.0.1:{port}'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert snapshot(old_run) == before


# -------------------------------------------------- the bundle plan
def test_one_bundle_per_actor_that_reserves_something():
    """Ray refuses empty bundles: scorers that reserve nothing (scorer_num_cpus 0, the
    default) get bundle index -1 (any bundle of the group) and no bundle of their own."""
    config = tiny_test_config(num_generators=2, num_learners=2, generator_num_gpus=0.25,
                              learner_resources={"gpu_node": 0.01})
    demands = role_demands(config)
    assert [d.role for d in demands] == ["generator-0", "generator-1", "reference", "reward",
                                         "learner-0", "learner-1"]
    bundles, index = plan_bundles(demands)
    assert bundles == [{"CPU": 1.0, "GPU": 0.25}] * 2 + [{"CPU": 1.0, "gpu_node": 0.01}] * 2
    assert index == [0, 1, -1, -1, 2, 3]
    bundles, index = plan_bundles(role_demands(config.replace(scorer_num_gpus=0.1)))
    assert bundles[2:4] == [{"GPU": 0.1}] * 2 and index == [0, 1, 2, 3, 4, 5]
    # nothing reserved at all: one tiny anchor bundle, every actor in "any bundle"
    nothing = tiny_test_config(generator_num_cpus=0, learner_num_cpus=0)
    assert plan_bundles(role_demands(nothing)) == ([{"CPU": 1e-4}], [-1, -1, -1, -1])


# -------------------------------------------------- roles, bundles, splits, stage settings
def test_a_demands_bundle_drops_what_it_does_not_reserve():
    from ppo_ray.driver.creation import Demand

    assert Demand("reward", 0.0, 0.5, {"gpu_node": 0.0, "big": 1.0}).bundle() == {"GPU": 0.5, "big": 1.0}
    assert Demand("reference", 0.0, 0.0, {}).bundle() == {}


def test_stage_settings_take_the_configs_stage_fields():
    from ppo_ray.config import PPOConfig
    from ppo_ray.driver.stage_tasks import stage_settings

    config = PPOConfig(stage_batch_size=8, seed=5, dtype="bfloat16", micro_batch_size=2)
    s = stage_settings(config, epochs=3, learning_rate=2e-5)
    assert (s.epochs, s.learning_rate, s.batch_size, s.seed, s.micro_batch_size) == (3, 2e-5, 8, 5, 2)
    assert s.dtype == s.save_dtype == "bfloat16"  # stage_dtype unset: the run's dtype
    fp32 = stage_settings(config.replace(stage_dtype="float32"), 1, 1e-4)
    assert (fp32.dtype, fp32.save_dtype) == ("float32", "bfloat16")  # trains in fp32, saved as PPO loads it
    assert stage_settings(config.replace(stage_micro_batch_size=1), 1, 1e-4).micro_batch_size == 1


# -------------------------------------------------- ppo_ray.placement: the old names
# Every public name of the single module placement.py was, by the module that holds it now.
OLD_NAMES = {
    "cluster": ["ClusterError", "init_ray", "check_ray_address", "keep_actor_lines_off_the_console"],
    "shipping": ["ShippedModel", "ModelStore", "ship_model", "local_model_dir", "group_nodes", "prepare_models"],
    "hosts": ["GeneratorHost", "ReferenceHost", "RewardHost", "LearnerHost", "HOSTS", "CPU_SHARE_ENV", "MALLOC_ENV",
              "cpu_share_env"],
    "reward_pool": ["RewardWorkerPool"],
    "creation": ["Demand", "role_demands", "plan_bundles", "reserve", "create_roles", "wait_ready"],
    "stage_tasks": ["stage_settings", "run_stage"],
}


def test_placement_re_exports_every_old_name_from_its_new_module():
    """`from ppo_ray.placement import X` keeps working for every name it had, and X is the new
    module's object itself (a subclass of a host, a patched function: one object, not a copy);
    classes and functions are defined in their new module (that is the path they pickle under)."""
    import importlib

    from ppo_ray import placement

    assert sorted(placement.__all__) == sorted(n for names in OLD_NAMES.values() for n in names)
    for module, names in OLD_NAMES.items():
        new = importlib.import_module(f"ppo_ray.driver.{module}")
        for name in names:
            assert getattr(placement, name) is getattr(new, name), (module, name)
            if callable(getattr(new, name)) and hasattr(getattr(new, name), "__module__"):
                assert getattr(new, name).__module__ == f"ppo_ray.driver.{module}", (module, name)


def test_a_pickle_that_names_the_old_module_still_loads():
    """A ShippedModel pickled before the split names ppo_ray.placement.ShippedModel; it loads
    into the same class (ppo_ray.driver.shipping's). Protocol 2 writes the class as a text GLOBAL, so the
    old pickle is the new one with the module name swapped."""
    import pickle

    from ppo_ray.driver.shipping import ShippedModel

    model = ShippedModel("/models/m", "node-1", "abc123", {})
    new = pickle.dumps(model, protocol=2)
    assert b"cppo_ray.driver.shipping\nShippedModel\n" in new
    old = new.replace(b"cppo_ray.driver.shipping\nShippedModel\n", b"cppo_ray.placement\nShippedModel\n")
    assert old != new and pickle.loads(old) == model and type(pickle.loads(old)) is ShippedModel
