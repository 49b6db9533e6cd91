"""Synchronous vs bounded staleness (max_staleness), measured: samples/s, wall time to a
reward level, and the reward at equal samples, over seeds. Writes a JSON and a markdown table.

    python -m benchmarks.async_compare [--modes 0:merged,0:tensor,1:tensor:tis,2:tensor:tis,...]
        [--seeds 0,1,2] [--steps 12] [--num_generators 2] [--out_dir DIR] [--<PPOConfig field> VALUE ...]

A mode is max_staleness:lora_sync[:is_correction[:partial_rollout]] (is_correction none by default;
tis on a stale step is decoupled PPO; partial_rollout finish by default, continue lets long
responses go on with newer versions). Every run builds its own trainer (the tiny preset by default,
2 generator replicas, 1 learner), then times train() over `steps` steps of batch_size rollouts
(the engine starts are not timed). Per run:

* samples/s: steps x batch_size / the wall time of train(); response tokens/s: the tokens of
  those samples / the same time (the policies of two modes sample other lengths as they learn,
  so samples/s alone mixes speed and what was learnt: a run with a learning rate near 0 keeps
  the workload equal);
* reward: the mean score of each step's rollouts (the same reward as training; the run is the
  same task with the same seed in every mode, so the curves are comparable);
* time to the level: the wall time until the moving mean of 3 steps' rewards first reaches
  `level` (by default 0.9 x the synchronous runs' final reward, mode 0:tensor's or the first
  mode's), NaN when it never does;
* final reward: the mean of the last 3 steps (equal samples in every mode: same steps, same
  batch).

On a CPU-only machine the generators, the scorers and the learner share the cores, so
overlapping them gains only where one phase leaves cores idle (the long tail of a batch's
responses decoding a few sequences at a time); the JSON records the machine and its load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.step import load_average, machine_info

REPO = Path(__file__).resolve().parent.parent
DEFAULTS = dict(num_generators=2, max_new_tokens=128, batch_size=16, micro_batch_size=8, eval_every=0,
                checkpoint_every=0, report_to=[])


def run_one(staleness: int, lora_sync: str, correction: str, seed: int, steps: int, overrides: dict,
            partial: str = "finish") -> dict:
    from ppo_ray.config import PPOConfig
    from ppo_ray.data import bundled_prompts
    from ppo_ray.trainer import PPOTrainer

    config = PPOConfig.from_yaml(overrides.pop("config", "tiny"), **{
        **DEFAULTS, **overrides, "max_staleness": staleness, "lora_sync": lora_sync, "is_correction": correction,
        "partial_rollout": partial, "seed": seed, "steps": steps})
    trainer = PPOTrainer(config)
    try:
        t0 = time.perf_counter()
        history = trainer.train(bundled_prompts(), progress=False)
        wall = time.perf_counter() - t0
    finally:
        trainer.shutdown()
    ends, now = [], 0.0
    for h in history:
        now += h.timing.step_s
        ends.append(now)
    label = config.lora_sync_mode + ("" if correction == "none" else f" + {correction}") + \
        ("" if partial == "finish" else f" + {partial}")
    return {"max_staleness": staleness, "lora_sync": label,
            "seed": seed, "wall_s": wall,
            "samples_per_s": steps * config.batch_size / wall,
            "rewards": [h["reward_mean"] for h in history], "step_end_s": ends,
            "response_length_mean": [h["response_length_mean"] for h in history],
            "response_length_max": [max(h.response_lengths) for h in history],
            "stale_versions": [h["stale_versions"] for h in history],
            "rollout_tokens_per_s": [h["rollout_tokens_per_s"] for h in history],
            "learner_tokens_per_s": [h["learner_tokens_per_s"] for h in history],
            "step_s": [h.timing.step_s for h in history], "generate_s": [h.timing.generate_s for h in history],
            "prefetch_wait_s": [h.timing.prefetch_wait_s for h in history]}


def moving(values: Sequence[float], n: int = 3) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - n): i + 1]) for i in range(len(values))]


def time_to(run: dict, level: float) -> float:
    for mean, at in zip(moving(run["rewards"]), run["step_end_s"]):
        if mean >= level:
            return at
    return math.nan


def summarise(runs: list[dict], level: Optional[float]) -> tuple[float, list[dict]]:
    modes = list(dict.fromkeys((r["max_staleness"], r["lora_sync"]) for r in runs))
    final = {m: [statistics.fmean(r["rewards"][-3:]) for r in runs if (r["max_staleness"], r["lora_sync"]) == m]
             for m in modes}
    if level is None:
        base = next((m for m in modes if m == (0, "tensor")), modes[0])
        level = 0.9 * statistics.fmean(final[base])
    rows = []
    for m in modes:
        mine = [r for r in runs if (r["max_staleness"], r["lora_sync"]) == m]

        def spread(values: list[float]) -> tuple[float, float]:
            values = [v for v in values if math.isfinite(v)]
            if not values:
                return math.nan, math.nan
            return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)

        rows.append({"max_staleness": m[0], "lora_sync": m[1], "seeds": len(mine),
                     "samples_per_s": spread([r["samples_per_s"] for r in mine]),
                     # every step has batch_size samples: tokens/s = samples/s x the mean length
                     "tokens_per_s": spread([r["samples_per_s"] * statistics.fmean(r["response_length_mean"])
                                             for r in mine]),
                     "time_to_level_s": spread([time_to(r, level) for r in mine]),
                     "reached": sum(math.isfinite(time_to(r, level)) for r in mine),
                     "final_reward": spread(final[m]),
                     "response_length_mean": statistics.fmean(x for r in mine for x in r["response_length_mean"]),
                     "step_s": statistics.fmean(x for r in mine for x in r["step_s"][1:])})
    return level, rows


def table(level: float, rows: list[dict]) -> str:
    base = next((r["samples_per_s"][0] for r in rows if (r["max_staleness"], r["lora_sync"]) == (0, "tensor")),
                rows[0]["samples_per_s"][0])
    lines = [f"| max_staleness | lora_sync | samples/s | vs 0 tensor | response tokens/s | mean length | "
             f"time to reward {level:.3f} (s) | final reward (last 3 steps) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        (s, sd), (t, tsd), (f, fsd) = r["samples_per_s"], r["time_to_level_s"], r["final_reward"]
        tok, tsd_ = r["tokens_per_s"]
        lines.append(f"| {r['max_staleness']} | {r['lora_sync']} | {s:.2f} ± {sd:.2f} | {s / base:.2f}x | "
                     f"{tok:.0f} ± {tsd_:.0f} | {r['response_length_mean']:.1f} | "
                     f"{t:.1f} ± {tsd:.1f} ({r['reached']}/{r['seeds']}) | {f:.3f} ± {fsd:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.async_compare", description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="0:merged,0:tensor,1:tensor:tis,2:tensor:tis,4:tensor:tis,2:tensor")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--level", type=float, default=None)
    parser.add_argument("--out_dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--summarise", default=None, help="a JSON this wrote: print its table again, measure nothing")
    args, rest = parser.parse_known_args(argv)
    if args.summarise:
        saved = json.loads(Path(args.summarise).read_text())
        level, rows = summarise(saved["runs"], args.level)
        print(table(level, rows))
        return saved
    overrides: dict = {}
    for key, value in zip(rest[::2], rest[1::2]):
        import yaml

        overrides[key.lstrip("-")] = yaml.safe_load(value)
    from ppo_ray.driver.cluster import init_ray

    init_ray()
    runs = []
    modes = [(int(parts[0]), parts[1], parts[2] if len(parts) > 2 else "none", parts[3] if len(parts) > 3 else "finish")
             for parts in (m.split(":") for m in args.modes.split(","))]
    for seed in [int(s) for s in args.seeds.split(",")]:
        for staleness, sync, correction, partial in modes:
            load = load_average()
            run = run_one(staleness, sync, correction, seed, args.steps, dict(overrides), partial)
            run["load_before"] = load
            runs.append(run)
            print(f"[async_compare] max_staleness {staleness} {run['lora_sync']} seed {seed}: "
                  f"{run['samples_per_s']:.2f} samples/s, final reward {statistics.fmean(run['rewards'][-3:]):.3f}, "
                  f"mean length {statistics.fmean(run['response_length_mean']):.1f}", file=sys.stderr, flush=True)
    level, rows = summarise(runs, args.level)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
           "command": "python -m benchmarks.async_compare " + " ".join(argv if argv is not None else sys.argv[1:]),
           "steps": args.steps, "overrides": overrides, "level": level, "rows": rows, "runs": runs}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "async_compare.json").write_text(json.dumps(out, indent=1))
    text = table(level, rows)
    (out_dir / "async_compare.md").write_text(text + "\n")
    print(text)
    return out


if __name__ == "__main__":
    main()
