"""Scaling: our PPO step time and tokens/s as the batch and the response length grow, and
with 1 vs 2 generator replicas. Writes a JSON, a PNG plot and a markdown table.

    python -m benchmarks.scaling [--preset small] [--quick] [--batch_sizes 16,32,64,128]
        [--lengths 16,32,64,128] [--replicas 1,2] [--base_batch B] [--base_length T]
        [--steps K] [--warmup W] [--out_dir DIR] [--wait_for_load L] [--<PPOConfig field> VALUE ...]

Three sweeps around one base point (base_batch prompts x base_length tokens, 1 replica):

* batch size: base_length tokens, each of --batch_sizes;
* response length: base_batch prompts, each of --lengths (max_new_tokens; the "small"
  preset's random model almost never samples EOS, so responses run to that length);
* replicas: base point with each of --replicas generator replicas (the prompts split
  across them; on a CPU machine the replicas share the cores: generator_num_cpus 1/N).

Each point runs W warm-up + K timed steps through benchmarks.step (same phases, medians).
A trainer (vLLM engine start included) is built per (response length, replicas); the batch
sweep runs on one trainer built with batch_size = the largest batch: its learner then takes
each smaller batch as one minibatch, as a trainer built for that batch would (mini_batch_size
unset = the whole batch), so the PPO math per point is the same. The single-process baseline
is not part of the sweep (benchmarks.step measures it).

--quick: batches 8,16,32 at 32 tokens; lengths 16,32,64 at 16 prompts; 1 vs 2 replicas;
1 warm-up + 2 timed steps (~20 minutes on the "small" preset, 2 cores).
--points BxT[xN],...: measure only those points and merge them into the existing JSON (the
same name), e.g. to re-measure points that other work on a shared machine overlapped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.step import (build_config, connect_ray, load_average, machine_info, measure_trainer,
                             prompt_batches, wait_for_load)

REPO = Path(__file__).resolve().parent.parent
FULL = dict(batch_sizes=[16, 32, 64, 128], lengths=[16, 32, 64, 128], replicas=[1, 2], base_batch=32,
            base_length=64, steps=3, warmup=1)
QUICK = dict(batch_sizes=[8, 16, 32], lengths=[16, 32, 64], replicas=[1, 2], base_batch=16, base_length=32,
             steps=2, warmup=1)
KEEP = ("generate", "reference", "reward", "learner_forward", "update", "sync", "overhead", "step",
        "response_tokens", "tokens_per_s", "samples_per_s", "generate_tokens_per_s")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def point(trainer, batch_size: int, warmup: int, steps: int, max_load: Optional[float] = None, **labels: Any) -> dict:
    """One measured point: medians (and the step's min / max) over the timed steps. With
    max_load, first wait for the 1-min load average to fall below it (the previous point's
    own load decays in a minute or two); the load before and after is recorded, so a point
    that others' work overlapped shows it."""
    before = wait_for_load(max_load)
    result = measure_trainer(trainer, prompt_batches(warmup + steps, batch_size), warmup)
    s = result["summary"]
    out = {**labels, "batch_size": batch_size, "load_before": before["load_average"], "load_after": load_average()}
    out.update({k: s[k]["median"] for k in KEEP})
    out["step_min"], out["step_max"] = s["step"]["min"], s["step"]["max"]
    print(f"[scaling] {labels} B={batch_size}: step {out['step']:.2f} s, {out['tokens_per_s']:.0f} tok/s",
          file=sys.stderr, flush=True)
    return out


def grid_plans(*, batch_sizes: list[int], lengths: list[int], replicas: list[int], base_batch: int,
               base_length: int, **_: Any) -> list[tuple[int, int, list[int]]]:
    """The trainers to build: (response length, replicas, the batch sizes run on it)."""
    plans: list[tuple[int, int, list[int]]] = []
    for t in sorted(set(lengths) | {base_length}):
        sizes = sorted(set(batch_sizes) | {base_batch}) if t == base_length else [base_batch]
        plans.append((t, 1, sizes))
    return plans + [(base_length, n, [base_batch]) for n in replicas if n != 1]


def parse_points(text: str) -> list[tuple[int, int, list[int]]]:
    """"BxT[xN],..." (prompts x tokens [x replicas]) -> plans, one trainer per (T, N)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for item in text.split(","):
        parts = [int(x) for x in item.strip().lower().split("x")]
        if len(parts) not in (2, 3):
            raise SystemExit(f"--points: {item!r} is not BxT or BxTxN")
        b, t, n = parts[0], parts[1], parts[2] if len(parts) == 3 else 1
        groups.setdefault((t, n), []).append(b)
    return [(t, n, sorted(set(sizes))) for (t, n), sizes in sorted(groups.items())]


def sweep(preset: str, extra: Sequence[str], plans: list[tuple[int, int, list[int]]], *, steps: int, warmup: int,
          max_load: Optional[float] = None) -> list[dict]:
    import ray

    from ppo_ray.trainer import PPOTrainer

    started = connect_ray()
    points: list[dict] = []
    try:
        for t, n, sizes in plans:
            args = [*extra, "--max_new_tokens", str(t), "--num_generators", str(n), "--batch_size", str(max(sizes))]
            if n > 1:
                args += ["--generator_num_cpus", str(round(1.0 / n, 3))]
            config = build_config(preset, args)
            trainer = PPOTrainer(config)
            try:
                for b in sizes:
                    points.append(point(trainer, b, warmup, steps, max_load, max_new_tokens=t, num_generators=n))
            finally:
                trainer.shutdown()
    finally:
        if started:
            ray.shutdown()
    return points


def select(points: list[dict], *, batch: Optional[int] = None, length: Optional[int] = None,
           replicas: Optional[int] = None) -> list[dict]:
    return [p for p in points if (batch is None or p["batch_size"] == batch)
            and (length is None or p["max_new_tokens"] == length)
            and (replicas is None or p["num_generators"] == replicas)]


def markdown(points: list[dict]) -> str:
    head = ("| prompts | tokens | replicas | step s (min-max) | generate s | learner s (fwd + update) | sync s | "
            "overhead s | gen. tokens/s (step) | samples/s | load before / after |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for p in sorted(points, key=lambda p: (p["num_generators"], p["max_new_tokens"], p["batch_size"])):
        rows.append(f"| {p['batch_size']} | {p['max_new_tokens']} | {p['num_generators']} | "
                    f"{p['step']:.2f} ({p['step_min']:.2f}-{p['step_max']:.2f}) | {p['generate']:.2f} | "
                    f"{p['learner_forward'] + p['update']:.2f} | {p['sync']:.3f} | {p['overhead']:.3f} | "
                    f"{p['tokens_per_s']:.1f} | {p['samples_per_s']:.2f} | {p['load_before'][0]:.2f} / "
                    f"{p['load_after'][0]:.2f} |")
    return head + "\n".join(rows) + "\n"


def plot(points: list[dict], base_batch: int, base_length: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), constrained_layout=True)
    sweeps = [
        ("prompts per step", "batch_size", select(points, length=base_length, replicas=1), f"{base_length} tokens"),
        ("response tokens", "max_new_tokens", select(points, batch=base_batch, replicas=1), f"{base_batch} prompts"),
        ("generator replicas", "num_generators", select(points, batch=base_batch, length=base_length),
         f"{base_batch} x {base_length}"),
    ]
    for col, (xlabel, key, pts, note) in enumerate(sweeps):
        pts = sorted(pts, key=lambda p: p[key])
        xs = [p[key] for p in pts]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(xs, [p["step"] for p in pts], "o-", label="step")
        top.plot(xs, [p["generate"] for p in pts], "s--", label="generate")
        top.plot(xs, [p["learner_forward"] + p["update"] for p in pts], "^--", label="learner")
        top.set_ylabel("seconds (median)")
        top.set_title(f"vs {xlabel} ({note})")
        bottom.plot(xs, [p["tokens_per_s"] for p in pts], "o-", label="tokens/s of the step")
        bottom.plot(xs, [p["generate_tokens_per_s"] for p in pts], "s--", label="tokens/s of generate")
        bottom.set_ylabel("generated tokens / s")
        bottom.set_xlabel(xlabel)
        for ax in (top, bottom):
            ax.set_xticks(xs)
            ax.grid(alpha=0.3)
        if col == 0:
            top.legend(fontsize=8)
            bottom.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--quick", action="store_true", help="a small grid and 2 timed steps (see the docstring)")
    parser.add_argument("--batch_sizes", type=_ints, default=None)
    parser.add_argument("--lengths", type=_ints, default=None)
    parser.add_argument("--replicas", type=_ints, default=None)
    parser.add_argument("--base_batch", type=int, default=None)
    parser.add_argument("--base_length", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--points", default=None,
                        help="measure only these points, 'BxT[xN],...', and merge them into the existing JSON of "
                             "the same name (re-measuring points that others' work overlapped)")
    parser.add_argument("--out_dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--wait_for_load", type=float, default=None,
                        help="before every point, wait (polling every 30 s, up to 20 min) until the 1-min load "
                             "average is below this")
    args, extra = parser.parse_known_args(argv)
    grid = dict(QUICK if args.quick else FULL)
    for k in grid:
        if getattr(args, k) is not None:
            grid[k] = getattr(args, k)

    name = f"scaling-{args.preset}{'-quick' if args.quick else ''}"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.scaling " + " ".join(sys.argv[1:] if argv is None else argv)
    result: dict[str, Any] = {
        "command": command.strip(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(), "preset": args.preset, "grid": grid, "extra": list(extra),
    }
    plans = parse_points(args.points) if args.points else grid_plans(**grid)
    points = sweep(args.preset, extra, plans, steps=grid["steps"], warmup=grid["warmup"], max_load=args.wait_for_load)
    for p in points:
        p["date"] = result["date"]
    result["load_after"] = load_average()
    existing = out_dir / f"{name}.json"
    if args.points and existing.exists():  # merge: the new points replace the old ones at the same (B, T, N)
        old = json.loads(existing.read_text())
        key = lambda p: (p["batch_size"], p["max_new_tokens"], p["num_generators"])  # noqa: E731
        new_keys = {key(p) for p in points}
        points = [p for p in old["points"] if key(p) not in new_keys] + points
        result["grid"] = old["grid"]
        result["commands"] = old.get("commands", [old["command"]]) + [result["command"]]
    result["points"] = points
    grid = result["grid"]
    table = markdown(result["points"])
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{name}.md").write_text(table)
    plot(result["points"], grid["base_batch"], grid["base_length"], out_dir / f"{name}.png",
         f"PPO step scaling, preset {args.preset}, {result['machine']['cpus']} CPUs ({result['date'][:10]}), "
         f"median of {grid['steps']} steps")
    print(table)
    print(f"wrote {out_dir / name}.json, .md, .png", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
