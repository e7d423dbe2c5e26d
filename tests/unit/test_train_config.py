import json
import pathlib

import pytest

from memagent.errors import ConfigError
from memagent.train.config import TrainConfig, apply_overrides, config_to_dict, load_config


def test_reference_preset_states_reference_values():
    c = load_config("configs/train_reference_7b.yaml")
    assert (c.agent.rollout.chunk_tokens, c.agent.rollout.memory_tokens, c.rl.group_size) == (5000, 1024, 16)
    assert (c.rl.prompts_per_step, c.rl.mini_batches) == (128, 16)
    assert (c.optim.lr, c.optim.warmup_steps, c.optim.schedule) == (1e-6, 20, "constant")
    assert (c.rl.loss.clip_low, c.rl.loss.clip_high, c.rl.loss.dual_clip) == (0.2, 0.2, 3.0)
    assert (c.rl.loss.kl_type, c.rl.loss.kl_coef, c.rl.loss.agg_mode, c.rl.normalize_std) == ("k3", 0.001, "token-mean", False)
    assert (c.optim.grad_clip, c.optim.weight_decay, c.optim.betas) == (1.0, 0.01, (0.9, 0.999))


def test_overrides_and_types():
    c = load_config("configs/train_cpu_small.yaml", ["rl.group_size=8", "optim.lr=3e-5", "rl.dual_clip=null",
                                                     "data.val_context_multipliers=[1, 2]"])
    assert c.rl.group_size == 8 and c.optim.lr == 3e-5 and c.rl.loss.dual_clip is None
    assert c.data.val_context_multipliers == (1, 2)
    assert isinstance(c, TrainConfig)
    json.dumps(config_to_dict(c))
    assert apply_overrides({"a": {"b": 1}}, ["a.c=x"]) == {"a": {"b": 1, "c": "x"}}


@pytest.mark.parametrize("override, message", [
    (["rl.grup_size=4"], "did you mean rl.group_size"),
    (["rl.group_size=four"], "rl.group_size must be an integer"),
    (["rl.agg_mode=mean"], "rl.agg_mode must be one of"),
    (["model.dtype=float16"], "model.dtype must be one of"),
    (["rl.dual_clip=0.5"], "dual_clip must be > 1"),
    (["rl.mini_batches=100"], "must not exceed the trajectories per step"),
    (["optim.lr"], "is not key=value"),
    (["run.tensorboard=maybe"], "must be true or false"),
    (["data.synthetic_train_size=0"], "synthetic_train_size must be >= 1"),
    (["data.val_context_multipliers=[1, 0]"], "val_context_multipliers must be whole numbers >= 1"),
    (["rl.agg_mode=seq-mean-token-sum-norm"], "needs rl.horizon_tokens"),
    (["optim.betas=[0.9, 2]"], r"need 0 <= optim.betas < 1"),
    (["optim.weight_decay=-1"], r"optim.weight_decay >= 0"),
    (["rl.kl_coef=-1"], r"need rl.kl_coef >= 0 and rl.entropy_coef >= 0"),
    (["rl.entropy_coef=-0.1"], r"need rl.kl_coef >= 0 and rl.entropy_coef >= 0"),
    (["model.logprob_chunk_tokens=0"], "model.logprob_chunk_tokens must be >= 1"),
    (["data.synthetic_context_words=-5"], "data.synthetic_context_words must be >= 1"),
    (["data.val_size=0"], "need data.val_size >= 1 and data.synthetic_val_size >= 1 .to skip validation"),
    (["data.val_context_multipliers=[]"], "val_context_multipliers needs at least one entry"),
    (["agent.batch_size=0"], "agent: batch_size must be >= 1, got 0"),
    (["agent.chunk_tokens=0"], "agent: chunk_tokens must be >= 1, got 0"),
    (["agent.temperature=0"], "agent.temperature must be > 0: rollouts sample"),
    (["agent.temperature=-1"], r"agent: temperature must be >= 0 \(0 = greedy\), got -1.0"),
    (["agent.top_p=0"], r"agent: top_p must be in \(0, 1\], got 0.0"),
    (["agent.seed=3"], "unknown config key agent.seed"),
    (["agent.val_temperature=-0.5"], r"agent.val_temperature must be >= 0 \(0 = greedy\), got -0.5"),
    (["agent.val_top_p=1.5"], r"agent.val_top_p must be in \(0, 1\], got 1.5"),
    (["agent.max_context_tokens=1"], "agent: max_context_tokens must be >= 2 or None"),
    (["run.keep_checkpoints=0"], "run.keep_checkpoints must be >= 1"),
    (["run.keep_checkpoints=-1"], "run.keep_checkpoints must be >= 1"),
    (["run.save_every=-1"], r"need run.save_every >= 0 and run.val_every >= 0"),
    (["run.stop_after_step=0"], "run.stop_after_step must be >= 1 or null"),
    (["data.val_path=v.jsonl", "data.val_context_multipliers=[1, 4]", "run.val_every=5"], "applies to synthetic validation only"),
    (["run.dist_timeout_s=0"], "run.dist_timeout_s must be >= 1"),
    (["run.torch_threads=-1"], "run.torch_threads must be >= 1 or null .torch's default., got -1"),
    (["run.torch_threads=0"], "run.torch_threads must be >= 1 or null"),
    (["run.rollout_threads=0"], "run.rollout_threads must be >= 1 or null .all cores., got 0"),
    (["optim.lr=-1"], r"need optim.lr > 0, warmup_steps >= 0, grad_clip > 0 \(got lr=-1.0, warmup_steps="),
])
def test_bad_settings_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/train_cpu_small.yaml", override)


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/nope.yaml")


