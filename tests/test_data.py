"""Data as users keep it: image folders, CSVs, class names, compressed and larger-than-memory .npz.

Preprocessing is checked against torchvision itself — the same text run by torchvision's
transforms and by planner's spec must give the same floats — and so is the folder layout
(ImageFolder's classes and samples). The memory bound is a real address-space limit on the
planner process, below the dataset's size.
"""

from __future__ import annotations

import io
import json
import os
import resource
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import planner
from builders import blobs, tiny_cnn
from planner.errors import BadInput
from planner.inputs.data import DataFormat, load_dataset
from planner.inputs.data._images import decode
from planner.inputs.defaults import DEFAULT_DATA, DEFAULT_MODEL, EXAMPLE_DIR
from planner.inputs.model import load_model
from planner.inputs.preprocess import Preprocess, parse_text
from processes import PLANNED
from processes import planner as planner_process

# (size, mode, format): odd and even, smaller and larger than the crops, every mode a user's files come in
IMAGES = [
    ((5, 7), "L", "png"),
    ((8, 8), "RGB", "png"),
    ((13, 6), "RGBA", "png"),
    ((16, 16), "P", "png"),
    ((9, 15), "RGB", "jpg"),
    ((24, 11), "L", "jpg"),
    ((10, 10), "RGB", "bmp"),
    ((3, 3), "RGB", "png"),
]
# each text is run twice: as torchvision code and as planner's --preprocess
SPECS = [
    "Resize(8), CenterCrop(8), ToTensor()",
    "Resize([7, 9], interpolation=InterpolationMode.BICUBIC), ToTensor()",
    "Grayscale(3), Resize(11), CenterCrop([10, 12]), ToTensor(), Normalize(mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3])",
    "CenterCrop(12), ToTensor()",  # larger than some images: torchvision pads them
    "Resize(9, interpolation=InterpolationMode.NEAREST), CenterCrop([9, 6]), Grayscale(), ToTensor(), Normalize([0.2], [0.7])",
    "Compose([Resize(5, interpolation=InterpolationMode.BOX), CenterCrop(5), ToTensor()])",
]


def _image(path: Path, size: tuple[int, int], mode: str, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels).convert(mode if mode != "P" else "RGB")
    if mode == "P":
        image = image.quantize(16)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def _transforms():
    from torch_families import torchvision

    return torchvision().transforms


def _torchvision_compose(text: str):
    t = _transforms()
    made = eval(text, {**vars(t), "InterpolationMode": t.InterpolationMode})  # the test's own literals
    return made if isinstance(made, t.Compose) else t.Compose(list(made))


@pytest.mark.parametrize("text", SPECS)
def test_the_spec_preprocesses_as_torchvision_does(text, tmp_path):
    ours = Preprocess(parse_text(text))
    theirs = _torchvision_compose(text)  # imports torchvision, with its stubs, before its datasets
    from torchvision.datasets.folder import pil_loader

    for i, (size, mode, fmt) in enumerate(IMAGES):
        path = _image(tmp_path / f"{i}.{fmt}", size, mode, seed=i)
        expected = theirs(pil_loader(str(path))).numpy()
        got = ours.apply(decode(path))
        assert got.dtype == np.float32 and got.shape == expected.shape, (path.name, got.shape, expected.shape)
        np.testing.assert_array_equal(got, expected, err_msg=f"{text} on {path.name}")


def test_a_spec_is_completed_from_the_model_and_checked_against_it():
    grey_8 = (1, 8, 8)
    completed = Preprocess.complete(parse_text("Normalize(mean=[0.5], std=[0.25])"), grey_8, "spec")
    assert str(completed) == ("Grayscale(), Resize(size=8), CenterCrop(size=8), ToTensor(), Normalize(mean=[0.5], std=[0.25])")
    assert Preprocess.complete(completed.steps, grey_8, "spec") == completed  # a recorded spec stays as it is
    wide = Preprocess.complete([], (3, 6, 10), "spec")
    assert str(wide) == "Resize(size=10), CenterCrop(size=[6, 10]), ToTensor()"
    assert Preprocess.from_json(json.loads(json.dumps(wide.to_json())), "plan") == wide
    for text, words in [
        ("CenterCrop(7)", "the steps give 7x7 images; the model takes 8x8"),
        ("Grayscale(3)", "3-channel images; the model takes 1 channels"),
        ("Normalize(mean=[0.5, 0.5], std=[1, 1])", "Normalize's mean has 2 values; the images have 1 channels"),
        ("Normalize([0.5], [0.5]), Resize(8)", "the order is image steps, then ToTensor once, then Normalize"),
        ("ToTensor(), ToTensor()", "ToTensor once"),
        ("Resize(8, 9, 10)", "Resize takes at most 2 positional arguments"),
        ("Sharpen(2)", "unknown step 'Sharpen'"),
        ("Resize(x)", "arguments must be literal"),
        ("Resize(0)", "Resize.size"),
        ("Normalize(mean=[0.5], std=[0])", "std must not be 0"),
        ("Resize(8", "not a list of steps"),
    ]:
        with pytest.raises(BadInput) as info:
            Preprocess.complete(parse_text(text), grey_8, "spec")
        assert words in str(info.value), (text, str(info.value))
    with pytest.raises(BadInput, match=r"input is \(36,\)"):
        Preprocess.complete([], (36,), "spec")


