"""What the loop tells its components, and what it asks them: the seam that keeps `Trainer.fit` a
table of contents (OLMo-core's callbacks are the model).

After every optimizer step the loop makes a `StepEnd` and, for each component in order, asks
`reads(end)` (does it read this step's numbers? only then does the loop wait for the device:
step statistics stay lazy) and then calls `on_step_end(end)`, inside the preemption watchdog's
`unhurried` window; after the last step, `on_fit_end(step)`. A component decides from its own
schedule (every N steps, `end.last`) whether to do anything: a profiler or another evaluator is a
new component in the trainer's list, not an edit of `fit`. Components earlier in the list leave
their results on the StepEnd for later ones (the evaluator's `val_loss` for the metrics line, the
checkpointer's `saved` for the preemption).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from ddptrain.engine.stats import StepStats


@dataclass
class StepEnd:
    """One finished optimizer step, as the components see it."""

    step: int
    """Optimizer steps done, this one included."""
    last: bool
    """Whether this is trainer.max_steps, the run's last step."""
    stats: StepStats
    """The step's statistics, on the device until a component that `reads` the step reads them."""
    lr: float
    """The learning rate this step applied."""
    counters: Callable[[], dict] = field(default=dict)
    """The trainer's running counters for a metrics line (tokens seen, skipped steps, ...), read when called."""
    val_loss: float | None = None
    """Set by the evaluator on its steps."""
    rollout: dict = field(default_factory=dict)
    """objective=grpo: the step's rollout metrics (reward, completion lengths, phase times), set by the loop."""
    evals: dict = field(default_factory=dict)
    """Other evaluated metrics of this step by name (eval/<task>/acc, ...), set by the task scorer on its steps."""
    stop: str | None = None
    """Set by early stopping: why the run ends after this step."""
    improved: bool = False
    """Set by the best weights' tracker: this step is the best evaluated so far."""
    record: dict | None = None
    """Set by the metrics logger on its steps: the metrics.jsonl line, for the trackers after it."""
    saved: Path | None = None
    """Set by the checkpointer on its steps: the checkpoint of this step."""


class Component(Protocol):
    """A part of the loop with its own schedule."""

    def reads(self, end: StepEnd) -> bool:
        """Whether `on_step_end` reads the step's numbers (the loop then waits for the device)."""
        ...

    def on_step_end(self, end: StepEnd) -> None:
        """After every step; does what this step's schedule says, or nothing."""
        ...

    def on_fit_end(self, step: int) -> None:
        """Once the run reached trainer.max_steps (also on a launch with nothing left to train)."""
        ...
