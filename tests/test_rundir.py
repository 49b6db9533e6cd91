"""Nothing lost: a fresh run never writes over a run, checkpoints know their lineage, and a
damaged newest checkpoint (or `latest`) falls back along the run's own history only.

The checkpoint files are real (a tiny learner's state through ppo_ray.driver.checkpoint); no Ray.
Each case replays what a user did: a re-applied job, a resume from an older checkpoint,
a crash before the first `latest`, a damaged or redirected `latest`, a corrupt file.
(The end-to-end re-applied job, killed mid-run and started again: tests/test_launch.py.)
"""

from __future__ import annotations

import json

import pytest

import launch
from helpers import launch_ppo, snapshot
from ppo_ray.driver.checkpoint import (CheckpointError, Lineage, ancestry, branch_from, load_checkpoint,
                                resolve_checkpoint, save_checkpoint)
from ppo_ray.driver.rundir import RunDirError, held_outputs, mark_done, stages_done


@pytest.fixture(scope="module")
def learner_state():
    import torch

    from learner.learner import Learner
    from ppo_ray.config import PPOConfig
    from ppo_ray.paths import resolve_model_path

    cfg = PPOConfig(model_name="embedded:tiny", lora_r=4, lora_alpha=8)
    return cfg, Learner(cfg, resolve_model_path(cfg.model_name)).state_dict(), torch.Generator().get_state()


def save(run_dir, learner_state, step, lineage=None, keep=10):
    cfg, state, rng = learner_state
    return save_checkpoint(run_dir, config=cfg, learner_state=state, model_dir="base", keep=keep, lineage=lineage,
                           trainer_state={"step": step, "order": [step], "data_rng": rng})


def run_of(run_dir, learner_state, steps, keep=10):
    """A run's checkpoints at `steps`, saved as the trainer saves them (lineage carried on)."""
    lineage = Lineage.fresh()
    for step in steps:
        lineage = Lineage.after(save(run_dir, learner_state, step, lineage, keep))
    return lineage


