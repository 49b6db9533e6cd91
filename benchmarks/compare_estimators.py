"""PPO-GAE against the critic-free estimators and the stability knobs, on a finished pipeline
run: the main job (issue 30's comparison) or the verifiable task (issue 46's).

    python -m benchmarks.compare_estimators --base RUN_DIR --out DIR \\
        --runs gae grpo:n=4 rloo:n=4:kl=loss reinforce_pp:n=8 --seeds 0 1 2
    python -m benchmarks.compare_estimators --base ARITH_RUN --out DIR --seeds 0 1 2 \\
        --with ppo_epochs=2 mini_batch_size=64 micro_batch_size=64 \\
        --runs grpo ppo-gae=gae:n=1:gamma=1:lam=0.95 gspo=grpo:policy_loss=gspo:loss_agg=seq_mean_token_mean

RUN_DIR is a finished pipeline run (`python launch.py --run_dir RUN_DIR [--config arith-tiny]`).
Every run is the PPO stage alone (`launch.py ppo` with RUN_DIR's config.yaml) in
DIR/<run>-s<seed>, on a copy of RUN_DIR's SFT model, reward model (the main job's) and data, so
every row starts from the same SFT (and RM) and the same problems, and differs only in its
options and its PPO seed (sampling, LoRA init, prompt order; the data stays RUN_DIR's). A run is
`[NAME=]ESTIMATOR[:n=N][:kl=reward|loss][:FIELD=VALUE...]`: n is samples_per_prompt, kl=loss
sets kl_in_loss, any other FIELD=VALUE is passed as --FIELD VALUE (after --with's, which every
run gets); NAME labels the run in the tables. batch_size stays the config's, so every run sees
the same rollouts per step (dynamic sampling generates more and trains on batch_size).

A run whose report-ppo.json exists is read, not rerun: an interrupted comparison goes on where
it stopped. Runs go one after another (each uses the machine's cores), with RAY_ADDRESS unset.

Printed: one JSON line per run, then two markdown tables, mean +- sample std over the seeds:
validation (what a setting may be chosen by: on the main job win rate vs SFT and gold on the
validation prompts; on the verifiable task greedy pass@1) and test (main job: win rate vs SFT
and vs the reference summaries, gold; verifiable task: greedy pass@1, pass@k, the share of
right samples, and the generation rounds per step (dynamic sampling's; 1 without it); both:
final KL, and time: the training loop (sum of the steps), its learner phase (step 1's forward +
the update) and the whole stage (the evaluations before and after included)), and the loop's
and learner's time over the first run's of the same seed (the VM's speed drifts by up to 2x
within an hour: put the baseline first, and compare times within a seed's round). `--plot
FILE` draws the test columns. `--select`: a sweep. Every run goes on the first seed; the other
seeds run only each estimator's best run by the validation metric (ties by the second), so n
and the KL setting are chosen by a rule on validation, never on test. `--json FILE` keeps the
rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"n": "samples_per_prompt"}
# what `launch.py ppo` reads from a pipeline run's directory, per task (arith has no reward model)
COPIED = {"tldr": ("sft", "rm", "data"), "arith": ("sft", "data")}


def split_label(spec: str) -> tuple[str, str]:
    """`dapo=grpo:...` -> ("dapo", "grpo:..."); a spec without NAME= is its own label."""
    head = spec.split(":")[0]
    if "=" in head:
        label, _, rest = spec.partition("=")
        if not label or not rest:
            raise SystemExit(f"error: run {spec!r}: NAME=ESTIMATOR needs both")
        return label, rest
    return spec, spec


def estimator_of(spec: str) -> str:
    return split_label(spec)[1].split(":")[0]


def parse_run(spec: str) -> list[str]:
    """`grpo:n=4:kl=loss` (or `NAME=grpo:...`) -> the launch.py options of that run."""
    estimator, *parts = split_label(spec)[1].split(":")
    args = ["--advantage_estimator", estimator]
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise SystemExit(f"error: run {spec!r}: {part!r} is not FIELD=VALUE")
        if key == "kl":
            if value not in ("reward", "loss"):
                raise SystemExit(f"error: run {spec!r}: kl must be reward or loss, not {value!r}")
            key, value = "kl_in_loss", str(value == "loss").lower()
        args += [f"--{SHORT.get(key, key)}", value]
    return args


def run_dir_name(spec: str, seed: int) -> str:
    return split_label(spec)[0].replace(":", "_").replace("=", "") + f"-s{seed}"


def task_of(base: Path) -> str:
    """The pipeline run's task, from its saved config (the main job's before task existed)."""
    config = base / "config.yaml"
    if not config.is_file():
        return "tldr"
    from ppo_ray.config import PPOConfig

    return PPOConfig.from_saved(str(config)).task


def run_one(base: Path, out: Path, spec: str, seed: int, common: Optional[list[str]] = None) -> Path:
    dest = out / run_dir_name(spec, seed)
    if (dest / "report-ppo.json").exists():
        return dest
    if dest.exists():  # an interrupted run: start it again from the copy
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in COPIED[task_of(base)]:
        shutil.copytree(base / name, dest / name)
    config = ["--config", str(base / "config.yaml")] if (base / "config.yaml").is_file() else []
    cmd = [sys.executable, str(ROOT / "launch.py"), "ppo", *config, "--run_dir", str(dest), "--seed", str(seed),
           *(common or []), *parse_run(spec)]
    print(f"# {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    with open(out / f"{dest.name}.log", "w") as log:
        code = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "RAY_ADDRESS": ""})
    if code != 0:
        raise SystemExit(f"error: {spec} seed {seed} exited {code}; see {out / (dest.name + '.log')}")
    print(f"# {dest.name}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return dest


def summarise(dest: Path, spec: str, seed: int) -> dict:
    from ppo_ray.tasks.pipeline import read_metrics

    report = json.loads((dest / "report-ppo.json").read_text())
    steps = read_metrics(dest / "metrics.jsonl")
    row = {"run": split_label(spec)[0], "seed": seed}
    if "pass1_test_rl" in report:  # the verifiable task
        k = report["eval_k"]
        row.update({"pass1_val": report["pass1_val_rl"], "pass1_test": report["pass1_test_rl"],
                    "passk_test": report[f"pass{k}_test_rl"], "sample_acc": report["sample_accuracy_test_rl"],
                    "rounds": statistics.fmean(s.get("dynamic_sampling_rounds", 1) for s in steps)})
    else:
        row.update({"win_val_vs_sft": report["win_rate_val_ppo_vs_sft"], "gold_val": report["gold_val_ppo"],
                    "win_vs_sft": report["win_rate_ppo_vs_sft"],
                    "win_vs_reference": report["win_rate_ppo_vs_reference"], "gold_test": report["gold_test_ppo"]})
    return {**row, "final_kl": report["final_kl"],
            "loop_s": sum(s["time/step_s"] for s in steps),
            "learner_s": sum(s["time/learner_forward_s"] + s["time/update_s"] for s in steps),
            "stage_s": report["seconds"]}


def select(rows: list[dict], runs: list[str]) -> list[str]:
    """Each estimator's best run by the validation prompts (main job: win rate vs SFT, then
    gold; verifiable task: greedy pass@1): the sweep's choice of n and KL setting, made by a
    rule rather than by hand."""
    best: dict[str, dict] = {}
    labels = {split_label(spec)[0]: spec for spec in runs}
    # ascending, so each estimator's best is written last; an exact tie goes to the earlier run
    for row in sorted(reversed(rows), key=lambda r: (r.get("win_val_vs_sft", r.get("pass1_val")),
                                                     r.get("gold_val", 0.0))):
        best[estimator_of(labels.get(row["run"], row["run"]))] = row
    return [spec for spec in runs if best.get(estimator_of(spec), {}).get("run") == split_label(spec)[0]]


def _cell(values: list[float], digits: int) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


TIMES = [("final KL", "final_kl", 2), ("loop s", "loop_s", 0), ("learner s", "learner_s", 0),
         ("stage s", "stage_s", 0), ("loop / first run's", "loop_x", 2), ("learner / first run's", "learner_x", 2)]
TABLES = {
    "validation (selection)": [("win vs SFT", "win_val_vs_sft", 3), ("gold", "gold_val", 3)],
    "test": [("win vs SFT", "win_vs_sft", 3), ("win vs refs", "win_vs_reference", 3), ("gold", "gold_test", 3),
             *TIMES],
}
ARITH_TABLES = {
    "validation (selection)": [("pass@1", "pass1_val", 3)],
    "test": [("pass@1", "pass1_test", 3), ("pass@k", "passk_test", 3), ("right samples", "sample_acc", 3),
             ("rounds / step", "rounds", 2), *TIMES],
}


def with_ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Each run's loop and learner time over the baseline run's of the same seed: the VM's
    speed drifts by up to 2x within an hour, so times compare only within one seed's round
    (the runs of a seed go back to back)."""
    base = {r["seed"]: r for r in rows if r["run"] == baseline}
    return [{**r, "loop_x": r["loop_s"] / base[r["seed"]]["loop_s"],
             "learner_x": r["learner_s"] / base[r["seed"]]["learner_s"]} if r["seed"] in base else r for r in rows]


