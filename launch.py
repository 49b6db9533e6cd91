"""ppo-ray command line.

    python launch.py                                   # the embedded default (local Ray)
    python launch.py ppo --config configs/tiny.yaml --steps 30 --kl_coef 0.05
    RAY_ADDRESS=... python launch.py ppo --config ...   # attach to a running cluster
    ray job submit --working-dir . -- python launch.py ppo --config ...

Every `--name value` is a PPOConfig field (see ppo_ray/config.py); `--config FILE` loads a
YAML preset first. `--run_dir DIR` picks the run directory (default output_dir/<time>).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"
STAGES = ("ppo",)


def _pop_option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(f"--{name}="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from ppo_ray.config import ConfigError, parse_overrides

    run_dir_opt = _pop_option(argv, "run_dir")
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    try:
        config, positional = parse_overrides(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stage = positional[0] if positional else "ppo"
    if stage not in STAGES or len(positional) > 1:
        print(f"error: unknown stage {' '.join(positional)!r}; stages: {', '.join(STAGES)}", file=sys.stderr)
        return 2

    run_dir = Path(run_dir_opt or Path(config.output_dir) / time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    config.to_yaml(run_dir / "config.yaml")
    print(f"[ppo-ray] run directory: {run_dir}")

    from actors.reward import RewardError
    from ppo_ray.data import load_prompts
    from ppo_ray.placement import ClusterError
    from ppo_ray.trainer import PPOTrainer

    try:
        prompts = load_prompts(config)
        trainer = PPOTrainer(config, run_dir=run_dir)
    except (ClusterError, RewardError, FileNotFoundError) as e:
        # expected, user-fixable problems: the message names the bad thing; no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    history = trainer.train(prompts, metrics_path=run_dir / "metrics.jsonl")
    for h in history:
        print(f"step {h['step']:4d}  reward {h['reward_mean']:+.4f}  kl {h['kl']:+.4f}  "
              f"policy_loss {h['policy_loss']:+.4f}  value_loss {h['value_loss']:.4f}  "
              f"clipfrac {h['clipfrac']:.3f}  step {h['time/step_s']:.2f}s")
    summary = {"steps": len(history), "first_reward": history[0]["reward_mean"],
               "last_reward": history[-1]["reward_mean"], "run_dir": str(run_dir)}
    print(json.dumps(summary))
    trainer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
