"""Loading HF models and the one forward every role uses to score response tokens.

Bottom layer: imports torch/transformers/PEFT and ppo_ray.batch / ppo_ray.paths / ppo_ray.rewards only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch, rollout_micro_batches
from ppo_ray.paths import resolve_model_path
from ppo_ray.rewards import check_reward_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ContextLengthError(ValueError):
    """A model whose context window cannot hold max_prompt_length + max_new_tokens tokens."""


def _config_json(name: str) -> Path | None:
    """config.json of a local model directory, or of a hub id: fetched from the hub (a few KB,
    into the HF cache, which the later model load reuses), so that a fresh node checks the
    model before any stage runs. None when it cannot be had (no network and not cached, a
    private repo without a token, not a hub id): then the check is left to the model load."""
    if Path(name).is_dir():
        return Path(name) / "config.json"
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(name, "config.json"))
    except Exception as e:  # noqa: BLE001 - offline, gated, missing, or not a hub id at all
        log.warning("could not read %s's config.json from the hub (%s): its context length is not checked before "
                    "the run; the model load will", name, type(e).__name__)
        return None


def max_positions(name: str) -> int | None:
    """The model's context window from its config.json (max_position_embeddings, or the
    text config's for a multimodal model); None when it does not say or cannot be read."""
    import json

    path = _config_json(name)
    if path is None:
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    value = cfg.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def check_context_length(max_prompt_length: int, max_new_tokens: int, models: dict[str, str]) -> None:
    """ContextLengthError naming the fields and the model's limit when a model's context window
    (max_position_embeddings) is shorter than max_prompt_length + max_new_tokens: the vLLM
    engine would refuse max_model_len in the generator's constructor, and the learner and the
    scorers would see positions the model never learned. `models` maps a config field name
    (model_name, ...) to its resolved path or hub id; a hub id's config.json is fetched
    (_config_json), and skipped with a warning when it cannot be."""
    need = max_prompt_length + max_new_tokens
    for field, path in models.items():
        limit = max_positions(path) if path else None
        if limit is not None and limit < need:
            raise ContextLengthError(
                f"{field} {path!r} has max_position_embeddings={limit} (its config.json), below "
                f"max_prompt_length ({max_prompt_length}) + max_new_tokens ({max_new_tokens}) = {need}: lower "
                f"max_prompt_length (with prompt_truncation: left for longer prompts) or max_new_tokens so that "
                f"they add up to at most {limit}, or use a model with a longer context")


# A pad distinct from EOS, taken from the tokenizer's EXISTING tokens when it declares none
# (or declares EOS as pad, as the Qwen base tokenizers do: Qwen2.5-*, Qwen3-*-Base ship
# pad_token == eos_token == "<|endoftext|>"). An existing token needs no embedding resize, so
# the checkpoint, the learner and vLLM keep one vocabulary. Pad positions are masked out of
# attention and every loss, so which token it is matters only in that the model must never
# write it in a summary: hence tokens reserved for padding, in this order of preference.
PAD_CANDIDATES = (
    "<|pad|>", "<pad>", "[PAD]",      # a padding token the tokenizer_config does not name as pad
    "<|fim_pad|>",                    # Qwen2.5 / Qwen3: fill-in-the-middle padding
    "<|vision_pad|>",                 # Qwen2.5 / Qwen3: vision padding, never emitted by a text model
    "<|finetune_right_pad_id|>",      # Llama 3.1+: reserved for padding
)


def choose_pad_token(tok) -> str | None:
    """The existing token to use as pad for a tokenizer without a pad distinct from EOS:
    the first of PAD_CANDIDATES that is an added token (one id, never split from text) and
    has no other role; else the unused added SPECIAL token with the highest id (reserved
    tokens sit at the end of the vocabulary; non-special added tokens such as "<think>" are
    text a model writes); None when there is none."""
    added = tok.get_added_vocab()  # token text -> id
    taken = {tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.sep_token_id, tok.cls_token_id,
             tok.mask_token_id} - {None}  # tokens with a job are never pad
    for text in PAD_CANDIDATES:
        if text in added and added[text] not in taken:
            return text
    unused = [(i, t.content) for i, t in tok.added_tokens_decoder.items() if t.special and i not in taken]
    return max(unused)[1] if unused else None


