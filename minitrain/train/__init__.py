"""Training: the experiment contract, the pure train step and the fit loop."""

from minitrain.train.experiment import (
    Experiment,
    ExperimentError,
    apply_overrides,
    load_experiment,
    parse_overrides,
)
from minitrain.train.loop import FitResult, Interrupted, NonFiniteLoss, ResumeError, fit
from minitrain.train.step import StepOutput, make_train_step

__all__ = [
    "Experiment",
    "ExperimentError",
    "FitResult",
    "Interrupted",
    "NonFiniteLoss",
    "ResumeError",
    "StepOutput",
    "apply_overrides",
    "fit",
    "load_experiment",
    "make_train_step",
    "parse_overrides",
]
