"""Plans a user can trust: a plan that learns or says it did not, and one moved to another board
that neither keeps the first board's figures as its own nor claims to fit where it cannot.

- README's text path (a CSV of texts, its tokenizer.json, a small BERT from Hugging Face) learns
  in the default space: Adam is there beside plain SGD, which stays at chance on a transformer.
- A plan whose fine-tune does not beat the model's starting accuracy beyond the val split's noise
  is written, and says so: one line, exit 4, the report's first words, `selection.learned`.
- `planner compile` to another target refuses a step over that target's budgets (exit 2, one line,
  nothing written); one that fits says its latency and accuracy were not measured there.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import planner
from builders import blobs, keyword_texts, word_tokenizer
from processes import planner as planner_cli

LEARNED_NOTHING = 4  # README's exit-code table


def _texts(path: Path, n: int) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(keyword_texts(n, seed=1))
    return path


@pytest.mark.slow  # a PyTorch export and a 20-trial study of a transformer
def test_a_small_bert_learns_a_separable_text_task_in_the_default_space(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
    import torch_families as tf

    texts = _texts(tmp_path / "texts.csv", 240)
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", [row[0] for row in keyword_texts(240, seed=1)])
    result = planner.plan(model=tf.export("bert", "legacy"), data=texts, tokenizer=tokenizer, out=tmp_path / "plan")
    assert result.plan is not None
    accuracy = result.plan.metrics.accuracy
    assert accuracy.after >= 0.9, f"the default space left a separable three-class task at {accuracy.after:.3f}"
    assert result.plan.selection.learned is True
    optimizers = {t.candidate.optimizer for t in result.trials if t.candidate is not None}
    assert {"sgd", "adam"} <= {str(o) for o in optimizers}, "the default space offers SGD and Adam"


def test_a_plan_that_learned_nothing_is_written_and_says_so(tiny_model, tiny_data, tmp_path):
    # a learning rate nothing moves at: the fine-tune ends where the model started
    still = tmp_path / "still.yaml"
    still.write_text("strategy: all\nmodes: [full]\nbatch_size: [8]\noptimizer: [sgd]\nlr: {low: 1.0e-12, high: 1.0e-12}\n")
    out = tmp_path / "plan"
    res = planner_cli(
        "plan",
        "--model",
        tiny_model,
        "--data",
        tiny_data,
        "--space",
        still,
        "--trials",
        "1",
        "--accuracy-steps",
        "10",
        "--out",
        out,
    )
    assert res.returncode == LEARNED_NOTHING, res.stderr
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("warning: the plan learned nothing") and "noise" in last, res.stderr
    recorded = json.loads((out / "plan.json").read_text())
    assert recorded["selection"]["learned"] is False and recorded["selection"]["accuracy_noise"] > 0
    report = (out / "report.md").read_text().splitlines()
    assert report[2].startswith("> **Warning:** This plan learned nothing"), report[:4]
    assert '<p class="warning"><b>Warning:</b> This plan learned nothing' in (out / "report.html").read_text()


def test_a_plan_that_learned_says_nothing_of_it(tiny_model, tiny_data, tmp_path):
    res = planner_cli(
        "plan", "--model", tiny_model, "--data", tiny_data, "--trials", "2", "--accuracy-steps", "40", "--out", tmp_path / "p"
    )
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["selection"]["learned"] is True
    assert "Warning" not in (tmp_path / "p" / "report.md").read_text()
    # the study's database named by its path, as a user types it, is read as SQLite (not a journal)
    report = planner_cli("report", "--storage", tmp_path / "p" / "study.db", "--study", "planner", "--format", "md")
    assert report.returncode == 0 and report.stdout.startswith("# Study planner"), report.stderr


def test_version():
    res = planner_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"planner {planner.__version__}"


@pytest.mark.slow  # a plan of the bundled example, two builds
def test_compile_for_a_board_too_small_is_refused_and_one_that_fits_says_what_was_not_measured(tmp_path):
    plan = tmp_path / "plan"
    made = planner_cli("plan", "--space", "full", "--trials", "1", "--accuracy-steps", "20", "--out", plan)
    assert made.returncode in (0, LEARNED_NOTHING), made.stderr
    needs = json.loads((plan / "plan.json").read_text())["metrics"]["peak_memory_bytes"]["total"]
    assert needs > 256 * 1024, "the example's step must be one the nRF52840's 256 KiB cannot hold"

    refused = planner_cli("compile", plan, "--target", "nrf52840-dk", "--out", tmp_path / "nrf")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the plan's step does not fit nrf52840-dk"), lines
    assert "256.0 KiB budget" in lines[0] and "planner plan --target nrf52840-dk" in lines[0]
    assert not (tmp_path / "nrf").exists()

    moved = planner_cli("compile", plan, "--target", "raspberry-pi-4", "--out", tmp_path / "pi")
    assert moved.returncode == 0, moved.stderr
    assert "not measured there" in moved.stdout
    recorded = json.loads((tmp_path / "pi" / "plan.json").read_text())
    measurement = recorded["measurement"]
    assert measurement["retargeted_from"] == "host"
    assert measurement["latency"].startswith("not measured on raspberry-pi-4")
    assert measurement["ram_budget_bytes"] == planner.load_target("raspberry-pi-4").ram_budget_bytes  # the new board's
    report = (tmp_path / "pi" / "report.md").read_text().splitlines()
    leading = report[2 : report.index(next(line for line in report[2:] if line and not line.startswith("> **Warning:**")))]
    assert any(line.startswith("> **Warning:** Compiled for raspberry-pi-4 from a plan made on host") for line in leading), (
        report[:6]
    )


def test_no_batch_is_larger_than_the_train_split(tiny_model, tmp_path):
    """A train split of 12 samples: `plan` proposes only the batches it fills, `measure` refuses a
    scheme's batch of 16 and `run` a plan's batch on fewer samples, each in one line (exit 2)."""
    small = blobs(tmp_path / "small.npz", n=15)  # the last 20 % val: 12 train samples
    out = tmp_path / "plan"
    res = planner_cli("plan", "--model", tiny_model, "--data", small, "--trials", "3", "--accuracy-steps", "10", "--out", out)
    assert res.returncode in (0, LEARNED_NOTHING), res.stderr
    trials = json.loads((out / "trials.json").read_text())
    assert len(trials) == 3 and all(t["state"] == "COMPLETE" for t in trials), [t.get("fail_reason") for t in trials]
    assert {t["candidate"]["batch_size"] for t in trials} == {8}, "the space's 16 and 32 cannot be drawn from 12 samples"

    scheme = tmp_path / "sixteen.yaml"
    scheme.write_text("trainable:\n  - {layer: fc, mode: full}\nbatch_size: 16\noptimizer: {name: sgd, lr: 0.05}\n")
    refused = planner_cli("measure", tiny_model, "--scheme", scheme, "--data", small, "--out", tmp_path / "m")
    _one_line(refused, "scheme sixteen.yaml trains on batches of 16, but the train split of small.npz holds 12 samples")
    assert not (tmp_path / "m").exists()

    fewer = blobs(tmp_path / "fewer.npz", n=6)  # 5 train samples (the val split rounds down)
    refused = planner_cli("run", out, "--data", fewer, "--steps", "3", "--out", tmp_path / "ran")
    _one_line(refused, "the plan trains on batches of 8, but the train split of fewer.npz holds 5 samples")
    assert not (tmp_path / "ran").exists()

    none_fit = planner_cli("plan", "--model", tiny_model, "--data", fewer, "--out", tmp_path / "never")
    _one_line(none_fit, "the train split of fewer.npz holds 5 samples, fewer than every batch size")
    assert not (tmp_path / "never").exists()


def _one_line(res, words: str) -> None:
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines


def test_measure_of_a_scheme_over_budget_writes_what_it_measured_and_says_so(tiny_model, tiny_data, tmp_path):
    """Over a budget by far (the estimate alone would say so): still built, timed and fine-tuned,
    since the scheme is what was asked for; exit 1 and one line naming the budget."""
    scheme = tmp_path / "all.yaml"
    scheme.write_text(
        "trainable:\n  - {layer: c1, mode: full}\n  - {layer: fc, mode: full}\nbatch_size: 8\noptimizer: {name: sgd, lr: 0.05}\n"
    )
    small = tmp_path / "small.yaml"
    small.write_text("tvm_target: {kind: llvm}\nram_budget_bytes: 1KiB\nprecisions: [fp32]\n")
    out = tmp_path / "m"
    res = planner_cli(
        "measure", tiny_model, "--scheme", scheme, "--data", tiny_data, "--target", small, "--out", out, "--accuracy-steps", "5"
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("warning: the scheme is over budget: it breaks the target's ram budget"), res.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["selection"]["feasible"] is False and plan["selection"]["over_budget"]["ram_budget"] > 0
    assert plan["metrics"]["step_latency_ms"]["median"] > 0 and plan["metrics"]["accuracy"]["steps"] == 5
