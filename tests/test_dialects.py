"""The Keras of a task (app/dialects): found from its objects, both trained the same way."""


import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from app import config as cfg
from app import dialects, trainer
from app.dialects import keras2, keras3
from tests.conftest import one_device_reduction_mirrored, tiny_task


def config(*overrides: str) -> cfg.Config:
    # The MLP: the CNN's 12 MiB kernel makes each run several times slower here.
    return cfg.load(None, ["task.keras=keras", "task.model=mlp", "train.epochs=1",
                           "train.global_batch_size=16", "train.verbose=0", "eval.batch_size=32",
                           *overrides])


class _Losses:
    """A task's objects: its loss and metrics, from either Keras."""

    def __init__(self, loss, metrics=(), weighted=None):
        self._loss, self._metrics, self._weighted = loss, metrics, weighted

    def loss(self):
        return self._loss

    def metrics(self):
        return self._metrics

    def weighted_metrics(self):
        return self._weighted


def _model(kerases):
    return kerases.Sequential([kerases.Input((2,)), kerases.layers.Dense(1)])


@pytest.mark.parametrize("kerases, dialect", [(keras, keras3), (tf_keras, keras2)])
def test_a_models_keras_is_its_dialect(kerases, dialect):
    assert dialects.of(_model(kerases), _Losses("mse", ["mae"])) is dialect
    assert dialects.of(_model(tf.keras), _Losses("mse")) is keras3  # tf.keras is Keras 3


@pytest.mark.parametrize("model, objects, what", [
    (keras, _Losses(tf_keras.losses.MeanSquaredError()), "loss (MeanSquaredError)"),
    (keras, _Losses("mse", {"out": [tf_keras.metrics.AUC()]}), "metric (AUC)"),
    (tf_keras, _Losses("mse", weighted=[keras.metrics.MeanAbsoluteError()]),
     "weighted metric (MeanAbsoluteError)"),
])
def test_a_task_that_mixes_two_kerases_is_refused_naming_the_object(model, objects, what):
    with pytest.raises(cfg.ConfigError) as e:
        dialects.of(_model(model), objects)
    ours, theirs = (keras3, keras2) if model is keras else (keras2, keras3)
    assert str(e.value) == (
        f"task _Losses mixes two Kerases: its model is {ours.LABEL} and its {what} is "
        f"{theirs.LABEL}; build every object of a task with one of them ({ours.IMPORT} here)")


def test_a_model_of_neither_keras_is_refused():
    with pytest.raises(cfg.ConfigError) as e:
        dialects.of(tf.Module(), _Losses("mse"))
    assert str(e.value).startswith("task _Losses: build_model returned a ")
    assert str(e.value).endswith("not a Keras model; return a keras.Model (Keras 3 (keras, "
                                 "tf.keras)) or a tf_keras.Model (Keras 2 (tf_keras))")


def test_gradient_compression_is_refused_for_keras3():
    with pytest.raises(cfg.ConfigError) as e:
        keras3.optimizer("adam", 0.1, config("sync.compression=fp16").sync, cfg.PSConfig())
    assert str(e.value) == ("sync.compression = fp16 compresses the gradients of Keras 2 "
                            "(tf_keras) models; this task's model is Keras 3. Set it to none")


@pytest.fixture(scope="module")
def keras3_runs(tmp_path_factory):
    """The Keras 3 MNIST task trained on one process and under MirroredStrategy."""
    runs = {}
    for name, strategy in (("one", tf.distribute.get_strategy()),
                           ("mirrored", one_device_reduction_mirrored())):
        workdir = tmp_path_factory.mktemp(name)
        runs[name] = (trainer.run(config(), workdir, strategy=strategy,
                                  task=tiny_task(config())), workdir)
    return runs


@pytest.mark.parametrize("name, replicas", [("one", 1), ("mirrored", 2)])
def test_a_keras3_task_trains_evaluates_exactly_and_exports(keras3_runs, tiny_datasets, name,
                                                           replicas):
    metrics, workdir = keras3_runs[name]
    assert (metrics["keras"], metrics["num_replicas"]) == ("keras", replicas)
    assert metrics["steps"] == 512 // 16
    images, labels = tiny_datasets[2]
    exported = tf.saved_model.load(str(workdir / "export"))
    served = exported.serve(tf.constant(images)).numpy()
    assert metrics["test_accuracy"] == pytest.approx(
        float(np.mean(np.argmax(served, -1) == labels)), abs=1e-6)
    native = keras.models.load_model(workdir / "model.keras")
    np.testing.assert_allclose(native.predict(images, verbose=0), served, atol=1e-5)
    assert (workdir / "checkpoints").is_dir() and (workdir / "tensorboard").is_dir()
    assert not (workdir / "backup").exists()  # emptied when training ends


