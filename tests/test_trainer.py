"""The PPO loop on real Ray actors, the real vLLM engine and real PEFT LoRA (tiny model).

One PPOTrainer is shared by the module (fixture tiny_trainer); tests are written so their
order does not matter except where noted (agreement before any step is checked on the
fresh trainer, so it is first in the file and pytest runs files in order).
"""

from __future__ import annotations

import math
import os

import pytest
import ray
import torch

from ppo_ray.batch import RolloutBatch
from ppo_ray.stats import GenerateRequest
from helpers import on_actor, tiny_test_config
from tolerances import TINY_LOGPROB_TOL
from ppo_ray.data import bundled_prompts, encode_prompts

pytestmark = pytest.mark.usefixtures("ray_session")


def _generate(trainer, prompts, step=10_000):
    ids = encode_prompts(trainer.tokenizer, prompts, trainer.config.max_prompt_length, "left")
    batch_ref, _ = trainer.roles.generators[0].generate.remote(ids, GenerateRequest(step))
    return batch_ref


def _assert_generator_matches_learner(trainer):
    batch_ref = _generate(trainer, bundled_prompts()[:8])
    batch: RolloutBatch = ray.get(batch_ref)
    learner_lp = on_actor(trainer.roles.learner, lambda host, batch: host.learner.rollout_scores(batch, logprobs=True).logprobs.cpu(), batch_ref)
    assert batch.adapter_version == trainer.version
    diff = (learner_lp - batch.gen_logprobs).abs()[batch.response_mask]
    assert diff.numel() > 0 and diff.max() < TINY_LOGPROB_TOL, f"max |generator - learner| logprob = {diff.max():.2e}"


@pytest.mark.equality
def test_generator_and_learner_agree_at_the_current_version(tiny_trainer):
    """Before any sync when this module runs first; the session trainer may have been
    stepped by earlier modules (e.g. test_benchmarks), and the agreement must hold at any
    version."""
    assert tiny_trainer.version == ray.get(tiny_trainer.roles.learner.version.remote())
    _assert_generator_matches_learner(tiny_trainer)


@pytest.mark.equality
def test_three_steps_end_to_end(tiny_trainer):
    prompts = bundled_prompts()[:8]
    for _ in range(3):
        before = tiny_trainer.version
        out = tiny_trainer.ppo_step(prompts)
        assert out["adapter_version"] == before + 1 == tiny_trainer.version
        for key in ("policy_loss", "value_loss", "kl", "approx_kl", "clipfrac", "entropy", "reward_mean"):
            assert math.isfinite(out[key]), key
        assert len(out["generated_texts"]) == len(out["rewards"]) == len(prompts)
        # ratio == 1 on the first minibatch (float32, lora_dropout 0): old logprobs are the
        # policy's own, recomputed with the generator's temperature and top-k/top-p.
        assert abs(out["first_minibatch_ratio_mean"] - 1.0) < TINY_LOGPROB_TOL
        # the generator that will sample the next step holds the learner's version
        versions = ray.get([g.version.remote() for g in tiny_trainer.roles.generators])
        assert versions == [ray.get(tiny_trainer.roles.learner.version.remote())] == [tiny_trainer.version]
        # every phase was timed (a phase left at 0 or NaN was not), and none outlasts the step
        for phase in ("generate", "reference", "reward", "learner_forward", "update", "sync", "sync_check"):
            assert 0 < out[f"time/{phase}_s"] < out["time/step_s"], phase
        # throughput (StepResult.rates): each phase's tokens and the learner's model FLOPs
        # (learner/flops.py, counted on this step's real tokens) per second of that phase
        assert out["rollout_tokens_per_s"] == pytest.approx(out["response_tokens"] / out["time/generate_s"])
        assert out["learner_tokens_per_s"] == pytest.approx(out["tokens"] / out["time/update_s"])
        assert out["learner_flops"] > 0
        assert out["learner_flops_per_s"] == pytest.approx(out["learner_flops"] / out["time/update_s"])
        # the CPU's peak: a measured matmul rate (a GPU's: its datasheet's, NaN for one not listed)
        if math.isfinite(out["learner_peak_flops_per_s"]) or tiny_trainer.config.learner_num_gpus == 0:
            assert out["learner_peak_flops_per_s"] > 0
            assert out["learner_mfu"] == pytest.approx(out["learner_flops_per_s"] / out["learner_peak_flops_per_s"])
        assert out["queue_depth"] == 0.0  # the synchronous step generates its own rollouts
    _assert_generator_matches_learner(tiny_trainer)  # after syncs too


