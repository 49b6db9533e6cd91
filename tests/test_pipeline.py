"""ppo_ray/tasks/pipeline.py without Ray: the bundled task's data written for a run, the PPO stage's
config, the cached before-training evaluation, the report files (samples.md, curves.png).
The stages themselves run end to end in test_launch.py and test_tldr_path.py.
"""

from __future__ import annotations

import json

import pytest


def test_pipeline_writes_the_configured_reference_quality(tmp_path):
    from ppo_ray.config import PPOConfig
    from ppo_ray.tasks.pipeline import write_data

    ideal = [json.loads(x)["summary"] for x in
             (write_data(PPOConfig(), tmp_path / "a") / "sft_train.jsonl").read_text().splitlines()]
    mixed = [json.loads(x)["summary"] for x in
             (write_data(PPOConfig(bundled_ideal_fraction=0.3), tmp_path / "b") / "sft_train.jsonl")
             .read_text().splitlines()]
    assert len(ideal) == len(mixed) and 0.25 < sum(a == b for a, b in zip(ideal, mixed)) / len(ideal) < 0.35


def test_named_datasets_write_no_data_directory(tmp_path):
    from ppo_ray.config import PPOConfig
    from ppo_ray.tasks.pipeline import write_data

    data_dir = write_data(PPOConfig(sft_dataset="org/sft", preference_dataset="org/prefs"), tmp_path)
    assert data_dir == tmp_path / "data" and not data_dir.exists()


def test_real_split_fills_the_split_into_a_path_pattern():
    from ppo_ray.config import PPOConfig
    from ppo_ray.tasks.pipeline import _real_split

    config = PPOConfig(train_split="tr", eval_split="va")
    assert _real_split(config, "data/{split}.jsonl", "train") == ("data/tr.jsonl", "tr")
    assert _real_split(config, "org/name", "eval") == ("org/name", "va")


def test_ppo_config_points_the_stage_at_the_runs_sft_and_rm(tmp_path):
    from ppo_ray.config import PPOConfig
    from ppo_ray.tasks.pipeline import ppo_config

    run, data = tmp_path / "run", tmp_path / "run" / "data"
    cfg = ppo_config(PPOConfig(reward_funcs=["ppo_ray.rewards:brevity"], reward_weights=[1.0]), run, data)
    assert (cfg.model_name, cfg.reward_model_name, cfg.ref_model_name) == (str(run / "sft"), str(run / "rm"), None)
    assert cfg.reward_funcs == [] and cfg.reward_weights == [] and cfg.value_model_name is None
    assert (cfg.dataset, cfg.prompt_column) == (str(data / "prompts_train.jsonl"), "prompt")
    assert ppo_config(PPOConfig(value_model_name="rm"), run, data).value_model_name == str(run / "rm")


def test_the_before_training_evaluation_is_computed_once_and_kept(tmp_path):
    from types import SimpleNamespace

    from ppo_ray.tasks.pipeline import BEFORE_EVAL, before_training

    calls = []

    def evaluate():
        calls.append(1)
        return {"gold": [0.5]}

    assert before_training(SimpleNamespace(version=0), tmp_path, evaluate) == {"gold": [0.5]}
    # a resumed run reads the kept numbers, whatever its version
    assert before_training(SimpleNamespace(version=3), tmp_path, evaluate) == {"gold": [0.5]} and len(calls) == 1
    (tmp_path / BEFORE_EVAL).unlink()
    with pytest.raises(FileNotFoundError, match="a resumed policy cannot recompute it"):
        before_training(SimpleNamespace(version=3), tmp_path, evaluate)
    assert len(calls) == 1


def test_read_metrics_skips_blank_lines(tmp_path):
    from ppo_ray.tasks.pipeline import read_metrics

    (tmp_path / "m.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n  \n')
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 1}, {"step": 2}]


def test_samples_tables_escape_cells_and_keep_n_rows(tmp_path):
    from ppo_ray.tasks.pipeline import write_held_out_texts, write_samples

    prompts = ["SUBREDDIT: r/a\n\nPOST: my | post\nline two\n\nTL;DR:", "no post field"] * 2
    write_held_out_texts(tmp_path / "h.md", prompts, ["s|1", "s2"] * 2, ["p\n1", "p2"] * 2, n=2)
    lines = (tmp_path / "h.md").read_text().splitlines()
    assert lines[4] == r"| 0 | my \| post line two  TL;DR:... | s\|1 | p 1 |"
    assert lines[5].startswith("| 1 | no post field... |") and len(lines) == 6
    rows = [{"prompt": "P", "post": "a|b"}, {"prompt": "Q"}]
    write_samples(tmp_path / "s.md", rows, ["x", "y"], [0.25, 1.0], ["z|", "w"], [0.5, 0.0])
    lines = (tmp_path / "s.md").read_text().splitlines()
    assert lines[4:] == [r"| 0 | a\|b... | x | 0.25 | z\| | 0.50 |", "| 1 | Q... | y | 1.00 | w | 0.00 |"]


def test_plot_curves_writes_a_png_from_gappy_metrics(tmp_path):
    from ppo_ray.tasks.pipeline import plot_curves

    rows = [{"step": 1, "reward_mean": 0.1, "kl": float("nan")}, {"step": 2, "reward_mean": 0.3, "gold_val": 0.6}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_curves(tmp_path / "m.jsonl", tmp_path / "c.png", gold_before=0.4)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("task", ["arith", "tldr"])
def test_a_later_stage_keeps_the_data_its_sft_was_trained_on(tmp_path, caplog, task):
    """`launch.py ppo --seed 1` on a run whose SFT was trained on seed 0's data: the data stays
    seed 0's (another seed's test split would hold problems the SFT model was trained on), with
    a warning; a starting SFT stage writes it for its own seed, and says so in data/task.json."""
    from ppo_ray.config import PPOConfig
    from ppo_ray.tasks.pipeline import DATA_STAMP, write_data

    data_dir = write_data(PPOConfig(task=task, seed=0), tmp_path)
    before = {p.name: p.read_text() for p in data_dir.iterdir()}
    assert json.loads(before[DATA_STAMP])["seed"] == 0
    with caplog.at_level("WARNING"):
        assert write_data(PPOConfig(task=task, seed=1), tmp_path, keep=True) == data_dir
    assert {p.name: p.read_text() for p in data_dir.iterdir()} == before
    assert "kept, not rewritten" in caplog.text and "'seed': 1" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        write_data(PPOConfig(task=task, seed=0), tmp_path, keep=True)
    assert "kept" not in caplog.text  # the same spec: nothing to say
    write_data(PPOConfig(task=task, seed=1), tmp_path)  # SFT starts: the data is the new seed's
    after = {p.name: p.read_text() for p in data_dir.iterdir()}
    assert json.loads(after[DATA_STAMP])["seed"] == 1
    assert all(after[name] != before[name] for name in before)
