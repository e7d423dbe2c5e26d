"""A 2-step run on a tiny random model checkpoints, is stopped after step 1, resumes, and ends with the same
parameters as an uninterrupted run."""

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.errors import ConfigError  # noqa: E402
from memagent.train.config import load_config  # noqa: E402
from memagent.train.data import samples_sha256  # noqa: E402
from memagent.train.synthetic import needle_samples  # noqa: E402
from memagent.train.trainer import Trainer  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


TRAIN = needle_samples(4, 12, seed=0, prefix="t")
VAL = {1: needle_samples(1, 12, seed=1, prefix="v")}


def parity_reward(response, answers):
    return float(len(response) % 2)  # a varied reward so the policy gradient is not zero


def _cfg(out, *extra):
    return load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={out}", "run.total_steps=2", "run.save_every=1", "run.val_every=0",
        "run.val_before_train=false", "run.tensorboard=true", "rl.group_size=2", "rl.prompts_per_step=2",
        "rl.mini_batches=2", "agent.chunk_tokens=48", "agent.memory_tokens=6", "agent.final_tokens=6",
        "optim.lr=1e-2", "optim.warmup_steps=1", "optim.micro_batch_tokens=300", *extra,
    ])


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def _run(out, *extra):
    t = Trainer(_cfg(out, *extra), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)
    t.fit()
    return t


def test_kill_and_resume_matches_uninterrupted(tmp_path):
    full = _run(tmp_path / "full")
    first = _run(tmp_path / "cut", "run.stop_after_step=1")
    assert first.step == 1
    resumed = _run(tmp_path / "cut")
    assert resumed.step == 2
    init = Trainer(_cfg(tmp_path / "init", "run.resume=false"), train_samples=TRAIN, val_samples=VAL)
    a, b, c = _params(full), _params(resumed), _params(init)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # training changed the weights
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    assert resumed.optimizer.state_dict()["state"].keys() == full.optimizer.state_dict()["state"].keys()
    assert resumed.scheduler.get_last_lr() == full.scheduler.get_last_lr()
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    want = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/mean"] for m in lines] == [m["reward/mean"] for m in want]
    assert lines[0]["lr"] == pytest.approx(1e-2) and "pg/clip_frac" in lines[0] and "kl/mean" in lines[0]
    assert (tmp_path / "full" / "policy" / "config.json").exists()
    assert list((tmp_path / "full" / "tb").iterdir())


def test_resume_redoes_steps_after_the_checkpoint_without_duplicate_rows(tmp_path):
    full = _run(tmp_path / "full")
    ckpts = sorted((tmp_path / "full" / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_000001.pt", "step_000002.pt"]
    ckpts[-1].unlink()  # killed after step 2 was logged, before its checkpoint was written
    redone = _run(tmp_path / "full")
    lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]  # step 2's first row was dropped, not repeated
    a, b = _params(full), _params(redone)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)


def test_resume_refuses_changed_settings_and_restart_refuses_old_run(tmp_path):
    _run(tmp_path / "cut", "run.stop_after_step=1")
    with pytest.raises(ConfigError, match=r"optim.lr: 0.01 -> 0.5"):
        _run(tmp_path / "cut", "optim.lr=0.5")
    with pytest.raises(ConfigError, match="already holds a training run"):
        _run(tmp_path / "cut", "run.resume=false")
    import shutil

    shutil.move(tmp_path / "cut", tmp_path / "moved")  # a moved run folder resumes
    resumed = _run(tmp_path / "moved", "run.total_steps=3", "run.torch_threads=1")  # run length may change
    assert resumed.step == 3


def test_checkpoints_key_optimizer_state_by_name_and_old_index_layout_resumes(tmp_path):
    from memagent.train.checkpoint import optimizer_by_index as _optimizer_by_index

    full = _run(tmp_path / "full")
    first = _run(tmp_path / "cut", "run.stop_after_step=1")
    path = tmp_path / "cut" / "checkpoints" / "step_000001.pt"
    ck = torch.load(path, weights_only=False)
    names = [n for n, _ in first.policy.named_parameters()]
    # the layout torch.distributed.checkpoint uses (so FSDP and one process write the same file)
    assert ck["optimizer"]["param_groups"][0]["params"] == names and set(ck["optimizer"]["state"]) == set(names)
    assert set(ck["model"]) == set(first.policy.state_dict())
    ck["optimizer"] = _optimizer_by_index(ck["optimizer"], first.policy)  # as written before name keys
    assert ck["optimizer"]["param_groups"][0]["params"] == list(range(len(names)))
    torch.save(ck, path)
    resumed = _run(tmp_path / "cut")
    a, b = _params(full), _params(resumed)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)


