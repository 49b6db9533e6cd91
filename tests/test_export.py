"""launch.py export (ppo_ray/driver/export.py): a run's LoRA as a merged model and as a portable adapter.

On the embedded tiny model in float32, with real PEFT and transformers (no Ray, no vLLM):
- a LoRA with random, non-zero B (its effect on the logprobs is large): the merged model,
  loaded by transformers alone, gives the adapter-on-base logprobs (PEFT) up to float rounding,
  and not the base's; the exported adapter loads with PEFT from another working directory (its
  base named by absolute path) and gives the same logprobs; the model cards name the base and r;
- the committed real run (tests/data/checkpoint-v0: launch.py ppo, one step, its adapter's base
  recorded as the writer's own model cache path) exported from its checkpoint, and as a finished
  run directory (its final adapter/ beside it, as the PPO stage leaves it);
- bad input exits 2 naming the bad thing and writes nothing; a failed export leaves nothing.

The slow test serves the exports with vLLM's OpenAI-compatible server on the CPU
(test_served_adapter_and_merged_model_complete_as_the_peft_model_does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import Server, greedy, same_until_a_near_tie
from tolerances import decoder_terms, rounding_tol

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "checkpoint-v0"
STEP = "step-000001"
R = 4  # the random adapter's rank


def launch(*args: str) -> int:
    import launch as cli

    return cli.main(["export", *map(str, args)])


def tokens(tokenizer, n_rows: int = 3, length: int = 48) -> torch.Tensor:
    """(n_rows, length) token ids of the bundled prompts that the fixture's run trained on."""
    rows = [json.loads(line)["prompt"] for line in (FIXTURE / "prompts.jsonl").read_text().splitlines()][:n_rows]
    ids = [tokenizer(text)["input_ids"][:length] for text in rows]
    assert all(len(i) == length for i in ids)
    return torch.tensor(ids)


