"""repetition_penalty, an agent setting added end to end: one field in AgentConfig and one entry in the
backends' sampling table. It reaches every backend that has it under that engine's own name, is refused by one
that does not, is an option of run/eval, a key of eval grids (in the method hash), and is checked on resume."""

import json
import sys
import types

import pytest
from typer.testing import CliRunner

from memagent.agent.config import AgentConfig
from memagent.agent.loop import MemoryAgent
from memagent.backends.openai_compat import build_payload
from memagent.backends.scripted import ScriptedBackend
from memagent.errors import ConfigError
from memagent.types import Message, Request


class Recording(ScriptedBackend):
    """A scripted model that takes every sampling setting (records requests instead of applying them)."""

    def generate(self, requests):
        self.seen = [r.sampling for r in requests]
        return super().generate([Request(r.messages, r.max_tokens, r.temperature, r.top_p, r.seed, r.request_id)
                                 for r in requests])


def _request(penalty):
    return Request((Message("user", "say cat cat cat"),), 8, sampling={"repetition_penalty": penalty}, request_id="r1")


def test_default_is_off_and_sent_only_when_set():
    assert AgentConfig().repetition_penalty == 1.0 and AgentConfig().sampling_options() == {}
    assert AgentConfig(repetition_penalty=1.3).sampling_options() == {"repetition_penalty": 1.3}
    with pytest.raises(ConfigError, match="repetition_penalty must be > 0.0, got 0.0"):
        AgentConfig(repetition_penalty=0)
    backend = Recording()
    MemoryAgent(backend, AgentConfig(chunk_tokens=50, repetition_penalty=1.3)).answer("q?", "x" * 120)
    assert backend.seen == [{"repetition_penalty": 1.3}]
    MemoryAgent(backend, AgentConfig(chunk_tokens=500)).answer("q?", "x")
    assert backend.seen == [{}]


def test_a_backend_without_it_refuses_it_by_name():
    with pytest.raises(ConfigError, match=r"the scripted backend cannot apply repetition_penalty=1.2; leave it at its "
                                          r"default, or use a backend that takes it \(hf, llamacpp, openai, vllm\)"):
        ScriptedBackend().generate([_request(1.2)])


def test_openai_sends_the_body_field():
    payload = build_payload(_request(1.15), "m")
    assert payload["repetition_penalty"] == 1.15
    assert "repetition_penalty" not in build_payload(Request((Message("user", "x"),), 8), "m")


def test_llamacpp_passes_repeat_penalty(gguf_path):
    from memagent.backends.llamacpp import LlamaCppBackend

    b = LlamaCppBackend(gguf_path, n_ctx=512, n_threads=1)
    seen = []
    real = b._llm.generate

    def spy(tokens, **kw):
        seen.append(kw["repeat_penalty"])
        return real(tokens, **kw)

    b._llm.generate = spy
    try:
        b.generate([_request(1.4), Request((Message("user", "hi"),), 4)])
    finally:
        b.close()
    assert seen == [1.4, 1.0]  # the no-op value when the request carries none


def test_hf_passes_it_in_the_generation_config(tiny, one_torch_thread):
    from memagent.backends.hf import HFBackend

    model, tok = tiny
    b = HFBackend(model, tok, max_batch_size=4)
    seen = []
    real = model.generate

    def spy(**kw):
        seen.append(kw["generation_config"].repetition_penalty)
        return real(**kw)

    model.generate = spy
    try:
        b.generate([_request(1.4), _request(1.4), Request((Message("user", "hi"),), 4)])
    finally:
        del model.generate
    # one batch per distinct setting; a request without one leaves it unset (transformers: off)
    assert seen == [1.4, None]


def test_vllm_passes_it_in_sampling_params(monkeypatch, tiny):
    pytest.importorskip("transformers")
    from memagent.backends.vllm import VLLMBackend

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    mod = types.ModuleType("vllm")
    mod.SamplingParams = SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    params = []

    class LLM:
        def generate(self, prompts, ps, use_tqdm=False):
            params.extend(ps)
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1])]) for _ in prompts]

    _, tok = tiny
    b = VLLMBackend("tiny", tokenizer=tok, llm=LLM(), context_tokens=512)
    b.generate([_request(1.25)])
    assert params[0].repetition_penalty == 1.25


def test_run_and_eval_take_the_option_and_record_it(tmp_path):
    from memagent.cli import app
    from memagent.eval.grid import EvalConfig

    doc = tmp_path / "d.txt"
    doc.write_text("some text")
    r = CliRunner().invoke(app, ["run", "-q", "Q", "-d", str(doc), "-b", "scripted", "--repetition-penalty", "1.2"])
    assert r.exit_code == 2 and "the scripted backend cannot apply repetition_penalty=1.2" in r.output
    r = CliRunner().invoke(app, ["run", "-q", "Q", "-d", str(doc), "-b", "scripted", "--repetition-penalty", "0"])
    assert r.exit_code == 2 and "repetition_penalty must be > 0.0" in r.output
    grid = {"backend": {"name": "scripted"}, "tasks": [{"name": "vt", "lengths": [8]}]}
    plain = EvalConfig.from_dict({**grid, "methods": [{"name": "m"}]})
    set_ = EvalConfig.from_dict({**grid, "methods": [{"name": "m", "repetition_penalty": 1.1}]})
    assert set_.methods[0].record()["repetition_penalty"] == 1.1 and "repetition_penalty" not in plain.methods[0].record()
    assert set_.method_hash(set_.methods[0]) != plain.method_hash(plain.methods[0])


def test_resume_refuses_another_penalty(tmp_path, monkeypatch):
    import memagent.cli as cli
    from memagent.cli import app

    monkeypatch.setattr(cli, "open_backend", lambda *a, **k: (Recording(), None))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"s{i}", "question": "q", "context": "doc"}) + "\n" for i in range(2)))
    args = ["run", "-i", str(inp), "-o", str(out)]
    assert CliRunner().invoke(app, [*args, "--repetition-penalty", "1.2"]).exit_code == 0
    assert json.loads(out.read_text().splitlines()[0])["settings"]["repetition_penalty"] == 1.2
    r = CliRunner().invoke(app, [*args, "--resume"])  # now at its default: differs from the rows
    assert r.exit_code == 2 and "repetition_penalty: 1.2 -> 1.0" in r.output
    assert CliRunner().invoke(app, [*args, "--overwrite"]).exit_code == 0  # rows without it (at the default) ...
    r = CliRunner().invoke(app, [*args, "--resume", "--repetition-penalty", "1.3"])
    assert r.exit_code == 2 and "repetition_penalty: 1.0 -> 1.3" in r.output  # ... count as the default


def test_training_does_not_take_it():
    from memagent.train.config import load_config

    with pytest.raises(ConfigError, match="unknown config key agent.repetition_penalty"):
        load_config("configs/train_cpu_small.yaml", ["agent.repetition_penalty=1.2"])
