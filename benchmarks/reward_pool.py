"""Reward scoring throughput (rows/s) against the number of reward workers, on a CPU-heavy
reward function: inline in the reward actor (reward_workers 0), then 1, 2, 4 workers.

    python -m benchmarks.reward_pool [--workers 0,1,2,4] [--rows 64] [--ms_per_row 10]
                                     [--repeats 3] [--chunk_size 0] [--num_cpus 4] [--out FILE.json]

The reward function is `burn` below: a pure-Python loop that holds the GIL for about
--ms_per_row milliseconds of CPU per row (its iteration count is calibrated once in the driver and
passed through the environment, so every worker burns the same amount). Each setting starts a
real reward actor (ppo_ray.driver.hosts.RewardHost, its RewardWorkerPool) on a local Ray with
--num_cpus CPUs, scores one warm-up batch, then --repeats batches of --rows rows; reported:
the median seconds of a score call and rows/s. Prints a table and one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

ITERS_ENV = "PPO_RAY_BENCH_BURN_ITERS"  # loop iterations per row, calibrated by the driver


def _spin(iters: int) -> int:
    x = 0
    for i in range(iters):
        x = (x * 31 + i) % 1000003
    return x


def burn(prompts: list[str], completions: list[str]) -> list[float]:
    """A CPU-heavy reward: ITERS_ENV iterations of pure Python per row (the GIL held)."""
    iters = int(os.environ.get(ITERS_ENV, "200000"))
    return [float(_spin(iters) % 7) + len(c) / 100.0 for c in completions]


def calibrate(ms_per_row: float) -> int:
    """Iterations of _spin that take about ms_per_row milliseconds of this process's CPU time
    (CPU time, not wall time: on a shared machine the wall clock also counts other processes)."""
    iters = 20000
    while True:
        t0 = time.process_time()
        _spin(iters)
        dt = time.process_time() - t0
        if dt > 0.05:
            return max(int(iters * ms_per_row / 1000.0 / dt), 1)
        iters *= 2


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reward_pool", description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="0,1,2,4", help="comma-separated reward_workers settings")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--ms_per_row", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk_size", type=int, default=0, help="reward_chunk_size (0: rows / workers)")
    p.add_argument("--num_cpus", type=int, default=4, help="CPUs of the local Ray (each worker reserves 1)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import ray
    import torch

    from ppo_ray.batch import RolloutBatch
    from ppo_ray.config import PPOConfig
    from ppo_ray.driver.hosts import RewardHost

    iters = calibrate(args.ms_per_row)
    root = str(Path(__file__).resolve().parent.parent)
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {ITERS_ENV: str(iters), "PYTHONPATH": root}})
    n = args.rows
    batch = RolloutBatch(
        prompt_ids=torch.full((n, 2), 5), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.full((n, 3), 6), response_mask=torch.ones(n, 3, dtype=torch.bool),
        gen_logprobs=torch.zeros(n, 3), adapter_version=0, pad_token_id=0, eos_token_id=1,
        prompts=[f"prompt {i}" for i in range(n)], responses=[f"response {i}" * (i % 5 + 1) for i in range(n)])
    rows = []
    reference = None
    for workers in [int(w) for w in args.workers.split(",")]:
        cfg = PPOConfig(model_name="embedded:tiny", reward_funcs=["benchmarks.reward_pool:burn"], batch_size=n,
                        reward_workers=workers, reward_chunk_size=args.chunk_size, reward_timeout_s=600.0,
                        kl_horizon=max(10000, n))
        host = ray.remote(RewardHost).options(max_concurrency=1).remote(cfg.slice("reward"), None)
        ray.get(host.__ray_ready__.remote())
        ray.get(host.score.remote(batch)[0])  # warm-up
        seconds = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            scores = ray.get(host.score.remote(batch)[0])
            seconds.append(time.perf_counter() - t0)
        scores = scores.tolist()
        reference = reference or scores
        assert scores == reference, "a setting scored differently"  # the same function on the same rows
        median = statistics.median(seconds)
        rows.append({"workers": workers, "seconds": median, "rows_per_s": n / median})
        ray.kill(host)
    ray.shutdown()
    base = rows[0]["rows_per_s"]
    print(f"{'reward_workers':>14} {'s / batch':>10} {'rows/s':>8} {'vs first':>9}")
    for r in rows:
        print(f"{r['workers']:>14} {r['seconds']:>10.3f} {r['rows_per_s']:>8.1f} {r['rows_per_s'] / base:>8.2f}x")
    result = {"machine": platform.machine(), "cores": os.cpu_count(), "rows": n, "ms_per_row": args.ms_per_row,
              "iters_per_row": iters, "chunk_size": args.chunk_size, "repeats": args.repeats, "results": rows}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
