"""Where the embedded model lives: see :mod:`memagent.embedded` (below tokenization, which needs it too)."""

from memagent.embedded import DEFAULT_GGUF, SMOLLM2_PACKAGE, smollm2_gguf_path

__all__ = ["DEFAULT_GGUF", "SMOLLM2_PACKAGE", "smollm2_gguf_path"]