def _actor_logs(logs_dir, actor_name: str) -> str:
    """The text of the worker-*.err files Ray wrote for the actor named `actor_name` (its
    `:actor_name:` line holds repr(actor), the hosts' Ray name)."""
    out = []
    for path in sorted(logs_dir.glob("worker-*.err")) + sorted(logs_dir.glob("old/worker-*.err")):
        text = path.read_text(errors="replace")
        if f":actor_name:{actor_name}\n" in text:
            out.append(text)
    return "\n".join(out)


def test_each_actor_logs_a_line_per_call_in_its_own_log_and_not_on_the_console(tiny_trainer, capfd):
    """Each actor is named <run tag>/<role>, and its Ray log file (the dashboard's per-actor
    Log) gets one INFO line per call: tokens and seconds (generator), losses (learner), rows
    (scorers), the training calls labelled by their step. Ray forwards those files to the driver too, which drops these lines: the
    console stays one line per step."""
    import sys
    import time
    from pathlib import Path

    from ppo_ray.logs import ACTOR_MARK
    from ppo_ray.driver.roles import role_names

    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
    before = tiny_trainer.version
    tiny_trainer.ppo_step(bundled_prompts()[:8])
    expected = {"generator-0": f"step {tiny_trainer.step}: 8 rollouts with adapter v{before}, ",
                "reference": f"reference logprobs: 8 rollouts of adapter v{before}, ",
                "reward": f"step {tiny_trainer.step}: scored 8 rollouts of adapter v{before}: reward ",
                "learner": f"update to adapter v{before + 1}: "}
    assert set(expected) == set(role_names(1, 1))
    missing = dict(expected)
    deadline = time.monotonic() + 30  # the worker's stderr is line-buffered; this only bounds a hang
    while missing and time.monotonic() < deadline:
        for role, text in list(missing.items()):
            if any(ACTOR_MARK + text in line for line in _actor_logs(logs_dir, f"{tiny_trainer.namespace}/{role}")
                   .splitlines()):
                del missing[role]
        time.sleep(0.2)
    assert not missing, f"no line {missing} in the actors' logs under {logs_dir}"
    learner_log = _actor_logs(logs_dir, f"{tiny_trainer.namespace}/learner")
    assert "policy_loss" in learner_log and "value_loss" in learner_log
    # Each actor now writes a marker after its lines; Ray forwards a file's lines in order,
    # so once every marker reached the console, every per-call line had its chance to.
    marker = f"ppo-test-marker-{before}"
    for actor in tiny_trainer.roles.all():
        on_actor(actor, lambda host, text: print(text, file=sys.stderr, flush=True), marker)
    console = ""
    while console.count(marker) < len(tiny_trainer.roles.all()) and time.monotonic() < deadline + 30:
        out = capfd.readouterr()
        console += out.out + out.err
        time.sleep(0.2)
    assert console.count(marker) == len(tiny_trainer.roles.all()), console[-2000:]
    assert ACTOR_MARK not in console


@pytest.mark.equality
def test_sync_changes_generation(tiny_trainer):
    """After a step, the generator's logprobs of a FIXED continuation equal the learner's
    for the new weights (not the old ones, not the base model's)."""
    tok = tiny_trainer.tokenizer
    prompt = tok("SUBREDDIT: r/cooking\n\nTITLE: burnt rice\n\nPOST: help\n\nTL;DR:")["input_ids"]
    cont = tok(" I burn the rice every time because the heat is too high" + tok.eos_token)["input_ids"]
    fixed = RolloutBatch(
        prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.bool),
        response_ids=torch.tensor([cont]), response_mask=torch.ones(1, len(cont), dtype=torch.bool),
        gen_logprobs=torch.zeros(1, len(cont)), adapter_version=tiny_trainer.version,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    generator = tiny_trainer.roles.generators[0]

    def sequence_logprobs(host, prompt_ids, continuation_ids):
        return host.generator.sequence_logprobs(prompt_ids, continuation_ids)

    gen_before = on_actor(generator, sequence_logprobs, prompt, cont)
    tiny_trainer.ppo_step(bundled_prompts()[8:16])
    gen_after = on_actor(generator, sequence_logprobs, prompt, cont)
    # vLLM's prompt logprobs are raw log_softmax (temperature 1, no truncation); the tiny
    # config samples at temperature 1.0, so the learner's full logprobs are the same quantity.
    assert tiny_trainer.config.temperature == 1.0
    learner = tiny_trainer.roles.learner
    learner_after = on_actor(learner, lambda host, batch: host.learner.rollout_scores(batch, full=True).full_logprobs.cpu(), fixed)[0]
    ref_logprobs, _ = ray.get(tiny_trainer.roles.reference.logprobs.remote(fixed))
    base = ref_logprobs[0]
    assert (gen_after - learner_after).abs().max() < TINY_LOGPROB_TOL
    assert (gen_after - gen_before).abs().max() > 1e-3, "the sync did not change the generator's policy"
    assert (gen_after - base).abs().max() > 1e-3, "the generator still serves the base model"


