"""The zoo of tests/zoo.py written with Keras 3 (`import keras`), as the README shows a task.

Each case is one Keras 3 feature, on the same tiny seeded data as tests/zoo.py (64
training and 40 test examples) and under the same name where the feature exists in
both; its docstring is its row's name in the compatibility matrix. After those come
preprocessing layers tests/zoo.py does not cover, and last, apart, tasks that mix the
two dialects (`MIXED_DIALECT`), which the project must refuse.

No task here uses tf_keras except the mixed-dialect ones: the project tells a task's
dialect from the objects it returns (model, loss, metrics, optimizer).

Every case compiles, fits, evaluates, exports (`model.export`) and saves a `.keras` file
with Keras 3.15 on one process (tests/test_zoo_keras3.py). Seen outside the project
with Keras 3.15: under MirroredStrategy with two replicas, `fit` and `evaluate` of every
model taking strings (all but LookupInDatasetFn of the string cases) fail before the
first step, as Keras builds the model from the MEAN of the replicas' first batches
(`_maybe_symbolic_build`: "Value for attr 'T' of string is not in the list of allowed
values", op AddN); and see AugmentationModel's and OwnSteps' comments.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
import tf_keras  # only the MIXED_DIALECT tasks at the end, which must be refused
import zoo
from zoo import TEST, TRAIN, WORDS, Zoo, _numbers, _rng, _structured, _words


class Zoo3(Zoo):
    """A zoo task whose loss and metrics are Keras 3 objects.

    The data, pipelines and example counts are tests/zoo.py's `Zoo`'s, which use
    no Keras; only what a task returns to `compile` is redefined.
    """

    def loss(self):
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def _classifier(inputs, hidden) -> keras.Model:
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


class StringLookupModel(Zoo3):
    """`StringLookup` inside the model"""

    def arrays(self, split):
        return _words(split)

    def build_model(self):
        words = keras.Input((1,), dtype="string")
        ids = keras.layers.StringLookup(vocabulary=list(WORDS))(words)
        return _classifier(words, keras.layers.Flatten()(keras.layers.Embedding(9, 4)(ids)))


class IntegerLookupModel(Zoo3):
    """`IntegerLookup` inside the model"""

    def arrays(self, split):
        n = TRAIN if split == "train" else TEST
        ids = _rng(split).integers(0, 8, n)
        return (ids * 100 + 7).reshape(n, 1), (ids % 2).astype(np.int64)

    def build_model(self):
        codes = keras.Input((1,), dtype="int64")
        ids = keras.layers.IntegerLookup(vocabulary=[i * 100 + 7 for i in range(8)])(codes)
        return _classifier(codes, keras.layers.Flatten()(keras.layers.Embedding(9, 4)(ids)))


class TextVectorizationModel(Zoo3):
    """adapted `TextVectorization` inside the model"""

    def arrays(self, split):
        words, labels = _words(split)
        other = np.roll(words.ravel(), 3)
        return np.array([f"{a} and {b}" for a, b in zip(words.ravel(), other, strict=True)],
                        dtype=object), labels

    def build_model(self):
        text = keras.Input((), dtype="string")
        vectorize = keras.layers.TextVectorization(max_tokens=12, output_sequence_length=3)
        vectorize.adapt(self.arrays("train")[0])  # the same vocabulary in every process
        vectors = keras.layers.Embedding(12, 4)(vectorize(text))
        return _classifier(text, keras.layers.Flatten()(vectors))


class HashingModel(Zoo3):
    """`Hashing` inside the model"""

    def arrays(self, split):
        return _words(split)

    def build_model(self):
        words = keras.Input((1,), dtype="string")
        bins = keras.layers.Hashing(num_bins=32)(words)
        return _classifier(words, keras.layers.Flatten()(keras.layers.Embedding(32, 4)(bins)))


class NormalizationModel(Zoo3):
    """adapted `Normalization` inside the model"""

    def arrays(self, split):
        x, y = _numbers(split)
        return x * 50 + 300, y

    def build_model(self):
        x = keras.Input((4,))
        norm = keras.layers.Normalization()
        norm.adapt(self.arrays("train")[0])
        return _classifier(x, keras.layers.Dense(8, activation="relu")(norm(x)))


class LookupInDatasetFn(Zoo3):
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
        ids = keras.Input((1,), dtype="int64")
        return _classifier(ids, keras.layers.Flatten()(keras.layers.Embedding(9, 4)(ids)))

    def serving_model(self, model):
        words = keras.Input((1,), dtype="string")
        return keras.Model(words, model(self.lookup()(words)))


class BatchNormModel(Zoo3):
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


class DropoutModel(Zoo3):
    """`Dropout`"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = keras.Input((4,))
        return _classifier(x, keras.layers.Dropout(0.3)(keras.layers.Dense(16, "relu")(x)))


