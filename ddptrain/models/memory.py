"""trainer.activation_checkpointing: keep only each block's input in the forward pass and recompute
the block in backward.

The activations a block saves for backward (attention inputs, the 4x-wide MLP hidden, norms) are
freed after its forward and rebuilt when backward reaches it, so activation memory drops from all
of every block's saved tensors to one tensor per block plus one block's worth at a time, for one
extra forward pass of compute (~1/3 more FLOPs per step). Checkpointing is non-reentrant
(`use_reentrant=False`): it works under DDP's no_sync, with keyword arguments (packed rows) and
with inputs that need no grad, and it restores the RNG state so dropout recomputes the same mask.
The update is unchanged: the recompute runs the same operations on the same inputs.
"""

from __future__ import annotations

from torch import nn

from ddptrain.models.build import ModelError, ModelSpec
from ddptrain.models.gpt import GPT


def enable_activation_checkpointing(module: nn.Module, spec: ModelSpec) -> nn.Module:
    """Checkpoint every transformer block of `module` (built as `spec` says); returns `module`.

    model=gpt: GPT's own per-block flag. model=hf, or a custom module that follows transformers'
    convention: its `gradient_checkpointing_enable` (per decoder layer). Any other custom module:
    a ModelError, since only the module knows where its blocks are.
    """
    from ddptrain.models import hf  # imports no transformers by itself

    if isinstance(module, GPT):
        module.activation_checkpointing = True
    elif spec.kind == "hf" or callable(getattr(module, "gradient_checkpointing_enable", None)):
        hf.enable_activation_checkpointing(module)
    else:
        target = spec.config.get("_target_", spec.class_name)
        raise ModelError(f"trainer.activation_checkpointing=true: {type(module).__name__} (model._target_={target}) "
                         "has no gradient_checkpointing_enable(gradient_checkpointing_kwargs=...) method, so "
                         "ddptrain does not know its blocks; add that method (transformers' convention, e.g. "
                         "wrapping each block in torch.utils.checkpoint.checkpoint(..., use_reentrant=False)) "
                         "or set trainer.activation_checkpointing=false")
    return module
