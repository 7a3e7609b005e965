"""Dataset loaders, each fed tiny files written in the dataset's own on-disk format."""

from __future__ import annotations

import gzip
import os
import pickle
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedbench.data import sources
from fedbench.data.sources import Dataset, cache_file, dataset_names, load_dataset
from fedbench.errors import ConfigError, DataError

FMNIST_SYSTEM = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def _no_system_dirs(monkeypatch, tmp_path_factory):
    # Tests see only what they write; the real-FMNIST test restores the system dir. Each
    # test has a cache folder of its own, outside its data root.
    monkeypatch.setattr(sources, "FMNIST_SYSTEM_DIRS", ())
    monkeypatch.setenv("FEDBENCH_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setattr(sources, "_unusable", set())


def tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its kind, size and mtime (what a write would change)."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


# ------------------------------------------------------------------------ file writers


def write_idx(path: Path, arr: np.ndarray, gz: bool = True) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def write_fmnist(folder: Path, n_train=20, n_test=10, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    xtr = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    ytr = np.arange(n_train, dtype=np.uint8) % 10
    xte = rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    yte = (np.arange(n_test, dtype=np.uint8) * 3) % 10
    write_idx(folder / "train-images-idx3-ubyte", xtr, gz)
    write_idx(folder / "train-labels-idx1-ubyte", ytr, gz)
    write_idx(folder / "t10k-images-idx3-ubyte", xte, gz)
    write_idx(folder / "t10k-labels-idx1-ubyte", yte, gz)
    return xtr, ytr, xte, yte


def write_pickle(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(obj, f)


def cifar_batch(rng, n, label_key, num_classes):
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, num_classes, n)]
    return {b"batch_label": b"x", b"data": data, label_key: labels, b"filenames": []}


def write_cifar10(root: Path, per_batch=4, n_test=10, seed=1):
    rng = np.random.default_rng(seed)
    d = root / "cifar-10-batches-py"
    batches = [cifar_batch(rng, per_batch, b"labels", 10) for _ in range(5)]
    for i, b in enumerate(batches, 1):
        write_pickle(d / f"data_batch_{i}", b)
    test = cifar_batch(rng, n_test, b"labels", 10)
    write_pickle(d / "test_batch", test)
    return batches, test


def write_tinyimagenet(root: Path):
    """Three classes, listed unsorted in wnids.txt; each image a solid, class-coded colour."""
    d = root / "tiny-imagenet-200"
    wnids = ["n03000000", "n01000000", "n02000000"]  # sorted index: n01->0, n02->1, n03->2
    colours = {"n01000000": (250, 0, 0), "n02000000": (0, 250, 0), "n03000000": (0, 0, 250)}
    d.mkdir(parents=True)
    (d / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for w in wnids:
        img_dir = d / "train" / w / "images"
        img_dir.mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (64, 64), colours[w]).save(img_dir / f"{w}_{i}.JPEG", quality=95)
        (d / "train" / w / f"{w}_boxes.txt").write_text("")
    (d / "val" / "images").mkdir(parents=True)
    val = [("val_0.JPEG", "n02000000"), ("val_1.JPEG", "n03000000"), ("val_2.JPEG", "n01000000")]
    lines = []
    for fname, w in val:
        # One grayscale image: the loader must convert it to RGB.
        mode = "L" if fname == "val_2.JPEG" else "RGB"
        colour = 128 if mode == "L" else colours[w]
        Image.new(mode, (64, 64), colour).save(d / "val" / "images" / fname, quality=95)
        lines.append(f"{fname}\t{w}\t0\t0\t63\t63")
    (d / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return colours


def write_bmp_as_jpeg(path: Path, colour) -> None:
    """A 64x64 image in BMP bytes under a .JPEG name (PIL goes by content): unlike a JPEG,
    its size does not depend on the pixels, so two colours give files of equal size."""
    Image.new("RGB", (64, 64), colour).save(path, format="BMP")


# -------------------------------------------------------------------- file damage


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path: Path, at: int) -> None:
    """Invert byte ``at`` (negative: from the end)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def replace_with_garbage(path: Path) -> None:
    path.write_bytes(b"<html><body>503 Service Unavailable</body></html>\n" * 40)


def age(root: Path, seconds: float) -> None:
    """Set the mtime of every raw file under ``root`` ``seconds`` in the past."""
    when = time.time() - seconds
    for p in root.rglob("*"):
        if p.is_file():
            os.utime(p, (when, when))


def bad_file_error(root: Path, name: str, path: Path, **params) -> str:
    """The one-line DataError loading ``name`` gives, which must name ``path``. Any other
    exception type escapes pytest.raises and fails the test."""
    with pytest.raises(DataError) as exc:
        load_dataset(name, root, download=False, **params)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def write_pathmnist(root: Path, seed=2):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in (("train", 20), ("val", 5), ("test", 10)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 9, (n, 1)).astype(np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(root / "pathmnist.npz", **arrays)
    return arrays


# ------------------------------------------------------------------------------ tests


@pytest.mark.quick
def test_registry_lists_all_datasets():
    assert dataset_names() == sorted(
        ["fmnist", "cifar10", "cifar100", "tinyimagenet", "pathmnist", "synthetic"]
    )


@pytest.mark.quick
def test_unknown_dataset_and_parameter_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="valid"):
        load_dataset("mnist", tmp_path)
    with pytest.raises(ConfigError, match="use_val"):
        load_dataset("pathmnist", tmp_path, download=False, use_vall=True)


@pytest.mark.quick
@pytest.mark.parametrize(
    "layout,gz", [(".", True), ("fashion-mnist", True), ("FashionMNIST/raw", False)]
)
def test_fmnist_idx_layouts(tmp_path, layout, gz):
    xtr, ytr, xte, yte = write_fmnist(tmp_path / layout, gz=gz)
    ds = load_dataset("fmnist", tmp_path, download=False)
    assert isinstance(ds, Dataset)
    assert ds.x_train.shape == (20, 1, 28, 28) and ds.x_test.shape == (10, 1, 28, 28)
    assert ds.x_train.dtype == torch.uint8 and ds.y_train.dtype == torch.int64
    assert torch.equal(ds.x_train[:, 0], torch.from_numpy(xtr))
    assert ds.y_train.tolist() == ytr.tolist() and ds.y_test.tolist() == yte.tolist()
    assert ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    assert ds.mean == (0.2860,) and ds.std == (0.3530,)


@pytest.mark.quick
def test_digest_follows_content_not_location(tmp_path):
    """A moved copy of the same files has the same digest; labels shifted by one do not."""
    write_fmnist(tmp_path / "a", gz=True)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a = load_dataset("fmnist", tmp_path / "a", download=False)
    b = load_dataset("fmnist", tmp_path / "b", download=False)
    assert a.digest() == b.digest() and len(a.digest()) == 64
    shifted = Dataset(**{**a.__dict__, "y_train": (a.y_train + 1) % 10})
    assert shifted.digest() != a.digest()


@pytest.mark.quick
def test_fmnist_truncated_idx_is_data_error(tmp_path):
    write_fmnist(tmp_path, gz=False)
    f = tmp_path / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(DataError, match="truncated"):
        load_dataset("fmnist", tmp_path, download=False)


@pytest.mark.quick
def test_cifar10_pickles(tmp_path):
    batches, test = write_cifar10(tmp_path)
    ds = load_dataset("cifar10", tmp_path, download=False)
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (10, 3, 32, 32)
    assert ds.x_train.dtype == torch.uint8 and ds.y_test.dtype == torch.int64
    # Batches in order 1..5; row layout is 1024 red, 1024 green, 1024 blue, row-major.
    labels = [lab for b in batches for lab in b[b"labels"]]
    assert ds.y_train.tolist() == labels and ds.y_test.tolist() == test[b"labels"]
    row = batches[1][b"data"][0]
    img = ds.x_train[4]
    assert img[0, 0, 0] == row[0] and img[1, 0, 0] == row[1024] and img[2, 31, 31] == row[3071]
    assert img[0, 1, 2] == row[32 + 2]
    assert ds.num_classes == 10 and len(ds.mean) == 3 and len(ds.std) == 3


@pytest.mark.quick
def test_federation_normalizes_per_channel_or_keeps_pixels_in_unit_range(tmp_path):
    """data.normalize: (x / 255 - mean_c) / std_c per channel, or x / 255 alone."""
    from fedbench.data.federation import Federation
    from fedbench.data.splits import Partition

    write_cifar10(tmp_path)
    ds = load_dataset("cifar10", tmp_path, download=False)
    part = Partition([np.arange(20)], [np.arange(20, 30)])
    raw = torch.cat([ds.x_train, ds.x_test]).double() / 255
    mean = torch.tensor(ds.mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(ds.std, dtype=torch.float64).view(1, 3, 1, 1)
    on = Federation(ds, part).x.double()
    off = Federation(ds, part, normalize=False).x.double()
    raw = raw[:30]  # the samples the clients' sets name (the pool's first 30)
    assert torch.allclose(on, (raw - mean) / std, atol=1e-5)
    assert torch.allclose(off, raw, atol=1e-6) and off.min() >= 0 and off.max() <= 1


@pytest.mark.quick
def test_a_run_saved_before_data_normalize_resumes_normalized():
    """Inputs were always normalized before `data.normalize` existed: resuming such a run
    with normalize=true is no difference, with normalize=false it is refused."""
    from conftest import compose
    from fedbench.runner import resume_differences
    from fedbench.trees import plain

    now = plain(compose(["algo=fedavg"]))
    saved = {**now, "data": {k: v for k, v in now["data"].items() if k != "normalize"}}
    assert resume_differences(saved, now) == []
    off = plain(compose(["algo=fedavg", "data.normalize=false"]))
    assert resume_differences(saved, off) == ["data.normalize (absent -> False)"]


@pytest.mark.quick
def test_cifar100_fine_labels(tmp_path):
    rng = np.random.default_rng(3)
    d = tmp_path / "cifar-100-python"
    train = cifar_batch(rng, 20, b"fine_labels", 100)
    train[b"coarse_labels"] = [0] * 20
    train[b"fine_labels"][0] = 99
    test = cifar_batch(rng, 10, b"fine_labels", 100)
    write_pickle(d / "train", train)
    write_pickle(d / "test", test)
    ds = load_dataset("cifar100", tmp_path, download=False)
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (10, 3, 32, 32)
    assert ds.y_train.tolist() == train[b"fine_labels"] and ds.y_train[0] == 99
    assert ds.y_test.tolist() == test[b"fine_labels"]
    assert ds.num_classes == 100


@pytest.mark.quick
def test_cifar_pickle_with_wrong_labels_is_data_error(tmp_path):
    d = tmp_path / "cifar-100-python"
    rng = np.random.default_rng(4)
    write_pickle(d / "train", cifar_batch(rng, 4, b"labels", 10))  # a CIFAR-10 batch
    write_pickle(d / "test", cifar_batch(rng, 4, b"labels", 10))
    with pytest.raises(DataError, match="cifar100"):
        load_dataset("cifar100", tmp_path, download=False)


@pytest.mark.quick
def test_tinyimagenet_folder(tmp_path):
    colours = write_tinyimagenet(tmp_path)
    ds = load_dataset("tinyimagenet", tmp_path, download=False)
    assert ds.x_train.shape == (6, 3, 64, 64) and ds.x_test.shape == (3, 3, 64, 64)
    assert ds.x_train.dtype == torch.uint8 and ds.y_train.dtype == torch.int64
    assert ds.num_classes == 200 and ds.input_shape == (3, 64, 64)
    # Class index = position in sorted wnids, whatever the order in wnids.txt.
    assert ds.y_train.tolist() == [0, 0, 1, 1, 2, 2]
    assert ds.y_test.tolist() == [1, 2, 0]
    for img, label in zip(ds.x_train, ds.y_train.tolist()):
        wnid = sorted(colours)[label]
        mean = img.float().mean(dim=(1, 2))
        assert torch.allclose(mean, torch.tensor(colours[wnid], dtype=torch.float), atol=8)
    gray = ds.x_test[2].float().mean(dim=(1, 2))  # grayscale JPEG came back as 3 equal channels
    assert torch.allclose(gray, torch.full((3,), 128.0), atol=4)


@pytest.mark.quick
def test_tinyimagenet_unknown_val_class_is_data_error(tmp_path):
    write_tinyimagenet(tmp_path)
    ann = tmp_path / "tiny-imagenet-200" / "val" / "val_annotations.txt"
    ann.write_text("val_0.JPEG\tn09999999\t0\t0\t1\t1\n")
    with pytest.raises(DataError, match="n09999999"):
        load_dataset("tinyimagenet", tmp_path, download=False)


@pytest.mark.quick
@pytest.mark.parametrize("use_val", [False, True])
def test_pathmnist_npz(tmp_path, use_val):
    a = write_pathmnist(tmp_path)
    ds = load_dataset("pathmnist", tmp_path, download=False, use_val=use_val)
    n_train = 25 if use_val else 20
    assert ds.x_train.shape == (n_train, 3, 28, 28) and ds.x_test.shape == (10, 3, 28, 28)
    assert ds.x_train.dtype == torch.uint8 and ds.y_train.dtype == torch.int64
    assert torch.equal(ds.x_train[:20].permute(0, 2, 3, 1), torch.from_numpy(a["train_images"]))
    labels = a["train_labels"].ravel().tolist()
    if use_val:
        labels += a["val_labels"].ravel().tolist()
    assert ds.y_train.tolist() == labels
    assert ds.y_test.tolist() == a["test_labels"].ravel().tolist()
    assert ds.num_classes == 9 and len(ds.mean) == 3


@pytest.mark.quick
@pytest.mark.parametrize("name", ["fmnist", "cifar10", "tinyimagenet", "pathmnist"])
def test_cache_written_and_reused_without_raw_files(tmp_path, name):
    writers = {
        "fmnist": lambda: write_fmnist(tmp_path),
        "cifar10": lambda: write_cifar10(tmp_path),
        "tinyimagenet": lambda: write_tinyimagenet(tmp_path),
        "pathmnist": lambda: write_pathmnist(tmp_path),
    }
    writers[name]()
    raw = set(tmp_path.iterdir())
    first = load_dataset(name, tmp_path, download=False)
    cache = cache_file(name, tmp_path)
    assert cache.is_file()
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temp files left
    for p in raw:  # delete the raw files: the second load must come from the cache
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    second = load_dataset(name, tmp_path, download=False)
    assert torch.equal(first.x_train, second.x_train) and torch.equal(first.y_test, second.y_test)


@pytest.mark.quick
def test_stale_cache_is_ignored(tmp_path):
    write_fmnist(tmp_path, seed=0)
    first = load_dataset("fmnist", tmp_path, download=False)
    cache = cache_file("fmnist", tmp_path)
    old = cache.stat().st_mtime - 100
    os.utime(cache, (old, old))  # raw files now newer than the cache
    xtr, *_ = write_fmnist(tmp_path, seed=1)
    second = load_dataset("fmnist", tmp_path, download=False)
    assert not torch.equal(first.x_train, second.x_train)
    assert torch.equal(second.x_train[:, 0], torch.from_numpy(xtr))


@pytest.mark.quick
def test_corrupt_cache_is_redecoded(tmp_path):
    xtr, *_ = write_fmnist(tmp_path)
    cache = cache_file("fmnist", tmp_path)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_bytes(b"not a torch file")
    ds = load_dataset("fmnist", tmp_path, download=False)
    assert torch.equal(ds.x_train[:, 0], torch.from_numpy(xtr))


@pytest.mark.quick
@pytest.mark.parametrize("where", ["a file", "under a file", "no home"])
def test_an_unusable_cache_folder_warns_once_and_the_load_goes_on(
    tmp_path, monkeypatch, caplog, where
):
    xtr, *_ = write_fmnist(tmp_path / "data")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    if where == "a file":
        monkeypatch.setenv("FEDBENCH_CACHE", str(blocker))
    elif where == "under a file":
        monkeypatch.setenv("FEDBENCH_CACHE", str(blocker / "cache"))
    else:  # no $FEDBENCH_CACHE, no $XDG_CACHE_HOME and no home folder: Path.expanduser says

        def no_home():
            raise RuntimeError("Could not determine home directory.")

        monkeypatch.setattr(sources, "cache_dir", no_home)
    with caplog.at_level("WARNING", logger="fedbench"):
        for _ in range(2):
            ds = load_dataset("fmnist", tmp_path / "data", download=False)
            assert torch.equal(ds.x_train[:, 0], torch.from_numpy(xtr))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "going on without it" in warned[0], warned
    assert "\n" not in warned[0] and "FEDBENCH_CACHE" in warned[0]
    assert blocker.read_text() == "a file where the cache folder should be"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "data"]


@pytest.mark.quick
def test_the_cache_lives_in_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDBENCH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sources.cache_dir() == tmp_path / "xdg" / "fedbench" / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # not absolute: ignored (XDG spec)
    assert sources.cache_dir() == Path.home() / ".cache" / "fedbench" / "cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert sources.cache_dir() == Path.home() / ".cache" / "fedbench" / "cache"
    monkeypatch.setenv("FEDBENCH_CACHE", str(tmp_path / "mine"))
    assert sources.cache_dir() == tmp_path / "mine"
    assert cache_file("fmnist", tmp_path / "a").parent == tmp_path / "mine"
    assert cache_file("fmnist", tmp_path / "a") != cache_file("fmnist", tmp_path / "b")
    assert cache_file("fmnist", tmp_path / "a") != cache_file("cifar10", tmp_path / "a")


@pytest.mark.quick
def test_a_read_only_source_folder_gets_nothing_written_into_it(tmp_path):
    src = tmp_path / "src"
    xtr, *_ = write_fmnist(src)
    before = tree(src)
    modes = {p: p.stat().st_mode for p in [src, *src.rglob("*")]}
    for p in modes:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        for _ in range(2):  # the first load decodes and caches, the second reads the cache
            ds = load_dataset("fmnist", src, download=False)
            assert torch.equal(ds.x_train[:, 0], torch.from_numpy(xtr))
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
    assert tree(src) == before  # as root the modes stop nothing: the loader must not write
    assert cache_file("fmnist", src).is_file()


@pytest.mark.quick
def test_two_data_roots_never_share_a_cache_entry(tmp_path):
    """Same dataset, same file names and sizes, other content: each root its own entry, also
    once the raw files are gone (a cache then stands in for its own root's files only)."""
    xa, *_ = write_fmnist(tmp_path / "a", seed=0)
    xb, *_ = write_fmnist(tmp_path / "b", seed=1)
    for root, x in (("a", xa), ("b", xb), ("a", xa)):
        ds = load_dataset("fmnist", tmp_path / root, download=False)
        assert torch.equal(ds.x_train[:, 0], torch.from_numpy(x))
    assert cache_file("fmnist", tmp_path / "a") != cache_file("fmnist", tmp_path / "b")
    shutil.rmtree(tmp_path / "b")
    (tmp_path / "b").mkdir()
    ds = load_dataset("fmnist", tmp_path / "b", download=False)
    assert torch.equal(ds.x_train[:, 0], torch.from_numpy(xb))
    with pytest.raises(DataError):
        load_dataset("fmnist", tmp_path / "c", download=False)


@pytest.mark.quick
def test_root_none_uses_fedbench_data_env(tmp_path, monkeypatch):
    write_fmnist(tmp_path / "fashion-mnist")
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path))
    assert load_dataset("fmnist", None, download=False).x_train.shape == (20, 1, 28, 28)
    assert sources.default_root() == tmp_path
    monkeypatch.delenv("FEDBENCH_DATA")
    assert sources.default_root() == Path.home() / ".cache" / "fedbench"


