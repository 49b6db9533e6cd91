"""ppo_ray/deadlines.py and the waiting in ppo_ray/driver/roles.py: every call the driver makes to an
actor has a deadline; past it the actor is killed (Ray restarts it) and CallTimeout names the
call and the actor, which the supervisor's rule treats as the actor's death.

- the rule itself (Deadlines), without Ray;
- Roles' waiting on stand-in Ray actors (plain actors with the methods Roles calls, no model):
  the hung call's actor is the one killed and named, also when the call the driver waits for
  takes the hung call's results or is queued behind it on the same actor;
- the real system (test_a_hanging_reward_function_*): a PPOTrainer on the tiny model (vLLM
  generator, HF scorers, PEFT learner) whose reward function hangs, in the reward actor, with
  the inline default (reward_workers 0): the step is retried and the run goes on, equal to a
  run without the hang; one that always hangs stops the run with an error naming the call
  and the actor. And (slow) a generator that stops answering.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import ray

from ppo_ray.deadlines import CALL_KINDS, CallTimeout, Deadlines
from ppo_ray.driver.roles import RETRYABLE, Roles
from ppo_ray.stats import GenerateRequest


# ----------------------------------------------------------------------------- the rule
def test_first_calls_and_later_calls_each_keep_their_own_pace():
    d = Deadlines(factor=10.0, min_s=5.0, first_s=100.0)
    assert d.limit("generate", "generator-0", 8)[0] == 100.0   # nothing measured: call_timeout_first_s
    d.record("generate", "generator-0", 40.0, 8)                # its first call (a warm-up): 5 s per row
    assert d.first_rates == {"generate": 5.0} and d.rates == {}
    assert d.limit("generate", "generator-0", 8)[0] == 400.0   # no later call yet: the first call's pace
    assert d.limit("generate", "generator-1", 8)[0] == 400.0   # another replica's first call, by the same pace
    d.record("generate", "generator-0", 2.0, 8)                 # a later call: 0.25 s per row
    limit, rule = d.limit("generate", "generator-0", 8)
    assert limit == 20.0 and "call_timeout_factor 10" in rule and "0.25 s per row" in rule
    assert d.limit("generate", "generator-0", 80)[0] == 200.0  # scales with the rows
    assert d.limit("generate", "generator-0", 1)[0] == 5.0     # never under the floor
    d.record("generate", "generator-0", 1.0, 8)                 # a faster call keeps the slowest pace
    assert d.rates["generate"] == 0.25
    assert d.limit("generate", "generator-1", 8)[0] == 400.0   # still cold: first calls' pace
    d.restarted("generator-0")                                  # a restart: its next call is a first call
    assert d.limit("generate", "generator-0", 8)[0] == 400.0
    assert "first call of an actor" in d.limit("generate", "generator-0", 8)[1]
    assert "call_timeout_first_s" in d.limit("score", "reward", 8)[1]


def test_bad_values_and_kinds_are_named():
    with pytest.raises(ValueError, match="Deadlines.min_s"):
        Deadlines(min_s=0.0)
    with pytest.raises(ValueError, match="call kind 'decode'"):
        Deadlines().limit("decode", "generator-0", 1)


def test_a_call_timeout_names_the_call_and_the_actor_and_is_retried_like_a_death():
    error = CallTimeout("score", ["reward"], 12.0, 10.0, "call_timeout_min_s 10")
    assert isinstance(error, RETRYABLE) and error.role == "reward"
    assert "reward actor" in str(error) and "score call" in str(error) and CALL_KINDS["score"] in str(error)


# ----------------------------------------------------------------------------- Roles' waiting, stand-in actors
@ray.remote(max_restarts=1, max_task_retries=0)
class StandIn:
    """An actor with the methods Roles calls; `hang_file`: while it exists, generate and score
    block (a call that never returns)."""

    def __init__(self, hang_file: str, hang_at_start: bool = False):
        self.hang_file = hang_file
        if hang_at_start:
            self._maybe_hang()

    def _maybe_hang(self):
        while os.path.exists(self.hang_file):
            threading.Event().wait(0.05)

    @ray.method(num_returns=2)
    def generate(self, prompt_ids, request):
        self._maybe_hang()
        return [len(p) for p in prompt_ids], {"rows": len(prompt_ids)}

    @ray.method(num_returns=2)
    def score(self, *parts, label="", columns=None):
        self._maybe_hang()
        return [float(sum(p)) for p in parts], {"label": label}

    def work(self):
        self._maybe_hang()
        return os.getpid()

    def pid(self):
        return os.getpid()


@pytest.fixture
def stand_ins(ray_session, tmp_path):
    """Roles over stand-in actors (generator-0, generator-1, reference, reward, learner) with
    short deadlines; `hang(name)` makes that actor's calls block until its restart clears it."""
    files = {name: str(tmp_path / f"hang-{name}") for name in ("generator-0", "generator-1", "reference", "reward",
                                                               "learner")}
    actors = {name: StandIn.remote(path) for name, path in files.items()}
    roles = Roles([actors["generator-0"], actors["generator-1"]], actors["reference"], actors["reward"],
                  [actors["learner"]], deadlines=Deadlines(factor=10.0, min_s=2.0, first_s=3.0))
    pids = {name: ray.get(a.pid.remote()) for name, a in actors.items()}

    def hang(name: str) -> None:
        Path(files[name]).touch()

    yield roles, hang, files, pids
    for path in files.values():
        Path(path).unlink(missing_ok=True)
    for a in actors.values():
        ray.kill(a, no_restart=True)


