"""8-bit inputs (`planner.types.Encoding`): a microcontroller's step takes its batch as 8-bit codes
and decodes them as its first operation. For images the codes are the pixels themselves, so the
step computes on the floats torchvision's `ToTensor` and `Normalize` make of them; the decoded step
is the float step on the decoded values; the c back end's step is the VM's to the bit."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from test_c_step import NO_FMA, BuildOptions, Kernels, _both, _equal_over_steps

from planner.backend.vm.compile import compile_candidate
from planner.errors import BadInput
from planner.inputs.model import load_model
from planner.inputs.preprocess import Preprocess, parse_text
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
    code = Encoding.calibrated(x)
    assert code.decode(code.encode(np.array([x.min(), x.max()])[None])).ravel() == pytest.approx([x.min(), x.max()], abs=1e-5)
    err = np.abs(code.decode(code.encode(x)) - x)
    assert err.max() <= code.scale[0] / 2 * (1 + 1e-4)
    outside = np.array([[x.min() - 5, x.max() + 5]], np.float32)
    assert code.encode(outside).tolist() == [[0, 255]]
    assert Encoding.calibrated(np.zeros(4)).scale == (1.0,)  # a constant input: any scale codes it exactly


def test_an_encoding_is_recorded_and_read_back_and_a_bad_one_refused():
    spec = ModelInput("x", (3, 4, 4)).encoded(Encoding((0.1, 0.2, 0.3), (0.0, -1.0, 1.0)))
    assert spec.dtype == "uint8" and ModelInput.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="channel scales"):
        ModelInput("x", (3, 4, 4)).encoded(Encoding((0.1, 0.2), (0.0, 0.0)))
    with pytest.raises(ValueError, match="finite and positive"):
        Encoding((0.0,), (1.0,))
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


def test_the_decoding_step_is_the_float_step_on_the_decoded_values(tiny_model, tmp_path):
    """The step given codes trains as the float model's step given what they stand for."""
    model = load_model(tiny_model)
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
