"""The bundled TL;DR-style task as a registered task (``task: tldr``): its data (ppo_ray.tasks.
tldr_synth's writer, for the seed and bundled_ideal_fraction), its stages (sft, rm, ppo: the
reward is the reward model its rm stage trains on the preference pairs), its SFT targets (the
posters' reference summaries), its evaluation (the gold judge, which training never sees:
ppo_ray.tasks.evaluation.judge and tldr_numbers) and report.json's keys (gold_*, win_rate_*,
copy_*), with held_out.jsonl and samples.md behind them.

The real path (sft_dataset / preference_dataset named: ppo_ray.tasks.tldr's loaders) is this
task on other data; ppo_ray.tasks.pipeline reads it there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from ppo_ray.tasks.base import Task
from ppo_ray.tasks.pipeline import HELD_OUT, final_rewards, plot_curves, read_metrics, report_part

BEST_OF_N = 8  # the reward model's best-of-n diagnostic (rm_report)


class TLDRTask(Task):
    name = "tldr"
    stages = ("sft", "rm", "ppo")
    sft_target = "summary"
    verifier = None  # the reward model of the rm stage

    def data_spec(self, config) -> dict:
        return {"task": config.task, "seed": config.seed, "ideal_fraction": config.bundled_ideal_fraction}

    def write_data(self, data_dir: Path, config) -> None:
        from ppo_ray.tasks.tldr_synth import write_task

        write_task(data_dir, seed=config.seed, ideal_fraction=config.bundled_ideal_fraction)

    def sft_report(self, config, run_dir: Path, data_dir: Path) -> dict:
        """The SFT policy's fact copying, greedy, on validation posts (gold judge)."""
        from ppo_ray.data import read_rows
        from ppo_ray.tasks.tldr_eval import sft_copy_report

        rows = read_rows(data_dir / "prompts_validation.jsonl")[: config.eval_size]
        return {"sft_copy_greedy_val": sft_copy_report(str(run_dir / "sft"), rows, config.max_new_tokens)}

    def rm_report(self, config, run_dir: Path, data_dir: Path, correct: list) -> dict:
        """Can the reward model guide PPO? Its validation accuracy by pair kind and best-of-n by the
        gold judge (ppo_ray/tasks/tldr_eval.py; validation split)."""
        from ppo_ray.data import column, read_rows
        from ppo_ray.tasks.tldr_eval import accuracy_by_kind, reward_model_report

        path = data_dir / "preferences_validation.jsonl"
        kinds = column(read_rows(path), "kind", str(path))
        out = {"rm_val_accuracy_by_kind": accuracy_by_kind(correct, kinds)}
        rows = read_rows(data_dir / "prompts_validation.jsonl")[: config.eval_size]
        out[f"rm_best_of_{BEST_OF_N}_val"] = reward_model_report(
            str(run_dir / "sft"), str(run_dir / "rm"), rows, n=BEST_OF_N, temperature=config.temperature,
            max_new_tokens=config.max_new_tokens, missing_eos_penalty=config.missing_eos_penalty, seed=config.seed)
        return out

    def evaluate(self, trainer, cfg, rows: Sequence[dict], *, label: Optional[str] = None) -> dict:
        from ppo_ray.tasks.evaluation import judge

        return judge(trainer, rows, label=label)

    def periodic(self, trainer, cfg, rows: Sequence[dict]) -> dict:
        from ppo_ray.tasks.evaluation import judge, mean

        return {"gold_val": mean(judge(trainer, rows)["gold"])}

    def train_eval_prompts(self, rows: Sequence[dict]) -> list[str]:
        return [r["prompt"] for r in rows]

    def report(self, run_dir: Path, metrics: Path, cfg, test_rows: list[dict], val_rows: list[dict], sft: dict,
               after: dict, after_val: dict) -> dict:
        return tldr_report(run_dir, metrics, test_rows, val_rows, sft, after, after_val)

    def check_columns(self, rows: Sequence[dict], source: str) -> dict[str, str]:
        why = tldr_columns(rows, source)
        if why:
            return {"gold": why}
        if any("summary" not in row for row in rows):
            first = next(i for i, row in enumerate(rows) if "summary" not in row)
            return {"reference": f"{source}: row {first} has no column 'summary' (the reference summary)"}
        return {}

    def eval_policy(self, trainer, cfg, rows: Sequence[dict], *, label: str, skipped: dict[str, str],
                    score: bool) -> dict:
        from ppo_ray.tasks.evaluation import judge

        return judge(trainer, rows, label=label, gold="gold" not in skipped, score=score)

    def eval_numbers(self, tag: str, cfg, rows: Sequence[dict], after: dict, before: Optional[dict],
                     skipped: dict[str, str]) -> dict:
        from ppo_ray.tasks.evaluation import tldr_numbers

        if "gold" in skipped:
            return {}
        return tldr_numbers(tag, rows, after, before, reference="reference" not in skipped)

    def eval_samples_md(self, path: Path, cfg, rows: Sequence[dict], after: dict, before: Optional[dict],
                        skipped: dict[str, str]) -> bool:
        if "gold" not in after or before is None:
            return False
        write_samples(path, rows, before["texts"], before["gold"], after["texts"], after["gold"])
        return True


