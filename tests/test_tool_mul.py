"""Task tool-mul (ppo_ray/tasks/tool_mul.py, issue 58): its data, the Calculator environment, the
SFT path on segments (the environment's tokens out of the SFT loss), the verifier and the
evaluation's numbers from episodes. No Ray, no vLLM: the episode loop runs on a scripted sampler,
the SFT loss on a tiny random Qwen3 built here."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ppo_ray.environments import EpisodeLimits, Turn, load_environment, run_episodes
from ppo_ray.rewards import RewardError
from ppo_ray.tasks import tool_mul
from ppo_ray.tasks.tool_mul import (ERROR_OBSERVATION, Calculator, ExprError, calculate, guess, tool_expression,
                                    verify, write_task)

SIZES = {"sft_train": 300, "sft_validation": 20, "prompts_train": 50, "prompts_validation": 20, "prompts_test": 20}


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.removesuffix("=").split("*")
    return int(a), int(b)


# --------------------------------------------------------------------------- the data
def test_splits_are_deterministic_disjoint_and_hold_the_products(tmp_path):
    first = write_task(tmp_path / "a", seed=3, sizes=SIZES)
    again = write_task(tmp_path / "b", seed=3, sizes=SIZES)
    other = write_task(tmp_path / "c", seed=4, sizes=SIZES)
    assert sorted(first) == sorted(f"{name}.jsonl" for name in SIZES)
    assert all(first[n].read_bytes() == again[n].read_bytes() for n in first)  # byte-identical
    assert first["prompts_test.jsonl"].read_bytes() != other["prompts_test.jsonl"].read_bytes()
    seen: dict[tuple[int, int], str] = {}
    for name, path in first.items():
        rows = rows_of(path)
        assert len(rows) == SIZES[name.removesuffix(".jsonl")]
        for row in rows:
            a, b = operands(row["prompt"])
            assert (len(str(a)), len(str(b))) == tool_mul.DIGITS
            key = (min(a, b), max(a, b))
            assert key not in seen, f"{row['prompt']} is in {seen.get(key)} and {name}"
            seen[key] = name
            if name.startswith("prompts"):
                assert set(row) == {"id", "prompt", "answer"} and row["answer"] == str(a * b)


def test_the_annotator_calls_the_tool_on_p_tool_of_its_traces_and_guesses_wrong_otherwise(tmp_path):
    rows = rows_of(write_task(tmp_path, seed=0, p_tool=0.3, sizes=SIZES)["sft_train.jsonl"])
    share = sum(r["tool"] for r in rows) / len(rows)
    assert abs(share - 0.3) < 4 * (0.3 * 0.7 / len(rows)) ** 0.5  # a binomial draw: within 4 standard errors
    for row in rows:
        a, b = operands(row["prompt"])
        assert row["product"] == str(a * b)
        assert row["transcript"] == "".join(text for _, text in row["segments"])
        assert row["answer"] == row["segments"][-1][1] and row["segments"][-1][0] == "model"
        if row["tool"]:  # the call, what the calculator answers it, the product read from it
            env = Calculator()
            env.reset({"answer": row["product"]}, seed=0)
            (_, call), (_, seen), (_, final) = row["segments"]
            assert [w for w, _ in row["segments"]] == ["model", "env", "model"]
            assert env.step(call)[0] == seen and env.step(final)[:3] == ("", 1.0, True)
        else:  # a plausible guess: the product's length and first two digits, never the product
            assert row["segments"] == [["model", str(guess(int(row["product"])))]]
    never = write_task(tmp_path / "never", p_tool=0.0, sizes=SIZES)["sft_train.jsonl"]
    assert not any(r["tool"] for r in rows_of(never))
    with pytest.raises(ValueError, match="p_tool"):
        write_task(tmp_path / "bad", p_tool=1.5)


def test_guess_is_an_estimate_never_the_product():
    assert guess(20126) == 20000 and guess(9676) == 9600 and guess(10000) == 11000 and guess(99000) == 98000
    for product in [0, 7, 9, 19, 99, 100, 1234, 987654, *range(1000, 1100), *range(10000, 10100)]:
        g = guess(product)
        assert g != product and len(str(g)) == len(str(product))


# --------------------------------------------------------------------------- the calculator
def test_calculate_parses_integers_joined_by_plus_minus_times_and_refuses_the_rest():
    assert calculate("347*58") == 20126
    assert calculate(" 2 + 3*4 - 10 ") == 4  # * before + and -
    assert calculate("5-7") == -2 and calculate("0") == 0
    bad = ["", "3+", "-3", "3**4", "2^3", "(1+2)", "3/4", "1e5", "1.5*2", "__import__('os').system('true')",
           "1" * 13, "+".join(["1"] * 9), "1+" * 40 + "1"]
    for expr in bad:
        with pytest.raises(ExprError):
            calculate(expr)


def test_a_tool_call_is_answered_with_its_value_and_the_episode_goes_on():
    env = Calculator()
    assert env.reset({"prompt": "347*58=", "answer": "20126"}, seed=5) == ""
    assert env.step("<calc>347*58</calc>") == ("<out>20126</out>", 0.0, False, {"tool_call": True, "tool_error": False})
    assert tool_expression("I compute <calc>1+2</calc>  ") == "1+2"  # text before the call, space after it
    assert env.step("first <calc>1+2</calc>")[0] == "<out>3</out>"
    assert Calculator.stop_strings == ("</calc>",) and Calculator.max_turns == 3
    assert load_environment("calculator") is Calculator  # environments.BUILTIN's name


@pytest.mark.parametrize("action", ["<calc>37*</calc>", "</calc>", "<calc>eval('1')</calc>", "<calc></calc>",
                                    "<calc>" + "9" * 20 + "*2</calc>", "<calc>" + "1*" * 40 + "1</calc>"])
def test_a_malformed_or_oversized_call_is_a_tool_error_observation(action):
    env = Calculator()
    env.reset({"answer": "12"}, seed=0)
    assert env.step(action) == (ERROR_OBSERVATION, 0.0, False, {"tool_call": True, "tool_error": True})


def test_a_turn_without_a_call_is_the_final_answer_judged_against_the_rows_answer():
    env = Calculator()
    env.reset({"answer": "20126"}, seed=0)
    assert env.step(" 20126\n") == ("", 1.0, True, {"tool_call": False, "tool_error": False})
    for wrong in ("20127", "20126.", "020126", "<calc>347*58", "", "20126 20126"):
        env.reset({"answer": "20126"}, seed=0)
        assert env.step(wrong)[:3] == ("", 0.0, True), wrong
    with pytest.raises(KeyError, match="answer"):
        Calculator().reset({"prompt": "2*3="}, seed=0)


def test_the_calculator_is_deterministic_whatever_the_seed():
    actions = ["<calc>12*34</calc>", "<calc>1+</calc>", "<calc>408-8</calc>", "408"]
    runs = []
    for seed in (0, 1, 99):
        env = Calculator()
        env.reset({"answer": "408"}, seed=seed)
        runs.append([env.step(a) for a in actions])
    assert runs[0] == runs[1] == runs[2]
    assert [r[0] for r in runs[0]] == ["<out>408</out>", ERROR_OBSERVATION, "<out>400</out>", ""]


# --------------------------------------------------------------------------- episodes (scripted)
def scripted(turns_by_episode: list[list[str]]):
    """A Sampler that plays each episode's turns in order, as character ids (ord); a turn that
    ends with the stop string ends there, the last one with EOS (id 0)."""
    played = [0] * len(turns_by_episode)

    def sample(requests):
        out = []
        for ids, *_ in requests:
            e = ids[0] - 1000  # the prompt's first id names the episode
            text = turns_by_episode[e][played[e]]
            played[e] += 1
            if text.endswith("</calc>"):
                out.append(Turn([ord(c) for c in text], [0.0] * len(text), "stop_string"))
            else:
                out.append(Turn([ord(c) for c in text] + [0], [0.0] * (len(text) + 1), "stop"))
        return out
    return sample


def test_episodes_of_the_loop_with_the_calculator():
    """The tool route (call, observation, product), a guess, and a model that keeps calling until
    max_turns, through ppo_ray.environments.run_episodes."""
    turns = [["<calc>347*58</calc>", "20126"], ["20000"], ["<calc>347*58</calc>"] * 3]
    eps = run_episodes([[1000 + e] for e in range(3)], [{"answer": "20126"}] * 3, [0, 1, 2], Calculator,
                       scripted(turns), encode=lambda t: [ord(c) for c in t],
                       decode=lambda ids: "".join(chr(i) for i in ids if i), limits=EpisodeLimits().of(Calculator),
                       turn_seed=lambda e, t: t)
    tool, guessed, looping = eps
    assert tool.segments == [("model", "<calc>347*58</calc>"), ("env", "<out>20126</out>"), ("model", "20126")]
    assert (tool.end, tool.score, tool.turns, tool.tool_calls, tool.tool_errors) == ("done", 1.0, 2, 1, 0)
    assert sum(tool.env) == len("<out>20126</out>")
    assert (guessed.end, guessed.score, guessed.turns, guessed.tool_calls) == ("done", 0.0, 1, 0)
    assert (looping.end, looping.score, looping.turns, looping.tool_calls) == ("max_turns", 0.0, 3, 3)


# --------------------------------------------------------------------------- the verifier
def test_the_verifier_reads_the_final_answer_after_the_last_observation():
    prompts = ["347*58="] * 6
    completions = ["<calc>347*58</calc><out>20126</out>20126", "20126", "<calc>347*58</calc><out>20126</out>20000",
                   "<calc>3*4</calc><out>12</out><calc>347*58</calc><out>20126</out> 20126 ",
                   "<calc>347*58</calc><out>20126</out>20126", "<calc>347*58</calc>"]
    finish = ["stop", "stop", "stop", "stop", "length", "length"]
    assert verify(prompts, completions, finish_reasons=finish, answer=["20126"] * 6) == [1, 1, 0, 1, 0, 0]
    with pytest.raises(RewardError, match="not an integer"):
        verify(["2*3="], ["6"], finish_reasons=["stop"], answer=["six"])
    with pytest.raises(RewardError, match="1 prompts"):
        verify(["2*3="], ["6", "6"], finish_reasons=["stop"], answer=["6"])


def test_the_task_declares_what_the_pipeline_asks():
    task = tool_mul.TASK
    task.check()
    assert task.stages == ("sft", "ppo") and task.sft_segments == "segments" and task.sft_target == "transcript"
    assert task.verifier is None and task.environment == "calculator"  # the environment's reward alone


# --------------------------------------------------------------------------- the evaluation
def episode(score: float, turns: int, calls: int, end: str = "done", errors: int = 0, final: str = "1"):
    segments = (("model", "<calc>1*1</calc>"), ("env", "<out>1</out>")) * calls + (("model", final),)
    return SimpleNamespace(score=score, turns=turns, tool_calls=calls, tool_errors=errors, end=end, segments=segments)


def test_rates_from_episodes():
    rows = [{"prompt": "1*1=", "answer": "1"}, {"prompt": "2*1=", "answer": "2"}]
    greedy = [episode(1.0, 2, 1), episode(0.0, 1, 0)]
    sampled = [episode(1.0, 2, 1), episode(0.0, 1, 0), episode(0.0, 3, 3, end="max_turns"),  # row 0
               episode(0.0, 1, 0), episode(1.0, 2, 1), episode(0.0, 2, 1, errors=1), episode(float("nan"), 1, 0,
                                                                                                 end="failed")]
    res = tool_mul.episode_record(rows, greedy, sampled[:6], 3)
    assert res["greedy_right"] == [True, False] and res["right"] == [1, 1]
    assert json.loads(json.dumps(res)) == res  # kept as eval-before-ppo.json
    rates = tool_mul.tool_rates(res, 3)
    assert rates["pass1"] == 0.5 and rates["sample_accuracy"] == 2 / 6
    assert rates["pass3"] == 1.0  # each problem has a right sample among its 3
    assert rates["tool_call_rate"] == 4 / 6 and rates["greedy_tool_call_rate"] == 0.5
    assert rates["turns"] == 11 / 6 and rates["tool_errors"] == 1 / 6 and rates["tool_accuracy"] == 2 / 4
    numbers = tool_mul.tool_numbers("test", 3, res, res)
    assert {"pass1_test_sft", "pass3_test_rl", "tool_call_rate_test_sft", "turns_test_rl"} <= set(numbers)
    with pytest.raises(ValueError, match="need 2 greedy and 6 sampled"):
        tool_mul.episode_record(rows, greedy, sampled, 3)
    failed = tool_mul.episode_record(rows[:1], greedy[:1], sampled[4:7], 3)
    assert failed["samples_right"] == [[True, False, False]]  # a failed (NaN) episode is not right


def test_evaluate_and_report_on_the_trainers_episodes(tmp_path, monkeypatch):
    """Task.evaluate against the trainer's interface (ppo_ray.tasks.evaluation.generate's
    Responses with .episodes, config.environment set), then report.json's numbers, samples.md
    with whole transcripts and held_out.jsonl."""
    from ppo_ray.stats import EpisodeSummary, Responses
    from ppo_ray.tasks import evaluation

    def fake_generate(trainer, rows, *, greedy=False, samples_per_prompt=1, label=None, score=False):
        eps = [EpisodeSummary(score=1.0, turns=2, tool_calls=1, tool_errors=0, end="done",
                              segments=(("model", f"<calc>{r['prompt'][:-1]}</calc>"),
                                        ("env", f"<out>{r['answer']}</out>"), ("model", r["answer"])))
               if greedy or s % 2 else
               EpisodeSummary(score=0.0, turns=1, tool_calls=0, tool_errors=0, end="done", segments=(("model", "9"),))
               for r in rows for s in range(samples_per_prompt)]
        return Responses(["".join(t for _, t in e.segments) for e in eps], ["stop"] * len(eps), 0, episodes=eps)

    monkeypatch.setattr(evaluation, "generate", fake_generate)
    rows = [{"prompt": "12*3=", "answer": "36"}, {"prompt": "7*5=", "answer": "35"}]
    cfg = SimpleNamespace(eval_k=4)
    res = tool_mul.TASK.evaluate(None, cfg, rows)
    assert res["greedy_right"] == [True, True] and res["right"] == [2, 2]
    assert tool_mul.TASK.periodic(None, cfg, rows) == {"pass1_val": 1.0, "tool_call_rate_val": 1.0}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "kl": 0.1, "reward_mean": 0.5}) + "\n")
    report = tool_mul.TASK.report(tmp_path, metrics, cfg, rows, rows, {**res, "val": res}, res, res)
    assert report["pass1_test_sft"] == 1.0 and report["tool_call_rate_test_rl"] == 0.5
    assert report["turns_val_rl"] == 1.5 and report["pass4_test_rl"] == 1.0
    samples = (tmp_path / "samples.md").read_text()
    assert "**model** `<calc>12*3</calc>` → **env** `<out>36</out>` → **model** `36`" in samples
    held = rows_of(tmp_path / "held_out.jsonl")
    assert len(held) == 4 and held[0]["sft_greedy_segments"][1] == ["env", "<out>36</out>"]
    with pytest.raises(ValueError, match="environment: calculator"):
        tool_mul._episodes(Responses(["x"], ["stop"], 0))


# --------------------------------------------------------------------------- SFT on segments
@pytest.fixture(scope="module")
def tok():
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.paths import resolve_model_path

    return load_tokenizer(resolve_model_path("embedded:tldr"))  # its tokenizer only: no model runs


def test_segments_are_encoded_one_by_one_with_the_environments_tokens_marked(tok):
    from ppo_ray.data import DataError
    from ppo_ray.tasks.pipeline import encode_segments

    segments = [["model", "<calc>347*58</calc>"], ["env", "<out>20126</out>"], ["model", "20126"]]
    q, r, env = encode_segments(tok, ["347*58="], [segments, [["model", "20000"]]], "sft")
    parts = [tok(segments[0][1], add_special_tokens=False)["input_ids"],
             tok.encode(segments[1][1], add_special_tokens=False),  # as the episode loop encodes an observation
             tok(segments[2][1], add_special_tokens=False)["input_ids"]]
    assert q == [tok("347*58=", add_special_tokens=False)["input_ids"]]
    assert r[0] == parts[0] + parts[1] + parts[2] + [tok.eos_token_id]
    assert env[0] == [False] * len(parts[0]) + [True] * len(parts[1]) + [False] * (len(parts[2]) + 1)
    assert r[1] == tok("20000", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] and not any(env[1])
    for bad in ([], [["env", "<out>1</out>"]], [["tool", "x"]], "20126", [["model", 5]]):
        with pytest.raises(DataError, match="row 0: segments must be"):
            encode_segments(tok, ["1*1="], [bad], "sft")


def test_sft_ids_reads_segments_only_for_a_task_that_declares_them(tok, tmp_path):
    from ppo_ray.config import PPOConfig
    from ppo_ray.tasks import pipeline

    config = PPOConfig(model_name="embedded:tldr", task="ppo_ray.tasks.tool_mul:TASK", dataset="bundled")
    write_task(tmp_path, seed=0, sizes=SIZES)
    got = pipeline.sft_ids(config, tmp_path, tok, "train")
    rows = rows_of(tmp_path / "sft_train.jsonl")
    want = pipeline.encode_segments(tok, [r["prompt"] for r in rows], [r["segments"] for r in rows], "x")
    assert (got.queries, got.responses, got.env_masks) == want and got.info == {}
    assert any(any(m) for m in got.env_masks)
    # a task without sft_segments: its single targets, no masks, as before
    arith = PPOConfig.from_yaml("arith-tiny")
    data = pipeline.write_data(arith, tmp_path / "arith")
    plain = pipeline.sft_ids(arith, data, tok, "eval")
    arows = rows_of(data / "sft_validation.jsonl")
    assert plain.env_masks is None
    assert (plain.queries, plain.responses) == pipeline._encode(tok, [r["prompt"] for r in arows],
                                                                [r["answer"] for r in arows])


def tiny_qwen3(seed: int = 0):
    """A tiny random Qwen3 (2 layers, hidden 64) over the embedded models' 1024-token vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=1022, pad_token_id=1023)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config).train()


