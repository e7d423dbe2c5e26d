"""`memagent train` then `memagent export` on the tiny model: the run folder the trainer writes is exportable."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402


def test_a_finished_run_exports_as_an_hf_model(tmp_path):
    import json
    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memagent.cli import app

    run, out = tmp_path / "run", tmp_path / "hf"
    n = torch.get_num_threads()
    train = ["train", "--config", "configs/train_cpu_small.yaml", f"run.output_dir={run}", "run.val_before_train=false",
             "run.val_every=0", "run.torch_threads=1", "rl.group_size=2", "data.synthetic_context_words=12",
             "agent.chunk_tokens=48", "agent.memory_tokens=4", "agent.final_tokens=4", "run.tensorboard=false"]
    try:
        res = CliRunner().invoke(app, [*train, "run.total_steps=1"])
        assert res.exit_code == 0, res.output
        res = CliRunner().invoke(app, ["export", str(run), "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert res.stdout.strip() == str(out) and "warning" not in res.output
        want = AutoModelForCausalLM.from_pretrained(run / "policy").state_dict()
        got = AutoModelForCausalLM.from_pretrained(out).state_dict()
        # continued past its end and stopped before the new one: policy/ still holds step 1, and export says so
        # (it exported the older weights silently)
        res = CliRunner().invoke(app, [*train, "run.total_steps=3", "run.stop_after_step=2", "run.save_every=1"])
        assert res.exit_code == 0, res.output
        assert json.loads((run / "policy" / "training_step.json").read_text()) == {"step": 1}
        res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "stale")])
        assert res.exit_code == 0 and re.search(r"warning: .*policy holds step 1, but the run's newest checkpoint is "
                                                r"step 2 .* give --checkpoint 2", " ".join(res.output.split())), res.output
    finally:
        torch.set_num_threads(n)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert AutoTokenizer.from_pretrained(out).chat_template
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "lora"), "--format", "lora-gguf"])
    assert res.exit_code == 2 and "trained without LoRA" in res.output


def test_bad_export_requests_are_named_before_any_model_loads(tmp_path):
    import json

    from memagent.cli import app

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{bad")
    (tmp_path / "doc.txt").write_text("x")
    cases = [
        ([str(run), "--out", str(tmp_path / "o"), "--dtype", "f16"], "--dtype f16 applies to --format gguf and "
                                                                    "lora-gguf; --format hf writes float32"),
        ([str(run), "--out", str(tmp_path / "doc.txt" / "sub")], "is under '.*doc.txt', which is a file; choose a new"),
        ([str(run), "--out", str(tmp_path / "o"), "--format", "gguf", "--dtype", "bf16"], "--dtype must be f16 or f32, "
                                                                                          "got 'bf16'"),
        ([str(run), "--out", str(tmp_path / "o")], "config.json: the run's training config cannot be read"),
        ([str(tmp_path / "doc.txt"), "--out", str(tmp_path / "o")], "doc.txt' is a file; give the training run's folder"),
    ]
    import os
    import re

    if os.path.isdir("/sys"):  # a read-only file system: an error before any model loads, not a PermissionError
        cases.append(([str(run), "--out", "/sys/memagent-out"], "--out '/sys/memagent-out' cannot be written"))
    for args, message in cases:
        res = CliRunner().invoke(app, ["export", *args])
        assert res.exit_code == 2 and re.search(message, " ".join(res.output.split())), res.output
    (run / "config.json").write_text(json.dumps([1]))
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "must be a JSON object, got list" in res.output, res.output
    assert not (tmp_path / "o").exists()