def names(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


# ------------------------------------------------------------------ lineage and pruning
def test_checkpoints_record_their_lineage(tmp_path, learner_state):
    run_of(tmp_path, learner_state, (1, 2, 3))
    root = tmp_path / "checkpoints"
    metas = [json.loads((root / f"step-00000{i}" / "trainer.json").read_text()) for i in (1, 2, 3)]
    assert len({m["run_id"] for m in metas}) == 1 and len({m["checkpoint_id"] for m in metas}) == 3
    assert metas[0]["parent"] is None
    assert (metas[2]["parent"], metas[2]["parent_id"]) == ("step-000002", metas[1]["checkpoint_id"])
    assert [p.name for p in ancestry(root / "step-000003")] == ["step-000003", "step-000002", "step-000001"]


def test_resume_from_an_older_checkpoint_moves_the_abandoned_branch_aside(tmp_path, learner_state, caplog):
    """Resume from step-10 with step-20 present, save step-12: step-20 was pruned by name
    before ({12, 20} kept, 10 deleted; damage 12 and resume picked 20, the abandoned run).
    Now 20 is moved aside (logged), 10 stays until 12 is written, and a damaged 12 falls
    back to 10."""
    run_of(tmp_path, learner_state, (10, 20), keep=2)
    root = tmp_path / "checkpoints"
    with caplog.at_level("WARNING", logger="ppo_ray.driver.checkpoint"):
        moved = branch_from(root / "step-000010")
    assert names(root) == ["step-000010"] and (root / "latest").read_text().strip() == "step-000010"
    assert [p.name for p in moved.iterdir()] == ["step-000020"] and moved.parent == root / "abandoned"
    assert str(moved) in caplog.text and "step-000020" in caplog.text
    save(tmp_path, learner_state, 12, Lineage.after(root / "step-000010"), keep=2)
    assert names(root) == ["step-000010", "step-000012"]
    value = root / "step-000012" / "value.safetensors"
    value.write_bytes(value.read_bytes()[:100])
    assert resolve_checkpoint(tmp_path).name == "step-000010"


def test_pruning_keeps_only_the_runs_own_history(tmp_path, learner_state):
    """Another run's checkpoint (copied in, a higher step) is neither pruned nor a fallback."""
    run_of(tmp_path / "other", learner_state, (50,))
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (tmp_path / "other" / "checkpoints" / "step-000050").rename(root / "step-000050")
    run_of(tmp_path / "run", learner_state, (1, 2, 3), keep=1)
    assert names(root) == ["step-000003", "step-000050"]
    value = root / "step-000003" / "value.safetensors"
    value.write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*step-000003"):
        resolve_checkpoint(tmp_path / "run")


def test_a_crash_before_the_first_latest_pointer_resumes(tmp_path, learner_state):
    run_of(tmp_path, learner_state, (1, 2))
    (tmp_path / "checkpoints" / "latest").unlink()
    assert resolve_checkpoint(tmp_path).name == "step-000002"


@pytest.mark.parametrize("pointer", ["../../elsewhere/step-000009", "/etc", "step-000009", "\x00garbage"])
def test_a_missing_or_damaged_latest_falls_back_to_the_newest_of_the_lineage(tmp_path, learner_state, caplog, pointer):
    run_of(tmp_path, learner_state, (1, 2))
    outside = tmp_path / "elsewhere" / "step-000009"  # what an escaping pointer would name
    outside.mkdir(parents=True)
    (outside / "trainer.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text(pointer + "\n")
    with caplog.at_level("WARNING", logger="ppo_ray.driver.checkpoint"):
        assert resolve_checkpoint(tmp_path).name == "step-000002"
    assert "latest" in caplog.text


def test_an_unreadable_file_is_a_checkpoint_error_naming_it(tmp_path, learner_state):
    run_of(tmp_path, learner_state, (1,))
    ckpt = tmp_path / "checkpoints" / "step-000001"
    (ckpt / "checksums.json").unlink()  # as an older checkpoint: no checksum catches it first
    (ckpt / "optimizer.pt").write_bytes(b"garbage, not a pickle")
    with pytest.raises(CheckpointError, match=r"step-000001/optimizer.pt cannot be read \(UnpicklingError"):
        load_checkpoint(ckpt)


# ------------------------------------------------------------------ a fresh run never writes over a run
def test_launch_refuses_a_fresh_run_into_a_used_run_directory(old_run, capsys, no_ray_address):
    """deploy/rayjob.yaml re-applied used to re-train over the old run and delete its
    metrics: now the command stops before writing anything and says what to do."""
    before = snapshot(old_run)
    assert launch_ppo(old_run) == 2
    err = capsys.readouterr().err
    assert "already holds a run (checkpoints, metrics.jsonl)" in err
    assert "--resume auto" in err and "--overwrite" in err
    assert snapshot(old_run) == before


def test_launch_resume_and_overwrite_together_is_an_error(old_run, capsys):
    assert launch_ppo(old_run, "--resume", "auto", "--overwrite") == 2
    assert "give one of them" in capsys.readouterr().err


def test_overwrite_moves_the_old_outputs_aside(tmp_path):
    run = tmp_path / "run"
    (run / "sft").mkdir(parents=True)
    (run / "sft" / "model.safetensors").write_text("sft")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "report.json").write_text("{}")
    mark_done(run, "sft", {"sft_loss": 1.0})
    assert launch.plan_run_dir(run, "ppo", ("ppo",), None, overwrite=True) == ({}, None)
    assert (run / "sft" / "model.safetensors").is_file()  # another stage's output: kept
    assert not (run / "metrics.jsonl").exists() and stages_done(run) == {"sft": {"sft_loss": 1.0}}
    [moved] = (run / "replaced").iterdir()
    assert (moved / "metrics.jsonl").read_text() == '{"step": 1}\n'
    launch.plan_run_dir(run, "all", ("sft", "rm", "ppo"), None, overwrite=True)
    assert held_outputs(run, ["all"]) == [] and stages_done(run) == {}


def test_the_report_page_moves_aside_with_the_report_and_a_fresh_run_refuses_it(tmp_path):
    """report.html (ppo_ray.tasks.report_page, written at the end of `all` and `ppo`) is one of
    the run's reports: --overwrite of any stage moves it aside with report.json, and a fresh
    `all` does not write over it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "report.json").write_text("{}")
    (run / "report.html").write_text("<!DOCTYPE html>")
    launch.plan_run_dir(run, "ppo", ("ppo",), None, overwrite=True)
    [moved] = (run / "replaced").iterdir()
    assert sorted(p.name for p in moved.iterdir()) == ["metrics.jsonl", "report.html", "report.json"]
    (run / "report.html").write_text("<!DOCTYPE html>")
    assert held_outputs(run, ["all"]) == ["report.html"]
    with pytest.raises(RunDirError, match="report.html"):
        launch.plan_run_dir(run, "all", ("sft", "rm", "ppo"), None, overwrite=False)


@pytest.mark.parametrize("stage, stages", [("ppo", ("ppo",)), ("sft", ("sft",)), ("all", ("sft", "rm", "ppo"))])
def test_overwrite_moves_the_old_runs_evaluations_aside(tmp_path, stage, stages):
    """`launch.py eval` writes into RUN_DIR/eval/<time>/ (its default --out): evaluations of the
    run's checkpoints. --overwrite of PPO, or of a stage PPO is built on, moves eval/ aside with
    the checkpoints it evaluated (an old run's numbers never sit in the new run), and a fresh PPO
    stage refuses a directory that holds one."""
    from ppo_ray.tasks.evaluate import EVAL_DIR

    run = tmp_path / "run"
    (run / EVAL_DIR / "20261201-100000").mkdir(parents=True)
    (run / EVAL_DIR / "20261201-100000" / "eval.json").write_text('{"step": 2}')
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    assert held_outputs(run, ["ppo"]) == ["metrics.jsonl", EVAL_DIR]
    launch.plan_run_dir(run, stage, stages, None, overwrite=True)
    assert not (run / EVAL_DIR).exists() and held_outputs(run, ["all"]) == []
    [moved] = (run / "replaced").iterdir()
    assert (moved / EVAL_DIR / "20261201-100000" / "eval.json").read_text() == '{"step": 2}'
    (run / EVAL_DIR).mkdir()
    (run / EVAL_DIR / "eval.json").write_text("{}")
    with pytest.raises(RunDirError, match=EVAL_DIR):
        launch.plan_run_dir(run, "ppo", ("ppo",), None, overwrite=False)


def test_resume_auto_continues_what_the_run_directory_holds(tmp_path, learner_state):
    run = tmp_path / "run"
    all_stages = ("sft", "rm", "ppo")
    # nothing there: a fresh start
    assert launch.plan_run_dir(run, "all", all_stages, "auto", False) == ({}, None)
    # SFT finished, the RM stage was killed half-way: RM starts again, its partial output aside
    (run / "sft").mkdir(parents=True)
    mark_done(run, "sft", {"sft_loss": 1.0})
    (run / "rm").mkdir()
    (run / "rm" / "half.bin").write_text("x")
    done, resume = launch.plan_run_dir(run, "all", all_stages, "auto", False)
    assert done == {"sft": {"sft_loss": 1.0}} and resume is None
    assert not (run / "rm").exists() and any((run / "replaced").rglob("half.bin"))
    # RM finished, PPO killed after its step-2 checkpoint: PPO resumes from it
    mark_done(run, "rm", {"rm_loss": 0.5})
    run_of(run, learner_state, (1, 2))
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    done, resume = launch.plan_run_dir(run, "all", all_stages, "auto", False)
    assert set(done) == {"sft", "rm"} and resume == str(run / "checkpoints" / "step-000002")
    assert (run / "metrics.jsonl").is_file()  # the resumed run truncates it to its step
    # PPO killed before its first checkpoint: its partial outputs move aside, it starts again
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text('{"step": 1}\n')
    assert launch.plan_run_dir(plain, "ppo", ("ppo",), "auto", False) == ({}, None)
    assert not (plain / "metrics.jsonl").exists()


def _finished_pipeline(run, learner_state):
    """A finished `all` run: sft and rm done, PPO checkpoints, metrics and report."""
    for stage in ("sft", "rm"):
        (run / stage).mkdir(parents=True)
        (run / stage / "model.safetensors").write_text(stage)
        mark_done(run, stage, {f"{stage}_loss": 1.0})
    run_of(run, learner_state, (1, 2))
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "report.json").write_text("{}")
    mark_done(run, "ppo", {"ppo_steps": 2})


def test_overwriting_a_stage_moves_every_stage_built_on_it_aside(tmp_path, learner_state):
    """`launch.py sft --overwrite` on a finished run used to leave rm/ and the PPO checkpoints
    in place, and a later --resume auto put the old adapter, value head and Adam state onto the
    new SFT model. Downstream follows upstream: they move aside with it, into one folder."""
    run = tmp_path / "run"
    _finished_pipeline(run, learner_state)
    assert launch.plan_run_dir(run, "sft", ("sft",), None, overwrite=True) == ({}, None)
    assert held_outputs(run, ["all"]) == [] and stages_done(run) == {}
    [moved] = (run / "replaced").iterdir()
    assert sorted(p.name for p in moved.iterdir()) == ["checkpoints", "metrics.jsonl", "report.json", "rm", "sft"]
    # rm --overwrite: the SFT model stays, the value head's source and PPO go
    run = tmp_path / "run2"
    _finished_pipeline(run, learner_state)
    launch.plan_run_dir(run, "rm", ("rm",), None, overwrite=True)
    assert (run / "sft").is_dir() and not (run / "rm").exists() and not (run / "checkpoints").exists()
    assert set(stages_done(run)) == {"sft"}
    # then --resume auto: rm and PPO start again; nothing resumes
    done, resume = launch.plan_run_dir(run, "all", ("sft", "rm", "ppo"), "auto", False)
    assert set(done) == {"sft"} and resume is None


def test_a_lost_run_json_never_resumes_onto_re_trained_stages(tmp_path, learner_state):
    """Without run.json nothing is known to have finished: SFT starts again, and the reward
    model and the PPO run built on the old SFT move aside with its partial outputs (they used
    to be resumed onto the re-trained stages)."""
    run = tmp_path / "run"
    _finished_pipeline(run, learner_state)
    (run / "run.json").unlink()
    done, resume = launch.plan_run_dir(run, "all", ("sft", "rm", "ppo"), "auto", False)
    assert done == {} and resume is None
    assert held_outputs(run, ["all"]) == []
    # only the RM unfinished: it starts again, and the PPO run built on the old one goes too
    run = tmp_path / "run2"
    _finished_pipeline(run, learner_state)
    from ppo_ray.driver.rundir import forget_done

    forget_done(run, ["rm"])
    done, resume = launch.plan_run_dir(run, "all", ("sft", "rm", "ppo"), "auto", False)
    assert set(done) == {"sft"} and resume is None and not (run / "checkpoints").exists()
    assert (run / "sft" / "model.safetensors").is_file()


def test_a_checkpoint_refuses_models_that_changed_since(tmp_path, learner_state):
    """The compatibility check compared the paths <run_dir>/sft and <run_dir>/rm, not what is
    in them. A checkpoint records its models' content digests; a resume recomputes them and
    refuses a model re-trained since, naming the stage and both digests."""
    import shutil

    from ppo_ray.driver.checkpoint import model_fingerprints
    from ppo_ray.paths import resolve_model_path

    cfg, state, rng = learner_state
    run = tmp_path / "run"
    shutil.copytree(resolve_model_path("embedded:tiny"), run / "sft")
    cfg = cfg.replace(model_name=str(run / "sft"))
    saved = model_fingerprints(cfg)
    assert saved["model_name"].startswith("sha256:")
    save_checkpoint(run, config=cfg, learner_state=state, model_dir=cfg.model_name,
                    trainer_state={"step": 1, "order": [1], "data_rng": rng, "fingerprints": saved})
    load_checkpoint(run, cfg)  # the same models: fine
    with open(run / "sft" / "model.safetensors", "r+b") as f:  # the stage re-trained: other weights, same path
        f.seek(-4, 2)
        f.write(b"\x01\x02\x03\x04")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(run, cfg)
    now = model_fingerprints(cfg)["model_name"]
    assert "'sft' stage" in str(e.value) and saved["model_name"] in str(e.value) and now in str(e.value)
    assert now != saved["model_name"]


def test_a_resume_touches_only_its_own_run(tmp_path, learner_state, capsys, no_ray_address):
    """`launch.py ppo --resume A/checkpoints/step-N --run_dir B` used to truncate B's metrics,
    move B's checkpoints aside and overwrite its adapter: it is refused before anything is
    read or written, naming both runs and the ways on."""
    from ppo_ray.driver.checkpoint import check_own_lineage

    a, b = tmp_path / "a", tmp_path / "b"
    run_of(a, learner_state, (1, 2, 3))
    run_of(b, learner_state, (1, 2, 3, 4))
    (b / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3, 4)))
    before = snapshot(b)
    ckpt = a / "checkpoints" / "step-000003"
    assert launch.main(["ppo", "--resume", str(ckpt), "--run_dir", str(b)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {ckpt}" in err and "--overwrite" in err and str(b) in err
    assert snapshot(b) == before
    check_own_lineage(ckpt, a)  # in its own run directory: fine
    check_own_lineage(ckpt, tmp_path / "empty")  # into a directory that holds no run: a copy of the run
    # a checkpoint of another run copied in beside this run's: refused too
    import shutil

    shutil.copytree(ckpt, b / "checkpoints" / "step-000009")
    with pytest.raises(RunDirError, match="also holds run"):
        check_own_lineage(b / "checkpoints" / "step-000009", b)


def test_one_resume_rule_the_checkpoints_config_plus_the_commands_options(tmp_path, learner_state, monkeypatch,
                                                                           capsys, no_ray_address):
    """--resume auto read config.yaml, --resume DIR config-ppo.yaml: a PPO override given on an
    earlier resume (here kl_coef 0.2, in the checkpoint's config) was silently reverted by one
    of them. Both now resume with the checkpoint's config plus this command's options."""
    from helpers import TINY
    from ppo_ray.config import PPOConfig

    _, state, rng = learner_state
    run = tmp_path / "run"
    first = PPOConfig.from_yaml(TINY, kl_coef=0.1)
    run.mkdir()
    first.to_yaml(run / "config-ppo.yaml")  # what the first command saved
    save_checkpoint(run, config=first.replace(kl_coef=0.2), learner_state=state, model_dir="base",
                    trainer_state={"step": 1, "order": [1], "data_rng": rng})  # resumed since with --kl_coef 0.2
    seen = []
    monkeypatch.setattr(launch, "_run", lambda config, *args, **kw: seen.append(config) or 0)
    assert launch.main(["ppo", "--resume", str(run), "--learning_rate", "1e-4"]) == 0
    assert launch.main(["ppo", "--run_dir", str(run), "--resume", "auto", "--learning_rate", "1e-4"]) == 0
    assert [c.kl_coef for c in seen] == [0.2, 0.2] and [c.learning_rate for c in seen] == [1e-4, 1e-4]
    assert seen[0] == seen[1]
    # --config beside --resume CKPT names the rule instead of mixing two configs
    assert launch.main(["ppo", "--resume", str(run), "--config", str(TINY)]) == 2
    assert "give changes as --<field> VALUE" in capsys.readouterr().err


def test_a_resume_names_the_changed_fields_and_restarts_an_overridden_adaptive_kl(caplog, learner_state):
    """What a restored state would shadow is applied and said, never dropped: an adaptive
    controller given another --kl_coef starts from it; the changes are listed in the log."""
    from dataclasses import replace

    from ppo_ray.driver.checkpoint import apply_changes

    cfg, state, _ = learner_state
    saved = cfg.replace(kl_target=1.0)
    state = replace(state, kl_coef=0.0734)
    with caplog.at_level("WARNING", logger="ppo_ray.driver.checkpoint"):
        out = apply_changes(saved.replace(kl_coef=0.3, learning_rate=1e-4), "ckpt", saved, state)
    assert out.kl_coef is None  # the learner takes the config's 0.3
    assert "kl_coef 0.1 -> 0.3 (the adaptive KL controller starts from kl_coef 0.3, not the checkpoint's 0.0734)" \
        in caplog.text and "learning_rate" in caplog.text
    # unchanged: the controller continues from the checkpoint's coefficient
    assert apply_changes(saved, "ckpt", saved, state).kl_coef == 0.0734


def test_resume_auto_needs_a_run_directory(capsys):
    assert launch.main(["--resume", "auto"]) == 2
    assert "pass --run_dir" in capsys.readouterr().err


def test_a_fresh_trainer_refuses_another_runs_checkpoints_and_metrics(tmp_path, learner_state):
    """The library path (PPOTrainer.train calls check_fresh_run) has the same rule as launch.py."""
    from ppo_ray.driver.checkpoint import check_fresh_run

    run_of(tmp_path, learner_state, (1,))
    with pytest.raises(RunDirError, match="holds another run's checkpoints"):
        check_fresh_run(0, Lineage.fresh(), tmp_path, None)
    metrics = tmp_path / "elsewhere.jsonl"
    metrics.write_text('{"step": 1}\n')
    with pytest.raises(RunDirError, match="elsewhere.jsonl holds another run's steps"):
        check_fresh_run(0, Lineage.fresh(), None, metrics)
    check_fresh_run(1, Lineage.after(tmp_path / "checkpoints" / "step-000001"), tmp_path, metrics)  # its own run


# ------------------------------------------------------------------ an unwritable run directory
def _launch_as(uid: int | None, argv: list[str], err_path) -> int:
    """launch.main(argv) with stderr to err_path; as `uid` (effective ids, in a forked child)
    when given. Modules are imported before the fork: the unprivileged child may not read
    the interpreter's own folder."""
    import os
    import sys

    if uid is None:
        with open(err_path, "w") as err:
            old, sys.stderr = sys.stderr, err
            try:
                return launch.main(argv)
            finally:
                sys.stderr = old
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            err = open(err_path, "w")
            os.setgroups([])
            os.setegid(uid)
            os.seteuid(uid)
            sys.stderr = err
            code = launch.main(argv)
            err.flush()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_an_unwritable_run_directory_is_an_error_naming_it_and_the_uid(tmp_path, no_ray_address):
    """A freshly provisioned volume owned by root, and the image running as uid 1000: launch.py
    stops before writing anything, naming the folder, its owner and the process's uid (no
    traceback). As an unprivileged user (root may write anywhere): `nobody` (65534) when the
    suite runs as root, else this user with the folder made read-only."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    config = str(Path(launch.__file__).resolve().parent / "configs" / "tldr-tiny.yaml")
    # the same checks once in this process, stopped by a file in the way: imports what they use
    (tmp_path / "file").write_text("x")
    assert _launch_as(None, ["sft", "--config", config, "--run_dir", str(tmp_path / "file" / "run")],
                      tmp_path / "err") == 2
    assert "file is a file, not a folder" in (tmp_path / "err").read_text()
    volume = Path(tempfile.mkdtemp(prefix="ppo-ray-volume-"))  # under /tmp: every user can reach it
    try:
        volume.chmod(0o755 if os.geteuid() == 0 else 0o555)  # writable by root only / by nobody
        run_dir = volume / "runs" / "qwen3"
        uid = 65534 if os.geteuid() == 0 else None
        rc = _launch_as(uid, ["sft", "--config", config, "--run_dir", str(run_dir)], tmp_path / "err")
        err = (tmp_path / "err").read_text()
        assert rc == 2, err
        assert "Traceback" not in err, err
        assert f"error: cannot write run directory {run_dir}: {volume} (owner uid {volume.stat().st_uid}" in err
        assert f"(uid {uid if uid is not None else os.geteuid()}," in err and "fsGroup" in err
        assert list(volume.iterdir()) == []  # nothing written
    finally:
        volume.chmod(0o755)
        shutil.rmtree(volume, ignore_errors=True)


def test_check_writable_names_a_file_in_the_way(tmp_path):
    from ppo_ray.driver.rundir import check_writable

    (tmp_path / "runs").write_text("a file")
    with pytest.raises(RunDirError, match=r"runs is a file, not a folder"):
        check_writable(tmp_path / "runs" / "qwen3")
    check_writable(tmp_path / "fresh" / "run")  # creatable: no error, nothing made
    assert not (tmp_path / "fresh").exists()
