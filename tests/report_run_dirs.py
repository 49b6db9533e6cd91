"""Run directories as the pipeline leaves them, without Ray: each file written by the code that
writes it in a real run (the bundled tasks' data and judges, StepResult.scalars() rows for
metrics.jsonl, tldr_task.write_samples, arith.write_arith_samples, pipeline.plot_curves, PPOConfig.to_yaml,
rundir.mark_done), with the report's keys as the tasks' reports build them. The texts
are the tasks' own reference answers, plus one hostile sample (SCRIPT). For
tests/test_report_page.py and benchmarks/report_page_browser.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

SCRIPT = "<script>document.title='pwned'</script> & <b>bold</b>"


def _metrics(run_dir: Path, steps: int, eval_key: str, eval_values: list[float]) -> Path:
    from helpers import step_result  # a real StepResult: its scalars() are the JSONL's line

    path = run_dir / "metrics.jsonl"
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            extra = {}
            if step % 2 == 0 or step == steps:  # eval_every 2, and the last step
                extra = {eval_key: eval_values[min(step // 2, len(eval_values) - 1)], "eval_reward_mean": 0.1 * step}
            timing = dataclasses.replace(step_result().timing, step_s=2.0 + 0.1 * step, generate_s=0.5 + 0.01 * step)
            result = dataclasses.replace(step_result(rewards=(0.1 * step, 0.2 * step, 0.3)), step=step,
                                         timing=timing, extra=extra)
            f.write(json.dumps(result.scalars()) + "\n")
    return path


def _eval_samples(run_dir: Path, prompts: list[str], responses: list[str], steps: int) -> None:
    with open(run_dir / "eval_samples.jsonl", "w") as f:
        for step in range(2, steps + 1, 2):
            for p, r in zip(prompts, responses):
                f.write(json.dumps({"step": step, "prompt": p, "response": r, "reward": 0.5,
                                    "finish_reason": "stop"}) + "\n")


def _attribution(run_dir: Path, prompts: list[str], texts: list[str], steps: int, critic: bool) -> None:
    """attribution.jsonl as the trainer appends it (RolloutAttribution.as_dict of sa_pairs), at
    every evaluation: the texts cut into word tokens with an EOS, made-up numbers that vary
    along each response (a critic's value, TD error and return; a group estimator's baseline)."""
    import re

    import torch

    from ppo_ray.attribution import AttributionRows, sa_pairs

    words = [re.findall(r"\s*\S+", t) + ["<eos>"] for t in texts]
    vocab = sorted({w for ws in words for w in ws} | {"<pad>"} | set(prompts))
    index = {w: i for i, w in enumerate(vocab)}
    n, width = len(texts), max(len(ws) for ws in words)
    ids = torch.tensor([[index[w] for w in ws] + [index["<pad>"]] * (width - len(ws)) for ws in words])
    mask = torch.tensor([[t < len(ws) for t in range(width)] for ws in words])
    pos = torch.arange(width, dtype=torch.float32).expand(n, width)
    row = torch.arange(n, dtype=torch.float32)[:, None]

    def per_token(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, torch.zeros(()))

    with open(run_dir / "attribution.jsonl", "w") as f:
        for step in range(2, steps + 1, 2):
            kl = per_token(0.3 * torch.sin(pos + row + step))
            adv = per_token(torch.cos(0.7 * pos - row) * (1 + 0.1 * step))
            values = per_token(0.1 * pos - row)
            rows = AttributionRows(
                rows=list(range(n)), version=step - 1, prompt_ids=torch.tensor([[index[p]] for p in prompts]),
                prompt_mask=torch.ones(n, 1, dtype=torch.bool), response_ids=ids, mask=mask, loss_mask=mask,
                gen_logprobs=per_token(-0.5 - 0.1 * pos), old_logprobs=per_token(-0.5 - 0.1 * pos),
                ref_logprobs=per_token(-0.5 - 0.1 * pos) - kl, kl=kl, rewards=-0.05 * kl, advantages=adv,
                scores=0.5 - 0.25 * row[:, 0], values=values if critic else None,
                td_errors=per_token(adv - 0.1) if critic else None, returns=adv + values if critic else None,
                baselines=None if critic else torch.full((n,), 0.25, dtype=torch.float64),
                groups=None if critic else torch.arange(n) // 2, estimator="gae" if critic else "grpo",
                kl_coef=0.05, whitened=critic)
            held = AttributionRows(  # the evaluation's held-out samples: logprobs and KL_t only
                rows=list(range(n)), version=step, prompt_ids=rows.prompt_ids, prompt_mask=rows.prompt_mask,
                response_ids=ids, mask=mask, loss_mask=None, gen_logprobs=rows.gen_logprobs, old_logprobs=None,
                ref_logprobs=rows.gen_logprobs - 2 * kl, kl=2 * kl, rewards=None, advantages=None, scores=None,
                values=None, td_errors=None, returns=None, baselines=None, groups=None, estimator="", kl_coef=0.0,
                whitened=False, held_out=True)
            for view in (rows, held):
                f.writelines(json.dumps(r.as_dict()) + "\n"
                             for r in sa_pairs(view, lambda i: "".join(vocab[k] for k in i), step))


def _run_file(run_dir: Path, stages: dict[str, dict]) -> None:
    from ppo_ray.machine import machine_info
    from ppo_ray.driver.rundir import mark_done
    from ppo_ray.tracking import update_run_file

    update_run_file(run_dir, run_tag="run-0001", run_tags=["run-0001"],
                    environment={**machine_info(), "recorded": time.strftime("%Y-%m-%d %H:%M:%S")})
    for stage, stats in stages.items():
        mark_done(run_dir, stage, stats)


def tldr_run(run_dir: Path, steps: int = 6) -> dict:
    """A finished `launch.py` (stage all) on the bundled TL;DR task; returns its report."""
    from ppo_ray.config import PPOConfig, resolve_config
    from ppo_ray.data import read_rows
    from ppo_ray.tasks.pipeline import plot_curves
    from ppo_ray.tasks.tldr_task import write_held_out, write_samples
    from ppo_ray.tasks.tldr_synth import copy_accuracy, gold_score, win_rate, write_task

    run_dir.mkdir(parents=True)
    PPOConfig.from_yaml(resolve_config("tldr-tiny"), steps=steps).to_yaml(run_dir / "config.yaml")
    write_task(run_dir / "data", seed=0, n_train=20, n_val=8, n_test=12, ideal_fraction=0.3)
    rows = read_rows(run_dir / "data" / "prompts_test.jsonl")
    sft_texts = [row["summary"] for row in rows]
    ppo_texts = [SCRIPT] + sft_texts[1:]
    def judged(texts: list[str]) -> dict:  # run_ppo's judge(): texts, EOS flags, gold scores
        return {"texts": texts, "stops": [True] * len(rows), "gold": [gold_score(r, t, True) for r, t in zip(rows, texts)]}

    sft, ppo = judged(sft_texts), judged(ppo_texts)
    sft_stats = {"sft_train_loss_first": 3.2, "sft_train_loss_last": 0.41, "sft_steps": 40, "sft_seconds": 61.3,
                 "sft_val_loss": 0.52, "sft_copy_greedy_val": copy_accuracy(rows, sft_texts)}
    rm_stats = {"rm_train_loss_last": 0.45, "rm_train_accuracy_last": 0.8, "rm_steps": 20, "rm_seconds": 30.2,
                "rm_val_accuracy": 0.74, "rm_val_accuracy_by_kind": {"wrong": 0.51, "distractor": 0.47}}
    metrics = _metrics(run_dir, steps, "gold_val", [0.7, 0.8, 0.85, 0.9])
    history = [json.loads(line) for line in metrics.read_text().splitlines()]
    ref_gold = sft["gold"]
    ppo_report = {
        "gold_test_sft": sum(sft["gold"]) / len(rows), "gold_test_ppo": sum(ppo["gold"]) / len(rows),
        "gold_test_reference": sum(ref_gold) / len(rows),
        "win_rate_ppo_vs_sft": win_rate(ppo["gold"], sft["gold"]),
        "win_rate_sft_vs_reference": win_rate(sft["gold"], ref_gold),
        "win_rate_ppo_vs_reference": win_rate(ppo["gold"], ref_gold),
        "final_kl": history[-1]["kl"], "final_reward": history[-1]["reward_mean"], "ppo_steps": len(history),
        "eval_prompts": len(rows), "copy_test_sft": copy_accuracy(rows, sft_texts),
        "copy_test_ppo": copy_accuracy(rows, ppo_texts),
        "gold_val_sft": 0.7, "gold_val_ppo": 0.875, "win_rate_val_ppo_vs_sft": 0.75}
    write_held_out(run_dir / "held_out.jsonl", {"test": (sft, ppo)})
    write_samples(run_dir / "samples.md", rows, sft_texts, sft["gold"], ppo_texts, ppo["gold"])
    plot_curves(metrics, run_dir / "curves.png", ppo_report["gold_val_sft"])
    _eval_samples(run_dir, [r["prompt"] for r in rows[:3]], ppo_texts[:3], steps)
    _attribution(run_dir, [r["prompt"] for r in rows[:4]], ppo_texts[:4], steps, critic=True)
    _run_file(run_dir, {"sft": sft_stats, "rm": rm_stats, "ppo": ppo_report})
    report = {"run_dir": str(run_dir), **sft_stats, **rm_stats, **ppo_report, "seconds": 412.7, "run_tag": "run-0001"}
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report


def arith_run(run_dir: Path, steps: int = 8, k: int = 8) -> dict:
    """A finished `launch.py --config arith-tiny` (sft, then RL with the verifier); returns its report."""
    from ppo_ray.config import PPOConfig, resolve_config
    from ppo_ray.data import read_rows
    from ppo_ray.tasks.arith import is_right, pass_at_k, write_task
    from ppo_ray.tasks.arith import write_arith_samples
    from ppo_ray.tasks.pipeline import plot_curves

    run_dir.mkdir(parents=True)
    PPOConfig.from_yaml(resolve_config("arith-tiny"), steps=steps).to_yaml(run_dir / "config.yaml")
    write_task(run_dir / "data", seed=0, sizes={"sft_train": 30, "sft_validation": 5, "prompts_train": 20,
                                                "prompts_validation": 10, "prompts_test": 10})
    rows = read_rows(run_dir / "data" / "prompts_test.jsonl")

    def solve(wrong_every: int, hostile: bool = False) -> dict:
        greedy = [r["answer"] if i % wrong_every else str(int(r["answer"]) - 10) for i, r in enumerate(rows)]
        if hostile:
            greedy[1] = SCRIPT + " | 12"
        right = [is_right(r["prompt"], g, "stop") for r, g in zip(rows, greedy)]
        counts = [k - (i % 3) if ok else i % 3 for i, ok in enumerate(right)]
        return {"greedy": greedy, "greedy_right": right, "right": counts}

    sft, rl = solve(2), solve(5, hostile=True)
    report = {}
    for who, res in (("sft", sft), ("rl", rl)):
        report[f"pass1_test_{who}"] = sum(res["greedy_right"]) / len(rows)
        report[f"pass{k}_test_{who}"] = sum(pass_at_k(k, c, k) for c in res["right"]) / len(rows)
        report[f"sample_accuracy_test_{who}"] = sum(c / k for c in res["right"]) / len(rows)
    report.update({"pass1_val_sft": 0.6, f"pass{k}_val_sft": 0.9, "sample_accuracy_val_sft": 0.55,
                   "pass1_val_rl": 0.8, f"pass{k}_val_rl": 0.95, "sample_accuracy_val_rl": 0.7})
    metrics = _metrics(run_dir, steps, "pass1_val", [0.6, 0.7, 0.75, 0.8])
    history = [json.loads(line) for line in metrics.read_text().splitlines()]
    report.update({"final_kl": history[-1]["kl"], "final_reward": history[-1]["reward_mean"],
                   "rl_steps": len(history), "eval_prompts": len(rows), "eval_k": k})
    write_arith_samples(run_dir / "samples.md", rows, sft, rl, k)
    _attribution(run_dir, [r["prompt"] for r in rows[:4]], rl["greedy"][:4], steps, critic=False)
    plot_curves(metrics, run_dir / "curves.png", report["pass1_val_sft"], gold_key="pass1_val",
                gold_title="pass@1 (held-out validation, greedy)", reward_title="verifier reward (share right)")
    sft_stats = {"sft_train_loss_first": 2.1, "sft_train_loss_last": 0.3, "sft_steps": 50, "sft_seconds": 20.5}
    _run_file(run_dir, {"sft": sft_stats, "ppo": report})
    full = {"run_dir": str(run_dir), **sft_stats, **report, "seconds": 180.4, "run_tag": "run-0001"}
    (run_dir / "report.json").write_text(json.dumps(full, indent=2))
    return full


def plain_run(run_dir: Path, steps: int = 4) -> dict:
    """A finished plain `launch.py ppo --config tiny` (reward_funcs, no samples.md or curves.png)."""
    from ppo_ray.config import PPOConfig, resolve_config

    run_dir.mkdir(parents=True)
    PPOConfig.from_yaml(resolve_config("tiny"), steps=steps).to_yaml(run_dir / "config-ppo.yaml")
    metrics = _metrics(run_dir, steps, "eval_reward_mean", [0.1, 0.2, 0.3])
    history = [json.loads(line) for line in metrics.read_text().splitlines()]
    _eval_samples(run_dir, ["SUBREDDIT: r/a\nPOST: hello\nTL;DR:", SCRIPT], ["eeee", "ok"], steps)
    report = {"steps": len(history), "first_reward": history[0]["reward_mean"],
              "last_reward": history[-1]["reward_mean"], "final_kl": history[-1]["kl"]}
    _run_file(run_dir, {"ppo": report})
    full = {"run_dir": str(run_dir), **report, "seconds": 55.0, "run_tag": "run-0001"}
    (run_dir / "report-ppo.json").write_text(json.dumps(full, indent=2))
    return full
