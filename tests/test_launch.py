"""End to end from the user's side: launch.py as a subprocess, and the README's example."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from exact import assert_same, rerun_if_last_digits_differ

ROOT = Path(__file__).resolve().parent.parent


def _start_until_checkpoint(cmd: list[str], cwd, env: dict, run_dir, meanwhile=None, **popen):
    """launch.py started in a subprocess, returned once its checkpoint of step 2 is the latest
    (the run still going). `meanwhile(proc)`, if given, runs once the run holds its run
    directory's lock (it takes it first, before Ray and the actors start)."""
    import time

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    if meanwhile is not None:
        deadline = time.monotonic() + 300
        while not (run_dir / ".ppo-ray.lock").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        meanwhile(proc)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step-000002":
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be stopped: " + proc.communicate()[1][-3000:]
    return proc


@pytest.mark.slow
def test_launch_ppo_interrupted_then_resumed(tmp_path):
    """launch.py ppo as a user runs it: one Ctrl-C (SIGINT) once a checkpoint exists, then
    `launch.py ppo --resume RUN_DIR` (the run's saved config) finishes the run; every step
    is in metrics.jsonl exactly once. launch.py starts with SIGINT ignored, as a shell without
    job control starts `launch.py &` (POSIX; a CI script): Python then installs no
    KeyboardInterrupt handler of its own, and before ppo_ray.driver.interrupts such a run ignored
    the Ctrl-C and finished all its steps (2026-11-28). One press: exit 130, the resume hint,
    and no process of the run left (Ray's included). Slow (~105 s: two launch.py processes,
    each starting Ray and a vLLM engine); the default run covers resume at the trainer level
    (tests/test_checkpoint.py: exact resume, actors killed mid-step)."""
    import signal
    import uuid

    from helpers import RUN_MARKER, tagged_processes, wait_for

    run_dir = tmp_path / "run"
    tag = uuid.uuid4().hex
    env = {**os.environ, "RAY_ADDRESS": ""}  # a local Ray of its own
    steps = 5
    cmd = [sys.executable, str(ROOT / "launch.py"), "ppo", "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--steps", str(steps), "--batch_size", "4", "--checkpoint_every", "1",
           "--run_dir", str(run_dir), "--vllm_kv_cache_gib", "0.25"]
    proc = _start_until_checkpoint(cmd, tmp_path, {**env, RUN_MARKER: tag}, run_dir,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    latest = run_dir / "checkpoints" / "latest"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert "interrupted: the last checkpoint is" in err and f"--resume {run_dir}" in err
    stopped_at = int(latest.read_text().strip().split("-")[1])
    assert 2 <= stopped_at < steps
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    wait_for(lambda: not tagged_processes(tag), 120, "exit of the run's processes")

    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "ppo", "--resume", str(run_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(rf"step {steps}/{steps}  reward [+-]\d", proc.stderr)  # the per-step log lines
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == steps
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, steps + 1))
    assert latest.read_text().strip() == f"step-{steps:06d}"
    assert "batch_size: 4" in (run_dir / "config-ppo.yaml").read_text()
    assert (run_dir / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_the_same_command_twice_continues_the_run(tmp_path):
    """A re-applied job (a RayJob applied again, a restarted pod): the same command, with
    --resume auto, is run twice and the first is killed hard (SIGKILL to its whole process
    group, Ray included, as a lost pod) once a checkpoint exists. The second continues from
    it: every step once in metrics.jsonl, the final checkpoint the run's last step, and the
    first run's checkpoints its ancestors (one lineage). Before --resume auto, re-applying
    started a fresh run over the old one. While the first runs, the same command again (a
    double submit) is refused at once, naming the holder of the run directory's lock; the
    killed driver's lock is taken over. Slow (~2 min: two launch.py processes)."""
    import signal

    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ""}
    cmd = [sys.executable, str(ROOT / "launch.py"), "ppo", "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--steps", "5", "--batch_size", "4", "--checkpoint_every", "1", "--keep_checkpoints", "10",
           "--run_dir", str(run_dir), "--vllm_kv_cache_gib", "0.25", "--resume", "auto"]
    def double_submit(first: subprocess.Popen) -> None:
        """The same command while the first driver lives: refused at once, naming it."""
        second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert second.returncode == 2 and "in use by another driver" in second.stderr, second.stderr[-3000:]
        assert f"pid {first.pid}" in second.stderr

    proc = _start_until_checkpoint(cmd, tmp_path, env, run_dir, meanwhile=double_submit, start_new_session=True)
    latest = run_dir / "checkpoints" / "latest"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    killed_at = int(latest.read_text().strip().split("-")[1])
    assert 2 <= killed_at < 5
    assert (run_dir / ".ppo-ray.lock").is_file()  # a killed driver cannot release its lock

    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "took over the run directory's lock" in proc.stderr and "no longer running" in proc.stderr
    assert not (run_dir / ".ppo-ray.lock").exists()  # released at the end
    assert "PPO resumes from" in proc.stderr and f"step-{killed_at:06d}" in proc.stderr
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5]
    from ppo_ray.driver.checkpoint import ancestry, resolve_checkpoint

    head = resolve_checkpoint(run_dir)
    assert head.name == "step-000005"
    assert [p.name for p in ancestry(head)] == [f"step-{s:06d}" for s in (5, 4, 3, 2, 1)]


