"""PPOConfig: the seeds' fields and defaults, YAML + CLI loading, and clear errors; launch.py
refusing a bad config file, value or key before it writes anything (issue 5, items 1a, 2, 3,
9: no Ray, launch.py in-process except one subprocess run)."""

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import launch
from helpers import ROOT, launch_ppo, snapshot
from ppo_ray.config import (VLLM_LORA_RANKS, ConfigError, PPOConfig, field_docs, field_sections, fields_markdown,
                            parse_overrides)

SEED_DEFAULTS = dict(
    model_name="Qwen/Qwen3-0.6B-Base", lora_r=16, lora_alpha=32, lora_dropout=0.1,
    learning_rate=1e-5, value_learning_rate=1e-4, batch_size=32, max_new_tokens=10,
    gamma=0.99, lam=0.95, kl_coef=0.1, clip_epsilon=0.2, temperature=1.0, top_k=50, top_p=0.95,
)


def test_seed_fields_and_defaults():
    cfg = PPOConfig()
    for name, value in SEED_DEFAULTS.items():
        assert getattr(cfg, name) == value, name
        assert type(getattr(cfg, name)) is type(value), name


def test_keyword_override():
    assert PPOConfig(kl_coef=0.05).kl_coef == 0.05


@pytest.mark.parametrize("field,value", [
    ("gamma", 1.5), ("gamma", -0.1), ("lam", 2.0), ("lam", -1.0), ("clip_epsilon", 0.0),
    ("kl_coef", -0.01), ("temperature", 0.0), ("top_p", 0.0), ("top_p", 1.01),
    ("batch_size", 0), ("lora_r", 0), ("max_new_tokens", 0), ("ppo_epochs", 0),
    ("lora_dropout", 1.0), ("kl_estimator", "k4"), ("learning_rate", 0.0),
    ("mini_batch_size", 5), ("dtype", "int8"), ("top_k", -3), ("stage_micro_batch_size", 0),
    ("metrics_report_interval_ms", 999),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        PPOConfig(**{field: value})


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match="'batch_size'"):
        PPOConfig(batch_size="many")
    with pytest.raises(ConfigError, match="'gamma'"):
        PPOConfig.from_args(["--gamma", "abc"])


def test_yaml_then_cli_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kl_coef: 0.2\nbatch_size: 8\nvalue_clip: null\nreward_funcs: [a.b:c]\n")
    cfg = PPOConfig.from_yaml(path)
    assert (cfg.kl_coef, cfg.batch_size, cfg.value_clip, cfg.reward_funcs) == (0.2, 8, None, ["a.b:c"])
    cfg, pos = parse_overrides(["ppo", "--config", str(path), "--kl_coef", "0.05", "--top_k=0"])
    assert (cfg.kl_coef, cfg.batch_size, cfg.top_k, pos) == (0.05, 8, 0, ["ppo"])


def test_round_trip(tmp_path):
    cfg = PPOConfig(kl_coef=0.03, reward_funcs=["m:f"], value_clip=None)
    cfg.to_yaml(tmp_path / "c.yaml")
    assert PPOConfig.from_yaml(tmp_path / "c.yaml") == cfg


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"--kl_coeff; did you mean --kl_coef\?"):
        PPOConfig.from_args(["--kl_coeff", "0.1"])
    path = tmp_path / "c.yaml"
    path.write_text("learning_rat: 1e-5\n")
    with pytest.raises(ConfigError, match=r"c.yaml.*learning_rat; did you mean learning_rate"):
        PPOConfig.from_yaml(path)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        PPOConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kl_coef: [0.1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        PPOConfig.from_yaml(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        PPOConfig.from_yaml(lst)


def test_reward_specs_validated():
    with pytest.raises(ConfigError, match="reward_funcs"):
        PPOConfig(reward_funcs=["not a spec"])
    with pytest.raises(ConfigError, match="reward_weights"):
        PPOConfig(reward_funcs=["m:f"], reward_weights=[1.0, 2.0])


@pytest.mark.parametrize("changes,field", [
    (dict(sft_dataset="data/sft.jsonl", preference_dataset="data/p_{split}.jsonl"), "sft_dataset"),
    (dict(sft_dataset="data/sft_{split}.jsonl", preference_dataset="prefs.parquet"), "preference_dataset"),
    (dict(sft_dataset="org/sft"), "preference_dataset"),  # one task: both named or both bundled
    (dict(preference_dataset="org/prefs"), "preference_dataset"),
    (dict(sft_dataset=" "), "sft_dataset"),
    (dict(eval_split="train"), "eval_split"),
    (dict(data_max_rows=0), "data_max_rows"),
    (dict(stage_dtype="int8"), "stage_dtype"),
])
def test_data_source_fields_validated(changes, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        PPOConfig(**changes)


def test_data_source_fields_accept_hub_ids_folders_and_split_paths():
    cfg = PPOConfig(sft_dataset="org/sft", preference_dataset="data/prefs_{split}.parquet",
                    preference_config="null", data_max_rows="100", stage_dtype="float32")
    assert not cfg.uses_bundled_data
    assert (cfg.preference_config, cfg.data_max_rows, cfg.stage_dtype) == (None, 100, "float32")
    assert PPOConfig().uses_bundled_data


@pytest.mark.parametrize("field,value", [
    ("lora_r", 513), ("missing_eos_penalty", float("inf")), ("dataset", " "), ("prompt_column", ""),
])
def test_range_checks_of_issue_5(field, value):
    """lora_r above vLLM's largest max_lora_rank (the generator could not serve it), a
    non-finite missing-EOS score, an empty dataset / prompt column name."""
    with pytest.raises(ConfigError, match=f"'{field}'"):
        PPOConfig(**{field: value})
    PPOConfig(lora_r=512, missing_eos_penalty=-1.0)  # the limits themselves are fine


def test_placement_fields(tmp_path):
    """Issue 7: the placement strategy, per-role custom resources (mappings from YAML and
    from the CLI as JSON or a YAML flow mapping) and the placement timeout."""
    cfg = PPOConfig()
    assert (cfg.placement_strategy, cfg.generator_resources, cfg.learner_resources, cfg.scorer_resources,
            cfg.placement_timeout_s) == ("PACK", {}, {}, {}, 60.0)
    path = tmp_path / "c.yaml"
    path.write_text("placement_strategy: SPREAD\ngenerator_resources: {gpu_node: 0.01}\n")
    cfg, _ = parse_overrides(["--config", str(path), "--learner_resources", '{"cpu_node": 1}',
                              "--scorer_resources={cpu_node: 0.5}", "--placement_timeout_s", "5"])
    assert cfg.placement_strategy == "SPREAD" and cfg.generator_resources == {"gpu_node": 0.01}
    assert cfg.learner_resources == {"cpu_node": 1.0} and type(cfg.learner_resources["cpu_node"]) is float
    assert cfg.scorer_resources == {"cpu_node": 0.5} and cfg.placement_timeout_s == 5.0
    cfg.to_yaml(tmp_path / "round.yaml")
    assert PPOConfig.from_yaml(tmp_path / "round.yaml") == cfg
    for changes, match in [
        (dict(placement_strategy="pack"), "'placement_strategy'"),
        (dict(generator_resources={"GPU": 1}), "'generator_resources'.*use the \\*_num_cpus"),
        (dict(learner_resources={"x": 0}), "'learner_resources'.*>= 0.0001"),
        (dict(scorer_resources={"x": float("inf")}), "'scorer_resources'"),
        (dict(scorer_resources="x=1"), "'scorer_resources' = 'x=1' must be a mapping"),
        (dict(generator_resources={"x": "many"}), "'generator_resources'"),
        (dict(placement_timeout_s=0), "'placement_timeout_s'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            PPOConfig(**changes)


def test_cpu_rule_fits_the_machine():
    """Issue 33: a CPU-only run reserves no CPU for its actors and gives each phase the node's
    cores (the generator and the learner all of them, the two scorers, which run together,
    half each; under max_staleness >= 1 the generator and the learners share them); with a GPU, or an explicit reservation,
    Ray's rule (threads = the CPUs reserved) as before."""
    cfg = PPOConfig()
    assert not cfg.uses_gpus and cfg.generator_num_cpus is None and cfg.learner_num_cpus is None
    assert [cfg.num_cpus(r) for r in ("generator", "learner", "reference", "reward")] == [0.0] * 4
    assert [cfg.cpu_share(r) for r in ("generator", "learner", "reference", "reward", "stage")] == [1, 1, 2, 2, 1]
    assert cfg.stage_demand[0] == 0.0
    overlap = cfg.replace(max_staleness=1, num_learners=2)
    assert [overlap.cpu_share(r) for r in ("generator", "learner", "reference", "stage")] == [2, 4, 4, 1]
    assert cfg.replace(generator_num_cpus=1).cpu_share("generator") == 0
    gpu = cfg.replace(learner_num_gpus=0.5, generator_num_gpus=0.5)
    assert gpu.uses_gpus and [gpu.num_cpus(r) for r in ("generator", "learner", "reference")] == [1.0, 1.0, 0.0]
    assert [gpu.cpu_share(r) for r in ("generator", "learner", "reference", "stage")] == [0, 0, 0, 0]
    assert cfg.replace(stage_num_gpus=1.0).uses_gpus
    explicit = cfg.replace(learner_num_cpus=2, scorer_torch_threads=1)
    assert explicit.num_cpus("learner") == 2.0 and explicit.stage_demand[0] == 2.0
    assert [explicit.cpu_share(r) for r in ("learner", "reference", "stage")] == [0, 0, 0]
    assert cfg.replace(scorer_num_cpus=1).cpu_share("reward") == 0
    with pytest.raises(ConfigError, match="'learner_num_cpus'.*>= 0 or null"):
        PPOConfig(learner_num_cpus=-1)


def test_cpu_malloc_keep_sets_the_actors_malloc_on_a_cpu_only_run(monkeypatch):
    """cpu_malloc_keep: glibc malloc's settings in every CPU-only actor's and stage task's
    environment, beside the CPU rule's variable; none when off or with a GPU; a value in the
    driver's environment wins."""
    from ppo_ray.driver.hosts import CPU_SHARE_ENV, MALLOC_ENV, cpu_share_env

    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    cfg = PPOConfig()
    assert cfg.cpu_malloc_keep
    for role in ("generator", "learner", "reference", "reward", "stage"):
        assert cpu_share_env(cfg, role) == {CPU_SHARE_ENV: str(cfg.cpu_share(role)), **MALLOC_ENV}
    assert cpu_share_env(cfg.replace(cpu_malloc_keep=False), "learner") == {CPU_SHARE_ENV: "1"}
    assert cpu_share_env(cfg.replace(learner_num_gpus=1.0), "learner") == {}
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    assert cpu_share_env(cfg, "learner")["MALLOC_TRIM_THRESHOLD_"] == "12345"


def test_lora_sync_auto_merges_on_the_cpu():
    """Issue 33: lora_sync auto = merged for a CPU generator (vLLM's CPU LoRA path is the slow
    one), adapter for a GPU generator; an explicit mode is kept."""
    assert PPOConfig().lora_sync == "auto" and PPOConfig().lora_sync_mode == "merged"
    assert PPOConfig(generator_num_gpus=0.5).lora_sync_mode == "adapter"
    assert PPOConfig(lora_sync="adapter").lora_sync_mode == "adapter"
    assert PPOConfig(generator_num_gpus=1, lora_sync="merged").lora_sync_mode == "merged"
    with pytest.raises(ConfigError, match="'lora_sync'"):
        PPOConfig(lora_sync="both")


def test_max_staleness_replaces_overlap_generation(tmp_path):
    """max_staleness is the one knob: overlap_generation (a config file's, a checkpoint's, a
    replace()'s) still loads as max_staleness 0 or 1, and both given and disagreeing is an
    error naming both; merged sync, which holds one adapter version, refuses 2 or more, and
    auto picks tensor on the CPU there; the range is checked."""
    assert PPOConfig().max_staleness == 0
    assert PPOConfig.from_dict({"overlap_generation": True}).max_staleness == 1
    assert PPOConfig.from_dict({"overlap_generation": False}).max_staleness == 0
    assert PPOConfig().replace(overlap_generation=True).max_staleness == 1
    path = tmp_path / "old.yaml"
    path.write_text("overlap_generation: true\n")
    assert PPOConfig.from_yaml(path).max_staleness == 1
    assert PPOConfig.from_yaml(path, max_staleness=1).max_staleness == 1
    with pytest.raises(ConfigError, match=r"overlap_generation \(now max_staleness\) says max_staleness = 1, but "
                                          r"max_staleness = 2"):
        PPOConfig.from_yaml(path, max_staleness=2, lora_sync="tensor")
    with pytest.raises(ConfigError, match="unknown config key --overlap_generation; it was renamed --max_staleness"):
        PPOConfig.from_args(["--overlap_generation", "true"])
    assert PPOConfig(max_staleness=1).lora_sync_mode == "merged"
    assert PPOConfig(max_staleness=2).lora_sync_mode == "tensor"
    assert PPOConfig(max_staleness=2, generator_num_gpus=1).lora_sync_mode == "adapter"
    with pytest.raises(ConfigError, match="'max_staleness' = 2 is invalid: needs lora_sync adapter or tensor"):
        PPOConfig(max_staleness=2, lora_sync="merged")
    for bad in (-1, 9):
        with pytest.raises(ConfigError, match="'max_staleness'"):
            PPOConfig(max_staleness=bad)
    # partial rollouts go on with versions newer than the batch's: there are some from k = 2
    assert PPOConfig(max_staleness=2, partial_rollout="continue").partial_rollout_tokens == 32
    with pytest.raises(ConfigError, match="'partial_rollout' = 'continue' is invalid: continue needs max_staleness >= 2"):
        PPOConfig(max_staleness=1, partial_rollout="continue")
    with pytest.raises(ConfigError, match="'partial_rollout_tokens'"):
        PPOConfig(max_staleness=2, partial_rollout="continue", partial_rollout_tokens=0)


def test_cli_syntaxes():
    """--field value, --field=value, --field-name, YAML values (null, comma lists, flow
    mappings, bools), positionals anywhere."""
    cfg, pos = parse_overrides(["--kl-coef=0.05", "ppo", "--value-clip", "null", "--reward_funcs", "a:f,b:g",
                                "--generator_resources", "{gpu_node: 0.01}", "--whiten_rewards", "true",
                                "--missing_eos_penalty", "-1", "--top_k=-1", "--steps", "3"])
    assert (cfg.kl_coef, cfg.value_clip, cfg.reward_funcs, cfg.generator_resources) == (
        0.05, None, ["a:f", "b:g"], {"gpu_node": 0.01})
    assert (cfg.whiten_rewards, cfg.missing_eos_penalty, cfg.top_k, cfg.steps, pos) == (True, -1.0, -1, 3, ["ppo"])


@pytest.mark.parametrize("argv,match", [
    (["--kl_coef"], r"^command-line option --kl_coef needs a value$"),
    (["--steps", "--kl_coef", "0.1"], r"^command-line option --steps needs a value$"),
    (["--generator_resources", "{gpu_node: 0.01"], r"^command-line option --generator_resources: '\{gpu_node"),
    (["--kl", "0.1"], r"^command line: unknown config key --kl$"),  # no abbreviations
    (["--kl-coeff=0.1"], r"unknown config key --kl_coeff; did you mean --kl_coef\?"),
    (["--steps", "two"], r"^config field 'steps' = 'two' must be of type int$"),
])
def test_cli_errors_name_the_option(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_overrides(argv)


def test_every_field_has_one_section_and_a_doc():
    sections = field_sections()  # raises when a field has no section, or two
    assert sum(len(fields) for _, fields in sections) == len(PPOConfig.field_names())
    assert 8 <= len(sections) <= 12
    docs = field_docs()
    assert set(docs) == set(PPOConfig.field_names()) and all(doc.strip() for doc in docs.values())
    assert docs["kl_coef"].startswith("beta: weight of the per-token KL penalty")


def test_field_docs_carry_no_history():
    """A field's doc says what the field does and when to use it: no dates or issue numbers,
    no speed-ups or seconds of one run (a measurement is cited by its RESULTS.md section's title)."""
    told = re.compile(r"\bissue \d+|\b20\d\d-\d\d-\d\d\b|\b\d+(?:\.\d+)?x (?:faster|slower)\b|\bafter \d+ s\b"
                      r"|\btook \d+(?:\.\d+)? (?:s|minutes)\b|\b\d\.\d+x on\b", re.IGNORECASE)
    dated = {name: m.group(0) for name, doc in field_docs().items() for m in [told.search(doc)] if m}
    assert dated == {}, dated


def test_the_package_exports_the_names_of_the_one_module_it_was():
    """ppo_ray.config is a package (knobs, fields, cli, docs); every name the single module had is
    still imported from ppo_ray.config, and __all__ lists only names that exist."""
    import ppo_ray.config as package

    before = {"ALL_PROJECTIONS", "DTYPE_NAMES", "TRUNCATION_MODES", "LORA_SYNC_MODES", "LOGPROB_GAP_TOLERANCE",
              "DATA_FILE_SUFFIXES", "TINY_MODEL", "PRESETS_DIR", "VLLM_LORA_RANKS", "MIN_TEMPERATURE", "MAX_STALENESS",
              "RENAMED", "REPORT_TO", "LOG_LEVELS", "ConfigError", "MODEL", "ALGORITHM", "GENERATION", "REWARDS",
              "DATA", "STAGES", "EVALUATION", "RESOURCES", "FAULTS", "LOGGING", "SPEED", "SECTIONS", "LEARNER",
              "GENERATOR", "REFERENCE", "REWARD", "ROLES", "fresh", "knob", "at_least", "within", "not_empty",
              "custom_resources", "one_split_per_file", "PPOConfig", "ConfigSlice", "preset_names", "resolve_config",
              "read_yaml", "field_docs", "field_sections", "fields_where", "role_fields", "MUST_MATCH", "PATH_FIELDS",
              "MODEL_FIELDS", "GPU_FIELDS", "type_name", "default_text", "fields_markdown", "CONFIG_DOCS_MARKERS",
              "write_config_docs", "ConfigParser", "parse_overrides", "selection_reads", "ignored_knobs"}
    assert before <= set(package.__all__) and all(hasattr(package, name) for name in package.__all__)
    assert package.PRESETS_DIR == ROOT / "ppo_ray" / "configs" and package.preset_names()


def test_validate_holds_only_rules_that_relate_fields():
    """A rule on one field's own value lives at the field (knob's check: at_least, within, ...);
    PPOConfig._validate keeps the rules that read two fields or more. Each need(...) there must
    read, in its condition and the field it names, a second field or a local derived from them."""
    import inspect
    import textwrap

    from ppo_ray.config import PPOConfig as cls
    single = []
    for method in (cls._validate, cls._validate_data_sources):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(method)))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "need"):
                continue
            condition, named = node.args[0], node.args[1]
            if not isinstance(named, ast.Constant):  # need(False, name, ...): the loop over ignored knobs
                continue
            fields = {n.attr for n in ast.walk(condition) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id == "self"} | {named.value}
            local = {n.id for n in ast.walk(condition) if isinstance(n, ast.Name)} - {"self", "len", "all", "math"}
            if len(fields) == 1 and not local:
                single.append(f"{method.__name__}:{node.lineno}: {ast.unparse(condition)}")
    assert single == [], f"single-field checks belong in knob(check=...): {single}"


# A sentence ends at . ! or ? (and any closing quote or bracket) before white space, except
# after an abbreviation; a decimal point (0.95) or a path (launch.py) has no space after it.
SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)")
ABBREVIATION = re.compile(r"\b(?:e\.g|i\.e|et al|Dr|vs|cf|etc|eq|sec)\.$")
MAX_DOC_CHARS = 300


def sentences(text: str) -> list[str]:
    """`text` cut into sentences by SENTENCE_END, ignoring the ends of ABBREVIATIONs."""
    out, start = [], 0
    for end in SENTENCE_END.finditer(text):
        if not ABBREVIATION.search(text[start:end.start() + 1]):
            out.append(text[start:end.end()].strip())
            start = end.end()
    return out + ([text[start:].strip()] if text[start:].strip() else [])


def test_the_sentence_rule():
    assert sentences("One (e.g. this, Dr. GRPO's, Yu et al. 2025, eq. 13). Two: 0.95, launch.py.") == [
        "One (e.g. this, Dr. GRPO's, Yu et al. 2025, eq. 13).", "Two: 0.95, launch.py."]
    assert sentences('A (b.) c. "D." e? f') == ["A (b.)", "c.", '"D."', "e?", "f"]


def test_field_docs_are_at_most_two_sentences():
    """A field's doc is its --help line (CleanRL's one line per flag): what it does, its unit and
    what special values mean, in at most two sentences and MAX_DOC_CHARS characters. The
    reasoning, measurements and caveats are in docs/, which the doc may point at as
    (docs/FILE.md, "Heading"): the file must have that heading (or a bold lead of that name)."""
    long = {name: (len(doc), len(sentences(doc))) for name, doc in field_docs().items()
            if len(doc) > MAX_DOC_CHARS or len(sentences(doc)) > 2}
    assert long == {}, f"field docs over {MAX_DOC_CHARS} characters or 2 sentences (chars, sentences): {long}"
    broken = []
    for name, doc in field_docs().items():
        for path, title in re.findall(r'(docs/\w+\.md), "([^"]+)"', doc):
            text = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
            if not (re.search(rf"^#+ {re.escape(title)}$", text, re.M) or f"**{title}" in text):
                broken.append(f"{name}: {path}, {title!r}")
    assert broken == [], f"field docs point at headings that do not exist: {broken}"


def test_docs_list_every_field_by_section():
    """docs/CONFIG.md's tables (linked from README.md's Configuration) are fields_markdown()'s
    output (the fields' own docs)."""
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "CONFIG.md").read_text()
    block = text.split("<!-- config-fields: begin -->\n", 1)[1].split("<!-- config-fields: end -->", 1)[0]
    assert block.strip() == fields_markdown().strip(), (
        "docs/CONFIG.md's field tables are stale: rewrite them with "
        "python -c 'from ppo_ray.config import write_config_docs; write_config_docs()'")
    assert "(docs/CONFIG.md)" in (root / "README.md").read_text(), "README.md no longer links docs/CONFIG.md"


def test_config_slice():
    """An actor's part of the config: its fields, PPOConfig's derived values over them,
    read-only, picklable; any other field is an error naming it and the slice."""
    import pickle

    part = PPOConfig(batch_size=8, mini_batch_size=4).slice("learner", ("batch_size", "mini_batch_size", "lora_r"))
    assert (part.batch_size, part.effective_mini_batch_size) == (8, 4)
    assert pickle.loads(pickle.dumps(part)) == part
    with pytest.raises(AttributeError, match="'gamma' is not in the learner actor's config slice"):
        part.gamma
    with pytest.raises(AttributeError, match="'lora_alpha' is not in the learner"):  # lora_scaling needs it
        part.lora_scaling
    with pytest.raises(AttributeError, match="read-only"):
        part.batch_size = 2
    with pytest.raises(ConfigError, match="did you mean kl_coef"):
        PPOConfig().slice("x", ("kl_coeff",))


def _config_reads(cls) -> set[str]:
    """The names read as cfg.X / config.X / self.config.X in a class's source."""
    import ast
    import inspect
    import textwrap

    reads = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("cfg", "config")) or (
                    isinstance(owner, ast.Attribute) and owner.attr == "config"
                    and isinstance(owner.value, ast.Name) and owner.value.id == "self"):
                reads.add(node.attr)
    return reads


