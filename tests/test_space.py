"""Search spaces turn trials into the candidates their strategy promises."""

from __future__ import annotations

import optuna
import pytest

from planner.errors import BadInput
from planner.inputs.model import load_model
from planner.inputs.spaces import SPACES_DIR, load_space
from planner.modes.lora import max_rank
from planner.search.study import make_sampler


def test_last_k_trains_exactly_the_last_k_layers(tiny_model):
    model = load_model(tiny_model)
    space = load_space("last-k")
    trial = optuna.trial.FixedTrial(
        {
            "last_k": 2,
            "mode": "full",
            "batch_size": 8,
            "optimizer": "sgd",
            "lr": 0.01,
            "lr_position": 0.0,
            "precision": "fp32",
            "grad_accum": 1,
            "frozen_weights": "fp32",
            "updates": "in-place",
            "recompute": "none",
        }
    )
    cand = space.sample(trial, model)
    assert cand.trainable == (("c2", "full"), ("fc", "full"))


def test_bias_only_trains_every_bias_and_no_weight(tiny_model):
    model = load_model(tiny_model)
    cand = load_space("bias-only").sample(
        optuna.trial.FixedTrial(
            {
                "mode": "bias",
                "batch_size": 8,
                "optimizer": "sgd",
                "lr": 0.01,
                "lr_position": 0.0,
                "precision": "fp32",
                "grad_accum": 1,
                "frozen_weights": "fp32",
                "updates": "in-place",
                "recompute": "none",
            }
        ),
        model,
    )
    assert cand.trainable == tuple((layer.name, "bias") for layer in model.layers)


def test_full_trains_everything(tiny_model):
    model = load_model(tiny_model)
    cand = load_space("full").sample(
        optuna.trial.FixedTrial(
            {
                "mode": "full",
                "batch_size": 8,
                "optimizer": "adam",
                "lr": 0.01,
                "lr_position": 0.0,
                "precision": "fp32",
                "grad_accum": 1,
                "frozen_weights": "fp32",
                "updates": "in-place",
                "recompute": "none",
            }
        ),
        model,
    )
    assert cand.trainable == tuple((layer.name, "full") for layer in model.layers) and cand.optimizer == "adam"


