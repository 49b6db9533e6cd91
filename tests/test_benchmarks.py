"""The step benchmark (benchmarks/step.py) produces a complete report: every phase of ours
and of the in-run baseline, positive numbers, the ratio, the actors' peak memory.

Correctness of the report only; the numbers themselves are measured, never asserted
(benchmarks/RESULTS.md). The fast test runs in-process on the session's tiny trainer (no
second vLLM engine start); the slow one runs the documented command as a subprocess on a
local Ray of its own (~60-90 s on 2 idle cores, most of it the engine start).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

OURS_PHASES = ("generate", "reference", "reward", "learner_forward", "update", "sync", "sync_transfer",
               "sync_engine", "sync_write", "sync_register", "overhead", "step")
BASELINE_PHASES = ("generate", "reference", "reward", "learner_forward", "update", "step")
THROUGHPUT = ("response_tokens", "tokens_per_s", "samples_per_s", "generate_tokens_per_s")


def check_report(result: dict, steps: int) -> None:
    ours, base = result["ours"], result["baseline"]
    if result["config"]["lora_sync_mode"] == "merged":  # no adapter files written: 0 s
        assert ours["summary"]["sync_write"]["max"] == 0.0
        ours_phases = tuple(k for k in OURS_PHASES if k != "sync_write")
    else:
        ours_phases = OURS_PHASES
    for part, phases in ((ours, ours_phases), (base, BASELINE_PHASES)):
        assert len(part["per_step"]) == steps
        for k in (*phases, *THROUGHPUT):
            s = part["summary"][k]
            assert set(s) == {"median", "min", "max"}, k
            assert all(math.isfinite(v) for v in s.values()), (k, s)
            assert s["min"] <= s["median"] <= s["max"], (k, s)
            assert s["min"] > 0, (k, s)  # every timed phase took time; tokens were generated
    # The overhead is the step's wall time outside its timed phases: the actors' own timings
    # fit inside the driver's wall time of the step (no phase counted twice, none longer than
    # the step), and the engine's part of the sync fits inside the driver's sync.
    for step in ours["per_step"]:
        assert 0 <= step["overhead"] < step["step"], step
        assert step["sync_engine"] <= step["sync"], step
    for name in ("generator-0", "reference", "reward", "learner"):
        assert ours["memory"][name]["peak_rss_mib"] > 0
        malloc = ours["memory"][name]["malloc_mib"]  # glibc's own account (mallinfo2)
        assert malloc["heap"] > 0 and malloc["in_use"] + malloc["free"] <= malloc["heap"] + 1, (name, malloc)
    # The vLLM engine core runs in the CPU generator actor's own process (ppo_ray.driver.creation sets
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the environment says otherwise): no child then.
    children = ours["memory"]["generator-0"]["children_peak_rss_mib"]
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0":
        assert children == 0 and ours["memory"]["generator-0"]["peak_rss_mib"] > ours["memory"]["reference"]["peak_rss_mib"]
    else:
        assert children > 0  # the engine core process
    assert base["memory"]["process"]["peak_rss_mib"] > 0
    assert base["torch_threads"] >= 1
    ratio = result["ratio"]
    for k in ("step", "generate", "reference", "reward", "learner_forward", "update"):
        assert math.isfinite(ratio[k]) and ratio[k] > 0, (k, ratio)
    assert result["load_before"]["load_average"] and result["machine"]["cpus"] >= 1
    json.dumps(result)  # the report is JSON


def test_step_benchmark_report(tiny_trainer):
    """Ours on the session's trainer (warm-up 1 + 2 steps of 4 prompts), then the baseline."""
    import torch

    from benchmarks.step import benchmark, format_summary

    threads = torch.get_num_threads()
    config = tiny_trainer.config.replace(batch_size=4)  # the trainer's learner: one minibatch either way
    result = benchmark(config, steps=2, warmup=1, preset="tiny", trainer=tiny_trainer)
    check_report(result, steps=2)
    assert result["config"]["batch_size"] == 4
    assert result["ours"]["per_step"][0]["samples_per_s"] * result["ours"]["per_step"][0]["step"] == pytest.approx(4)
    assert torch.get_num_threads() == threads  # the baseline restored the thread count
    assert "ours/baseline" in format_summary(result)
    # the FLOP floor: a measured GEMM rate, each phase's FLOPs on the steps' real tokens
    assert result["gemm"]["flops_per_s"] > 0 and result["gemm"]["n"] == 2048
    floor = result["ours"]["floor"]
    assert set(floor) == {"generate", "reference", "reward", "scorers", "learner_forward", "update", "step"}
    assert floor["reward"]["flop"] == 0  # the tiny config's reward is a function, no model
    # the two scorers together, against the wall time they share
    per_step = result["ours"]["per_step"]
    assert floor["scorers"]["flop"] == floor["reference"]["flop"] + floor["reward"]["flop"]
    assert floor["scorers"]["measured_s"] == pytest.approx(sum(max(s["reference"], s["reward"]) for s in per_step))
    # learner_forward: 0 FLOPs at a version where the generator's logprobs stand in (old_logprobs: auto)
    # and the value model's old values come from the update (old_values: auto, one minibatch)
    for phase in ("generate", "reference", "learner_forward", "update"):
        row = floor[phase]
        assert row["flop"] > 0 or phase == "learner_forward"
        assert row["floor_s"] == pytest.approx(row["flop"] / result["gemm"]["flops_per_s"])
        assert row["fraction_of_floor"] == pytest.approx(row["floor_s"] / row["measured_s"])
    assert "fraction of floor" in format_summary(result)