def test_samples_without_gold_answers_are_refused_before_any_step(tmp_path):
    from memagent.errors import DataError
    from memagent.types import Sample

    bad = [*TRAIN[:2], Sample("no-gold", "q?", "some document text"), Sample("blank", "q?", "text", ("",))]
    with pytest.raises(DataError, match=r"2 of 4 samples in the training set have no gold answers \(ids 'no-gold', 'blank'\)"):
        Trainer(_cfg(tmp_path / "a"), train_samples=bad, val_samples=VAL)
    assert not (tmp_path / "a").exists()


def test_cosine_schedule_refuses_a_new_run_length_on_resume(tmp_path):
    _run(tmp_path / "cut", "optim.schedule=cosine", "run.stop_after_step=1")
    with pytest.raises(ConfigError, match=r"run.total_steps \(the cosine schedule decays to 0 at it\): 2 -> 4"):
        _run(tmp_path / "cut", "optim.schedule=cosine", "run.total_steps=4")
    import shutil

    shutil.copytree(tmp_path / "cut", tmp_path / "branch")
    assert _run(tmp_path / "cut", "optim.schedule=cosine").step == 2
    # named in run.resume_changes, as the refusal advises, the new length is a branch (it was refused all the same)
    with pytest.warns(UserWarning, match=r"run.total_steps \(the cosine schedule decays to 0 at it\): 2 -> 3"):
        t = _run(tmp_path / "branch", "optim.schedule=cosine", "run.total_steps=3", "run.resume_changes=[run.total_steps]")
    assert t.step == 3


def test_an_edited_template_file_is_refused_on_resume(tmp_path):
    from importlib import resources

    path = tmp_path / "tpl.yaml"
    path.write_text(resources.files("memagent.agent").joinpath("templates/default.yaml").read_text(encoding="utf-8"))
    _run(tmp_path / "cut", f"agent.templates={path}", "run.stop_after_step=1")
    original = path.read_text()
    path.write_text(original.replace("No previous memory", "No memory yet", 1))
    with pytest.raises(ConfigError, match=r"agent.templates \(the prompt templates' text\)"):
        _run(tmp_path / "cut", f"agent.templates={path}")
    path.write_text(original)
    same = tmp_path / "same.yaml"  # the same text under another path: compared by text, not refused
    same.write_text(original)
    assert _run(tmp_path / "cut", f"agent.templates={same}").step == 2
    edited = tmp_path / "edited.yaml"
    edited.write_text(original.replace("No previous memory", "No memory yet", 1))
    with pytest.warns(UserWarning, match=r"agent.templates \(the prompt templates' text\)"):
        t = _run(tmp_path / "cut", f"agent.templates={edited}", "run.total_steps=3", "run.resume_changes=[agent.templates]")
    assert t.step == 3


def test_a_resume_that_changes_prompts_per_step_continues_the_data_stream(tmp_path):
    """Step 1 took questions t-0 and t-1 (2 per step). Resumed at 1 per step, step 2 takes t-2, the next one,
    not t-1 again (step x prompts_per_step = 1 would), and the checkpoint carries the position on."""
    _run(tmp_path, "run.stop_after_step=1")
    changed = ("rl.prompts_per_step=1", "run.resume_changes=[rl.prompts_per_step]")
    t = Trainer(_cfg(tmp_path, *changed), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)
    assert (t.step, t.data_position) == (1, 2)
    samples, first = t.step_samples()
    assert (first, [s.id for s in samples]) == (2, ["t-2"])
    t.fit()
    assert (t.step, t.data_position) == (2, 3)
    saved = torch.load(tmp_path / "checkpoints" / "step_000002.pt", map_location="cpu", weights_only=False)
    assert saved["data_position"] == 3


def test_a_branch_that_changes_the_optimizer_settings_trains_under_them(tmp_path):
    """The optimizer's and schedule's saved state carried the old lr, betas and weight decay, which the restored
    run kept while its config and warning said the new values applied."""
    import warnings

    _run(tmp_path, "run.stop_after_step=1")
    changed = ("optim.lr=0.05", "optim.weight_decay=0.5", "optim.betas=[0.5,0.6]",
               "run.resume_changes=[optim.lr,optim.weight_decay,optim.betas]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = Trainer(_cfg(tmp_path, *changed), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)
    (group,) = t.optimizer.param_groups
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.05, (0.5, 0.6), 0.5)  # past the 1-step warmup
    t.fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in rows] == [(1, 0.01), (2, 0.05)]
    saved = torch.load(tmp_path / "checkpoints" / "step_000002.pt", map_location="cpu", weights_only=False)
    assert saved["optimizer"]["param_groups"][0]["weight_decay"] == 0.5


