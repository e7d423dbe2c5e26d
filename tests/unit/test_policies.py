"""memagent.policies: packaged policy lookup, sha256 check, and the agent settings a policy brings."""

import hashlib
import json

import pytest

import memagent.policies as policies
from memagent.errors import ConfigError


@pytest.fixture
def packaged(tmp_path, monkeypatch):
    folder = tmp_path / "niah-test"
    folder.mkdir()
    (folder / "adapter.gguf").write_bytes(b"GGUF fake adapter")
    info = {"adapter": "adapter.gguf", "adapter_sha256": hashlib.sha256(b"GGUF fake adapter").hexdigest(),
            "base": "smollm2", "agent": {"chunk_tokens": 512, "memory_tokens": 64, "final_tokens": 48,
                                         "templates": "chunk_first"}}
    (folder / "policy.json").write_text(json.dumps(info))
    monkeypatch.setattr(policies, "_HERE", tmp_path)
    return folder


def test_a_name_resolves_to_its_adapter_and_a_path_stays(packaged):
    assert policies.names() == ["niah-test"]
    assert policies.resolve_lora("niah-test") == str(packaged / "adapter.gguf")
    assert policies.resolve_lora("runs/x/adapter.gguf") == "runs/x/adapter.gguf"
    assert policies.resolve_lora(None) is None


def test_unknown_name_and_a_tampered_adapter_are_refused(packaged):
    with pytest.raises(ConfigError, match=r"no packaged policy 'niah-tset'; did you mean 'niah-test'\? packaged: niah-test"):
        policies.get("niah-tset")
    (packaged / "adapter.gguf").write_bytes(b"GGUF other bytes")
    with pytest.raises(ConfigError, match="does not match its recorded sha256"):
        policies.get("niah-test")


def test_adapter_sha256_of_a_policy_name_a_path_and_a_file_rewritten_in_place(packaged, tmp_path):
    fake = hashlib.sha256(b"GGUF fake adapter").hexdigest()
    assert policies.adapter_sha256("niah-test") == fake
    assert policies.adapter_sha256(str(packaged / "adapter.gguf")) == fake
    other = tmp_path / "mine.gguf"
    other.write_bytes(b"one")
    assert policies.adapter_sha256(str(other)) == hashlib.sha256(b"one").hexdigest()
    other.write_bytes(b"two, longer")  # rewritten in place: read again, not the remembered digest
    assert policies.adapter_sha256(str(other)) == hashlib.sha256(b"two, longer").hexdigest()
    assert policies.adapter_sha256(None) is None
    assert policies.adapter_sha256(str(tmp_path / "not-yet.gguf")) is None
    assert policies.adapter_sha256("no-such-policy") is None


def test_trained_settings_fill_only_the_options_left_at_their_defaults(packaged):
    defaults = {"chunk_tokens": 5000, "memory_tokens": 1024, "final_tokens": 1024, "templates": "default"}
    current = dict(defaults, memory_tokens=128)  # the user gave --memory-tokens 128
    assert policies.agent_overrides("niah-test", current, defaults) == {
        "chunk_tokens": 512, "final_tokens": 48, "templates": "chunk_first"}
    assert policies.agent_overrides("some/file.gguf", current, defaults) == {}
    # --chunk-tokens 5000 given explicitly (the default's value): kept
    assert policies.agent_overrides("niah-test", current, defaults, given={"chunk_tokens"}) == {
        "final_tokens": 48, "templates": "chunk_first"}