def test_memory_watch_names_every_actor_and_reads_its_peak(tiny_trainer):
    """benchmarks.memory's sampler over this session's Ray (its workers descend from this
    process): every actor of the trainer is found, named by its role, and its peak RSS is at
    least the VmHWM the actor read of itself just before (the kernel's peak only grows)."""
    from benchmarks.memory import MemoryWatch, format_table
    from benchmarks.step import actor_memory

    inside = actor_memory(tiny_trainer.roles)
    watch = MemoryWatch(os.getpid(), tag=None)
    sums = watch.sample()
    report = watch.report()
    by_pid = {p["pid"]: p for p in report["processes"]}
    for name in ("generator-0", "reference", "reward", "learner"):
        seen = by_pid[inside[name]["pid"]]
        assert seen["role"].startswith(name.split("-")[0]), (name, seen["role"], seen["titles"])
        assert seen["hwm_mib"] >= inside[name]["peak_rss_mib"] > 0, (name, seen, inside[name])
        assert seen["pss_mib"] > 0 and seen["anon_mib"] > 0 and seen["minflt"] > 0
    assert by_pid[os.getpid()]["role"] == "driver"
    assert "ray system" in report["roles"]  # gcs_server, raylet, ... started by this process
    total = report["totals_gib"]["all"]
    assert 0 < total["pss"] <= total["rss"] <= total["hwm_sum"] and sums["processes"] >= 6
    table = format_table(report)
    assert all(role in table for role in report["roles"])


def test_memory_command_follows_its_processes_and_their_peaks(tmp_path):
    """python -m benchmarks.memory -- COMMAND: the command's own peak RSS to its last page
    (wait4), and a process that left its tree (its parent exited, as a Ray worker's may) found
    by the marker in its environment; the JSON on stdout and in --out, the table on stderr."""
    script = textwrap.dedent("""
        import subprocess, sys, time
        x = bytearray(150 * 2**20)  # touched: 150 MiB resident
        # an intermediate that starts a grandchild and exits: the grandchild leaves the tree
        subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                        "'import time; y = bytearray(100 * 2**20); time.sleep(3)'])"])
        time.sleep(2)
        x = bytearray(200 * 2**20)  # a new peak in the last moment before exit: no sample sees it
    """)
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--sample_s", "0.2", "--out", str(out), "--",
                           sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert json.loads(out.read_text()) == result and result["returncode"] == 0
    roles = result["memory"]["roles"]
    assert roles["driver"]["hwm_mib"] >= 150 + 200  # the two bytearrays were alive together at the end
    grandchild = [p for p in result["memory"]["processes"] if p["titles"][0].endswith("time.sleep(3)")]
    assert len(grandchild) == 1 and grandchild[0]["hwm_mib"] >= 100, result["memory"]["processes"]
    assert grandchild[0]["role"] == "other: python"
    assert "peak RSS MiB" in proc.stderr and "driver" in proc.stderr