def tables(rows: list[dict], runs: list[str]) -> str:
    runs = [split_label(spec)[0] for spec in runs]
    rows, lines = with_ratios(rows, runs[0]), []
    for title, cols in (ARITH_TABLES if any("pass1_test" in r for r in rows) else TABLES).items():
        lines += [f"{title}:", "", "| run | seeds | " + " | ".join(c[0] for c in cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for spec in runs:
            mine = [r for r in rows if r["run"] == spec]
            if mine:
                cells = [_cell([r[key] for r in mine if key in r], digits) if any(key in r for r in mine) else "-"
                         for _, key, digits in cols]
                lines.append(f"| {spec} | {len(mine)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], runs: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [split_label(spec)[0] for spec in runs]
    panels = [("win rate vs SFT (test)", "win_vs_sft"), ("win rate vs references (test)", "win_vs_reference"),
              ("final KL", "final_kl"), (f"learner phase / {runs[0]}'s (same seed)", "learner_x")]
    if any("pass1_test" in r for r in rows):
        panels = [("pass@1, greedy (test)", "pass1_test"), ("pass@k (test)", "passk_test"),
                  ("generation rounds / step", "rounds"), (f"training loop / {runs[0]}'s (same seed)", "loop_x")]
    rows = with_ratios(rows, runs[0])
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, key) in zip(axes, panels):
        for i, spec in enumerate(runs):
            values = [r[key] for r in rows if r["run"] == spec and key in r]
            if values:
                ax.scatter([i] * len(values), values, s=18, alpha=0.7)
                ax.hlines(statistics.fmean(values), i - 0.3, i + 0.3, color="black")
        ax.set_xticks(range(len(runs)), runs, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="a finished pipeline run's directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", nargs="+", required=True,
                    help="[NAME=]ESTIMATOR[:n=N][:kl=reward|loss][:FIELD=VALUE]")
    ap.add_argument("--with", dest="common", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="options every run gets (before the run's own)")
    ap.add_argument("--json", type=Path, help="write the rows (a JSON list) here")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--select", action="store_true",
                    help="run every RUN on the first seed, then only each estimator's best (validation) on the others")
    ap.add_argument("--plot", type=Path, help="draw the test columns (PNG)")
    args = ap.parse_args(argv)
    missing = [name for name in COPIED[task_of(args.base)] if not (args.base / name).is_dir()]
    if missing:
        raise SystemExit(f"error: {args.base} has no {', '.join(missing)}: pass a finished pipeline run's directory")
    for spec in args.runs:
        parse_run(spec)  # every spec checked before the first run starts
    common = parse_run("x:" + ":".join(args.common))[2:] if args.common else []
    labels = [split_label(spec)[0] for spec in args.runs]
    if len(set(labels)) < len(labels):
        raise SystemExit(f"error: two runs share a name: {' '.join(labels)}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, runs = [], args.runs
    for i, seed in enumerate(args.seeds):  # seed-major: a partial comparison has every run on its first seeds
        if i == 1 and args.select:
            runs = select(rows, runs)
            print(f"# selected on seed {args.seeds[0]}'s validation: {' '.join(runs)}", file=sys.stderr, flush=True)
        for spec in runs:
            row = summarise(run_one(args.base, args.out, spec, seed, common), spec, seed)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    print(tables(rows, args.runs))
    if args.plot:
        plot(rows, runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
