"""The task interface: what to train, independent of how it is distributed.

A task builds its Keras model, gives its training input as a
`dataset_fn(input_context)` and its evaluation splits as plain datasets,
names its loss and metrics, and says which metric is its headline. It knows
nothing about strategies: the runner of each strategy kind (`app.run.runners`)
decides what a global batch means, who writes outputs and how evaluation
stays exact.

A task is chosen by `task.name`: a built-in name (`config.BUILTIN_TASKS`) or
an import path `package.module:ClassName` found on the import path (the
current directory and `PYTHONPATH`). The rest of the `[task]` config table are its
parameters, checked against its `Params` dataclass: unknown keys and wrong
types are refused with the field named, as for every other config section.

    class Regression(Task):
        @dataclasses.dataclass(frozen=True)
        class Params:
            hidden: int = field(64, minimum=1)

        metric, higher_is_better = "mae", False
        ...
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import TYPE_CHECKING, Any, ClassVar

import tensorflow as tf

from app import config as cfg
from app import indexed
from app.config import ConfigError, field  # noqa: F401 (re-exported for task authors)

if TYPE_CHECKING:  # a task builds with either Keras: app.dialects finds which
    import keras
    import tf_keras

    Model = keras.Model | tf_keras.Model
    Loss = keras.losses.Loss | tf_keras.losses.Loss
    Metric = keras.metrics.Metric | tf_keras.metrics.Metric
    Optimizer = keras.optimizers.Optimizer | tf_keras.optimizers.Optimizer


@dataclasses.dataclass(frozen=True)
class NoParams:
    """The parameters of a task that takes none."""


class Task:
    """Base class of every task. Subclasses implement the four methods marked so."""

    # The task's parameters: a frozen dataclass whose defaults are the task's defaults.
    Params: ClassVar[type] = NoParams
    # The headline metric: a name in `metrics()` (or "loss"), reported as
    # test_<metric> in metrics.json, the summary line, the evaluator and the bench.
    metric: ClassVar[str] = "loss"
    higher_is_better: ClassVar[bool] = False

    def __init__(self, params: Any = None, *, seed: int = 0, shard_policy: str = "auto"):
        self.params = self.Params() if params is None else params
        self.seed = seed
        self.shard_policy = shard_policy

    # -- what a task must give ------------------------------------------------------------

    def build_model(self) -> Model:
        """The model, taking the raw features the datasets yield. (Must implement.)"""
        raise NotImplementedError(f"{type(self).__name__}.build_model")

    def train_dataset(self, context: tf.distribute.InputContext,
                      global_batch_size: int) -> tf.data.Dataset:
        """This input pipeline's training data: its shard (`self.shard`), shuffled,
        repeated, batched at `context.get_per_replica_batch_size(global_batch_size)`.
        (Must implement, unless `train_source` gives the examples: then by default
        this pipeline reads them, for the runs that read a pipeline.)"""
        source = self.train_source()
        if source is None:
            raise NotImplementedError(f"{type(self).__name__}.train_dataset")
        return indexed.pipeline(source, self.shard(tf.data.Dataset.range(source.size), context),
                                context.get_per_replica_batch_size(global_batch_size),
                                self.pipeline_seed(context))

    def eval_dataset(self, split: str, batch_size: int) -> tf.data.Dataset | None:
        """Every example of `split` ("validation" or "test") once, in order, batched;
        None when the task has no such split. (Must implement.)"""
        raise NotImplementedError(f"{type(self).__name__}.eval_dataset")

    def loss(self) -> Loss | dict[str, Any]:
        """The training loss, averaged over a batch; for a model of several outputs,
        a dict of losses by output name. (Must implement.)"""
        raise NotImplementedError(f"{type(self).__name__}.loss")

    # -- what a task may change -----------------------------------------------------------

    def metrics(self) -> list[Metric] | dict[str, Any]:
        """New metric objects for training and evaluation (named; called more than once);
        for a model of several outputs, a dict of them by output name, as
        `Model.compile(metrics=...)` takes."""
        return []

    def weighted_metrics(self) -> list[Metric] | dict[str, Any] | None:
        """Metrics weighted by the sample weights the datasets yield (as
        `Model.compile(weighted_metrics=...)` takes), or None."""
        return None

    def loss_weights(self) -> list[float] | dict[str, float] | None:
        """The weight of each output's loss in the total (`Model.compile(loss_weights=...)`),
        or None for equal weights."""
        return None

    def train_source(self) -> indexed.Source | None:
        """The training examples by index (`app.indexed.Source`), or None when the task
        gives only `train_dataset`. With a source every example is trained on once
        per epoch, in an order that neither failures nor the cluster's shape change,
        and a run resumes at the batch after its backup's (docs/tasks.md); without
        one, a failure or a resume re-reads or skips examples."""
        return None

    def train_examples(self) -> int | None:
        """Examples in one pass over the training data; None for an unbounded source
        (then `train.steps_per_epoch` must be set)."""
        return None

    def eval_examples(self, split: str) -> int | None:
        """Examples in `split`, for metrics.json (None: not known without a pass)."""
        return None

    def optimizer(self, learning_rate: Any) -> Optimizer | None:
        """The optimizer to train with, or None for the one `train.optimizer` configures."""
        return None

    def serving_model(self, model: Model) -> Model:
        """The model to export: it must take raw input (preprocessing inside)."""
        return model

    def lookup_rows(self, variable: tf.Variable, shard_rows: list[int],
                    batch_size: int) -> list[float] | None:
        """For a variable a step reads by lookup (an embedding table): the expected
        number of its rows one training step of `batch_size` examples reads, per row
        shard (`shard_rows` rows each, in order). None: the step reads all of it.
        `tools.plan` predicts parameter-server traffic with it."""
        return None

    def report(self, model: Model, test: dict[str, float]) -> dict[str, Any]:
        """Figures of the task's own for metrics.json, given the trained model and its
        test results (e.g. the best score its data allows)."""
        return {}

    # -- helpers for dataset_fn ------------------------------------------------------------

    def shard(self, dataset: tf.data.Dataset,
              context: tf.distribute.InputContext) -> tf.data.Dataset:
        """`dataset`'s records for this input pipeline, by `data.shard_policy`:
        pipeline i of n takes records i, i+n, ... ("auto", "data"), or all ("off")."""
        if self.shard_policy == "file":
            raise ConfigError(
                f"data.shard_policy = 'file' needs a task that reads its training data from "
                f"files, one or more per worker; task {type(self).__name__} shards records. "
                "Use auto or data")
        if self.shard_policy == "off" or context.num_input_pipelines == 1:
            return dataset
        return dataset.shard(context.num_input_pipelines, context.input_pipeline_id)

    def shard_files(self, files: list[str],
                    context: tf.distribute.InputContext) -> tuple[tf.data.Dataset, bool]:
        """The file names this input pipeline reads, and whether its records still need
        `shard` (when the files were not split among the pipelines).

        "file", or "auto" with at least as many files as pipelines: pipeline i reads
        files i, i+n, ...; "data": every pipeline reads every file and shards its
        records; "off": every pipeline reads everything.
        """
        names = tf.data.Dataset.from_tensor_slices(sorted(files))
        n, policy = context.num_input_pipelines, self.shard_policy
        if policy == "off" or n == 1:
            return names, False
        if policy == "file" and len(files) < n:
            raise ConfigError(
                f"data.shard_policy = 'file' needs at least one file per input pipeline, "
                f"but there are {len(files)} file(s) for {n} pipelines; write more files "
                "or use data")
        if policy == "file" or (policy == "auto" and len(files) >= n):
            return names.shard(n, context.input_pipeline_id), False
        return names, True

    def pipeline_seed(self, context: tf.distribute.InputContext) -> int:
        """A shuffle seed of this input pipeline's own: `seed` + its id.

        Under ParameterServerStrategy the id is a tensor filled in on each worker,
        and tf.data's shuffle refuses a tensor seed while the global seed is 0
        (TF 2.21, framework random_seed.get_seed), so there every worker uses
        `seed`: with sharding each still shuffles its own records; with
        `data.shard_policy = off` the workers share one order.
        """
        pipeline = context.input_pipeline_id
        return self.seed + pipeline if isinstance(pipeline, int) else self.seed


def find(name: str) -> type[Task]:
    """The task class `name` stands for: a built-in name or `package.module:ClassName`."""
    module_name, _, attr = cfg.task_target(name).partition(":")
    # `python -m app.train` puts the current directory on the path; the console script
    # does not, and users expect their own code next to their config to be found.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"task.name = {name!r}: no module named {module_name!r} in the current "
                f"directory ({os.getcwd()}) or on PYTHONPATH; run from the directory that "
                "holds it, or add its directory to PYTHONPATH") from None
        raise ConfigError(f"task.name = {name!r}: importing {module_name} failed: module "
                          f"{missing!r} it imports is not installed") from None
    found = getattr(module, attr, None)
    if found is None:
        tasks = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Task) and v is not Task)
        raise ConfigError(
            f"task.name = {name!r}: module {module_name} has no {attr!r}"
            + (f"; its tasks are {', '.join(tasks)}" if tasks else "; it defines no Task"))
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise ConfigError(
            f"task.name = {name!r} is a {type(found).__name__}, not a subclass of "
            "app.task.Task")
    return found


def create(config: cfg.Config) -> tuple[Task, cfg.Config]:
    """The configured task, and `config` with every task parameter filled in."""
    kind = find(config.task.name)
    params = cfg.build_section("task", kind.Params, config.task.params)
    task = kind(params, seed=config.train.seed, shard_policy=config.data.shard_policy)
    resolved = cfg.TaskConfig(config.task.name, dataclasses.asdict(params))
    return task, dataclasses.replace(config, task=resolved)