def test_flop_counts_match_a_hand_count():
    """benchmarks.flops on a one-layer model small enough to count by hand: matmul
    parameters N = 16 (q) + 2 x 16 (k, v) + 16 (o) + 3 x 32 (MLP) = 160; 2 prompt + 1
    response tokens."""
    from benchmarks.flops import forward_flops, learner_flops, step_flops

    shape = dict(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                 num_key_value_heads=1, head_dim=4, vocab_size=10)
    base, attn, head = 2 * 160 * 3, 2 * 4 * 3 * 4, 2 * 4 * 10 * 1  # 2 N n; 2 q n (n + 1); 2 H V r
    lora = 2 * 2 * (4 + 4) * 3  # r = 2 on q_proj: 2 r (in + out) per token
    assert forward_flops(shape, [2], [1]) == base + attn + head
    assert forward_flops(shape, [2], [1], logits=False) == base + attn
    assert forward_flops(shape, [2], [1], lora_r=2, lora_targets=["q_proj"]) == base + attn + head + lora
    one = learner_flops(shape, [2], [1], ppo_epochs=3, lora_r=2, lora_targets=["q_proj"], models=1)
    assert one["learner_forward"] == base + lora + attn + head
    assert one["update"] == 3 * ((base + lora + attn + head) + (base + 2 * lora + 2 * attn + head))
    assert one["matmul_parameters"] == 160 and one["real_tokens"] == 3
    two = learner_flops(shape, [2], [1], ppo_epochs=1, lora_r=2, lora_targets=["q_proj"], models=2)
    assert two["learner_forward"] == 2 * (base + lora + attn) + head  # the value model has no lm_head

    from ppo_ray.config import PPOConfig

    config = PPOConfig(lora_r=2, lora_target_modules=["q_proj"], ppo_epochs=3, advantage_estimator="grpo",
                       samples_per_prompt=2, batch_size=8)
    flops = step_flops({"policy": shape, "reward": shape}, [2], [1], config)
    assert flops == {"generate": base + attn + head + lora, "reference": base + attn + head,
                     "reward": base + attn, "learner_forward": one["learner_forward"], "update": one["update"]}
    # the generator's old logprobs: no policy pass; the value model's (no lm_head), none without a critic
    assert step_flops({"policy": shape, "reward": None}, [2], [1], config, recomputed=False)["learner_forward"] == 0
    gae = config.replace(advantage_estimator="gae", samples_per_prompt=1, old_values="forward")
    assert step_flops({"policy": shape, "reward": None}, [2], [1], gae, recomputed=False)["learner_forward"] == \
        base + lora + attn
    # old_values: update (auto with one minibatch): no value pass; the policy's alone when it recomputes
    gae = gae.replace(old_values="auto")
    assert gae.old_values_source == "update"
    assert step_flops({"policy": shape, "reward": None}, [2], [1], gae, recomputed=False)["learner_forward"] == 0
    assert step_flops({"policy": shape, "reward": None}, [2], [1], gae)["learner_forward"] == \
        base + lora + attn + head
    no_pass = learner_flops(shape, [2], [1], ppo_epochs=1, lora_r=2, lora_targets=["q_proj"], value_pass=False)
    assert no_pass["learner_forward"] == base + lora + attn + head and no_pass["update"] == two["update"]


def test_step_benchmark_cli_arguments():
    """Presets and --field overrides go through PPOConfig's own parser and validation."""
    from benchmarks.step import build_config, parse_args
    from ppo_ray.config import ConfigError

    args, extra = parse_args(["--preset", "small", "--batch_size", "8", "--no-baseline", "--kl_coef", "0.2"])
    config = build_config(args.preset, extra)
    assert (config.model_name, config.batch_size, config.max_new_tokens, config.kl_coef) == ("embedded:small", 8, 64, 0.2)
    assert args.baseline is False
    with pytest.raises(ConfigError, match="kl_coeff"):
        build_config("tiny", ["--kl_coeff", "0.2"])


def test_peer_preset_is_the_single_process_comparisons_work(tiny_model_dir):
    """The preset of the comparison with a single-process trainer: 64 prompts of <= 60
    tokens, 16 new tokens at temperature 0.7, 1 epoch over 1 minibatch, a reward model of
    the policy's shape (a real sequence classifier: the reward actor's checks pass) and a
    separate value model."""
    from ppo_ray.rewards import check_reward_model
    from benchmarks.step import build_config

    config = build_config("peer")
    assert (config.batch_size, config.max_new_tokens, config.max_prompt_length, config.temperature) == (64, 16, 60, 0.7)
    assert (config.top_k, config.top_p, config.ppo_epochs, config.effective_mini_batch_size) == (0, 1.0, 1, 64)
    assert config.reward_funcs == [] and config.value_model == "separate"
    check_reward_model(config.reward_model_name)
    assert build_config("peer").reward_model_name == config.reward_model_name  # built once, then reused


