"""Synchronous parameter-server training (ps.mode = sync) on the in-process
cluster of conftest.py: 2 workers, 2 ps, this process the chief."""

import collections
import contextlib

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from app import config as cfg
from app import indexed, tf_internal, trainer
from app.dialects import keras2_sync, keras3_sync
from app.dialects import keras3 as keras3_dialect
from app.distribute.ps import straggler as stragglers
from app.distribute.ps import sync as sync_ps
from app.run import runners
from app.task import Task
from app.tasks.mnist import Mnist
from tests.conftest import tiny_split, tiny_task

pytestmark = pytest.mark.cluster

FEATURES, BATCH = 6, 4


def _examples(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, FEATURES)).astype(np.float32),
            rng.integers(0, 3, n).astype(np.int64))


def _in_order(context: tf.distribute.InputContext) -> tf.data.Dataset:
    """Worker i's k-th batch is rows [BATCH*k, BATCH*(k+1)) of shard i: no shuffling."""
    images, labels = _examples()
    return (tf.data.Dataset.from_tensor_slices((images, labels))
            .shard(context.num_input_pipelines, context.input_pipeline_id)
            .batch(BATCH).repeat())


def _model() -> keras.Model:
    model = keras.Sequential([keras.layers.Dense(3, input_shape=(FEATURES,))])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    return model


def _training(strategy, model, backup_workers: int, straggler=None, path=None,
              train=None, half_reads: bool = False) -> sync_ps.SyncTraining:
    return sync_ps.SyncTraining(
        model, train or model.train_step, tf.distribute.coordinator.ClusterCoordinator(strategy),
        path or keras2_sync.UpdatePath(),
        sync_ps.Settings(num_workers=2, backup_workers=backup_workers, straggler=straggler,
                         half_reads=half_reads))


def _fit(training: sync_ps.SyncTraining, dataset_fn, steps: int, tmp_path,
         keras_module=keras) -> dict:
    source = sync_ps.Pipelines(training.coordinator, runners.per_worker(dataset_fn, 2))
    _, figures = sync_ps.fit(training, source, keras_module, epochs=1,
                             steps_per_epoch=steps, callbacks=[], verbose=0,
                             backup=sync_ps.SyncBackup(training, tmp_path / "backup"))
    return figures


