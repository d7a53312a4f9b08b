"""What defines a run beyond its config, fingerprinted into every checkpoint and compared on resume.

    model   the architecture the `model` section does not spell out: model=hf's config.json
    reference  objective=dpo with full fine-tuning: the sha256 of the frozen reference's weights, the
            initial weights rebuilt from model.path (or the seed) at every launch; another model there
            would silently change the objective (LoRA's base is ModelSpec.base_weights, checked on load)
    data    the corpus: its source files (names relative to their common directory, sizes, mtimes),
            the tokenizer's (and chat template's) hash, the number of training documents, and the
            number of valid training targets (the objective's divisor over the data: an upgrade that
            tokenizes or masks the same files another way, and rebuilds its cache, changes it)

No absolute path and no cache format version, so a run dir or corpus moved whole, or a ddptrain
upgrade that builds the same examples from it, still resumes. A difference is refused with the key,
the old and the new value, like a changed config key (ddptrain/runs/resume.py);
checkpoint.accept_changed_data=true accepts a changed corpus (a file appended to, a new file
matching the glob) with a warning that the data order differs from here on. A checkpoint written before fingerprints resumes without the check, and
one written before a key of ADDED was fingerprinted is not compared on that key, so an upgrade that
fingerprints more still resumes.
"""

from __future__ import annotations

import logging
from typing import Any

from ddptrain.runs.store import CheckpointError
from ddptrain.runs.resume import config_changes, flatten

ADDED = ("data.tokenizer_class", "data.targets", "reference.weights")
"""Keys a later ddptrain fingerprints; a checkpoint without one (an older ddptrain's) is not compared on it."""

WEIGHTS = "data.weights."
"""data=mixture's weights per source: recorded, and a change is said, not refused."""

log = logging.getLogger(__name__)


def run_fingerprint(model_architecture: dict, data_inputs: dict, reference_weights: str | None = None) -> dict:
    """`reference_weights`: the sha256 of DPO's frozen reference (full fine-tuning), else None."""
    reference = {"reference": {"weights": reference_weights}} if reference_weights is not None else {}
    return {"model": model_architecture, "data": data_inputs, **reference}


def check_fingerprint(saved: dict | None, current: dict, accept_changed_data: bool) -> list[tuple[str, Any, Any]]:
    """The differences accepted (a changed corpus, with accept_changed_data); raises CheckpointError
    naming every other one. `saved` None: a checkpoint from before fingerprints, nothing to compare."""
    if saved is None:
        log.info("resume: the checkpoint holds no fingerprint of its inputs (an older ddptrain); not compared")
        return []
    recorded = flatten(saved)
    changes = [change for change in config_changes(saved, current, {})
               if change[0] in recorded or change[0] not in ADDED]
    weights = [change for change in changes if change[0].startswith(WEIGHTS)]
    changes = [change for change in changes if change not in weights]
    if weights:  # allowed: the mix continues from each source's cursor with the new weights
        log.info("resume: the mixture's weights changed (%s)", "; ".join(f"{key}: {old!r} -> {new!r}"
                                                                      for key, old, new in weights))
    data = [change for change in changes if change[0].startswith("data.")]
    refused = [change for change in changes if change not in data or not accept_changed_data]
    if refused:
        lines = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in refused)
        override = (" A changed corpus may be accepted with checkpoint.accept_changed_data=true (the data order "
                    "then differs from here on)." if any(change in data for change in refused) else "")
        if [key for key, _, _ in refused if key.startswith("data.")] == ["data.targets"]:
            override = (" The same files now make other targets: this ddptrain tokenizes or masks them otherwise than "
                        "the one that wrote the checkpoint." + override)
        if any(key == "reference.weights" for key, _, _ in refused):
            override += (" reference.weights is the sha256 of DPO's reference, the frozen copy of the initial weights "
                         "(model.path's) that a full fine-tune is optimised against: they changed since the run "
                         "started, so it would continue against another model. No switch accepts that: put the "
                         "weights the run started from back at model.path, or start a new run from the new ones.")
        raise CheckpointError(f"the run's inputs differ from the checkpoint's: {lines}. Resume with the inputs the run "
                              f"was trained on, or start a new run (another run.dir, or checkpoint.resume=none)."
                              f"{override}")
    if data:
        log.warning("resume: the corpus changed (%s); checkpoint.accept_changed_data=true accepts it: the data order "
                    "differs from here on, so this run is no longer the same as one uninterrupted run",
                    "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in data[:5]))
    return data
