"""NaN and infinite sampling settings are refused wherever settings enter (issue 17, item 4).

NaN compares false with everything, so range checks such as ``temperature < 0`` let it through; infinity
passes every lower bound. Before the fix the embedded model sampled noise at ``--temperature nan`` (exit 0) and
the openai backend failed in its JSON encoder.
"""

from __future__ import annotations

import math

import httpx
import pytest
from typer.testing import CliRunner

from memagent.agent.loop import AgentConfig
from memagent.backends.scripted import ScriptedBackend
from memagent.configtypes import check_sampling, coerce, finite_number
from memagent.errors import ConfigError
from memagent.types import Message, Request

BAD = [math.nan, math.inf, -math.inf]


def _req(temperature=0.0, top_p=1.0, rid="s/0"):
    return Request((Message("user", "hi"),), 4, temperature, top_p, None, rid)


def test_finite_number_and_the_shared_sampling_rule():
    assert finite_number(2, "k") == 2.0 and finite_number(0.5, "k") == 0.5
    for bad in BAD:
        with pytest.raises(ConfigError, match=r"^k must be a finite number, got (nan|inf|-inf)$"):
            finite_number(bad, "k")
    with pytest.raises(ConfigError, match=r"k must be a finite number, got 1000"):
        finite_number(10**400, "k")  # too large for a float
    with pytest.raises(ConfigError, match="k must be a number, got True"):
        finite_number(True, "k")
    with pytest.raises(ConfigError, match="x must be a finite number, got nan"):
        coerce("nan", float, "x")  # YAML 1.1 can hand over the string
    check_sampling(0.0, 1.0)
    check_sampling(2.0, 1e-9)
    with pytest.raises(ConfigError, match=r"^temperature must be >= 0 \(0 = greedy\), got -0.5$"):
        check_sampling(-0.5, 1.0)
    with pytest.raises(ConfigError, match=r"^r: top_p must be in \(0, 1\], got 0$"):
        check_sampling(1.0, 0, where="r: ")


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("key", ["temperature", "top_p"])
def test_the_python_api_config_classes_refuse_non_finite_sampling(bad, key):
    from memagent.eval.grid import EvalConfig, MethodConfig, TaskConfig
    from memagent.train.config import AgentSettings, TrainConfig

    with pytest.raises(ConfigError, match=f"^{key} must be a finite number"):
        AgentConfig(**{key: bad})
    with pytest.raises(ConfigError, match=f"^{key} must be a finite number"):
        EvalConfig(methods=(MethodConfig("m"),), tasks=(TaskConfig("vt", (1024,)),), **{key: bad})
    for train_key in (key, f"val_{key}"):
        with pytest.raises(ConfigError, match=f"^agent.{train_key} must be a finite number"):
            TrainConfig(agent=AgentSettings(**{train_key: bad}))


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan"])
def test_yaml_and_dotted_overrides_refuse_non_finite_sampling(tmp_path, value):
    from memagent.eval.grid import EvalConfig
    from memagent.train.config import load_config

    grid = tmp_path / "grid.yaml"
    grid.write_text(f"temperature: {value}\nmethods: [{{name: m}}]\ntasks: [{{name: vt, lengths: [1K]}}]\n")
    with pytest.raises(ConfigError, match=r"grid\.yaml: temperature must be a finite number"):
        EvalConfig.from_yaml(grid)
    with pytest.raises(ConfigError, match=r"^agent\.top_p must be a finite number"):
        load_config("configs/train_cpu_small.yaml", [f"agent.top_p={value}"])


@pytest.mark.parametrize("bad", BAD)
def test_every_backend_refuses_a_non_finite_request_before_sending_it(bad, tiny, tmp_path, monkeypatch):
    import sys
    import types

    from memagent.backends.hf import HFBackend
    from memagent.backends.openai_compat import OpenAIBackend
    from memagent.backends.vllm import VLLMBackend

    sent = []
    openai = OpenAIBackend("http://h/v1", "m", api_key_env="X_UNSET",
                           transport=httpx.MockTransport(lambda r: sent.append(r) or httpx.Response(500)))
    model, tok = tiny
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    (tmp_path / "m").mkdir()
    vllm = VLLMBackend(str(tmp_path / "m"), tokenizer=tok, llm=object(), context_tokens=512)
    scripted = ScriptedBackend()
    for backend in (scripted, openai, HFBackend(model, tok), vllm):
        with pytest.raises(ConfigError, match=r"request 'b/1': temperature must be a finite number"):
            backend.generate([_req(rid="a/0"), _req(temperature=bad, rid="b/1")])
        with pytest.raises(ConfigError, match=r"request 'b/1': top_p must be a finite number"):
            backend.generate([_req(rid="a/0"), _req(top_p=bad, rid="b/1")])
    assert sent == [] and scripted.calls == []


@pytest.mark.slow
def test_the_embedded_backend_refuses_a_nan_temperature(gguf_path):
    from memagent.backends.llamacpp import LlamaCppBackend

    with LlamaCppBackend(gguf_path, n_ctx=256) as b:
        with pytest.raises(ConfigError, match=r"request 's/0': temperature must be a finite number, got nan"):
            b.generate([_req(temperature=math.nan)])


@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan"),
                                        ("--top-p", "-inf")])
def test_the_command_line_exits_2_before_any_call(flag, value, tmp_path):
    from memagent.cli import app

    r = CliRunner().invoke(app, ["run", "-q", "Q", "-d", "-", "-b", "scripted", flag, value], input="doc")
    key = flag[2:].replace("-", "_")
    assert r.exit_code == 2 and f"{key} must be a finite number, got {value}" in r.output, r.output
    r = CliRunner().invoke(app, ["eval", "--tasks", "vt", "--lengths", "1K", "-n", "1", "--backend", "scripted",
                                 "-o", str(tmp_path / "o"), flag, value])
    assert r.exit_code == 2 and f"{key} must be a finite number" in r.output, r.output
    assert not (tmp_path / "o" / "results.jsonl").exists()
