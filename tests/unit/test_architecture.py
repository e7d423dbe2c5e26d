"""One home per concern: the package's shape, settings declared once, one scoring rule, one resume rule, one
backend per distinct method backend, and committed run folders that still resume."""

import importlib.util
import json
import pathlib

import pytest

from memagent.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("architecture_check", REPO / "benchmarks" / "architecture_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_files_functions_layers_cycles_and_one_declaration_of_chunk_tokens():
    arch = _checker()
    known = arch.modules()
    assert arch.long_files(known) == []
    assert arch.long_functions(known) == []
    assert arch.import_violations(known) == []
    assert arch.cycles(known) == []
    assert arch.classes_declaring("chunk_tokens", known) == ["memagent.agent.config.AgentConfig"]


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    arch = _checker()
    pkg = tmp_path / "memagent"
    (pkg / "rl").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "rl" / "__init__.py").write_text("")
    (pkg / "rl" / "bad.py").write_text("def f():\n    from memagent.train.trainer import Trainer\n")
    (pkg / "train").mkdir()
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "trainer.py").write_text("import memagent.rl.bad\n")
    monkeypatch.setattr(arch, "SRC", pkg)
    known = arch.modules()
    bad = arch.import_violations(known)
    assert "memagent.rl.bad (layer 1) imports memagent.train.trainer (layer 6)" in bad
    assert "memagent.rl.bad imports memagent.train.trainer: rl/ is pure tensor code" in bad
    assert arch.cycles(known) == [["memagent.rl.bad", "memagent.train.trainer"]]


def test_score_reads_the_raw_response_for_strict_rewards_only():
    from memagent.scoring import score

    assert score("strict_boxed", "The answer is Paris.", ["Paris"]) == 0.0  # no box: the strict reward is 0
    assert score("strict_boxed", "so \\boxed{Paris}", ["Paris"]) == 1.0
    assert score("sub_em", "The answer is Paris.", ["Paris"]) == 1.0  # extracted: "Paris"
    assert score("exact_match", "The answer is Paris.", ["Paris"]) == 1.0
    assert score("exact_match", "Paris, I think, is the answer is nothing", ["Paris"]) == 0.0


def test_settings_come_from_agent_config_everywhere():
    """The eval method and the training config embed AgentConfig, flat in YAML; did-you-mean still works."""
    from memagent.agent.config import AgentConfig
    from memagent.eval.grid import EvalConfig
    from memagent.train.config import load_config

    grid = EvalConfig.from_dict({"backend": {"name": "scripted"}, "tasks": [{"name": "vt", "lengths": [8]}],
                                 "methods": [{"name": "m", "chunk_tokens": 300, "slack_tokens": 4}]})
    assert isinstance(grid.methods[0].agent, AgentConfig) and grid.methods[0].agent.chunk_tokens == 300
    assert grid.to_dict()["methods"][0]["slack_tokens"] == 4  # off its default: recorded
    assert "strict" not in grid.to_dict()["methods"][0]  # at its default and newer than the record layout
    with pytest.raises(ConfigError, match="did you mean 'slack_tokens'"):
        EvalConfig.from_dict({"backend": {"name": "scripted"}, "tasks": [{"name": "vt", "lengths": [8]}],
                              "methods": [{"name": "m", "slack_token": 4}]})
    with pytest.raises(ConfigError, match="temperature is a setting of the whole grid"):
        EvalConfig.from_dict({"backend": {"name": "scripted"}, "tasks": [{"name": "vt", "lengths": [8]}],
                              "methods": [{"name": "m", "temperature": 0.5}]})
    cfg = load_config("configs/train_cpu_small.yaml", ["agent.chunk_tokens=96", "rl.clip_low=0.1", "rl.clip_high=0.3"])
    assert isinstance(cfg.agent.rollout, AgentConfig) and cfg.agent.rollout.chunk_tokens == 96
    assert (cfg.rl.loss.clip_low, cfg.rl.loss.clip_high) == (0.1, 0.3)  # by name, into the loss settings


def test_the_resume_rule():
    from memagent.runfiles import describe, setting_changes

    old = {"a": 1, "b": {"c": 2}, "lr": 0.1}
    assert setting_changes(old, {"a": 1, "b": {"c": 3}, "lr": 0.2, "new": 5}, may_change={"lr"}) == [("b.c", 2, 3)]
    # a setting the old record lacks: not compared, unless the caller knows its default
    assert setting_changes({}, {"penalty": 1.3}) == []
    assert setting_changes({}, {"penalty": 1.3}, defaults={"penalty": 1.0}) == [("penalty", 1.0, 1.3)]
    assert setting_changes({}, {"penalty": 1.0}, defaults={"penalty": 1.0}) == []
    assert describe([("b.c", 2, 3)]) == "b.c: 2 -> 3"