def _restarted(roles, name: str, files, pids) -> bool:
    """Clear the hang and say whether `name`'s actor now runs in another process. The hang is
    cleared once every actor answers again (ray.kill is asynchronous: cleared first, a hung call
    could still return before its kill lands)."""
    roles.wait_for_actors(timeout_s=120)
    Path(files[name]).unlink(missing_ok=True)
    return ray.get(roles.actor(name).pid.remote()) != pids[name]


def test_a_call_past_its_deadline_has_its_actor_killed_and_named(stand_ins, caplog):
    roles, hang, files, pids = stand_ins
    generation = roles.generate([[1, 2], [3]], GenerateRequest(0))
    assert roles.fetch(generation.summaries) == [{"rows": 1}, {"rows": 1}]  # in time
    hang("generator-1")
    generation = roles.generate([[1, 2], [3]], GenerateRequest(1))
    with caplog.at_level(logging.WARNING, logger="ppo_ray.trainer"):
        with pytest.raises(CallTimeout, match="generator-1 actor did not finish generate call") as error:
            roles.fetch(generation.summaries)
    # its first call set the pace of first calls; this one, its second, is held to it (or the floor)
    assert error.value.roles == ["generator-1"] and error.value.limit_s == 2.0
    assert "past its deadline" in caplog.text
    assert _restarted(roles, "generator-1", files, pids)
    assert not _restarted(roles, "generator-0", files, pids)  # the replica that answered is left alone
    assert not roles.intact(generation)  # the hung call's results died with it


def test_a_hang_is_blamed_on_the_call_that_hangs_not_on_the_one_that_takes_its_results(stand_ins):
    roles, hang, files, pids = stand_ins
    hang("generator-0")
    generation = roles.generate([[1], [2]], GenerateRequest(0))
    scores, _ = roles.score(generation.parts, seed_step=0)
    with pytest.raises(CallTimeout, match="generator-0") as error:
        roles.fetch(scores)
    assert error.value.kind == "generate"
    assert _restarted(roles, "generator-0", files, pids)
    assert not _restarted(roles, "reward", files, pids)
    # the score call failed on its lost input, seen only now (after the recovery): no pace
    roles._wait([scores])
    assert roles._calls[scores].done is not None
    assert "score" not in roles.deadlines.first_rates and "score" not in roles.deadlines.rates


def test_a_call_queued_behind_a_hung_one_on_the_same_actor_blames_the_hung_one(stand_ins):
    """The reward actor runs one call at a time: a call behind a hung one waits for it, and
    the deadline that runs out is the hung call's (another kind here, so the two are told apart)."""
    roles, hang, files, pids = stand_ins
    hang("reward")
    reward = roles.reward
    roles._track("sync", reward, reward.work.remote())      # hangs
    queued = roles._track("query", reward, reward.work.remote())
    with pytest.raises(CallTimeout) as error:
        roles.fetch(queued)
    assert error.value.roles == ["reward"] and error.value.kind == "sync"
    assert _restarted(roles, "reward", files, pids)