def test_each_role_declares_the_config_fields_it_reads():
    from actors.generator import Generator
    from actors.reference import ReferenceScorer
    from actors.reward import RewardScorer
    from learner.learner import Learner
    from ppo_ray.driver.hosts import GeneratorHost, LearnerHost, ReferenceHost, RewardHost

    derived = {name for name, value in vars(PPOConfig).items() if isinstance(value, property)}
    for host, cls in ((GeneratorHost, Generator), (LearnerHost, Learner), (ReferenceHost, ReferenceScorer),
                      (RewardHost, RewardScorer)):
        fields = set(cls.CONFIG_FIELDS)
        assert fields <= set(PPOConfig.field_names()), cls
        assert _config_reads(host) | _config_reads(cls) <= fields | derived, cls


# -------------------------------------------------- launch.py with a bad config file (issue 5, item 1a)
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


# -------------------------------------------------- launch.py with a bad value or key (issue 5, items 2, 3)
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


# -------------------------------------------------- LoRA rank vLLM can serve (issue 5, item 9)
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


# ---------------------------------------------------------------------- knobs a selection ignores (issue 55, item 7)
# A valid value other than the default for every knob a registration declares it reads (a new one
# must be added here: the first test names it).
AWAY_FROM_DEFAULT = {
    "clip_epsilon": 0.1, "clip_epsilon_high": 0.28, "dual_clip": 3.0, "gspo_clip_epsilon": 3e-4,
    "gspo_clip_epsilon_high": 5e-4, "cispo_epsilon_high": 4.0, "cispo_epsilon_low": 0.5, "grpo_norm_std": False,
    "gamma": 1.0, "lam": 0.9, "whiten_rewards": True, "reward_shaping": "every_token", "whiten_advantages": False,
    "value_learning_rate": 3e-4, "value_clip": None, "vf_coef": 0.2, "value_model": "shared",
    "value_model_name": "some/value-model", "old_values": "forward", "loss_agg_tokens": 8,
}