def test_cpu_only_actors_take_the_cores_by_default(tiny_trainer):
    """Issue 33: the tests' config sets no *_num_cpus, so on this CPU-only machine the
    generator's (vLLM's in-process CPU engine computes on them) and the learner's torch threads
    are every core the actor may run on and each scorer's half of them (the reference and reward
    run at the same time): not Ray's 1 thread per reserved CPU."""
    roles = tiny_trainer.roles
    assert tiny_trainer.config.learner_num_cpus is None and not tiny_trainer.config.uses_gpus
    cores = on_actor(roles.learner, lambda host: len(os.sched_getaffinity(0)))
    threads = ray.get([actor.torch_threads.remote()
                       for actor in (roles.generators[0], roles.learner, roles.reference, roles.reward)])
    assert threads == [cores, cores, max(1, cores // 2), max(1, cores // 2)]


def test_cpu_only_actors_keep_the_memory_malloc_frees(tiny_trainer):
    """Issue 33, cpu_malloc_keep (on by default): every actor of a CPU-only run starts with
    glibc malloc's settings in its environment (the driver's own values win)."""
    from ppo_ray.driver.hosts import MALLOC_ENV

    assert tiny_trainer.config.cpu_malloc_keep and not tiny_trainer.config.uses_gpus
    want = {key: os.environ.get(key, value) for key, value in MALLOC_ENV.items()}
    for actor in tiny_trainer.roles.all():
        assert on_actor(actor, lambda host: {key: os.environ.get(key) for key in MALLOC_ENV}) == want


def test_bad_prompts_fail_clearly_and_leave_state_intact(tiny_trainer):
    version = tiny_trainer.version
    with pytest.raises(ValueError, match="no prompts"):
        tiny_trainer.ppo_step([])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        tiny_trainer.ppo_step(["SUBREDDIT: r/a\n\nTITLE: b\n\nPOST: c\n\nTL;DR:", "   "])
    with pytest.raises(ValueError, match=r"prompt 0 is \d+ tokens long, over max_prompt_length=400"):
        tiny_trainer.ppo_step(["word " * 2000])
    assert tiny_trainer.version == version
    out = tiny_trainer.ppo_step(bundled_prompts()[:4])  # still works afterwards
    assert out["adapter_version"] == version + 1


def test_ppo_learns_a_simple_reward(tiny_trainer):
    """letter_e_fraction (share of 'e' in the completion): mean reward rises clearly, from the
    untrained policy (the shared trainer is first put back to its initial state, so what other
    tests did to it does not matter)."""
    tiny_trainer.restore(tiny_trainer.initial_checkpoint)
    assert tiny_trainer.step == 0 and tiny_trainer.version == 0
    history = tiny_trainer.train(bundled_prompts(), steps=24, progress=False)
    rewards = [h["reward_mean"] for h in history]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.03 and last > 1.3 * first, f"reward did not rise: {rewards}"
    assert all(math.isfinite(h["kl"]) for h in history)


@pytest.mark.parametrize("fn,match", [
    ("reward_fns:raises", r"reward function 'reward_fns:raises' raised RuntimeError"),
    ("reward_fns:wrong_length", r"returned 9 values for 8 prompts"),
    ("reward_fns:nan_at_two", r"non-finite score nan for prompt index 2"),
    ("reward_fns:not_numbers", r"must return a list of 8 numbers"),
])
def test_bad_reward_functions_are_named(tiny_trainer, fn, match):
    """A reward actor with a misbehaving function, fed the trainer's real rollouts."""
    from ppo_ray.driver.hosts import RewardHost
    from ppo_ray.rewards import RewardError

    host = ray.remote(RewardHost).remote(tiny_trainer.config.replace(reward_funcs=[fn]), None)
    batch_ref = _generate(tiny_trainer, bundled_prompts()[:8])
    scores_ref, _ = host.score.remote(batch_ref)
    with pytest.raises(RewardError, match=match):
        ray.get(scores_ref)
    ray.kill(host)


@pytest.mark.equality
@pytest.mark.slow  # ~75 s; overlap with a fault runs by default in tests/test_faults.py
def test_overlap_mode_with_merged_sync(ray_session, tiny_model_dir):
    """max_staleness 1: step k+1 is generated while the learner trains on step k, so from
    step 2 on the rollouts are one adapter version behind and the ratio is taken against the
    generator's (behaviour) logprobs. The generator runs lora_sync="merged" (the LoRA merged
    into its weights; one engine start for both features): its logprobs agree with the
    learner's PEFT forward."""
    from ppo_ray.trainer import PPOTrainer

    trainer = PPOTrainer(tiny_test_config(max_staleness=1, lora_sync="merged", steps=4))
    try:
        history = trainer.train(bundled_prompts(), progress=False)
        assert trainer.version == 4 and ray.get([g.version.remote() for g in trainer.roles.generators]) == [4]
    finally:
        trainer.shutdown()
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [h["adapter_version"] for h in history] == [1, 2, 3, 4]
    assert [h["stale_versions"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    assert history[0]["first_minibatch_ratio_mean"] == pytest.approx(1.0, abs=TINY_LOGPROB_TOL)
    assert history[0]["behaviour_logprob_gap"] < TINY_LOGPROB_TOL
    assert history[0]["gen_logprob_max_abs_diff"] < TINY_LOGPROB_TOL  # merged vLLM weights vs PEFT
    assert all(h["behaviour_logprob_gap"] > TINY_LOGPROB_TOL for h in history[1:])  # one version apart
    assert all(math.isfinite(h["kl"]) and math.isfinite(h["policy_loss"]) for h in history)


@pytest.mark.equality
def test_old_logprobs_from_the_generator(ray_session, tiny_model_dir):
    """old_logprobs: generator on the real system: between checks the learner takes vLLM's
    logprobs as the old policy's (no generator-vs-learner gap is measured: NaN), and they
    are the policy's own: the first minibatch's ratio, the learner's training forward over
    vLLM's logprobs, is 1 to float32 agreement. At the checks (versions 0 and 2) the
    learner recomputes and the guard runs (logprob_gap_check: error)."""
    from ppo_ray.trainer import PPOTrainer

    trainer = PPOTrainer(tiny_test_config(old_logprobs="generator", old_logprobs_check_every=2, top_k=0, top_p=1.0,
                                          steps=3))
    try:
        history = trainer.train(bundled_prompts(), progress=False)
    finally:
        trainer.shutdown()
    # a normal end: every actor exited on its own (what the dashboard shows), none was killed
    import time

    from ppo_ray.driver.roles import role_names

    names = {f"{trainer.namespace}/{role}" for role in role_names(1, 1)}
    deadline = time.monotonic() + 30
    while True:
        causes = {a["Name"]: (a["State"], str(a.get("DeathCause"))) for a in ray._private.state.actors().values()
                  if a["Name"] in names}
        if all(state == "DEAD" for state, _ in causes.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(causes) == names and all(state == "DEAD" and "INTENDED_USER_EXIT" in cause and "ray.kill" not in cause
                                        for state, cause in causes.values()), causes
    assert [h["adapter_version"] for h in history] == [1, 2, 3]
    gaps = [h["gen_logprob_max_abs_diff"] for h in history]
    assert gaps[0] < TINY_LOGPROB_TOL and math.isnan(gaps[1]) and gaps[2] < TINY_LOGPROB_TOL, gaps
    for h in history:
        assert h["first_minibatch_ratio_mean"] == pytest.approx(1.0, abs=TINY_LOGPROB_TOL)
        assert math.isfinite(h["kl"]) and math.isfinite(h["policy_loss"]) and h["entropy"] > 0


def test_the_logprob_guard_stops_or_warns(tiny_trainer, caplog):
    """The generator-vs-learner check: a gap above the tolerance is an error naming the step
    and the sync mode (the learner, which had already stepped, is put back: the trainer stays
    at its version), or a warning. A tolerance below float32 agreement (~5e-6) trips it."""
    from ppo_ray.trainer import LogprobGapError

    base = tiny_trainer.config
    version = tiny_trainer.version
    try:
        tiny_trainer.config = base.replace(logprob_gap_tolerance=1e-12, logprob_gap_check="error")
        with pytest.raises(LogprobGapError, match=rf"step {tiny_trainer.step + 1}: .* lora_sync={base.lora_sync_mode}"):
            tiny_trainer.ppo_step(bundled_prompts()[:4])
        assert tiny_trainer.version == version
        assert ray.get(tiny_trainer.roles.learner.version.remote()) == version
        tiny_trainer.config = base.replace(logprob_gap_tolerance=1e-12, logprob_gap_check="warn")
        with caplog.at_level("WARNING", logger="ppo_ray.trainer"):
            out = tiny_trainer.ppo_step(bundled_prompts()[:4])
        assert out["adapter_version"] == version + 1
        assert "differ from the learner's" in caplog.text
    finally:
        tiny_trainer.config = base
    assert base.logprob_gap_check == "error" and base.logprob_gap_limit == 1e-3  # what the other tests run with
