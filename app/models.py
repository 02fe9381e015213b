"""Keras models. Pure `tf_keras` (Keras 2): no strategy code here.

Keras 3 cannot train under ParameterServerStrategy (keras-team/keras#18624),
so every model is built with tf_keras. Models output float32 logits, also
under a mixed-precision policy, so the loss is computed in full precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import tf_keras as keras


def build(name: str, input_shape: Sequence[int], num_classes: int,
          dropout: float = 0.5) -> keras.Model:
    """The model called `name`, for images of `input_shape`."""
    if name == "cnn":
        return cnn(input_shape, num_classes, dropout)
    if name == "mlp":
        return mlp(input_shape, num_classes)
    raise ValueError(f"Unrecognized model {name!r}; choose cnn or mlp")


def cnn(input_shape: Sequence[int], num_classes: int, dropout: float) -> keras.Model:
    """The classic distributed-MNIST network: two 5x5 conv/pool blocks, dense 1024, dropout."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input(shape=tuple(input_shape)),
        layers.Conv2D(32, 5, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(64, 5, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dense(1024, activation="relu"),
        layers.Dropout(dropout),
        layers.Dense(num_classes, dtype="float32"),
    ], name="cnn")


def mlp(input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """The classic multi-GPU tower example's fully connected 512-128-128 stack."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input(shape=tuple(input_shape)),
        layers.Flatten(),
        layers.Dense(512, activation="relu"),
        layers.Dense(128, activation="relu"),
        layers.Dense(128, activation="relu"),
        layers.Dense(num_classes, dtype="float32"),
    ], name="mlp")
