"""Generation alone on the CPU: vLLM (as actors.vllm_engine.build_llm builds it) against HF
``generate``, on issue 16's peer work (the embedded tiny model, 64 prompts of 40-60 random
tokens, 16 new tokens at temperature 0.7, per-request seeds, the sampled tokens' processed
logprobs, no detokenisation: what the generator asks for).

    python -m benchmarks.generate_cpu hf|vllm [--engine_core inproc|process] [--repeats 5]

Each run builds one engine (or loads the model once), generates twice to warm up, then
`--repeats` times; prints JSON with the times, their median and the engine's start.
``--engine_core inproc`` sets VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core in this
process: what ppo_ray.driver.creation gives a CPU generator actor), ``process`` sets it to 1
(vLLM's and build_llm's default: a spawned engine-core process). One engine per process:
compare modes in separate runs, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generate_cpu", description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=("hf", "vllm"))
    p.add_argument("--engine_core", choices=("inproc", "process"), default="inproc")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads of HF generate")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.engine_core == "inproc" else "1"

    import torch

    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.paths import resolve_model_path

    model = resolve_model_path("embedded:tiny")
    tok = load_tokenizer(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randint(40, 60))] for _ in range(64)]
    result = {"engine": args.engine, "engine_core": args.engine_core if args.engine == "vllm" else None,
              "model": "embedded:tiny", "prompts": 64, "new_tokens": 16}
    if args.engine == "hf":
        from ppo_ray.modeling import load_causal_lm

        torch.set_num_threads(args.threads)
        lm = load_causal_lm(model, "float32").eval()
        width = max(len(x) for x in prompts)
        ids = torch.full((64, width), tok.pad_token_id)
        mask = torch.zeros((64, width), dtype=torch.long)
        for i, x in enumerate(prompts):
            ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1

        def run() -> None:
            with torch.no_grad():
                lm.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.7, top_k=0,
                            max_new_tokens=16, min_new_tokens=16, pad_token_id=tok.pad_token_id,
                            output_scores=True, return_dict_in_generate=True)
    else:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from actors.vllm_engine import build_llm

        t0 = time.perf_counter()
        llm = build_llm(model, dtype="float32", seed=0, max_model_len=128)
        result["start_s"] = time.perf_counter() - t0
        params = [SamplingParams(temperature=0.7, max_tokens=16, min_tokens=16, logprobs=0, detokenize=False, seed=i)
                  for i in range(64)]
        inputs = [TokensPrompt(prompt_token_ids=x) for x in prompts]

        def run() -> None:
            llm.generate(inputs, params, use_tqdm=False)

    times = []
    for _ in range(2 + args.repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    result.update(times=times, median_s=statistics.median(times[2:]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
