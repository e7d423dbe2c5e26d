"""Trainer validation goes through the eval runner: per-sample rows on disk, the same answers as the trainer's
own agent, the returned means computed from those rows, and a repeated validation at the same step resumes
instead of counting samples twice."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.eval.metrics import read_results, summarize  # noqa: E402
from memagent.train.config import load_config  # noqa: E402
from memagent.train.synthetic import needle_samples  # noqa: E402
from memagent.train.trainer import Trainer  # noqa: E402
from memagent.verifiers import sub_em  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _trainer(out, reward="strict_boxed"):
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={out}", "run.resume=false", "agent.chunk_tokens=40", "agent.memory_tokens=6",
        "agent.final_tokens=6", "agent.batch_size=4", f"rl.reward={reward}",
    ])
    val = {1: needle_samples(3, 10, seed=1, prefix="v1x"), 4: needle_samples(2, 40, seed=1, prefix="v4x")}
    return Trainer(cfg, train_samples=needle_samples(2, 10, seed=0, prefix="t"), val_samples=val)


def test_validation_rows_match_agent_and_resume(tmp_path):
    t = _trainer(tmp_path / "run")
    res = t.validate()
    scores = {f"val/x{m}/{k}" for m in (1, 4) for k in ("reward", "sub_em", "boxed", "n_error")}
    # the rest are the memory diagnostics of the step's folder (tests/integration/test_train_validation_diagnostics.py)
    assert scores <= set(res) and {k.split("/")[1] for k in res} == {"x1", "x4"}
    assert all(k.endswith(("_pct", "_mean")) for k in set(res) - scores) and "val/x4/captured_pct" in res

    run_dir = tmp_path / "run" / "val" / "step_000000"
    rows = read_results(run_dir / "results.jsonl")
    assert len(rows) == 5 and {r["method"] for r in rows} == {"policy"} and {r["task"] for r in rows} == {"val"}
    assert (run_dir / "manifest.json").exists() and list((run_dir / "traces" / "policy").iterdir())

    # cells are keyed by the mean document length in tokens of the policy's tokenizer
    tok = t.backend.tokenizer
    for m in (1, 4):
        want_len = round(sum(len(tok.encode(s.context)) for s in t.val_samples[m]) / len(t.val_samples[m]))
        cell = [r for r in rows if r["length"] == want_len]
        assert sorted(r["sample_id"] for r in cell) == sorted(s.id for s in t.val_samples[m])
        # the runner's greedy answers are the trainer's own agent's answers, byte for byte
        trajs = t.agent(0.0, 1.0, t.cfg.run.seed).run(t.val_samples[m])
        by_id = {r["sample_id"]: r for r in cell}
        assert [by_id[s.id]["response"] for s in t.val_samples[m]] == [tr.response for tr in trajs]
        got_sub_em = sum(sub_em(tr.answer, s.answers) for s, tr in zip(t.val_samples[m], trajs)) / len(trajs)
        assert res[f"val/x{m}/sub_em"] == pytest.approx(got_sub_em)
        assert res[f"val/x{m}/reward"] == pytest.approx(sum(r["scores"]["strict_boxed"] for r in cell) / len(cell))
        assert res[f"val/x{m}/n_error"] == 0.0
    assert {c.n for c in summarize(rows)} == {3, 2}

    # validating again at the same step resumes: no row is written twice, the numbers are unchanged
    lines_before = (run_dir / "results.jsonl").read_text().splitlines()
    assert t.validate() == res
    assert (run_dir / "results.jsonl").read_text().splitlines() == lines_before
    assert all(json.loads(x)["status"] == "ok" for x in lines_before)


def test_validation_reward_follows_rl_reward(tmp_path):
    t = _trainer(tmp_path / "run", reward="sub_em")
    res = t.validate()
    assert res["val/x1/reward"] == res["val/x1/sub_em"]
    rows = read_results(tmp_path / "run" / "val" / "step_000000" / "results.jsonl")
    assert {tuple(r["scores"]) for r in rows} == {("sub_em",)}


def test_validation_rows_carry_context_length(tmp_path):
    t = _trainer(tmp_path / "run")
    t.validate()
    rows = read_results(tmp_path / "run" / "val" / "step_000000" / "results.jsonl")
    tok = t.backend.tokenizer
    want = {s.id: len(tok.encode(s.context)) for m in (1, 4) for s in t.val_samples[m]}
    assert {r["sample_id"]: r["context_tokens"] for r in rows} == want


def test_validation_rows_of_other_settings_name_the_folder_to_delete(tmp_path):
    from memagent.errors import ConfigError

    _trainer(tmp_path / "run").validate()  # an earlier start, killed before its first checkpoint
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={tmp_path / 'run'}", "run.resume=false", "agent.chunk_tokens=40", "agent.memory_tokens=8",
        "agent.final_tokens=6", "agent.batch_size=4",
    ])
    t = Trainer(cfg, train_samples=needle_samples(2, 10, seed=0, prefix="t"),
                val_samples={1: needle_samples(3, 10, seed=1, prefix="v1x")})
    folder = tmp_path / "run" / "val" / "step_000000"
    with pytest.raises(ConfigError, match=rf"validation at step 0: {folder} holds rows this run cannot continue .* Delete {folder}"):
        t.validate()