def _launch(args: list, cwd, timeout: int = 900) -> subprocess.CompletedProcess:
    """launch.py as a user runs it, on a local Ray of its own; exit 0 asserted."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_a_resume_into_another_run_directory_is_refused_and_overwrite_forks_it(tmp_path):
    """Two runs of an lr sweep, A and B. `launch.py ppo --resume A/checkpoints/step-000001
    --run_dir B` used to truncate B's metrics, move its checkpoints aside and overwrite its
    adapter and report: now it stops before touching B. With --overwrite, B's run is moved
    aside (never deleted) and A's checkpoint continues in B; A is not touched by either. Slow
    (~3 min: three launch.py runs of the tiny preset)."""
    from helpers import snapshot
    from ppo_ray.driver.checkpoint import read_meta, resolve_checkpoint

    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--config", ROOT / "configs" / "tiny.yaml", "--steps", 1, "--batch_size", 4,
              "--vllm_kv_cache_gib", 0.25]
    _launch(["ppo", *common, "--run_dir", a], tmp_path)
    _launch(["ppo", *common, "--run_dir", b, "--learning_rate", 1e-3], tmp_path)
    before_a, before_b = snapshot(a), snapshot(b)
    ckpt = a / "checkpoints" / "step-000001"
    env = {**os.environ, "RAY_ADDRESS": ""}
    refused = subprocess.run([sys.executable, str(ROOT / "launch.py"), "ppo", "--resume", str(ckpt), "--run_dir",
                              str(b), "--steps", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"not in the run directory {b}" in refused.stderr and "--overwrite" in refused.stderr
    assert snapshot(b) == before_b and snapshot(a) == before_a

    _launch(["ppo", "--resume", ckpt, "--run_dir", b, "--steps", 2, "--overwrite"], tmp_path)
    assert snapshot(a) == before_a  # the run it continued from: untouched
    [old_b] = (b / "replaced").iterdir()  # B's own run, whole
    assert {p.relative_to(old_b).as_posix() for p in old_b.rglob("*") if p.is_file()} >= \
        {"metrics.jsonl", "checkpoints/step-000001/trainer.json", "adapter/adapter_model.safetensors"}
    assert [json.loads(x)["step"] for x in (b / "metrics.jsonl").read_text().splitlines()] == [2]
    head = resolve_checkpoint(b)
    assert head.name == "step-000002" and read_meta(head)["run_id"] == read_meta(ckpt)["run_id"]
    assert read_meta(head)["parent_id"] == read_meta(ckpt)["checkpoint_id"]


@pytest.mark.slow
@pytest.mark.matrix  # the other resume through a new model (another run directory) stays in CI
def test_overwriting_sft_leaves_nothing_to_resume_onto_the_new_model(tmp_path):
    """A finished `all` run, then `launch.py sft --overwrite` with another SFT learning rate:
    `--resume auto` used to say "sft, rm finished; PPO resumes from step-N" and load the old
    policy adapter, value head and Adam state onto the new SFT model. Now the overwrite moves
    rm/ and the PPO run aside with the old SFT, and --resume auto trains the reward model and
    PPO again; the new checkpoint records the new SFT's digest. Slow (~4 min)."""
    from ppo_ray.driver.checkpoint import model_fingerprint, read_meta, resolve_checkpoint

    run = tmp_path / "run"
    short = ["--steps", 1, "--sft_epochs", 1, "--rm_epochs", 1, "--eval_size", 4, "--eval_samples", 4,
             "--vllm_kv_cache_gib", 0.25, "--data_max_rows", 64]
    _launch(["--run_dir", run, *short], tmp_path)
    old_sft = model_fingerprint(str(run / "sft"))
    assert read_meta(resolve_checkpoint(run))["fingerprints"]["model_name"] == old_sft
    _launch(["sft", "--run_dir", run, "--overwrite", "--sft_epochs", 1, "--data_max_rows", 64,
             "--sft_learning_rate", 1e-4], tmp_path)
    assert not (run / "rm").exists() and not (run / "checkpoints").exists()
    [moved] = (run / "replaced").iterdir()
    assert {p.name for p in moved.iterdir()} >= {"sft", "rm", "checkpoints", "metrics.jsonl", "report.json"}
    new_sft = model_fingerprint(str(run / "sft"))
    assert new_sft != old_sft

    proc = _launch(["--run_dir", run, "--resume", "auto", *short], tmp_path)
    assert "PPO resumes from" not in proc.stderr and "sft finished" in proc.stderr, proc.stderr[-3000:]
    assert read_meta(resolve_checkpoint(run))["fingerprints"]["model_name"] == new_sft
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.slow
@rerun_if_last_digits_differ
def test_a_reward_actor_killed_in_the_evaluation_leaves_the_run_as_a_straight_one(tmp_path):
    """launch.py ppo on the tiny preset, as a user runs it (issue 43's report: kill -9 of the
    reward actor in the in-run evaluation ended the run with ActorUnavailableError). A test
    reward function holds the evaluation's first scoring call (4 rows; a step scores 8) and
    names its process; the test SIGKILLs it there. The run recovers (the evaluation is redone
    by the restarted actor) and its metrics.jsonl and eval_samples.jsonl equal a straight
    run's, every number but the wall-clock ones (float32 on the CPU is deterministic).
    Slow (~3 min: two launch.py processes)."""
    import signal

    from helpers import TESTS_DIR, wait_for
    from reward_fns import EVAL_MARKER_ENV, EVAL_PID_FILE, EVAL_ROWS_ENV

    env = {**os.environ, "RAY_ADDRESS": "",  # a local Ray of its own, whose workers import tests/reward_fns.py
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}

    def launch(run_dir, extra_env):
        return subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "ppo", "--config", "tiny", "--run_dir", str(run_dir),
             "--steps", "4", "--eval_every", "2", "--eval_samples", "4", "--batch_size", "8",
             "--reward_funcs", "reward_fns:e_fraction_held_in_eval", "--vllm_kv_cache_gib", "0.25"],
            cwd=tmp_path, env={**env, **extra_env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    marker = tmp_path / "marker"
    marker.mkdir()
    proc = launch(tmp_path / "killed", {EVAL_MARKER_ENV: str(marker), EVAL_ROWS_ENV: "4"})
    try:
        pid_file = marker / EVAL_PID_FILE
        wait_for(pid_file.is_file, 900, "evaluation's scoring call", proc)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "the reward actor failed in the evaluation" in err, err[-3000:]
    proc = launch(tmp_path / "straight", {})
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]

    def numbers(run_dir, name):  # NaN (e.g. a CPU's peak memory) as text: equal to itself
        rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
        # timings, rates (*_s) and the MFU (a rate over a measured peak) differ run to run
        return [{k: "NaN" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()
                 if not (k.startswith("time/") or k.endswith("_s") or k == "learner_mfu")} for row in rows]

    for name in ("metrics.jsonl", "eval_samples.jsonl"):
        killed, straight = numbers(tmp_path / "killed", name), numbers(tmp_path / "straight", name)
        assert_same(killed, straight, name)
    assert [row["step"] for row in numbers(tmp_path / "straight", "eval_samples.jsonl")] == [2] * 4 + [4] * 4


