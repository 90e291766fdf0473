"""A run's settings are one validated object: every value checked before anything loads, in one set of words.

The CLI's bad-input table (tests/test_cli_errors.py) shows the same checks through the flags.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

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
    settings = rec.settings()
    assert (settings.screen_steps, settings.tune_trials, rec.space, rec.tracker) == (0, 0, None, None)
    assert (settings.trials, settings.seed, settings.accuracy_steps, settings.latency_repeats) == (4, 1, 20, 3)


# A setting declared once, in `Settings` (here: a model with one field more, made the module's
# before anything else imports it): the command line offers it, a study stores it, `work` runs
# with it, and a bad value names its flag.
_ONE_PLACE = """
import json, sys
from pathlib import Path
import planner.inputs.settings as st
from pydantic import create_model
st.Settings = create_model("Settings", __base__=st.Settings, knob=(int, st._setting(3, "a new knob", study=True, ge=0)))
from typer.testing import CliRunner
from planner.cli import app
import planner.api._search as search
seen = []
evaluation = search._evaluation
search._evaluation = lambda loaded, settings: (seen.append(settings.knob), evaluation(loaded, settings))[1]
out, storage = Path(sys.argv[1]), f"sqlite:///{sys.argv[1]}.db"
shown = CliRunner().invoke(app, ["plan", "--help"], terminal_width=200).output
refused = CliRunner().invoke(app, ["plan", "--knob", "-1", "--out", str(out)])
planner = __import__("planner")
planner.plan(out=out, storage=storage, study="s", trials=1, accuracy_steps=4, screen_steps=0, knob=5)
from planner.search.records import stored_inputs
stored = stored_inputs(storage, "s")[1]
planner.work(storage=storage, study="s", trials=1)
print(json.dumps({"shown": shown, "refused": [refused.exit_code, refused.output], "stored": stored, "seen": seen}))
"""


@pytest.mark.slow  # two trials of the bundled example
def test_a_setting_declared_once_is_a_flag_stored_with_the_study_and_read_back_by_work(tmp_path):
    done = subprocess.run([sys.executable, "-c", _ONE_PLACE, str(tmp_path / "plan")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "--knob <int>" in got["shown"] and "a new knob" in got["shown"], got["shown"]
    assert got["refused"][0] == 2 and "--knob" in got["refused"][1], got["refused"]
    assert got["stored"]["knob"] == 5
    assert got["seen"] == [5, 5], "plan and the worker that joined its study ran with it"