def test_base_model_is_the_policys_base_spec_and_none_for_the_shipped_file(packaged):
    assert policies.base_model("niah-test") is None  # base: smollm2 = the shipped Q4_1 file, the default
    info = json.loads((packaged / "policy.json").read_text())
    (packaged / "policy.json").write_text(json.dumps({**info, "base": "smollm2-f16"}))
    assert policies.base_model("niah-test") == "smollm2-f16"
    assert policies.base_model("runs/x/adapter.gguf") is None and policies.base_model(None) is None
    with pytest.raises(ConfigError, match="no packaged policy 'nope'"):
        policies.base_model("nope")
    # a value with a file extension is a path, never a policy name ("no packaged policy 'missing.pt'" misled)
    assert not policies.is_policy_name("missing.pt") and not policies.is_policy_name("adapter.safetensors")
    assert policies.is_policy_name("ruler-niah") and policies.resolve_lora("missing.pt") == "missing.pt"


def test_open_backend_loads_the_policys_base_unless_a_model_is_given(packaged, monkeypatch):
    import memagent.backends as backends
    from memagent.backends.factory import open_backend

    info = json.loads((packaged / "policy.json").read_text())
    (packaged / "policy.json").write_text(json.dumps({**info, "base": "smollm2-f16"}))
    seen = []
    monkeypatch.setattr(backends, "make_backend", lambda name, **kw: seen.append((name, kw)) or object())
    open_backend({"name": "llamacpp", "n_ctx": 2048, "lora_path": "niah-test"})
    open_backend({"name": "llamacpp-batch", "model_path": "my.gguf", "lora_path": "niah-test"})
    open_backend({"name": "llamacpp", "lora_path": "some/adapter.gguf"})
    assert seen == [
        ("llamacpp", {"n_ctx": 2048, "lora_path": str(packaged / "adapter.gguf"), "model_path": "smollm2-f16"}),
        ("llamacpp-batch", {"model_path": "my.gguf", "lora_path": str(packaged / "adapter.gguf")}),
        ("llamacpp", {"lora_path": "some/adapter.gguf"}),
    ]


def test_a_policy_used_otherwise_than_trained_is_warned_about(tmp_path, monkeypatch, capsys):
    """Settings given that differ from the policy's trained ones; its adapter given by path (which ran on the
    default model and budgets, silently); a file here hiding the policy's name."""
    import dataclasses
    import shutil

    from memagent.agent.config import AgentConfig
    from memagent.options import _GIVEN, _warn_about_policy_use

    fields = [f.name for f in dataclasses.fields(AgentConfig)]
    trained = policies.get("ruler-niah").agent
    token = _GIVEN.set(frozenset({"chunk_tokens", "memory_tokens"}))
    try:
        cfg = AgentConfig(chunk_tokens=64, memory_tokens=trained["memory_tokens"])
        _warn_about_policy_use("ruler-niah", cfg, fields)
        err = " ".join(capsys.readouterr().err.split())
        assert f"policy ruler-niah was trained with other settings than this run's: chunk_tokens=64 (trained " \
               f"{trained['chunk_tokens']}); it may score lower" in err and "memory_tokens=" not in err
        # the trained templates given as the file that holds them: the same templates, no warning
        from importlib import resources

        _GIVEN.set(frozenset({"templates"}))
        text = resources.files("memagent.agent").joinpath(f"templates/{trained.get('templates') or 'default'}.yaml")
        (tmp_path / "same.yaml").write_text(text.read_text(encoding="utf-8"))
        _warn_about_policy_use("ruler-niah", AgentConfig(templates=str(tmp_path / "same.yaml")), fields)
        assert "trained with other settings" not in capsys.readouterr().err
    finally:
        _GIVEN.reset(token)
    copy = tmp_path / "adapter.gguf"
    shutil.copy(policies.get("ruler-niah").adapter_path, copy)
    _warn_about_policy_use(str(policies.get("ruler-niah").adapter_path), AgentConfig(), fields)
    _warn_about_policy_use(str(copy), AgentConfig(), fields)  # another file with the same bytes: not the policy's
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("is the adapter of the packaged policy ruler-niah") == 1 and "give --lora ruler-niah" in err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ruler-niah").mkdir()
    _warn_about_policy_use("ruler-niah", AgentConfig(), fields)
    assert "--lora ruler-niah is read as the file or folder" in " ".join(capsys.readouterr().err.split())