class RecurrentModel(Zoo3):
    """`LSTM` and `GRU`"""

    def arrays(self, split):
        x, y = _numbers(split, width=12)
        return x.reshape(-1, 4, 3), y

    def build_model(self):
        x = keras.Input((4, 3))
        hidden = keras.layers.LSTM(8, return_sequences=True)(x)
        return _classifier(x, keras.layers.GRU(8)(hidden))


class ConvModel(Zoo3):
    """`Conv2D` and pooling"""

    def arrays(self, split):
        x, y = _numbers(split, width=64)
        return x.reshape(-1, 8, 8, 1), y

    def build_model(self):
        x = keras.Input((8, 8, 1))
        hidden = keras.layers.Conv2D(4, 3, activation="relu")(x)
        return _classifier(x, keras.layers.GlobalAveragePooling2D()(hidden))


class ApplicationModel(Zoo3):
    """`keras.applications.MobileNet(weights=None)`"""

    def arrays(self, split):
        x, y = _numbers(split, width=32 * 32 * 3)
        return x.reshape(-1, 32, 32, 3), y

    def build_model(self):
        return keras.applications.MobileNet(input_shape=(32, 32, 3), alpha=0.25, weights=None,
                                            classes=2, classifier_activation=None)


class MultiOutputModel(Zoo3):
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
        self.add_loss(0.05 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


class AddLossModel(Zoo3):
    """`add_loss` and kernel regularizers (headline: the loss)"""

    metric, higher_is_better = "loss", False

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = keras.Input((4,))
        hidden = keras.layers.Dense(8, "relu", kernel_regularizer=keras.regularizers.L2(0.02))(x)
        return _classifier(x, ActivityLoss()(hidden))


class OwnSteps(keras.Model):
    """A subclassed model with its own train_step and test_step, written as keras.io's
    "Customizing what happens in fit() with TensorFlow" does: the compiled loss through
    `compute_loss`, the compiled metrics through `self.metrics`."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(8, "relu"), keras.layers.Dense(2)

    def build(self, input_shape):
        # Without it Keras 3's `build` marks the model built with no weights (a warning):
        # a checkpoint could not be restored into it before its first call.
        self.hidden.build(input_shape)
        self.out.build((*input_shape[:-1], self.hidden.units))

    def call(self, inputs, training=False):
        return self.out(self.hidden(inputs))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return self._track(loss, y, y_pred)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        return self._track(self.compute_loss(y=y, y_pred=y_pred, training=False), y, y_pred)

    def _track(self, loss, y, y_pred):
        # As the guide does. Under a tf.distribute strategy of n replicas Keras 3.15's
        # `compute_loss` returns the loss divided by n (so that summed gradients average),
        # and Keras' own steps multiply it back before their tracker; this one does not, so
        # its "loss" reads 1/n of the true loss there (seen: 0.309 against 0.618, n=2).
        for metric in self.metrics:  # the loss tracker, then the compiled metrics
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OwnStepsModel(Zoo3):
    """subclassed `keras.Model` with its own `train_step` and `test_step`"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        model = OwnSteps()
        model.build((None, 4))
        return model


class GuideModel(keras.Model):
    """keras.io's "Customizing what happens in fit() with TensorFlow", as a new user
    writes it: layers made in `__init__`, no `build` of its own (so `Model.build(shape)`
    creates no variable: its layers are built at the first call), the compiled loss
    through `compute_loss(x=, y=, y_pred=)`, and `optimizer.apply`."""

    def __init__(self):
        super().__init__()
        self.dense, self.out = keras.layers.Dense(32, "relu"), keras.layers.Dense(2)

    def call(self, inputs):
        return self.out(self.dense(inputs))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GuideStepModel(Zoo3):
    """subclassed `keras.Model` built by `build(shape)`, its `train_step` as keras.io writes it"""

    def arrays(self, split):
        return _numbers(split, width=5)

    def build_model(self):
        model = GuideModel()
        model.build((None, 5))
        return model


class Trackers(keras.Model):
    """keras.io's "Customizing what happens in fit()", going lower-level: a loss of its
    own, the metrics it tracks itself (a `keras.metrics.Mean` of the loss) listed by a
    `metrics` property, in `train_step` and in a `test_step` of its own. Its layers are
    named by the task, and it has no `build`: built at its first call."""

    def __init__(self):
        super().__init__(name="trackers")
        self.hidden = keras.layers.Dense(8, "relu", name="hidden")
        self.out = keras.layers.Dense(2, name="scores")
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return self._track(loss, y, y_pred)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        return self._track(self.loss_fn(y, y_pred), y, y_pred)

    def _track(self, loss, y, y_pred):
        self.loss_tracker.update_state(loss)
        self.accuracy.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "accuracy": self.accuracy.result()}


