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


def bundled_eval(task: str, run_dir, **overrides):
    """(config, settings, test rows) of the PPO stage's held-out evaluation on a small bundled
    preset (tldr-tiny, arith-tiny), its data written into run_dir/data as the SFT stage does."""
    from ppo_ray.config import PPOConfig
    from ppo_ray.data import read_rows
    from ppo_ray.tasks.pipeline import eval_settings, write_data

    config = PPOConfig.from_yaml(f"{task}-tiny", **overrides)
    data_dir = write_data(config, run_dir)
    rows = {split: read_rows(data_dir / f"prompts_{split}.jsonl")[: config.eval_size] for split in ("test", "validation")}
    task_fields = {"eval_k": config.eval_k} if task == "arith" else {}
    settings = eval_settings(config, {split: (f"data/prompts_{split}.jsonl", r) for split, r in rows.items()},
                             **task_fields)
    return config, settings, rows["test"]


@pytest.mark.parametrize("task", ["tldr", "arith"])
def test_the_before_training_evaluation_is_kept_with_its_settings_and_redone_when_they_change(tmp_path, caplog,
                                                                                              task):
    """eval-before-ppo.json (the SFT policy's held-out evaluation) is paired with the trained
    policy's only when it was computed with the same settings: a resume with another eval_size
    or eval_k (arith), or other held-out rows, evaluates the SFT policy again (at version 0: before
    the restore) and moves the old file aside; the warning names each changed setting."""
    from types import SimpleNamespace

    from ppo_ray.tasks.pipeline import BEFORE_EVAL, before_training

    run = tmp_path / "run"
    calls = []

    def evaluate():
        calls.append(1)
        return {"texts": ["x"] * len(calls)}

    _, settings, _ = bundled_eval(task, run)
    assert before_training(SimpleNamespace(version=0), run, settings, evaluate) == {"texts": ["x"]}
    kept = json.loads((run / BEFORE_EVAL).read_text())
    assert kept["settings"] == settings and kept["settings"]["eval_size"] == 200
    assert list(kept["settings"]["splits"]) == ["test", "validation"]
    # the same settings: the kept numbers, whatever the version (a resumed run)
    assert before_training(SimpleNamespace(version=3), run, settings, evaluate) == {"texts": ["x"]}
    assert len(calls) == 1

    changes = {"eval_size": 50, **({"eval_k": 4} if task == "arith" else {})}
    _, other, _ = bundled_eval(task, tmp_path / "other", **changes)
    with pytest.raises(RuntimeError, match="adapter version 0"):  # a restored trainer cannot redo it
        before_training(SimpleNamespace(version=3), run, other, evaluate)
    assert len(calls) == 1
    with caplog.at_level("WARNING"):
        assert before_training(SimpleNamespace(version=0), run, other, evaluate) == {"texts": ["x", "x"]}
    assert "eval_size: 200 -> 50" in caplog.text and "splits.test.prompts: 200 -> 50" in caplog.text
    assert ("eval_k: 8 -> 4" in caplog.text) == (task == "arith")
    assert json.loads((run / BEFORE_EVAL).read_text())["settings"]["eval_size"] == 50
    [aside] = (run / "replaced").glob(f"*-eval-settings-changed-*/{BEFORE_EVAL}")
    assert json.loads(aside.read_text()) == kept  # moved, never deleted

    # a file of an older version (no settings recorded): evaluated again too
    (run / BEFORE_EVAL).write_text(json.dumps({"texts": ["old"]}))
    assert before_training(SimpleNamespace(version=0), run, other, evaluate) == {"texts": ["x"] * 3}


def test_the_settings_name_the_held_out_rows_they_were_computed_on(tmp_path):
    """Other rows under the same eval_size (data written for another seed) change the digest."""
    from ppo_ray.tasks.pipeline import settings_changes

    _, a, _ = bundled_eval("arith", tmp_path / "a")
    _, b, _ = bundled_eval("arith", tmp_path / "b", seed=1)
    changed = [c.split(":")[0] for c in settings_changes(a, b)]
    assert changed == ["seed", "splits.test.sha256", "splits.validation.sha256"]
    assert settings_changes(a, a) == []


