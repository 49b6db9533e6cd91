"""The RLHF pipeline on the bundled task: SFT -> reward model -> PPO, judged by the gold judge.

    run_dir/
      config.yaml          the config used
      data/                the bundled task's splits (JSONL), written deterministically
      sft/                 the SFT checkpoint (policy start and frozen reference)
      rm/                  the reward model (and the value model's initialisation)
      metrics.jsonl        one line per PPO step (+ gold evaluations every eval_every steps)
      adapter/             the final policy LoRA (PEFT format)
      curves.png           reward, KL, gold score and losses over steps
      samples.md           before/after summaries of held-out prompts
      report.json          the summary printed at the end

The gold judge (ppo_ray.tldr_synth) is used only here, to evaluate: SFT learns from the
reference summaries, the reward model from the preference pairs, PPO from the reward model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ppo_ray.config import PPOConfig
from ppo_ray.data import column, read_rows


def _encode(tok, prompts, responses):
    q = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in responses]
    return q, r


def write_data(config: PPOConfig, run_dir: Path) -> Path:
    from ppo_ray.tldr_synth import write_task

    data_dir = run_dir / "data"
    write_task(data_dir, seed=config.seed)
    return data_dir


def run_sft(config: PPOConfig, run_dir: Path, data_dir: Path) -> dict:
    from learner.stages import TrainSettings, train_sft
    from ppo_ray.modeling import load_tokenizer, resolve_model_path

    base = resolve_model_path(config.model_name)
    tok = load_tokenizer(base)
    train = read_rows(data_dir / "sft_train.jsonl")
    val = read_rows(data_dir / "sft_validation.jsonl")
    src = str(data_dir / "sft_train.jsonl")
    q, r = _encode(tok, column(train, "prompt", src), column(train, "summary", src))
    vq, vr = _encode(tok, column(val, "prompt", src), column(val, "summary", src))
    settings = TrainSettings(epochs=config.sft_epochs, learning_rate=config.sft_learning_rate,
                             batch_size=config.stage_batch_size, seed=config.seed, dtype=config.dtype)
    return train_sft(base, q, r, run_dir / "sft", settings, val=(vq, vr))


def run_rm(config: PPOConfig, run_dir: Path, data_dir: Path) -> dict:
    from learner.stages import TrainSettings, train_reward_model
    from ppo_ray.modeling import load_tokenizer

    sft = str(run_dir / "sft")
    tok = load_tokenizer(sft)

    def load(split):
        path = data_dir / f"preferences_{split}.jsonl"
        rows = read_rows(path)
        prompts = column(rows, "prompt", str(path))
        q, c = _encode(tok, prompts, column(rows, "chosen", str(path)))
        _, r = _encode(tok, prompts, column(rows, "rejected", str(path)))
        return q, c, r

    settings = TrainSettings(epochs=config.rm_epochs, learning_rate=config.rm_learning_rate,
                             batch_size=config.stage_batch_size, seed=config.seed, dtype=config.dtype)
    return train_reward_model(sft, *load("train"), run_dir / "rm", settings, val=load("validation"))


def ppo_config(config: PPOConfig, run_dir: Path, data_dir: Path) -> PPOConfig:
    """The PPO stage's config: policy and reference = SFT, reward = RM. The value model is
    the SFT backbone with a zero head unless config.value_model_name says otherwise ("rm"
    = the run's reward model, the N+ recipe's init)."""
    value = config.value_model_name
    if value == "rm":
        value = str(run_dir / "rm")
    return config.replace(
        model_name=str(run_dir / "sft"), ref_model_name=None, reward_model_name=str(run_dir / "rm"),
        value_model_name=value, reward_funcs=[], reward_weights=[],
        dataset=str(data_dir / "prompts_train.jsonl"), prompt_column="prompt")


def run_ppo(config: PPOConfig, run_dir: Path, data_dir: Path) -> dict:
    from ppo_ray.data import load_prompts
    from ppo_ray.tldr_synth import gold_score
    from ppo_ray.trainer import PPOTrainer

    cfg = ppo_config(config, run_dir, data_dir)
    test_rows = read_rows(data_dir / "prompts_test.jsonl")[: cfg.eval_size]
    val_rows = read_rows(data_dir / "prompts_validation.jsonl")[: cfg.eval_size]

    def judge(trainer: PPOTrainer, rows: list[dict]) -> tuple[dict, list[float]]:
        out = trainer.generate([row["prompt"] for row in rows])
        golds = [gold_score(row, text, reason == "stop")
                 for row, text, reason in zip(rows, out["texts"], out["finish_reasons"])]
        return out, golds

    def evaluate(trainer: PPOTrainer, step: int) -> dict:
        _, golds = judge(trainer, val_rows)
        return {"gold_val": sum(golds) / len(golds)}

    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a rerun of the stage starts a fresh curve
    trainer = PPOTrainer(cfg, run_dir=run_dir)
    try:
        sft_out, sft_gold = judge(trainer, test_rows)  # version 0: the SFT policy itself
        history = trainer.train(load_prompts(cfg), metrics_path=metrics, evaluate=evaluate)
        ppo_out, ppo_gold = judge(trainer, test_rows)
        trainer.save_adapter(run_dir / "adapter")
    finally:
        trainer.shutdown()

    wins = [1.0 if p > s else 0.5 if p == s else 0.0 for p, s in zip(ppo_gold, sft_gold)]
    report = {
        "gold_test_sft": sum(sft_gold) / len(sft_gold),
        "gold_test_ppo": sum(ppo_gold) / len(ppo_gold),
        "win_rate_ppo_vs_sft": sum(wins) / len(wins),
        "final_kl": history[-1]["kl"],
        "final_reward": history[-1]["reward_mean"],
        "ppo_steps": len(history),
        "eval_prompts": len(test_rows),
    }
    write_samples(run_dir / "samples.md", test_rows, sft_out["texts"], sft_gold, ppo_out["texts"], ppo_gold)
    plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    return report


def write_samples(path: Path, rows, sft_texts, sft_gold, ppo_texts, ppo_gold, n: int = 12) -> None:
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| # | post (start) | SFT summary | gold | PPO summary | gold |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(rows[:n]):
        post = row.get("post", row["prompt"])[:80]
        lines.append(f"| {i} | {cell(post)}... | {cell(sft_texts[i])} | {sft_gold[i]:.2f} | "
                     f"{cell(ppo_texts[i])} | {ppo_gold[i]:.2f} |")
    path.write_text("# Held-out summaries before (SFT) and after PPO\n\n" + "\n".join(lines) + "\n")


def plot_curves(metrics_path: Path, out_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    panels = [("reward_mean", "reward-model score"), ("kl", "KL to SFT (nats/seq)"),
              ("gold_val", "gold score (held-out)"), ("policy_loss", "policy loss"),
              ("value_loss", "value loss"), ("clipfrac", "clip fraction")]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(s, r[key]) for s, r in zip(steps, rows) if key in r and r[key] is not None
               and math.isfinite(r[key])]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "gold_val" else None)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