def test_peer_small_preset_is_the_peer_work_on_the_small_model(tiny_model_dir, monkeypatch):
    """"peer-small" is "peer" with the 25M model and ITS reward model (the small base with a
    1-label head); the sentinel goes to peer_reward_model("small") (stubbed here with the
    tiny reward model: building the 25M model belongs to the slow tests)."""
    import benchmarks.step as step

    assert {k: v for k, v in step.PRESETS["peer-small"].items() if k not in ("model_name", "reward_model_name")} == \
        {k: v for k, v in step.PRESETS["peer"].items() if k not in ("model_name", "reward_model_name")}
    assert step.PRESETS["peer-small"]["model_name"] == "embedded:small"
    asked = []
    tiny_rm = step.peer_reward_model("tiny")
    monkeypatch.setattr(step, "peer_reward_model", lambda size="tiny": asked.append(size) or tiny_rm)
    config = step.build_config("peer-small", ["--kl_coef", "0.1"])
    assert asked == ["small"] and config.reward_model_name == tiny_rm
    assert (config.model_name, config.batch_size, config.max_new_tokens, config.max_prompt_length) == \
        ("embedded:small", 64, 16, 60)
    assert (config.temperature, config.top_k, config.top_p, config.ppo_epochs, config.effective_mini_batch_size) == \
        (0.7, 0, 1.0, 1, 64)
    assert config.reward_funcs == [] and config.value_model == "separate" and config.kl_coef == 0.1


def test_peer_reward_model_of_the_tiny_size_is_the_tiny_reward_model(tiny_model_dir):
    """The builder generalised to a size keeps the tiny reward model where it was (the base's
    directory name + "-reward-seed0" in the model cache): one directory for both names."""
    from benchmarks.step import peer_reward_model, tiny_reward_model
    from ppo_ray.tiny_model import default_cache_dir

    path = peer_reward_model("tiny")
    assert path == tiny_reward_model() == str(default_cache_dir() / f"{Path(tiny_model_dir).name}-reward-seed0")


def test_trl_peer_prompts_are_the_peer_presets(tiny_model_dir):
    """TRL's side of the peer comparison (run in .venv-trl; imported here without TRL: its
    TRL imports are lazy) tokenises the same prompt batches as ours: 64 per step, the last 60
    tokens of each, as the trainer's encode_prompts gives them."""
    from benchmarks.step import build_config, prompt_batches
    from benchmarks.trl_peer import BATCH_SIZE, MAX_NEW_TOKENS, MAX_PROMPT_LENGTH, parse_args, peer_prompt_ids
    from ppo_ray.data import encode_prompts
    from ppo_ray.modeling import load_tokenizer

    config = build_config("peer")
    assert (BATCH_SIZE, MAX_NEW_TOKENS, MAX_PROMPT_LENGTH) == (config.batch_size, config.max_new_tokens,
                                                               config.max_prompt_length)
    tok = load_tokenizer(str(tiny_model_dir))
    ids = peer_prompt_ids(tok, 2)
    batches = prompt_batches(2, 64)
    assert ids == [x for b in batches for x in encode_prompts(tok, b, 60, config.prompt_truncation)]
    assert len(ids) == 128 and max(len(x) for x in ids) == 60
    args = parse_args(["--size", "small", "--steps", "3", "--warmup", "1"])
    assert (args.size, args.steps, args.warmup, args.micro_batch_size) == ("small", 3, 1, 32)
    with pytest.raises(SystemExit):
        parse_args(["--micro_batch_size", "48"])  # must divide 64


def test_peer_comparison_table_and_arguments():
    """benchmarks.peer: our median step (benchmarks.step's JSON) over TRL's (trl_peer's JSON);
    unknown options are PPOConfig overrides for benchmarks.step, never abbreviations of its own."""
    from benchmarks.peer import format_table, parse_args, peer_row

    ours = {"ours": {"summary": {"step": {"median": 1.5, "min": 1.0, "max": 2.0}},
                     "per_step": [{"step": 1.0}, {"step": 1.5}, {"step": 2.0}]}}
    trl = {"framework": "trl", "params": 361_344, "median_step_s": 0.5, "steps": [0.4, 0.5, 0.6],
           "trl_version": "1.12.0"}
    row = peer_row("tiny", ours, trl)
    assert row["ratio_ours_over_trl"] == pytest.approx(3.0)
    assert (row["ours_median_step_s"], row["trl_median_step_s"], row["params"]) == (1.5, 0.5, 361_344)
    assert (row["ours_steps"], row["trl_steps"]) == (3, 3)
    table = format_table([row, peer_row("small", ours, {**trl, "params": 25_175_552, "median_step_s": 3.0})])
    lines = table.splitlines()
    assert "ours/TRL" in lines[0] and len(lines) == 3
    assert lines[1].split()[0] == "tiny" and lines[1].split()[-1] == "3.00" and "361,344" in lines[1]
    assert lines[2].split()[0] == "small" and lines[2].split()[-1] == "0.50"
    args, extra = parse_args(["--sizes", "small", "--steps", "3", "--kl_coef", "0.2", "--step", "x"])
    assert (args.sizes, args.steps, args.warmup) == (["small"], 3, 2)
    assert extra == ["--kl_coef", "0.2", "--step", "x"]