def test_augmentation_is_seeded_and_only_in_training(tmp_path):
    model = load_model(tiny_cnn(tmp_path / "tiny.onnx"))  # input (1, 6, 6), 3 classes
    for c in range(3):
        for i in range(4):
            _image(tmp_path / "data" / f"class{c}" / f"{i}.png", (9, 9), "L", seed=10 * c + i)
    spec = "RandomCrop(6, padding=2), RandomHorizontalFlip()"
    ds = load_dataset(tmp_path / "data", model, preprocess=spec)
    assert str(ds.preprocess) == "Grayscale(), RandomCrop(size=6, padding=2), RandomHorizontalFlip(), ToTensor()"
    index = np.arange(len(ds.train))
    a, b, c = (ds.train.batch(index, augment=a)[0] for a in ((0, 1), (0, 1), (0, 2)))
    np.testing.assert_array_equal(a, b)  # the same seed and step: the same crops and flips
    assert not np.array_equal(a, c)
    plain = ds.train.batch(index)[0]  # evaluation's view: the centre crop, no flip
    centre = Preprocess(parse_text("Grayscale(), CenterCrop(6), ToTensor()"))
    expected = np.stack([centre.apply(decode(f)) for f in ds.train.rows.files])
    np.testing.assert_array_equal(plain, expected)
    evaluated = np.concatenate([x for x, _ in ds.val.chunks(2)])  # what evaluation sees of val
    np.testing.assert_array_equal(evaluated, np.stack([centre.apply(decode(f)) for f in ds.val.rows.files]))


def test_folders_are_read_as_torchvision_reads_them(tmp_path):
    root = tmp_path / "photos"
    names = ["10", "2", "Zebra", "apple"]  # ImageFolder sorts as strings: 10 < 2 < Zebra < apple
    for c, name in enumerate(names):
        for i in range(6):
            sub = "nested/" if i == 5 else ""
            ext = ["png", "JPG", "bmp", "jpeg", "PNG", "png"][i]
            _image(root / "train" / name / f"{sub}{i}.{ext}", (8 + i, 8), "RGB", seed=c * 10 + i)
        _image(root / "val" / name / "v.png", (8, 8), "L", seed=100 + c)
    (root / "train" / "apple" / "notes.txt").write_text("not an image")
    model = load_model(tiny_cnn(tmp_path / "four.onnx", n_classes=4))
    ds = load_dataset(root, model)
    _transforms()  # imports torchvision, with its stubs, before its datasets
    from torchvision.datasets import ImageFolder

    reference = ImageFolder(str(root / "train"))
    assert list(ds.classes) == reference.classes == sorted(names)
    assert [(str(f), int(y)) for f, y in zip(ds.train.rows.files, ds.train.labels)] == reference.samples
    assert ds.format is DataFormat.IMAGES and ds.split == "train/ and val/ folders" and len(ds.val) == 4

    flat = tmp_path / "flat"
    for c in range(3):
        for i in range(5 + 5 * c):
            _image(flat / f"c{c}" / f"{i}.png", (6, 6), "L", seed=c * 100 + i)
    tiny = load_model(tiny_cnn(tmp_path / "tiny.onnx"))
    one, two = load_dataset(flat, tiny), load_dataset(flat, tiny)
    assert [int((one.val.labels == c).sum()) for c in range(3)] == [1, 2, 3]  # 20 % of 5, 10 and 15
    assert one.val.rows.files == two.val.rows.files and one.sha256 == two.sha256
    assert "stratified" in one.split