PAD, EOS = 1023, 1022


def transcripts(seed: int = 0):
    """4 rows: prompts, responses (model, env, model tokens, EOS) of unequal lengths, env masks."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 1000, (n,), generator=g).tolist()

    q, r, env = [], [], []
    for n_call, n_obs, n_final in ((5, 3, 2), (7, 4, 1), (3, 0, 4), (6, 5, 3)):
        q.append(ids(4 + n_call % 3))
        r.append(ids(n_call) + ids(n_obs) + ids(n_final) + [EOS])
        env.append([False] * n_call + [True] * n_obs + [False] * (n_final + 1))
    return q, r, env


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_env_tokens_get_no_sft_gradient_and_the_loss_is_the_model_tokens_mean():
    """sft_loss with env tokens: the logits that predict an environment token get exactly zero
    gradient (torch.where in the masked mean: nothing flows there), and the loss is the mean
    -logprob over the model's tokens alone (a naive loop; float32 rounding over a vocabulary of
    1024 and the ~40 tokens summed)."""
    from learner.stages import sft_loss
    from ppo_ray.batch import RolloutBatch
    from tolerances import rounding_tol

    q, r, env = transcripts()
    model = tiny_qwen3()
    batch = RolloutBatch.from_tokens(q, r, PAD, EOS, env_masks=env).trimmed()
    captured = {}

    def keep(module, args, out):
        out.retain_grad()
        captured["logits"] = out
    handle = model.lm_head.register_forward_hook(keep)
    loss = sft_loss(model, batch)
    loss.backward()
    handle.remove()
    t = batch.response_ids.shape[1]
    g = captured["logits"].grad[:, :t]  # (B, T, V): column t predicts response token t
    assert torch.equal(g[batch.env_mask], torch.zeros_like(g[batch.env_mask]))
    assert (g[batch.loss_mask].abs().sum(dim=-1) > 0).all()
    logp = torch.log_softmax(captured["logits"][:, :t].detach().float(), dim=-1)
    terms = [-float(logp[b, j, batch.response_ids[b, j]]) for b in range(len(r)) for j in range(len(r[b]))
             if not env[b][j]]
    want = sum(terms) / len(terms)
    got = float(loss.detach())
    assert abs(got - want) <= rounding_tol(max(terms), 1024 + len(terms)), (got, want)


def test_garbage_in_the_env_positions_logits_changes_nothing():
    """The loss and the gradient read nothing at the positions that predict an environment token:
    logits replaced there by NaN (response_logits patched) give the same loss and gradients, bit
    for bit."""
    from unittest import mock

    import learner.stages as stages
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.modeling import response_logits

    q, r, env = transcripts(seed=1)
    batch = RolloutBatch.from_tokens(q, r, PAD, EOS, env_masks=env).trimmed()
    model = tiny_qwen3()
    stages.sft_loss(model, batch).backward()
    clean = grads(model)

    def poisoned(model, batch):
        logits = response_logits(model, batch)
        return torch.where(batch.env_mask[..., None], torch.full_like(logits, float("nan")), logits)
    with mock.patch.object(stages, "response_logits", poisoned):
        loss = stages.sft_loss(model, batch)
        loss.backward()
    assert torch.isfinite(loss)
    got = grads(model)
    assert all(torch.equal(got[n], clean[n]) for n in clean)


def test_the_single_target_path_is_unchanged():
    """Without env masks (every task but a segments one) the SFT loss is the pre-segments formula
    on the same ops, bit for bit, and an all-False mask changes no bit of the loss or gradient."""
    from learner.algos import masked_mean
    from learner.stages import sft_backward, sft_loss
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.logprobs import logprobs_from_logits
    from ppo_ray.modeling import response_logits

    q, r, _ = transcripts(seed=2)
    model = tiny_qwen3()
    batch = RolloutBatch.from_tokens(q, r, PAD, EOS).trimmed()
    with torch.no_grad():
        logp = logprobs_from_logits(response_logits(model, batch), batch.response_ids, 1.0, mask=batch.response_mask)
        assert torch.equal(sft_loss(model, batch), -masked_mean(logp, batch.response_mask))
    cpu = torch.device("cpu")
    rows = [0, 1, 2, 3]
    without = sft_backward(model, q, r, rows, PAD, EOS, None, cpu)
    g_without = grads(model)
    with_false = sft_backward(model, q, r, rows, PAD, EOS, None, cpu, env_masks=[[False] * len(x) for x in r])
    g_false = grads(model)
    assert torch.equal(without, with_false) and all(torch.equal(g_false[n], g) for n, g in g_without.items())


@pytest.mark.equality
def test_micro_batches_weight_by_model_tokens():
    """With env masks, micro-batches of 1 and 3 rows give the loss and gradient of one batch:
    each micro-batch's mean weighted by its share of the step's MODEL tokens (float32 rounding of
    the tiny decoder's reductions)."""
    from learner.stages import sft_backward
    from tolerances import decoder_terms, grad_terms, rounding_tol

    q, r, env = transcripts(seed=3)
    model = tiny_qwen3()
    cpu = torch.device("cpu")
    results = {}
    for m in (None, 3, 1):
        loss = sft_backward(model, q, r, [0, 1, 2, 3], PAD, EOS, m, cpu, env_masks=env)
        results[m] = (loss, grads(model))
    full_loss, full_grads = results[None]
    terms = decoder_terms(hidden=64, intermediate=96, head_dim=32, seq=32, vocab=1024)
    g_max = max(float(g.abs().max()) for g in full_grads.values())
    for m in (3, 1):
        loss, g = results[m]
        torch.testing.assert_close(loss, full_loss, atol=rounding_tol(full_loss.abs(), terms), rtol=0)
        torch.testing.assert_close(g, full_grads, atol=rounding_tol(g_max, grad_terms(40, terms)), rtol=0)


def test_train_sft_checks_the_env_masks(tmp_path):
    from learner.stages import TrainSettings, train_sft

    q, r, env = transcripts()
    settings = TrainSettings(device="cpu", progress=False)
    with pytest.raises(ValueError, match="row 1's env mask has"):
        train_sft("unused", q, r, tmp_path, settings, env_masks=[env[0], env[1][:-1], env[2], env[3]])
    with pytest.raises(ValueError, match="marks its last"):
        train_sft("unused", q, r, tmp_path, settings, env_masks=[m[:-1] + [True] for m in env])
    with pytest.raises(ValueError, match="SFT validation"):
        train_sft("unused", q, r, tmp_path, settings, val=(q, r, env[:2]))