@pytest.mark.slow
def test_step_benchmark_command(tmp_path):
    """The documented command, as a user runs it: JSON on stdout and in --out."""
    out = tmp_path / "step.json"
    env = {**os.environ, "RAY_ADDRESS": "", "VLLM_LOGGING_LEVEL": "WARNING"}  # a local Ray of its own
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.step", "--preset", "tiny", "--steps", "2", "--warmup", "1",
         "--batch_size", "4", "--max_new_tokens", "8", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    check_report(result, steps=2)
    assert result["config"]["max_new_tokens"] == 8 and result["ours"]["startup_s"] > 0


@pytest.mark.heavy("runs the benchmark's miniature learner")
def test_gpu_step_benchmark_on_cpu(tmp_path):
    """benchmarks/gpu_step.py (run on the lent GPU, which has no Ray/vLLM) works end to end on
    its 2-layer miniature: every phase measured, tokens counted, the one-off phases run and
    the JSON written."""
    from benchmarks.gpu_step import main

    out = tmp_path / "gpu.json"
    result = main(["--model", "test", "--batch_sizes", "4", "--steps", "1", "--warmup", "0", "--prompt_len", "8:12",
                   "--max_new_tokens", "4", "--device", "cpu", "--out", str(out),
                   "--learner_compile", "false"])  # the preset compiles (GPU); on the CPU that costs ~60 s
    assert json.loads(out.read_text())["runs"][0]["batch_size"] == 4
    assert result["config"]["learner_compile"] is False
    run = result["runs"][0]
    summary = run["summary"]
    for phase in ("generate", "reference", "reward", "learner_forward", "update", "lora_export", "step"):
        assert summary[phase]["median"] > 0, phase
    assert summary["response_tokens"]["median"] == 4 * 4  # random weights: no EOS, every response runs to the limit
    assert 4 * 8 <= summary["prompt_tokens"]["median"] <= 4 * 12
    assert summary["lora_mib"]["median"] > 0
    for key in ("reference_actor_s", "lora_merge_s", "generate_merged_s"):
        assert run[key] > 0, key
    assert result["parameters"] > 0 and result["model_shape"]["vocab_size"] == 151936
    assert summary["padded_token_ratio"]["median"] >= 1.0 and summary["update_flop"]["median"] > 0
    assert "mfu_update" not in summary  # no GPU, no peak rate
    assert result["gemm"]["flops_per_s"] > 0 and result["gemm"]["dtype"] == "float32"
    assert summary["floor_fraction_update"]["median"] > 0  # the floor is measured on any device


def test_gpu_step_passes_learner_options_and_counts_flops():
    """Unknown --options go to PPOConfig (the learner speed options); learner_flops' formula
    on a shape small enough to count by hand."""
    from benchmarks.gpu_step import learner_flops, parse_args, peak_flops

    args = parse_args(["--batch_sizes", "64", "--learner_layout", "causal", "--logprob_chunk_size", "512"])
    assert args.batch_sizes == [64] and args.config_overrides == ["--learner_layout", "causal",
                                                                  "--logprob_chunk_size", "512"]
    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989.4e12
    shape = dict(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                 num_key_value_heads=1, head_dim=4, vocab_size=10)
    flops = learner_flops(shape, [2], [1], ppo_epochs=1, lora_r=1, lora_targets=["q_proj"])
    # matmul params 4*4*4 + 3*4*8 = 160; 3 tokens: base 2*160*3 = 960, LoRA 2*1*(4+4)*3 = 48,
    # attention 2*4*3*4 = 96, lm_head 2*4*10*1 = 80 (policy only)
    assert flops["matmul_parameters"] == 160 and flops["real_tokens"] == 3
    assert flops["learner_forward"] == 2 * (960 + 48 + 96) + 80
    assert flops["update"] == flops["learner_forward"] + 2 * (960 + 2 * 48 + 2 * 96) + 80
    shared = learner_flops(shape, [2], [1], ppo_epochs=1, lora_r=1, lora_targets=["q_proj"], models=1)
    assert shared["learner_forward"] == (960 + 48 + 96) + 80  # value_model: shared, one trunk
    assert shared["update"] == shared["learner_forward"] + (960 + 2 * 48 + 2 * 96) + 80
    assert parse_args(["--extras", "false"]).extras is False and parse_args([]).extras is True


