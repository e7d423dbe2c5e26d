"""Exporting a trained policy: HF model directories, GGUF models and llama.cpp LoRA adapters.

- :mod:`memagent.export.gguf_lora`: a peft LoRA adapter as a llama.cpp LoRA adapter GGUF (the rollout engine
  loads one after every training step).
- :mod:`memagent.export.gguf_model`: a full HF llama model as a GGUF that llama.cpp runs.
- :mod:`memagent.export.run`: what a run folder must hold, and ``memagent export RUN_DIR --out DIR``.
"""
