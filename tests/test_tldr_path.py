"""The real TL;DR path through launch.py: the Qwen3 preset with its data fields pointed at small
local JSONL / parquet files in the hub schemas, on the embedded tiny model (no network)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import launch
from ppo_ray.tasks import tldr
from ppo_ray.config import ConfigError, PPOConfig

ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "configs" / "qwen3-0.6b-tldr.yaml"
# Never reach a hub, whatever a test does by mistake.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

SUBREDDITS = ("relationships", "AskReddit", "personalfinance", "tifu")
TOPICS = ("car loan", "noisy neighbour", "lost passport", "new job", "broken laptop", "late rent")
LONG_POST = "\n".join(["My partner has been working late every night for weeks and we barely talk anymore."] * 8)


def sft_row(i: int) -> dict:
    topic = TOPICS[i % len(TOPICS)]
    post = (LONG_POST if i == 0 else  # over 256 tiny-model tokens: cut at its last newline
            f"I have a {topic} problem.\nIt started {i % 5 + 2} weeks ago and keeps getting worse.\nWhat now?")
    summary = f"{topic} for {i % 5 + 2} weeks"
    if i == 1:  # over max_new_tokens=24 tokens: dropped from SFT and counted
        summary += ", it keeps getting worse every single day and nobody helps, what now?"
    return {"id": f"t3_{i}", "subreddit": SUBREDDITS[i % len(SUBREDDITS)], "title": f"Help with my {topic}",
            "post": post, "summary": summary}


def comparison_row(i: int) -> dict:
    """openai/summarize_from_feedback "comparisons": nested info, two summaries, choice."""
    row = sft_row(i)
    good, bad = f" {row['summary']}", " i dont know"
    choice = i % 2
    texts = [good, bad] if choice == 0 else [bad, good]
    return {"info": {"id": row["id"], "post": row["post"], "title": row["title"], "subreddit": row["subreddit"],
                     "site": None, "article": None},
            "summaries": [{"text": texts[0], "policy": "sup1", "note": None},
                          {"text": texts[1], "policy": "ref", "note": None}],
            "choice": choice, "worker": "w0", "batch": "batch3", "split": "train", "extra": {"confidence": 5}}


def cnndm_row() -> dict:
    row = comparison_row(99)
    row["batch"] = "cnndm0"
    row["info"].update(post=None, article="The article text.", subreddit=None, site="cnn")
    return row


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """sft/ is a folder (train.jsonl, validation.parquet); preferences are one file per split
    named by prefs_{split}.parquet / .jsonl: both layouts and both formats."""
    d = tmp_path_factory.mktemp("tldr")
    write(d / "sft" / "train.jsonl", [sft_row(i) for i in range(24)])
    write(d / "sft" / "validation.parquet", [sft_row(i) for i in range(100, 108)])
    write(d / "prefs_train.parquet", [comparison_row(i) for i in range(24)])
    write(d / "prefs_validation.parquet", [comparison_row(i) for i in range(100, 108)] + [cnndm_row()])
    return d


def tiny_args(data: Path, **overrides) -> list[str]:
    """The Qwen3 preset on the embedded tiny model, float32 on the CPU, tiny stages (their Ray
    tasks reserve no GPU: the preset's learner_num_gpus would)."""
    fields = dict(model_name="embedded:tiny", dtype="float32", stage_dtype="null", stage_num_gpus=0,
                  sft_dataset=str(data / "sft"), preference_dataset=str(data / "prefs_{split}.parquet"),
                  max_prompt_length=256, max_new_tokens=24, sft_epochs=1, rm_epochs=1, stage_batch_size=8,
                  sft_learning_rate=1e-3, rm_learning_rate=3e-4)
    fields.update(overrides)
    return ["--config", str(PRESET), *[a for k, v in fields.items() for a in (f"--{k}", str(v))]]


def run_launch(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE, "RAY_ADDRESS": ""}
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sft_run(data, tiny_model_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "run"
    proc = run_launch(["sft", "--run_dir", str(run_dir), *tiny_args(data)], cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


# --------------------------------------------------------------------------- the preset


def test_qwen3_preset_holds_the_n_plus_settings():
    cfg = PPOConfig.from_yaml(PRESET)
    assert cfg.model_name == "Qwen/Qwen3-0.6B-Base"
    assert (cfg.sft_dataset, cfg.preference_dataset, cfg.preference_config) == (
        tldr.SFT_DATASET, tldr.PREFERENCE_DATASET, tldr.PREFERENCE_CONFIG)
    assert not cfg.uses_bundled_data
    assert cfg.max_prompt_length == tldr.MAX_QUERY_LENGTH == 512
    assert cfg.max_new_tokens == tldr.MAX_SFT_RESPONSE_LENGTH == 53
    assert (cfg.temperature, cfg.top_k, cfg.top_p) == (0.7, 0, 1.0)  # temperature only
    assert cfg.missing_eos_penalty == -1.0
    assert (cfg.kl_coef, cfg.kl_estimator, cfg.gamma, cfg.lam) == (0.05, "k1", 1.0, 0.95)
    assert (cfg.ppo_epochs, cfg.mini_batch_size, cfg.batch_size) == (4, None, 512)
    assert (cfg.clip_epsilon, cfg.value_clip, cfg.whiten_advantages, cfg.whiten_rewards) == (0.2, 0.2, True, False)
    assert cfg.lora_dropout == 0.0 and cfg.value_model_name == "rm"
    assert (cfg.dtype, cfg.stage_dtype) == ("bfloat16", "float32")
    gpus = cfg.num_generators * cfg.generator_num_gpus + cfg.learner_num_gpus + 2 * cfg.scorer_num_gpus
    assert gpus == pytest.approx(1.0)  # every actor on one shared GPU


def test_data_fields_default_to_the_bundled_task():
    cfg = PPOConfig()
    assert (cfg.sft_dataset, cfg.preference_dataset) == ("bundled", "bundled") and cfg.uses_bundled_data


def test_a_local_file_without_split_is_refused_before_anything_runs(data, tmp_path, capsys):
    code = launch.main(["sft", "--run_dir", str(tmp_path / "run"),
                        *tiny_args(data, sft_dataset=str(data / "sft" / "train.jsonl"))])
    err = capsys.readouterr().err
    assert code == 2 and "'sft_dataset'" in err and "{split}" in err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- the stages


def test_sft_stage_trains_on_local_sft_files(sft_run):
    assert (sft_run / "sft" / "model.safetensors").is_file()
    assert (sft_run / "sft" / "tokenizer_config.json").is_file()
    assert not (sft_run / "data").exists(), "the real path must not write the bundled task"
    report = json.loads((sft_run / "report-sft.json").read_text())
    assert report["sft_train_examples"] == 23 and report["sft_eval_examples"] == 8
    assert report["sft_train_dropped"] == {"response_too_long": 1} and report["sft_eval_dropped"] == {}
    assert report["sft_train_query_cuts"] == {"newline": 1}  # the long post, cut at a newline
    assert isinstance(report["sft_val_loss"], float) and 0 < report["sft_val_loss"] < 100  # finite, a real loss
    saved = PPOConfig.from_yaml(sft_run / "config-sft.yaml")
    assert saved.sft_dataset.endswith("sft") and saved.max_new_tokens == 24


def test_rm_stage_trains_on_local_comparison_files(sft_run, data):
    proc = run_launch(["rm", "--run_dir", str(sft_run), *tiny_args(data)], cwd=sft_run.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (sft_run / "rm" / "model.safetensors").is_file()
    report = json.loads((sft_run / "report-rm.json").read_text())
    assert report["rm_train_examples"] == 24 and report["rm_eval_examples"] == 8
    assert report["rm_eval_dropped"] == {"cnndm": 1}  # the CNN/DM row is skipped, and counted
    # correct pairs out of the 8 validation comparisons (a NaN, or a mean over the wrong rows, fails)
    assert report["rm_val_accuracy"] * 8 in range(9)


# --------------------------------------------------------------------------- bad data


def test_missing_column_exits_2_naming_file_row_and_column(data, tmp_path):
    bad = tmp_path / "bad"
    rows = [sft_row(i) for i in range(4)]
    del rows[2]["summary"]
    write(bad / "train.jsonl", rows)
    write(bad / "validation.jsonl", [sft_row(i) for i in range(100, 102)])
    proc = run_launch(["sft", "--run_dir", str(tmp_path / "run"), *tiny_args(data, sft_dataset=str(bad))],
                      cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: {bad / 'train.jsonl'}: row 2 column 'summary': missing" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "sft").exists()


def test_bad_comparison_row_and_bad_json_are_errors_not_tracebacks(data, tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run_dir / "sft")  # stands in for an SFT checkpoint
    rows = [comparison_row(i) for i in range(4)]
    rows[1]["summaries"][0]["text"] = "  "
    prefs = write(tmp_path / "p_train.parquet", rows)
    write(tmp_path / "p_validation.parquet", [comparison_row(100)])
    code = launch.main(["rm", "--run_dir", str(run_dir),
                        *tiny_args(data, preference_dataset=str(tmp_path / "p_{split}.parquet"))])
    assert code == 2
    assert f"error: {prefs}: row 1 column 'summaries[0].text': is an empty" in capsys.readouterr().err

    write(tmp_path / "q_train.jsonl", [comparison_row(0)])
    (tmp_path / "q_train.jsonl").write_text((tmp_path / "q_train.jsonl").read_text() + "{not json\n")
    code = launch.main(["rm", "--run_dir", str(run_dir),
                        *tiny_args(data, preference_dataset=str(tmp_path / "q_{split}.jsonl"))])
    assert code == 2
    assert f"{tmp_path / 'q_train.jsonl'}: line 2 is not valid JSON" in capsys.readouterr().err
    assert not (run_dir / "rm").exists()


# --------------------------------------------------------------------------- launch.py eval's plan


def real_run(data: Path, tiny_model_dir: Path, run_dir: Path, evaluated: bool) -> tuple[Path, list[str]]:
    """A real-path run directory as `launch.py eval` reads it: sft/ (the embedded model's files),
    a checkpoint of the PPO stage's config (the preset on the local files) from a real learner's
    state, and, when `evaluated`, eval-before-ppo.json as the PPO stage keeps it (run_ppo_real's
    held-out prompts and settings; the SFT policy's texts stand in). Returns it and the held-out
    prompts its PPO stage evaluates on."""
    import torch

    from learner.learner import Learner
    from ppo_ray.driver.checkpoint import save_checkpoint
    from ppo_ray.config import parse_overrides
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.tasks import pipeline

    shutil.copytree(tiny_model_dir, run_dir / "sft")
    config = parse_overrides(tiny_args(data, value_model_name="null"))[0]
    cfg = pipeline.ppo_config(config, run_dir, run_dir / "data")
    save_checkpoint(run_dir, config=cfg, learner_state=Learner(cfg, str(run_dir / "sft")).state_dict(),
                    model_dir=str(run_dir / "sft"),
                    trainer_state={"step": 1, "order": [], "data_rng": torch.Generator().get_state()})
    held_out, settings = pipeline.real_held_out(config, cfg, load_tokenizer(cfg.model_name))
    if evaluated:
        from types import SimpleNamespace

        pipeline.before_training(SimpleNamespace(version=0), run_dir, settings,
                                 lambda: {"texts": [""] * len(held_out)})
    return run_dir, held_out


@pytest.mark.parametrize("evaluated", [True, False])
def test_eval_defaults_to_the_split_the_ppo_stage_evaluated_on(data, tiny_model_dir, tmp_path, evaluated):
    """The real path's PPO stage samples its held-out prompts from eval_split (the preset's
    `validation`); `launch.py eval RUN_DIR` takes the same prompts by default: the split its
    eval-before-ppo.json records, or (a run of an older version, no record) the stage's
    eval_split. It used to default to `test`, a split the run never evaluated on (the local
    files here have none)."""
    from ppo_ray.tasks.evaluate import plan

    run_dir, held_out = real_run(data, tiny_model_dir, tmp_path / "run", evaluated)
    p = plan([str(run_dir), "--out", str(tmp_path / "out")])
    assert p.kind == "reward" and p.source == f"validation split of {data / 'sft'}" and p.tag == "val"
    assert [row["prompt"] for row in p.rows] == held_out and len(held_out) == 8  # validation.parquet's rows
    if evaluated:
        from ppo_ray.tasks.pipeline import BEFORE_EVAL

        recorded = json.loads((run_dir / BEFORE_EVAL).read_text())["settings"]["splits"]
        assert list(recorded) == ["validation"] and recorded["validation"]["prompts"] == len(held_out)


# --------------------------------------------------------------------------- PPO (slow: Ray + vLLM)


@pytest.mark.slow
def test_all_stages_on_local_tldr_files_report_rm_score_and_kl(data, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data, steps=2, batch_size=4, micro_batch_size=4, eval_size=4, generator_num_gpus=0,
                     learner_num_gpus=0, scorer_num_gpus=0, vllm_kv_cache_gib=0.25, learning_rate=3e-4)
    proc = run_launch(["--run_dir", str(run_dir), *args], cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    for key in ("sft_val_loss", "rm_val_accuracy", "first_reward", "final_reward", "final_kl"):
        assert isinstance(report[key], float) and math.isfinite(report[key]), key
    assert report["ppo_steps"] == 2 and report["eval_prompts"] == 4 and report["ppo_prompts"] == 24
    assert not any(k.startswith("gold") or k.startswith("win_rate") for k in report)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and not any("gold_val" in m for m in metrics)
    for name in ("samples.md", "curves.png", "adapter/adapter_model.safetensors"):
        assert (run_dir / name).is_file(), name

    # `launch.py eval` on the held-out split the PPO stage sampled (eval_split: validation), its
    # default: the same samples (the SFT policy's as kept in eval-before-ppo.json, both in
    # samples.md), and the reward model's mean score of each policy's
    out = tmp_path / "eval"
    proc = run_launch(["eval", str(run_dir), "--out", str(out)], cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ev = json.loads((out / "eval.json").read_text())
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert ev["policies"] == ["sft", "ppo"] and ev["eval_prompts"] == len(samples) == 4
    assert [s["sft"] for s in samples] == json.loads((run_dir / "eval-before-ppo.json").read_text())["texts"]
    assert (out / "samples.md").read_text() == (run_dir / "samples.md").read_text()
    for who in ("sft", "ppo"):
        assert ev[f"reward_val_{who}"] == sum(s[f"{who}_reward"] for s in samples) / 4