def test_calls_that_share_their_dependencies_are_waited_for_together(stand_ins):
    """Two calls that take the same generations (the reference's and the reward's, every step):
    waited for at once, each dependency is waited for once (ray.wait refuses a ref twice)."""
    roles, _, _, _ = stand_ins
    generation = roles.generate([[1], [2]], GenerateRequest(0))
    after = [*generation.parts, *generation.summaries]
    first = roles._track("query", roles.reference, roles.reference.work.remote(), after=after)
    second = roles._track("query", roles.reward, roles.reward.work.remote(), after=after)
    assert len(set(roles.fetch([first, second]))) == 2


def test_a_call_that_fails_is_raised_at_once_while_its_sibling_still_runs(stand_ins):
    """fetch of two calls, one of whose actors dies while the other's call goes on (a partial
    rollout's next segment waits for a version only the driver's next call brings): the death
    is raised at once, as ray.get raises it, not at the running call's deadline."""
    roles, hang, files, pids = stand_ins
    roles.deadlines = Deadlines(factor=10.0, min_s=60.0, first_s=60.0)
    hang("generator-0")
    hang("generator-1")
    generation = roles.generate([[1], [2]], GenerateRequest(0))
    ray.kill(roles.actor("generator-1"), no_restart=False)  # in its call
    # the death itself: waited for until the hung sibling's deadline, it would be a CallTimeout
    with pytest.raises(ray.exceptions.RayActorError):
        roles.fetch(generation.summaries)
    Path(files["generator-1"]).unlink()
    Path(files["generator-0"]).unlink()
    assert roles.fetch(generation.summaries[0]) == {"rows": 1}  # the sibling's call, finished in its own time


def test_calls_in_time_set_the_pace_after_each_actors_first(stand_ins):
    roles, _, _, _ = stand_ins
    for step in range(3):
        generation = roles.generate([[1], [2], [3], [4]], GenerateRequest(step))
        roles.fetch(roles.score(generation.parts, seed_step=step)[0])
    d = roles.deadlines
    assert {("generate", "generator-0"), ("generate", "generator-1"), ("score", "reward")} <= d.warm
    assert set(d.rates) == {"generate", "score"}
    # a call of the reward actor takes the rows of the batches it scores
    generation = roles.generate([[1]] * 6, GenerateRequest(9))
    scores, _ = roles.score(generation.parts, seed_step=9)
    assert roles._calls[scores].rows == 6
    roles.fetch(scores)


def test_an_actor_whose_start_hangs_is_named_within_the_first_calls_deadline(ray_session, tmp_path):
    from ppo_ray.driver.cluster import ClusterError
    from ppo_ray.driver.creation import wait_ready

    hang = tmp_path / "hang"
    hang.touch()
    names = ("generator-0", "reference", "reward", "learner")
    actors = {name: StandIn.options(max_restarts=0).remote(str(hang), hang_at_start=name == "reward")
              for name in names}
    roles = Roles([actors["generator-0"]], actors["reference"], actors["reward"], [actors["learner"]],
                  deadlines=Deadlines(first_s=3.0))
    # the others started first (a loaded machine may take seconds to start any actor)
    ray.get([actors[name].pid.remote() for name in names if name != "reward"])
    with pytest.raises(ClusterError, match=r"actor ppo/reward did not start within call_timeout_first_s \(3 s\)"):
        wait_ready(roles)
    hang.unlink()


# ----------------------------------------------------------------------------- the real system
STEPS_BEFORE, STEPS_AFTER = 2, 2  # the hang comes at step 3: steps 1-2 measure every call's pace
KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "approx_kl", "clipfrac", "entropy", "adapter_version",
        "response_tokens", "generated_texts")