@pytest.mark.heavy("runs the benchmark's miniature learner")
def test_learner_profile_on_cpu(tmp_path):
    """benchmarks/learner_profile.py on its miniature: the plain path and the speed options
    on one learner, each with its phases, padding ratio and split timings."""
    from benchmarks.learner_profile import main

    out = tmp_path / "learner.json"
    result = main(["--model", "test", "--batch_size", "4", "--variants", "base,all_mb2", "--split", "all_mb2",
                   "--profile", "none", "--prompt_len", "4:9", "--response_len", "2:3", "--device", "cpu",
                   "--out", str(out)])
    assert json.loads(out.read_text())["variants"].keys() == {"base", "all_mb2"}
    base, fast = result["variants"]["base"], result["variants"]["all_mb2"]
    for row in (base, fast):
        assert "error" not in row and row["update_s"] > 0 and row["learner_forward_s"] > 0
        assert row["padded_token_ratio"] >= 1.0
    assert fast["split"]["policy_fwd_bwd_s"] > 0 and fast["split"]["micro_batch_rows"] == 2
    assert result["flops"]["update"] > result["flops"]["learner_forward"] > 0


def test_learner_profile_refuses_unknown_variants_before_loading_a_model(capsys):
    """A one-call device check cannot afford a typo found after the model loads."""
    from benchmarks.learner_profile import VARIANTS, parse_args

    with pytest.raises(SystemExit):
        parse_args(["--variants", "merged_compile_mb64,merged_compile_gc_mb4"])
    assert "unknown --variants ['merged_compile_gc_mb4']" in capsys.readouterr().err
    assert parse_args(["--variants", "merged_compile_gc_mb128"]).variants == "merged_compile_gc_mb128"
    assert VARIANTS["merged_compile_gc_mb128"]["gradient_checkpointing"] is True


