"""A task written the way a user would: 64 MiB of NumPy arrays passed to `from_arrays`.

    python -m app.train --set task.name=examples.large_arrays:LargeArrays --set train.epochs=1
    python -m launch.local --workers 2 --ps 1 --set task.name=examples.large_arrays:LargeArrays \
        --set train.epochs=1

Above 8 MiB, `data.from_arrays` writes each array once to `<workdir>/arrays/`
and every input pipeline reads it from there (docs/tasks.md).
"""

import numpy as np
import tf_keras as keras

from app import data
from app.task import Task

rng = np.random.default_rng(0)  # the same arrays in every process
X = rng.normal(size=(65536, 256)).astype("float32")  # 64 MiB
Y = (X[:, :1] * 2 + X[:, 1:2]).astype("float32")
TRAIN, TEST = (X[:61440], Y[:61440]), (X[61440:], Y[61440:])


class LargeArrays(Task):
    metric, higher_is_better = "mae", False  # reported as test_mae

    def build_model(self):
        return keras.Sequential([keras.Input((256,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.Dense(1)])

    def train_dataset(self, context, global_batch_size):
        examples = self.shard(data.from_arrays(*TRAIN), context)  # this worker's share
        return data.batches(examples, context.get_per_replica_batch_size(global_batch_size),
                            seed=self.pipeline_seed(context), shuffle_buffer=4096)

    def eval_dataset(self, split, batch_size):
        return data.from_arrays(*TEST).batch(batch_size) if split == "test" else None

    def train_examples(self):
        return len(TRAIN[0])

    def loss(self):
        return keras.losses.MeanSquaredError()

    def metrics(self):
        return [keras.metrics.MeanAbsoluteError(name="mae")]
