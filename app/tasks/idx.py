"""Reader for the IDX files MNIST ships in (http://yann.lecun.com/exdb/mnist/).

Header: two zero bytes, a type code (0x08 = unsigned byte), the number of
dimensions, then each dimension as a big-endian uint32; the data follows.
Errors name the file, since a user with a broken copy needs to know which one.
"""

from __future__ import annotations

import gzip
import pathlib
import struct
import zlib

import numpy as np

from app.config import ConfigError

_UBYTE = 0x08


class IdxError(ConfigError):
    """An IDX file that is missing, corrupt or inconsistent."""


def find(directory: pathlib.Path, stem: str) -> pathlib.Path:
    """`stem` or `stem.gz` in `directory`."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise IdxError(
        f"{directory / stem}[.gz]: no such file; set task.dir to a directory with the "
        "four MNIST IDX files, or leave it empty for the bundled copy")


def read(path: pathlib.Path, ndim: int) -> np.ndarray:
    """The array stored in the IDX file at `path`, which must have `ndim` dimensions."""
    raw = _read_bytes(path)
    shape, header = _layout(raw, path, ndim)
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def layout(path: pathlib.Path, ndim: int) -> tuple[tuple[int, ...], int]:
    """The shape stored in the IDX file at `path` and its header's length in bytes,
    after checking that the file holds exactly that (for readers that stream it)."""
    return _layout(_read_bytes(path), path, ndim)


def _layout(raw: bytes, path: pathlib.Path, ndim: int) -> tuple[tuple[int, ...], int]:
    if len(raw) < 4:
        raise IdxError(f"{path}: truncated: {len(raw)} bytes, too short for an IDX header")
    zero, dtype, dims = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != _UBYTE or dims != ndim:
        raise IdxError(
            f"{path}: bad magic number 0x{raw[:4].hex()}; expected 0x0000{_UBYTE:02x}{ndim:02x} "
            f"(an unsigned-byte IDX file with {ndim} dimension(s))")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxError(f"{path}: truncated: header needs {header} bytes, file has {len(raw)}")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        problem = "truncated" if len(raw) < expected else "has trailing bytes"
        raise IdxError(
            f"{path}: {problem}: header says shape {shape} ({expected} bytes with the header), "
            f"file has {len(raw)} bytes")
    return shape, header


def read_pair(directory: pathlib.Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of one MNIST split (`prefix` is "train" or "t10k")."""
    images_path, labels_path = paths(directory, prefix)
    images, labels = read(images_path, 3), read(labels_path, 1)
    _check_counts(images_path, len(images), labels_path, len(labels))
    return images, labels


def paths(directory: pathlib.Path, prefix: str) -> tuple[pathlib.Path, pathlib.Path]:
    """The images and labels files of one MNIST split."""
    return (find(directory, f"{prefix}-images-idx3-ubyte"),
            find(directory, f"{prefix}-labels-idx1-ubyte"))


def check_pair(images_path: pathlib.Path, labels_path: pathlib.Path
               ) -> tuple[int, tuple[int, ...], int, int]:
    """(examples, image shape, images header bytes, labels header bytes) of a checked
    pair of files."""
    (count, *image_shape), image_header = layout(images_path, 3)
    (labels,), label_header = layout(labels_path, 1)
    _check_counts(images_path, count, labels_path, labels)
    return count, tuple(image_shape), image_header, label_header


def _check_counts(images_path: pathlib.Path, images: int, labels_path: pathlib.Path,
                  labels: int) -> None:
    if images != labels:
        raise IdxError(
            f"{images_path} has {images} images but {labels_path} has "
            f"{labels} labels; the two files must come from the same split")


def _read_bytes(path: pathlib.Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise IdxError(f"{path}: cannot be read ({e}); replace the file") from None
