"""Multi-turn episodes (ppo_ray.environments) through the real vLLM engine (Generator.generate_episodes):
the transcript is token-exact (the ids trained on are the ids sampled, each observation
tokenised once and appended), the sampled tokens' logprobs are the policy's on the whole
transcript as context (HF's forward over it), episodes replay by (step, prompt, sample), and
the contract's errors name the episode. The loop itself on a scripted sampler: its limits.
"""

from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, hf_logprobs, logprob_tol
from ppo_ray.environments import EnvError, EpisodeLimits, Turn, load_environment, run_episodes
from ppo_ray.modeling import load_causal_lm, load_tokenizer

OBSERVATION = " [obs {n}: {row}]"


class Echo:
    """Observation after each turn names the turn and the row's `tag`; reward 1 per turn; done
    after `done_after` turns (the row's, default 3)."""

    def reset(self, row: dict, seed: int) -> str:
        self.row, self.turn = row, 0
        return "" if row.get("silent_start") else f" [start {row['tag']}]"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turn += 1
        return OBSERVATION.format(n=self.turn, row=self.row["tag"]), 1.0, self.turn >= self.row.get("done_after", 3)


class Record(Echo):
    """Keeps every action it is given; done after one."""
    actions: list[str] = []

    def step(self, action):
        Record.actions.append(action)
        return " [ok]", 0.5, True


class BadStep(Echo):
    def step(self, action):
        return 42


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir))


@pytest.fixture
def generator(vllm_llm, tokenizer, tiny_model_dir):
    from actors.generator import Generator

    gen = Generator(vllm_llm, tokenizer, model_dir=tiny_model_dir, temperature=1.0, top_k=0, top_p=1.0,
                    max_new_tokens=48, seed=0, max_prompt_length=64)
    yield gen
    gen.close()


ROWS = [{"tag": "a"}, {"tag": "b", "done_after": 1}, {"tag": "c", "silent_start": True}, {"tag": "d"}]
LIMITS = EpisodeLimits(max_turns=3, max_episode_tokens=48, max_turn_tokens=5)


def test_an_episode_is_the_sampled_ids_and_each_observation_tokenised_once(generator, tokenizer, hf_model):
    batch, episodes = generator.generate_episodes(PROMPTS[:4], rows=ROWS, step=1, environment=f"{__name__}:Echo",
                                                  limits=LIMITS)
    assert len(batch) == 4 and batch.env_mask is not None
    for i, (ep, row) in enumerate(zip(episodes, ROWS)):
        n = int(batch.response_mask[i].sum())
        ids, env = batch.response_ids[i, :n].tolist(), batch.env_mask[i, :n].tolist()
        assert ids == ep.ids and env == ep.env
        # the transcript, rebuilt from its parts: the observations' ids are their text encoded once
        rebuilt, k = [], 0
        for role, text in ep.segments:
            if role == "env":
                obs = tokenizer.encode(text, add_special_tokens=False)
                assert ids[k:k + len(obs)] == obs and all(env[k:k + len(obs)])
                k += len(obs)
            else:
                run = k
                while run < n and not env[run]:
                    run += 1
                assert tokenizer.decode(ids[k:run], skip_special_tokens=True) == text and run > k
                k = run
            rebuilt.append(role)
        assert k == n
        want_turns = min(row.get("done_after", 3), LIMITS.max_turns)
        assert ep.turns <= want_turns and ep.score == float(ep.turns)
        assert ep.end in ("done", "eos", "max_turns", "budget")
        assert rebuilt[0] == ("model" if row.get("silent_start") else "env")
        assert batch.gen_logprobs[i, :n][torch.tensor(env)].eq(0).all()
    assert episodes[1].turns == 1 and episodes[1].end in ("done", "eos")
    assert any(ep.turns == 3 for ep in episodes)  # an episode with model turns between observations
    # the sampled logprobs are the policy's at each model token, the transcript (observations
    # included) as its context: HF's forward over the batch, on the model's tokens
    ref = hf_logprobs(hf_model, batch, 1.0)
    model = batch.loss_mask
    diff = (ref - batch.gen_logprobs).abs()[model]
    assert diff.max() < logprob_tol(ref, model), f"max |vLLM - HF| on model tokens {diff.max():.2e}"