def selection_cases():
    """(selector, choice, the config that selects it, the knobs it reads, every knob of its selector)."""
    from ppo_ray.config import selection_reads

    for selector, reads in selection_reads().items():
        for choice, knobs in reads.items():
            base = {selector: choice}
            if selector == "advantage_estimator" and choice != "gae":
                base["samples_per_prompt"] = 2  # the group baselines compare samples of one prompt
            yield selector, choice, base, knobs, frozenset().union(*reads.values())


def test_every_knob_a_selection_does_not_read_is_refused_and_every_one_it_reads_is_taken():
    """policy_loss, advantage_estimator and loss_agg: each choice declares the shared knobs it
    reads (its registration's reads and own parameters); any other knob of its selector, set
    away from its default, is a ConfigError naming the knob, the selection and who reads it
    (gspo with clip_epsilon_high or dual_clip, cispo with clip_epsilon, loss_agg_tokens without
    token_sum_norm, grpo with gamma or a value-model knob), and at its default it is accepted."""
    cases = list(selection_cases())
    assert {k for *_, every in cases for k in every} == set(AWAY_FROM_DEFAULT), "AWAY_FROM_DEFAULT is out of date"
    for selector, choice, base, knobs, every in cases:
        PPOConfig(**base)
        for name in sorted(every):
            value = AWAY_FROM_DEFAULT[name]
            if name in knobs:
                assert getattr(PPOConfig(**base, **{name: value}), name) == value, (choice, name)
                continue
            readers = r"\w+(, \w+)*"
            with pytest.raises(ConfigError, match=rf"'{name}' = {re.escape(repr(value))} is invalid: {selector} "
                                                  rf"'{choice}' does not read it \(read by {readers}\): leave it at "
                                                  r"its default"):
                PPOConfig(**base, **{name: value})
    # the reviewer's cases, by name
    for kw, knob, selection in ((dict(policy_loss="gspo", clip_epsilon_high=0.28), "clip_epsilon_high", "gspo"),
                                (dict(policy_loss="cispo", dual_clip=3.0), "dual_clip", "cispo"),
                                (dict(policy_loss="gspo", clip_epsilon=0.1), "clip_epsilon", "gspo"),
                                (dict(loss_agg_tokens=64), "loss_agg_tokens", "token_mean")):
        with pytest.raises(ConfigError, match=rf"'{knob}' = .* is invalid: \w+ '{selection}' does not read it"):
            PPOConfig(**kw)


