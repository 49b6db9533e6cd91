"""Bad input: every item of issue 5 gives an error naming the bad thing, before any actor
(and, where possible, before Ray) starts, and a rejected command leaves the run directory as
it was. Fast: no actors, no Ray session; launch.py runs in-process (launch.main) except one
subprocess run, and every run here stops before Ray starts.

| # | bad input | where it is caught | tests |
|---|---|---|---|
| 1a | config file missing, unreadable, bad YAML, not a mapping | `config.read_yaml` (from `parse_overrides`), launch.py exit 2 | test_config.py::test_bad_files; here test_launch_rejects_bad_config_files, test_launch_subprocess_missing_config |
| 1b | data file missing, a directory, a broken JSONL line, an unreadable parquet file, a path-like name that does not exist | `data.read_rows` / `data.load_prompts` (FileNotFoundError / DataError), launch.py `plain_ppo_inputs` before the run directory is written | test_bad_data_files, test_launch_rejects_bad_data_before_writing; test_tldr_path.py::test_bad_comparison_row_and_bad_json_are_errors_not_tracebacks (sft/rm data) |
| 2 | config value out of range | `PPOConfig._validate` (ConfigError naming the field) | test_config.py::test_invalid_values_name_the_field, test_config.py::test_range_checks_of_issue_5, test_tldr_path.py::test_a_local_file_without_split_is_refused_before_anything_runs, test_launch.py::test_launch_rejects_bad_arguments; here test_launch_rejected_config_leaves_run_dir_untouched |
| 3 | unknown config key (CLI, YAML, replace) | `config._check_keys` (closest name suggested) | test_config.py::test_unknown_key_suggests_closest, test_launch.py::test_launch_rejects_bad_arguments; here test_launch_rejected_config_leaves_run_dir_untouched |
| 4 | dataset without the prompt column (or a non-str value) | `data.column` (DataError: file, row, columns), at load | test_missing_prompt_column; test_tldr_path.py::test_missing_column_exits_2_naming_file_row_and_column (SFT data) |
| 5 | empty prompts | `data.load_prompts(config, tokenizer)` at load (launch.py, before writing); `data.encode_prompts` at every step | test_empty_and_overlong_prompts_found_at_load, test_launch_rejects_bad_data_before_writing; test_generator.py::test_encode_prompts_errors, test_trainer.py::test_bad_prompts_fail_clearly_and_leave_state_intact |
| 6 | over-long prompts (prompt_truncation=error) | as 5 | as 5 |
| 7 | reward model path that is not a reward model: no config.json, a file, a broken config.json, num_labels != 1, a causal LM | `modeling.resolve_model_path` (FileNotFoundError), `rewards.check_reward_model` via `rewards.check_reward_sources` (config.json; top of `PPOTrainer.__init__`, launch.py and `RewardScorer`; RewardError), `modeling.load_reward_model` (weights: no trained `score`) | test_reward_model_paths_that_are_not_reward_models, test_causal_lm_checkpoint_is_not_a_reward_model, test_trainer_checks_reward_sources_before_ray, test_launch_rejects_a_causal_lm_reward_model; test_scorers.py::test_reward_sources_are_checked |
| 8 | reward function raises, returns NaN, the wrong number of values, not numbers; does not import | `RewardScorer.function_scores` / `.score` (RewardError naming the function); import in `rewards.check_reward_sources` (top of `PPOTrainer.__init__`, launch.py, `RewardScorer`) | test_bad_reward_functions_without_ray, test_trainer_checks_reward_sources_before_ray; test_trainer.py::test_bad_reward_functions_are_named (in a Ray actor), test_scorers.py::test_nonfinite_scores_error_or_drop, test_scorers.py::test_reward_sources_are_checked |
| 9 | LoRA rank the vLLM generator cannot serve | `PPOConfig._validate`: lora_r <= 512 (`VLLM_LORA_RANKS`, vLLM's `MaxLoRARanks`) | test_lora_rank_above_vllms_largest_is_refused, test_lora_rank_set_matches_vllm |
| 10 | RAY_ADDRESS where nothing listens, a dashboard URL, not host:port | `placement.check_ray_address` (TCP connect, 5 s bound) in `init_ray`, and in launch.py before writing | test_check_ray_address, test_init_ray_fails_fast_without_calling_ray_init, test_launch_subprocess_ray_address_nowhere; test_deploy.py::test_submit_fails_fast_when_nothing_listens (deploy/submit.sh) |
| 11 | a model whose max_position_embeddings < max_prompt_length + max_new_tokens (issue 15) | `modeling.check_context_length` in launch.py before writing (the pipeline: the base model) and at the top of `PPOTrainer.__init__`, before Ray | test_ops_inputs.py::test_context_length_error_names_both_fields_and_the_limit, test_trainer_refuses_a_short_model_before_ray, test_launch_refuses_a_short_model_before_writing |
| 12 | apply_chat_template with a tokenizer that has no chat template; with the sft/rm stages | `data.check_chat_template` (load_prompts, PPOTrainer), launch.py exit 2 | test_ops_inputs.py::test_apply_chat_template_is_checked_at_load_and_refused_for_the_pipeline |
| 13 | report_to names a tracker whose package is missing (wandb) | `tracking.check_trackers` in launch.py before writing and in `PPOTrainer.__init__` | test_monitoring.py::test_a_missing_tracker_package_is_named_before_anything_starts |
| 14 | the cluster's entrypoint Python lacks a dependency (ray job submit) | deploy/submit.sh preflight job, exit 4 | test_deploy.py::test_submit_preflight_names_what_the_clusters_python_cannot_import |
| 15 | model_transfer: path and a node that cannot read a model directory | `placement.prepare_models` (a probe task per node), ClusterError before any actor starts | not tested: every node of a cluster simulated on one machine shares its filesystem |

Decision (item 7): a causal LM is refused as a reward model. AutoModelForSequenceClassification
would load it with a randomly initialised score head; its scores are noise and PPO would
train on them with no sign of trouble. A reward model is a checkpoint saved from
AutoModelForSequenceClassification (num_labels=1), such as `launch.py rm`'s rm/.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch
from conftest import tiny_test_config
from ppo_ray.config import VLLM_LORA_RANKS, ConfigError, PPOConfig

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
GOOD_PROMPT = "SUBREDDIT: r/advice\n\nTITLE: help\n\nPOST: my bike broke\n\nTL;DR:"


# --------------------------------------------------------------------------- helpers
def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory`: relative path -> (bytes, mtime_ns)."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def old_run(tmp_path) -> Path:
    """A run directory with a previous run's files, which a rejected command must not touch."""
    run = tmp_path / "old-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config-ppo.yaml").write_text("kl_coef: 0.1\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    return run


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def launch_ppo(run: Path, *args: str) -> int:
    """launch.py ppo on configs/tiny.yaml (a programmatic reward) in `run`, RAY_ADDRESS unset."""
    return launch.main(["ppo", "--config", str(TINY), "--run_dir", str(run), *args])


@pytest.fixture
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from ppo_ray.modeling import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- 1a. config files
@pytest.mark.parametrize("content,match", [
    (None, "config file '.*nope.yaml' does not exist"),
    ("kl_coef: [0.1\n", "is not valid YAML"),
    ("- 1\n- 2\n", "must hold a mapping"),
    (b"\xff\xfe\x00garbage", "cannot be read"),  # not UTF-8 (chmod 000 does not stop root)
    ("directory", "does not exist \\(or is not a file\\)"),
])
def test_launch_rejects_bad_config_files(tmp_path, old_run, capsys, content, match):
    path = tmp_path / "nope.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    before = snapshot(old_run)
    assert launch.main(["ppo", "--config", str(path), "--run_dir", str(old_run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(match, err), err
    assert snapshot(old_run) == before


def test_launch_subprocess_missing_config(tmp_path):
    """The CLI as a user runs it: one line on stderr, exit code 2, nothing written."""
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--config", "nope.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: config file 'nope.yaml' does not exist (or is not a file)"
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- 2, 3. values and keys
@pytest.mark.parametrize("args,message", [
    (["--gamma", "2"], "config field 'gamma' = 2.0 is invalid"),
    (["--kl_coeff", "0.1"], "unknown config key --kl_coeff; did you mean --kl_coef?"),
    (["--lora_r", "1024"], "config field 'lora_r' = 1024 is invalid"),
    (["--missing_eos_penalty", ".inf"], "'missing_eos_penalty'"),
    (["--dataset", ""], "'dataset'"),
])
def test_launch_rejected_config_leaves_run_dir_untouched(old_run, capsys, no_ray_address, args, message):
    before = snapshot(old_run)
    assert launch_ppo(old_run, *args) == 2
    assert message in capsys.readouterr().err
    assert snapshot(old_run) == before


def test_unknown_key_in_a_yaml_file_names_file_and_key(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model_name: embedded:tiny\nlearning_rat: 1e-5\n")
    assert launch.main(["ppo", "--config", str(path), "--run_dir", str(tmp_path / "run")]) == 2
    assert f"{path}: unknown config key learning_rat; did you mean learning_rate?" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- 1b, 4, 5, 6. data
def test_bad_data_files(tmp_path, tok):
    from ppo_ray.data import DataError, load_prompts

    def load(dataset: str, **kw):
        return load_prompts(PPOConfig(dataset=dataset, **kw), tok)

    with pytest.raises(FileNotFoundError, match="data file '.*nope.jsonl' does not exist"):
        load(str(tmp_path / "nope.jsonl"))
    # a name only a local path looks like is not looked up on the hub
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load("./no_such_prompts")
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load(str(tmp_path / "folder"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": GOOD_PROMPT}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl: line 2 is not valid JSON"):
        load(str(broken))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: cannot be read as UTF-8 JSONL"):
        load(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"bad.parquet: cannot be read as parquet"):
        load(str(tmp_path / "bad.parquet"))
    (tmp_path / "p.csv").write_text("prompt\nhello\n")
    with pytest.raises(DataError, match=r"unsupported format '.csv'"):
        load(str(tmp_path / "p.csv"))


def test_missing_prompt_column(tmp_path):
    from ppo_ray.data import DataError, load_prompts

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": GOOD_PROMPT}, {"text": GOOD_PROMPT, "id": 1}])
    with pytest.raises(DataError, match=r"p.jsonl: row 1 has no column 'prompt' \(columns: \['id', 'text'\]\)"):
        load_prompts(PPOConfig(dataset=str(path)))
    with pytest.raises(DataError, match=r"row 0 has no column 'query'"):
        load_prompts(PPOConfig(dataset=str(path), prompt_column="query"))
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": GOOD_PROMPT}, {"prompt": 7}])
    with pytest.raises(DataError, match=r"row 1 column 'prompt' is a int, not a str"):
        load_prompts(PPOConfig(dataset=str(path)))


def test_empty_and_overlong_prompts_found_at_load(tmp_path, tok, monkeypatch):
    """Found when the dataset is loaded (every row, not only the first batch's), with the row index."""
    from ppo_ray import data
    from ppo_ray.data import DataError, load_prompts

    monkeypatch.setattr(data, "CHECK_CHUNK", 2)  # row indices stay global across chunks
    long_prompt = GOOD_PROMPT.replace("my bike broke", "my bike broke again " * 60)
    n_long = len(tok(long_prompt, add_special_tokens=False)["input_ids"])
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": GOOD_PROMPT}] * 4 + [{"prompt": "  \n"}])
    with pytest.raises(DataError, match=r"empty.jsonl' column 'prompt': prompt 4 is empty or whitespace only"):
        load_prompts(PPOConfig(dataset=str(empty)), tok)
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": GOOD_PROMPT}] * 3 + [{"prompt": long_prompt}])
    cfg = PPOConfig(dataset=str(long), max_prompt_length=64, prompt_truncation="error")
    with pytest.raises(DataError, match=rf"prompt 3 is {n_long} tokens long, over max_prompt_length=64"):
        load_prompts(cfg, tok)
    assert len(load_prompts(cfg.replace(prompt_truncation="left"), tok)) == 4  # truncation: fine
    assert len(load_prompts(cfg.replace(max_prompt_length=n_long), tok)) == 4  # at the limit: fine
    write_jsonl(tmp_path / "none.jsonl", [])
    with pytest.raises(DataError, match="has no rows"):
        load_prompts(PPOConfig(dataset=str(tmp_path / "none.jsonl")), tok)


@pytest.mark.parametrize("case,message", [
    ("missing", "data file '{path}' does not exist"),
    ("broken", "{path}: line 2 is not valid JSON"),
    ("no_column", "{path}: row 0 has no column 'prompt'"),
    ("empty", "prompt 1 is empty or whitespace only"),
    ("long", "prompt 0 is "),
])
def test_launch_rejects_bad_data_before_writing(tmp_path, old_run, capsys, no_ray_address, case, message):
    path = tmp_path / f"{case}.jsonl"
    if case == "broken":
        path.write_text(json.dumps({"prompt": GOOD_PROMPT}) + "\n{\n")
    elif case == "no_column":
        write_jsonl(path, [{"text": GOOD_PROMPT}])
    elif case == "empty":
        write_jsonl(path, [{"prompt": GOOD_PROMPT}, {"prompt": ""}])
    elif case == "long":
        write_jsonl(path, [{"prompt": "word " * 400}])
    before = snapshot(old_run)
    code = launch_ppo(old_run, "--dataset", str(path), "--prompt_truncation", "error", "--max_prompt_length", "64")
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(path=path) in err and "Traceback" not in err
    assert snapshot(old_run) == before


# --------------------------------------------------------------------------- 7. reward model paths
@pytest.fixture(scope="module")
def causal_lm_dir(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("causal") / "lm"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_reward_model_paths_that_are_not_reward_models(tmp_path, causal_lm_dir):
    from ppo_ray.rewards import RewardError, check_reward_model

    with pytest.raises(FileNotFoundError, match="exists but is not a model directory"):
        check_reward_model(str(tmp_path))  # a directory without config.json
    weights = next(causal_lm_dir.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="exists but is not a model directory"):
        check_reward_model(str(weights))  # a file
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RewardError, match="is not a loadable model"):
        check_reward_model(str(tmp_path))
    two = tmp_path / "two"
    shutil.copytree(causal_lm_dir, two)
    cfg = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForSequenceClassification"],
                                                 "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(RewardError, match="num_labels=2; a reward model needs 1"):
        check_reward_model(str(two))


def test_causal_lm_checkpoint_is_not_a_reward_model(tmp_path, causal_lm_dir):
    from actors.reward import RewardScorer
    from ppo_ray.rewards import RewardError, check_reward_model
    from ppo_ray.modeling import load_reward_model

    with pytest.raises(RewardError, match=r"is a Qwen3ForCausalLM checkpoint, not a sequence-classification"):
        check_reward_model(str(causal_lm_dir))
    with pytest.raises(RewardError, match="Qwen3ForCausalLM"):
        RewardScorer(str(causal_lm_dir))  # the reward actor's constructor checks too
    # config.json claims a reward model, the weights have no score head: caught at load
    liar = tmp_path / "liar"
    shutil.copytree(causal_lm_dir, liar)
    cfg = json.loads((liar / "config.json").read_text())
    (liar / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForSequenceClassification"],
                                                  "id2label": {"0": "LABEL_0"}}))
    check_reward_model(str(liar))
    with pytest.raises(ValueError, match=r"has no trained score head \(missing from the checkpoint: \['score.weight'\]\)"):
        load_reward_model(str(liar))


def _fail_if_ray_starts(monkeypatch):
    import ppo_ray.trainer as trainer_module

    def boom(*a, **k):
        raise AssertionError("init_ray was called: the check came after Ray started")

    monkeypatch.setattr(trainer_module, "init_ray", boom)
    monkeypatch.setattr(trainer_module, "create_roles", boom)
    return trainer_module.PPOTrainer


@pytest.mark.parametrize("changes,error,match", [
    (dict(reward_funcs=["no_such_module_xyz:f"], reward_weights=[]), "RewardError", "cannot import module"),
    (dict(reward_funcs=["ppo_ray.rewards:nope"], reward_weights=[]), "RewardError", "has no callable 'nope'"),
    (dict(reward_funcs=[], reward_weights=[], reward_model_name="CAUSAL"), "RewardError", "Qwen3ForCausalLM"),
    (dict(reward_funcs=[], reward_weights=[], reward_model_name="DIR"), "FileNotFoundError", "not a model directory"),
    (dict(reward_funcs=[], reward_weights=[]), "RewardError", "no reward source"),
])
def test_trainer_checks_reward_sources_before_ray(monkeypatch, tmp_path, causal_lm_dir, changes, error, match):
    PPOTrainer = _fail_if_ray_starts(monkeypatch)
    if changes.get("reward_model_name") == "CAUSAL":
        changes["reward_model_name"] = str(causal_lm_dir)
    elif changes.get("reward_model_name") == "DIR":
        changes["reward_model_name"] = str(tmp_path)
    with pytest.raises(Exception, match=match) as info:
        PPOTrainer(tiny_test_config(**changes))
    assert type(info.value).__name__ == error


def test_launch_rejects_a_causal_lm_reward_model(old_run, causal_lm_dir, capsys, no_ray_address):
    before = snapshot(old_run)
    assert launch_ppo(old_run, "--reward_model_name", str(causal_lm_dir), "--reward_funcs", "[]",
                      "--reward_weights", "[]") == 2
    assert "Qwen3ForCausalLM checkpoint, not a sequence-classification reward model" in capsys.readouterr().err
    assert snapshot(old_run) == before


# --------------------------------------------------------------------------- 8. reward functions
def _texts_batch(n: int):
    from ppo_ray.batch import RolloutBatch

    return RolloutBatch(
        prompt_ids=torch.full((n, 2), 5), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.full((n, 3), 6), response_mask=torch.ones(n, 3, dtype=torch.bool),
        gen_logprobs=torch.zeros(n, 3), adapter_version=0, pad_token_id=0, eos_token_id=1,
        prompts=[f"p{i}" for i in range(n)], responses=[f"r{i}" for i in range(n)])


@pytest.mark.parametrize("fn,match", [
    ("reward_fns:raises", r"reward function 'reward_fns:raises' raised RuntimeError: this reward function always fails"),
    ("reward_fns:wrong_length", r"reward function 'reward_fns:wrong_length' returned 9 values for 8 prompts"),
    ("reward_fns:nan_at_two", r"reward source 'reward_fns:nan_at_two' gave non-finite score nan for prompt index 2"),
    ("reward_fns:not_numbers", r"reward function 'reward_fns:not_numbers' must return a list of 8 numbers"),
])
def test_bad_reward_functions_without_ray(fn, match):
    from actors.reward import RewardScorer
    from ppo_ray.rewards import RewardError

    with pytest.raises(RewardError, match=match):
        RewardScorer(None, [fn]).score(_texts_batch(8))


# --------------------------------------------------------------------------- 9. LoRA rank
def test_lora_rank_above_vllms_largest_is_refused():
    with pytest.raises(ConfigError, match=r"'lora_r' = 513 is invalid: must be <= 512.*\[1, 8, 16, 32, 64, 128, 256, 320, 512\]"):
        PPOConfig(lora_r=513)
    for r in (1, 4, 16, 100, 512):  # any rank up to 512: the generator rounds max_lora_rank up
        assert PPOConfig(lora_r=r).lora_r == r


def test_lora_rank_set_matches_vllm():
    """The copy in ppo_ray.config (the generator uses it too) equals vLLM's MaxLoRARanks,
    read from vllm/config/lora.py's source (importing vllm takes ~15 s here)."""
    spec = importlib.util.find_spec("vllm")
    source = Path(spec.origin).parent / "config" / "lora.py"
    tree = ast.parse(source.read_text())
    values = [ast.literal_eval(node.value.slice) for node in ast.walk(tree)
              if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MaxLoRARanks" for t in node.targets)]
    assert values, f"MaxLoRARanks not found in {source}"
    assert tuple(values[0]) == VLLM_LORA_RANKS


# --------------------------------------------------------------------------- 10. RAY_ADDRESS
def test_check_ray_address():
    from ppo_ray.placement import ClusterError, check_ray_address

    port = closed_port()
    with pytest.raises(ClusterError, match=rf"no Ray cluster at RAY_ADDRESS='127.0.0.1:{port}': cannot connect"):
        check_ray_address(f"127.0.0.1:{port}")
    with pytest.raises(ClusterError, match=rf"RAY_ADDRESS='ray://127.0.0.1:{port}': cannot connect to 127.0.0.1:{port}"):
        check_ray_address(f"ray://127.0.0.1:{port}")  # the Ray client's address
    with pytest.raises(ClusterError, match="no Ray cluster at RAY_ADDRESS='no-such-host.invalid:6379'"):
        check_ray_address("no-such-host.invalid:6379")
    with pytest.raises(ClusterError, match="is a dashboard / job-submission address"):
        check_ray_address("http://127.0.0.1:8265")
    for bad in ("127.0.0.1", "127.0.0.1:port"):
        with pytest.raises(ClusterError, match="is not a host:port address"):
            check_ray_address(bad)
    with socket.socket() as server:  # something listens: passes
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")


def test_init_ray_fails_fast_without_calling_ray_init(monkeypatch):
    """ray.init on a closed port retries for minutes (still waiting after 300 s here): init_ray
    must name the address without calling it."""
    import ray

    from ppo_ray import placement

    def no_init(*a, **k):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_init)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port()}")
    with pytest.raises(placement.ClusterError, match="no Ray cluster at RAY_ADDRESS"):
        placement.init_ray()


def test_launch_subprocess_ray_address_nowhere(tmp_path, old_run):
    port = closed_port()
    before = snapshot(old_run)
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    # timeout: a launch.py that fell through to ray.init would retry the address for minutes
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "ppo", "--config", str(TINY),
                           "--run_dir", str(old_run)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: no Ray cluster at RAY_ADDRESS='127.0.0.1:{port}'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert snapshot(old_run) == before