@pytest.mark.quick
@pytest.mark.parametrize(
    "name,path_part,hint",
    [
        ("fmnist", "FashionMNIST", "apt-get install dataset-fashion-mnist"),
        ("cifar10", "cifar-10-batches-py", "cifar-10-python.tar.gz"),
        ("cifar100", "cifar-100-python", "cifar-100-python.tar.gz"),
        ("tinyimagenet", "tiny-imagenet-200", "http://cs231n.stanford.edu/tiny-imagenet-200.zip"),
        ("pathmnist", "pathmnist.npz", "medmnist"),
    ],
)
def test_missing_files_give_one_line_data_error(tmp_path, name, path_part, hint):
    with pytest.raises(DataError) as exc:
        load_dataset(name, tmp_path, download=False)
    msg = str(exc.value)
    assert "\n" not in msg
    assert repr(name) in msg and str(tmp_path) in msg and path_part in msg and hint in msg


@pytest.mark.quick
def test_missing_pathmnist_without_medmnist_package(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_medmnist(name, *args, **kwargs):
        if name == "medmnist":
            raise ImportError("no medmnist")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_medmnist)
    with pytest.raises(DataError, match="medmnist package is not installed") as exc:
        load_dataset("pathmnist", tmp_path, download=True)
    assert "\n" not in str(exc.value)


