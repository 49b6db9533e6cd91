"""learner/flops.py: the model FLOPs the learner reports per step (learner_flops), counted by
hand on models small enough to do so, the GPU peak table and the CPU's measured peak, and
the benchmarks' use of the same functions (one copy of the rules). No Ray, no model."""

from __future__ import annotations

import math

import pytest

from learner.flops import (DECODER_TYPES, PEAK_FLOPS, decoder_shape, device_peak_flops, forward_flops,
                           learner_flops, peak_flops, update_flops)

# One layer, one head: matmul parameters N = 4x4 (q) + 2 x 4x4 (k, v) + 4x4 (o) + 3 x 4x8 (MLP) = 160.
POLICY = dict(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
              head_dim=4, vocab_size=10)
# A value backbone of another width: N = 4 x 4x4 + 3 x 4x4 = 112.
VALUE = dict(POLICY, intermediate_size=4)
LORA = dict(lora_r=1, lora_targets=["q_proj"])

# One row of 2 prompt + 1 response tokens (n = 3), by hand:
BASE = 2 * 160 * 3            # 2 N n                      = 960
VBASE = 2 * 112 * 3           # the value backbone's       = 672
ATTN = 2 * 4 * 3 * (3 + 1)    # 2 (heads x head_dim) n (n + 1) per layer = 96
HEAD = 2 * 4 * 10 * 1         # 2 H V per response token   = 80
LORA_Q = 2 * 1 * (4 + 4) * 3  # 2 r (in + out) n on q_proj = 48


def test_forward_flops_by_hand():
    assert forward_flops(POLICY, [2], [1]) == 960.0 + 96.0 + 80.0 == BASE + ATTN + HEAD
    assert forward_flops(POLICY, [2], [1], logits=False, **LORA) == BASE + ATTN + LORA_Q
    # two rows: attention is per row, n (n + 1) each, not over the batch's total
    assert forward_flops(POLICY, [2, 3], [1, 2]) == 2 * 160 * 8 + 2 * 4 * (3 * 4 + 5 * 6) + 2 * 4 * 10 * 3 == 3136.0


def test_update_flops_by_hand_for_each_value_model_and_pass():
    """update = ppo_epochs x (forward + backward); backward = 1x base and lm_head, 2x LoRA and
    attention (frozen base: input gradients only). ppo_epochs 2."""
    policy_fwd = BASE + LORA_Q + ATTN + HEAD            # 1184
    value_fwd = VBASE + LORA_Q + ATTN                   # 816: no lm_head
    policy_bwd = BASE + 2 * LORA_Q + 2 * ATTN + HEAD    # 1328
    value_bwd = VBASE + 2 * LORA_Q + 2 * ATTN           # 960
    assert (policy_fwd, value_fwd, policy_bwd, value_bwd) == (1184, 816, 1328, 960)

    def count(value_model, values_in_update=False, recomputed=True, value_shape=VALUE):
        return update_flops(POLICY, [2], [1], ppo_epochs=2, value_model=value_model, values_in_update=values_in_update,
                            recomputed=recomputed, value_shape=value_shape, **LORA)

    assert 2 * (1184 + 816 + 1328 + 960) == 8576  # the separate value model's update
    assert count("separate") == {"learner_forward": 1184.0 + 816.0, "update": 8576.0}
    # old values from the update's first forward: the pass ran the policy alone, or nothing
    assert count("separate", values_in_update=True) == {"learner_forward": 1184.0, "update": 8576.0}
    assert count("separate", values_in_update=True, recomputed=False) == {"learner_forward": 0.0, "update": 8576.0}
    # the generator's old logprobs: the pass ran the value model's trunk alone
    assert count("separate", recomputed=False) == {"learner_forward": 816.0, "update": 8576.0}
    shared = {"learner_forward": 1184.0, "update": 2 * (1184.0 + 1328.0)}  # one trunk, the head is not counted
    assert count("shared", value_shape=None) == shared
    assert count("shared", value_shape=None, recomputed=False)["learner_forward"] == BASE + LORA_Q + ATTN == 1104.0
    assert count("none", value_shape=None) == shared
    assert count("none", value_shape=None, recomputed=False)["learner_forward"] == 0.0
    # the value model defaults to the policy's shape (the benchmarks' assumption)
    same = update_flops(POLICY, [2], [1], ppo_epochs=1, value_model="separate", values_in_update=False,
                        recomputed=True, **LORA)
    assert same == {"learner_forward": 2.0 * (BASE + LORA_Q + ATTN) + HEAD,
                    "update": 2.0 * (BASE + LORA_Q + ATTN) + HEAD + 2.0 * (BASE + 2 * LORA_Q + 2 * ATTN) + HEAD}
    with pytest.raises(ValueError, match="value_model"):
        count("twin")


def test_decoder_shape_counts_only_the_decoders_its_rules_describe():
    from transformers import GPT2Config, Qwen3Config

    qwen = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=100)
    assert decoder_shape(qwen) == dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100)
    assert decoder_shape({**qwen.to_dict(), "head_dim": None})["head_dim"] == 16  # hidden / heads
    assert "qwen3" in DECODER_TYPES and decoder_shape(GPT2Config()) is None  # fused c_attn, ungated MLP
    assert decoder_shape({"model_type": "llama"}) is None  # no shape: no count, not a wrong one


def test_gpu_peaks_by_name_and_dtype():
    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32") == 67e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H100 NVL") == 835e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert peak_flops("NVIDIA GeForce RTX 4090") is None
    assert all(set(rates) == {"bfloat16", "float16", "float32"} for rates in PEAK_FLOPS.values())


def test_the_cpu_peak_is_a_measured_matmul_rate_and_other_devices_have_none():
    import torch

    threads = torch.get_num_threads()
    rate = device_peak_flops("cpu", "float32", threads=1)
    assert math.isfinite(rate) and rate > 0
    assert torch.get_num_threads() == threads  # restored
    assert math.isnan(device_peak_flops("meta", "float32"))


def test_the_benchmarks_count_with_the_products_functions():
    """One copy of the rules: benchmarks/flops.py and benchmarks/gpu_step.py import them."""
    import benchmarks.flops
    import benchmarks.gpu_step
    import learner.flops

    for name in ("forward_flops", "learner_flops", "update_flops", "model_shape", "gemm_rate"):
        assert getattr(benchmarks.flops, name) is getattr(learner.flops, name), name
    for name in ("learner_flops", "peak_flops", "gemm_rate"):
        assert getattr(benchmarks.gpu_step, name) is getattr(learner.flops, name), name
    assert learner_flops is benchmarks.flops.learner_flops
