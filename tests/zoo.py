"""A zoo of small tasks, one Keras feature each, written as the README shows a task.

`tests/compat.py` trains each under every way of training and checks it against
Keras' own `evaluate` on one process; `docs/compatibility.md` is their matrix.
Each task's docstring is its row's name there. The data are tiny and learnable,
the same in every process (seeded), 64 training and 40 test examples.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras as keras

from app import data
from app.task import Task

TRAIN, TEST = 64, 40
WORDS = np.array(["red", "green", "blue", "cyan", "amber", "black", "white", "olive"])


def _rng(split: str) -> np.random.Generator:
    return np.random.default_rng(0 if split == "train" else 1)


class Zoo(Task):
    """Binary classification of `arrays(split)`; subclasses give the features and model."""

    metric, higher_is_better = "accuracy", True
    # Config overrides the case needs (e.g. its precision); the compat runner applies them.
    overrides: dict[str, str] = {}

    def arrays(self, split: str) -> tuple:
        """(features, labels) or (features, labels, sample weights) of `split`."""
        raise NotImplementedError

    def train_dataset(self, context, global_batch_size):
        examples = self.shard(data.from_arrays(*self.arrays("train")), context)
        return data.batches(examples, context.get_per_replica_batch_size(global_batch_size),
                            seed=self.pipeline_seed(context), shuffle_buffer=TRAIN)

    def eval_dataset(self, split, batch_size):
        return data.from_arrays(*self.arrays("test")).batch(batch_size) if split == "test" else None

    def train_examples(self):
        return TRAIN

    def eval_examples(self, split):
        return TEST

    def loss(self):
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def _numbers(split: str, width: int = 4) -> tuple[np.ndarray, np.ndarray]:
    n = TRAIN if split == "train" else TEST
    x = _rng(split).normal(size=(n, width)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)


def _words(split: str) -> tuple[np.ndarray, np.ndarray]:
    n = TRAIN if split == "train" else TEST
    ids = _rng(split).integers(0, len(WORDS), n)
    return WORDS[ids].reshape(n, 1).astype(object), (ids % 2).astype(np.int64)


def _classifier(inputs, hidden) -> keras.Model:
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


# -- What the Keras guides teach, shared by both zoos (each passes its own `keras`) ---------------

def scale_layer(keras):
    """A custom layer class with a `get_config`, registered as Keras serializable with
    `keras`: a weight per feature, multiplying its input."""

    @keras.saving.register_keras_serializable(package="zoo")
    class Scale(keras.layers.Layer):
        def __init__(self, initial: float = 1.0, **kwargs):
            super().__init__(**kwargs)
            self.initial = initial

        def build(self, input_shape):
            self.scale = self.add_weight(name="scale", shape=(input_shape[-1],),
                                         initializer=keras.initializers.Constant(self.initial))

        def call(self, inputs):
            return inputs * self.scale

        def get_config(self):
            return {**super().get_config(), "initial": self.initial}

    return Scale


def lazy_sequential(keras, scale) -> object:
    """A `keras.Sequential` without an `Input` (built at its first call): the custom
    layer `scale` twice, named by Keras (its class name, then with `_1`), and layers
    named by the task, one with a leading underscore."""
    return keras.Sequential([scale(0.5), keras.layers.Dense(8, "relu", name="_hidden"),
                             scale(), keras.layers.Dense(2, name="scores")], name="stack")


class ClassWeightedLoss:
    """A model's `compute_loss` overridden, as each Keras' `Model.compute_loss` says a
    subclass may: its examples of class 1 weigh twice. It calls the compiled loss, which
    scales itself for the replicas (a loss computed from scratch there would not)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        weights = tf.where(tf.equal(y, 1), 2.0, 1.0)
        if sample_weight is not None:
            weights *= sample_weight
        return super().compute_loss(x, y, y_pred, weights, **kwargs)


def functional(keras, model_class) -> object:
    """A small functional model of `model_class` (a subclass of `keras.Model`)."""
    x = keras.Input((4,))
    return model_class(x, keras.layers.Dense(2)(keras.layers.Dense(8, "relu")(x)))


