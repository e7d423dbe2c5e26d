"""The backend options for llama.cpp LoRA adapters and the batched llama.cpp backend (no model is loaded)."""

import pytest

from memagent.backends.factory import BackendOptions
from memagent.errors import ConfigError
from memagent.eval.grid import EvalConfig


def test_llamacpp_backends_take_lora_path_and_the_same_window_rule():
    assert BackendOptions(backend="llamacpp-batch", model="m.gguf", threads=2, lora_path="a.gguf").settings() == {
        "name": "llamacpp-batch", "n_ctx": 8192, "model_path": "m.gguf", "n_threads": 2, "lora_path": "a.gguf"}
    assert BackendOptions(lora_path="a.gguf", n_ctx=1024).settings() == {
        "name": "llamacpp", "n_ctx": 1024, "lora_path": "a.gguf"}
    assert BackendOptions().settings() == {"name": "llamacpp", "n_ctx": 8192}  # no lora_path key when unset


@pytest.mark.parametrize("backend, extra", [("hf", {"model": "d"}), ("scripted", {}),
                                            ("openai", {"model": "m", "base_url": "http://x/v1"})])
def test_lora_is_refused_by_backends_that_cannot_apply_it(backend, extra):
    with pytest.raises(ConfigError, match=f"--lora is not used by --backend {backend}.*llamacpp-batch"):
        BackendOptions(backend=backend, lora_path="a.gguf", **extra).settings()


def test_a_packaged_policy_on_another_backend_is_refused_without_pointing_at_a_training_run():
    with pytest.raises(ConfigError, match=r"^--lora ruler-niah \(a packaged policy: a llama.cpp LoRA adapter\) is not "
                                          r"used by --backend hf; drop --backend .*llamacpp-batch$") as e:
        BackendOptions(backend="hf", model="d", lora_path="ruler-niah").settings()
    assert "memagent export" not in str(e.value)


@pytest.mark.parametrize("backend, extra", [("scripted", {}), ("llamacpp", {}), ("hf", {"model": "d"})])
def test_base_url_is_refused_by_backends_that_reach_no_server(backend, extra):
    with pytest.raises(ConfigError, match=f"--base-url is not used by --backend {backend}; .*--backend openai"):
        BackendOptions(backend=backend, base_url="http://127.0.0.1:8000/v1", **extra).settings()


@pytest.mark.parametrize("backend, extra", [("scripted", {}), ("openai", {"model": "m", "base_url": "http://h/v1"}),
                                            ("hf", {"model": "d"})])
def test_engine_options_of_other_backends_are_refused_not_ignored(backend, extra):
    with pytest.raises(ConfigError, match=f"^--threads is not used by --backend {backend}; it sets the CPU threads"):
        BackendOptions(backend=backend, threads=2, **extra).settings()
    if backend != "openai":
        for option, flag in (({"timeout": 5.0}, "--timeout"), ({"max_retries": 1}, "--max-retries")):
            with pytest.raises(ConfigError, match=f"^{flag} is not used by --backend {backend}; it applies to server"):
                BackendOptions(backend=backend, **option, **extra).settings()
    assert BackendOptions(backend="llamacpp-batch", threads=2).settings()["n_threads"] == 2


def test_lora_path_is_in_the_method_hash_only_when_given():
    grid = {"backend": {"name": "llamacpp", "n_ctx": 8192},
            "methods": [{"name": "base", "chunk_tokens": 512},
                        {"name": "rl", "chunk_tokens": 512, "backend": {"lora_path": "runs/a/adapter.gguf"}},
                        {"name": "rl2", "chunk_tokens": 512, "backend": {"lora_path": "runs/b/adapter.gguf"}}],
            "tasks": [{"name": "niah_single_2", "lengths": [2048]}]}
    cfg = EvalConfig.from_dict(grid)
    base, rl, rl2 = (cfg.method_hash(m) for m in cfg.methods)
    assert len({base, rl, rl2}) == 3
    assert cfg.backend_for(cfg.methods[1]) == {"name": "llamacpp", "n_ctx": 8192, "lora_path": "runs/a/adapter.gguf"}
    alone = EvalConfig.from_dict({**grid, "methods": grid["methods"][:1]})
    assert alone.method_hash(alone.methods[0]) == base  # adding an adapter method leaves the others' hashes


def test_existing_grids_keep_their_method_hashes():
    cfg = EvalConfig.from_yaml("configs/eval_ruler_rl.yaml")
    hashes = {m.name: cfg.method_hash(m) for m in cfg.methods}
    assert {k: hashes[k] for k in ("memagent_base", "direct")} == {"memagent_base": "5012b5fc9907",
                                                                   "direct": "fb7a0e2af24c"}


def test_an_adapter_retrained_under_the_same_path_changes_the_hash(tmp_path):
    adapter = tmp_path / "adapter.gguf"
    grid = {"backend": {"name": "llamacpp"}, "tasks": [{"name": "niah_single_2", "lengths": [2048]}],
            "methods": [{"name": "rl", "chunk_tokens": 512, "backend": {"lora_path": str(adapter)}}]}
    cfg = EvalConfig.from_dict(grid)
    missing = cfg.method_hash(cfg.methods[0])
    adapter.write_bytes(b"step 18")
    first = cfg.method_hash(cfg.methods[0])
    assert first == cfg.method_hash(cfg.methods[0]) != missing
    adapter.write_bytes(b"step 40, retrained")  # (hashes are cached per path, size and mtime)
    assert cfg.method_hash(cfg.methods[0]) not in (first, missing)


def test_transport_settings_stay_out_of_the_method_hash():
    def hash_of(**backend):
        cfg = EvalConfig.from_dict({"backend": {"name": "openai", "model": "m", **backend},
                                    "methods": [{"name": "agent", "chunk_tokens": 512}],
                                    "tasks": [{"name": "niah_single_2", "lengths": [2048]}]})
        return cfg.method_hash(cfg.methods[0])

    one = hash_of(base_url="http://a/v1", concurrency=16)
    assert one == hash_of(base_url=["http://a/v1", "http://b/v1"], concurrency=256, timeout_s=30, max_retries=9,
                          api_key_env="KEY", n_threads=2)  # more replicas, more in flight: the same answers
    assert one != hash_of(base_url="http://a/v1", concurrency=16, context_tokens=4096)  # the window is not transport
    cfg = EvalConfig.from_dict({"backend": {"name": "openai", "model": "other"},
                                "methods": [{"name": "agent", "chunk_tokens": 512}],
                                "tasks": [{"name": "niah_single_2", "lengths": [2048]}]})
    assert cfg.method_hash(cfg.methods[0]) != one  # another model


def test_the_default_layout_grid_shares_direct_and_its_rows_are_the_packaged_policys():
    import json

    cfg = EvalConfig.from_yaml("configs/eval_ruler_rl_default.yaml")
    hashes = {m.name: cfg.method_hash(m) for m in cfg.methods}
    assert hashes["direct"] == "fb7a0e2af24c"  # the first grid's direct rows carry over
    committed = {}
    with open("docs/results/ruler_rl/grid_default/results.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            committed.setdefault(row["method"], set()).add(row["method_hash"])
    # memagent_rl's hash holds the packaged adapter's sha256: a retrained ruler-niah makes these rows stale
    assert committed == {name: {h} for name, h in hashes.items()}
