"""A tiny chat Llama and prompt records for the GRPO tests."""

from __future__ import annotations

import random

from tests.data.chats import WORDS, save_chat_tokenizer
from tests.helpers import import_optional

torch = import_optional("torch")


def save_chat_llama(directory, seed: int = 0):
    """A tiny Llama with the chat tokenizer beside it: a model=hf directory."""
    transformers = import_optional("transformers")
    save_chat_tokenizer(directory)
    vocab = len(transformers.AutoTokenizer.from_pretrained(directory))
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def prompt_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))}],
             "answer": str(i), "pid": i, "kind": "skip" if i % 5 == 4 else "keep"} for i in range(count)]
