"""`launch.py eval`'s checks of its input, before Ray or any actor starts: a bad run directory,
checkpoint, split, prompts file or --out is one line naming it, exit 2, and nothing is written.
The run directory here is a real one as far as those checks read it: the bundled arith task's
data, an SFT model directory (the embedded model's files), and a checkpoint of the PPO stage's
config written by ppo_ray.driver.checkpoint from a real learner's state. The evaluation itself, run
on a finished run and compared with its report.json: tests/test_launch.py
(test_the_verifiable_task_end_to_end)."""

from __future__ import annotations

import json
import shutil

import pytest

import launch
from helpers import snapshot


@pytest.fixture(scope="module")
def arith_run(tmp_path_factory):
    import torch

    from learner.learner import Learner
    from ppo_ray.driver.checkpoint import save_checkpoint
    from ppo_ray.config import PPOConfig
    from ppo_ray.paths import resolve_model_path
    from ppo_ray.tasks import pipeline

    run = tmp_path_factory.mktemp("eval") / "run"
    config = PPOConfig.from_yaml("arith-tiny")
    data_dir = pipeline.write_data(config, run)
    shutil.copytree(resolve_model_path(config.model_name), run / "sft")
    config.to_yaml(run / "config.yaml")
    cfg = pipeline.ppo_config(config, run, data_dir)
    state = Learner(cfg, str(run / "sft")).state_dict()
    save_checkpoint(run, config=cfg, learner_state=state, model_dir=str(run / "sft"),
                    trainer_state={"step": 1, "order": [], "data_rng": torch.Generator().get_state()})
    return run


