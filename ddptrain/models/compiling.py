"""trainer.compile: torch.compile each transformer block of the model, in place.

Per block, not the whole model, as torchtitan's `apply_compile` does: per-block graphs release
gradients block by block, so DDP's all-reduces overlap the backward as in eager mode, and blocks of
the same shapes reuse one graph, so compile time does not grow with depth.

`nn.Module.compile()` compiles in place: parameter names, state_dict keys, checkpoints, export and
`isinstance` checks stay what they were (`torch.compile(model)` would add an `_orig_mod.` prefix).
Embeddings, the final norm and the LM head stay eager; the loss is computed outside the model.
Nothing compiles here: compiling happens in the first forward and backward (its cost:
docs/benchmarks.md). The Engine's fp64 cast comes after this call; the first forward compiles for
the dtype it sees.
"""

from __future__ import annotations

from torch import nn

from ddptrain.contract.blocks import transformer_blocks


def compile_model(module: nn.Module) -> nn.Module:
    """torch.compile each of `module`'s transformer blocks (ddptrain.contract.blocks) in place, the
    whole module when it has none; returns `module`. Costs nothing until the first forward (see the
    module docstring)."""
    for part in transformer_blocks(module) or [module]:
        part.compile()
    return module
