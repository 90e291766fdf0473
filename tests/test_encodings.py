"""8-bit inputs (`planner.types.Encoding`): a microcontroller's step takes its batch as 8-bit codes
and decodes them as its first operation. For images the codes are the pixels themselves, so the
step computes on the floats torchvision's `ToTensor` and `Normalize` make of them; the decoded step
is the float step on the decoded values; the c back end's step is the VM's to the bit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_c_step import NO_FMA, BuildOptions, Kernels, _both, _equal_over_steps

import planner
from builders import blobs, tiny_cnn
from planner.backend.vm.compile import compile_candidate
from planner.errors import BadInput
from planner.inputs.data import input_encodings, load_dataset
from planner.inputs.model import load_model
from planner.inputs.preprocess import Preprocess, parse_text
from planner.inputs.resources import shipped
from planner.runtime.session import TrainingSession, step_inputs
from planner.types import Candidate, Encoding, ModelInput, StepSignature


@pytest.mark.parametrize(
    "steps",
    [
        "Resize(9), CenterCrop(7), ToTensor(), Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])",
        "Resize([5, 6]), ToTensor()",
        "CenterCrop(8), ToTensor(), Normalize(mean=0.5, std=0.25), Normalize(mean=[0.1, -0.2, 0.3], std=[2.0, 0.5, 1.5])",
    ],
)
def test_an_images_pixels_come_back_from_the_floats_its_preprocessing_makes(steps):
    spec = Preprocess(parse_text(steps))
    code = spec.pixel_encoding(3)
    rng = np.random.default_rng(0)
    for _ in range(20):
        image = Image.fromarray(rng.integers(0, 256, (int(rng.integers(8, 14)), int(rng.integers(8, 14)), 3), np.uint8))
        x = spec.apply(image)[None]
        pixels = np.asarray(Preprocess([s for s in spec.steps if s.on_tensor is False][:-1]).apply(image))
        q = code.encode(x)
        np.testing.assert_array_equal(q[0], pixels.transpose(2, 0, 1))
        np.testing.assert_allclose(code.decode(q), x, rtol=1e-5, atol=1e-6)


def test_arrays_are_coded_over_their_range_within_half_a_step_and_clipped_outside():
    rng = np.random.default_rng(1)
    x = rng.normal(0.3, 2.0, (64, 5, 7)).astype(np.float32)
    code = Encoding.calibrated(float(x.min()), float(x.max()))
    assert code.decode(code.encode(np.array([x.min(), x.max()])[None])).ravel() == pytest.approx([x.min(), x.max()], abs=1e-5)
    err = np.abs(code.decode(code.encode(x)) - x)
    assert err.max() <= code.scale[0] / 2 * (1 + 1e-4)
    outside = np.array([[x.min() - 5, x.max() + 5]], np.float32)
    assert code.encode(outside).tolist() == [[0, 255]]
    assert Encoding.calibrated(0.0, 0.0).scale == (1.0,)  # a constant input: any scale codes it exactly
    whole = np.arange(-3.0, 250.0)[None]  # 8-bit values saved as floats: coded as they are
    exact = Encoding.calibrated(-3.0, 249.0, integral=True)
    np.testing.assert_array_equal(exact.decode(exact.encode(whole)), whole)


def test_an_encoding_is_recorded_and_read_back_and_a_bad_one_refused():
    spec = ModelInput("x", (3, 4, 4)).encoded(Encoding((0.1, 0.2, 0.3), (0.0, -1.0, 1.0)))
    assert spec.dtype == "uint8" and ModelInput.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="channel scales"):
        ModelInput("x", (3, 4, 4)).encoded(Encoding((0.1, 0.2), (0.0, 0.0)))
    with pytest.raises(ValueError, match="finite and not 0"):
        Encoding((0.0,), (1.0,))
    flipped = Encoding((-0.5,), (1.0,))  # a Normalize with a negative std
    assert flipped.encode(flipped.decode(np.arange(256, dtype=np.uint8)[None])).tolist() == [list(range(256))]
    with pytest.raises(ValueError, match="not a batch of floats"):
        ModelInput("ids", (8,), "int64").encoded(Encoding((1.0,), (0.0,)))


def test_a_model_encodes_only_inputs_it_has_and_its_key_names_the_encoding(tiny_model):
    model = load_model(tiny_model)
    code = Encoding((0.05,), (-3.0,))
    encoded = model.encoded({model.only_input.name: code})
    assert encoded.key != model.key and encoded.key == model.encoded({model.only_input.name: code}).key
    assert encoded.key != model.encoded({model.only_input.name: Encoding((0.05,), (-2.0,))}).key
    with pytest.raises(BadInput, match="no input named"):
        model.encoded({"nope": code})


def test_the_decoding_step_is_the_float_step_on_the_decoded_values(tmp_path):
    """The step given codes trains as the float model's step given what they stand for, each
    channel by its own scale and offset."""
    model = load_model(tiny_cnn(tmp_path / "rgb.onnx", channels=3))
    shape = model.only_input.static
    code = Encoding(tuple(np.linspace(0.01, 0.03, shape[0])), tuple(np.linspace(-1.0, 1.0, shape[0])))
    encoded = model.encoded({model.only_input.name: code})
    candidate = Candidate((("c1", "full"), ("fc", "full")), batch_size=3, optimizer="momentum", lr=0.05)
    build = BuildOptions(NO_FMA, tmp_path / "cache", kernels=Kernels.TVM)
    weights = dict(model.initializers)
    steps = []
    for m in (model, encoded):
        art = compile_candidate(m, candidate, build)
        steps.append(TrainingSession(art.library, art.signature.with_lr(candidate.lr), weights))
    floats, codes = steps
    assert codes.sig.inputs[0].encoding == code and codes.sig.inputs[0].dtype == "uint8"
    rng = np.random.default_rng(2)
    for _ in range(4):
        q = rng.integers(0, 256, (3, *shape), np.uint8)
        y = rng.integers(0, model.n_classes, 3)
        assert codes.step(q, y) == pytest.approx(floats.step(code.decode(q), y), rel=1e-6)
    for name, w in floats.weights().items():
        np.testing.assert_allclose(codes.weights()[name], w, rtol=1e-5, atol=1e-6, err_msg=name)
    assert step_inputs(codes.sig, code.decode(q))[0].tolist() == q.tolist()  # floats fed in are coded back


def test_the_c_step_taking_codes_is_the_vm_step_to_the_bit(tiny_model, tmp_path):
    model = load_model(tiny_model)
    code = Encoding(tuple(np.linspace(0.01, 0.03, model.only_input.static[0])), tuple([-0.5] * model.only_input.static[0]))
    candidate = Candidate((("c2", "full"), ("fc", "full")), batch_size=2, optimizer="sgd", lr=0.05)
    vm, c, _ = _both(model.encoded({model.only_input.name: code}), candidate, tmp_path)
    assert "8-bit codes" in c.header
    _equal_over_steps(vm, c, model.only_input.shape, model.n_classes, codes=True)


def test_a_signature_of_a_step_taking_codes_is_read_back():
    sig = StepSignature(
        inputs=(ModelInput("x", (1, 4, 4)).encoded(Encoding((0.5,), (1.0,))),),
        batch_size=1,
        micro_batch=1,
        frozen=(),
        trainable=("w",),
        layouts={},
        quantized={},
        loss_scale=1.0,
        optim_states=(((), "float32", 0.1),),
        n_classes=2,
        output=(2,),
    )
    assert StepSignature.from_json(sig.to_json()) == sig


def _rgb_folder(root: Path, n_classes: int = 3, per_class: int = 8) -> Path:
    rng = np.random.default_rng(3)
    for c in range(n_classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (9, 9, 3), dtype=np.uint8)
            pixels[..., c] = np.maximum(pixels[..., c], 160)  # a class is a brighter channel
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.png")
    return root


def test_a_plan_for_an_8_bit_target_records_its_pixels_encoding_and_runs_on_floats_alike(tmp_path):
    """Images measured for a target with `input_bits: 8`: the step takes the pixels, plan.json
    records how they decode (the model's own input stays float32), and `planner run` trains the
    same on the folder as on the float arrays its preprocessing makes."""
    model = tiny_cnn(tmp_path / "rgb.onnx", channels=3)
    root = _rgb_folder(tmp_path / "images")
    text = "Resize(6), CenterCrop(6), ToTensor(), Normalize(mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3])"
    target = tmp_path / "host8.yaml"
    target.write_text((shipped("hw_targets") / "host.yaml").read_text() + "input_bits: 8\n")
    scheme = tmp_path / "fc.yaml"
    scheme.write_text("trainable:\n  - params: [fc.w, fc.b]\nbatch_size: 4\noptimizer: {name: sgd, lr: 0.1}\n")
    common = dict(scheme=scheme, target=str(target), accuracy_steps=8, latency_repeats=1, cache_dir=tmp_path / "cache")
    planner.measure(model, data=root, preprocess=text, out=tmp_path / "plan", **common)
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["schema_version"] >= 9 and plan["model"]["inputs"][0]["dtype"] == "float32"
    (taken,) = plan["step"]["signature"]["inputs"]
    expected = Preprocess(parse_text(text)).pixel_encoding(3)
    assert taken["dtype"] == "uint8" and Encoding.from_json(taken["encoding"]) == expected
    loaded = load_dataset(root, load_model(model), preprocess=text)
    arrays = tmp_path / "floats.npz"
    xs = {s: np.concatenate([x for x, _ in split.chunks(64)]) for s, split in (("train", loaded.train), ("val", loaded.val))}
    ys = {s: np.concatenate([y for _, y in split.chunks(64)]) for s, split in (("train", loaded.train), ("val", loaded.val))}
    np.savez(arrays, x_train=xs["train"], y_train=ys["train"], x_val=xs["val"], y_val=ys["val"])
    by_files = planner.run(tmp_path / "plan", steps=6, out=tmp_path / "ran-files")
    by_arrays = planner.run(tmp_path / "plan", data=arrays, steps=6, out=tmp_path / "ran-arrays")
    assert (by_files.before, by_files.after) == (by_arrays.before, by_arrays.after)


def test_arrays_for_an_8_bit_target_are_coded_over_their_range_and_a_loss_models_targets_stay_float(tmp_path, tiny_model):
    model = load_model(tiny_model)
    data = load_dataset(blobs(tmp_path / "blobs.npz"), model)
    (code,) = input_encodings(model, data).values()
    x = np.concatenate([x for x, _ in data.train.chunks(64)])
    assert code == Encoding.calibrated(float(x.min()), float(x.max()))
    whole = tmp_path / "whole.npz"  # 8-bit values saved as floats
    np.savez(whole, x=np.round(x * 10 + 100).clip(0, 255), y=np.concatenate([y for _, y in data.train.chunks(64)]))
    assert input_encodings(model, load_dataset(whole, model))[model.only_input.name].scale == (1.0,)
    assert input_encodings(replace(model, output=replace(model.output, batched=False)), data) == {}
