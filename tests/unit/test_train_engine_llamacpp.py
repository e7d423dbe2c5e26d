"""The llama.cpp rollout engine's refusals and window rule (no GGUF is loaded)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.errors import ConfigError  # noqa: E402
from memagent.train.config import load_config  # noqa: E402
from memagent.train.distributed import DistInfo  # noqa: E402
from memagent.train.engine import make_engine  # noqa: E402
from memagent.train.engine_llamacpp import rollout_window_tokens  # noqa: E402
from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer  # noqa: E402


def _cfg(tmp_path, *extra):
    return load_config("configs/train_cpu_small.yaml", [f"run.output_dir={tmp_path}", "run.rollout_engine=llamacpp",
                                                        *extra])


def test_full_fine_tuning_is_refused_saying_to_use_lora(tmp_path):
    tok = make_tiny_tokenizer()
    with pytest.raises(ConfigError, match=r"trains LoRA only; turn LoRA on \(model.lora.enabled=true\) or use run.rollout_engine hf"):
        make_engine(_cfg(tmp_path), DistInfo(), make_tiny_model(tok), tok, False)
    assert not (tmp_path / "rollout").exists()  # refused before anything is written


def test_a_policy_without_a_gguf_is_refused(tmp_path):
    peft = pytest.importorskip("peft")
    tok = make_tiny_tokenizer()
    model = peft.get_peft_model(make_tiny_model(tok), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="model.path 'tiny' is not one; use model.path smollm2 or a .gguf"):
        make_engine(_cfg(tmp_path), DistInfo(), model, tok, False)
    with pytest.raises(ConfigError, match="does not run under FSDP"):
        make_engine(_cfg(tmp_path), DistInfo(), model, tok, True)
    with pytest.raises(ConfigError, match="GGUF file not found"):
        make_engine(_cfg(tmp_path, f"model.path={tmp_path / 'no.gguf'}"), DistInfo(), model, tok, False)


def test_each_sequence_gets_the_agents_budgets_plus_the_prompt_allowance(tmp_path):
    cfg = _cfg(tmp_path, "agent.chunk_tokens=512", "agent.memory_tokens=64", "agent.final_tokens=48")
    assert cfg.agent.rollout.slack_tokens == 16
    assert rollout_window_tokens(cfg, 8192) == 512 + 2 * 64 + 48 + 2 * 16 + 1024
    assert rollout_window_tokens(cfg, 1000) == 1000  # capped at the model's window
    assert rollout_window_tokens(cfg, None) == 1744


@pytest.mark.parametrize("setting, world, cores, expected", [
    (None, 1, 2, 2),   # every core: rollouts and the update take turns
    (None, 4, 2, 1),   # never below one thread per process
    (None, 2, 16, 8),  # a torchrun job divides the cores among its processes
    (3, 2, 16, 3),     # run.rollout_threads wins
])
def test_rollout_threads_default_to_the_machines_cores(tmp_path, monkeypatch, setting, world, cores, expected):
    from memagent.train.engine import LlamaCppEngine

    extra = [] if setting is None else [f"run.rollout_threads={setting}"]
    engine = LlamaCppEngine.__new__(LlamaCppEngine)  # the thread rule only; no GGUF is loaded
    engine.cfg, engine.dist = _cfg(tmp_path, "run.torch_threads=1", *extra), DistInfo(world_size=world)
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert engine.rollout_threads() == expected