def test_launch_resume_errors(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "ppo", "--resume", str(tmp_path / "nope")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "ppo", "--resume", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no checkpoint there" in proc.stderr


def test_help_after_a_stage_lists_the_options(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "ppo", "--help"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "python launch.py" in out and "--run_dir DIR" in out and "--resume DIR" in out and "--config FILE" in out
    # every field under its section, with its type, doc and default

    def entry(section: str, name: str) -> str:
        block = out.split(f"\n{section}:\n", 1)[1].split("\n\n", 1)[0]
        return " ".join(block.split(f"  --{name} ", 1)[1].split("\n  --", 1)[0].split())

    assert entry("PPO algorithm", "kl_coef").startswith("float beta: weight of the per-token KL")
    assert entry("PPO algorithm", "kl_coef").endswith("(default: 0.1)")
    assert entry("resources and placement", "num_learners").endswith("(default: 1)")
    assert entry("resources and placement", "generator_resources").startswith("{str: float} Custom Ray")
    assert entry("PPO algorithm", "value_clip").startswith("float|null Value clipping")
    assert not any(tmp_path.iterdir()), "help must not write a run directory"


def test_launch_rejects_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--kl_coeff", "0.1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "did you mean --kl_coef?" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--gamma", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "'gamma' = 2.0 is invalid" in proc.stderr
    # the verifiable task has no reward-model stage
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "rm", "--config", "arith-tiny", "--run_dir",
                           str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "task 'arith' has no stage 'rm'; its stages: sft, ppo" in proc.stderr
    assert not any(tmp_path.iterdir()), "a rejected command must not write a run directory"


def test_readme_example_runs_as_written(ray_session):
    """The README's Python example (the seeds' example with the embedded preset)."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Usage\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    try:
        results = namespace["results"]
        assert len(results["generated_texts"]) == len(results["rewards"]) == 2
        assert results["adapter_version"] == 1
    finally:
        namespace["trainer"].shutdown()


@pytest.mark.heavy("runs every stage through Ray and vLLM")
def test_all_stages_end_to_end_on_the_bundled_task(tmp_path):
    """`launch.py` with no stage: data -> SFT -> reward model -> PPO -> report (short)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--run_dir", str(run_dir), "--steps", "2",
         "--sft_epochs", "1", "--rm_epochs", "1", "--eval_size", "8", "--eval_every", "1",
         "--vllm_kv_cache_gib", "0.25", "--data_max_rows", "256"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    # the summary is stdout's last line (Ray's late actor log lines come before it)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report
    for key in ("sft_val_loss", "rm_val_accuracy", "gold_test_sft", "gold_test_ppo", "win_rate_ppo_vs_sft",
                "win_rate_sft_vs_reference", "win_rate_ppo_vs_reference", "final_kl", "gold_val_sft", "gold_val_ppo", "win_rate_val_ppo_vs_sft"):
        assert isinstance(report[key], float) and math.isfinite(report[key]), key
    assert report["rm_val_accuracy"] > 0.5
    # The headline numbers are the held-out samples', recomputed here with the gold judge.
    from ppo_ray.tasks.tldr_synth import gold_score, win_rate

    held = [json.loads(x) for x in (run_dir / "held_out.jsonl").read_text().splitlines()]
    for split, name, key in (("test", "prompts_test.jsonl", "test"), ("val", "prompts_validation.jsonl", "val")):
        samples = [h for h in held if h["split"] == split]
        rows = [json.loads(x) for x in (run_dir / "data" / name).read_text().splitlines()][:len(samples)]
        assert len(samples) == 8 and [h["index"] for h in samples] == list(range(8))
        sft = [gold_score(row, h["sft"], h["sft_stop"]) for row, h in zip(rows, samples)]
        ppo = [gold_score(row, h["ppo"], h["ppo_stop"]) for row, h in zip(rows, samples)]
        assert sft == [h["sft_gold"] for h in samples] and ppo == [h["ppo_gold"] for h in samples]
        assert report[f"gold_{key}_sft"] == sum(sft) / len(sft), split
        assert report[f"gold_{key}_ppo"] == sum(ppo) / len(ppo), split
        win = "win_rate_ppo_vs_sft" if split == "test" else "win_rate_val_ppo_vs_sft"
        assert report[win] == win_rate(ppo, sft), split
        if split == "test":  # the N+ metric: against the reference summaries (the prompts' `summary`)
            ref = [gold_score(row, row["summary"], True) for row in rows]
            assert report["gold_test_reference"] == sum(ref) / len(ref)
            assert report["win_rate_sft_vs_reference"] == win_rate(sft, ref)
            assert report["win_rate_ppo_vs_reference"] == win_rate(ppo, ref)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("gold_val" in m for m in metrics)
    # each evaluation's first 4 training rollouts, per token (value, TD error, return), and the heat map
    from helpers import assert_attribution

    assert_attribution(run_dir, [1, 2], 4, critic=True)
    # the console is kept in the run directory (a RayJob's pods and their logs are deleted)
    (log_file,) = (run_dir / "logs").glob("launch-*.log")
    console = log_file.read_text()
    assert f"run directory: {run_dir}" in console and "step 2/2" in console
    # with the actors' own lines, which the console leaves out (prefixed as Ray prints them)
    assert re.search(r"\(ppo-[0-9a-f]{8}/generator-0 pid=\d+[^)]*\) .*INFO ppo_ray\.actor: step 2: ", console), console
    assert "INFO ppo_ray.actor:" not in proc.stderr
    assert console.rstrip().splitlines()[-1] == proc.stdout.strip().splitlines()[-1]  # the report, last
    for name in ("curves.png", "samples.md", "config.yaml", "sft/model.safetensors", "rm/model.safetensors",
                 "adapter/adapter_model.safetensors", "data/prompts_test.jsonl"):
        assert (run_dir / name).is_file(), name
    # the final adapter loads with PEFT over the SFT checkpoint
    from peft import PeftModel

    from ppo_ray.modeling import load_causal_lm

    PeftModel.from_pretrained(load_causal_lm(str(run_dir / "sft")), str(run_dir / "adapter"))
    # launch.py export (tests/test_export.py tests it in depth): the pipeline's base is the run's
    # SFT model (${run_dir}/sft in the checkpoint's config), named by its absolute path; the
    # card has the report's numbers and the run tag
    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "export", "run", "--adapter", str(out / "a"),
                           "--merged", str(out / "m")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "a" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((run_dir / "sft").resolve())
    card = (out / "m" / "README.md").read_text()
    assert "this is the run's final adapter" in card and f"run tag: `{report['run_tag']}`" in card
    assert f"| gold_test_ppo | {report['gold_test_ppo']:.4g} |" in card
    from transformers import AutoModelForCausalLM

    assert not any("lora" in n for n, _ in AutoModelForCausalLM.from_pretrained(str(out / "m")).named_parameters())

    # `launch.py eval` on the finished run (its default --out: run_dir/eval/<time>/, beside the
    # run's files, none of them touched) reproduces the report's test numbers exactly: the same
    # judge on the same samples (same functions, same seeds), means and win rates taken in the
    # same order. It also reports the reward model's mean score of each policy's samples.
    from helpers import snapshot

    run_files = snapshot(run_dir)
    proc = _launch(["eval", run_dir], tmp_path)
    (out,) = (run_dir / "eval").iterdir()
    ev = json.loads((out / "eval.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ev
    assert ev["policies"] == ["sft", "ppo"] and ev["step"] == 2 and ev["eval_prompts"] == 8
    keys = ["gold_test_sft", "gold_test_ppo", "gold_test_reference", "win_rate_ppo_vs_sft",
            "win_rate_sft_vs_reference", "win_rate_ppo_vs_reference", "copy_test_sft", "copy_test_ppo"]
    assert {k: ev[k] for k in keys} == {k: report[k] for k in keys}
    test = [h for h in held if h["split"] == "test"]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [(s["sft"], s["sft_stop"], s["sft_gold"], s["ppo"], s["ppo_stop"], s["ppo_gold"]) for s in samples] == \
        [(h["sft"], h["sft_stop"], h["sft_gold"], h["ppo"], h["ppo_stop"], h["ppo_gold"]) for h in test]
    rewards = {who: [s[f"{who}_reward"] for s in samples] for who in ("sft", "ppo")}
    assert ev["reward_test_sft"] == sum(rewards["sft"]) / 8 and ev["reward_test_ppo"] == sum(rewards["ppo"]) / 8
    assert all(math.isfinite(r) for rs in rewards.values() for r in rs)
    assert {k: v for k, v in snapshot(run_dir).items() if not k.startswith("eval/")} == run_files


@pytest.mark.heavy("runs every stage through Ray and vLLM")
def test_the_verifiable_task_end_to_end(tmp_path):
    """`launch.py --config arith-tiny`: data -> SFT -> RL with the verifier -> pass@1 / pass@k
    (short). No reward model is trained; the report's rates are the held-out samples',
    recomputed here with the verifier."""
    from ppo_ray.tasks.arith import is_right, pass_at_k

    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--config", "arith-tiny", "--run_dir", str(run_dir),
         "--steps", "2", "--sft_epochs", "1", "--eval_size", "8", "--eval_k", "4", "--eval_every", "1",
         "--batch_size", "32", "--micro_batch_size", "32", "--vllm_kv_cache_gib", "0.25", "--data_max_rows", "256"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report
    assert not (run_dir / "rm").exists() and "rm_val_accuracy" not in report
    held = [json.loads(x) for x in (run_dir / "held_out.jsonl").read_text().splitlines()]
    for split in ("test", "val"):
        rows = [h for h in held if h["split"] == split]
        assert len(rows) == 8 and all(len(h["sft_samples"]) == len(h["rl_samples"]) == 4 for h in rows)
        for who in ("sft", "rl"):
            greedy = [is_right(h["prompt"], h[f"{who}_greedy"], h[f"{who}_greedy_finish"]) for h in rows]
            right = [sum(is_right(h["prompt"], s, f) for s, f in zip(h[f"{who}_samples"], h[f"{who}_samples_finish"]))
                     for h in rows]
            assert report[f"pass1_{split}_{who}"] == sum(greedy) / 8, (split, who)
            assert report[f"pass4_{split}_{who}"] == sum(pass_at_k(4, c, 4) for c in right) / 8, (split, who)
            assert report[f"sample_accuracy_{split}_{who}"] == sum(c / 4 for c in right) / 8, (split, who)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(0 <= m["pass1_val"] <= 1 for m in metrics)
    from helpers import assert_attribution

    assert_attribution(run_dir, [1, 2], 4, critic=False)  # GRPO: the group baseline, no value
    assert all(m["score/ppo_ray.tasks.arith:verify"] in (m["reward_mean"],) for m in metrics)
    for name in ("curves.png", "samples.md", "sft/model.safetensors", "adapter/adapter_model.safetensors",
                 "data/sft_train.jsonl", "data/prompts_test.jsonl"):
        assert (run_dir / name).is_file(), name
    assert report["rl_steps"] == 2 and report["eval_k"] == 4

    # `launch.py eval` on the finished run reproduces the report's test numbers exactly: the same
    # evaluation functions and seeds, the SFT policy from a fresh trainer, the trained one from the
    # run's newest checkpoint (step 2, written at the end). Pass rates are means of counts taken in
    # the same order: equal, not close. The run directory is left as it was.
    from helpers import snapshot

    run_files = snapshot(run_dir)
    out = tmp_path / "eval"
    proc = _launch(["eval", run_dir, "--out", out], tmp_path)
    ev = json.loads((out / "eval.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ev
    assert ev["checkpoint"] == str(run_dir / "checkpoints" / "step-000002") and ev["step"] == 2
    assert ev["policies"] == ["sft", "rl"] and ev["eval_prompts"] == 8 and ev["eval_k"] == 4
    keys = [f"{rate}_test_{who}" for who in ("sft", "rl") for rate in ("pass1", "pass4", "sample_accuracy")]
    assert {k: ev[k] for k in keys} == {k: report[k] for k in keys}
    assert ev["pass1_test_rl_minus_sft"] == report["pass1_test_rl"] - report["pass1_test_sft"]
    # the very samples behind them
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    test = [h for h in held if h["split"] == "test"]
    fields = ("prompt", "answer", "sft_greedy", "sft_samples", "rl_greedy", "rl_samples")
    assert [{f: s[f] for f in fields} for s in samples] == [{f: h[f] for f in fields} for h in test]
    assert (out / "samples.md").read_text() == (run_dir / "samples.md").read_text()
    assert snapshot(run_dir) == run_files

    # The same run resumed with other evaluation settings (fewer problems, fewer samples each):
    # nothing more to train, and the SFT policy is evaluated again with them (its old evaluation
    # moved aside), so the report pairs the same 4 problems with k = 2 on both sides. Before, the
    # smaller eval_k failed at the very end (pass@2 of 4 samples), and the stage was never marked
    # done; a smaller eval_size alone compared 8 SFT problems with 4 RL ones, silently.
    proc = _launch(["--run_dir", run_dir, "--resume", "auto", "--eval_size", "4", "--eval_k", "2"], tmp_path)
    assert "the SFT policy is evaluated again" in proc.stderr and "eval_k: 4 -> 2" in proc.stderr
    resumed = json.loads((run_dir / "report.json").read_text())
    assert "report_errors" not in resumed and resumed["rl_steps"] == 2
    assert resumed["eval_prompts"] == 4 and resumed["eval_k"] == 2
    settings = json.loads((run_dir / "eval-before-ppo.json").read_text())["settings"]
    assert (settings["eval_size"], settings["eval_k"]) == (4, 2)
    assert list((run_dir / "replaced").glob("*-eval-settings-changed-*/eval-before-ppo.json"))
    held = [json.loads(x) for x in (run_dir / "held_out.jsonl").read_text().splitlines()]
    for split in ("test", "val"):
        rows = [h for h in held if h["split"] == split]
        assert len(rows) == 4 and all(len(h["sft_samples"]) == len(h["rl_samples"]) == 2 for h in rows)
        for who in ("sft", "rl"):
            right = [sum(is_right(h["prompt"], s, f) for s, f in zip(h[f"{who}_samples"], h[f"{who}_samples_finish"],
                                                                      strict=True)) for h in rows]
            assert resumed[f"pass2_{split}_{who}"] == sum(pass_at_k(2, c, 2) for c in right) / 4, (split, who)
