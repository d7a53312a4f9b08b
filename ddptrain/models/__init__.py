"""Models: plain nn.Modules built from config; strategies wrap them."""

from ddptrain.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
