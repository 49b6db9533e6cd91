"""The embedded default model: a tiny, deterministic Qwen3-architecture causal LM.

Tests and the CPU default configuration need a model that exists without network
access. This module builds one from scratch: a byte-level BPE tokenizer trained on
the bundled text ``ppo_ray/assets/tiny_corpus.txt`` and a ``Qwen3ForCausalLM``
initialised from a seed (std 0.02) and then, for the "tiny" preset, briefly
pretrained on that same corpus (see "Pretraining" below). It is written as an ordinary Hugging Face
model directory with ``save_pretrained`` (``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``), so every code
path that loads ``Qwen/Qwen3-0.6B-Base`` (``AutoTokenizer``, ``AutoModelForCausalLM``,
``AutoModelForSequenceClassification``, PEFT, vLLM) loads it the same way.

Public API::

    build_tiny_model(out_dir=None, size="tiny") -> pathlib.Path
    PRESETS                          # {"tiny": {...}, "small": {...}}
    EOS_TOKEN, PAD_TOKEN             # "<|endoftext|>", "<|pad|>"
    default_cache_dir() -> pathlib.Path
    content_hash(size="tiny") -> str
    corpus_text() -> str
    corpus_documents() -> list[str]
    tldr_examples() -> list[dict]    # {"subreddit", "title", "post", "summary"}

Command line: ``python -m ppo_ray.tiny_model [--size small] [--out DIR]`` prints the
directory.

Design choices (kept close to Qwen3-0.6B-Base where it matters):

* Architecture: ``head_dim`` is 64 because vLLM's CPU attention rejects smaller heads.
  ``tie_word_embeddings=True`` and ``rope_theta=1e6`` as in Qwen3-0.6B; vLLM's Qwen3
  implementation ties ``lm_head`` to ``embed_tokens`` and skips the (absent)
  ``lm_head.weight``. float32 weights.
* Tokenizer: GPT-2 style byte-level BPE (ByteLevel pre-tokenizer, decoder and
  post-processor, no normalizer), so any Unicode text round-trips exactly. The 256
  byte symbols come first (ids 0..255), then the merges, then the two special tokens
  at the END of the vocabulary like Qwen's added tokens: ``<|endoftext|>`` (EOS) at
  ``vocab_size - 2`` and ``<|pad|>`` at ``vocab_size - 1``. Pad is never EOS (a project
  invariant) and no special token has id 0, so code that pads with 0 or confuses pad
  and EOS gets caught by tests. ``len(tokenizer) == config.vocab_size``.
* BOS: like Qwen3, the tokenizer has no BOS token and adds none; ``config.json`` and
  ``generation_config.json`` carry ``bos_token_id == eos_token_id`` exactly as
  Qwen3-0.6B-Base does (only used by HF ``generate`` when it is given no input).
* ``tokenizer_class`` is the generic tokenizers-backed class (``TokenizersBackend``,
  a.k.a. ``PreTrainedTokenizerFast``), which loads ``tokenizer.json`` verbatim. (The
  ``Qwen2Tokenizer`` class would rebuild the pipeline with Qwen's regex and an NFC
  normalizer, which would break exact round trips.)
* Pretraining ("tiny" only; ``pretrain_*`` preset keys, ``_pretrain``). Why: with
  random tied embeddings of std 0.02 and a final RMSNorm (scale 1), every logit is
  bounded by ``|h| * |e| ~ sqrt(128) * 0.02 * sqrt(128) ~ 2.6``, so the random model is
  near-uniform over its 512 tokens (it samples the pad token, greedy decoding is
  degenerate) and no LoRA update can make any token likely: PPO on it shows no
  learning. So after the seeded init the model is trained with the causal-LM
  next-token loss on the corpus documents, each followed by EOS (``<|endoftext|>``
  right after the document's last token, as a PPO response ends), one document per
  row starting at position 0 (like a prompt; documents are 152-442 tokens, so every
  position a TL;DR prompt plus response uses is trained), right-padded with the pad
  token and masked out of the loss. Settings: 140 steps of 8 documents (~19 epochs of
  the 16.9K-token corpus), AdamW (betas 0.9/0.95, weight decay 0.1 on matrices and
  the embedding), peak lr 3e-3 with 8 warmup steps and a cosine decay to 10%, the
  tied embedding at 5x the lr (it must grow from std 0.02 before logits can leave
  the +-2.6 range; this halves the steps needed), gradient clipping 1.0. Data order
  comes from a local ``torch.Generator``; batches group documents of similar length.
  Result (recorded in ``ppo_ray_tiny_model.json``): corpus loss 6.27 -> 1.99 nats
  (ln 512 = 6.24), mean next-token entropy 6.21 -> 2.80 nats, the largest P(pad)
  anywhere in the corpus ~1e-3 (it never occurs in the data). The model writes
  English-looking text in the corpus' SUBREDDIT/TITLE/POST/TL;DR format and ends
  documents with EOS; it is a 361K-parameter model that has seen 17K tokens, so it
  does not make much sense. Cost: ~25 s on one CPU thread (the whole build), paid
  once per cache. The "small" preset (benchmarks only: speed does not depend on the
  weights) stays random, ``pretrain_steps: 0``.
* Determinism: the tokenizer trainer is deterministic for a fixed corpus (checked
  across processes with different hash seeds); weights come from a local
  ``torch.Generator`` (global RNG state is saved and restored); pretraining uses a
  local generator for the data order, no dropout, and runs on ONE thread
  (``torch.set_num_threads(1)``, restored afterwards) because CPU float reductions
  can depend on the thread count; all files are written by ``save_pretrained`` with
  no timestamps. Rebuilding gives bit-identical files on the same machine and
  library versions. (Caveat: float results of training can differ between CPUs with
  different vector instruction sets, e.g. AVX2 vs AVX-512, so two unlike machines
  may build slightly different weights under the same cache name; a multi-node
  cluster should build once and share the directory.)
* Caching: ``$PPO_RAY_CACHE`` (default ``~/.cache/ppo_ray``) / ``qwen3-{size}-{hash16}``
  where the hash covers the builder version, the preset (including the pretraining
  settings), the corpus bytes and the versions of torch/transformers/tokenizers/
  safetensors. Builds go to a temporary directory beside the target and are renamed
  into place (ppo_ray.atomic), so a crash never leaves a half-written model and concurrent builders
  (pytest, several Ray workers) are safe. Builders of the same target on one machine
  also take an advisory lock (``.{name}.lock`` beside it, ``fcntl.flock``) so that
  only one of them pays for the pretraining; the others wait and reuse its build.

Importing this module has no side effects (heavy libraries are imported lazily).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import pathlib
import re
from typing import Any

from ppo_ray.atomic import atomic_dir, exclusive_lock, remove_stale_temps, temp_prefix

__all__ = [
    "BUILDER_VERSION",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "PRESETS",
    "build_tiny_model",
    "content_hash",
    "corpus_documents",
    "corpus_text",
    "default_cache_dir",
    "tldr_examples",
]

log = logging.getLogger(__name__)

# Bump whenever the builder's output changes for the same preset and corpus.
# 2: the "tiny" preset is pretrained on the bundled corpus (see _pretrain).
BUILDER_VERSION = 2

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Document separator in the bundled corpus (a line of its own).
DOC_SEPARATOR = "\n" + EOS_TOKEN + "\n"

CORPUS_RESOURCE = "assets/tiny_corpus.txt"
BUILD_INFO_FILE = "ppo_ray_tiny_model.json"
CACHE_ENV = "PPO_RAY_CACHE"
_EXPECTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", BUILD_INFO_FILE)

_ARCH_COMMON: dict[str, Any] = {
    "head_dim": 64,  # vLLM CPU attention needs 64 (16 is rejected)
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,  # as Qwen3-0.6B
    "tie_word_embeddings": True,  # as Qwen3-0.6B
    "initializer_range": 0.02,
    "seed": 0,
    "bpe_min_frequency": 1,
}

# Pretraining (see ``_pretrain``). Part of every preset, hence of the content hash.
_PRETRAIN_COMMON: dict[str, Any] = {
    "pretrain_steps": 0,  # 0 = keep the random init
    "pretrain_batch_docs": 8,  # documents per step, one per row, right-padded
    "pretrain_max_len": 512,  # tokens per document incl. its EOS (longer ones would be cut)
    "pretrain_lr": 3e-3,  # AdamW peak lr of the transformer blocks
    "pretrain_embedding_lr_mult": 5.0,  # the (tied) embedding learns 5x faster (module docstring)
    "pretrain_warmup_steps": 8,  # linear warmup, then cosine decay ...
    "pretrain_final_lr_frac": 0.1,  # ... to 10% of the peak at the last step
    "pretrain_betas": [0.9, 0.95],
    "pretrain_weight_decay": 0.1,  # on matrices and the embedding, not on norm scales
    "pretrain_grad_clip": 1.0,
    "pretrain_seed": 1,  # data order (a local torch.Generator)
}

PRESETS: dict[str, dict[str, Any]] = {
    # 361,344 parameters: fast enough for unit tests (HF and vLLM); pretrained on the corpus.
    "tiny": {
        **_ARCH_COMMON,
        **_PRETRAIN_COMMON,
        "pretrain_steps": 140,  # ~19 epochs of the corpus; ~20-30 s on one CPU thread
        "vocab_size": 512,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 256,
    },
    # 25,175,552 parameters: for CPU benchmarks. Kept RANDOM (pretrain_steps 0): speed
    # does not depend on the weights, and pretraining 25M parameters on one CPU thread
    # would take many minutes (and the 40K-byte corpus could not feed it anyway).
    "small": {
        **_ARCH_COMMON,
        **_PRETRAIN_COMMON,
        "vocab_size": 2048,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1536,
    },
}


# --------------------------------------------------------------------------- corpus


def _corpus_bytes() -> bytes:
    try:
        from importlib import resources

        return resources.files("ppo_ray").joinpath(CORPUS_RESOURCE).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError, TypeError):  # pragma: no cover - fallback
        return (pathlib.Path(__file__).resolve().parent / CORPUS_RESOURCE).read_bytes()


def corpus_text() -> str:
    """The bundled corpus (UTF-8 text, documents separated by ``<|endoftext|>`` lines)."""
    return _corpus_bytes().decode("utf-8")


def corpus_documents() -> list[str]:
    """The bundled corpus split into documents (separator lines removed)."""
    docs = [d.strip("\n") for d in corpus_text().split(DOC_SEPARATOR)]
    return [d for d in docs if d.strip()]


_TLDR_RE = re.compile(
    r"\ASUBREDDIT: r/(?P<subreddit>[^\n]+)\n\nTITLE: (?P<title>[^\n]+)\n\n"
    r"POST: (?P<post>.+?)\n\nTL;DR: (?P<summary>.+)\Z",
    re.DOTALL,
)


def tldr_examples() -> list[dict[str, str]]:
    """The Reddit-TL;DR-style documents of the corpus, parsed.

    Each is ``{"subreddit", "title", "post", "summary"}``; the document text is
    ``f"SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR: {summary}"``.
    """
    out = []
    for doc in corpus_documents():
        m = _TLDR_RE.match(doc)
        if m:
            out.append({k: m.group(k).strip() for k in ("subreddit", "title", "post", "summary")})
    return out


# --------------------------------------------------------------------------- hashing / cache


def _preset(size: str) -> dict[str, Any]:
    try:
        return copy.deepcopy(PRESETS[size])
    except KeyError:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(PRESETS)}") from None


def _library_versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {}
    for name in ("torch", "transformers", "tokenizers", "safetensors"):
        try:
            out[name] = version(name)
        except Exception:  # pragma: no cover - a source checkout without metadata
            out[name] = "unknown"
    return out


def _build_info(size: str) -> dict[str, Any]:
    return {
        "builder": "ppo_ray.tiny_model",
        "builder_version": BUILDER_VERSION,
        "size": size,
        "preset": _preset(size),
        "corpus_sha256": hashlib.sha256(_corpus_bytes()).hexdigest(),
        "versions": _library_versions(),
    }


def content_hash(size: str = "tiny") -> str:
    """sha256 (hex) of the builder version, preset, corpus and library versions."""
    blob = json.dumps(_build_info(size), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def default_cache_dir() -> pathlib.Path:
    """``$PPO_RAY_CACHE`` or ``~/.cache/ppo_ray``."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "ppo_ray"