def load_tokenizer(name: str):
    """AutoTokenizer with a pad token distinct from EOS (see PAD_CANDIDATES): a tokenizer
    whose pad is missing or equals EOS gets an existing token as pad, the same one on every
    load, and keeps it when saved (save_pretrained writes it to tokenizer_config.json)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(name))
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        pad = choose_pad_token(tok)
        if pad is None:
            raise ValueError(
                f"tokenizer of {name!r} has pad_token={tok.pad_token!r} and eos_token={tok.eos_token!r}, and no "
                f"existing token can serve as a pad distinct from EOS (none of {list(PAD_CANDIDATES)} nor an "
                "unused added special token): set a pad token that is not EOS in the tokenizer "
                "(tokenizer.pad_token = '<an existing special token>', then save_pretrained), or add one with "
                "tokenizer.add_special_tokens and resize the model's embeddings")
        before = "missing" if tok.pad_token_id is None else f"EOS ({tok.pad_token!r})"
        tok.pad_token = pad
        log.warning("tokenizer of %r: pad token was %s; using its existing token %r (id %d) as pad",
                    name, before, pad, tok.pad_token_id)
    return tok


def pick_device(device: str | None = None) -> torch.device:
    """`device`, or when None / "auto" the GPU this process sees (Ray sets
    CUDA_VISIBLE_DEVICES for actors given GPUs), else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_causal_lm(name: str, dtype: str = "float32", use_safetensors: bool | None = None):
    """AutoModelForCausalLM in eval mode (callers switch to train mode where they train).
    use_safetensors=True refuses a model whose weights are not safetensors (no pickle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=DTYPES[dtype],
                                                 use_safetensors=use_safetensors)
    model.eval()
    return model


def response_logits(model, batch: RolloutBatch) -> Tensor:
    """Logits that predict each response token: (B, T, V), in the model's dtype.

    One forward over cat(prompt, response); column P-1+t predicts response token t.
    Callers pass a trimmed micro-batch (RolloutBatch.trimmed) so padding costs nothing.
    """
    input_ids, attention_mask, position_ids = batch.sequences()  # (B, P+T) each
    t = batch.response_ids.shape[1]
    # logits_to_keep: only the last T+1 positions (columns P-1 .. P+T-1) go through lm_head,
    # not all P+T (for 512-token prompts and a 151k vocab that is most of the memory).
    out = model(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids,
                use_cache=False, logits_to_keep=t + 1)
    return out.logits[:, :t]  # (B, T, V)


def response_hidden(backbone, batch: RolloutBatch) -> Tensor:
    """Last hidden states at the positions whose logits predict response tokens: (B, T, H).

    hidden[:, t] is the state s_t = prompt + response[:t], the state the value V(s_t) and the
    action a_t = response[t] belong to.
    """
    input_ids, attention_mask, position_ids = batch.sequences()
    out = backbone(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids,
                   use_cache=False)
    p, t = batch.prompt_len, batch.response_ids.shape[1]
    return out.last_hidden_state[:, p - 1: p - 1 + t]  # (B, T, H)


def no_mask(config) -> dict | None:
    """The attention-mask argument of a forward with no padding in any row (plain causal
    attention): Transformers' prepared mask mapping with no mask for any layer type, where
    every layer is full attention; else None (the model builds its own, e.g. sliding-window
    masks). Under torch.compile, Transformers (with torch < 2.14) builds a full (B, 1, L, L)
    mask instead of SDPA's is_causal when it is left to itself, which takes the causal flash
    kernels away; the mapping skips that, and is what the eager forward builds anyway."""
    types = getattr(config, "layer_types", None)
    if types and all(t == "full_attention" for t in types):
        return {"full_attention": None}
    return None


def causal_response_hidden(model, batch: RolloutBatch, length: int) -> Tensor:
    """``response_hidden`` by a forward with no attention mask: (B, T, H).

    ``model`` returns ``last_hidden_state`` (a decoder: the policy's ``get_decoder()``, the
    value backbone). The rows are laid out by ``RolloutBatch.causal_sequences(length)``
    (real tokens from column 0, padding after them), so the forward is plain causal
    attention at positions 0.. (SDPA's flash kernel; no mask to build or read), and the
    real tokens' states equal the masked forward's. ``length``: host-side max real length.
    Positions of padding response tokens hold a state of some column (garbage by design;
    every consumer masks them).
    """
    input_ids, predict = batch.causal_sequences(length)  # (B, L), (B, T)
    out = model(input_ids=input_ids, attention_mask=no_mask(model.config),  # positions 0..L-1, causal
                use_cache=False)
    hidden = out.last_hidden_state                        # (B, L, H)
    return hidden.gather(1, predict.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, T, H)


def last_token_hidden(backbone, batch: RolloutBatch) -> Tensor:
    """Last hidden state at each row's last real token (the response's EOS when it has one;
    the prompt's last token for an empty response): (B, H). Never a pad position."""
    input_ids, attention_mask, position_ids = batch.sequences()
    out = backbone(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids,
                   use_cache=False)
    last = batch.prompt_len - 1 + batch.response_lengths  # (B,) column of the last real token
    rows = torch.arange(len(batch), device=last.device)
    return out.last_hidden_state[rows, last]  # (B, H)


def rm_scores(model, batch: RolloutBatch) -> Tensor:
    """(B,) float32 scores of a reward model (AutoModelForSequenceClassification,
    num_labels=1) at each row's last real token, on the model's device (autograd as the
    caller has it: the RM stage trains through it)."""
    backbone = getattr(model, model.base_model_prefix)
    return model.score(last_token_hidden(backbone, batch)).float().squeeze(-1)


@torch.no_grad()
def reward_scores(model, batch: RolloutBatch, micro_batch_size: int, device: torch.device | str) -> Tensor:
    """(B,) float32 CPU reward-model scores of a batch (on any device), over trimmed
    micro-batches of `micro_batch_size` rows moved to `device`: the reward actor's and the
    evaluations' RM scoring."""
    out = [rm_scores(model, micro.to(device)).cpu() for _, micro in rollout_micro_batches(batch, micro_batch_size)]
    return torch.cat(out) if out else torch.zeros(0)


def load_reward_model(name: str, dtype: str = "float32"):
    """A sequence-classification reward model (num_labels=1) in eval mode, with its
    config.json (ppo_ray.rewards.check_reward_model: RewardError), backbone and `score`
    head checked, or a clear error naming the path."""
    from transformers import AutoModelForSequenceClassification

    check_reward_model(name)
    path = resolve_model_path(name)
    model, info = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=DTYPES[dtype],
                                                                     output_loading_info=True)
    if not hasattr(model, "score") or not hasattr(model, model.base_model_prefix):
        raise ValueError(f"reward model {name!r} ({type(model).__name__}) has no `score` head over a backbone")
    missing = sorted(k for k in info["missing_keys"] if k.split(".")[0] == "score")
    if missing:  # transformers would initialise them at random: the scores would be noise
        raise ValueError(f"reward model {name!r} has no trained score head (missing from the checkpoint: "
                         f"{missing}); it is not a reward model")
    model.eval()
    return model


