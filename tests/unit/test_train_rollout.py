import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.agent.loop import AgentConfig, MemoryAgent  # noqa: E402
from memagent.backends.hf import HFBackend  # noqa: E402
from memagent.backends.scripted import ScriptedBackend  # noqa: E402
from memagent.errors import DataError  # noqa: E402
from memagent.train.rollout import collect_rollouts, repeat_samples, trajectory_rows  # noqa: E402
from memagent.types import Completion, Sample, Usage  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


SAMPLES = [
    Sample("a", "Which number?", "line one\nthe number is 7\nline three\n" * 3, ("7",)),
    Sample("b", "Which colour?", "red\n", ("red",)),
]


def test_repeat_samples_ids():
    rep = repeat_samples(SAMPLES, 2)
    assert [s.id for s in rep] == ["a#g0", "a#g1", "b#g0", "b#g1"]
    assert rep[1].question == "Which number?" and rep[3].answers == ("red",)
    with pytest.raises(DataError, match="group_size"):
        repeat_samples(SAMPLES, 0)


def test_rollout_rows_match_turns_and_groups():
    backend = ScriptedBackend()
    agent = MemoryAgent(backend, AgentConfig(chunk_tokens=40, memory_tokens=60, final_tokens=30, batch_size=3))
    ro = collect_rollouts(agent, SAMPLES, group_size=3, reward_fn=lambda resp, ans: float(ans[0] == "7"))
    assert ro.rewards == (1.0, 1.0, 1.0, 0.0, 0.0, 0.0)
    assert ro.group_ids == (0, 0, 0, 1, 1, 1)
    assert [t.sample_id for t in ro.trajectories] == ["a#g0", "a#g1", "a#g2", "b#g0", "b#g1", "b#g2"]
    turns = [t for traj in ro.trajectories for t in traj.turns]
    assert len(ro.rows) == len(turns)
    assert [r.prompt_ids for r in ro.rows] == [t.prompt_token_ids for t in turns]
    assert [r.response_ids for r in ro.rows] == [t.response_token_ids for t in turns]
    n_a = len(ro.trajectories[0].turns)  # 105-byte document in 40-byte chunks -> 3 chunks + final
    assert n_a == 4
    assert [r.traj_index for r in ro.rows[: n_a + 1]] == [0] * n_a + [1]
    assert [r.is_final for r in ro.rows[:n_a]] == [False] * (n_a - 1) + [True]
    assert sum(r.is_final for r in ro.rows) == 6
    assert ro.response_tokens == sum(len(r.response_ids) for r in ro.rows)


def test_rollout_errors():
    agent = MemoryAgent(ScriptedBackend(), AgentConfig(chunk_tokens=40, memory_tokens=60, final_tokens=30))
    with pytest.raises(DataError, match="no gold answers"):
        collect_rollouts(agent, [Sample("x", "q?", "doc")], 2)
    traj = agent.answer("q?", "doc")
    no_ids = traj.turns[0].__class__(**{**traj.turns[0].__dict__, "prompt_token_ids": None})
    with pytest.raises(DataError, match="in-process"):
        trajectory_rows(traj.__class__(**{**traj.__dict__, "turns": (no_ids,) + traj.turns[1:]}), 0, 0)


def test_training_prompts_are_byte_identical_to_memagent_run(tmp_path, monkeypatch):
    """`memagent run` and a training rollout send the same prompt ids for the same inputs."""
    from typer.testing import CliRunner

    from memagent.cli import app
    from memagent.train.config import load_config
    from memagent.train.tiny import save_tiny
    from memagent.train.trainer import Trainer

    model_dir = save_tiny(tmp_path / "tiny")
    doc = "The special magic number for apple is 1234567. " * 6
    question = "What is the special magic number for apple?"
    (tmp_path / "doc.txt").write_text(doc)
    seen: list[tuple[int, ...]] = []
    original = HFBackend.generate

    def recording(self, requests):
        out = original(self, requests)
        seen.extend(c.prompt_token_ids for c in out)
        return out

    monkeypatch.setattr(HFBackend, "generate", recording)
    res = CliRunner().invoke(app, [
        "run", "--backend", "hf", "--model", model_dir, "-q", question, "-d", str(tmp_path / "doc.txt"),
        "--chunk-tokens", "40", "--memory-tokens", "8", "--final-tokens", "8", "--temperature", "0",
    ])
    assert res.exit_code == 0, res.output
    run_prompts = list(seen)
    with pytest.warns(UserWarning, match="bfloat16"):  # bf16 like `run --backend hf`; no update is taken here
        cfg = load_config("configs/train_cpu_small.yaml", [
            f"model.path={model_dir}", "model.dtype=bfloat16", "agent.chunk_tokens=40", "agent.memory_tokens=8",
            "agent.final_tokens=8", "rl.group_size=1", "rl.prompts_per_step=1",
            f"run.output_dir={tmp_path / 'out'}", "run.resume=false",
        ])
    trainer = Trainer(cfg, train_samples=[Sample("0", question, doc, ("1234567",))], val_samples={})
    ro = collect_rollouts(trainer.agent(0.0, 1.0, 0), trainer.train_samples, 1)
    train_prompts = [r.prompt_ids for r in ro.rows]
    assert len(train_prompts) == len(run_prompts) >= 3
    assert train_prompts == run_prompts
    tok = trainer.backend.tokenizer
    assert [tok.decode(p).encode() for p in train_prompts] == [tok.decode(p).encode() for p in run_prompts]


def test_run_hf_takes_the_models_context_window_by_default(tmp_path):
    from typer.testing import CliRunner

    from memagent.cli import app
    from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    make_tiny_model(tok, max_positions=128).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "doc.txt").write_text("the fox jumps over the dog. " * 40)
    args = ["run", "-b", "hf", "--model", str(tmp_path / "m"), "-q", "what?", "-d", str(tmp_path / "doc.txt"),
            "--chunk-tokens", "200", "--memory-tokens", "20", "--final-tokens", "10"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "context window of hf:m is 128 tokens" in r.output, r.output
    r = CliRunner().invoke(app, [*args, "--n-ctx", "1024"])  # an explicit window is taken as given
    assert "context window" not in r.output and r.exit_code == 0, r.output