def _is_complete(path: pathlib.Path, digest: str) -> bool:
    try:
        info = json.loads((path / BUILD_INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return info.get("content_hash") == digest and all((path / f).is_file() for f in _EXPECTED_FILES)


# --------------------------------------------------------------------------- building


def _train_tokenizer(preset: dict[str, Any], documents: list[str] | None = None):
    """Byte-level BPE of ``preset["vocab_size"]`` tokens (EOS and pad last) trained on
    `documents` (default: the bundled corpus)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    n_special = 2
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=preset["vocab_size"] - n_special,
        min_frequency=preset["bpe_min_frequency"],
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_documents() if documents is None else documents, trainer=trainer)
    if tok.get_vocab_size() != preset["vocab_size"] - n_special:
        raise RuntimeError(
            f"BPE training produced {tok.get_vocab_size()} tokens, expected "
            f"{preset['vocab_size'] - n_special}: the corpus is too small for this vocab_size"
        )
    # Special tokens go at the end of the vocabulary (like Qwen's added tokens).
    tok.add_special_tokens(
        [
            AddedToken(EOS_TOKEN, special=True, normalized=False),
            AddedToken(PAD_TOKEN, special=True, normalized=False),
        ]
    )
    assert tok.get_vocab_size() == preset["vocab_size"]
    return tok


def _pretrain_documents(raw_tok, preset: dict[str, Any], eos_id: int,
                        documents: list[str] | None = None) -> list[list[int]]:
    """The documents (default: the bundled corpus') as token ids, each followed by EOS (cut
    to ``pretrain_max_len``)."""
    max_len = int(preset["pretrain_max_len"])
    docs = corpus_documents() if documents is None else documents
    return [(e.ids + [eos_id])[:max_len] for e in raw_tok.encode_batch(docs)]


def _pretrain_batches(docs: list[list[int]], preset: dict[str, Any], gen, pad_id: int):
    """Endless (inputs, labels) batches: each epoch is a random permutation of the
    documents (from ``gen``), cut into groups of 4 batches; each group is sorted by
    length (less padding) and split into batches, whose order is shuffled. One document
    per row, starting at position 0 like a prompt, right-padded with pad; labels are the
    next tokens, -100 on padding and after the EOS."""
    import torch

    bs = int(preset["pretrain_batch_docs"])
    while True:
        perm = torch.randperm(len(docs), generator=gen).tolist()
        batches = []
        for g in range(0, len(perm), 4 * bs):
            group = sorted(perm[g : g + 4 * bs], key=lambda i: len(docs[i]))  # stable
            batches += [group[b : b + bs] for b in range(0, len(group), bs)]
        for k in torch.randperm(len(batches), generator=gen).tolist():
            rows = [docs[i] for i in batches[k]]
            width = max(len(r) for r in rows) - 1
            inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
            labels = torch.full((len(rows), width), -100, dtype=torch.long)
            for r, ids in enumerate(rows):
                t = torch.tensor(ids, dtype=torch.long)
                inputs[r, : len(ids) - 1] = t[:-1]
                labels[r, : len(ids) - 1] = t[1:]
            yield inputs, labels


def _corpus_stats(model, docs: list[list[int]], pad_id: int) -> dict[str, float]:
    """Mean next-token loss and entropy (nats) over the corpus documents, and the
    largest probability the model gives the pad token anywhere in them."""
    import torch
    import torch.nn.functional as F

    loss_sum = ent_sum = 0.0
    n = 0
    max_pad = 0.0
    with torch.no_grad():
        for ids in docs:
            x = torch.tensor([ids], dtype=torch.long)
            logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits[0, :-1].double(), dim=-1)
            loss_sum += -logp.gather(-1, x[0, 1:, None]).sum().item()
            ent_sum += -(logp.exp() * logp).sum().item()
            max_pad = max(max_pad, logp[:, pad_id].exp().max().item())
            n += len(ids) - 1
    return {"loss": loss_sum / n, "entropy": ent_sum / n, "max_p_pad": max_pad}


def _pretrain(model, raw_tok, preset: dict[str, Any], eos_id: int, pad_id: int,
              documents: list[str] | None = None, stats_documents: int | None = None) -> dict[str, Any]:
    """Train ``model`` in place for ``preset["pretrain_steps"]`` steps of next-token
    prediction on `documents` (default: the bundled corpus); returns statistics for the
    build info, measured on the first `stats_documents` documents (default: all).

    Deterministic: data order from a local generator, no dropout (Qwen3's attention
    dropout is 0), a fixed CPU thread count (``preset["pretrain_threads"]``, default one:
    the thread count can change float reductions). The global torch RNG and thread count
    are restored afterwards.
    """
    import math

    import torch
    import torch.nn.functional as F

    steps = int(preset["pretrain_steps"])
    docs = _pretrain_documents(raw_tok, preset, eos_id, documents)
    stats_docs = docs[:stats_documents] if stats_documents else docs
    threads = torch.get_num_threads()
    torch.set_num_threads(int(preset.get("pretrain_threads", 1)))
    try:
        with torch.random.fork_rng(devices=[]):
            model.eval()
            before = _corpus_stats(model, stats_docs, pad_id)
            emb = model.get_input_embeddings().weight  # == lm_head.weight (tied)
            matrices = [p for n, p in model.named_parameters() if p.ndim >= 2 and p is not emb]
            vectors = [p for p in model.parameters() if p.ndim < 2]
            peak = float(preset["pretrain_lr"])
            wd = float(preset["pretrain_weight_decay"])
            groups = [
                {"params": [emb], "weight_decay": wd, "lr_mult": float(preset["pretrain_embedding_lr_mult"])},
                {"params": matrices, "weight_decay": wd, "lr_mult": 1.0},
                {"params": vectors, "weight_decay": 0.0, "lr_mult": 1.0},
            ]
            opt = torch.optim.AdamW(groups, lr=peak, betas=tuple(preset["pretrain_betas"]), eps=1e-8,
                                    foreach=False, fused=False)
            warmup = int(preset["pretrain_warmup_steps"])
            final = float(preset["pretrain_final_lr_frac"])

            def lr_at(step: int) -> float:
                if step < warmup:
                    return peak * (step + 1) / warmup
                t = (step - warmup) / max(1, steps - 1 - warmup)
                return peak * (final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * t)))

            gen = torch.Generator(device="cpu").manual_seed(int(preset["pretrain_seed"]))
            batches = _pretrain_batches(docs, preset, gen, pad_id)
            model.train()
            train_losses = []
            for step in range(steps):
                for g in opt.param_groups:
                    g["lr"] = lr_at(step) * g["lr_mult"]
                inputs, labels = next(batches)
                logits = model(input_ids=inputs, use_cache=False).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(preset["pretrain_grad_clip"]))
                opt.step()
                train_losses.append(loss.item())
                if (step + 1) % 100 == 0:  # python -m ppo_ray.tldr_model shows these (a long build)
                    log.info("pretraining step %d/%d: loss %.4f", step + 1, steps, sum(train_losses[-100:]) / 100)
            model.eval()
            after = _corpus_stats(model, stats_docs, pad_id)
    finally:
        torch.set_num_threads(threads)
    r6 = lambda v: round(float(v), 6)  # noqa: E731
    return {
        "steps": steps,
        "tokens_per_epoch": sum(len(d) for d in docs),
        "corpus_loss_before": r6(before["loss"]),
        "corpus_loss_after": r6(after["loss"]),
        "corpus_entropy_before": r6(before["entropy"]),
        "corpus_entropy_after": r6(after["entropy"]),
        "corpus_max_p_pad_after": float(f"{after['max_p_pad']:.3e}"),
        "train_loss_first_step": r6(train_losses[0]) if train_losses else None,
        "train_loss_last_10_steps": r6(sum(train_losses[-10:]) / len(train_losses[-10:])) if train_losses else None,
    }


def _write_model(dest: pathlib.Path, size: str, digest: str) -> None:
    """Build everything into the (existing, empty) directory ``dest``."""
    model, pretrain_stats = build_model_files(dest, _preset(size))
    info = _build_info(size)
    info["content_hash"] = digest
    info["num_parameters"] = sum(p.numel() for p in model.parameters())
    info["pretrain"] = pretrain_stats
    (dest / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def build_model_files(dest: pathlib.Path, preset: dict[str, Any], documents: list[str] | None = None,
                      stats_documents: int | None = None):
    """Tokenizer, seeded init and pretraining (when ``preset["pretrain_steps"]`` > 0) on
    `documents` (default: the bundled corpus), written to ``dest`` with ``save_pretrained``
    (config, generation config, safetensors weights, tokenizer). Returns (the model,
    pretraining statistics or None). Shared by this module's presets and
    ppo_ray.tldr_model."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    raw_tok = _train_tokenizer(preset, documents)
    eos_id = raw_tok.token_to_id(EOS_TOKEN)
    pad_id = raw_tok.token_to_id(PAD_TOKEN)
    assert eos_id != pad_id

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=preset["max_position_embeddings"],
        padding_side="right",
        truncation_side="right",
        clean_up_tokenization_spaces=False,
    )

    config = Qwen3Config(
        vocab_size=preset["vocab_size"],
        hidden_size=preset["hidden_size"],
        intermediate_size=preset["intermediate_size"],
        num_hidden_layers=preset["num_hidden_layers"],
        num_attention_heads=preset["num_attention_heads"],
        num_key_value_heads=preset["num_key_value_heads"],
        head_dim=preset["head_dim"],
        hidden_act=preset["hidden_act"],
        max_position_embeddings=preset["max_position_embeddings"],
        initializer_range=preset["initializer_range"],
        rms_norm_eps=preset["rms_norm_eps"],
        tie_word_embeddings=preset["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": preset["rope_theta"]},
        max_window_layers=preset["num_hidden_layers"],
        use_sliding_window=False,
        bos_token_id=eos_id,  # as Qwen3-0.6B-Base: bos id == eos id, tokenizer adds no BOS
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )

    # Construct under a forked global RNG (HF's own init draws from it), then
    # overwrite every weight from a local generator: deterministic, and the
    # caller's global torch RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        model = Qwen3ForCausalLM(config)
    gen = torch.Generator(device="cpu").manual_seed(int(preset["seed"]))
    std = float(preset["initializer_range"])
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if param.ndim >= 2:  # embeddings and linear projections
                param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
            elif name.endswith("norm.weight"):  # RMSNorm scales (incl. q_norm/k_norm)
                param.fill_(1.0)
            else:  # biases (none in Qwen3 without attention_bias)
                param.zero_()
        # HF zero-initialises the padding_idx row of the embedding; do the same.
        model.get_input_embeddings().weight[pad_id].zero_()
    model = model.to(torch.float32)
    pretrain_stats = (_pretrain(model, raw_tok, preset, eos_id, pad_id, documents, stats_documents)
                      if preset["pretrain_steps"] > 0 else None)
    model = model.eval()

    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)

    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return model, pretrain_stats