def test_episodes_replay_by_step_and_each_sample_is_its_own(generator):
    env = f"{__name__}:Echo"
    a, _ = generator.generate_episodes(PROMPTS[:2], rows=ROWS[:2], step=3, environment=env, limits=LIMITS,
                                       samples_per_prompt=2)
    b, _ = generator.generate_episodes(PROMPTS[:2], rows=ROWS[:2], step=3, environment=env, limits=LIMITS,
                                       samples_per_prompt=2)
    c, _ = generator.generate_episodes(PROMPTS[:2], rows=ROWS[:2], step=4, environment=env, limits=LIMITS,
                                       samples_per_prompt=2)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.gen_logprobs, b.gen_logprobs)
    assert a.groups.tolist() == [0, 0, 1, 1]
    assert not torch.equal(a.response_ids[0], a.response_ids[1]) or not torch.equal(a.response_ids, c.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_a_stop_string_ends_the_model_turn_and_stays_in_its_action(generator, tokenizer):
    """The stop string: a character the same turn samples without it (same seed, so the same
    tokens up to it)."""
    one = EpisodeLimits(max_turns=1, max_episode_tokens=48, max_turn_tokens=12)
    _, free = generator.generate_episodes(PROMPTS[:1], rows=[{"tag": "s"}], step=7, environment=f"{__name__}:Record",
                                          limits=one)
    text = free[0].segments[-1][1]
    stop = next(ch for ch in text[2:] if ch.strip())
    Record.actions.clear()
    stopped = EpisodeLimits(stop_strings=(stop,), max_turns=1, max_episode_tokens=48, max_turn_tokens=12)
    _, eps = generator.generate_episodes(PROMPTS[:1], rows=[{"tag": "s"}], step=7, environment=f"{__name__}:Record",
                                         limits=stopped)
    assert stop in Record.actions[0] and Record.actions[0].index(stop) >= len(Record.actions[0]) - len(stop) - 8
    assert eps[0].finish_reason == "stop_string" and len(eps[0].ids) <= len(free[0].ids)
    assert free[0].ids[:len(eps[0].ids)] == eps[0].ids  # the same tokens up to the stop


def test_an_environment_that_breaks_the_contract_is_named(generator):
    with pytest.raises(EnvError, match=r"episode \S+/prompt-0/sample-0: the environment's step\(\) failed \(exception\): "
                                        r"the environment's step\(\) must return"):
        generator.generate_episodes(PROMPTS[:1], rows=ROWS[:1], step=1, environment=f"{__name__}:BadStep",
                                    limits=LIMITS)
    with pytest.raises(EnvError, match="must be a registered name"):
        load_environment("no_such_env")
    with pytest.raises(EnvError, match="has no class 'Nope'"):
        load_environment(f"{__name__}:Nope")


# --------------------------------------------------------------------------- the loop's limits
def scripted(turn_ids: list[int]):
    """A sampler that answers every request with `turn_ids` (truncated to its max tokens)."""
    def sample(requests):
        return [Turn(turn_ids[:max_tokens], [-0.5] * len(turn_ids[:max_tokens]), "length")
                for _, _, max_tokens, _ in requests]
    return sample


def loop(limits, rows, turn_ids=(7, 8, 9), obs_len=4):
    class Env:
        closed = 0

        def reset(self, row, seed):
            return ""

        def step(self, action):
            return "x" * obs_len, 0.25, False

        def close(self):
            Env.closed += 1

    eps = run_episodes([[1, 2]] * len(rows), rows, list(range(len(rows))), Env, scripted(list(turn_ids)),
                       encode=lambda text: [3] * len(text), decode=lambda ids: "t" * len(ids), limits=limits,
                       turn_seed=lambda i, turn: i * 100 + turn)
    return eps, Env.closed


def test_the_loop_ends_episodes_at_max_turns_and_at_the_token_budget_and_closes_every_environment():
    eps, closed = loop(EpisodeLimits(max_turns=2, max_episode_tokens=100, max_turn_tokens=3), [{}, {}])
    assert closed == 2 and [ep.end for ep in eps] == ["max_turns"] * 2
    assert eps[0].ids == [7, 8, 9, 3, 3, 3, 3, 7, 8, 9] and eps[0].env == [False] * 3 + [True] * 4 + [False] * 3
    assert eps[0].score == 0.5 and eps[0].logprobs == [-0.5] * 3 + [0.0] * 4 + [-0.5] * 3
    eps, _ = loop(EpisodeLimits(max_turns=9, max_episode_tokens=9, max_turn_tokens=3), [{}])
    assert eps[0].end == "budget" and len(eps[0].ids) == 9  # 3 model, 4 observation, 2 model (the budget's rest)
    assert eps[0].ids[-2:] == [7, 8]
    eps, _ = loop(EpisodeLimits(max_turns=9, max_episode_tokens=5, max_turn_tokens=3), [{}])
    assert eps[0].end == "budget" and eps[0].ids == [7, 8, 9, 3, 3]  # an observation cut to the budget
    with pytest.raises(EnvError, match="max_turns must be >= 1"):
        EpisodeLimits(max_turns=0)


def test_an_environments_own_limits_and_stop_strings_win():
    class Own:
        stop_strings = ["</tool>"]
        max_turns = 2

    limits = EpisodeLimits(max_turns=5).of(Own())
    assert limits.stop_strings == ("</tool>",) and limits.max_turns == 2 and limits.max_episode_tokens == 256


def test_the_docs_example_environment_follows_the_contract():
    """docs/ENVIRONMENTS.md's example, through the loop: a wrong guess gets the observation, a
    right one ends the episode with reward 1."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parents[1] / "docs" / "ENVIRONMENTS.md").read_text(encoding="utf-8")
    namespace: dict = {}
    exec(re.search(r"```python\n(.*?)```", doc, re.S).group(1), namespace)  # our own doc's code
    guesses = iter(["<guess>4</guess>", "<guess>5</guess>"])
    vocab: dict[int, str] = {}

    def encode(text):
        vocab[len(vocab) + 100] = text
        return [len(vocab) + 99]

    def sample(requests):
        return [Turn(encode(next(guesses)), [-1.0], "stop_string") for _ in requests]

    eps = run_episodes([[1]], [{"answer": 5}], [0], namespace["Guess"], sample, encode=encode,
                       decode=lambda ids: "".join(vocab[i] for i in ids), limits=EpisodeLimits(),
                       turn_seed=lambda i, turn: turn)
    assert eps[0].end == "done" and eps[0].turns == 2 and eps[0].rewards == [0.0, 1.0]
    assert [role for role, _ in eps[0].segments] == ["model", "env", "model"]
    assert EpisodeLimits().of(namespace["Guess"]()).stop_strings == ("</guess>",)


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_the_learner_trains_on_generated_episodes_and_the_sync_check_passes_on_their_model_tokens(
        generator, tiny_model_dir, estimator):
    """Episodes from the engine into the real learner (LoRA on the same base, version 0 on
    both sides): the sync check over the model tokens is within rounding, and an update with
    the episodes' scores moves the policy and leaves environment tokens out of every term."""
    from helpers import keep_experience, make_config
    from learner.learner import Learner

    extra = {} if estimator == "gae" else dict(advantage_estimator="grpo", samples_per_prompt=2)
    learner = Learner(make_config(temperature=1.0, top_k=0, top_p=1.0, batch_size=4, mini_batch_size=4, **extra),
                      str(tiny_model_dir))
    kept = keep_experience(learner)
    n = 1 if estimator == "gae" else 2
    batch, episodes = generator.generate_episodes(PROMPTS[:4 // n], rows=ROWS[:4 // n], step=2,
                                                  environment=f"{__name__}:Echo", limits=LIMITS, samples_per_prompt=n)
    assert batch.env_mask.any()
    gap = learner.sync_gap(batch)
    full = learner.rollout_scores(batch, full=True).full_logprobs.cpu()
    assert gap < logprob_tol(full, batch.loss_mask), f"sync gap on model tokens {gap:.2e}"
    ref = full + 0.05 * torch.randn(full.shape, generator=torch.Generator().manual_seed(0))
    scores = torch.tensor([ep.score for ep in episodes]) + torch.arange(len(episodes)) * 0.1
    before = learner.lora_weights().tensors
    stats, adapter = learner.update(batch, torch.where(batch.response_mask, ref, 0.0), scores)
    assert any(not torch.equal(before[k], adapter.tensors[k]) for k in before)
    exp = kept[0]
    env = batch.env_mask
    assert not exp.kl[env].any() and not exp.advantages[env].any() and not (exp.policy_mask & env).any()