def test_a_csv_names_images_and_their_classes(tmp_path):
    tiny = load_model(tiny_cnn(tmp_path / "tiny.onnx"))
    rows = []
    for i in range(12):
        label = ["cat", "dog", "owl"][i % 3]
        _image(tmp_path / "img" / f"{i}.png", (7, 7), "RGB", seed=i)
        rows.append(f"img/{i}.png,{label},{'val' if i >= 9 else 'train'}")
    csv = tmp_path / "labels.csv"
    csv.write_text("path,label,split\n" + "\n".join(rows) + "\n")
    ds = load_dataset(csv, tiny)
    assert ds.format is DataFormat.CSV and ds.classes == ("cat", "dog", "owl") and (len(ds.train), len(ds.val)) == (9, 3)
    assert ds.val.labels.tolist() == [0, 1, 2]
    numbers = tmp_path / "numbers.csv"
    numbers.write_text("\n".join(f"img/{i}.png,{i % 3}" for i in range(12)))
    plain = load_dataset(numbers, tiny)
    assert plain.classes is None and sorted(set(plain.train.labels.tolist())) == [0, 1, 2]
    # a plan's class names decide the indices of new data, whatever names it lacks
    four = load_model(tiny_cnn(tmp_path / "four.onnx", n_classes=4))
    again = load_dataset(csv, four, classes=["ant", "cat", "dog", "owl"])
    assert again.val.labels.tolist() == [1, 2, 3] and again.sha256 != ds.sha256
    with pytest.raises(BadInput, match="class 'owl' is not one the plan was made with"):
        load_dataset(csv, tiny, classes=["cat", "dog"])


