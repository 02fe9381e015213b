"""tf.train.Examples written a column at a time (app/example_proto.py) parse as the
messages protobuf builds."""

import numpy as np
import pytest
import tensorflow as tf

from app import example_proto


def columns(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(rows, 3)).astype(np.float32),
        "wide": rng.normal(size=(rows, 2, 2)),  # float64: written as float32
        # Every varint length, negative numbers (10 bytes) too.
        "id": np.stack([rng.integers(-2**63, 2**63 - 1, rows, dtype=np.int64),
                        np.array([0, 1, 127, 128, 2**14, 2**35, 2**62, -1][:rows] * (rows // 8 + 1))
                        [:rows]], axis=1),
        "flag": np.arange(rows) % 2 == 0,
        "png": np.array([b"\x89PNG" + bytes([i]) * i for i in range(rows)], dtype=object),
        "words": np.array([["a", "bc"]] * rows),
        "none": np.zeros((rows, 0), np.float32),
    }


def test_each_row_is_the_example_protobuf_would_build():
    values = columns(8)
    for row, serialized in enumerate(example_proto.serialize(values)):
        feature = tf.train.Example.FromString(serialized).features.feature
        assert sorted(feature) == sorted(values)
        np.testing.assert_array_equal(feature["x"].float_list.value, values["x"][row])
        np.testing.assert_array_equal(feature["wide"].float_list.value,
                                      values["wide"][row].ravel().astype(np.float32))
        assert list(feature["id"].int64_list.value) == values["id"][row].tolist()
        assert list(feature["flag"].int64_list.value) == [int(values["flag"][row])]
        assert list(feature["png"].bytes_list.value) == [values["png"][row]]
        assert list(feature["words"].bytes_list.value) == [b"a", b"bc"]
        assert list(feature["none"].float_list.value) == []
        expected = tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(float_list=tf.train.FloatList(value=values["x"][row])),
            "id": tf.train.Feature(int64_list=tf.train.Int64List(value=values["id"][row]))}))
        only = tf.train.Example.FromString(
            b"".join(example_proto.serialize({k: values[k][row:row + 1] for k in ("x", "id")})))
        assert only == expected


def test_a_batch_parses_with_parse_example():
    values = columns(16)
    parsed = tf.io.parse_example(list(example_proto.serialize(values)), {
        "x": tf.io.FixedLenFeature([3], tf.float32), "id": tf.io.FixedLenFeature([2], tf.int64),
        "png": tf.io.FixedLenFeature([], tf.string)})
    np.testing.assert_array_equal(parsed["x"].numpy(), values["x"])
    np.testing.assert_array_equal(parsed["id"].numpy(), values["id"])
    assert list(parsed["png"].numpy()) == list(values["png"])


def test_a_column_of_another_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="column 'when' holds complex128"):
        list(example_proto.serialize({"when": np.zeros(3, np.complex128)}))
