"""The learner's speed options on a Llama-architecture model (the packaged real model,
SmolLM2-135M-Instruct, is a Llama: docs/MODELS.md, "The learner's speed options on Llama").

tests/test_learner_speed.py holds every option to the plain path on the embedded tiny Qwen3;
here the same checks run on a tiny random LlamaForCausalLM built locally (helpers.tiny_llama:
SmolLM2's layout in miniature, grouped-query attention and tied embeddings, the tiny model's
tokenizer; no hub), float32, non-zero LoRA B matrices, left-padded prompts and responses of
different lengths:

* each option reaches the Llama modules it is for (the LoRA projections, LlamaRMSNorm, the
  decoder layers to compile, the tied lm_head in the compiled head path);
* the no-grad pass and an SGD update with each option equal the plain path's within float32
  rounding (the tolerances of test_learner_speed: logprob_tol, update_tols, whose TINY_TERMS
  hold here: the tiny Llama has the tiny Qwen3's widths, depth and vocabulary).

The real model's check (the 30-layer SmolLM2 itself) is the slow
tests/test_gguf_model.py::test_the_learners_speed_options_equal_the_plain_path_on_smollm2.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (FAST, assert_same_update, learner_with, logprob_tol, make_config, passes, plain_pass_and_update,
                     random_batch, update_tols, with_sgd, write_tiny_llama)
from learner.learner import Learner
from learner.speed import head_token_stats
from ppo_ray.config import ALL_PROJECTIONS


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama_path(tiny_model_dir, tmp_path_factory) -> str:
    """A tiny random Llama (helpers.tiny_llama) saved as an HF directory."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_model_dir))


@pytest.fixture(scope="module")
def special(llama_path) -> tuple[int, int]:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(llama_path)
    assert cfg.model_type == "llama" and cfg.pad_token_id != cfg.eos_token_id
    return cfg.eos_token_id, cfg.pad_token_id


@pytest.fixture(scope="module")
def batch(special):
    return random_batch(special, n=8, p=10, t=16, seed=3)


@pytest.fixture(scope="module")
def plain(llama_path, batch):
    """The plain path's no-grad pass and one SGD update on the Llama."""
    return plain_pass_and_update(llama_path, batch)


def test_each_option_reaches_the_llama_modules(llama_path, monkeypatch):
    """LoRA on Llama's 7 projections (the same names as Qwen3's), the fused RMSNorm on every
    LlamaRMSNorm (2 per layer and the final norm), the tied lm_head as a plain Linear (the
    compiled head path takes its weight: the embedding), and learner_compile's layer scope on
    every LlamaDecoderLayer of both models."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    learner = Learner(make_config(lora_kernel="merged", rms_norm_kernel="fused"), llama_path)
    base = learner.policy.get_base_model()
    layers = base.config.num_hidden_layers
    lora = [n for n, m in learner.policy.named_modules() if isinstance(m, LoraLinear)]
    assert len(lora) == layers * len(ALL_PROJECTIONS)
    assert all(m.__dict__.get("_lora_kernel") == "merged" for m in learner.policy.modules() if isinstance(m, LoraLinear))
    norms = [m for m in base.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 2 * layers + 1 and all("forward" in m.__dict__ for m in norms)
    head = learner.speed.lm_head
    assert type(head) is torch.nn.Linear and head.bias is None
    assert head.weight is base.get_input_embeddings().weight  # tied, as SmolLM2's

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(self))
    learner = Learner(make_config(learner_compile=True), llama_path)
    assert [type(m).__name__ for m in compiled] == ["LlamaDecoderLayer"] * (2 * layers)  # policy and value model
    assert learner.speed.head_stats is not head_token_stats


@pytest.mark.equality
@pytest.mark.parametrize("options", [dict(learner_layout="causal"), dict(logprob_chunk_size=5),
                                     dict(lora_kernel="fused"), dict(lora_kernel="merged"),
                                     dict(rms_norm_kernel="fused"), dict(learner_sort_by_length=True), FAST],
                         ids=["causal", "chunked", "fused_lora", "merged_lora", "fused_norm", "sorted", "all"])
def test_no_grad_pass_equals_plain_on_llama(llama_path, plain, options):
    """Old logprobs, full logprobs, entropy and values of every real token equal the plain
    path's to the rounding of logprobs of this size (test_learner_speed's tolerance)."""
    b, _, _, before, _, _ = plain
    got = passes(learner_with(llama_path, **options), b)
    torch.testing.assert_close(got, before, atol=logprob_tol(before["full"], b.response_mask), rtol=0)


@pytest.mark.equality
@pytest.mark.parametrize("options", [dict(lora_kernel="merged"), dict(gradient_checkpointing=True),
                                     dict(FAST, lora_kernel="merged", gradient_checkpointing=True)],
                         ids=["merged_lora", "checkpointed", "all_merged_checkpointed"])
def test_update_equals_plain_on_llama(llama_path, plain, options):
    """Two PPO epochs x two minibatches x micro-batches of 2 (SGD): every stat and the new
    adapter equal the plain path's (float32, float summation order only: update_tols)."""
    b, ref, scores, _, stats, weights = plain
    assert stats.clipfrac == 0 and stats.vf_clipfrac == 0  # with_sgd's premise: no ratio at a clip end
    fast_stats, fast_weights = with_sgd(learner_with(llama_path, **options)).update(b, ref, scores)
    assert_same_update((fast_stats, fast_weights.tensors), (stats, weights), update_tols(make_config(), b, weights))



@pytest.mark.slow
@pytest.mark.equality
def test_compiled_update_equals_plain_on_llama(llama_path, plain):
    """A real torch.compile of the learner on the Llama (each LlamaDecoderLayer and the head
    path; tens of seconds on the CPU): the SGD update with every speed option equals the plain
    path's (float32, update_tols)."""
    b, ref, scores, _, stats, weights = plain
    learner = with_sgd(learner_with(llama_path, **FAST, learner_compile=True))
    fast_stats, fast_weights = learner.update(b, ref, scores)
    assert_same_update((fast_stats, fast_weights.tensors), (stats, weights), update_tols(make_config(), b, weights),
                       keys=("policy_loss", "value_loss"))
