"""Training: the experiment contract, the pure train step and the one fit loop."""

from minitrain.errors import ExperimentError, Interrupted, NonFiniteLoss, ResumeError, ScriptError
from minitrain.train.experiment import Experiment, apply_overrides, load_experiment, parse_overrides
from minitrain.train.loop import run_loop
from minitrain.train.single import SingleRun, fit
from minitrain.train.step import StepOutput, make_train_step
from minitrain.train.stepper import FitResult, Stepper

__all__ = [
    "Experiment", "ExperimentError", "FitResult", "Interrupted", "NonFiniteLoss", "ResumeError",
    "ScriptError", "SingleRun", "StepOutput", "Stepper", "apply_overrides", "fit",
    "load_experiment", "make_train_step", "parse_overrides", "run_loop",
]