@pytest.mark.parametrize("name", sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
def test_every_shipped_space_samples_valid_candidates(name, tiny_model):
    model = load_model(tiny_model)
    space = load_space(name)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(30):
        cand = space.sample(study.ask(), model)
        assert cand.batch_size in space.batch_size and cand.optimizer in space.optimizer
        lr = space.lr_range(cand.optimizer)  # the range of the optimizer drawn
        assert lr.low <= cand.lr <= lr.high * (1 + 1e-12)
        assert all(mode.kind in space.modes for _, mode in cand.trainable)
        assert all(mode.value in space.arguments["ratio"] for _, mode in cand.trainable if mode.kind == "ratio")
        # channel ratios only where a weight has output channels (never on BatchNormalization)
        assert all(model.layer(n).out_axis is not None for n, mode in cand.trainable if mode.kind == "ratio")
        # LoRA ranks from the space, and only those the layer's weight takes
        lora = [(n, mode.value) for n, mode in cand.trainable if mode.kind == "lora"]
        assert all(rank in space.arguments["lora"] and rank <= max_rank(model.layer(n)) for n, rank in lora)


def test_a_space_without_a_training_mode_is_refused(tmp_path):
    path = tmp_path / "frozen.yaml"
    path.write_text("modes: [frozen]\n")
    with pytest.raises(BadInput, match="modes"):
        load_space(str(path))


def _sparse():
    """A space with the `sparse` strategy (a depth, then a mode per layer): memory_frontier's."""
    return load_space("sparse-update").model_copy(update={"strategy": "sparse"})


def test_sparse_strategy_only_trains_within_the_drawn_depth(tiny_model):
    model = load_model(tiny_model)
    params = {
        "depth": 2,
        "deepest_mode:c2": "ratio",
        "ratio:c2": 0.5,
        "mode:fc": "bias",
        "batch_size": 4,
        "optimizer": "sgd",
        "lr": 0.01,
        "lr_position": 0.0,
        "precision": "fp32",
        "grad_accum": 1,
        "frozen_weights": "fp32",
        "updates": "in-place",
        "recompute": "none",
    }
    cand = _sparse().sample(optuna.trial.FixedTrial(params), model)
    assert cand.trainable == (("c2", "ratio:0.5"), ("fc", "bias"))


def test_sparse_strategy_reaches_exactly_its_depth(tiny_model):
    """The depth is how far back the update goes: the deepest layer of the window always trains."""
    model = load_model(tiny_model)
    space = _sparse()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    names = space.layer_names(model)
    for _ in range(40):
        trial = study.ask()
        cand = space.sample(trial, model)
        assert cand.trainable and cand.trainable[0][0] == names[len(names) - trial.params["depth"]]


def test_a_precision_the_target_does_not_list_is_never_proposed(tiny_model):
    model = load_model(tiny_model)
    space = load_space("per-layer").model_copy(update={"precision": ["fp32", "fp16", "bf16"]}).for_target(["fp32", "bf16"])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    proposed = {space.sample(study.ask(), model).precision for _ in range(40)}
    assert proposed == {"fp32", "bf16"}


COMMON = {"optimizer": "sgd", "lr": 0.01, "lr_position": 0.0, "precision": "fp32", "grad_accum": 1, "frozen_weights": "fp32"}
COMMON |= {"updates": "in-place", "recompute": "none", "batch_size": 8}


@pytest.mark.parametrize(
    "bias, weights, mode, trained",
    [
        (1, 1, "full", [("fc", "full")]),
        (3, 1, "full", [("bn", "bias"), ("c2", "bias"), ("fc", "full")]),
        (3, 3, "ratio:0.5", [("bn", "bias"), ("c2", "ratio:0.5"), ("fc", "full")]),
        (2, 3, "full", [("c2", "full"), ("fc", "full")]),
        (4, 2, "ratio:0.25", [("c1", "bias"), ("bn", "bias"), ("c2", "ratio:0.25"), ("fc", "full")]),
        (1, 1, "ratio:0.125", [("fc", "full")]),
    ],
)
def test_depths_train_biases_and_weights_as_far_back_as_drawn(tiny_model, bias, weights, mode, trained):
    """`depths`: the last `bias_depth` layers update their biases, the last `weight_depth` of
    those their weights in `weight_mode` (no further back than the biases: a step's cost follows
    how far backpropagation reaches); a layer that cannot take that mode (BatchNorm has no output
    channels to split) updates its bias, nothing before the bias depth trains, and the classifier
    trains whole under a ratio (a share of its output channels is a share of the classes)."""
    model = load_model(tiny_model)
    assert [layer.name for layer in model.layers] == ["c1", "bn", "c2", "fc"]
    params = {"bias_depth": bias, "weight_depth": weights, "weight_mode": mode} | COMMON
    cand = load_space("sparse-update").sample(optuna.trial.FixedTrial(params), model)
    assert [(n, str(m)) for n, m in cand.trainable] == trained


def test_depths_draw_the_same_parameters_every_trial(tiny_model):
    """A fixed set of parameters, whatever a trial draws: what lets multivariate TPE, GP and
    NSGA-II model the space jointly instead of falling back to independent draws."""
    model = load_model(tiny_model)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    names = set()
    for _ in range(20):
        trial = study.ask()
        load_space("sparse-update").sample(trial, model)
        names.add(frozenset(trial.params))
    assert len(names) == 1 and {"bias_depth", "weight_depth", "weight_mode"} <= next(iter(names))


@pytest.mark.parametrize("name", ["depths", "per-layer", "sparse-update", "last-k"])
def test_a_study_starts_from_the_hand_made_schemes(name, tiny_model):
    """The recipes users would otherwise copy are the first candidates, at the smallest batch."""
    model = load_model(tiny_model)
    space = load_space(name)
    layers = [layer.name for layer in model.layers]
    anchors = space.anchors(model)
    study = optuna.create_study(sampler=make_sampler("tpe", 0, anchors))
    cands = [space.sample(study.ask(), model) for _ in anchors]
    got = [c.trainable for c in cands]
    assert got[0] == ((layers[-1], "full"),)  # the head alone
    assert tuple((n, "full") for n in layers) in got  # everything
    biases = tuple((n, "bias") for n in layers[:-1] if model.layer(n).bias)
    if space.strategy == "depths":  # TinyTL: every bias and the classifier
        assert (*biases, (layers[-1], "full")) in got
    elif "bias" in space.modes:
        assert (*biases, (layers[-1], "bias")) in got  # every bias
    assert len(set(got)) == len(got) and {c.batch_size for c in cands} == {min(space.batch_size)}


@pytest.mark.parametrize("precisions", [["fp32", "int8"], ["fp32"]])
def test_a_microcontrollers_study_starts_from_the_recipes_at_their_leanest(precisions, tiny_model):
    """On a microcontroller (`lean`), the recipes are also at the cheap end of every setting that
    sizes the step: plain SGD, the narrowest precision the target takes, int8 frozen weights;
    elsewhere those stay to the sampler, which draws all of them over a study."""
    model = load_model(tiny_model)
    space = load_space("sparse-update").for_target(precisions)
    lean, plain_anchors = space.anchors(model, lean=True), space.anchors(model)
    assert [{k: v for k, v in a.items() if k in plain_anchors[0]} for a in lean] == plain_anchors
    study = optuna.create_study(sampler=make_sampler("tpe", 0, lean))
    cands = [space.sample(study.ask(), model) for _ in lean]
    assert {(c.optimizer, c.precision, c.frozen_weights, c.batch_size) for c in cands} == {("sgd", precisions[-1], "int8", 1)}
    assert not {"optimizer", "precision", "frozen_weights"} & set(plain_anchors[0])