@pytest.fixture(scope="module")
def hang_trainer(ray_session, tiny_model_dir, tmp_path_factory):
    """A trainer of its own (the session's has another reward function) whose reward function
    hangs while reward_fns.hang_file() exists; short deadlines (the first calls keep a long
    one: they warm the engine up); a snapshot at step 0 and the straight run from it."""
    from helpers import tiny_test_config
    from fault_injection import FaultyTrainer
    from ppo_ray.data import bundled_prompts
    from reward_fns import hang_file

    hang_file().unlink(missing_ok=True)
    config = tiny_test_config(reward_funcs=["reward_fns:e_fraction_or_hang"], call_timeout_min_s=5.0,
                              call_timeout_first_s=600.0, max_step_retries=1, max_actor_restarts=20)
    trainer = FaultyTrainer(config)
    try:
        assert (trainer.roles.deadlines.min_s, trainer.roles.deadlines.first_s) == (5.0, 600.0)  # from the config
        trainer.run_dir = tmp_path_factory.mktemp("hang-snapshot")
        snapshot = trainer.save_checkpoint()
        trainer.run_dir = None
        prompts = bundled_prompts()
        straight = trainer.train(prompts, steps=STEPS_BEFORE, progress=False) \
            + trainer.train(prompts, steps=STEPS_AFTER, progress=False)
        yield trainer, snapshot, straight
    finally:
        hang_file().unlink(missing_ok=True)
        trainer.shutdown(graceful=False)


def _with_hang(trainer, snapshot, start_hang) -> list:
    """The straight run's steps again from the snapshot, the hang started before step 3."""
    from ppo_ray.data import bundled_prompts

    trainer.restore(snapshot)
    prompts = bundled_prompts()
    history = trainer.train(prompts, steps=STEPS_BEFORE, progress=False)
    start_hang()
    try:
        return history + trainer.train(prompts, steps=STEPS_AFTER, progress=False)
    finally:
        trainer.inject_faults([])


def _same_steps(got, want) -> None:
    from exact import assert_same

    assert_same([{k: h[k] for k in KEYS} for h in got], [{k: h[k] for k in KEYS} for h in want], "hang vs straight")


HANGS = {
    # the inline default (reward_workers 0): a Python function in the reward actor's thread
    "reward function": ("reward", lambda trainer: __import__("reward_fns").hang_file().write_text("once")),
    "generator": ("generator-0", lambda trainer: trainer.inject_faults(
        [__import__("fault_injection").Fault("generator-0", trainer.step + 1, "generate", "hang")])),
}


@pytest.mark.parametrize("what", [pytest.param("reward function"),
                                  pytest.param("generator", marks=pytest.mark.slow)])
def test_a_hung_call_is_cut_by_its_deadline_and_the_step_retried_as_if_it_had_not_hung(hang_trainer, what, caplog):
    from exact import rerun_if_last_digits_differ

    trainer, snapshot, straight = hang_trainer
    role, start_hang = HANGS[what]

    @rerun_if_last_digits_differ
    def case():
        before = len(trainer.retries)
        with caplog.at_level(logging.WARNING, logger="ppo_ray.trainer"):
            got = _with_hang(trainer, snapshot, lambda: start_hang(trainer))
        assert trainer.retries[before:] == [{"step": STEPS_BEFORE + 1, "role": role, "where": "step"}]
        assert f"the {role} actor's" in caplog.text and "past its deadline" in caplog.text
        _same_steps(got, straight)

    case()


def test_a_call_that_hangs_on_every_retry_stops_the_run_naming_the_call_and_the_actor(hang_trainer):
    from ppo_ray.data import bundled_prompts
    from reward_fns import hang_file

    trainer, snapshot, _ = hang_trainer
    trainer.restore(snapshot)
    trainer.train(bundled_prompts(), steps=STEPS_BEFORE, progress=False)
    before = len(trainer.retries)
    hang_file().write_text("always")
    try:
        with pytest.raises(CallTimeout, match=r"the reward actor did not finish score call") as error:
            trainer.train(bundled_prompts(), steps=1, progress=False)
    finally:
        hang_file().unlink(missing_ok=True)
    assert error.value.kind == "score" and error.value.roles == ["reward"]
    assert [r["role"] for r in trainer.retries[before:]] == ["reward"] * trainer.config.max_step_retries
    assert trainer.step == STEPS_BEFORE  # nothing committed
