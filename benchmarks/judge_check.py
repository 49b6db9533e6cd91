"""The gold judge and the reward model on a finished main-job run directory (issue 30).

    python -m benchmarks.judge_check held_out RUN_DIR   # re-score held_out.jsonl with today's judge
    python -m benchmarks.judge_check rm_by_kind RM_DIR  # an RM's accuracy by kind on the stratified
                                                        # validation pairs (generate_task(seed=0))

``held_out``: each split's SFT and PPO samples (held_out.jsonl) against RUN_DIR/data's
prompts, scored with the judge as it is now, beside the gold scores the run recorded (the
judge of its time): gold, win rate PPO vs SFT, win rates against the reference summaries
(the prompts' ``summary``) and the share of all-three-facts-right. So an old run's samples
separate a judge change from a data change. ``rm_by_kind``: the reward model in RM_DIR on
every validation pair of the current task (>= 100 of each kind), accuracy by kind, beside
its accuracy on the train pairs it learnt from (seen combinations; one pair per train post). One JSON
line per split / model on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def held_out(run_dir: Path) -> list[dict]:
    from ppo_ray.data import read_rows
    from ppo_ray.tasks.tldr_synth import copy_accuracy, gold_score, win_rate

    held = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines() if line.strip()]
    out = []
    for split, name in (("test", "prompts_test.jsonl"), ("val", "prompts_validation.jsonl")):
        hs = [h for h in held if h["split"] == split]
        if not hs:
            continue
        rows = read_rows(run_dir / "data" / name)[: len(hs)]
        sft = [gold_score(r, h["sft"], h["sft_stop"]) for r, h in zip(rows, hs)]
        ppo = [gold_score(r, h["ppo"], h["ppo_stop"]) for r, h in zip(rows, hs)]
        ref = [gold_score(r, r["summary"], True) for r in rows]
        rec_sft, rec_ppo = [h["sft_gold"] for h in hs], [h["ppo_gold"] for h in hs]
        n = len(hs)
        out.append({
            "split": split, "n": n,
            "recorded": {"gold_sft": sum(rec_sft) / n, "gold_ppo": sum(rec_ppo) / n,
                         "win_ppo_vs_sft": win_rate(rec_ppo, rec_sft)},
            "judge_now": {"gold_sft": sum(sft) / n, "gold_ppo": sum(ppo) / n, "gold_reference": sum(ref) / n,
                          "win_ppo_vs_sft": win_rate(ppo, sft), "win_sft_vs_reference": win_rate(sft, ref),
                          "win_ppo_vs_reference": win_rate(ppo, ref),
                          "all_right_sft": copy_accuracy(rows, [h["sft"] for h in hs])["all_right"],
                          "all_right_ppo": copy_accuracy(rows, [h["ppo"] for h in hs])["all_right"]},
            "scores_changed": sum(a != b for a, b in zip(rec_sft + rec_ppo, sft + ppo)),
        })
    return out


def rm_by_kind(rm_dir: Path, seed: int = 0) -> dict:
    import torch

    from learner.stages import preference_correct
    from ppo_ray.modeling import load_reward_model, load_tokenizer
    from ppo_ray.tasks.tldr_eval import accuracy_by_kind
    from ppo_ray.tasks.tldr_synth import DEFAULT_IDEAL_FRACTION, generate_task

    task = generate_task(seed=seed, ideal_fraction=DEFAULT_IDEAL_FRACTION)
    tok = load_tokenizer(str(rm_dir))
    model = load_reward_model(str(rm_dir)).eval()

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    def by_kind(pairs: list[tuple[str, dict]]) -> tuple[float, dict]:
        queries = [ids(prompt) for prompt, _ in pairs]
        chosen = [ids(p["chosen"]) + [tok.eos_token_id] for _, p in pairs]
        rejected = [ids(p["rejected"]) + [tok.eos_token_id] for _, p in pairs]
        with torch.no_grad():
            correct = preference_correct(model, queries, chosen, rejected, pad=tok.pad_token_id, eos=tok.eos_token_id)
        return sum(correct) / len(correct), accuracy_by_kind(correct, [p["kind"] for _, p in pairs])

    accuracy, kinds = by_kind([(ex["prompt"], p) for ex in task["validation"] for p in ex["pairs"]])
    # the pairs it trained on (one per train post): seen combinations, against validation's unseen ones
    train_accuracy, train_kinds = by_kind([(ex["prompt"], ex) for ex in task["train"]])
    return {"rm": str(rm_dir), "n": sum(k["n"] for k in kinds.values()), "accuracy": accuracy, "by_kind": kinds,
            "train_accuracy": train_accuracy, "train_by_kind": train_kinds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("held_out", "rm_by_kind"))
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    if args.what == "held_out":
        for line in held_out(args.path):
            print(json.dumps(line))
    else:
        print(json.dumps(rm_by_kind(args.path)))


if __name__ == "__main__":
    main()
