"""Safe loading: every torch file ddptrain reads is loaded with weights_only=True and an explicit
allowlist; a pickled object outside it is refused by name and none of it runs."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from ddptrain.fsutil import UnsafeFileError, load_torch
from ddptrain.runs import store as ckpt


class _SideEffect:
    """Unpickling it would create a directory: the side effect a refused file must never have."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_a_trainer_state_with_a_pickled_object_is_refused_and_its_side_effect_never_happens(tmp_path):
    witness = tmp_path / "the-side-effect-happened"
    path = ckpt.write_checkpoint(tmp_path / "run", 2, {"step": 2, "payload": _SideEffect(witness)})
    assert ckpt.agree_on_checkpoint(tmp_path / "run", "auto") == path  # its digests are fine: only the content is bad
    with pytest.raises(ckpt.CheckpointError, match=r"trainer.pt holds a pickled object outside ddptrain's allowlist "
                                                   r"\(the global os.makedirs\).*checkpoints you trust"):
        ckpt.load_trainer_state(path)
    torch.save({"python": _SideEffect(witness)}, path / "rng_rank0.pt")
    with pytest.raises(ckpt.CheckpointError, match="rng_rank0.pt holds a pickled object"):
        ckpt.load_rng_for_rank(path, 0, 1, 1)
    assert not witness.exists()


def test_rng_states_and_optimizer_states_load_under_the_allowlist(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    ckpt.load_rng_state(load_torch(tmp_path / "rng.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    assert load_torch(tmp_path / "optimizer.pt")["param_groups"][0]["betas"] == (0.8, 0.9)
    torch.save({"f": print}, tmp_path / "function.pt")
    with pytest.raises(UnsafeFileError, match="function.pt"):
        load_torch(tmp_path / "function.pt")