def test_bfloat16_training_at_small_lr_warns():
    import warnings

    with pytest.warns(UserWarning, match="bfloat16 parameters round away AdamW updates"):
        load_config(None, ["data.synthetic=needle", "model.dtype=bfloat16", "optim.lr=1e-5"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["data.synthetic=needle", "model.dtype=float32", "optim.lr=1e-5"])
        load_config("configs/train_needle_smollm2.yaml")


def test_settings_that_defeat_the_kl_term_or_the_ratio_warn():
    """k1 as a loss term has expected gradient 0 (memagent.rl.kl); LoRA dropout makes the update's log-probs differ
    from the dropout-free old-policy pass, so with several mini-batches the ratio is not 1 on the first one."""
    import warnings

    with pytest.warns(UserWarning, match=r"rl.kl_type=k1 with rl.kl_coef > 0: .* expected gradient is 0"):
        load_config(None, ["data.synthetic=needle", "rl.kl_type=k1"])
    with pytest.warns(UserWarning, match=r"model.lora.dropout=0.1 with rl.mini_batches=2: .* the clip fires on it"):
        load_config(None, ["data.synthetic=needle", "model.lora.enabled=true", "model.lora.dropout=0.1",
                           "rl.mini_batches=2", "rl.group_size=2", "rl.prompts_per_step=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["data.synthetic=needle", "rl.kl_type=k1", "rl.kl_coef=0"])
        load_config(None, ["data.synthetic=needle", "model.lora.enabled=true", "model.lora.dropout=0.1",
                           "rl.mini_batches=1"])


def test_a_key_given_twice_in_a_training_config_is_refused_naming_both_lines(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("optim:\n  lr: 1.0e-5\nrl:\n  group_size: 4\noptim:\n  lr: 1.0e-4\n")
    with pytest.raises(ConfigError, match=r"line 5: the key 'optim' is given a second time \(first at line 1\)"):
        load_config(str(cfg))  # PyYAML kept the second section only, silently
    cfg.write_text("base: &b {lr: 1.0e-5, warmup_steps: 2}\noptim:\n  <<: *b\n  lr: 1.0e-4\n")  # merge, then override
    with pytest.raises(ConfigError, match=r"unknown .*base"):
        load_config(str(cfg))  # the override itself is allowed; only the stray 'base' section is refused


def test_a_chain_of_merges_is_not_read_as_a_key_given_twice(tmp_path):
    """A mapping that merges an anchor and overrides one of its keys, itself merged by a mapping PyYAML builds first:
    the merge flattened the middle mapping in place before its own check, so its override read as a repeated key."""
    from memagent.configtypes import DuplicateKeyError, load_yaml

    text = ("common: &c\n  lr: 1.0e-5\nnested:\n  mid: &m\n    <<: *c\n    lr: 1.0e-4\n"
            "optim:\n  <<: *m\n  warmup_steps: 2\n")
    data = load_yaml(text)
    assert data["nested"]["mid"] == {"lr": 1.0e-4} and data["optim"] == {"lr": 1.0e-4, "warmup_steps": 2}
    with pytest.raises(DuplicateKeyError, match=r"line 7: the key 'lr' is given a second time \(first at line 6\)"):
        load_yaml(text.replace("    lr: 1.0e-4\n", "    lr: 1.0e-4\n    lr: 2.0e-4\n"))  # still refused


def test_single_trajectory_groups_under_the_zero_rule_warn():
    """rl.singleton=zero gives a group of one advantage 0; with rl.group_size=1 every group is one, so no step of the
    run has a policy gradient (it loaded silently)."""
    import warnings

    import torch

    from memagent.rl.advantages import group_advantages

    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 2]), singleton="zero")
    assert adv.tolist() == [0.0, 0.0, 0.0]
    with pytest.warns(UserWarning, match=r"rl.group_size=1 with rl.singleton=zero: .* no step has a policy gradient"):
        load_config(None, ["rl.group_size=1", "rl.singleton=zero", "rl.mini_batches=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["rl.group_size=1", "rl.mini_batches=1"])  # the reference's rule: advantage = reward
        load_config(None, ["rl.group_size=2", "rl.singleton=zero"])


def test_huge_validation_multipliers_warn():
    """120 words x 100000 = 12M-word documents per validation question: warned (the threshold is 1M words);
    120 x 8000 = 960,000 words is not, nor any size when validation is off."""
    import warnings

    with pytest.warns(UserWarning, match=r"longest synthetic validation documents are 12,000,000 words each "
                                         r"\(120 x 100000\).*multipliers up to 8,333 here"):
        load_config(None, ["data.synthetic=needle", "data.val_context_multipliers=[1,100000]"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["data.synthetic=needle", "data.val_context_multipliers=[1,8000]"])
        load_config(None, ["data.synthetic=needle", "data.val_context_multipliers=[100000]", "run.val_every=0"])


def test_empty_training_file_is_named(tmp_path):
    from memagent.errors import DataError
    from memagent.train.data import train_data as _train_data

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = load_config("configs/train_cpu_small.yaml", [f"data.train_path={empty}", "data.synthetic=null"])
    with pytest.raises(DataError, match="data.train_path .*empty.jsonl holds no samples"):
        _train_data(cfg)


def test_validation_off_reads_no_validation_file(tmp_path):
    """run.val_every=0 never validates, so a configured data.val_path that is absent (a new machine where the
    validation set was not rebuilt) must not stop the run; with validation on, the same path is read and named."""
    from memagent.errors import DataError
    from memagent.train.data import val_data

    val_file = [f"data.val_path={tmp_path / 'absent_val.jsonl'}", "data.val_context_multipliers=[1]"]
    assert val_data(load_config("configs/train_cpu_small.yaml", [*val_file, "run.val_every=0"])) == {}
    # the preset's synthetic multipliers [1, 4] do not matter either when validation is off
    assert val_data(load_config("configs/train_cpu_small.yaml", [val_file[0], "run.val_every=0"])) == {}
    with pytest.raises(DataError, match="absent_val.jsonl' not found"):
        val_data(load_config("configs/train_cpu_small.yaml", [*val_file, "run.val_every=5"]))


def test_a_missing_training_file_is_named_with_where_it_was_looked_for(tmp_path, monkeypatch):
    """Without a data root the error spoke only of that ("no data root found: pass --data-root DIR", a flag memagent
    train lacks), not of data.train_path nor the file."""
    from memagent.data import paths
    from memagent.errors import DataError
    from memagent.train.data import train_data

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEMAGENT_DATA", raising=False)
    monkeypatch.setattr(paths, "_repo_default", lambda: tmp_path / "no-shared-data")
    cfg = load_config(None, ["data.train_path=typo.jsonl"])
    with pytest.raises(DataError) as e:
        train_data(cfg)
    assert str(e.value) == (f"data.train_path 'typo.jsonl' not found (working directory {str(tmp_path)!r}); a relative "
                            "path is also looked for under the data root, and none was found ($MEMAGENT_DATA)")
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("MEMAGENT_DATA", str(root))
    with pytest.raises(DataError, match=r"data.train_path 'typo.jsonl' not found \(working directory .*\), nor under "
                                        r"the data root '.*root'"):
        train_data(cfg)
    (root / "typo.jsonl").write_text('{"id": "a", "question": "q?", "context": "doc", "answers": ["x"]}\n')
    assert [s.id for s in train_data(cfg)] == ["a"]
    monkeypatch.setenv("MEMAGENT_DATA", str(tmp_path / "typo-root"))  # set, but to no folder: not "none was found"
    with pytest.raises(DataError, match=r"not found \(working directory .*\); a relative path is also looked for "
                                        r"under the data root, and \$MEMAGENT_DATA is '.*typo-root', which is not a "
                                        r"folder$"):
        train_data(cfg)


def test_docs_list_every_option_with_its_default():
    # docs/training.md's "Every option" table: every key once, with the dataclass default
    import dataclasses
    import re
    import typing

    import yaml

    from memagent.configtypes import coerce, flat_dict
    from memagent.train.config import TrainConfig

    text = pathlib.Path("docs/training.md").read_text(encoding="utf-8").split("## Every option", 1)[1]
    documented = dict(re.findall(r"^\| `([a-z_]+(?:\.[a-z_]+)+)` \| `([^`]*)` \|", text, flags=re.M))
    hints, want = {}, {}

    def walk(part, prefix):  # flat-embedded settings (agent, loss) sit at their section's level; nested
        types = typing.get_type_hints(type(part))  # sections (model.lora) become dotted keys
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if f.metadata.get("flat"):
                inner = typing.get_type_hints(type(value))
                for key, v in flat_dict(value).items():
                    if key not in f.metadata["exclude"]:
                        want[prefix + key] = tuple(v) if isinstance(v, list) else v
                        hints[prefix + key] = inner[key]
            elif dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                want[prefix + f.name], hints[prefix + f.name] = value, types[f.name]

    walk(TrainConfig(), "")
    assert sorted(documented) == sorted(want)
    for key, raw in documented.items():
        assert coerce(yaml.safe_load(raw), hints[key], key) == want[key], key


def test_a_checkpoint_config_without_newer_settings_compares_as_their_defaults():
    from memagent.train.checkpoint import config_changes
    from memagent.train.config import config_to_dict

    now = config_to_dict(load_config(None, ["optim.lr=1e-5"]))
    old = {k: dict(v) for k, v in now.items()}
    del old["model"]["lora"]  # written before model.lora existed: a full fine-tuning run
    del old["rl"]["shared_prefix"]
    assert config_changes(old, now) == []
    lora = config_to_dict(load_config(None, ["optim.lr=1e-5", "model.lora.enabled=true", "model.lora.rank=4"]))
    assert config_changes(old, lora) == [("model.lora.enabled", False, True), ("model.lora.rank", 8, 4)]


def test_a_resume_may_change_only_the_settings_resume_changes_names(tmp_path):
    import warnings

    from memagent.errors import ConfigError
    from memagent.train.checkpoint import Checkpointer
    from memagent.train.distributed import DistInfo

    out = f"run.output_dir={tmp_path}"
    first = load_config(None, [out, "rl.kl_coef=0.001"])
    Checkpointer(first, DistInfo(), fsdp=False).save({"step": 10, "templates_hash": "t"})

    def load(*overrides):
        return Checkpointer(load_config(None, [out, *overrides]), DistInfo(), fsdp=False).load("t")

    with pytest.raises(ConfigError, match=r"other settings \(rl.kl_coef: 0.001 -> 0.05\)"):
        load("rl.kl_coef=0.05")
    with pytest.warns(UserWarning, match=r"\(step 10\) with changed settings \(rl.kl_coef: 0.001 -> 0.05\), as "
                      "run.resume_changes allows"):
        assert load("rl.kl_coef=0.05", "run.resume_changes=[rl.kl_coef]")["step"] == 10
    with pytest.raises(ConfigError, match=r"other settings \(optim.lr: 1e-06 -> 2e-06\)"):  # only the named key
        load("rl.kl_coef=0.05", "optim.lr=2e-6", "run.resume_changes=[rl.kl_coef]")
    with pytest.raises(ConfigError, match="run.resume_changes names 'rl.kl_coeff', not a setting of a training "
                                          "config; did you mean rl.kl_coef?"):
        load_config(None, [out, "run.resume_changes=[rl.kl_coeff]"])  # refused as the config loads
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing changed: no warning although the key is allowed
        assert load("rl.kl_coef=0.001", "run.resume_changes=[rl.kl_coef]")["step"] == 10


def test_an_output_dir_that_cannot_hold_a_run_is_refused_before_any_model_loads(tmp_path):
    from memagent.train.checkpoint import check_output_dir
    from memagent.train.trainer import Trainer

    (tmp_path / "doc.txt").write_text("x")
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "llama"}')
    (export / "model.safetensors").write_text("weights")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("mine")
    cases = [
        (tmp_path / "doc.txt", "'.*doc.txt' is a file; give a new or empty folder"),
        (tmp_path / "doc.txt" / "sub", "'.*sub' is under '.*doc.txt', which is a file"),
        (export, "'.*export' holds a config.json that is not a training config .an exported model.., which the run would overwrite"),
        (notes, r"'.*notes' holds files but no training run \(README.md\); give a new or empty folder"),
    ]
    import os

    if os.path.isdir("/sys"):  # a read-only file system (sysfs): refused before the model loads, not a traceback
        cases.append(("/sys/memagent-run", "'/sys/memagent-run' cannot be written \\(/sys: "))
    for out, message in cases:
        with pytest.raises(ConfigError, match="run.output_dir " + message):
            Trainer(load_config("configs/train_cpu_small.yaml", [f"run.output_dir={out}"]))
    assert (export / "config.json").read_text() == '{"model_type": "llama"}'
    run = tmp_path / "run"  # a run's folder with notes copied beside it (a committed results folder) resumes
    (run / "checkpoints").mkdir(parents=True)
    (run / "COMMANDS.txt").write_text("how it was made")
    (run / "config.json").write_text(json.dumps(config_to_dict(TrainConfig())))
    for ok in (run, tmp_path / "new", tmp_path / "empty"):
        check_output_dir(ok)
    (run / "config.json").write_text('{"run": {"total_st')  # torn by a kill: the run rewrites it
    check_output_dir(run)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "config.json").write_text("{bad")
    with pytest.raises(ConfigError, match=r"holds files but no training run \(config.json\)"):
        check_output_dir(torn)
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty")


def test_a_leading_tilde_in_a_path_setting_is_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("configs/train_cpu_small.yaml", ["data.train_path=~/x.jsonl", "run.output_dir=~/runs/a"])
    assert cfg.data.train_path == str(tmp_path / "x.jsonl") and cfg.run.output_dir == str(tmp_path / "runs" / "a")
    assert load_config("configs/train_cpu_small.yaml", ["run.output_dir=runs/~a"]).run.output_dir == "runs/~a"


def test_a_model_path_that_names_nothing_gets_a_did_you_mean():
    from memagent.train.policy import load_policy

    with pytest.raises(ConfigError, match="^model.path 'tiy' is not a file or folder; did you mean tiny. give tiny"):
        load_policy(load_config("configs/train_cpu_small.yaml", ["model.path=tiy"]))