@dataclass(frozen=True)
class LoraSpec:
    """What a LoRA adapter's tensors mean: the part of the PEFT LoraConfig that travels with
    the weights (LoraWeights), so the side that loads them (generator, checkpoint, saved
    adapter) reads r and alpha from the adapter itself, never from a config of its own."""

    r: int
    lora_alpha: int
    target_modules: tuple[str, ...]  # module names, sorted (PEFT keeps them as a set)
    lora_dropout: float = 0.0

    @property
    def scaling(self) -> float:
        """The factor on B @ A in W = W0 + scaling * B @ A (plain LoRA, no rsLoRA)."""
        return self.lora_alpha / self.r

    @classmethod
    def of(cls, config) -> "LoraSpec":
        """The spec of a peft LoraConfig (e.g. ``peft_model.peft_config["default"]``)."""
        return cls(int(config.r), int(config.lora_alpha), tuple(sorted(config.target_modules)),
                   float(config.lora_dropout))

    def peft_config(self, base_model: str | None = None):
        """The peft LoraConfig of a causal-LM adapter with this spec (bias none, default init;
        inference_mode as PeftModel.save_pretrained writes it)."""
        from peft import LoraConfig, TaskType

        return LoraConfig(r=self.r, lora_alpha=self.lora_alpha, target_modules=list(self.target_modules),
                          lora_dropout=self.lora_dropout, bias="none", task_type=TaskType.CAUSAL_LM,
                          base_model_name_or_path=base_model, inference_mode=True)


@dataclass
class LoraWeights:
    """A LoRA adapter as it travels between actors: the tensors and the spec that says what
    they mean. ``tensors``: get_peft_model_state_dict() keys (adapter_model.safetensors
    names, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: A (r, in),
    B (out, r)), CPU tensors."""

    tensors: dict[str, Tensor]
    spec: LoraSpec

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors.values())


def write_lora_adapter(path: str | Path, weights: LoraWeights, *, base_model: str) -> Path:
    """Write a PEFT LoRA adapter directory (adapter_model.safetensors + adapter_config.json)
    that PeftModel.from_pretrained and vLLM's LoRARequest both load: the config is PEFT's
    own (LoraConfig.save_pretrained) from ``weights.spec``; returns the directory."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.tensors.items()},
              str(path / "adapter_model.safetensors"))
    weights.spec.peft_config(base_model).save_pretrained(str(path))
    return path


def read_lora_adapter(path: str | Path) -> LoraWeights:
    """The adapter directory that write_lora_adapter (or PEFT's save_pretrained) wrote:
    tensors from its safetensors file, spec from its adapter_config.json."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    path = Path(path)
    return LoraWeights(load_file(str(path / "adapter_model.safetensors")),
                       LoraSpec.of(LoraConfig.from_pretrained(str(path))))
