import json

import pytest

from memagent.errors import DataError
from memagent.train.curves import main, read_metrics, validation_table

ROWS = [
    {"step": 0, "val/x1/reward": 0.5, "val/x4/reward": 0.125},
    {"step": 1, "reward/mean": 0.25},
    {"step": 2, "reward/mean": 0.5, "val/x1/reward": 0.75, "val/x4/reward": 0.25},
]


def test_validation_table_values():
    assert validation_table(ROWS).splitlines()[:4] == [
        "| step | x1/reward | x4/reward |",
        "|---|---|---|",
        "| 0 | 50.0 | 12.5 |",
        "| 2 | 75.0 | 25.0 |",
    ]
    assert validation_table([{"step": 1, "reward/mean": 0}]) == "(no validation rows)\n"
    counted = validation_table([{"step": 3, "val/x2/sub_em": 0.25, "val/x2/n_error": 3.0}])
    assert counted.splitlines()[2] == "| 3 | 3 | 25.0 |"  # n_error is a count, not a percentage
    assert "`x2`: held-out samples at 2x the training context length" in counted
    # validation's memory diagnostics: capture and retention shown as the percentages they are, the rest left out
    diag = validation_table([{"step": 4, "val/x1/reward": 0.5, "val/x1/captured_pct": 62.5, "val/x1/retained_pct": 25.0,
                              "val/x1/memory_tokens_mean": 41.0, "val/x1/never_captured_pct": 37.5}])
    assert diag.splitlines()[:3] == ["| step | x1/captured_pct | x1/retained_pct | x1/reward |", "|---|---|---|---|",
                                     "| 4 | 62.5 | 25.0 | 50.0 |"]
    # a validation whose scores are all null (no sample answered) or that logged other metrics only gets no line
    # and opens no column; before, it made a header of one empty column and a line of blank cells
    assert validation_table([{"step": 5, "val/x1/reward": None, "val/x1/captured_pct": None}]) == "(no validation rows)\n"
    assert validation_table([{"step": 5, "val/x1/time_s": 12.0}]) == "(no validation rows)\n"
    mixed = validation_table([{"step": 5, "val/x1/reward": None, "val/x1/captured_pct": None},
                              {"step": 6, "val/x1/reward": 0.5, "val/x1/captured_pct": None}])
    assert mixed.splitlines()[:3] == ["| step | x1/reward |", "|---|---|", "| 6 | 50.0 |"]


def test_curves_from_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert read_metrics(run) == ROWS
    main([str(run), str(tmp_path / "out")])
    png = (tmp_path / "out" / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 2 | 75.0 | 25.0 |" in (tmp_path / "out" / "validation.md").read_text()
    (run / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2: not JSON"):
        read_metrics(run)
    with pytest.raises(DataError, match="no metrics.jsonl"):
        read_metrics(tmp_path)
    with pytest.raises(SystemExit, match="error: no metrics.jsonl"):
        main([str(tmp_path / "missing"), str(tmp_path / "out")])
    # a line that is JSON but no metrics row, and an OUT_DIR under a file: errors, not tracebacks
    for bad in ('[1, 2]\n', '{"reward/mean": 0.5}\n', '{"step": true}\n'):
        (run / "metrics.jsonl").write_text('{"step": 1}\n' + bad)
        with pytest.raises(DataError, match=r"metrics.jsonl:2: not a metrics row"):
            read_metrics(run)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match=r"error: OUT_DIR .*afile/sub' is under .*afile', which is a file"):
        main([str(run), str(tmp_path / "afile" / "sub")])


def test_reward_choices():
    pytest.importorskip("torch")
    from memagent.scoring import score

    def _reward_fn(name):
        return lambda response, answers: score(name, response, answers)

    sub = _reward_fn("sub_em")
    assert sub("The special number is 4417093.", ["4417093"]) == 1.0  # raw-text fallback still scores
    assert sub("\\boxed{12}", ["4417093"]) == 0.0
    strict = _reward_fn("strict_boxed")
    assert strict("The special number is 4417093.", ["4417093"]) == 0.0  # no box: the strict reward is 0
    assert strict("so \\boxed{4417093}", ["4417093"]) == 1.0
