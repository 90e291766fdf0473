"""A run's settings are one validated object: every value checked before anything loads, in one set of words.

The CLI's bad-input table (tests/test_cli_errors.py) shows the same checks through the flags.
"""

from __future__ import annotations

import math

import pytest

import planner
from planner.errors import BadInput
from planner.inputs.settings import SEED_MAX, Settings, StudyRecord


@pytest.mark.parametrize(
    "given, words",
    [
        ({"trials": 0}, "`trials` must be at least 1"),
        ({"timeout_s": -1.0}, "`timeout_s` must be a positive number of seconds (not -1)"),
        ({"timeout_s": math.inf}, "`timeout_s` must be a positive number of seconds (not inf)"),
        ({"seed": SEED_MAX + 1}, f"`seed` must lie in 0..{SEED_MAX} (not {SEED_MAX + 1})"),
        ({"accuracy_tolerance": math.nan}, "`accuracy_tolerance` must lie in 0..1"),
        ({"accuracy_steps": 0}, "`accuracy_steps` must be at least 1"),
        ({"accuracy_steps": 40, "screen_steps": 40}, "`screen_steps` must lie in 0..39, fewer than `accuracy_steps`"),
        ({"latency_repeats": 0}, "`latency_repeats` must be at least 1 (not 0)"),
        ({"tune_trials": -1}, "`tune_trials` must be 0 (default schedules only) or more"),
        ({"policy": "fastest"}, "`policy` must be memory, latency or accuracy (not 'fastest')"),
        ({"trials": "many"}, "`trials` must be at least 1"),
        ({"sampler_name": "tpe"}, "`sampler_name`: Extra inputs are not permitted"),
    ],
)
def test_a_value_out_of_range_is_one_line_naming_the_parameter(given, words):
    with pytest.raises(BadInput) as err:
        Settings(**given)
    assert str(err.value).startswith(words), str(err.value)


def test_defaults_and_the_screen_that_follows_accuracy_steps():
    s = Settings()
    assert (s.trials, s.seed, s.policy, s.sampler, s.screen) == (20, 0, "memory", "tpe", 50)
    assert Settings(accuracy_steps=40).screen == 10 and Settings(screen_steps=0).screen == 0


def test_keyword_options_override_a_settings_object_and_an_unknown_one_is_a_type_error(tiny_model, tiny_data, tmp_path):
    base = planner.Settings(trials=5, accuracy_steps=10)
    with pytest.raises(BadInput, match="`trials` must be at least 1"):  # the keyword wins, and is checked
        planner.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", settings=base, trials=0)
    with pytest.raises(TypeError, match="plan\\(\\) got an unexpected keyword argument 'trails'"):
        planner.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", trails=5)
    assert not (tmp_path / "p").exists()  # refused before anything was written


def test_a_study_record_reads_what_an_older_planner_stored():
    old = {  # no screen_steps (before screening), one field a newer planner may add
        "model": "m.onnx", "data": "d.npz", "target": "host", "trials": 4, "seed": 1, "sampler": "tpe", "anchors": True,
        "accuracy_steps": 20, "latency_repeats": 3, "from_the_future": 1,
    }  # fmt: skip
    rec = StudyRecord.model_validate(old)
    assert (rec.screen_steps, rec.tune_trials, rec.space, rec.tracker) == (0, 0, None, None)
