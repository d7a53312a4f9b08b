"""A model's transformer blocks: the one rule that compile (per block) and FSDP (a shard unit per
block) both use.

The blocks are the children of an nn.ModuleList whose children all have one class: the built-in
GPT's `blocks`, a transformers model's `model.layers` (Llama) or `transformer.h` (GPT-2). When a
transformers model names its block classes in `_no_split_modules` (what accelerate and FSDP
wrapping use), the lists of those classes are the blocks, so a mixture-of-experts layer's longer
list of experts is not mistaken for them. Otherwise the longest such list is. A model without one
(a convolution, a custom module with named layers) has no blocks: [].
"""

from __future__ import annotations

from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `model`, in module order; [] when it has none (see the module docstring)."""
    lists = [child for child in model.modules()
             if isinstance(child, nn.ModuleList) and len(child) and len({type(b) for b in child}) == 1]
    declared = set(getattr(model, "_no_split_modules", None) or ())
    named = [blocks for blocks in lists if type(blocks[0]).__name__ in declared]
    if not named:
        return list(max(lists, key=len)) if lists else []  # max keeps the first of equally long lists
    found: list[nn.Module] = []
    inside: set[int] = set()  # modules within a block already found: a list there is part of that block
    for blocks in named:
        if id(blocks) not in inside:
            found.extend(blocks)
            inside.update(id(module) for block in blocks for module in block.modules())
    return found


def block_class_names(model: nn.Module) -> set[str]:
    """Class names of `model`'s transformer blocks (FSDP's default shard units); empty when none."""
    return {type(block).__name__ for block in transformer_blocks(model)}