def test_a_selection_switched_over_a_file_leaves_the_files_knobs_behind(tmp_path, caplog):
    """The tiny preset sets gamma and value_learning_rate for gae (its estimator): selecting grpo
    on top of it puts them back at their defaults, each with a warning, instead of refusing the
    preset; the same knobs given with the selection (an override, or in one file) are refused;
    replace() leaves a switched selection's knobs behind the same way."""
    grpo = dict(advantage_estimator="grpo", samples_per_prompt=2)
    with caplog.at_level("WARNING", logger="ppo_ray.config"):
        config = PPOConfig.from_yaml("tiny", **grpo)
    assert (config.gamma, config.value_learning_rate) == (0.99, 1e-4)
    assert "tiny.yaml: gamma = 1.0 goes back to its default (0.99): advantage_estimator 'grpo' does not read it" \
        in caplog.text and "value_learning_rate = 0.003 goes back" in caplog.text
    assert PPOConfig.from_yaml("tiny").gamma == 1.0  # gae reads it
    with pytest.raises(ConfigError, match="'gamma' = 1.0 is invalid: advantage_estimator 'grpo' does not read it"):
        PPOConfig.from_yaml("tiny", **grpo, gamma=1.0)
    with pytest.raises(ConfigError, match="'gamma' = 0.9 is invalid"):
        PPOConfig.from_args(["--config", "tiny", "--advantage_estimator", "grpo", "--samples_per_prompt", "2",
                             "--gamma", "0.9"])
    own = tmp_path / "gspo.yaml"
    own.write_text("policy_loss: gspo\nclip_epsilon_high: 0.28\n")
    with pytest.raises(ConfigError, match="'clip_epsilon_high' = 0.28 is invalid: policy_loss 'gspo' does not read"):
        PPOConfig.from_yaml(own)
    dapo = PPOConfig(clip_epsilon_high=0.28, dual_clip=3.0)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ppo_ray.config"):
        gspo = dapo.replace(policy_loss="gspo")
    assert (gspo.clip_epsilon_high, gspo.dual_clip) == (None, None) and "replace(): dual_clip = 3.0" in caplog.text
    with pytest.raises(ConfigError, match="'dual_clip' = 4.0 is invalid: policy_loss 'gspo' does not read it"):
        dapo.replace(policy_loss="gspo", dual_clip=4.0)