@torch.no_grad()
def token_logprobs(model, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(B, T-1) logprobs of each next token (ppo_ray.logprobs, the learner's own), and the
    largest |logit| (the magnitude a logprob's rounding scales with: x - logsumexp(x))."""
    from ppo_ray.logprobs import logprobs_from_logits

    logits = model(input_ids=ids).logits[:, :-1].float()
    return logprobs_from_logits(logits, ids[:, 1:]), logits.abs().max().item()


def tolerance(reference: torch.Tensor, logit_max: float, seq: int) -> float:
    """Merged (W0 + s B A) x against W0 x + s B (A x): the same sums in another order (and one
    rounding of each merged weight). Magnitude: the larger of |logprob| and |logit| (a logprob
    keeps the rounding of its logsumexp); terms: the tiny decoder's reductions for `seq` tokens
    plus the rank-r sums the LoRA adds to its 7 projections in each of its 2 layers."""
    magnitude = max(reference.abs().max().item(), logit_max)
    return rounding_tol(magnitude, decoder_terms(seq=seq) + 2 * 7 * R)


@pytest.fixture(scope="module")
def random_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A PEFT adapter on the tiny model with every A and B drawn at random (B non-zero, so the
    merge changes the weights), written as the trainer writes one (write_lora_adapter)."""
    from peft import get_peft_model, get_peft_model_state_dict

    from ppo_ray.modeling import LoraSpec, LoraWeights, load_causal_lm, write_lora_adapter

    spec = LoraSpec(r=R, lora_alpha=8, target_modules=("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                         "up_proj", "v_proj"), lora_dropout=0.05)
    model = get_peft_model(load_causal_lm(str(tiny_model_dir)), spec.peft_config())
    g = torch.Generator().manual_seed(0)
    weights = LoraWeights({k: 0.1 * torch.randn(v.shape, generator=g)
                           for k, v in get_peft_model_state_dict(model).items()}, spec)
    return write_lora_adapter(tmp_path_factory.mktemp("random") / "adapter", weights, base_model=str(tiny_model_dir))


@pytest.fixture(scope="module")
def exported(random_adapter, tmp_path_factory) -> dict[str, Path]:
    """The random adapter exported both ways by the command, float32."""
    out = tmp_path_factory.mktemp("exported")
    assert launch(random_adapter, "--merged", out / "merged", "--adapter", out / "adapter", "--dtype", "float32") == 0
    return {"merged": out / "merged", "adapter": out / "adapter"}


def test_merged_model_gives_the_adapters_logprobs_without_peft(tiny_model_dir, random_adapter, exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ppo_ray.modeling import load_causal_lm, load_tokenizer

    merged_dir = exported["merged"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} \
        <= {p.name for p in merged_dir.iterdir()}
    assert not any(p.suffix in (".bin", ".pt", ".pth") for p in merged_dir.iterdir())
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())  # plain transformers, no PEFT
    ids = tokens(load_tokenizer(str(merged_dir)))

    with_lora = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_dir)), str(random_adapter)).eval()
    reference, logit_max = token_logprobs(with_lora, ids)
    got, _ = token_logprobs(merged, ids)
    base, _ = token_logprobs(load_causal_lm(str(tiny_model_dir)), ids)
    tol = tolerance(reference, logit_max, ids.shape[1])
    diff = (got - reference).abs().max().item()
    print(f"merged vs adapter-on-base: max |diff| {diff:.3g}, tolerance {tol:.3g}; "
          f"base vs adapter-on-base: {(base - reference).abs().max().item():.3g}")
    assert diff <= tol
    assert (base - reference).abs().max().item() > 100 * tol  # the LoRA matters, and the merge kept it


def test_exported_adapter_loads_with_peft_elsewhere_and_names_its_base(tiny_model_dir, random_adapter, exported,
                                                                       tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM, PeftModel

    from ppo_ray.modeling import load_causal_lm, load_tokenizer

    out = exported["adapter"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    assert Path(config["base_model_name_or_path"]).is_absolute()
    assert config["r"] == R and config["lora_alpha"] == 8
    # the tensors are the trained ones, byte for byte
    weights = "adapter_model.safetensors"
    assert (out / weights).read_bytes() == (random_adapter / weights).read_bytes()
    ids = tokens(load_tokenizer(str(tiny_model_dir)))
    reference, _ = token_logprobs(PeftModel.from_pretrained(load_causal_lm(str(tiny_model_dir)),
                                                            str(random_adapter)).eval(), ids)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # PEFT reads the base from the adapter's own config, from a working directory of its own
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    got, _ = token_logprobs(loaded, ids)
    assert torch.equal(got, reference)  # the same base and tensors, the same computation
    # the cards
    for kind in ("merged", "adapter"):
        card = (exported[kind] / "README.md").read_text()
        assert f"base model: `{tiny_model_dir.resolve()}`" in card and f"r={R}, lora_alpha=8" in card, kind
        assert "ppo-ray export" in card and "--dtype float32" in card
    assert "weights: float32, safetensors" in (exported["merged"] / "README.md").read_text()


def test_bfloat16_merge_is_cast_after_merging_in_float32(random_adapter, tmp_path):
    from safetensors import safe_open

    assert launch(random_adapter, "--merged", tmp_path / "m", "--dtype", "bfloat16") == 0
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """The committed real run, moved: one checkpoint, no final adapter/ (as written)."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "moved" / "run"))


def test_a_real_runs_checkpoint_and_finished_run_directory_export(run_dir, tmp_path, tiny_model_dir, capsys):
    """The fixture's checkpoint names its base `embedded:tiny` in config.yaml, and its adapter's
    base_model_name_or_path is the writing machine's cache path: the export names the base as
    this machine resolves embedded:tiny, checks the checkpoint's fingerprint, and the card
    gives the lineage. As a finished run directory (adapter/ = the last checkpoint's, as
    trainer.save_adapter leaves it, and a report), the card says it is the final adapter and
    gives the report's numbers and the run tag."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from ppo_ray.modeling import load_tokenizer

    ckpt = run_dir / "checkpoints" / STEP
    assert launch(ckpt, "--adapter", tmp_path / "a", "--merged", tmp_path / "m") == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["base_model"] == str(tiny_model_dir.resolve()) and summary["dtype"] == "float32"
    card = (tmp_path / "a" / "README.md").read_text()
    meta = json.loads((ckpt / "trainer.json").read_text())
    assert f"checkpoint id `{meta['checkpoint_id']}`, run id `{meta['run_id']}`" in card
    assert "the run's first checkpoint" in card and "holds no final adapter/" in card
    assert "(the run's model_name: `embedded:tiny`)" in card and "| learning_rate | `0.003` |" in card
    # the trained step moved the policy: merged and adapter agree, and differ from the base
    ids = tokens(load_tokenizer(str(tiny_model_dir)))
    via_peft, logit_max = token_logprobs(AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "a")).eval(), ids)
    merged, _ = token_logprobs(AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval(), ids)
    base, _ = token_logprobs(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval(), ids)
    tol = tolerance(via_peft, logit_max, ids.shape[1])
    print(f"checkpoint-v0: merged vs adapter {(merged - via_peft).abs().max().item():.3g} (tol {tol:.3g}); "
          f"base vs adapter {(base - via_peft).abs().max().item():.3g}")
    assert (merged - via_peft).abs().max().item() <= tol
    assert (base - via_peft).abs().max().item() > 10 * tol

    # the run, finished: its final adapter is its last checkpoint's, and it has a report and a run tag
    shutil.copytree(ckpt / "adapter", run_dir / "adapter")
    (run_dir / "report-ppo.json").write_text(json.dumps({"steps": 1, "first_reward": 0.5, "last_reward": 0.625,
                                                         "final_kl": 0.01, "run_dir": str(run_dir)}))
    (run_dir / "run.json").write_text(json.dumps({"run_tag": "ppo-1234abcd", "run_tags": ["ppo-1234abcd"]}))
    assert launch(run_dir, "--adapter", tmp_path / "a2") == 0
    card = (tmp_path / "a2" / "README.md").read_text()
    assert "this is the run's final adapter" in card and f"checkpoint: `{STEP}`" in card
    assert "| last_reward | 0.625 |" in card and "run tag: `ppo-1234abcd`" in card
    assert (tmp_path / "a2" / "adapter_model.safetensors").read_bytes() == \
        (ckpt / "adapter" / "adapter_model.safetensors").read_bytes()


def nothing_written(parent: Path, names: list[str]) -> bool:
    return not any((parent / n).exists() for n in names) and not any(p.name.startswith(".tmp-")
                                                                      for p in parent.iterdir())


def test_bad_input_exits_2_naming_it_and_writes_nothing(run_dir, random_adapter, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()

    def rejected(*args) -> str:
        assert launch(*args) == 2
        return capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty} holds no adapter" in rejected(empty, "--merged", out / "m")
    # a run that has not finished: no adapter/, but checkpoints: the message names the newest
    err = rejected(run_dir, "--merged", out / "m")
    assert "holds no adapter" in err and f"launch.py export {run_dir / 'checkpoints' / STEP}" in err
    assert "no such directory" in rejected(tmp_path / "nope", "--adapter", out / "a")
    assert "--dtype 'float64': unknown; one of float32, bfloat16, float16" in rejected(
        random_adapter, "--merged", out / "m", "--dtype", "float64")
    (out / "taken").mkdir()
    (out / "taken" / "keep.txt").write_text("mine")
    assert f"--adapter {out / 'taken'} exists and is not empty" in rejected(random_adapter, "--adapter", out / "taken")
    assert (out / "taken" / "keep.txt").read_text() == "mine" and len(list((out / "taken").iterdir())) == 1
    assert "nothing to export" in rejected(random_adapter)
    assert "name the same directory" in rejected(random_adapter, "--merged", out / "x", "--adapter", out / "x")
    # weights load with safetensors only
    pickled = tmp_path / "pickled"
    shutil.copytree(random_adapter, pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    assert "has no adapter_model.safetensors (it has adapter_model.bin: weights load with safetensors only)" in \
        rejected(pickled, "--merged", out / "m")
    # an adapter whose base is named by a path that is not there, and no run config to say otherwise
    moved = tmp_path / "moved-adapter"
    shutil.copytree(random_adapter, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "runs/x/sft"}))
    assert "names its base 'runs/x/sft', which is not a hub id or an existing absolute directory" in \
        rejected(moved, "--adapter", out / "a")
    # a damaged checkpoint is named, not exported
    with open(run_dir / "checkpoints" / STEP / "adapter" / "adapter_model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    assert "fails its sha256 checksum" in rejected(run_dir / "checkpoints" / STEP, "--adapter", out / "a")
    assert nothing_written(out, ["m", "a", "x"]) and nothing_written(tmp_path, ["m", "a"])


def test_a_failed_export_leaves_nothing(random_adapter, tmp_path, monkeypatch):
    """Both outputs are renamed into place only when both are complete: a failure while writing
    the second leaves neither (and no temp directory)."""
    import ppo_ray.driver.export as export

    def fail(source, out):
        (out / "adapter_model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_write_adapter", fail)
    with pytest.raises(OSError, match="No space left"):
        launch(random_adapter, "--merged", tmp_path / "m", "--adapter", tmp_path / "a")
    assert nothing_written(tmp_path, ["m", "a"])


# --------------------------------------------------------------------------- served with vLLM
@pytest.mark.slow
def test_served_adapter_and_merged_model_complete_as_the_peft_model_does(tiny_model_dir, random_adapter, exported,
                                                                          tmp_path):
    """`vllm serve`'s OpenAI API over HTTP, as a user serves an export (README, "After training"):
    the base with the exported adapter as a LoRA module (`--enable-lora --lora-modules ppo=...`),
    then the merged model with no LoRA. Greedy completions of a few prompts (token ids in, token
    ids out, EOS ignored) equal the PEFT model's own greedy decode under the same adapter, and
    the base model's served completions differ. Two server starts (one per model), ~20-60 s each
    on 2 cores."""
    from peft import PeftModel

    from ppo_ray.driver.export import serving_rank
    from ppo_ray.modeling import load_causal_lm, load_tokenizer

    n_tokens = 12
    prompts = [row.tolist() for row in tokens(load_tokenizer(str(tiny_model_dir)), n_rows=3, length=24)]
    peft_model = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_dir)), str(exported["adapter"])).eval()
    reference = [greedy(peft_model, p, n_tokens) for p in prompts]
    # a greedy choice is decided by a logit gap: two float32 computations of the logits (vLLM's
    # kernels, PEFT's) may order a near tie differently; the rounding as in tolerance() above
    tol = max(rounding_tol(logit_max, decoder_terms(seq=24 + n_tokens) + 2 * 7 * R) for _, _, logit_max in reference)

    server = Server(tiny_model_dir, tmp_path / "lora-server.log", "--served-model-name", "base", "--enable-lora",
                    "--max-lora-rank", str(serving_rank(R)), "--lora-modules", f"ppo={exported['adapter']}")
    try:
        print(f"vLLM server (base + LoRA) answered after {server.wait_ready():.1f} s")
        served = [server.complete("ppo", p, n_tokens) for p in prompts]
        served_base = [server.complete("base", p, n_tokens) for p in prompts]
    finally:
        server.stop()
    compared = [same_until_a_near_tie(got, want, gaps, tol) for got, (want, gaps, _) in zip(served, reference)]
    assert sum(compared) >= len(prompts) * n_tokens // 2, compared  # near ties are rare: most tokens were compared
    assert served_base != served  # the adapter was applied

    server = Server(exported["merged"], tmp_path / "merged-server.log", "--served-model-name", "merged")
    try:
        print(f"vLLM server (merged, no LoRA) answered after {server.wait_ready():.1f} s")
        served_merged = [server.complete("merged", p, n_tokens) for p in prompts]
    finally:
        server.stop()
    compared = [same_until_a_near_tie(got, want, gaps, tol) for got, (want, gaps, _) in zip(served_merged, reference)]
    assert sum(compared) >= len(prompts) * n_tokens // 2, compared
    print(f"tokens compared: {compared} of {n_tokens} per prompt; smallest reference margin "
          f"{min(g for _, gaps, _ in reference for g in gaps):.3g} (tolerance {tol:.3g})")