def refused(argv: list[str], capsys, *watched) -> str:
    """launch.py eval `argv` in this process: exit 2, nothing written into `watched`; its stderr."""
    before = [snapshot(d) for d in watched]
    assert launch.main(["eval", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert [snapshot(d) for d in watched] == before
    return err


def test_a_missing_run_or_checkpoint_is_named(tmp_path, capsys):
    err = refused([tmp_path / "nope"], capsys, tmp_path)
    assert f"run directory {tmp_path / 'nope'}: no such directory" in err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("task: arith\n")
    err = refused([tmp_path / "run"], capsys, tmp_path)
    assert f"run directory {tmp_path / 'run'}: no checkpoint there" in err
    err = refused([], capsys, tmp_path)
    assert "give one run directory" in err
    # --config is refused with its reason, and --help does not offer it
    err = refused([tmp_path / "run", "--config", "tiny"], capsys, tmp_path)
    assert "--config: eval runs with the run's own config" in err
    assert launch.main(["eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--checkpoint CKPT" in out and "--config" not in out


def test_bad_options_are_named(arith_run, tmp_path, capsys):
    err = refused([arith_run, "--split", "train"], capsys, arith_run)
    assert "unknown split 'train'; splits: test, validation" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    err = refused([arith_run, "--split", "test", "--prompts", prompts], capsys, arith_run)
    assert "--split and --prompts: give one of them" in err
    err = refused([arith_run, "--checkpoint", tmp_path], capsys, arith_run)
    assert f"--checkpoint {tmp_path}: no checkpoint there" in err
    err = refused([arith_run, "--checkpoint", tmp_path / "step-000001"], capsys, arith_run)
    assert f"--checkpoint {tmp_path / 'step-000001'}: no such file or directory" in err
    other = tmp_path / "other"
    shutil.copytree(arith_run / "checkpoints", other / "checkpoints")
    err = refused([arith_run, "--checkpoint", other / "checkpoints" / "step-000001"], capsys, arith_run, other)
    assert f"checkpoint {other / 'checkpoints' / 'step-000001'} is not one of {arith_run}'s" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    err = refused([arith_run, "--out", tmp_path / "full"], capsys, arith_run, tmp_path)
    assert f"--out {tmp_path / 'full'}: exists and is not an empty folder" in err
    err = refused([arith_run, "--kl_coeff", "0.1"], capsys, arith_run)
    assert "did you mean --kl_coef?" in err
    err = refused([arith_run, "--lora_r", "4"], capsys, arith_run)  # the checkpoint's adapter has another rank
    assert "lora_r" in err and "different config" in err
    assert not (arith_run / "eval").exists()


@pytest.mark.parametrize("lines, expected", [
    (['{"prompt": "1+2=", "answer": "3"}', '{"question": "2+2="}'], "row 1 has no column 'prompt'"),
    (['{"prompt": "1+2=", "answer": "3"}', '{"prompt": 7}'], "row 1 column 'prompt' is a int, not a str"),
    (['{"prompt": "1+2=", "answer": "3"}', '{"prompt": "2+'], "line 2 is not valid JSON"),
    (['{"prompt": "1+2=", "answer": "3"}', '{"prompt": "   "}'], "prompt 1"),
    (['{"prompt": "1+2=", "answer": "4"}'], "row 0: answer '4' is not 1+2 = 3"),
    (['{"prompt": "one plus two", "answer": "3"}'], "row 0: arith verifier: 'one plus two' is not an addition"),
    ([], "no rows"),
])
def test_a_bad_prompts_file_is_named_by_its_row(arith_run, tmp_path, capsys, lines, expected):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(line + "\n" for line in lines))
    err = refused([arith_run, "--prompts", prompts], capsys, arith_run, tmp_path)
    assert str(prompts) in err and expected in err, err


def test_prompts_without_the_tasks_columns_skip_its_metrics_and_say_why(arith_run, tmp_path):
    """No `answer` column: eval still samples (and would write the samples), and eval.json's
    `skipped` names the metric and the first row without it. Checked on the plan (no Ray)."""
    from ppo_ray.tasks.evaluate import plan
    from ppo_ray.tasks.evaluation import tldr_numbers  # noqa: F401 - the module imports without Ray

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "4+5="}\n')
    p = plan([str(arith_run), "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    assert p.kind == "arith" and p.tag == "prompts" and p.has_sft and len(p.rows) == 2
    assert p.skipped == {"pass_rates": f"{prompts}: row 1 has no column 'answer' (1 of 2 rows lack it)"}
    # the held-out split: the PPO stage's rows (the first eval_size), all checked
    p = plan([str(arith_run), "--split", "validation", "--out", str(tmp_path / "out")])
    rows = [json.loads(x) for x in (arith_run / "data" / "prompts_validation.jsonl").read_text().splitlines()]
    assert p.rows == rows[: p.config.eval_size] and p.tag == "val" and not p.skipped
    assert p.checkpoint == arith_run / "checkpoints" / "step-000001"
    assert p.config.model_name == str(arith_run / "sft") and p.config.reward_funcs == ["ppo_ray.tasks.arith:verify"]
    assert not (tmp_path / "out").exists()


def test_tldr_rows_without_facts_skip_the_gold_judge():
    from ppo_ray.data import DataError
    from ppo_ray.tasks.tldr_task import tldr_columns

    assert tldr_columns([{"prompt": "x", "facts": ["a", "b", "c"]}], "f.jsonl") is None
    why = tldr_columns([{"prompt": "x", "facts": ["a", "b", "c"]}, {"prompt": "y"}], "f.jsonl")
    assert why.startswith("f.jsonl: row 1 has no column 'facts' (1 of 2 rows lack it")
    with pytest.raises(DataError, match="f.jsonl: row 0 column 'facts': expected three strings"):
        tldr_columns([{"prompt": "x", "facts": "a"}], "f.jsonl")


def test_an_evaluation_in_chunks_keeps_each_prompts_global_index(monkeypatch, caplog):
    """evaluation.generate asks for EVAL_CHUNK prompts at a time, each chunk with the global index
    of its first prompt (trainer.generate's index_offset: the sampling seed follows it), and
    logs a progress line per chunk. The stand-in's sample is its prompt's global index, so the
    joined texts show every prompt got its own index, in order, whatever the chunking."""
    import logging

    from ppo_ray.stats import Responses
    from ppo_ray.tasks import evaluation

    class Trainer:
        def generate(self, prompts, *, samples_per_prompt, greedy, score, index_offset):
            texts = [f"{index_offset + i}/{j}" for i in range(len(prompts)) for j in range(samples_per_prompt)]
            return Responses(texts, ["stop"] * len(texts), 7, [float(len(t)) for t in texts] if score else None)

    monkeypatch.setattr(evaluation, "EVAL_CHUNK", 3)
    with caplog.at_level(logging.INFO, logger=evaluation.__name__):
        out = evaluation.generate(Trainer(), [f"p{i}" for i in range(7)], samples_per_prompt=2, score=True,
                                  label="SFT policy")
    assert out.texts == [f"{i}/{j}" for i in range(7) for j in range(2)] and out.version == 7
    assert out.rewards == [float(len(t)) for t in out.texts]
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "SFT policy: 3/7 prompts", "SFT policy: 6/7 prompts", "SFT policy: 7/7 prompts"]
    assert evaluation.generate(Trainer(), ["a", "b"]).rewards is None

    class Columns:  # rows keyed "prompt": each chunk carries its own rows' columns
        def generate(self, prompts, *, samples_per_prompt, greedy, score, index_offset):
            texts = [f"{t}={i}" for t, i in zip(prompts.texts, prompts.columns["id"], strict=True)]
            return Responses(texts, ["stop"] * len(texts), 7, None)

    out = evaluation.generate(Columns(), [{"prompt": f"p{i}", "id": i} for i in range(7)])
    assert out.texts == [f"p{i}={i}" for i in range(7)]