def test_profile_kernel_categories_of_h100_kernel_names():
    """The profile's breakdown sorts kernels as the fifth GPU session's trace needed by hand
    (names from that trace, torch 2.11 on an H100)."""
    from benchmarks.learner_profile import kernel_breakdown, kernel_category

    names = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "gemm",
        "nvjet_sm90_tst_64x32_64x16_2x1_v_bz_splitK_NTT": "gemm_small",
        "nvjet_sm90_tst_16x192_64x8_1x4_h_bz_TNN": "gemm_small",
        "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNN": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*, v": "attention",
        "void cudnn::fusion::fmha_reduce_head<true>(void const*, void*, unsigned int, unsigned i": "attention",
        "triton_poi_fused__unsafe_view_mul_silu_7": "inductor",
        "triton_per_fused__fused_rms_norm__scaled_dot_product_cudnn_attention__unsafe_view_add_c": "inductor",
        "Memcpy DtoH (Device -> Pageable)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::Tenso": "aten",
        "void some_library::unknown_kernel<float>(float*)": "other",
    }
    assert {n: kernel_category(n) for n in names} == names
    shares = kernel_breakdown([("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 0.6),
                               ("nvjet_sm90_tst_16x192_64x8_1x4_h_bz_TNN", 0.1), ("triton_poi_fused_add_0", 0.2),
                               ("triton_per_fused_rms_1", 0.1)])
    assert list(shares) == ["gemm", "inductor", "gemm_small"]
    assert shares["inductor"] == {"s": 0.3, "share": 0.3} and shares["gemm"]["share"] == 0.6


def test_gpu_sh_stages_have_functions_and_unknown_ones_are_refused(tmp_path):
    """benchmarks/gpu.sh (the one-call checks on a lent GPU) lists every stage of its table with
    a description, each stage has its function, `next` is still gpu_next.sh's three stages, and
    an unknown name stops the call before anything runs (no $OUT made). No model runs."""
    script = ROOT / "benchmarks" / "gpu.sh"
    listed = subprocess.run(["bash", str(script), "--list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr  # --list also checks the tables against the functions
    table = script.read_text().split("STAGES=$(cat <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    stages = [line.split()[0] for line in table.splitlines() if line.strip()]
    assert len(stages) == len(set(stages)) >= 10
    rows = {line.split()[0]: line.split()[3:] for line in listed.stdout.splitlines() if line.startswith("  ")}
    assert all(rows.get(s) for s in stages), [s for s in stages if not rows.get(s)]  # listed, described
    # Sourced, the script defines its functions without running: bash itself says which exist.
    missing = subprocess.run(["bash", "-c", 'source "$1"; shift; for s; do declare -F "stage_$s" >/dev/null || echo "$s"; done',
                              "bash", str(script), *stages], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 0 and missing.stdout == "", missing.stdout + missing.stderr
    assert rows["next"][-3:] == ["step_shared", "step_separate", "profile]"]  # gpu_next.sh's stages, in order

    out = tmp_path / "out"
    for args in (["no_such_stage"], ["next", "no_such_stage"]):
        bad = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "OUT": str(out)})
        assert bad.returncode == 2 and "'no_such_stage'" in bad.stderr, (args, bad.stderr)
    assert not out.exists()


def test_compare_estimators_runs_selection_and_table(tmp_path):
    """benchmarks/compare_estimators.py: a run spec becomes launch.py options (a bad part is
    refused naming it), --select keeps each estimator's best run by validation (win rate vs
    SFT, then gold), and a finished run directory becomes a table row (sums of the steps'
    times). The runs themselves are measured, never asserted (benchmarks/RESULTS.md)."""
    from benchmarks import compare_estimators as ce

    assert ce.parse_run("gae") == ["--advantage_estimator", "gae"]
    assert ce.parse_run("rloo:n=4:kl=loss:dual_clip=3") == [
        "--advantage_estimator", "rloo", "--samples_per_prompt", "4", "--kl_in_loss", "true", "--dual_clip", "3"]
    assert ce.parse_run("grpo:kl=reward")[-2:] == ["--kl_in_loss", "false"]
    for bad, named in (("grpo:n4", "'n4'"), ("grpo:kl=both", "'both'"), ("grpo:n=", "'n='")):
        with pytest.raises(SystemExit, match=named):
            ce.parse_run(bad)
    rows = [{"run": "gae", "win_val_vs_sft": 0.5, "gold_val": 0.9},
            {"run": "grpo:n=4", "win_val_vs_sft": 0.7, "gold_val": 0.90},
            {"run": "grpo:n=8", "win_val_vs_sft": 0.7, "gold_val": 0.95},
            {"run": "rloo:n=4", "win_val_vs_sft": 0.8, "gold_val": 0.10}]
    assert ce.select(rows, ["gae", "grpo:n=4", "grpo:n=8", "rloo:n=4"]) == ["gae", "grpo:n=8", "rloo:n=4"]

    run = tmp_path / "grpo_n4-s0"
    run.mkdir()
    report = {"win_rate_val_ppo_vs_sft": 0.75, "gold_val_ppo": 0.9, "win_rate_ppo_vs_sft": 0.8,
              "win_rate_ppo_vs_reference": 0.6, "gold_test_ppo": 0.95, "final_kl": 1.5, "seconds": 200.0}
    (run / "report-ppo.json").write_text(json.dumps(report))
    steps = [{"time/step_s": 3.0, "time/learner_forward_s": 0.5, "time/update_s": 1.0},
             {"time/step_s": 5.0, "time/learner_forward_s": 0.25, "time/update_s": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    row = ce.summarise(run, "grpo:n=4", 0)
    assert (row["loop_s"], row["learner_s"], row["stage_s"], row["win_vs_reference"]) == (8.0, 3.75, 200.0, 0.6)
    table = ce.tables([row, {**row, "seed": 1, "win_vs_sft": 0.6}], ["grpo:n=4"])
    assert "| grpo:n=4 | 2 | 0.700 ± 0.141 | 0.600 ± 0.000 |" in table
    base = {**row, "run": "gae", "loop_s": 16.0, "learner_s": 7.5}
    ratios = ce.with_ratios([base, row, {**row, "seed": 1}], "gae")  # seed 1 has no baseline: no ratio
    assert (ratios[1]["loop_x"], ratios[1]["learner_x"]) == (0.5, 0.5) and "loop_x" not in ratios[2]
    with pytest.raises(SystemExit, match="no sft, rm, data"):
        ce.main(["--base", str(tmp_path), "--out", str(tmp_path / "out"), "--runs", "gae"])


def test_async_compare_summarises_runs():
    """benchmarks.async_compare's summary on made-up runs: the level is 0.9 x the synchronous
    tensor runs' final reward, the time to it is the end of the first step whose 3-step moving
    mean reaches it (NaN when none does), and tokens/s is samples/s x the mean length."""
    import math

    from benchmarks.async_compare import summarise, table, time_to

    def run(k, sync, seed, rewards, sps):
        return {"max_staleness": k, "lora_sync": sync, "seed": seed, "samples_per_s": sps, "rewards": rewards,
                "step_end_s": [1.0, 2.0, 3.0, 4.0], "response_length_mean": [10.0, 20.0, 30.0, 40.0],
                "step_s": [1.0] * 4}

    runs = [run(0, "tensor", 0, [0.0, 1.0, 2.0, 3.0], 2.0), run(2, "tensor + tis", 0, [0.0, 0.0, 0.0, 0.0], 3.0)]
    level, rows = summarise(runs, None)
    assert level == pytest.approx(0.9 * 2.0)  # the last 3 steps' mean of the synchronous run
    assert time_to(runs[0], level) == 4.0 and math.isnan(time_to(runs[1], level))  # moving means 1, 2 at steps 3, 4
    assert rows[1]["tokens_per_s"] == (3.0 * 25.0, 0.0) and rows[1]["reached"] == 0
    assert "| 2 | tensor + tis | 3.00 ± 0.00 | 1.50x | 75 ± 0 | 25.0 |" in table(level, rows)


def test_compare_estimators_on_the_verifiable_task(tmp_path):
    """The verifiable task's rows (issue 46's comparison): NAME= labels a run (its run
    directory and table row), --with's options come before the run's own, an arith run
    directory becomes pass@1 / pass@k / generation rounds per step, and the tables switch to
    those columns; a base without sft or data is refused naming them."""
    from benchmarks import compare_estimators as ce

    assert ce.split_label("dapo=grpo:clip_epsilon_high=0.28") == ("dapo", "grpo:clip_epsilon_high=0.28")
    assert ce.split_label("grpo:n=4") == ("grpo:n=4", "grpo:n=4")
    assert ce.parse_run("gspo=grpo:policy_loss=gspo") == ["--advantage_estimator", "grpo", "--policy_loss", "gspo"]
    assert ce.run_dir_name("dapo=grpo:dynamic_sampling=true", 2) == "dapo-s2"
    with pytest.raises(SystemExit, match="needs both"):
        ce.split_label("=grpo")
    run = tmp_path / "dapo-s0"
    run.mkdir()
    report = {"pass1_test_rl": 0.9, "pass8_test_rl": 0.97, "sample_accuracy_test_rl": 0.7, "pass1_val_rl": 0.88,
              "eval_k": 8, "final_kl": 0.5, "seconds": 100.0}
    (run / "report-ppo.json").write_text(json.dumps(report))
    steps = [{"time/step_s": 2.0, "time/learner_forward_s": 0.5, "time/update_s": 1.0, "dynamic_sampling_rounds": 1},
             {"time/step_s": 4.0, "time/learner_forward_s": 0.5, "time/update_s": 1.0, "dynamic_sampling_rounds": 2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    row = ce.summarise(run, "dapo=grpo:dynamic_sampling=true", 0)
    assert row["run"] == "dapo" and (row["pass1_test"], row["passk_test"], row["rounds"], row["loop_s"]) == \
        (0.9, 0.97, 1.5, 6.0)
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in s.items() if "dynamic" not in k}) + "\n"
                                               for s in steps))
    assert ce.summarise(run, "grpo", 0)["rounds"] == 1.0  # without dynamic sampling a step is one round
    table = ce.tables([row, {**row, "seed": 1, "pass1_test": 0.8}], ["dapo=grpo:dynamic_sampling=true"])
    assert "| dapo | 2 | 0.850 ± 0.071 | 0.970 ± 0.000 |" in table and "win vs SFT" not in table
    base = tmp_path / "base"
    base.mkdir()
    from ppo_ray.config import PPOConfig

    PPOConfig.from_yaml("arith-tiny").to_yaml(base / "config.yaml")
    assert ce.task_of(base) == "arith" and ce.task_of(tmp_path) == "tldr"
    with pytest.raises(SystemExit, match="has no sft, data"):
        ce.main(["--base", str(base), "--out", str(tmp_path / "out"), "--runs", "grpo"])
    with pytest.raises(SystemExit, match="share a name"):
        (base / "sft").mkdir(), (base / "data").mkdir()
        ce.main(["--base", str(base), "--out", str(tmp_path / "out"), "--runs", "a=grpo", "a=gae"])