@pytest.mark.parametrize("half_reads", [False, True])
def test_sync_without_backups_equals_one_process_taking_the_averaged_steps(
        ps_strategy, tmp_path, half_reads):
    # With half_reads (ps.read_compression = fp16) each contribution's forward and backward
    # pass see the weights rounded to float16, and the update applies to the float32 ones.
    keras.utils.set_random_seed(1)
    with ps_strategy.scope():
        model = _model()
    training = _training(ps_strategy, model, backup_workers=0, half_reads=half_reads)
    figures = _fit(training, _in_order, 6, tmp_path)
    assert figures == {"contributions": [6, 6], "pushed": [6, 6], "stale_dropped": 0}

    keras.utils.set_random_seed(1)
    reference = _model()  # same seed: same initial weights
    seen = _model()  # the weights a contribution computes on
    images, labels = _examples()
    shards = [(images[i::2], labels[i::2]) for i in range(2)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for k in range(6):
        rows = slice(BATCH * k, BATCH * (k + 1))
        seen.set_weights([w.astype(np.float16).astype(np.float32) if half_reads else w
                          for w in reference.get_weights()])
        with tf.GradientTape() as tape:
            # The mean of the two workers' mean losses: the mean of their gradients.
            value = tf.add_n([loss(y[rows], seen(x[rows])) for x, y in shards]) / 2
        grads = tape.gradient(value, seen.trainable_variables)
        reference.optimizer.apply_gradients(zip(grads, reference.trainable_variables, strict=True))
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 6


def _late(version: tf.Variable, final: int, jitter_us: int = 0, late: bool = True,
          draining: tf.Variable | None = None, hang_s: float = 300.0):
    """A `straggle` whose slow worker deposits only once the parameters have moved on
    from those it read, or have had their `final` update: a straggler that is late
    whatever the load on the machine, where `Straggler.factor` is relative to its
    own step time and can lose a race with a fast worker held up by the load. It waits
    on the run's own progress, never on the clock (`hang_s` is a deadline only a hang
    reaches). With `jitter_us`, every deposit (the slow worker's too) first waits up to
    that long, at random: contributions interleave with updates in ever other orders.
    Without `late`, the slow worker has that jitter only (an update that waits for it
    would wait for ever). With `draining` (the exchange's), it is not late while the
    chief drains (at an epoch's end, no update comes until every contribution ended)."""
    def wait(ready: list[tf.Tensor]) -> tf.Tensor:
        with tf.control_dependencies(ready):
            seen, deadline = version.read_value(), tf.timestamp() + hang_s
        def drained():
            return tf.constant(False) if draining is None else draining.read_value()

        tick = tf_internal.ticks(tf.constant(1000, tf.int64))
        return tf.while_loop(
            lambda slept: ((version.read_value() <= seen) & (seen < final)
                           & (tf.timestamp() < deadline) & tf.logical_not(drained())),
            lambda slept: slept + next(tick),
            [tf.constant(0, tf.int64)])[0]

    def jitter(ready: list[tf.Tensor]) -> tf.Tensor:
        with tf.control_dependencies(ready):
            pause = tf.random.uniform([], 0, jitter_us + 1, tf.int64)
        return tf_internal.sleep(pause)

    def straggle(values, is_slow, factor, started):
        if jitter_us:
            values = stragglers.hold(values, tf.constant(True), jitter)
        return stragglers.hold(values, is_slow, wait) if late else values

    return straggle


def test_one_ticks_iterator_sleeps_at_every_next_of_a_loop():
    @tf.function
    def sleeps():
        tick = tf_internal.ticks(tf.constant(1, tf.int64))  # made once, outside the loop
        return tf.while_loop(lambda i, total: i < 50,
                             lambda i, total: (i + 1, total + next(tick)),
                             [tf.constant(0, tf.int64), tf.constant(0, tf.int64)])

    done, total = sleeps()
    assert (int(done), int(total)) == (50, 0)  # 50 sleeps, each giving 0; none ran out


def test_with_a_backup_worker_updates_never_wait_for_the_straggler(
        ps_strategy, monkeypatch, tmp_path):
    steps = 12
    keras.utils.set_random_seed(1)
    with ps_strategy.scope():
        model = _model()
    training = _training(ps_strategy, model, backup_workers=1,
                         straggler=stragglers.Straggler(worker=1, factor=2.0))
    monkeypatch.setattr(sync_ps, "straggle", _late(training.exchange.version, final=steps))
    figures = _fit(training, _in_order, steps, tmp_path)
    # Every update went ahead on the fast worker's contribution alone; the straggler's,
    # computed on parameters that had moved on, were all dropped.
    assert figures["contributions"] == [steps, 0]
    assert figures["stale_dropped"] == figures["pushed"][1] >= 1


# -- exact synchronous updates --------------------------------------------------------------

UPDATES = 60


class Clock(keras3.layers.Layer):
    """Two variables that record what each update averaged: `clock` gains 1 per update
    (gradient -1, SGD at 1), and `seen[c]` gains the share of an update's contributions
    that read `clock` = c. After update k, exact updates leave seen[k] == 1."""

    def __init__(self, seen_first: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.seen_first = seen_first  # the ps tasks take variables in turn

    def build(self, input_shape):
        for name in (("seen", "clock") if self.seen_first else ("clock", "seen")):
            setattr(self, name, self.add_weight(shape=(UPDATES + 8,) if name == "seen" else (),
                                                initializer="zeros", name=name))

    def call(self, inputs):
        read = keras3.ops.cast(keras3.ops.round(keras3.ops.stop_gradient(self.clock)), "int32")
        value = -self.clock - keras3.ops.sum(self.seen * keras3.ops.one_hot(read, UPDATES + 8))
        return keras3.ops.zeros_like(inputs[:, :1]) + value


def _clocks() -> keras3.Model:
    """Clocks on both ps tasks (variables are placed in turn), and a dense layer between."""
    inputs = keras3.Input((FEATURES,))
    clocks = [Clock(seen_first=i % 2 == 1, name=f"clock_{i}")(inputs) for i in range(3)]
    hidden = keras3.layers.Dense(2, name="hidden")(inputs)
    outputs = keras3.layers.Add()([*clocks, 0.0 * keras3.ops.sum(hidden, 1, keepdims=True)])
    model = keras3.Model(inputs, outputs)
    model.compile(optimizer=keras3.optimizers.SGD(1.0),
                  loss=lambda y, prediction: keras3.ops.mean(prediction, axis=-1))
    return model


@pytest.mark.parametrize("backup_workers", [0, 1])
def test_every_update_averages_contributions_computed_on_the_version_it_updates(
        ps_strategy, monkeypatch, tmp_path, backup_workers):
    """Each update k averages N contributions that all read the parameters of version k
    (the clock on each ps task), every deposit delayed at random and, with a backup
    worker, a straggler whose contributions are all late; the version is announced
    only once every variable holds it."""
    with ps_strategy.scope():
        model = _clocks()
    built = keras3_dialect.build_coordinated(model, None, _in_order, contextlib.nullcontext())
    training = _training(ps_strategy, model, backup_workers,
                         straggler=stragglers.Straggler(worker=1, factor=2.0),
                         path=keras3_sync.UpdatePath(keras3_dialect.tf_variable),
                         train=built.train)
    monkeypatch.setattr(sync_ps, "straggle", _late(training.exchange.version, final=UPDATES,
                                                   jitter_us=3000, late=backup_workers > 0))
    figures = _fit(training, _in_order, UPDATES, tmp_path, keras3)
    devices = set()
    for layer in model.layers:
        if isinstance(layer, Clock):
            devices.add(layer.clock.value.device)
            assert float(layer.clock.numpy()) == UPDATES
            np.testing.assert_array_equal(layer.seen.numpy()[:UPDATES], np.ones(UPDATES))
            assert not layer.seen.numpy()[UPDATES:].any()
    assert len(devices) == 2  # clocks on both ps tasks
    required = 2 - backup_workers
    assert sum(figures["contributions"]) == required * UPDATES
    assert figures["stale_dropped"] == sum(figures["pushed"]) - required * UPDATES


def _cast_to_half(tensor: tf.Tensor) -> bool:
    """Whether `tensor`, through identities, is cast to float16."""
    return any(op.type == "Cast" and op.outputs[0].dtype == tf.float16
               or op.type == "Identity" and _cast_to_half(op.outputs[0])
               for op in tensor.consumers())


def _after(op: tf.Operation, first: tf.Operation) -> bool:
    """Whether `op` runs after `first`: a path of inputs or control inputs leads back to it."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        if current is first:
            return True
        if current.name not in seen:
            seen.add(current.name)
            stack += [t.op for t in current.inputs] + list(current.control_inputs)
    return False


@pytest.mark.parametrize("keras_name, compression", [
    ("tf_keras", "none"), ("keras", "none"), ("tf_keras", "fp16"), ("keras", "fp16")])
def test_a_contribution_reads_every_variable_after_the_version(ps_strategy, ps_cluster,
                                                               keras_name, compression):
    """The ordering the exactness test relies on, in the graph: each read of a model
    variable, and the deposit's, follows the version's read (the train step runs in
    strategy.run's own thread, where the caller's control dependencies do not reach),
    as float32 or as float16 (ps.read_compression)."""
    config = _config(f"task.keras={keras_name}", f"ps.read_compression={compression}")
    runner = runners.create(config, ps_cluster, ps_strategy)
    task = tiny_task(config)
    runner.build(task, lambda dialect: dialect.optimizer("sgd", 0.1, config.sync, config.ps))
    training = runner.training
    _, concrete = training.trace(runner.train_fn(task)(tf.distribute.InputContext()).element_spec)
    graph = concrete.graph
    handles = {id(external): internal.op for external, internal in graph.captures}
    version = handles[id(training.exchange.version.handle)]
    variables = [part for v in training.model.trainable_variables
                 for part in getattr(training.path.tf_variable(v), "variables",
                                     [training.path.tf_variable(v)])]
    model = {handles[id(part.handle)] for part in variables if id(part.handle) in handles}
    read_version = [op for op in graph.get_operations()
                    if op.type == "ReadVariableOp" and op.inputs[0].op is version]
    reads = [op for op in graph.get_operations()
             if op.type == "ReadVariableOp" and op.inputs[0].op in model]
    assert len(read_version) == 1 and len(reads) >= len(variables) > 0
    assert all(_after(op, read_version[0]) for op in reads)
    halved = [op for op in reads if _cast_to_half(op.outputs[0])]
    assert len(halved) == (len(reads) if compression == "fp16" else 0)


# -- trainer.run ---------------------------------------------------------------------------

def _config(*overrides: str) -> cfg.Config:
    # The MLP: what these runs test is the exchange, and the CNN's 12 MiB kernel made
    # each update cost a 12 MiB deposit per worker (measured with TEST_CPU_LOG, the
    # straggler runs took 29 and 25 CPU s with it, 14 and 12 with the MLP).
    return cfg.load(None, ["train.epochs=2", "train.global_batch_size=16", "train.verbose=0",
                           "eval.batch_size=32", "ps.mode=sync", "task.model=mlp", *overrides])


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras"])
def test_sync_run_reports_its_mode_and_contributions(ps_strategy, ps_cluster, tmp_path,
                                                     keras_name):
    config = _config(f"task.keras={keras_name}")
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy,
                          cluster=ps_cluster, task=tiny_task(config))
    steps = 2 * 512 // 16
    assert (metrics["mode"], metrics["backup_workers"], metrics["steps"]) == ("sync", 0, steps)
    assert metrics["keras"] == keras_name
    assert metrics["contributions"] == [steps, steps] and metrics["stale_dropped"] == 0
    assert metrics["test_accuracy"] > 0.3  # learnable bars, far above chance
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert (tmp_path / "checkpoints" / "ckpt-2.index").exists()
    assert (tmp_path / "export" / "saved_model.pb").exists()


@pytest.mark.parametrize("mode, keras_name", [("async", "tf_keras"), ("sync", "tf_keras"),
                                              ("sync", "keras")])
def test_run_with_a_straggler(mode, keras_name, ps_strategy, ps_cluster, tmp_path):
    config = _config(f"ps.mode={mode}", "debug.slow_worker=1", "debug.slow_factor=2",
                     f"task.keras={keras_name}")
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy,
                          cluster=ps_cluster, task=tiny_task(config))
    assert (metrics["mode"], metrics["slow_worker"], metrics["slow_factor"]) == (mode, 1, 2.0)
    assert metrics["steps"] == 2 * 512 // 16
    assert ("contributions" in metrics) == (mode == "sync")


@pytest.mark.parametrize("overrides, message", [
    (["ps.backup_workers=2"], "ps.backup_workers = 2 must be less than the number of "
                              "workers (2): each update needs at least one gradient"),
    (["ps.backup_workers=1", "train.global_batch_size=15"], None),
    (["train.global_batch_size=15"], "train.global_batch_size (15) must be divisible by the "
                                     "workers each update waits for (workers - "
                                     "ps.backup_workers) (2); use 14 or 16"),
    (["debug.slow_worker=2"], "debug.slow_worker = 2 is not a worker of this cluster (0 to 1)"),
    (["ps.read_every=2", "train.steps_per_execution=2"],
     "ps.read_every = 2 is for ps.mode = async: each step of the synchronous loop reads the "
     "variables; set it to 1, or use ps.mode = async"),
    (["ps.read_every=2"],  # not first told to raise train.steps_per_execution, refused too
     "ps.read_every = 2 is for ps.mode = async: each step of the synchronous loop reads the "
     "variables; set it to 1, or use ps.mode = async"),
    (["train.steps_per_execution=4"], "train.steps_per_execution = 4 runs 4 steps a scheduled "
     "closure; in ps.mode = sync a closure is one worker's contribution to an update the "
     "chief applies between closures: set it to 1, or use ps.mode = async"),
])
def test_sync_settings_are_checked_against_the_cluster(ps_strategy, ps_cluster, tmp_path,
                                                       overrides, message):
    config = _config("train.epochs=1", *overrides)
    task = Mnist.from_arrays(tiny_split(60), None, tiny_split(10))
    if message is None:  # one worker's gradient per update: any batch divides
        assert trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                           task=task)["backup_workers"] == 1
        return
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster, task=task)
    assert str(e.value) == message


class _Weighted(Mnist):
    """The MNIST task whose training batches carry sample weights."""

    def train_dataset(self, context, global_batch_size):
        batches = super().train_dataset(context, global_batch_size)
        return batches.map(lambda x, y: (x, y, tf.ones_like(y, tf.float32)))


def test_sync_trains_on_batches_with_sample_weights(ps_strategy, ps_cluster, tmp_path):
    task = _Weighted.from_arrays(tiny_split(60), None, tiny_split(10))
    metrics = trainer.run(_config("train.epochs=1"), tmp_path, strategy=ps_strategy,
                          cluster=ps_cluster, task=task)
    assert metrics["steps"] == 60 // 16 and sum(metrics["contributions"]) == 2 * 3


# -- what cannot be deferred to one synchronous update, refused before training ---------------

class _Steps(keras3.Model):
    """A Keras 3 model with a train_step of its own, as keras.io writes one, made to do
    one thing ps.mode = sync cannot defer (`how`)."""

    how = "once"

    def __init__(self):
        super().__init__(name="steps")
        self.flat, self.out = keras3.layers.Flatten(), keras3.layers.Dense(10, name="scores")
        self.other = keras3.optimizers.SGD(0.1)

    def build(self, input_shape):
        self.out.build((None, 28 * 28))

    def call(self, inputs):
        return self.out(self.flat(keras3.ops.cast(inputs, "float32") / 255.0))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        if self.how in ("once", "assign", "twice"):
            self.optimizer.apply(grads, self.trainable_variables)
        if self.how == "twice":  # the kernel, then the bias: two updates
            self.optimizer.apply(grads[:1], self.trainable_variables[:1])
        if self.how == "other":  # a GAN's two optimizers, each on its part
            self.optimizer.apply(grads[:1], self.trainable_variables[:1])
            self.other.apply(grads[1:], self.trainable_variables[1:])
        if self.how == "cond" and loss > 0:  # autograph: tf.cond
            self.optimizer.apply(grads, self.trainable_variables)
        if self.how == "assign":  # WGAN's weight clipping
            for variable in self.trainable_variables:
                variable.assign(keras3.ops.clip(variable, -0.01, 0.01))
        return {"loss": loss}


class _Refused(Mnist):
    how = "once"
    params = Mnist.Params(keras="keras")

    def build_model(self):
        model = type(f"Steps_{self.how}", (_Steps,), {"how": self.how})()
        model.build((None, 28, 28, 1))
        return model

    def optimizer(self, learning_rate):
        if self.how == "scaled":
            return keras3.optimizers.LossScaleOptimizer(keras3.optimizers.SGD(learning_rate))
        return None


STEP = "ps.mode = sync {what}, and the train_step of Steps_{how} (task _Refused) "
ONE_UPDATE = "averages one optimizer update per step over the workers"
USE = "; use ps.mode = async or MultiWorkerMirrored"


@pytest.mark.parametrize("how, message", [
    ("twice", STEP.format(what=ONE_UPDATE, how="twice")
     + "applies 2 times the model's optimizer (model.optimizer)" + USE),
    ("never", STEP.format(what=ONE_UPDATE, how="never")
     + "never applies the model's optimizer (model.optimizer)" + USE),
    ("other", STEP.format(what="defers the update of the model's optimizer to the chief",
                          how="other") + "applies another optimizer too (SGD)" + USE),
    ("cond", STEP.format(what=ONE_UPDATE, how="cond")
     + "applies the model's optimizer inside a conditional or a loop on a tensor (tf.cond, "
       "tf.while_loop, or autograph's if and for)" + USE),
    ("assign", STEP.format(what="updates the trainable variables on the chief only",
                           how="assign")
     + "writes steps/scores/bias, steps/scores/kernel itself (assign, assign_add, ...)"
     + USE),
    ("scaled", "ps.mode = sync averages the workers' gradients before one update, and task "
               "_Refused's LossScaleOptimizer skips or applies each update by its gradients' "
               "values (dynamic loss scaling); use its inner optimizer, with train.precision "
               "= float32 or mixed_bfloat16, or use ps.mode = async"),
])
def test_a_step_whose_update_cannot_be_deferred_is_refused_by_name(
        ps_strategy, ps_cluster, tmp_path, how, message):
    task = type("_Refused", (_Refused,), {"how": how}).from_arrays(
        tiny_split(60), None, tiny_split(10), _Refused.params)
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(_config("train.epochs=1", "task.keras=keras"), tmp_path,
                    strategy=ps_strategy, cluster=ps_cluster, task=task)
    assert str(e.value) == message
    assert not (tmp_path / "checkpoints").exists()


def test_the_same_step_applied_once_trains(ps_strategy, ps_cluster, tmp_path):
    task = _Refused.from_arrays(tiny_split(60), None, tiny_split(10), _Refused.params)
    metrics = trainer.run(_config("train.epochs=1", "task.keras=keras"), tmp_path,
                          strategy=ps_strategy, cluster=ps_cluster, task=task)
    assert sum(metrics["contributions"]) == 2 * (60 // 16)


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras"])
def test_float16_pushes_send_and_hold_each_gradient_as_float16(
        ps_strategy, ps_cluster, tmp_path, keras_name):
    config = _config("train.epochs=1", "ps.compression=fp16", f"task.keras={keras_name}")
    runner = runners.create(config, ps_cluster, ps_strategy)
    task = tiny_task(config)
    runner.build(task, lambda dialect: dialect.optimizer("sgd", 0.1, config.sync, config.ps))
    slots = [slot for _, slot in runner.training.exchange.deposited]
    assert slots and all(slot.dtype == tf.float16 for slot in slots)
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster, task=task)
    assert metrics["test_accuracy"] > 0.3


# -- reading by index: every example once per epoch -----------------------------------------

COUNTED = 64


class _Lazy:
    """A variable found when read (the run that makes it starts after the test patches)."""

    def __init__(self, get):
        self.get = get

    def read_value(self):
        return self.get().read_value()


class Counts(keras3.layers.Layer):
    """A trainable count per example: the loss makes each update add 1 to the counts of
    the examples it trained on (gradient -1 / batch, SGD at the global batch), so only
    contributions an update took count."""

    def build(self, input_shape):
        self.counts = self.add_weight(shape=(COUNTED,), initializer="zeros", name="counts")

    def call(self, ids):
        return -keras3.ops.take(self.counts, ids)[:, None]


class _Counted(Task):
    """Examples 0 .. 63 by index, each its own feature."""

    def build_model(self):
        ids = keras3.Input((), dtype="int64")
        return keras3.Model(ids, Counts(name="counts")(ids))

    def train_source(self):
        return indexed.Source(COUNTED, read=lambda loaded, ids: (ids, tf.zeros_like(ids)))

    def train_dataset(self, context, global_batch_size):
        ids = tf.data.Dataset.range(COUNTED).shard(context.num_input_pipelines,
                                                   context.input_pipeline_id)
        return (ids.map(lambda i: (i, tf.zeros_like(i))).repeat()
                .batch(context.get_per_replica_batch_size(global_batch_size)))

    def eval_dataset(self, split, batch_size):
        ids = tf.data.Dataset.range(8)
        return ids.map(lambda i: (i, tf.zeros_like(i))).batch(8) if split == "test" else None

    def train_examples(self):
        return COUNTED

    def loss(self):
        return lambda labels, predictions: predictions[:, 0]

    def metrics(self):
        return []

    def optimizer(self, learning_rate):
        return keras3.optimizers.SGD(8.0)  # the global batch: each update adds 1 per example


@pytest.mark.parametrize("by_index, backup_workers", [("true", 1), ("true", 0), ("false", 1)])
def test_read_by_index_every_example_trains_once_per_epoch(
        ps_strategy, ps_cluster, tmp_path, monkeypatch, by_index, backup_workers):
    """With a backup worker and a straggler whose contributions are all dropped, the
    dropped parts are handed out again: every example trains once per epoch. Read from
    the workers' pipelines, the straggler's shard is never trained."""
    trainings = []

    class Recorded(sync_ps.SyncTraining):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainings.append(self)

    monkeypatch.setattr(sync_ps, "SyncTraining", Recorded)
    exchange = _Lazy(lambda: trainings[-1].exchange)
    late = _late(_Lazy(lambda: exchange.get().version), final=16,
                 draining=_Lazy(lambda: exchange.get().draining))
    monkeypatch.setattr(sync_ps, "straggle", late if backup_workers else sync_ps.straggle)
    config = _config("train.epochs=2", "train.global_batch_size=8", "eval.batch_size=8",
                     f"ps.backup_workers={backup_workers}", f"data.by_index={by_index}",
                     *(["debug.slow_worker=1"] if backup_workers else []))
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                          task=_Counted())
    counts = trainings[-1].model.get_layer("counts").counts.numpy()
    assert metrics["steps"] == 2 * COUNTED // 8
    if by_index == "true":
        assert metrics["input"] == "by_index" and metrics["input_guarantee"] == "exactly_once"
        np.testing.assert_array_equal(counts, np.full(COUNTED, 2.0))
    else:  # worker 1's shard: the odd examples
        assert metrics["input"] == "pipeline"
        assert not counts[1::2].any() and counts.sum() == 2 * COUNTED
    if backup_workers:
        assert metrics["contributions"][1] == 0 and metrics["pushed"][1] >= 1


# -- the slots' memory: dense, one per worker ------------------------------------------------

ROWS = 4 << 20  # a table of 4M rows x 16 float32: 256 MiB


class _Table(Task):
    """A large embedding table: its slots (2 workers' dense gradients) do not fit 1 GiB."""

    def build_model(self):
        ids = keras3.Input((), dtype="int64")
        return keras3.Model(ids, keras3.layers.Embedding(ROWS, 16, name="table")(ids))

    def train_dataset(self, context, global_batch_size):
        ids = tf.data.Dataset.range(64).map(lambda i: (i, tf.zeros([16])))
        return ids.repeat().batch(context.get_per_replica_batch_size(global_batch_size))

    def eval_dataset(self, split, batch_size):
        return None

    def train_examples(self):
        return 64

    def loss(self):
        return "mse"

    def metrics(self):
        return []

    def optimizer(self, learning_rate):
        return keras3.optimizers.SGD(0.1)


def test_slots_that_would_not_fit_the_memory_limit_are_refused_before_training(
        ps_strategy, ps_cluster, tmp_path, caplog):
    config = _config("runtime.memory_limit_gib=1", "train.epochs=1")
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster, task=_Table())
    message = str(e.value)
    assert message.startswith("ps.mode = sync needs ") and "\n" not in message
    assert ("gradient slots on ps:" in message and "(2 workers' dense copies" in message
            and "over runtime.memory_limit_gib = 1 GiB" in message)
    # Sharded over both ps tasks (ps.partitioner = "min_size"): the log says what it costs.
    warned = [r.getMessage() for r in caplog.records if "(sharded over 2 ps tasks)" in
              r.getMessage()]
    assert len(warned) == 1 and "table" in warned[0]
    assert "2 workers' slots of 256.0 MiB" in warned[0]


def _polls_until(ready_at: float, took, poll_s: float = 0.001) -> tuple[int, float]:
    """(polls, how late the last one was) of the chief's wait for an update ready
    `ready_at` s after it began, on a clock that moves only by its pauses."""
    now, polls = 0.0, 0
    while True:
        polls += 1
        if now >= ready_at:
            return polls, now - ready_at
        now += sync_ps.poll_pause(took, now, poll_s)


def test_the_chief_polls_every_poll_s_until_it_knows_how_long_an_update_waits():
    polls, late = _polls_until(0.05, [])
    assert polls > 40 and late < 0.001


def test_a_wait_as_long_as_the_recent_ones_takes_a_dozen_polls_and_ends_as_soon():
    polls, late = _polls_until(0.4, [0.4, 0.5, 0.45])
    assert polls <= 12 and late < 0.001
    assert _polls_until(0.6, [0.4])[1] < 0.001  # a longer one: polls every poll_s at its end


def test_after_waits_grow_shorter_the_chief_is_late_once_by_at_most_half_the_shortest():
    took = collections.deque([0.4] * 8, maxlen=8)
    lates = []
    for _ in range(4):
        polls, late = _polls_until(0.15, took)
        took.append(0.15 + late)
        lates.append(late)
    assert lates[0] <= 0.2 and max(lates[1:]) < 0.001