def test_a_tasks_own_optimizer_of_the_other_keras_is_refused():
    with pytest.raises(cfg.ConfigError) as e:
        dialects.check_optimizer(tf_keras.optimizers.Adam(), keras3, _Losses("mse"))
    assert str(e.value) == (
        f"task _Losses mixes two Kerases: its model is {keras3.LABEL} and its optimizer (Adam) "
        f"is {keras2.LABEL}; build every object of a task with one of them (import keras here)")


@pytest.mark.parametrize("mirrored", [False, True], ids=["one_device", "mirrored"])
def test_the_fused_adam_steps_as_keras_own_adam_does(mirrored):
    # A dense kernel takes the fused kernel; the embedding's sparse gradient Keras' update.
    strategy = one_device_reduction_mirrored() if mirrored else tf.distribute.get_strategy()
    rng = np.random.default_rng(0)
    ids, y = rng.integers(0, 50, (64, 3)), rng.normal(size=(64, 1)).astype("float32")
    trained = []
    for make in (lambda: keras.optimizers.Adam(0.05),
                 lambda: keras3.optimizer("adam", 0.05, cfg.SyncConfig(), cfg.PSConfig())):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            adam = make()
            model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                      keras.layers.Embedding(50, 4), keras.layers.Flatten(),
                                      keras.layers.Dense(8, "relu"), keras.layers.Dense(1)])
            model.compile(optimizer=adam, loss="mse")
        model.fit(ids, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        trained.append([v.numpy() for v in [*model.weights, *adam.variables]])
    assert len(trained[0]) == len(trained[1])
    for keras_own, fused in zip(*trained, strict=True):  # float32 rounding apart
        np.testing.assert_allclose(fused, keras_own, rtol=1e-4, atol=1e-5)
    fused = keras3.optimizer("adam", 0.05, cfg.SyncConfig(), cfg.PSConfig())
    assert "update_step" in vars(fused)  # the fused one


def test_a_keras3_export_does_not_depend_on_the_names_keras_gives_layers(tmp_path):
    # A layer class `_Scaled` is named `__scaled`, and so are its variables: TensorFlow
    # refuses that as a root name scope when it copies them into the SavedModel's graph.
    class _Scaled(keras.layers.Layer):
        def build(self, input_shape):
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

        def call(self, x):
            return x * self.scale

    x = keras.Input((3,))
    model = keras.Model(x, keras.layers.Dense(2)(_Scaled()(x)))
    assert model.layers[1].scale.value.name.startswith("__scaled/")
    keras3.export(model, tmp_path)
    features = np.arange(6, dtype="float32").reshape(2, 3)
    exported = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(exported.serve(features), model(features), atol=1e-6)
    assert model.layers[1].scale.value.name.startswith("__scaled/")  # the model's, unchanged
    assert (tmp_path / keras3.KERAS_FILE).exists()


def test_a_keras2_export_takes_layers_the_task_named_with_a_leading_underscore(tmp_path):
    # tf_keras' SavedModel traces each layer's call outside its model's name scope, where
    # a layer named `_hidden` would enter `_hidden/` as a root scope, which TensorFlow
    # refuses. (Built from an `Input`, tf_keras refuses the name already; built at its
    # first call, the model trains.)
    model = tf_keras.Sequential([tf_keras.layers.Dense(4, name="_hidden"),
                                 tf_keras.layers.Dense(2)])
    features = np.arange(6, dtype="float32").reshape(2, 3)
    model(features)
    keras2.export(model, tmp_path)
    exported = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(exported(features), model(features), atol=1e-6)
    assert model.layers[0].name == "_hidden"  # the model's, unchanged


@pytest.mark.parametrize("dialect", dialects.DIALECTS, ids=lambda d: d.NAME)
def test_each_dialect_exports_exactly_the_interface(dialect):
    assert set(dialect.__all__) == set(dialects.INTERFACE)
    assert len(dialect.__all__) == len(set(dialect.__all__))
    assert all(hasattr(dialect, name) for name in dialects.INTERFACE)


def test_a_built_in_tasks_keras_name_is_its_dialect():
    assert [dialects.named(d.NAME) for d in dialects.DIALECTS] == list(dialects.DIALECTS)
    assert dialects.module("keras") is keras and dialects.module("tf_keras") is tf_keras