def test_a_saved_config_whose_run_ignored_knobs_still_loads(tmp_path, caplog):
    """A run before issue 55 could save knobs its selections ignored (a grpo run on the main job's
    preset saved gamma 1.0 and value_learning_rate 3e-4). Its config.yaml is refused as a
    config file, and loads where a saved config is read (PPOConfig.from_saved: a resume, eval,
    export), the ignored knobs at their defaults (the run never read them), with a warning."""
    from ppo_ray.driver.checkpoint import resumed_config

    old = PPOConfig.from_yaml("tldr-tiny").to_dict()
    old.update(advantage_estimator="grpo", samples_per_prompt=4)  # what the old config check let through
    ckpt = tmp_path / "run" / "checkpoints" / "step-000010"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    with pytest.raises(ConfigError, match="'gamma' = 1.0 is invalid: advantage_estimator 'grpo' does not read it"):
        PPOConfig.from_yaml(ckpt / "config.yaml")
    with caplog.at_level("WARNING", logger="ppo_ray.config"):
        saved = resumed_config(ckpt, tmp_path / "run", {"steps": 40})
    assert (saved.advantage_estimator, saved.gamma, saved.value_learning_rate, saved.steps) == ("grpo", 0.99, 1e-4, 40)
    assert saved.lam == 0.95 and "value_learning_rate = 0.0003 goes back to its default (0.0001)" in caplog.text