class StringLookupModel(Zoo):
    """`StringLookup` inside the model"""

    def arrays(self, split):
        return _words(split)

    def build_model(self):
        words = keras.Input((1,), dtype=tf.string)
        ids = keras.layers.StringLookup(vocabulary=list(WORDS))(words)
        return _classifier(words, keras.layers.Flatten()(keras.layers.Embedding(9, 4)(ids)))


class IntegerLookupModel(Zoo):
    """`IntegerLookup` inside the model"""

    def arrays(self, split):
        n = TRAIN if split == "train" else TEST
        ids = _rng(split).integers(0, 8, n)
        return (ids * 100 + 7).reshape(n, 1), (ids % 2).astype(np.int64)

    def build_model(self):
        codes = keras.Input((1,), dtype=tf.int64)
        ids = keras.layers.IntegerLookup(vocabulary=[i * 100 + 7 for i in range(8)])(codes)
        return _classifier(codes, keras.layers.Flatten()(keras.layers.Embedding(9, 4)(ids)))


class TextVectorizationModel(Zoo):
    """adapted `TextVectorization` inside the model"""

    def arrays(self, split):
        words, labels = _words(split)
        other = np.roll(words.ravel(), 3)
        return np.array([f"{a} and {b}" for a, b in zip(words.ravel(), other, strict=True)],
                        dtype=object), labels

    def build_model(self):
        text = keras.Input((), dtype=tf.string)
        vectorize = keras.layers.TextVectorization(max_tokens=12, output_sequence_length=3)
        vectorize.adapt(self.arrays("train")[0])  # the same vocabulary in every process
        vectors = keras.layers.Embedding(12, 4)(vectorize(text))
        return _classifier(text, keras.layers.Flatten()(vectors))


class HashingModel(Zoo):
    """`Hashing` inside the model"""

    def arrays(self, split):
        return _words(split)

    def build_model(self):
        words = keras.Input((1,), dtype=tf.string)
        bins = keras.layers.Hashing(num_bins=32)(words)
        return _classifier(words, keras.layers.Flatten()(keras.layers.Embedding(32, 4)(bins)))


class NormalizationModel(Zoo):
    """adapted `Normalization` inside the model"""

    def arrays(self, split):
        x, y = _numbers(split)
        return x * 50 + 300, y

    def build_model(self):
        x = keras.Input((4,))
        norm = keras.layers.Normalization()
        norm.adapt(self.arrays("train")[0])
        return _classifier(x, keras.layers.Dense(8, activation="relu")(norm(x)))


class LookupInDatasetFn(Zoo):
    """`StringLookup` inside the `dataset_fn`, and in the export"""

    def arrays(self, split):
        return _words(split)

    @staticmethod
    def lookup():
        return keras.layers.StringLookup(vocabulary=list(WORDS))

    def train_dataset(self, context, global_batch_size):
        lookup = self.lookup()  # built where the dataset_fn runs, as TF's PS tutorial does
        return super().train_dataset(context, global_batch_size).map(
            lambda words, labels: (lookup(words), labels))

    def eval_dataset(self, split, batch_size):
        lookup = self.lookup()
        dataset = super().eval_dataset(split, batch_size)
        return dataset.map(lambda words, labels: (lookup(words), labels)) if dataset else None

    def build_model(self):
        ids = keras.Input((1,), dtype=tf.int64)
        return _classifier(ids, keras.layers.Flatten()(keras.layers.Embedding(9, 4)(ids)))

    def serving_model(self, model):
        words = keras.Input((1,), dtype=tf.string)
        return keras.Model(words, model(self.lookup()(words)))


class BatchNormModel(Zoo):
    """`BatchNormalization`"""

    synchronized = False

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = keras.Input((4,))
        hidden = keras.layers.Dense(8)(x)
        hidden = keras.layers.BatchNormalization(synchronized=self.synchronized)(hidden)
        return _classifier(x, keras.layers.ReLU()(hidden))


class SyncBatchNormModel(BatchNormModel):
    """`BatchNormalization(synchronized=True)`"""

    synchronized = True


