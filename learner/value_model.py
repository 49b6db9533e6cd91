"""The value model V(s_t): a transformer backbone with its own LoRA adapter and a scalar head.

Design: a separate model, not a head on the policy's trunk.
    The policy and the value function each get their own backbone (the frozen base weights
    loaded twice) and their own LoRA adapter. Each has its own optimiser and learning rate
    (the seeds' 1e-5 vs 1e-4), and neither loss's gradient leaks into the other's weights
    (a shared trunk mixes them, and vf_coef then becomes a tuning knob between the two).
    It also lets the value start from the reward model (N+ recipe) while the policy starts
    from the SFT model. The cost is one more base forward/backward per micro-batch and a
    second copy of the base weights in memory.

Initialisation (N+ recipe, Huang et al. 2024):
    * The value base directory is a sequence-classification reward model
      (config.architectures has a ``*ForSequenceClassification``): its backbone becomes the
      value backbone and its ``score`` weights are copied into the head ("value from RM").
    * Otherwise (a causal LM, e.g. the policy's base): the head is zero (V = 0 at the
      start; see the comment in __init__ for why not a random head).
    * The LoRA adapter's A matrices are drawn from torch's global RNG (PEFT's kaiming
      init; B = 0): the caller seeds it (Learner does ``torch.manual_seed(config.seed)``).

Only the LoRA weights and the head are trainable; the backbone's base weights are frozen.
The head runs in float32 whatever the backbone dtype (values are regression targets).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ppo_ray.batch import RolloutBatch
from ppo_ray.modeling import DTYPES, causal_response_hidden, load_reward_model, response_hidden
from ppo_ray.paths import resolve_model_path


def is_sequence_classifier(path: str) -> bool:
    """True if the HF directory's config names a ``*ForSequenceClassification`` architecture."""
    from transformers import AutoConfig

    archs = getattr(AutoConfig.from_pretrained(path), "architectures", None) or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


class ValueModel(nn.Module):
    """``forward(batch) -> (B, T)`` float32 values V(s_t), s_t = prompt + response[:t]."""

    def __init__(self, name: str, *, lora_r: int, lora_alpha: int, lora_dropout: float,
                 target_modules: Sequence[str], dtype: str = "float32", seed: int = 0):
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModel

        path = resolve_model_path(name)
        self.from_reward_model = is_sequence_classifier(path)
        score: Optional[nn.Linear] = None
        if self.from_reward_model:
            rm = load_reward_model(path, dtype)  # checks num_labels == 1 and the `score` head
            backbone = getattr(rm, rm.base_model_prefix)
            score = rm.score
        else:
            backbone = AutoModel.from_pretrained(path, dtype=DTYPES[dtype])
        hidden = backbone.config.hidden_size

        # No task_type: a plain PeftModel whose forward is the backbone's (last_hidden_state).
        lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                          target_modules=list(target_modules), bias="none")
        self.backbone = get_peft_model(backbone, lora)  # freezes the base weights
        self.head = nn.Linear(hidden, 1, dtype=torch.float32)  # (H,) -> scalar
        with torch.no_grad():
            if score is not None:
                self.head.weight.copy_(score.weight.float())  # (1, H)
                if score.bias is not None:
                    self.head.bias.copy_(score.bias.float())
                else:
                    self.head.bias.zero_()
            else:
                # Zero head: V = 0 everywhere at the start, so the first advantages are the
                # shaped returns themselves. A random head (N+'s 1/sqrt(H+1) std is for a head
                # that is then trained as a reward model) gives |V| ~ 1 on the final-norm
                # hidden states, and GAE's V_{t+1} - V_t noise then swamps rewards of ~0.1
                # for tens of steps (measured on the tiny model: no learning in 30 steps).
                self.head.weight.zero_()
                self.head.bias.zero_()
        self.eval()

    def forward(self, batch: RolloutBatch, causal_len: Optional[int] = None) -> Tensor:
        """causal_len: None = the masked forward over the left-padded layout; an int = the
        causal layout of that width (ppo_ray.modeling.causal_response_hidden)."""
        if causal_len is None:
            hidden = response_hidden(self.backbone, batch)  # (B, T, H), backbone dtype
        else:
            hidden = causal_response_hidden(self.backbone, batch, causal_len)  # (B, T, H)
        return self.head(hidden.float()).squeeze(-1)  # (B, T) float32

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


class ValueHead(nn.Module):
    """value_model: shared: V(s_t) = head(the policy's last hidden state at t); no backbone
    of its own (the learner feeds it the policy's hidden states). Zero-initialised, as
    ValueModel's head from a causal LM (V = 0 at the start; see there)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)  # (H,) -> scalar
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.zero_()

    def forward(self, hidden: Tensor) -> Tensor:
        """(..., H) hidden states in any dtype -> (...) float32 values."""
        return self.head(hidden.float()).squeeze(-1)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
