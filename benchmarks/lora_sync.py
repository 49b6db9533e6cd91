"""What one LoRA sync costs in the generator, by file (lora_sync adapter) and from memory
(lora_sync tensor), on one vLLM engine: the wall time of Generator.load_adapter per version.

    python -m benchmarks.lora_sync [--model qwen3-0.6b|test] [--dtype bfloat16|float32]
                                   [--lora_r 16] [--versions 10] [--out FILE.json]

The model: randomly initialised weights with Qwen3-0.6B-Base's architecture (benchmarks.gpu_step
.write_models: the cost depends on the adapter's size and the engine, not the weights), LoRA on
every attention and MLP projection. One engine built for the tensor mode (its worker extension
changes nothing for the file path), so both modes load into the same engine, alternating, the
first load of each discarded (warm-up). Per version and mode: write_s (the adapter's files;
0 from memory), register_s (vLLM's load and validation), retire_s (the previous adapter and
its files, the prefix-cache reset), total. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora_sync", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b", choices=("qwen3-0.6b", "test"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--versions", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process

    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from actors.generator import Generator
    from actors.lora_sync import TensorSync
    from actors.vllm_engine import build_llm
    from benchmarks.gpu_step import MODELS, write_models
    from ppo_ray.config import ALL_PROJECTIONS
    from ppo_ray.modeling import LoraSpec, LoraWeights, load_causal_lm, load_tokenizer

    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="lora-sync-"))
    lm_dir, _ = write_models(root, MODELS[args.model], args.dtype, "cpu")
    peft = get_peft_model(load_causal_lm(str(lm_dir), args.dtype), LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=list(ALL_PROJECTIONS), lora_dropout=0.0))
    spec = LoraSpec.of(peft.peft_config["default"])
    state = {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(peft).items()}
    del peft
    llm = build_llm(lm_dir, dtype=args.dtype, seed=0, kv_cache_gib=1.0, max_model_len=1024,
                    **TensorSync.engine_args(args.lora_r))
    tok = load_tokenizer(str(lm_dir))
    gens = {mode: Generator(llm, tok, model_dir=str(lm_dir), lora_sync=mode, max_new_tokens=4, seed=0)
            for mode in ("adapter", "tensor")}
    rows: dict[str, list[dict]] = {mode: [] for mode in gens}
    for version in range(1, args.versions + 2):
        g = torch.Generator().manual_seed(version)
        weights = LoraWeights({k: 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}, spec)
        for mode, gen in gens.items():
            t = time.perf_counter()
            report = gen.load_adapter(version, weights)
            total = time.perf_counter() - t
            if version > 1:  # the first load of each mode is the warm-up
                rows[mode].append({"write_s": report.write_s, "register_s": report.register_s,
                                   "retire_s": report.retire_s, "total_s": total})
            gen.close() if version == args.versions + 1 else None
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "model": args.model, "dtype": args.dtype, "lora_r": args.lora_r, "adapter_mib": weights.nbytes / 2**20,
           "versions": args.versions}
    for mode, rs in rows.items():
        out[mode] = {k: {"median": statistics.median(r[k] for r in rs), "min": min(r[k] for r in rs)}
                     for k in rs[0]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
