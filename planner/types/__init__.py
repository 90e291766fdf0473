"""The types planner's stages pass along: what a candidate is and what was measured about it.

Plain data, no TVM and no Optuna: a report, the progress bar or a script reads trials without
loading a compiler. Enumerations are `StrEnum`s, so each compares equal to the string that plans,
spaces and Optuna storages hold, and serialises as that string.

One module per stage of a candidate's life: `_candidate` (what is proposed), `_step` (what its
compiled step takes and gives), `_measured` (what was measured, and a trial's record).
"""

from planner.types._candidate import (
    LEGACY_UPDATES,
    Candidate,
    FrozenWeights,
    Kernels,
    Mode,
    Optimizer,
    Precision,
    Recompute,
    Updates,
)
from planner.types._measured import (
    AccuracyResult,
    Fidelity,
    Latency,
    Measured,
    MemoryBreakdown,
    TrialRecord,
    TrialResult,
    TrialState,
)
from planner.types._metric import ACCURACY, METRICS, Metric, metric_named
from planner.types._step import Encoding, Int8Scale, KernelTime, ModelInput, RunCheck, RunResult, StepProfile, StepSignature

__all__ = [
    "ACCURACY",
    "Encoding",
    "Int8Scale",
    "METRICS",
    "Metric",
    "metric_named",
    "LEGACY_UPDATES",
    "AccuracyResult",
    "Candidate",
    "Fidelity",
    "FrozenWeights",
    "KernelTime",
    "Kernels",
    "Latency",
    "Measured",
    "MemoryBreakdown",
    "Mode",
    "ModelInput",
    "Optimizer",
    "Precision",
    "Recompute",
    "RunCheck",
    "RunResult",
    "StepProfile",
    "StepSignature",
    "TrialRecord",
    "TrialResult",
    "TrialState",
    "Updates",
]