def test_npz_samples_are_read_by_position_and_compressed_ones_unpacked_once(tmp_path):
    model = load_model(DEFAULT_MODEL)
    with np.load(DEFAULT_DATA) as npz:
        arrays = {k: npz[k] for k in npz.files}
    np.savez(tmp_path / "stored.npz", **arrays)
    stored = load_dataset(tmp_path / "stored.npz", model, cache_dir=tmp_path / "cache")
    rng = np.random.default_rng(0)
    for index in (rng.permutation(600)[:37], np.array([5, 5, 4, 3, 599, 0]), np.arange(100, 164)):
        x, y = stored.train.batch(index)
        np.testing.assert_array_equal(x, arrays["x_train"][index])
        np.testing.assert_array_equal(y, arrays["y_train"][index])
    assert not (tmp_path / "cache").exists()  # nothing to unpack

    names = np.array(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"])
    packed = tmp_path / "packed.npz"
    np.savez_compressed(packed, x=arrays["x_train"].astype(np.float64), y=names[arrays["y_train"]])
    ds = load_dataset(packed, model, cache_dir=tmp_path / "cache")
    assert ds.classes == tuple(sorted(names)) and ds.split == "the last 20% of x as val"
    x, y = ds.val.batch(np.arange(len(ds.val)))
    np.testing.assert_array_equal(x, arrays["x_train"][480:])
    assert [ds.classes[i] for i in y] == names[arrays["y_train"][480:]].tolist()
    (unpacked,) = (tmp_path / "cache" / "data").glob("*/x.npy")
    with open(unpacked, "r+b") as f:  # bit rot in the unpacked copy: noticed, unpacked again
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    again = load_dataset(packed, model, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(again.val.batch(np.arange(len(ds.val)))[0], arrays["x_train"][480:])


def test_a_folder_of_npy_files_reads_as_the_npz_it_would_zip(tmp_path):
    """`np.save` of each array into one folder: the same samples and labels as the `.npz`, read by
    position from each file; the dataset's sha256 follows every file's content."""
    model = load_model(DEFAULT_MODEL)
    with np.load(DEFAULT_DATA) as npz:
        arrays = {k: npz[k] for k in npz.files}
    (tmp_path / "split").mkdir()
    for name, array in arrays.items():
        np.save(tmp_path / "split" / f"{name}.npy", array)
    folder = load_dataset(tmp_path / "split", model, cache_dir=tmp_path / "cache")
    assert folder.format is DataFormat.NPY and folder.split == "x_train/x_val as given"
    for split, n in (("train", 600), ("val", 200)):
        index = np.random.default_rng(1).permutation(n)[:41]
        x, y = getattr(folder, split).batch(index)
        np.testing.assert_array_equal(x, arrays[f"x_{split}"][index])
        np.testing.assert_array_equal(y, arrays[f"y_{split}"][index])

    names = np.array(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"])
    (tmp_path / "xy").mkdir()
    np.save(tmp_path / "xy" / "x.npy", arrays["x_train"])
    np.save(tmp_path / "xy" / "y.npy", names[arrays["y_train"]])
    xy = load_dataset(tmp_path / "xy", model)
    assert xy.classes == tuple(sorted(names)) and xy.split == "the last 20% of x as val"
    x, y = xy.val.batch(np.arange(len(xy.val)))
    np.testing.assert_array_equal(x, arrays["x_train"][480:])
    assert [xy.classes[i] for i in y] == names[arrays["y_train"][480:]].tolist()
    assert not (tmp_path / "cache").exists()  # read in place

    np.save(tmp_path / "xy" / "y.npy", names[np.roll(arrays["y_train"], 1)])
    assert load_dataset(tmp_path / "xy", model).sha256 != xy.sha256


def test_a_folder_of_npy_files_plans_reports_and_runs(tmp_path):
    """README's "a folder of `.npy`", end to end: a plan, its report saying what the data was,
    and `run` on the same folder reproducing the plan's measured accuracy."""
    (tmp_path / "arrays").mkdir()
    with np.load(DEFAULT_DATA) as npz:
        for name in npz.files:
            np.save(tmp_path / "arrays" / f"{name}.npy", npz[name])
    result = planner.plan(data=tmp_path / "arrays", out=tmp_path / "plan", trials=2, accuracy_steps=40, latency_repeats=2)
    assert result.plan is not None
    recorded = json.loads((tmp_path / "plan" / "plan.json").read_text())["dataset"]
    assert recorded["format"] == "npy"
    assert "arrays in .npy files" in (tmp_path / "plan" / "report.md").read_text()
    ran = planner.run(tmp_path / "plan", data=tmp_path / "arrays", steps=40, out=tmp_path / "ran")
    assert ran.after["accuracy"] == result.plan.metrics.accuracy.after


def test_only_the_arrays_planner_reads_are_unpacked_and_only_into_the_cache(tmp_path):
    """A zip's member names are the file's, not planner's: `../../x.npy` or an absolute path
    must not be written where it points, and arrays beside x and y are not read at all."""
    model = load_model(DEFAULT_MODEL)
    with np.load(DEFAULT_DATA) as npz:
        x, y = npz["x_train"], npz["y_train"]

    def npy(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    outside = tmp_path / "outside"
    with zipfile.ZipFile(tmp_path / "odd.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", npy(x))
        zf.writestr("y.npy", npy(y))
        zf.writestr("../../" + str(outside).lstrip("/") + "/x.npy", npy(x[:3]))
        zf.writestr(str(outside / "abs.npy"), npy(x[:3]))
        zf.writestr("notes.npy", npy(np.array([{"a": 1}], dtype=object)))  # unreadable, and not read
    ds = load_dataset(tmp_path / "odd.npz", model, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(ds.train.batch(np.arange(5))[0], x[:5])
    assert not outside.exists()
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*.npy")) == ["x.npy"]


@pytest.mark.slow  # two measured schemes and two runs
def test_an_image_folder_plans_and_runs_as_its_npz_does(tmp_path):
    """Digits as PNG and JPEG files of three sizes, one folder per class: measured and run, they
    train exactly as the arrays torchvision makes of the same files with the same transforms."""
    root = tmp_path / "digits"
    with np.load(DEFAULT_DATA) as npz:
        arrays = {k: npz[k] for k in npz.files}
    for split in ("train", "val"):
        for i, (x, y) in enumerate(zip(arrays[f"x_{split}"], arrays[f"y_{split}"])):
            grey = Image.fromarray(np.clip(np.round((x[0] + 0.1) / 1.2 * 255), 0, 255).astype(np.uint8))
            size, fmt = [(8, "png"), (16, "png"), (12, "jpg")][i % 3]
            path = root / split / f"digit-{y}" / f"{i:04d}.{fmt}"
            path.parent.mkdir(parents=True, exist_ok=True)
            grey.resize((size, size), Image.Resampling.NEAREST).convert("RGB" if fmt == "jpg" else "L").save(path)
    text = "Resize(8), CenterCrop(8), Grayscale(), ToTensor(), Normalize(mean=[0.0833], std=[0.8333])"
    compose = _torchvision_compose(text)
    from torchvision.datasets import ImageFolder

    made = {s: ImageFolder(str(root / s), transform=compose) for s in ("train", "val")}
    equivalent = tmp_path / "equivalent.npz"
    np.savez(
        equivalent,
        **{f"x_{s}": np.stack([x.numpy() for x, _ in made[s]]) for s in made},
        **{f"y_{s}": np.array([y for _, y in made[s]]) for s in made},
    )
    scheme = EXAMPLE_DIR / "last-conv.yaml"
    common = dict(scheme=scheme, accuracy_steps=40, latency_repeats=2)
    images = planner.measure(DEFAULT_MODEL, data=root, preprocess=text, out=tmp_path / "images", **common)
    npz = planner.measure(DEFAULT_MODEL, data=equivalent, out=tmp_path / "npz", **common)
    assert images.plan.metrics.accuracy == npz.plan.metrics.accuracy
    recorded = json.loads((tmp_path / "images" / "plan.json").read_text())["dataset"]
    assert recorded["format"] == "images" and recorded["classes"] == [f"digit-{d}" for d in range(10)]
    assert str(Preprocess.from_json(recorded["preprocess"], "plan")) == (
        "Resize(size=8), CenterCrop(size=8), Grayscale(), ToTensor(), Normalize(mean=[0.0833], std=[0.8333])"
    )
    # `run` re-applies the recorded steps: on the folder as on the arrays they make
    by_files = planner.run(tmp_path / "images", steps=30, out=tmp_path / "ran-images")
    by_arrays = planner.run(tmp_path / "images", data=equivalent, steps=30, out=tmp_path / "ran-arrays")
    assert (by_files.before, by_files.after) == (by_arrays.before, by_arrays.after)
    assert by_files.after["accuracy"] > by_files.before["accuracy"]


@pytest.mark.slow  # writes and reads 2.2 GB
def test_a_dataset_larger_than_the_memory_limit_plans_and_runs_within_it(tmp_path, tiny_model):
    """7.5 M float64 samples, 2.2 GB in an uncompressed .npz, under a 1.5 GiB address-space limit
    on the planner process (planner itself needs about 1.3): `plan` and `run` finish."""
    n, limit = 7_500_000, 3 << 29
    path = tmp_path / "big.npz"
    val = blobs(tmp_path / "val.npz", n=300)
    with np.load(val) as small:
        x_val, y_val = small["x"], small["y"]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        with z.open("x_train.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (n, 1, 6, 6)})
            block = np.repeat(x_val.astype(np.float64), 500, axis=0)  # 150,000 samples
            for _ in range(n // len(block)):
                f.write(block.tobytes())
        for name, array in (("y_train", np.tile(y_val, n // 300).astype(np.uint8)), ("x_val", x_val), ("y_val", y_val)):
            with z.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, array)
    assert path.stat().st_size > limit

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = tmp_path / "plan"
    res = planner_process(
        "plan", "--model", tiny_model, "--data", path, "--trials", "2", "--accuracy-steps", "20", "--out", out, preexec_fn=cap
    )
    assert res.returncode == 0, res.stderr
    res = planner_process("run", out, "--steps", "20", "--json", preexec_fn=cap)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["steps"] == 20


@pytest.mark.slow  # a study and a run through the command line
def test_the_image_example_plans_and_runs_from_the_command_line(tmp_path):
    res = planner_process("example", "digits-images", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    root = tmp_path / "digits-images"
    files = sorted(root.glob("*/*/*.png"))
    assert len(files) == 899 and {Image.open(f).size[0] for f in files} == {8, 12, 16, 20, 24, 28, 32}
    again = planner_process("example", "digits-images", cwd=tmp_path)  # already there: kept
    assert again.returncode == 0 and sorted(root.glob("*/*/*.png")) == files
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("")
    refused = planner_process("example", "mine", cwd=tmp_path)
    assert refused.returncode == 2 and "is not the image example" in refused.stderr

    spec = root / "preprocess.yaml"
    args = ("--data", root, "--preprocess", spec, "--trials", "2", "--accuracy-steps", "30", "--out", tmp_path / "plan")
    res = planner_process("plan", *args)
    assert res.returncode in PLANNED, res.stderr
    dataset = json.loads((tmp_path / "plan" / "plan.json").read_text())["dataset"]
    assert dataset["format"] == "images" and dataset["classes"] == [str(d) for d in range(10)]
    assert [next(iter(s)) for s in dataset["preprocess"]] == ["Grayscale", "Resize", "CenterCrop", "ToTensor", "Normalize"]
    assert "preprocessing Grayscale(), Resize(size=8)" in (tmp_path / "plan" / "report.md").read_text()
    res = planner_process("run", tmp_path / "plan", "--steps", "30", "--json")
    assert res.returncode == 0, res.stderr
    ran = json.loads(res.stdout)
    assert ran["after"]["accuracy"] > ran["before"]["accuracy"]