class TrackersModel(Zoo3):
    """subclassed, built at its first call; own `Mean` trackers, `metrics` and `test_step`"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        return Trackers()


Scale = zoo.scale_layer(keras)


class SequentialModel(Zoo3):
    """`Sequential` built at its first call; a registered layer with `get_config`; names with `_`"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        return zoo.lazy_sequential(keras, Scale)


class WeightedLoss(zoo.ClassWeightedLoss, keras.Model):
    """A functional model whose class overrides `compute_loss`."""


class LossOverrideModel(Zoo3):
    """functional model whose class overrides `compute_loss` (headline: the loss)"""

    metric, higher_is_better = "loss", False

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        return zoo.functional(keras, WeightedLoss)


class _TokenAndPosition(keras.layers.Layer):
    """Token and position embeddings; its class name begins with an underscore, so Keras
    names it `__token_and_position` (and its variables' TensorFlow names begin so)."""

    def __init__(self, vocabulary: int, length: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocabulary, dim)
        self.positions = keras.layers.Embedding(length, dim)

    def call(self, ids):
        return self.tokens(ids) + self.positions(keras.ops.arange(keras.ops.shape(ids)[-1]))


class TransformerModel(Zoo3):
    """a Transformer block after a custom layer whose class name begins with `_`"""

    def arrays(self, split):
        n = TRAIN if split == "train" else TEST
        ids = _rng(split).integers(0, 12, (n, 6))
        return ids, (ids[:, 0] < 6).astype(np.int64)

    def build_model(self):
        ids = keras.Input((6,), dtype="int64")
        x = _TokenAndPosition(12, 6, 8)(ids)
        attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
        x = keras.layers.LayerNormalization()(x + attended)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(8, "relu")(x))
        return _classifier(ids, keras.layers.GlobalAveragePooling1D()(x))


class MixedPrecisionModel(Zoo3):
    """the `mixed_float16` policy"""

    overrides = {"train.precision": "mixed_float16"}

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = keras.Input((4,))
        hidden = keras.layers.Dense(16, "relu")(x)
        return keras.Model(x, keras.layers.Dense(2, dtype="float32")(hidden))


# -- Keras 3 preprocessing layers, the first of which tests/zoo.py covers too ----------------------

class StructuredDataModel(Zoo3):
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


class MultiHotModel(Zoo3):
    """`StringLookup(output_mode="multi_hot")` on bags of words"""

    def arrays(self, split):
        n = TRAIN if split == "train" else TEST
        ids = _rng(split).integers(0, len(WORDS), (n, 3))
        return WORDS[ids].astype(object), np.any(ids == 0, axis=1).astype(np.int64)

    def build_model(self):
        words = keras.Input((3,), dtype="string")
        bag = keras.layers.StringLookup(vocabulary=list(WORDS), output_mode="multi_hot")(words)
        return _classifier(words, keras.layers.Dense(8, "relu")(bag))