def test_training_data_is_compared_by_its_questions_not_its_path(tmp_path):
    import shutil

    from memagent.data.io import write_samples

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_samples(a, TRAIN)
    original = a.read_text()

    def run(path, *extra):
        t = Trainer(_cfg(tmp_path / "cut", f"data.train_path={path}", *extra), val_samples=VAL, reward_fn=parity_reward)
        t.fit()
        return t

    first = run(a, "run.stop_after_step=1")
    assert first.step == 1 and first.data_sha256 == {"data.train_path": samples_sha256(TRAIN)}
    a.write_text(original.replace(TRAIN[0].question, TRAIN[0].question + " Really?", 1))  # same path, new questions
    with pytest.raises(ConfigError, match=r"data.train_path: 'questions with sha256 [0-9a-f]{12}\.\.\.' -> "
                                          r"'questions with sha256 [0-9a-f]{12}\.\.\.'"):
        run(a)
    a.write_text(original)
    shutil.copy(a, b)
    assert run(b).step == 2  # the same questions under another path resume


def test_a_budget_that_does_not_fit_names_the_training_settings(tmp_path):
    with pytest.raises(ConfigError, match=r"context window of hf:model is 4096 tokens. To fix: lower "
                                          r"agent.chunk_tokens to at most 3907; or use a model with a larger "
                                          r"context window \(model.path\)$"):
        _run(tmp_path / "b", "agent.chunk_tokens=100000")


def test_more_questions_a_step_than_the_data_holds_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"rl.prompts_per_step=8 exceeds the 4 training questions .*lower "
                                          r"rl.prompts_per_step"):
        _run(tmp_path / "p", "rl.prompts_per_step=8")
    assert not (tmp_path / "p").exists()  # refused while being built: the folder it made (for its lock) is gone
    # a rollout engine's scratch written before the refusal goes too (it stranded the folder: "holds files but no
    # training run (rollout_init)"), and a folder holding one is taken as a run's
    (tmp_path / "s").mkdir()
    from memagent.train import trainer as trainer_module

    real = trainer_module.make_engine

    def engine_writing_scratch(cfg, *args):
        os.makedirs(os.path.join(cfg.run.output_dir, "rollout_init"))
        return real(cfg, *args)

    def refused_after_writing_scratch():
        trainer_module.make_engine = engine_writing_scratch
        try:
            with pytest.raises(ConfigError, match="exceeds the 4 training questions"):
                _run(tmp_path / "s", "rl.prompts_per_step=8")
        finally:
            trainer_module.make_engine = real

    refused_after_writing_scratch()
    assert sorted(os.listdir(tmp_path / "s")) == [".train.lock"]
    (tmp_path / "s" / "rollout_init").mkdir()
    assert _run(tmp_path / "s").step == 2
    assert (tmp_path / "s" / "rollout_init").is_dir()  # scratch that was there before a run is not touched
    # a refused resume of a run removes the scratch it wrote too (a full model copy for a real model), and only that
    (tmp_path / "s" / "rollout_init").rmdir()
    refused_after_writing_scratch()
    assert not (tmp_path / "s" / "rollout_init").exists() and (tmp_path / "s" / "metrics.jsonl").is_file()


def test_non_finite_metrics_are_written_as_null(tmp_path):
    """A skipped update's NaN grad norm was written as bare NaN, which is not JSON (strict readers refuse it)."""
    t = Trainer(_cfg(tmp_path), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)
    t.log({"step": 1, "grad_norm": float("nan"), "loss": float("inf"), "lr": 0.01})
    t.close()

    def refuse(name):
        raise ValueError(name)

    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=refuse) == {"step": 1, "grad_norm": None, "loss": None, "lr": 0.01}


def test_two_trainers_cannot_share_a_run_folder(tmp_path):
    """A double launch (or a requeued job beside the first) interleaved metrics rows [1, 1, 2, 2] and checkpoints."""
    first = Trainer(_cfg(tmp_path), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)
    with pytest.raises(ConfigError, match=r"run.output_dir .* is locked: another memagent train is writing to it"):
        Trainer(_cfg(tmp_path), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)
    first.fit()  # the lock goes when the run ends
    assert Trainer(_cfg(tmp_path), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward).step == 2


