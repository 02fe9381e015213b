"""The Keras 3 zoo (tests/zoo_keras3.py) with plain Keras 3 on one process, no trainer.

Each case compiles as the project would (the task's loss, metrics, loss weights and
weighted metrics), fits a few steps, evaluates, exports a SavedModel that serves the
raw test features as the model predicts them, and saves a `.keras` file. The
mixed-dialect tasks are only checked to be what their names say.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
import zoo_keras3

KERAS3 = (keras.Model, keras.losses.Loss, keras.metrics.Metric)
TF_KERAS = (tf_keras.Model, tf_keras.losses.Loss, tf_keras.metrics.Metric)


def _objects(task) -> list:
    """The Keras objects a task returns: model, losses, metrics."""
    returned = [task.build_model(), task.loss(), task.metrics(), task.weighted_metrics()]
    return [o for o in tf.nest.flatten(returned) if o is not None]


# Cases whose export Keras 3.15 serves differently from predict (see their comments).
AUGMENTS_WHEN_SERVED = {"AugmentationModel"}
# MobileNet takes ~20 s of the file's ~50 s, most of it tracing the export.
SLOW = {"ApplicationModel"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in zoo_keras3.CASES])
def test_case_trains_evaluates_and_exports_with_keras3(name, tmp_path):
    task = zoo_keras3.CASES[name]()
    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy(task.overrides.get("train.precision", "float32"))
    try:
        assert all(isinstance(o, KERAS3) for o in _objects(task)), _objects(task)
        model = task.build_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=task.loss(),
                      metrics=task.metrics(), loss_weights=task.loss_weights(),
                      weighted_metrics=task.weighted_metrics())
        built = len(model.weights)  # all of them before the first step: a restore needs them
        train = task.train_dataset(tf.distribute.InputContext(), 16).take(4)
        history = model.fit(train, epochs=2, verbose=0)
        assert len(model.weights) == built, (built, [w.path for w in model.weights])
        result = model.evaluate(task.eval_dataset("test", 8), verbose=0, return_dict=True)
        assert np.isfinite(history.history["loss"]).all()
        assert task.metric in result, sorted(result)

        model.save(tmp_path / "m.keras")
        serving = task.serving_model(model)
        serving.export(str(tmp_path / "export"), verbose=False)
        raw = tf.nest.map_structure(lambda a: a[:8], task.arrays("test")[0])
        exported = tf.saved_model.load(str(tmp_path / "export"))  # kept: .serve needs it alive
        served = exported.serve(raw)
        if name in AUGMENTS_WHEN_SERVED:  # fails once Keras serves with training=False
            assert not np.allclose(served, exported.serve(raw)), "the export no longer augments"
            return
        expected = serving(raw, training=False)
        for a, b in zip(tf.nest.flatten(served), tf.nest.flatten(expected), strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       atol=1e-3)
    finally:
        keras.mixed_precision.set_dtype_policy(previous)


def test_mixed_dialect_tasks_mix_the_dialects():
    for case in zoo_keras3.MIXED_DIALECT.values():
        objects = _objects(case())
        assert all(isinstance(o, KERAS3 + TF_KERAS) for o in objects), objects
        assert any(isinstance(o, KERAS3) for o in objects), objects
        assert any(isinstance(o, TF_KERAS) for o in objects), objects
    assert isinstance(zoo_keras3.MixedDialectLoss().loss(), tf_keras.losses.Loss)
    assert isinstance(zoo_keras3.MixedDialectMetric().build_model(), tf_keras.Model)
