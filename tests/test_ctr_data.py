"""The click-log generator (app/tasks/ctr_data.py): every draw inside (0, 1), so every
example finite, wherever its index lies. The generator's other checks (hashes, Zipf
laws, teacher, ceiling) run through the task in test_recommender.py."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from app.tasks import ctr_data, dlrm

# The first examples of [0, 30M) (data seed 0) one of whose 13 dense draws has its
# low 24 bits all ones: `python experiments/recommender_bisect.py scan` lists them.
TOP_DRAWS = (4_576_485, 4_958_133, 5_296_078)


@pytest.mark.parametrize("width, dtype", [(24, tf.float32), (16, tf.float32), (53, tf.float64)])
def test_uniform_draws_stay_inside_the_open_unit_interval(width, dtype):
    bits = tf.constant([0, (1 << width) - 1, (1 << 64) - 1], tf.uint64)
    u = ctr_data._uniform(bits, width, dtype).numpy()
    assert np.all(u > 0) and np.all(u < 1), u
    assert u[0] == 0.5 / 2**width  # the bottom draw as the formula gives it


def test_examples_whose_dense_draw_is_the_top_one_are_finite():
    generator = ctr_data.Generator(ctr_data.table_rows(0.0002), 2.0)
    features, clicks, probability = generator.examples(tf.constant(TOP_DRAWS, tf.int64))
    # Before the fix each held one dense count of inf (erfinv(1)).
    assert np.all(np.isfinite(features["dense"])), features["dense"]
    assert np.all((probability > 0) & (probability < 1))
    assert set(np.unique(clicks)) <= {0.0, 1.0}


def test_a_training_step_on_a_batch_holding_such_an_example_keeps_the_weights_finite():
    generator = ctr_data.Generator(ctr_data.table_rows(0.0002), 2.0)
    features, clicks, _ = generator.examples(tf.range(TOP_DRAWS[0] - 63, TOP_DRAWS[0] + 1,
                                                      dtype=tf.int64))
    keras.utils.set_random_seed(0)
    model = dlrm.model(generator.rows, 8, (16,), (32,), ctr_data.NUM_DENSE)
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(features, clicks, batch_size=64, epochs=1, verbose=0)
    # With the infinite count, the bottom MLP's weights turned NaN in this one step.
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_ids_are_the_examples_ids_and_unknown_ids_count_as_their_mean():
    generator = ctr_data.Generator(ctr_data.table_rows(0.0002), 1.05)
    index = tf.range(100, 164, dtype=tf.int64)
    features, _, probability = generator.examples(index)
    np.testing.assert_array_equal(generator.ids(index), features["cat"])
    dense, ids = features["dense"], features["cat"]
    everything = tf.ones(ids.shape, tf.bool)
    np.testing.assert_allclose(tf.sigmoid(generator.logit(dense, ids, everything)), probability,
                               rtol=1e-6)
    # Knowing no id leaves the bias and the dense term: the same for any ids.
    nothing = tf.zeros(ids.shape, tf.bool)
    np.testing.assert_allclose(generator.logit(dense, ids, nothing),
                               generator.logit(dense, ids[::-1], nothing), rtol=1e-6)
