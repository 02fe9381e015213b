"""Keras 3 models built before the first step: the layers from the shapes of the
input's features, and what Keras' fit builds from its first batch, from blanks of
the same shapes: what `app.dialects.keras3` does before Keras' fit, and before
the steps of its own loop under ParameterServerStrategy."""

from __future__ import annotations

import keras
import tensorflow as tf

from app.dialects import keras3_internal


def _element_spec(dataset_fn):
    return dataset_fn(tf.distribute.InputContext()).element_spec


def build_layers(model: keras.Model, dataset_fn) -> None:
    """Create the variables of every layer of `model` not built yet, from the shapes of
    the features `dataset_fn`'s elements hold, before anything is built from them.

    `Model.build(shape)` on a subclassed model without a `build` of its own (as
    keras.io's "Customizing what happens in fit()" builds one) marks it built and
    creates no variable (Keras 3.15 layer.py, `Layer.build`: a warning); its layers
    are built at its first call. Keras' own fit calls it before it builds the
    optimizer (`Trainer._symbolic_build`); built first, the optimizer knew no variable
    and the first step failed with "Unknown variable". A symbolic call, as Keras makes.
    """
    if all(layer.built for layer in keras3_internal.flatten_layers(model)):
        return
    features = keras.utils.unpack_x_y_sample_weight(_element_spec(dataset_fn))[0]
    model(tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype.name), features),
          training=False)


def prebuild(model: keras.Model, dataset_fn) -> None:
    """Build what Keras 3 builds from the first batch, from the shapes of `dataset_fn`'s
    elements instead, in the strategy's scope.

    Under a strategy Keras 3.15's fit() and evaluate() read a batch first and
    average it over the replicas to build the model (TensorFlowTrainer
    `_maybe_symbolic_build`): that batch is not trained on, and a model that
    takes strings fails there (AddN has no string kernel). Built here from
    blanks of the same shapes, the model does not need that batch: the step is
    skipped. Under ParameterServerStrategy no step may create variables on a
    worker, so they must exist before the first one is scheduled.
    """
    spec = _element_spec(dataset_fn)
    keras3_internal.build_from_batch(model, tf.nest.map_structure(_blank, spec))


def _blank(spec: tf.TensorSpec) -> tf.Tensor:
    shape = [1 if d is None else d for d in spec.shape]
    return tf.fill(shape, "") if spec.dtype == tf.string else tf.zeros(shape, spec.dtype)
