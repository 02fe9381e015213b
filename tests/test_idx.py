import gzip
import struct

import numpy as np
import pytest

from app.tasks import idx
from app.tasks.mnist import BUNDLED


def write_idx(path, array, magic=None):
    header = magic if magic is not None else struct.pack(">HBB", 0, 0x08, array.ndim)
    raw = header + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)
    return path


def write_split(directory, prefix, n_images, n_labels, gz=True):
    ext = ".gz" if gz else ""
    images = np.arange(n_images * 4 * 4).reshape(n_images, 4, 4) % 256
    write_idx(directory / f"{prefix}-images-idx3-ubyte{ext}", images)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte{ext}", np.arange(n_labels) % 10)
    return images


@pytest.mark.parametrize("gz", [True, False])
def test_reads_what_was_written(tmp_path, gz):
    images = write_split(tmp_path, "train", 3, 3, gz=gz)
    got_images, got_labels = idx.read_pair(tmp_path, "train")
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, [0, 1, 2])


def test_bad_magic_number(tmp_path):
    path = write_idx(tmp_path / "x", np.zeros((2, 2, 2)), magic=b"\x00\x00\x0d\x03")
    with pytest.raises(idx.IdxError) as e:
        idx.read(path, 3)
    assert str(e.value) == (f"{path}: bad magic number 0x00000d03; expected 0x00000803 "
                            "(an unsigned-byte IDX file with 3 dimension(s))")


def test_wrong_number_of_dimensions_is_a_bad_magic_number(tmp_path):
    path = write_idx(tmp_path / "labels", np.zeros(5))
    with pytest.raises(idx.IdxError, match="bad magic number 0x00000801; expected 0x00000803"):
        idx.read(path, 3)


def test_truncated_data(tmp_path):
    path = write_idx(tmp_path / "x", np.zeros((10, 4, 4)))
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(idx.IdxError) as e:
        idx.read(path, 3)
    assert str(e.value) == (f"{path}: truncated: header says shape (10, 4, 4) (176 bytes with "
                            "the header), file has 169 bytes")


def test_truncated_header_and_tiny_file(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(b"\x00\x00\x08\x03\x00\x00")
    with pytest.raises(idx.IdxError, match="truncated: header needs 16 bytes, file has 6"):
        idx.read(path, 3)
    path.write_bytes(b"\x00")
    with pytest.raises(idx.IdxError, match="truncated: 1 bytes, too short for an IDX header"):
        idx.read(path, 3)


def test_trailing_bytes(tmp_path):
    path = write_idx(tmp_path / "x", np.zeros(4))
    path.write_bytes(path.read_bytes() + b"junk")
    with pytest.raises(idx.IdxError, match="has trailing bytes"):
        idx.read(path, 1)


def test_corrupt_gzip_names_the_file(tmp_path):
    path = write_idx(tmp_path / "x.gz", np.zeros((100, 4, 4)))
    path.write_bytes(path.read_bytes()[:30])
    with pytest.raises(idx.IdxError, match=f"{path}: cannot be read .*; replace the file"):
        idx.read(path, 3)


def test_count_mismatch_names_both_files(tmp_path):
    write_split(tmp_path, "t10k", 5, 4)
    with pytest.raises(idx.IdxError) as e:
        idx.read_pair(tmp_path, "t10k")
    assert str(e.value) == (
        f"{tmp_path}/t10k-images-idx3-ubyte.gz has 5 images but "
        f"{tmp_path}/t10k-labels-idx1-ubyte.gz has 4 labels; the two files must come from "
        "the same split")


def test_missing_file(tmp_path):
    with pytest.raises(idx.IdxError) as e:
        idx.read_pair(tmp_path, "train")
    assert str(e.value) == (f"{tmp_path}/train-images-idx3-ubyte[.gz]: no such file; set "
                            "task.dir to a directory with the four MNIST IDX files, or leave "
                            "it empty for the bundled copy")


def test_bundled_mnist_is_the_real_one():
    images, labels = idx.read_pair(BUNDLED, "t10k")
    assert images.shape == (10000, 28, 28)
    assert np.bincount(labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    train_images, _ = idx.read_pair(BUNDLED, "train")
    assert train_images.shape == (60000, 28, 28)