class TfIdfModel(MultiHotModel):
    """adapted `StringLookup(output_mode="tf_idf")` on bags of words"""

    def build_model(self):
        words = keras.Input((3,), dtype="string")
        lookup = keras.layers.StringLookup(output_mode="tf_idf")
        lookup.adapt(self.arrays("train")[0])  # the vocabulary and its inverse frequencies
        return _classifier(words, keras.layers.Dense(8, "relu")(lookup(words)))


class EmbeddingModel(Zoo3):
    """`Embedding` on integer ids"""

    def arrays(self, split):
        n = TRAIN if split == "train" else TEST
        ids = _rng(split).integers(0, 20, (n, 2))
        return ids, (ids[:, 0] % 2).astype(np.int64)

    def build_model(self):
        ids = keras.Input((2,), dtype="int64")
        return _classifier(ids, keras.layers.Flatten()(keras.layers.Embedding(20, 4)(ids)))


class AugmentationModel(Zoo3):
    """`Rescaling`, `RandomFlip` and `RandomRotation` on `uint8` images"""

    # Keras 3.15 limitation: `model.export` serves `model.__call__` without `training`, and
    # the random image layers default to `training=True`, so the exported SavedModel flips
    # and rotates every request (`predict` and `evaluate` do not). A task that exports
    # through `model.export` serves augmented input unless the exporter passes
    # training=False; tests/test_zoo_keras3.py checks that it still does.

    def arrays(self, split):
        n = TRAIN if split == "train" else TEST
        rng = _rng(split)
        bright = rng.integers(0, 2, n)  # the label: a bright image or a dark one
        images = rng.integers(0, 128, (n, 8, 8, 1)) + 120 * bright[:, None, None, None]
        return images.astype(np.uint8), bright.astype(np.int64)

    def build_model(self):
        images = keras.Input((8, 8, 1), dtype="uint8")
        x = keras.layers.Rescaling(1 / 255)(images)
        x = keras.layers.RandomFlip("horizontal")(x)  # only while training
        x = keras.layers.RandomRotation(0.1)(x)
        hidden = keras.layers.Conv2D(4, 3, activation="relu")(x)
        return _classifier(images, keras.layers.GlobalAveragePooling2D()(hidden))


class UnexportableModel(Zoo3):
    """Not a case: a model that trains and whose SavedModel TensorFlow refuses (an input
    named "a feature": "Got non-flat/non-unique argument names for SavedModel signature";
    tests/test_train_cli.py: a failed export costs the run nothing but its export)."""

    def arrays(self, split):
        x, y = _numbers(split)
        return {"a feature": x}, y

    def build_model(self):
        x = keras.Input((4,), name="a feature")
        return _classifier({"a feature": x}, keras.layers.Dense(8, "relu")(x))


CASES: dict[str, type[Zoo3]] = {cls.__name__: cls for cls in (
    StringLookupModel, IntegerLookupModel, TextVectorizationModel, HashingModel,
    NormalizationModel, LookupInDatasetFn, BatchNormModel, SyncBatchNormModel, DropoutModel,
    RecurrentModel, ConvModel, ApplicationModel, MultiOutputModel, AddLossModel,
    OwnStepsModel, MixedPrecisionModel, GuideStepModel, TransformerModel,
    StructuredDataModel, MultiHotModel, TfIdfModel, EmbeddingModel, AugmentationModel,
    TrackersModel, SequentialModel, LossOverrideModel)}


# -- Deliberately wrong: one task, two dialects. The project must refuse these. ---------------


class MixedDialectLoss(Zoo3):
    """a Keras 3 model with a tf_keras loss"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = keras.Input((4,))
        return _classifier(x, keras.layers.Dense(8, "relu")(x))

    def loss(self):
        return tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class MixedDialectMetric(Zoo3):
    """a tf_keras model with a Keras 3 metric"""

    def arrays(self, split):
        return _numbers(split)

    def build_model(self):
        x = tf_keras.Input((4,))
        hidden = tf_keras.layers.Dense(8, "relu")(x)
        return tf_keras.Model(x, tf_keras.layers.Dense(2)(hidden))

    def loss(self):
        return tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # metrics(): Zoo3's Keras 3 SparseCategoricalAccuracy, the one object of the other dialect


MIXED_DIALECT: dict[str, type[Zoo3]] = {cls.__name__: cls for cls in (
    MixedDialectLoss, MixedDialectMetric)}
