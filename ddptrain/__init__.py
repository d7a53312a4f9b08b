"""ddptrain: data-parallel training whose update is exactly the global mean-token-loss update."""

from ddptrain.distributed import get_rank, get_world_size, init_distributed, is_distributed
from ddptrain.engine.engine import Engine, StepStats
from ddptrain.engine.objective import count_valid_tokens, token_loss_sum
from ddptrain.train.final import load_model

__all__ = ["init_distributed", "Engine", "StepStats", "get_rank", "get_world_size", "is_distributed",
           "count_valid_tokens", "token_loss_sum", "load_model"]
__version__ = "0.1.0"