@pytest.mark.quick
def test_synthetic_deterministic_and_valid():
    kw = dict(num_samples=600, groups=30, seed=3)
    a = load_dataset("synthetic", None, **kw)
    b = load_dataset("synthetic", None, **kw)
    c = load_dataset("synthetic", None, **{**kw, "seed": 4})
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert a.x_train.shape == (480, 60) and a.x_test.shape == (120, 60)
    assert a.x_train.dtype == torch.float32 and a.y_train.dtype == torch.int64
    assert a.num_classes == 10 and a.input_shape == (60,) and a.mean == () and a.std == ()
    y = torch.cat([a.y_train, a.y_test])
    assert int(y.min()) >= 0 and int(y.max()) < 10
    assert len(y.unique()) > 1


@pytest.mark.quick
def test_synthetic_params_and_validation():
    ds = load_dataset("synthetic", None, dim=5, num_classes=3, num_samples=101, test_frac=0.1)
    assert ds.x_train.shape == (91, 5) and ds.x_test.shape == (10, 5) and ds.num_classes == 3
    assert int(ds.y_train.max()) < 3
    with pytest.raises(ConfigError):
        load_dataset("synthetic", None, test_frac=1.5)
    with pytest.raises(ConfigError):
        load_dataset("synthetic", None, num_samples=10, groups=30)