def _metrics(run_dir):
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "kl": 0.1 * s, "reward_mean": 0.5}) + "\n" for s in (1, 2)))
    return path


def test_a_tldr_report_that_cannot_pair_its_evaluations_says_so_and_writes_the_rest(tmp_path, caplog):
    """SFT numbers on 4 posts, PPO's on 2 (what a resume with a smaller eval_size used to pair):
    no traceback at the end of the stage; the error is logged and named in the report, and what
    can be computed is written."""
    from ppo_ray.tasks.tldr_task import tldr_report
    from ppo_ray.tasks.tldr_synth import gold_score

    run = tmp_path / "run"
    _, _, rows = bundled_eval("tldr", run)

    def evaluation(n: int) -> dict:
        texts = [row["summary"] for row in rows[:n]]
        return {"texts": texts, "stops": [True] * n, "gold": [gold_score(r, t, True) for r, t in zip(rows, texts)]}

    sft, ppo = {**evaluation(4), "val": evaluation(4)}, evaluation(2)
    with caplog.at_level("ERROR"):
        report = tldr_report(run, _metrics(run), rows[:2], rows[:2], sft, ppo, evaluation(2))
    assert set(report["report_errors"]) == {"test split's gold numbers", "validation split's gold numbers",
                                            "held_out.jsonl"}
    assert "win_rate needs equal non-zero lengths" in report["report_errors"]["test split's gold numbers"]
    assert "could not be computed" in caplog.text
    assert report["final_kl"] == 0.2 and report["ppo_steps"] == 2 and report["eval_prompts"] == 2
    assert (run / "curves.png").is_file() and (run / "samples.md").is_file()
    # paired evaluations: the full report, no errors
    report = tldr_report(run, _metrics(run), rows[:2], rows[:2], {**evaluation(2), "val": evaluation(2)}, ppo,
                         evaluation(2))
    assert "report_errors" not in report and report["win_rate_ppo_vs_sft"] == 0.5


@pytest.mark.parametrize("sft_problems, sft_k, error", [
    (4, 4, "of 4 and 2 problems"),  # a smaller eval_size: used to be compared silently
    (2, 8, "pass@4 needs 4 samples per problem"),  # a smaller eval_k: used to fail at the end
    (2, 2, "pass@4 needs 4 samples per problem"),  # a larger one: used to give a wrong pass@k, silently
])
def test_an_arith_report_refuses_unpaired_evaluations_and_writes_the_rest(tmp_path, sft_problems, sft_k, error):
    from ppo_ray.tasks.arith import arith_report

    run = tmp_path / "run"
    _, _, rows = bundled_eval("arith", run)

    def evaluation(n: int, k: int) -> dict:
        right = [str(r["answer"]) for r in rows[:n]]
        return {"greedy": right, "greedy_finish": ["stop"] * n, "greedy_right": [True] * n,
                "samples": [right[i:i + 1] * k for i in range(n)], "samples_finish": [["stop"] * k] * n,
                "right": [k] * n}

    sft = {**evaluation(sft_problems, sft_k), "val": evaluation(sft_problems, sft_k)}
    report = arith_report(run, _metrics(run), 4, rows[:2], rows[:2], sft, evaluation(2, 4), evaluation(2, 4))
    assert set(report["report_errors"]) >= {"test split's pass rates", "validation split's pass rates"}
    assert error in report["report_errors"]["test split's pass rates"]
    assert report["rl_steps"] == 2 and report["eval_k"] == 4 and (run / "curves.png").is_file()
    report = arith_report(run, _metrics(run), 4, rows[:2], rows[:2], {**evaluation(2, 4), "val": evaluation(2, 4)},
                          evaluation(2, 4), evaluation(2, 4))
    assert "report_errors" not in report and report["pass4_test_sft"] == report["pass4_test_rl"] == 1.0


def test_read_metrics_skips_blank_lines(tmp_path):
    from ppo_ray.tasks.pipeline import read_metrics

    (tmp_path / "m.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n  \n')
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 1}, {"step": 2}]


def test_samples_tables_escape_cells_and_keep_n_rows(tmp_path):
    from ppo_ray.tasks.pipeline import write_held_out_texts
    from ppo_ray.tasks.tldr_task import write_samples

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