def test_a_method_backend_override_gets_its_own_backend_and_hash(tmp_path, monkeypatch):
    from memagent.backends.scripted import ScriptedBackend
    from memagent.data.io import write_samples
    from memagent.eval import runner as runner_mod
    from memagent.eval.grid import EvalConfig
    from memagent.runfiles import read_results
    from memagent.types import Sample

    data = tmp_path / "d.jsonl"
    write_samples(data, [Sample("s0", "q?", "some text " * 20, ("x",))])
    built = []

    class Tracked(ScriptedBackend):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.kw, self.closed = kw, False
            built.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr("memagent.backends.factory.open_backend",
                        lambda settings, tokenizer=None, check_reachable=False: (Tracked(context_tokens=settings.get("context_tokens")), None))
    method = {"kind": "memory_agent", "chunk_tokens": 100, "memory_tokens": 32, "final_tokens": 16}
    cfg = EvalConfig.from_dict({
        "output": str(tmp_path / "run"), "backend": {"name": "scripted", "context_tokens": 4000},
        "methods": [{"name": "base", **method}, {"name": "small", **method, "backend": {"context_tokens": 2000}},
                    {"name": "small2", **method, "backend": {"context_tokens": 2000}}],
        "tasks": [{"name": "mine", "lengths": [1], "samples": 1, "files": {1: str(data)}}]})
    assert cfg.backend_for(cfg.methods[1]) == {"name": "scripted", "context_tokens": 2000}
    hashes = [cfg.method_hash(m) for m in cfg.methods]
    assert hashes[1] != hashes[0] and hashes[1] != cfg.method_hash(EvalConfig.from_dict({
        **json.loads(json.dumps(cfg.to_dict())), "methods": [{"name": "small", **method}]}).methods[0])
    r = runner_mod.EvalRunner(cfg)
    rows = read_results(r.run())
    assert len(rows) == 3 and {row["method_hash"] for row in rows} == set(hashes)
    assert [b.kw["context_tokens"] for b in built] == [4000, 2000]  # the grid's, then one for both overrides
    assert built[1].closed and not built[0].closed  # the override's closed at the end; the grid's is r.backend


@pytest.mark.parametrize("folder, config", [("docs/results/embedded", "configs/eval_embedded.yaml"),
                                            ("docs/results/embedded_tiny", "configs/eval_embedded_tiny.yaml")])
def test_committed_run_folders_still_resume(tmp_path, folder, config):
    """Their rows' method hashes are the hashes the configs give now, and their data settings pass the resume
    check (a resume would run nothing and mix nothing)."""
    import shutil
    from dataclasses import replace

    from memagent.backends.scripted import ScriptedBackend
    from memagent.eval.grid import EvalConfig
    from memagent.eval.runner import EvalRunner
    from memagent.runfiles import ResultWriter, read_results

    rows = read_results(REPO / folder / "results.jsonl")
    cfg = EvalConfig.from_yaml(REPO / config)
    assert {(r["method"], r["method_hash"]) for r in rows} == {(m.name, cfg.method_hash(m)) for m in cfg.methods}
    copy = tmp_path / "run"
    shutil.copytree(REPO / folder, copy)
    runner = EvalRunner(replace(cfg, output=str(copy)), backend=ScriptedBackend(context_tokens=8192))
    writer = ResultWriter(copy / "results.jsonl")
    try:
        runner.check_resume(writer)
        assert all(writer.done[(r["method"], r["task"], int(r["length"]), r["sample_id"])] == r["status"] for r in rows)
    finally:
        writer.close()


def test_committed_training_validation_keeps_its_hash():
    """The validation rows of docs/results/train_needle were made by the trainer's validation method; the
    method the refactored trainer builds from that run's config hashes the same."""
    from memagent.eval.grid import EvalConfig, MethodConfig, TaskConfig
    from memagent.train.config import config_from_dict

    run = REPO / "docs/results/train_needle"
    cfg = config_from_dict(json.loads((run / "config.json").read_text()))
    rows = [json.loads(x) for x in (run / "val_step_000000" / "results.jsonl").read_text().splitlines()]
    ecfg = EvalConfig(methods=(MethodConfig(name="policy", agent=cfg.agent.rollout),),
                      tasks=(TaskConfig(name="val", lengths=(1,), files={1: "x.jsonl"}, metrics=("sub_em",)),),
                      seed=cfg.run.seed, temperature=cfg.agent.val_temperature, top_p=cfg.agent.val_top_p,
                      backend={"name": "hf", "model": cfg.model.path, "step": 0})
    assert {r["method_hash"] for r in rows} == {ecfg.method_hash(ecfg.methods[0])}


def test_each_document_is_tokenized_once_on_its_way_to_chunks():
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.scripted import ScriptedBackend
    from memagent.tokenization import ByteTokenizer

    class Counting(ByteTokenizer):
        calls = 0  # tokenizations of the document or a piece of it (prompts, templates and memories not counted)

        @staticmethod
        def _count(text):
            if len(text) > 100 and text in "0123456789" * 30:
                Counting.calls += 1

        def encode_with_offsets(self, text):
            self._count(text)
            return super().encode_with_offsets(text)

        def boundaries(self, text):  # the fast path the streaming chunker takes
            self._count(text)
            return super().boundaries(text)

        def encode(self, text):
            self._count(text)
            return super().encode(text)

    doc = "0123456789" * 30
    agent = MemoryAgent(ScriptedBackend(), AgentConfig(chunk_tokens=64, max_context_tokens=101), tokenizer=Counting())
    traj = agent.answer("q?", doc)
    assert Counting.calls == 1
    assert traj.document_tokens == 101  # head 51 + tail 50 tokens, exactly
    chunks = [t.chunk_chars for t in traj.turns if t.kind == "update"]
    assert chunks == [(0, 64), (64, 101)]
