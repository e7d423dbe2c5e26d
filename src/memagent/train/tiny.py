"""A tiny random-weight Llama with a byte-level BPE tokenizer and a chat template, built offline.

For tests, CI smoke runs and dry runs of the trainer (``model: tiny`` in a training config). It answers
nonsense but exercises every code path of rollout, batching and update in well under a second per step.
"""

from __future__ import annotations

import os
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Memory: the answer is \\boxed{42}.",
    "You are reading a document section by section. Update the memory with facts relevant to the question.",
    "Question: what is the special magic number? Section: the special magic number for apple is 7341.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 <>{}[]()\\/.,;:!?'\"-_=+*&^%$#@~`|\n\t",
]


def make_tiny_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` (exact round trip of any text) with a chat template.

    It is trained on a few sentences and the default prompt templates, so prompts stay short in tokens.
    """
    from memagent.agent.prompts import DEFAULT_TEMPLATES
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _CORPUS + [DEFAULT_TEMPLATES.update, DEFAULT_TEMPLATES.final, DEFAULT_TEMPLATES.no_memory]
    raw.train_from_iterator(corpus * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(tokenizer: Any, seed: int = 0, hidden: int = 32, layers: int = 2, max_positions: int = 4096) -> Any:
    """A random-weight ``LlamaForCausalLM`` (float32) sized to ``tokenizer``'s vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Write a tiny model and tokenizer to ``out_dir`` (an HF directory loadable by ``HFBackend``)."""
    tok = make_tiny_tokenizer()
    model = make_tiny_model(tok, seed=seed)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return os.fspath(out_dir)
