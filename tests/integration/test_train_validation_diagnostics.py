"""The memory diagnostics of a training-validation folder (what the trainer can log as val/x{m}/captured_pct, ...):
the step folder's rows, traces and data are found, the synthetic needles' evidence is read, the names follow
the given prefixes."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.eval.metrics import read_results  # noqa: E402
from memagent.eval.run_diagnostics import diagnose_run, validation_metrics  # noqa: E402
from memagent.train.config import load_config  # noqa: E402
from memagent.train.synthetic import needle_samples  # noqa: E402
from memagent.train.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_validation_folder_diagnostics(tmp_path):
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={tmp_path / 'run'}", "run.resume=false", "agent.chunk_tokens=40", "agent.memory_tokens=6",
        "agent.final_tokens=6", "agent.batch_size=4",
    ])
    val = {1: needle_samples(3, 10, seed=1, prefix="v1x"), 4: needle_samples(2, 40, seed=1, prefix="v4x")}
    t = Trainer(cfg, train_samples=needle_samples(2, 10, seed=0, prefix="t"), val_samples=val)
    logged = t.validate()
    step = tmp_path / "run" / "val" / "step_000000"
    lengths = sorted({int(r["length"]) for r in read_results(step / "results.jsonl")})
    got = validation_metrics(step, {lengths[0]: "val/x1", lengths[1]: "val/x4"}, method="policy")
    # the trainer's validation returns (so logs) them next to its reward numbers
    assert {k: v for k, v in logged.items() if k in got} == got and {"val/x1/reward", "val/x4/sub_em"} <= set(logged)
    assert {"val/x1/captured_pct", "val/x4/retained_pct", "val/x1/never_captured_pct"} <= set(logged)
    for m in (1, 4):
        # no center truncation: every needle was read; the tiny random policy's 6-token memories are measured
        assert got[f"val/x{m}/read_pct"] == 100.0
        assert 0.0 <= got[f"val/x{m}/captured_pct"] <= 100.0 and 0.0 <= got[f"val/x{m}/retained_pct"] <= 100.0
        assert got[f"val/x{m}/memory_tokens_mean"] <= 6.0
        shares = [got[f"val/x{m}/{k}_pct"] for k in ("correct", "retained_wrong", "captured_then_lost", "never_captured",
                                                      "not_read", "in_view_wrong", "unmeasured", "error")]
        assert sum(shares) == pytest.approx(100.0) and got[f"val/x{m}/unmeasured_pct"] == 0.0
    diags = diagnose_run(step)
    assert len(diags) == 5 and all(d.note == "" and d.health is not None for d in diags)
    assert {len(d.targets) for d in diags} == {1}  # one needle each, found through the manifest's data files