@pytest.mark.parametrize("base", ["tldr-tiny", "arith-tiny"])
def test_the_estimator_comparisons_runs_are_valid_configs(base):
    """benchmarks.compare_estimators' runs in benchmarks/RESULTS.md (the main job's estimators and
    the verifiable task's five methods, GSPO with the paper's bounds too) on their bases'
    presets: each is a config the check takes, the base's knobs for another selection left
    behind (the main job's gamma and value_learning_rate under a critic-free estimator)."""
    from benchmarks import compare_estimators as ce
    from ppo_ray.config import ConfigParser

    runs = {"tldr-tiny": ["gae", "grpo:n=8", "rloo:n=2", "reinforce_pp:n=4", "grpo:n=4:kl=loss", "rloo:n=4:kl=loss",
                          "reinforce_pp:n=4:kl=loss"],
            "arith-tiny": ["grpo", "ppo-gae=gae:n=1:gamma=1:lam=0.95",
                           "dapo=grpo:clip_epsilon_high=0.28:dynamic_sampling=true:overlong_filter=true:"
                           "overlong_buffer=1:loss_agg=token_mean",
                           "gspo=grpo:policy_loss=gspo:loss_agg=seq_mean_token_mean",
                           "gspo-paper=grpo:policy_loss=gspo:loss_agg=seq_mean_token_mean:gspo_clip_epsilon=3e-4:"
                           "gspo_clip_epsilon_high=4e-4",
                           "cispo=grpo:policy_loss=cispo",
                           "dapo-k1=grpo:clip_epsilon_high=0.28:dynamic_sampling=true:overlong_filter=true:"
                           "overlong_buffer=1:loss_agg=token_mean:max_staleness=1:lora_sync=tensor"]}[base]
    common = ["ppo_epochs=2", "mini_batch_size=64", "micro_batch_size=64"] if base == "arith-tiny" else []
    for spec in runs:
        args = (ce.parse_run("x:" + ":".join(common))[2:] if common else []) + ce.parse_run(spec)
        _, overrides, _ = ConfigParser().parse(args)
        config = PPOConfig.from_yaml(base, **overrides)
        assert config.advantage_estimator == ce.estimator_of(spec), spec