class DropoutModel(Zoo):
    """`Dropout`"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = keras.Input((4,))
        return _classifier(x, keras.layers.Dropout(0.3)(keras.layers.Dense(16, "relu")(x)))


class RecurrentModel(Zoo):
    """`LSTM` and `GRU`"""

    def arrays(self, split):
        x, y = _numbers(split, width=12)
        return x.reshape(-1, 4, 3), y

    def build_model(self):
        x = keras.Input((4, 3))
        hidden = keras.layers.LSTM(8, return_sequences=True)(x)
        return _classifier(x, keras.layers.GRU(8)(hidden))


class ConvModel(Zoo):
    """`Conv2D` and pooling"""

    def arrays(self, split):
        x, y = _numbers(split, width=64)
        return x.reshape(-1, 8, 8, 1), y

    def build_model(self):
        x = keras.Input((8, 8, 1))
        hidden = keras.layers.Conv2D(4, 3, activation="relu")(x)
        return _classifier(x, keras.layers.GlobalAveragePooling2D()(hidden))


class ApplicationModel(Zoo):
    """`tf_keras.applications.MobileNet(weights=None)`"""

    def arrays(self, split):
        x, y = _numbers(split, width=32 * 32 * 3)
        return x.reshape(-1, 32, 32, 3), y

    def build_model(self):
        return keras.applications.MobileNet(input_shape=(32, 32, 3), alpha=0.25, weights=None,
                                            classes=2, classifier_activation=None)


class MultiOutputModel(Zoo):
    """dict inputs, two outputs with their own loss, loss weight and metrics; sample weights"""

    metric = "label_accuracy"

    def arrays(self, split):
        x, y = _numbers(split)
        weights = _rng(split).uniform(0.2, 2.0, len(y)).astype(np.float32)
        features = {"numbers": x[:, :3], "extra": x[:, 3:]}
        targets = {"label": y, "score": (x[:, :1] * 2 + x[:, 1:2]).astype(np.float32)}
        return features, targets, {"label": weights, "score": weights}

    def build_model(self):
        numbers, extra = keras.Input((3,), name="numbers"), keras.Input((1,), name="extra")
        hidden = keras.layers.Dense(8, "relu")(keras.layers.Concatenate()([numbers, extra]))
        return keras.Model({"numbers": numbers, "extra": extra},
                           {"label": keras.layers.Dense(2, name="label")(hidden),
                            "score": keras.layers.Dense(1, name="score")(hidden)})

    def loss(self):
        return {"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                "score": keras.losses.MeanSquaredError()}

    def loss_weights(self):
        return {"label": 1.0, "score": 0.25}

    def metrics(self):
        return {"label": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]}

    def weighted_metrics(self):
        return {"score": [keras.metrics.MeanAbsoluteError(name="mae")]}


class ActivityLoss(keras.layers.Layer):
    """A layer that adds a loss of its input (`add_loss`), as activity regularizers do."""

    def call(self, inputs):
        self.add_loss(0.05 * tf.reduce_mean(tf.square(inputs)))
        return inputs


class AddLossModel(Zoo):
    """`add_loss` and kernel regularizers (headline: the loss)"""

    metric, higher_is_better = "loss", False

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = keras.Input((4,))
        hidden = keras.layers.Dense(8, "relu", kernel_regularizer=keras.regularizers.L2(0.02))(x)
        return _classifier(x, ActivityLoss()(hidden))


class OwnSteps(keras.Model):
    """A subclassed model with its own train_step and test_step, and its own trackers."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(8, "relu"), keras.layers.Dense(2)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.hits = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

    def call(self, inputs, training=False):
        return self.out(self.hidden(inputs))

    @property
    def metrics(self):
        return [self.loss_tracker, self.hits]

    def _loss(self, data, training):
        x, y = data
        logits = self(x, training=training)
        loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        return tf.reduce_mean(loss), y, logits

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss, y, logits = self._loss(data, training=True)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return self._track(loss, y, logits)

    def test_step(self, data):
        return self._track(*self._loss(data, training=False))

    def _track(self, loss, y, logits):
        self.loss_tracker.update_state(loss)
        self.hits.update_state(y, logits)
        return {m.name: m.result() for m in self.metrics}