@pytest.mark.slow
@pytest.mark.skipif(not FMNIST_SYSTEM.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fmnist_from_debian_package(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "FMNIST_SYSTEM_DIRS", (FMNIST_SYSTEM,))
    package = tree(FMNIST_SYSTEM)
    ds = load_dataset("fmnist", tmp_path, download=False)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert ds.y_train.bincount().tolist() == [6000] * 10
    assert ds.y_test.bincount().tolist() == [1000] * 10
    assert cache_file("fmnist", tmp_path).is_file()  # in the cache folder, not /usr/share
    assert tree(FMNIST_SYSTEM) == package and list(tmp_path.iterdir()) == []
    # the package's folder as the data root: still nothing written into it
    assert (
        load_dataset("fmnist", FMNIST_SYSTEM, download=False).y_test.bincount().tolist()
        == [1000] * 10
    )
    assert tree(FMNIST_SYSTEM) == package and cache_file("fmnist", FMNIST_SYSTEM).is_file()


# ------------------------------------------------- damaged files: one line, naming the file


def write_cifar100(root: Path):
    rng = np.random.default_rng(5)
    d = root / "cifar-100-python"
    write_pickle(d / "train", cifar_batch(rng, 8, b"fine_labels", 100))
    write_pickle(d / "test", cifar_batch(rng, 4, b"fine_labels", 100))


TINY = Path("tiny-imagenet-200")
FMNIST_FIX = "data.download=true"
CIFAR_FIX = "python.tar.gz into data.root again"
TINY_FIX = "unzip http://cs231n.stanford.edu/tiny-imagenet-200.zip into data.root again"
PATHMNIST_FIX = "pathmnist.npz again"
MIDDLE = "middle"  # flip_byte position: inside gzip's / zip's checksummed payload

# (dataset, writer, damaged file relative to root, damage, words the message must hold)
DAMAGE = [
    ("fmnist", write_fmnist, "train-images-idx3-ubyte.gz", truncate, ("truncated", FMNIST_FIX)),
    ("fmnist", write_fmnist, "train-images-idx3-ubyte.gz", MIDDLE, ("corrupt", FMNIST_FIX)),
    ("fmnist", write_fmnist, "t10k-labels-idx1-ubyte.gz", 0, ("not an IDX file", FMNIST_FIX)),
    ("fmnist", write_fmnist, "t10k-labels-idx1-ubyte.gz", replace_with_garbage, (FMNIST_FIX,)),
    (
        "cifar10",
        write_cifar10,
        "cifar-10-batches-py/data_batch_3",
        truncate,
        ("truncated", CIFAR_FIX),
    ),
    ("cifar10", write_cifar10, "cifar-10-batches-py/test_batch", 0, ("corrupt", CIFAR_FIX)),
    (
        "cifar10",
        write_cifar10,
        "cifar-10-batches-py/data_batch_1",
        replace_with_garbage,
        (CIFAR_FIX,),
    ),
    ("cifar100", write_cifar100, "cifar-100-python/train", truncate, ("truncated", "cifar-100")),
    ("cifar100", write_cifar100, "cifar-100-python/test", replace_with_garbage, ("cifar-100",)),
    (
        "tinyimagenet",
        write_tinyimagenet,
        TINY / "train/n02000000/images/n02000000_1.JPEG",
        truncate,
        ("truncated", TINY_FIX),
    ),
    (
        "tinyimagenet",
        write_tinyimagenet,
        TINY / "train/n01000000/images/n01000000_0.JPEG",
        0,
        ("corrupt", TINY_FIX),
    ),
    (
        "tinyimagenet",
        write_tinyimagenet,
        TINY / "val/images/val_1.JPEG",
        replace_with_garbage,
        (TINY_FIX,),
    ),
    ("pathmnist", write_pathmnist, "pathmnist.npz", truncate, ("truncated", PATHMNIST_FIX)),
    ("pathmnist", write_pathmnist, "pathmnist.npz", MIDDLE, ("corrupt", PATHMNIST_FIX)),
    (
        "pathmnist",
        write_pathmnist,
        "pathmnist.npz",
        replace_with_garbage,
        ("not an npz", PATHMNIST_FIX),
    ),
]


def _damage_id(case) -> str:
    name, _, rel, damage, _ = case
    how = damage if isinstance(damage, str) else getattr(damage, "__name__", f"flip{damage}")
    return f"{name}-{Path(rel).name}-{how}"


@pytest.mark.quick
@pytest.mark.parametrize("case", DAMAGE, ids=[_damage_id(c) for c in DAMAGE])
def test_damaged_file_is_one_line_data_error_naming_it(tmp_path, case):
    name, write, rel, damage, words = case
    write(tmp_path)
    f = tmp_path / rel
    if damage == MIDDLE:
        flip_byte(f, f.stat().st_size // 2)
    elif isinstance(damage, int):
        flip_byte(f, damage)
    else:
        damage(f)
    msg = bad_file_error(tmp_path, name, f)
    for w in words:
        assert w in msg, msg


@pytest.mark.quick
def test_damaged_file_is_an_error_even_with_a_cache_of_the_old_one(tmp_path):
    write_fmnist(tmp_path)
    load_dataset("fmnist", tmp_path, download=False)  # cache of the sound files
    f = tmp_path / "train-images-idx3-ubyte.gz"
    truncate(f)
    bad_file_error(tmp_path, "fmnist", f)


@pytest.mark.quick
@pytest.mark.parametrize(
    "fname,edit,words",
    [
        # Cut inside the 16-byte header of the images file.
        ("train-images-idx3-ubyte", lambda b: b[:10], ("truncated", "header")),
        ("train-images-idx3-ubyte", lambda b: b + b"\0" * 7, ("corrupt", "(20, 28, 28)")),
        # The third magic byte says "unsigned bytes"; flipped, the file is something else.
        ("t10k-images-idx3-ubyte", lambda b: b[:2] + b"\xf7" + b[3:], ("bad magic",)),
        # The first label (byte 8, after magic and count) becomes 255: not a class.
        ("train-labels-idx1-ubyte", lambda b: b[:8] + b"\xff" + b[9:], ("labels span 0..255",)),
        # Images and labels of different lengths (a file from another release).
        (
            "t10k-labels-idx1-ubyte",
            lambda b: b[:4] + struct.pack(">I", 9) + b[8:17],
            ("holds 9 labels", "10 images"),
        ),
    ],
    ids=["header-cut", "extra-bytes", "bad-magic", "label-out-of-range", "count-mismatch"],
)
def test_fmnist_inconsistent_idx_is_data_error_naming_it(tmp_path, fname, edit, words):
    write_fmnist(tmp_path, gz=False)
    f = tmp_path / fname
    f.write_bytes(edit(f.read_bytes()))
    msg = bad_file_error(tmp_path, "fmnist", f)
    for w in words:
        assert w in msg, msg
    assert FMNIST_FIX in msg and "dataset-fashion-mnist" in msg


@pytest.mark.quick
def test_damaged_system_fmnist_says_reinstall_the_package(tmp_path, monkeypatch):
    system = tmp_path / "usr-share" / "fashion-mnist"
    write_fmnist(system)
    monkeypatch.setattr(sources, "FMNIST_SYSTEM_DIRS", (system,))
    f = system / "train-labels-idx1-ubyte.gz"
    truncate(f)
    msg = bad_file_error(tmp_path / "root", "fmnist", f)
    assert "apt-get install --reinstall dataset-fashion-mnist" in msg


@pytest.mark.quick
def test_cifar_batch_with_labels_out_of_range_names_it(tmp_path):
    batches, test = write_cifar10(tmp_path)
    test[b"labels"][3] = 10
    f = tmp_path / "cifar-10-batches-py" / "test_batch"
    write_pickle(f, test)
    assert "labels span 0..10" in bad_file_error(tmp_path, "cifar10", f)


@pytest.mark.quick
@pytest.mark.parametrize(
    "rel,content,words",
    [
        ("wnids.txt", b"\xff\xfe\x00garbage\x9c", ("wnids.txt", "UnicodeDecodeError")),
        ("wnids.txt", b"n01000000\nn09999999\n", ("'n09999999'", "no images")),
        (
            "val/val_annotations.txt",
            b"val_0.JPEG\tn02000000\t0\t0\t63\t63\nval_1.JP",  # cut mid-line
            ("line 2", "truncated"),
        ),
    ],
    ids=["wnids-not-text", "wnids-unknown-class", "annotations-cut"],
)
def test_tinyimagenet_damaged_index_file_names_it(tmp_path, rel, content, words):
    write_tinyimagenet(tmp_path)
    f = tmp_path / TINY / rel
    f.write_bytes(content)
    msg = bad_file_error(tmp_path, "tinyimagenet", f)
    for w in words:
        assert w in msg, msg
    assert TINY_FIX in msg


@pytest.mark.quick
def test_unreadable_file_says_why(tmp_path, monkeypatch):
    write_fmnist(tmp_path)
    f = tmp_path / "t10k-images-idx3-ubyte.gz"
    real = Path.read_bytes

    def denied(self):
        if self == f:  # as if chmod 000 (tests may run as root, which ignores modes)
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    msg = bad_file_error(tmp_path, "fmnist", f)
    assert "cannot be read (Permission denied)" in msg and "permissions" in msg


@pytest.mark.quick
def test_failed_download_names_the_partial_archive_it_left(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(gzip.compress(b"half a tar")[:12])  # an interrupted download

    class CorruptArchive:  # what torchvision says when the archive fails its MD5
        def __init__(self, *args, **kwargs):
            raise RuntimeError("File not found or corrupted.")

    monkeypatch.setattr(tvd, "CIFAR10", CorruptArchive)
    with pytest.raises(DataError) as exc:
        load_dataset("cifar10", tmp_path, download=True)
    msg = str(exc.value)
    assert "\n" not in msg and "corrupted" in msg
    assert f"{archive} may be truncated or corrupt: delete it and retry" in msg


@pytest.mark.quick
def test_root_that_is_a_file_is_data_error(tmp_path, monkeypatch):
    write_fmnist(tmp_path / "fashion-mnist")
    not_a_dir = tmp_path / "root.txt"
    not_a_dir.write_text("")
    monkeypatch.setattr(sources, "FMNIST_SYSTEM_DIRS", (tmp_path / "fashion-mnist",))
    for name in ("fmnist", "cifar10", "pathmnist"):
        with pytest.raises(DataError) as exc:  # not quietly the system copy, for FMNIST
            load_dataset(name, not_a_dir, download=True)
        assert str(exc.value) == f"data.root={not_a_dir} is a file, not a directory"
    monkeypatch.setenv("FEDBENCH_DATA", str(not_a_dir))
    with pytest.raises(DataError, match="FEDBENCH_DATA.*is a file, not a directory"):
        load_dataset("fmnist", None, download=False)


# --------------------------------------------------------- the cache: rebuilt, never wrong


def count_calls(monkeypatch, fn_name: str) -> list:
    """Record each call of sources.<fn_name> (the loaders look it up at call time)."""
    calls = []
    real = getattr(sources, fn_name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(sources, fn_name, counted)
    return calls


def _flip_in_tensor_data(cache: Path, pixels: bytes) -> None:
    # torch.save stores tensor bytes uncompressed: find a run of the images and flip it.
    at = cache.read_bytes().find(pixels[1000:1064])
    assert at > 0
    flip_byte(cache, at)


@pytest.mark.quick
@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip-pixel"])
def test_damaged_cache_is_rebuilt_with_a_warning(tmp_path, monkeypatch, caplog, damage):
    xtr, *_ = write_fmnist(tmp_path)
    load_dataset("fmnist", tmp_path, download=False)
    cache = cache_file("fmnist", tmp_path)
    if damage == "truncate":
        truncate(cache)
    elif damage == "garbage":
        replace_with_garbage(cache)
    else:  # no error from torch.load: only the cache's own checksums see it
        _flip_in_tensor_data(cache, xtr.tobytes())
    decodes = count_calls(monkeypatch, "_read_idx")
    with caplog.at_level("WARNING", logger="fedbench"):
        ds = load_dataset("fmnist", tmp_path, download=False)
    assert torch.equal(ds.x_train[:, 0], torch.from_numpy(xtr))
    assert len(decodes) == 4  # rebuilt from the four raw files
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and str(cache) in warned[0] and "rebuilding" in warned[0]
    # ...and the rebuilt cache is sound: the next load decodes nothing, warns nothing.
    caplog.clear()
    again = load_dataset("fmnist", tmp_path, download=False)
    assert torch.equal(again.x_train, ds.x_train) and len(decodes) == 4
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.quick
def test_cache_of_an_older_format_is_rebuilt(tmp_path):
    xtr, *_ = write_fmnist(tmp_path)
    cache = cache_file("fmnist", tmp_path)
    cache.parent.mkdir(parents=True, exist_ok=True)
    wrong = {k: torch.zeros(1, dtype=torch.uint8) for k in sources._SPLITS}
    torch.save({"format": 1, "tensors": wrong}, cache)
    ds = load_dataset("fmnist", tmp_path, download=False)
    assert torch.equal(ds.x_train[:, 0], torch.from_numpy(xtr))


def _fmnist_set(root: Path, seed: int):
    xtr, ytr, *_ = write_fmnist(root, gz=False, seed=seed)  # uncompressed: same size per seed
    return torch.from_numpy(xtr).unsqueeze(1), torch.from_numpy(ytr.astype(np.int64))


def _cifar10_set(root: Path, seed: int):
    batches, _ = write_cifar10(root, seed=seed)
    x = np.concatenate([b[b"data"] for b in batches]).reshape(-1, 3, 32, 32)
    return torch.from_numpy(x), torch.tensor([v for b in batches for v in b[b"labels"]])


def _pathmnist_set(root: Path, seed: int):
    a = write_pathmnist(root, seed=seed)
    x = torch.from_numpy(a["train_images"]).permute(0, 3, 1, 2)
    return x, torch.from_numpy(a["train_labels"].ravel().astype(np.int64))


def _tinyimagenet_set(root: Path, seed: int):
    # Set B differs from A in one image only, of the same name and byte size.
    if not (root / TINY).exists():
        write_tinyimagenet(root)
    colour = (250, 0, 0) if seed == 0 else (10, 20, 30)
    f = root / TINY / "train" / "n01000000" / "images" / "n01000000_0.JPEG"
    write_bmp_as_jpeg(f, colour)
    return torch.tensor(colour, dtype=torch.uint8).view(1, 3, 1, 1).expand(1, 3, 64, 64), None


SETS = {
    "fmnist": _fmnist_set,
    "cifar10": _cifar10_set,
    "pathmnist": _pathmnist_set,
    "tinyimagenet": _tinyimagenet_set,
}


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(SETS))
def test_replaced_raw_files_with_an_older_mtime_are_loaded(tmp_path, name):
    """tar, cp -p and rsync -a give replacement files their source's (older) mtime. Each set
    function writes set A (0) or B (1) and returns the first training images and labels."""
    x_a, _ = SETS[name](tmp_path, 0)
    age(tmp_path, 10_000)  # past the racy window: the cache will trust these stamps
    sizes = {p: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}
    first = load_dataset(name, tmp_path, download=False)
    assert torch.equal(first.x_train[: len(x_a)], x_a)
    x_b, y_b = SETS[name](tmp_path, 1)
    age(tmp_path, 20_000)  # B is older than A, and older than the cache
    if name in ("fmnist", "tinyimagenet"):  # only the content tells A and B apart
        assert {p: p.stat().st_size for p in sizes} == sizes
    second = load_dataset(name, tmp_path, download=False)
    assert not torch.equal(x_a, x_b)
    assert torch.equal(second.x_train[: len(x_b)], x_b)
    if y_b is not None:
        assert torch.equal(second.y_train[: len(y_b)], y_b)
    else:  # tinyimagenet: the other images are as before
        assert torch.equal(second.x_train[1:], first.x_train[1:])


@pytest.mark.quick
def test_unchanged_sources_are_neither_decoded_nor_rehashed(tmp_path, monkeypatch):
    xtr, *_ = write_fmnist(tmp_path)
    decodes = count_calls(monkeypatch, "_read_idx")
    hashes = count_calls(monkeypatch, "_digest")
    load_dataset("fmnist", tmp_path, download=False)
    assert (len(decodes), len(hashes)) == (4, 4)
    # Just written (within the racy window): the stamps are not trusted yet, the content is
    # checked instead, and found unchanged.
    load_dataset("fmnist", tmp_path, download=False)
    assert (len(decodes), len(hashes)) == (4, 8)
    # Only the mtimes change (touch): re-hashed once, not decoded; the new stamps are kept...
    age(tmp_path, 10_000)
    load_dataset("fmnist", tmp_path, download=False)
    assert (len(decodes), len(hashes)) == (4, 12)
    # ...so from now on a load reads no raw file at all.
    ds = load_dataset("fmnist", tmp_path, download=False)
    assert (len(decodes), len(hashes)) == (4, 12)
    assert torch.equal(ds.x_train[:, 0], torch.from_numpy(xtr))


@pytest.mark.quick
def test_moved_raw_files_with_the_same_content_keep_the_cache(tmp_path, monkeypatch):
    write_fmnist(tmp_path)
    first = load_dataset("fmnist", tmp_path, download=False)
    (tmp_path / "fashion-mnist").mkdir()
    for f in tmp_path.glob("*.gz"):
        f.rename(tmp_path / "fashion-mnist" / f.name)
    decodes = count_calls(monkeypatch, "_read_idx")
    second = load_dataset("fmnist", tmp_path, download=False)
    assert decodes == [] and torch.equal(first.x_train, second.x_train)


@pytest.mark.quick
def test_tinyimagenet_cache_follows_the_image_folders(tmp_path, monkeypatch):
    write_tinyimagenet(tmp_path)
    age(tmp_path, 10_000)
    decodes = count_calls(monkeypatch, "_read_rgb")
    hashes = count_calls(monkeypatch, "_digest")
    assert len(load_dataset("tinyimagenet", tmp_path, download=False).y_train) == 6
    assert len(decodes) == 9
    n_hashed = len(hashes)
    load_dataset("tinyimagenet", tmp_path, download=False)
    assert len(decodes) == 9 and len(hashes) == n_hashed  # 110k images would not be read
    # An image added (with an old mtime) changes its folder's listing: decoded again.
    extra = tmp_path / TINY / "train" / "n02000000" / "images" / "n02000000_9.JPEG"
    Image.new("RGB", (64, 64), (0, 250, 0)).save(extra, quality=95)
    age(tmp_path, 20_000)
    ds = load_dataset("tinyimagenet", tmp_path, download=False)
    assert ds.y_train.tolist() == [0, 0, 1, 1, 1, 2, 2] and len(decodes) == 9 + 10


@pytest.mark.quick
def test_federation_keeps_the_named_samples_and_reads_each_set_as_the_pool_would(tmp_path):
    """Only the pool's samples some set names are kept; every client's train / test / val
    set and the S / G sets read the same samples through the renumbered indices as through
    their pool positions, in the same order."""
    from fedbench.data.federation import Federation
    from fedbench.data.splits import Partition

    write_cifar10(tmp_path)
    ds = load_dataset("cifar10", tmp_path, download=False)
    n_tr = ds.x_train.shape[0]
    pool_x = torch.cat([ds.x_train, ds.x_test]).float() / 255
    pool_y = torch.cat([ds.y_train, ds.y_test]).long()
    # train from the train split, test from the test split (pool positions past n_tr), out of
    # order and with gaps; S / G sets reach into other clients' test samples
    train = [np.array([7, 2, 11]), np.array([3, 15])]
    test = [np.array([n_tr + 4, n_tr + 1]), np.array([n_tr + 6])]
    val = [np.array([0]), np.array([9])]
    s_idx, g_idx = (
        [np.array([n_tr + 6, n_tr + 4]), np.array([n_tr + 1])],
        [np.array([]), np.array([n_tr + 6])],
    )
    fed = Federation(ds, Partition(train, test, val=val), s_idx=s_idx, g_idx=g_idx, normalize=False)
    assert fed.x.shape[0] == len(fed.rows) == 10 and list(fed.rows) == sorted(fed.rows)
    for mine, pool in [(fed.train_idx, train), (fed.test_idx, test), (fed.val_idx, val),
                       (fed.s_idx, s_idx), (fed.g_idx, g_idx)]:  # fmt: skip
        for m, p in zip(mine, pool, strict=True):
            p = torch.as_tensor(p, dtype=torch.int64)
            assert torch.equal(fed.x[m], pool_x[p]) and torch.equal(fed.y[m], pool_y[p])
            assert torch.equal(torch.argsort(m), torch.argsort(p))  # the same order
