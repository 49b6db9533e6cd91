"""End to end from the user's side: launch.py as a subprocess, and the README's example."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_launch_runs_ppo_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ""}  # a local Ray of its own
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "ppo", "--config", str(ROOT / "configs" / "tiny.yaml"),
         "--steps", "2", "--batch_size", "4",
         "--run_dir", str(run_dir), "--vllm_kv_cache_gib", "0.25"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"step\s+2\s+reward [+-]\d", proc.stdout)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert "batch_size: 4" in (run_dir / "config-ppo.yaml").read_text()
    assert (run_dir / "adapter" / "adapter_config.json").is_file()


def test_launch_rejects_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--kl_coeff", "0.1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "did you mean --kl_coef?" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--gamma", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "'gamma' = 2.0 is invalid" in proc.stderr
    assert not any(tmp_path.iterdir()), "a rejected command must not write a run directory"


def test_readme_example_runs_as_written(ray_session):
    """The README's Python example (the seeds' example with the embedded preset)."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Usage\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    try:
        results = namespace["results"]
        assert len(results["generated_texts"]) == len(results["rewards"]) == 2
        assert results["adapter_version"] == 1
    finally:
        namespace["trainer"].shutdown()


def test_all_stages_end_to_end_on_the_bundled_task(tmp_path):
    """`launch.py` with no stage: data -> SFT -> reward model -> PPO -> report (short)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--run_dir", str(run_dir), "--steps", "2",
         "--sft_epochs", "1", "--rm_epochs", "1", "--eval_size", "8", "--eval_every", "1",
         "--vllm_kv_cache_gib", "0.25"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    for key in ("sft_val_loss", "rm_val_accuracy", "gold_test_sft", "gold_test_ppo", "win_rate_ppo_vs_sft",
                "final_kl"):
        assert isinstance(report[key], float), key
    assert report["rm_val_accuracy"] > 0.5
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("gold_val" in m for m in metrics)
    for name in ("curves.png", "samples.md", "config.yaml", "sft/model.safetensors", "rm/model.safetensors",
                 "adapter/adapter_model.safetensors", "data/prompts_test.jsonl"):
        assert (run_dir / name).is_file(), name
    # the final adapter loads with PEFT over the SFT checkpoint
    from peft import PeftModel

    from ppo_ray.modeling import load_causal_lm

    PeftModel.from_pretrained(load_causal_lm(str(run_dir / "sft")), str(run_dir / "adapter"))