def build_tiny_model(out_dir: str | os.PathLike | None = None, size: str = "tiny") -> pathlib.Path:
    """Build (or reuse) the embedded model and return its directory.

    ``out_dir=None``: ``default_cache_dir() / f"qwen3-{size}-{hash[:16]}"``.
    ``out_dir`` given: exactly that directory. Either way, an existing complete
    build of the same content is returned as is; otherwise the model is built in a
    temporary sibling directory and renamed into place (atomic). An ``out_dir`` that
    exists with other content raises ``FileExistsError``; an empty one is replaced.
    """
    digest = content_hash(size)
    if out_dir is None:
        target = default_cache_dir() / f"qwen3-{size}-{digest[:16]}"
    else:
        target = pathlib.Path(out_dir).expanduser()
    target = target.absolute()

    if _is_complete(target, digest):
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not a complete build of tiny model {size!r} ({digest[:16]})")

    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(parent / f".{target.name}.lock"):
        if _is_complete(target, digest):  # built by another process while we waited
            return target
        _build_into(target, size, digest)
    return target


def _build_into(target: pathlib.Path, size: str, digest: str) -> None:
    # A crashed builder's temp directory is removed once it is an hour old (a fresh one may
    # be a concurrent builder's that could not take the lock).
    remove_stale_temps(target.parent, temp_prefix(target), max_age_s=3600.0)
    # The rename replaces an empty dir; where a non-empty one appeared, a concurrent builder
    # won the race: use its (identical) build.
    with atomic_dir(target, keep_existing=lambda: _is_complete(target, digest)) as tmp:
        _write_model(tmp, size, digest)
        # safetensors writes 0600: make the build readable like any other model directory.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ppo_ray.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--out", default=None, help="output directory (default: the cache)")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out, size=args.size))


if __name__ == "__main__":
    main()
