"""The ops of one training step, by type, in Keras 2 and Keras 3: where a Keras 3
step's extra work is (docs/benchmarks.md, "Keras 3 beside Keras 2").

    python experiments/step_ops.py                      # MirroredStrategy on 2 logical CPUs
    python experiments/step_ops.py --strategy default   # one device

Builds the MNIST task's model (the bench's settings: the CNN, Adam, batch 32)
in each Keras under the strategy, runs two steps of `fit`, and counts the ops
of the graph its train function traced, the bodies of the functions it calls
included. Prints the ops whose counts differ, and the totals.
"""

from __future__ import annotations

import argparse
import collections
import inspect

import tensorflow as tf

from app import config as cfg
from app import dialects
from app import task as tasks
from app.run import optimizers

SETTINGS = ["runtime.onednn=false", "task.source=synthetic", "task.train_examples=640",
            "task.validation_examples=0", "task.test_examples=32", "train.verbose=0"]


def step_ops(keras_name: str, strategy: tf.distribute.Strategy) -> collections.Counter:
    """Op type -> count in the traced train function of the MNIST task in `keras_name`."""
    task, config = tasks.create(cfg.load("configs/mnist.toml",
                                         [*SETTINGS, f"task.keras={keras_name}"]))
    with strategy.scope():
        model = task.build_model()
        dialect = dialects.of(model, task)
        model.compile(optimizer=optimizers.optimizer(config, task, 2, dialect), loss=task.loss(),
                      metrics=task.metrics())
    dataset = strategy.distribute_datasets_from_function(
        lambda context: task.train_dataset(context, config.train.global_batch_size).repeat())
    model.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0)
    function = model.train_function
    if not hasattr(function, "_list_all_concrete_functions"):
        # Keras 3.15: a Python function around the tf.function it steps.
        function = next(v for v in inspect.getclosurevars(function).nonlocals.values()
                        if hasattr(v, "_list_all_concrete_functions"))
    graph = function._list_all_concrete_functions()[0].graph.as_graph_def()
    return collections.Counter(node.op for fn in [graph, *graph.library.function]
                               for node in getattr(fn, "node", None) or fn.node_def)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("mirrored", "default"), default="mirrored")
    args = parser.parse_args()
    if args.strategy == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    else:
        strategy = tf.distribute.get_strategy()
    counts = {name: step_ops(name, strategy) for name in ("tf_keras", "keras")}
    print(f"{'op':28s} {'Keras 2':>8s} {'Keras 3':>8s}")
    for op in sorted(set(counts["tf_keras"]) | set(counts["keras"]),
                     key=lambda o: counts["tf_keras"][o] - counts["keras"][o]):
        if counts["tf_keras"][op] != counts["keras"][op]:
            print(f"{op:28s} {counts['tf_keras'][op]:8d} {counts['keras'][op]:8d}")
    print(f"{'all ops':28s} {sum(counts['tf_keras'].values()):8d} "
          f"{sum(counts['keras'].values()):8d}")


if __name__ == "__main__":
    main()