class OwnStepsModel(Zoo):
    """subclassed `keras.Model` with its own `train_step` and `test_step`"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        model = OwnSteps()
        model.build((None, 4))
        return model


class MixedPrecisionModel(Zoo):
    """the `mixed_float16` policy"""

    overrides = {"train.precision": "mixed_float16"}

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = keras.Input((4,))
        hidden = keras.layers.Dense(16, "relu")(x)
        return keras.Model(x, keras.layers.Dense(2, dtype="float32")(hidden))


class GuideSteps(keras.Model):
    """tf_keras' "Customizing what happens in fit()" guide as it writes the steps: the
    compiled loss (`self.compiled_loss`), `optimizer.apply_gradients` and the compiled
    metrics, in `train_step` and in `test_step`. Its layers are named by the task, and
    it has no `build`: built at its first call."""

    def __init__(self):
        super().__init__(name="guide")
        self.hidden = keras.layers.Dense(8, "relu", name="hidden")
        self.out = keras.layers.Dense(2, name="scores")

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compiled_loss(y, y_pred, regularization_losses=self.losses)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        self.compiled_metrics.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.compiled_loss(y, y_pred, regularization_losses=self.losses)
        self.compiled_metrics.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GuideStepModel(Zoo):
    """subclassed, built at its first call; `train_step`, `test_step` as tf_keras' guide has them"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        return GuideSteps()


Scale = scale_layer(keras)


class SequentialModel(Zoo):
    """`Sequential` built at its first call; a registered layer with `get_config`; names with `_`"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        return lazy_sequential(keras, Scale)


class WeightedLoss(ClassWeightedLoss, keras.Model):
    """A functional model whose class overrides `compute_loss`."""


class LossOverrideModel(Zoo):
    """functional model whose class overrides `compute_loss` (headline: the loss)"""

    metric, higher_is_better = "loss", False

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        return functional(keras, WeightedLoss)


CITIES = np.array(["oslo", "lima", "pune", "kobe", "nice", "bern"])


def _structured(split: str) -> tuple[dict, np.ndarray]:
    """A table of mixed columns, as TensorFlow's "classify structured data with
    preprocessing layers" tutorial has: a number, an integer code, a string, a count."""
    n = TRAIN if split == "train" else TEST
    rng = _rng(split)
    age = rng.normal(40, 12, (n, 1)).astype(np.float32)
    code = rng.choice([3, 5, 11, 42], (n, 1))
    city = rng.integers(0, len(CITIES), (n, 1))
    rooms = rng.integers(0, 5, (n, 1))
    votes = (age[:, 0] > 40).astype(int) + np.isin(code[:, 0], [5, 42]) + city[:, 0] % 2
    features = {"age": age, "code": code, "city": CITIES[city].astype(object), "rooms": rooms}
    return features, (votes >= 2).astype(np.int64)


class StructuredDataModel(Zoo):
    """dicts: adapted `Discretization`, one-hot `IntegerLookup`, `CategoryEncoding`, `Hashing`"""

    def arrays(self, split):
        return _structured(split)

    def build_model(self):
        train = self.arrays("train")[0]
        inputs = {"age": keras.Input((1,), name="age"),
                  "code": keras.Input((1,), name="code", dtype="int64"),
                  "city": keras.Input((1,), name="city", dtype="string"),
                  "rooms": keras.Input((1,), name="rooms", dtype="int64")}
        buckets = keras.layers.Discretization(num_bins=4)
        buckets.adapt(train["age"])  # quantiles of the training ages
        codes = keras.layers.IntegerLookup(output_mode="one_hot")
        codes.adapt(train["code"])
        encoded = [keras.layers.CategoryEncoding(4, output_mode="one_hot")(buckets(inputs["age"])),
                   codes(inputs["code"]),
                   keras.layers.Hashing(num_bins=16, output_mode="one_hot")(inputs["city"]),
                   keras.layers.CategoryEncoding(5, output_mode="one_hot")(inputs["rooms"])]
        hidden = keras.layers.Dense(8, "relu")(keras.layers.Concatenate()(encoded))
        return _classifier(inputs, hidden)


CASES: dict[str, type[Zoo]] = {cls.__name__: cls for cls in (
    StringLookupModel, IntegerLookupModel, TextVectorizationModel, HashingModel,
    NormalizationModel, LookupInDatasetFn, BatchNormModel, SyncBatchNormModel, DropoutModel,
    RecurrentModel, ConvModel, ApplicationModel, MultiOutputModel, AddLossModel,
    OwnStepsModel, MixedPrecisionModel, StructuredDataModel, GuideStepModel, SequentialModel,
    LossOverrideModel)}