TASK = TLDRTask()


def tldr_report(run_dir: Path, metrics: Path, test_rows: list[dict], val_rows: list[dict], sft: dict, ppo: dict,
                ppo_val: dict) -> dict:
    """report.json's numbers of the bundled TL;DR task, and the files behind them (held_out.jsonl,
    samples.md, curves.png). A part that fails is said (report_part) and the rest is written."""
    from ppo_ray.tasks.evaluation import tldr_numbers

    history = read_metrics(metrics)
    errors: dict = {}
    # the gold numbers (ppo_ray.tasks.evaluation, which `launch.py eval` calls too): each policy,
    # against each other and against the test posts' reference summaries (the N+ paper's metric),
    # and the same samples fact by fact (copy_test_*, kept last)
    test = report_part(errors, "test split's gold numbers", lambda: tldr_numbers("test", test_rows, ppo, sft)) or {}
    copy = {k: test.pop(k) for k in ("copy_test_sft", "copy_test_ppo") if k in test}
    report = {
        **test,
        "final_kl": history[-1]["kl"],
        **final_rewards(history),
        "ppo_steps": len(history),
        "eval_prompts": len(test_rows),
        **copy,
    }
    if "val" in sft:  # validation prompts: what hyperparameters may be chosen by (the test split never)
        report.update(report_part(errors, "validation split's gold numbers", lambda: tldr_numbers(
            "val", val_rows, ppo_val, sft["val"], reference=False, copy=False)) or {})
    report_part(errors, HELD_OUT, lambda: write_held_out(
        run_dir / HELD_OUT, {"test": (sft, ppo), **({"val": (sft["val"], ppo_val)} if "val" in sft else {})}))
    report_part(errors, "samples.md", lambda: write_samples(run_dir / "samples.md", test_rows, sft["texts"],
                                                            sft["gold"], ppo["texts"], ppo["gold"]))
    report_part(errors, "curves.png", lambda: plot_curves(metrics, run_dir / "curves.png", report.get("gold_val_sft")))
    if errors:
        report["report_errors"] = errors
    return report


def write_held_out(path: Path, splits: dict[str, tuple[dict, dict]]) -> None:
    """Every held-out sample behind the report: per split ("test": data/prompts_test.jsonl's
    first eval_size rows, "val": prompts_validation.jsonl's) and prompt index, the SFT and
    PPO summaries, whether each ended with EOS, and their gold scores, so the headline
    numbers can be recomputed from the texts with the judge (tests/test_launch.py does)."""
    with open(path, "w") as f:
        for split, (sft, ppo) in splits.items():
            # (an SFT evaluation cached by an older version has no EOS flags: null)
            sft_stops = sft.get("stops") or [None] * len(sft["texts"])
            for i, (sft_text, sft_stop, sft_gold, ppo_text, ppo_stop, ppo_gold) in enumerate(zip(
                    sft["texts"], sft_stops, sft["gold"], ppo["texts"], ppo["stops"], ppo["gold"], strict=True)):
                f.write(json.dumps({"split": split, "index": i, "sft": sft_text, "sft_stop": sft_stop,
                                    "sft_gold": sft_gold, "ppo": ppo_text, "ppo_stop": ppo_stop,
                                    "ppo_gold": ppo_gold}) + "\n")


def write_samples(path: Path, rows, sft_texts, sft_gold, ppo_texts, ppo_gold, n: int = 12) -> None:
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| # | post (start) | SFT summary | gold | PPO summary | gold |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(rows[:n]):
        post = row.get("post", row["prompt"])[:80]
        lines.append(f"| {i} | {cell(post)}... | {cell(sft_texts[i])} | {sft_gold[i]:.2f} | "
                     f"{cell(ppo_texts[i])} | {ppo_gold[i]:.2f} |")
    path.write_text("# Held-out summaries before (SFT) and after PPO\n\n" + "\n".join(lines) + "\n")


def tldr_columns(rows: Sequence[dict], source: str) -> Optional[str]:
    """Why the gold judge cannot score `rows` (no `facts`: the task's key facts of each post),
    or None. A `facts` that is not three strings is bad input."""
    from ppo_ray.data import DataError

    missing = [i for i, row in enumerate(rows) if "facts" not in row]
    if missing:
        return (f"{source}: row {missing[0]} has no column 'facts' ({len(missing)} of {len(rows)} rows lack it; "
                "the gold judge scores a summary by the task's key facts of its post)")
    for i, row in enumerate(rows):
        facts = row["facts"]
        if not (isinstance(facts, list) and len(facts) == 3 and all(isinstance(f, str) for f in facts)):
            raise DataError(f"{source}: row {i} column 'facts': expected three strings (person, event, quantity), "
                            f"got {facts!r}"[:300])
    return None
