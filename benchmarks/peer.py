"""The peer comparison: our PPO step against TRL's PPOTrainer on the same work and model.

    python -m benchmarks.peer [--sizes tiny small] [--steps K] [--warmup W] [--out_dir DIR]
        [--trl_micro_batch_size M] [--<any PPOConfig field> VALUE ...]

Run it in the project's .venv. TRL runs in its own .venv-trl (benchmarks/trl_venv.sh makes
it when it is missing: TRL 1.12 on .venv's very torch / transformers / peft), so TRL is never
a dependency of the project. For each size, one after the other (never concurrently):

1. ours: ``python -m benchmarks.step --preset peer|peer-small --steps K --warmup W
   --no-baseline --out DIR/ours-<size>.json [overrides]``: the Ray trainer (vLLM generator,
   LoRA learner) on the work of benchmarks.step's "peer" preset (tiny: the 361K model,
   overhead-bound) or "peer-small" (the 25M model, compute-bound); the PPOConfig overrides
   given here go to it;
2. TRL: ``.venv-trl/bin/python -m benchmarks.trl_peer --size <size> --steps K --warmup W
   --out DIR/trl-<size>.json``: TRL's PPOTrainer on the same work (benchmarks/trl_peer.py).

Then a table (stdout; also DIR/peer.json): size, parameters, our median step, TRL's median
step, and ours / TRL (< 1: ours is faster). The medians are over the K timed steps of each;
every step of both processes the same 64 prompts x 16 tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
TRL_VENV = REPO / ".venv-trl"
PRESET_OF_SIZE = {"tiny": "peer", "small": "peer-small"}


def ours_median_step(result: dict) -> float:
    """benchmarks.step's JSON -> our median step seconds."""
    return float(result["ours"]["summary"]["step"]["median"])


def peer_row(size: str, ours: dict, trl: dict) -> dict:
    """One size's line of the comparison, from benchmarks.step's JSON and benchmarks.trl_peer's."""
    a, b = ours_median_step(ours), float(trl["median_step_s"])
    return {"size": size, "params": int(trl["params"]), "ours_median_step_s": a, "trl_median_step_s": b,
            "ratio_ours_over_trl": a / b if b > 0 else None, "ours_steps": len(ours["ours"]["per_step"]),
            "trl_steps": len(trl["steps"]), "trl_version": trl.get("trl_version")}


def format_table(rows: Sequence[dict]) -> str:
    lines = [f"{'size':<6} {'params':>12} {'ppo-ray median s':>17} {'TRL median s':>13} {'ours/TRL':>9}"]
    for r in rows:
        ratio = "-" if r["ratio_ours_over_trl"] is None else f"{r['ratio_ours_over_trl']:.2f}"
        lines.append(f"{r['size']:<6} {r['params']:>12,} {r['ours_median_step_s']:>17.3f} "
                     f"{r['trl_median_step_s']:>13.3f} {ratio:>9}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)  # --step etc. must not become --steps: they go to step.py
    parser.add_argument("--sizes", nargs="+", choices=sorted(PRESET_OF_SIZE), default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps K (each side)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps W (each side)")
    parser.add_argument("--trl_micro_batch_size", type=int, default=32,
                        help="TRL's per_device_train_batch_size (accumulating to 64; default 32 as the presets)")
    parser.add_argument("--out_dir", default=None,
                        help="where the JSONs go (default benchmarks/results/peer-<date>)")
    args, extra = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args, extra


def run(cmd: list[str]) -> None:
    print("[peer] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # the JSON goes to --out


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args, extra = parse_args(argv)
    out_dir = Path(args.out_dir or REPO / "benchmarks" / "results" /
                   f"peer-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    trl_python = TRL_VENV / "bin" / "python"
    if not trl_python.exists():
        run(["bash", str(REPO / "benchmarks" / "trl_venv.sh")])
    rows = []
    for size in args.sizes:
        ours_out, trl_out = out_dir / f"ours-{size}.json", out_dir / f"trl-{size}.json"
        run([sys.executable, "-m", "benchmarks.step", "--preset", PRESET_OF_SIZE[size], "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--no-baseline", "--out", str(ours_out), *extra])
        run([str(trl_python), "-m", "benchmarks.trl_peer", "--size", size, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--micro_batch_size", str(args.trl_micro_batch_size),
             "--out", str(trl_out)])
        rows.append(peer_row(size, json.loads(ours_out.read_text()), json.loads(trl_out.read_text())))
    table = format_table(rows)
    command = "python -m benchmarks.peer " + " ".join(sys.argv[1:] if argv is None else argv)
    (out_dir / "peer.json").write_text(json.dumps({"command": command.strip(), "overrides": extra, "rows": rows,
                                                   "cpus": len(os.sched_getaffinity(0))}, indent=1) + "\n")
    print(table)
    print(f"[peer] JSONs in {out_dir}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