def test_a_rerun_of_a_finished_run_trains_nothing_and_leaves_its_policy_as_it_was(tmp_path):
    import os

    _run(tmp_path / "done")
    policy = tmp_path / "done" / "policy"
    stamps = {p.name: p.stat().st_mtime_ns for p in policy.iterdir()}
    os.utime(policy / "config.json", ns=(1, 1))  # a rewrite would give it a new time
    again = _run(tmp_path / "done")
    assert again.step == 2 and (policy / "config.json").stat().st_mtime_ns == 1
    assert {p.name for p in policy.iterdir()} == set(stamps)


def test_a_validation_file_is_compared_by_its_questions_too(tmp_path):
    import shutil

    from memagent.data.io import write_samples

    a, b = tmp_path / "v.jsonl", tmp_path / "copy.jsonl"
    write_samples(a, VAL[1])

    def run(path, *extra):
        t = Trainer(_cfg(tmp_path / "cut", f"data.val_path={path}", "run.val_every=1", "data.val_context_multipliers=[1]",
                         *extra), train_samples=TRAIN, reward_fn=parity_reward)
        t.fit()
        return t

    first = run(a, "run.stop_after_step=1")
    assert first.data_sha256["data.val_path"] == samples_sha256(VAL[1])
    shutil.copy(a, b)
    a.write_text(a.read_text().replace(VAL[1][0].question, VAL[1][0].question + " Sure?", 1))
    with pytest.raises(ConfigError, match=r"data.val_path: 'questions with sha256 [0-9a-f]{12}\.\.\.' ->"):
        run(a)
    assert run(b).step == 2  # the original questions under another path resume


def test_a_run_stopped_in_its_first_step_leaves_no_config_json(tmp_path, monkeypatch):
    """A run refused or interrupted before it wrote metrics or a checkpoint leaves its folder as it found it, so
    the folder does not pass for a run; one that trained keeps config.json when a later step fails."""
    t = Trainer(_cfg(tmp_path / "out"), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(t, "train_step", boom)
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    assert not (tmp_path / "out").exists()  # the folder it made, empty again, is removed too
    (tmp_path / "kept").mkdir()  # an earlier attempt's config.json (killed before its first metrics) is restored
    from memagent.train.config import TrainConfig, config_to_dict

    earlier = json.dumps(config_to_dict(TrainConfig()), indent=1)
    (tmp_path / "kept" / "config.json").write_text(earlier)
    t = Trainer(_cfg(tmp_path / "kept"), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)
    monkeypatch.setattr(t, "train_step", boom)
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    assert (tmp_path / "kept" / "config.json").read_text() == earlier  # not this run's (lr 1e-2, 2 steps)
    done = _run(tmp_path / "done", "run.stop_after_step=1")
    again = Trainer(_cfg(tmp_path / "done"), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)
    assert again.step == 1
    monkeypatch.setattr(again, "train_step", boom)
    with pytest.raises(KeyboardInterrupt):
        again.fit()
    assert json.loads((tmp_path / "done" / "config.json").read_text())["run"]["total_steps"] == 2 == done.cfg.run.total_steps


def test_a_resume_already_past_stop_after_step_checkpoints_the_step_it_stops_after(tmp_path):
    # the same command run twice: the second resumes at step 1 and stops after step 2; step 2 was logged but not
    # checkpointed (save_every=0), so every rerun threw it away and trained it again
    out = tmp_path / "run"
    _run(out, "run.total_steps=3", "run.save_every=0", "run.stop_after_step=1")
    second = _run(out, "run.total_steps=3", "run.save_every=0", "run.stop_after_step=1")
    assert second.step == 2
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000001.pt", "step_000002.pt"]
    again = Trainer(_cfg(out, "run.total_steps=3", "run.save_every=0"), train_samples=TRAIN, val_samples=VAL)
    assert again.step == 2
    again.close()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_shuffled_step_across_an_epoch_boundary_may_meet_a_question_again(tmp_path):
    # 3 questions, 2 per step, reshuffled every epoch: step 2 takes epoch 0's last question and epoch 1's first,
    # which with seed 0 is the same question; the rollouts refused it ("sample id 't-2#g0' appears more than once")
    from memagent.train.data import step_samples

    three = TRAIN[:3]
    cfg = _cfg(tmp_path, "data.shuffle=true", "run.seed=0")
    taken = [[s.id for s in step_samples(three, cfg, p, 0, 1)[0]] for p in (0, 2, 4)]
    assert taken == [["t-0", "t-1"], ["t-2", "t-2@epoch1"], ["t-1", "t-0"]]
    assert sorted(taken[0] + taken[1][:1]) == ["t-0", "t-1", "t-2"]  # each question once per epoch
    t = Trainer(cfg, train_samples=three, val_samples=VAL, reward_fn=parity_reward)
    t.fit()
    assert t.step == 2
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
