"""Training: build under the strategy, fit, evaluate on the test set, export, report.

`run` is what `python -m app.train` calls; tests call it with an injected
strategy and tiny datasets, so no cluster and no files outside the workdir.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import resource
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras as keras

from app import callbacks, data, models, parameter_server, sync_ps
from app import strategy as strategies
from app.cluster import Cluster, TaskLost, lost_ps
from app.config import Config, ConfigError
from app.workdir import BACKUP_DIR, METRICS_FILE, save_dir, storage_error, write_json

log = logging.getLogger(__name__)


def run(config: Config, workdir: pathlib.Path, *,
        strategy: tf.distribute.Strategy | None = None,
        datasets: data.Datasets | None = None,
        cluster: Cluster | None = None) -> dict[str, Any]:
    """Train as `config` says; write checkpoints, logs, export and metrics.json to `workdir`."""
    # Keras' dtype policy is global; it applies to every layer built during the run.
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(config.train.precision)
    try:
        return _run(config, workdir, strategy, datasets, cluster)
    except tf.errors.UnavailableError as e:
        if not (cluster and cluster.num_ps):
            raise
        # The coordinator stops at the first unreachable ps (its variables are
        # gone); carrying on is impossible, waiting is pointless.
        raise TaskLost(
            f"parameter server {lost_ps(e.message, cluster)} became unreachable; training "
            f"stopped. Restart the whole job (launch.local --max-restarts, or the cluster's "
            f"restart policy): it resumes from {workdir / BACKUP_DIR}") from None
    except (OSError, tf.errors.OpError) as e:
        # A full or read-only workdir mid-run: one line that names it, exit code 2.
        raise storage_error(e, pathlib.Path(workdir)) or e from None
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _run(config: Config, workdir: pathlib.Path, strategy: tf.distribute.Strategy | None,
         datasets: data.Datasets | None, cluster: Cluster | None) -> dict[str, Any]:
    start = time.perf_counter()
    workdir = pathlib.Path(workdir)
    strategy = strategy or strategies.create(config.runtime.strategy, cluster, config)
    coordinated = isinstance(strategy, tf.distribute.ParameterServerStrategy)
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    # Under MultiWorkerMirroredStrategy every worker runs this function and must
    # take part in saving; only the chief writes where the user looks.
    writer = not (multi_worker and cluster) or cluster.is_chief
    outdir = workdir if writer else pathlib.Path(tempfile.mkdtemp(prefix="worker-outputs-"))
    replicas = strategy.num_replicas_in_sync
    strategies.check_batch(config.train.global_batch_size, replicas)
    _check_compression(config, strategy)
    _check_ps_compression(config, strategy)
    sync = _sync_ps(config, strategy)
    straggler = _straggler(config, strategy)
    # In sync mode a global batch is the examples of one update, over `sync` workers.
    worker_batch = (strategies.check_batch(config.train.global_batch_size, sync,
                                           "the workers each update waits for (workers - "
                                           "ps.backup_workers)")
                    if sync else config.train.global_batch_size)
    keras.utils.set_random_seed(config.train.seed)
    datasets = datasets or data.load(config.data, seed=config.train.seed)
    steps_per_epoch = len(datasets.train) // config.train.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"train.global_batch_size ({config.train.global_batch_size}) is larger than the "
            f"training set ({len(datasets.train)} examples); lower it")
    log.info("%s: %d replica(s), %d train / %s validation / %d test examples, "
             "%d steps per epoch", strategies.describe(strategy), replicas, len(datasets.train),
             len(datasets.validation) if datasets.validation else 0, len(datasets.test),
             steps_per_epoch)

    with strategy.scope():
        model = models.build(config.model.name, datasets.image_shape, datasets.num_classes,
                             dropout=config.model.dropout)
        if straggler and not sync:
            model = sync_ps.StragglingModel.wrap(model, straggler)
        model.compile(
            optimizer=_optimizer(config, steps_per_epoch),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=config.train.steps_per_execution,
            jit_compile=config.train.jit_compile,
        )
        model.optimizer.build(model.trainable_variables)  # slots now, for the placement report

    ps_placement = None
    if coordinated:
        ps_placement = parameter_server.placement(
            model.variables + model.optimizer.variables(), strategy._num_ps)
        for line in ps_placement.report():
            log.info("%s", line)
        # Evaluation runs on the chief, on a local copy of the weights: exact (every
        # test image once), where evaluating through the coordinator is not.
        evaluate = _local_evaluator(model, config, datasets)
    else:
        def evaluate(dataset: tf.data.Dataset) -> dict[str, float]:
            return model.evaluate(dataset, verbose=0, return_dict=True)

    test_ds = data.eval_dataset(datasets.test, config.eval.batch_size)
    val_ds = (data.eval_dataset(datasets.validation, config.eval.batch_size)
              if datasets.validation else None)
    evaluations = []
    if coordinated and val_ds is not None:
        evaluations.append(callbacks.Evaluation(val_ds, evaluate, prefix="val_"))
    if config.eval.test_every_epoch:
        evaluations.append(callbacks.Evaluation(test_ds, evaluate, prefix="test_"))
    throughput = callbacks.Throughput(config.train.global_batch_size)
    train_fn = data.train_dataset_fn(
        datasets.train, worker_batch, seed=config.train.seed,
        shuffle_buffer=config.data.shuffle_buffer, augment_shift=config.data.augment_shift,
        shard_policy=config.data.shard_policy)
    if straggler and not sync:  # its train step needs to know which worker reads the batch
        train_fn = sync_ps.with_worker_id(train_fn)  # (sync_ps.fit adds it for sync runs)
    run_callbacks = callbacks.for_training(config, workdir, outdir, model, throughput,
                                           evaluations, resumable=not sync)
    sync_figures = {}
    if sync:
        training = sync_ps.SyncTraining(
            strategy, model, keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="none"),
            num_workers=strategy._num_workers, backup_workers=config.ps.backup_workers,
            straggler=straggler)
        history, sync_figures = sync_ps.fit(training, train_fn, epochs=config.train.epochs,
                                            steps_per_epoch=steps_per_epoch,
                                            callbacks=run_callbacks,
                                            verbose=_verbose(config.train.verbose),
                                            backup=sync_ps.SyncBackup(
                                                training, workdir / BACKUP_DIR,
                                                config.checkpoint.every_steps))
    else:
        history = model.fit(
            keras.utils.experimental.DatasetCreator(
                train_fn, input_options=strategies.input_options(strategy)),
            epochs=config.train.epochs,
            steps_per_epoch=steps_per_epoch,
            validation_data=None if coordinated else val_ds,
            callbacks=run_callbacks,
            verbose=_verbose(config.train.verbose),
        )

    test = evaluate(test_ds)
    examples_per_sec = throughput.examples_per_sec()
    save_dir(outdir / "export", lambda path: (evaluate.local_model if coordinated else model).save(
        path, save_format="tf"))  # whole or absent, never half-written
    if multi_worker:  # the same on every worker, if synchronous training kept its promise
        log.info("weights sha256 %s", weights_digest(model))
    metrics = {
        "strategy": strategies.describe(strategy),
        "num_replicas": replicas,
        "num_workers": _num_workers(strategy, cluster),
        "num_ps": strategy._num_ps if coordinated else 0,
        "global_batch_size": config.train.global_batch_size,
        "epochs_completed": history.epoch[-1] + 1 if history.epoch else config.train.epochs,
        "steps": int(model.optimizer.iterations.numpy()),
        "test_accuracy": float(test["accuracy"]),
        "test_loss": float(test["loss"]),
        "num_test_examples": len(datasets.test),
        "train_examples_per_sec": examples_per_sec,
        "train_steps_per_sec": round(examples_per_sec / config.train.global_batch_size, 3),
        "wall_seconds": round(time.perf_counter() - start, 2),
        "model": config.model.name,
        "dataset": config.data.name,
        "precision": config.train.precision,
        "jit_compile": config.train.jit_compile,
        "steps_per_execution": config.train.steps_per_execution,
        "cpu_allocator": config.runtime.cpu_allocator,
        **peak_memory_mib(),
        "history": callbacks.earlier_history(run_callbacks) + _history(history),
    }
    if ps_placement:
        metrics["ps_bytes"] = ps_placement.ps_bytes
        metrics["ps_balance"] = ps_placement.balance
        metrics["ps_partitioner"] = config.ps.partitioner
        metrics["mode"] = config.ps.mode
        metrics["backup_workers"] = config.ps.backup_workers if sync else 0
        metrics.update(sync_figures)  # contributions, pushed, stale_dropped
    if straggler:
        metrics["slow_worker"], metrics["slow_factor"] = straggler.worker, straggler.factor
    if writer:
        write_json(workdir / METRICS_FILE, metrics)  # the evaluator may be waiting for it
    else:
        shutil.rmtree(outdir, ignore_errors=True)
    return metrics


def _check_compression(config: Config, strategy: tf.distribute.Strategy) -> None:
    if config.sync.compression != "none" and not isinstance(
            strategy, (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)):
        raise ConfigError(
            f"sync.compression = {config.sync.compression} compresses the all-reduce of "
            "MultiWorkerMirrored and Mirrored runs, and this run has none "
            f"({strategies.describe(strategy)}); set it to none")


def _check_ps_compression(config: Config, strategy: tf.distribute.Strategy) -> None:
    if config.ps.compression == "none":
        return
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        raise ConfigError(
            f"ps.compression = {config.ps.compression} compresses the gradients workers push "
            f"to ps tasks, and this run has none ({strategies.describe(strategy)}); set it to none")
    if config.ps.mode != "async":
        raise ConfigError(
            f"ps.compression = {config.ps.compression} applies to ps.mode = async; "
            f"ps.mode = {config.ps.mode} sends its gradients through accumulators in float32. "
            "Set one of them back")


def _sync_ps(config: Config, strategy: tf.distribute.Strategy) -> int:
    """In ps.mode = sync, how many workers' gradients each update waits for; else 0."""
    if config.ps.mode != "sync":
        return 0
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        raise ConfigError(
            "ps.mode = sync is parameter-server training and this run has no ps tasks "
            f"({strategies.describe(strategy)}); give TF_CONFIG chief, worker and ps jobs, "
            "or use ps.mode = async")
    workers, backup = strategy._num_workers, config.ps.backup_workers
    if backup >= workers:
        raise ConfigError(f"ps.backup_workers = {backup} must be less than the number of "
                          f"workers ({workers}): each update needs at least one gradient")
    return workers - backup


def _straggler(config: Config, strategy: tf.distribute.Strategy) -> sync_ps.Straggler | None:
    index = config.debug.slow_worker
    if index < 0:
        return None
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        raise ConfigError(
            f"debug.slow_worker = {index} slows a worker of a parameter-server cluster, and "
            f"this run has none ({strategies.describe(strategy)}); set it to -1")
    if index >= strategy._num_workers:
        raise ConfigError(f"debug.slow_worker = {index} is not a worker of this cluster "
                          f"(0 to {strategy._num_workers - 1})")
    return sync_ps.Straggler(index, config.debug.slow_factor)


def peak_memory_mib() -> dict[str, float]:
    """This process's peak resident memory, TF's peak allocation on CPU:0 where its
    allocator counts one (bfc, or oneDNN's) and, with a GPU, on GPU:0."""
    peaks = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    try:
        peaks["peak_cpu_tensor_mib"] = round(
            tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20, 1)
    except ValueError:  # "Allocator stats not available": malloc, with oneDNN off
        pass
    if tf.config.list_logical_devices("GPU"):
        info = tf.config.experimental.get_memory_info("GPU:0")
        peaks["peak_gpu_mib"] = round(info["peak"] / 2**20, 1)
    return peaks


def weights_digest(model: keras.Model) -> str:
    digest = hashlib.sha256()
    for array in model.get_weights():
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


def _local_evaluator(model: keras.Model, config: Config, datasets: data.Datasets):
    """evaluate(dataset) on a non-distributed copy of `model`, refreshed from the ps tasks.

    Keras' own evaluate() cannot be used on the copy: called from a callback
    inside fit(), it would pick up the ParameterServerStrategy and send the
    work to the workers. A plain forward pass over the dataset is exact anyway.
    """
    # Outside the strategy's scope: its variables live on the chief.
    local = models.build(config.model.name, datasets.image_shape, datasets.num_classes,
                         dropout=config.model.dropout)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    @tf.function
    def sums(images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        logits = local(images, training=False)
        hits = tf.cast(tf.argmax(logits, axis=-1) == tf.cast(labels, tf.int64), tf.float64)
        return tf.cast(loss_fn(labels, logits), tf.float64), tf.reduce_sum(hits)

    def evaluate(dataset: tf.data.Dataset) -> dict[str, float]:
        local.set_weights(parameter_server.gather_weights(model))
        loss = hits = count = 0.0
        for images, labels in dataset:
            batch_loss, batch_hits = sums(images, labels)
            loss += float(batch_loss)
            hits += float(batch_hits)
            count += len(labels)
        return {"loss": loss / count, "accuracy": hits / count}

    evaluate.local_model = local
    return evaluate


def _num_workers(strategy: tf.distribute.Strategy, cluster: Cluster | None) -> int:
    if isinstance(strategy, tf.distribute.ParameterServerStrategy):
        return strategy._num_workers
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and cluster:
        return len(cluster.jobs.get("chief", ())) + cluster.num_workers  # a chief trains too
    return 1


def summary_line(metrics: dict[str, Any]) -> str:
    """The one-line result printed last."""
    return (f"test_accuracy={metrics['test_accuracy']:.4f} test_loss={metrics['test_loss']:.4f} "
            f"({metrics['num_test_examples']} test images) "
            f"epochs={metrics['epochs_completed']} steps={metrics['steps']} "
            f"strategy={metrics['strategy']} replicas={metrics['num_replicas']} "
            f"workers={metrics['num_workers']} ps={metrics['num_ps']} "
            f"batch={metrics['global_batch_size']} "
            f"train_examples_per_sec={metrics['train_examples_per_sec']:.0f} "
            f"wall_seconds={metrics['wall_seconds']:.1f}")


def _optimizer(config: Config, steps_per_epoch: int) -> keras.optimizers.Optimizer:
    lr = learning_rate(config, steps_per_epoch)
    if config.train.optimizer == "adam":
        kind, kwargs = keras.optimizers.Adam, {}
    else:
        kind, kwargs = keras.optimizers.SGD, {"momentum": 0.9}
    if config.sync.compression == "fp16":
        kind = strategies.fp16_all_reduce(kind)
    if config.ps.compression == "fp16":
        kind = strategies.fp16_push(kind)
    return kind(lr, **kwargs)


def learning_rate(config: Config, steps_per_epoch: int
                  ) -> float | keras.optimizers.schedules.LearningRateSchedule:
    """The learning rate, or its schedule over optimizer steps."""
    t = config.train
    if t.lr_schedule == "cosine":
        return keras.optimizers.schedules.CosineDecay(
            t.learning_rate, decay_steps=t.epochs * steps_per_epoch, alpha=t.final_lr_fraction)
    if t.lr_schedule == "cosine_restarts":
        return keras.optimizers.schedules.CosineDecayRestarts(
            t.learning_rate, first_decay_steps=t.lr_cycle_epochs * steps_per_epoch,
            t_mul=1.0, m_mul=t.lr_cycle_decay, alpha=t.final_lr_fraction)
    return t.learning_rate


def _verbose(setting: str) -> str | int:
    return setting if setting == "auto" else int(setting)


def _history(history: keras.callbacks.History) -> list[dict[str, float]]:
    keys = sorted(history.history)
    return [{"epoch": epoch + 1, **{k: round(float(history.history[k][i]), 6) for k in keys}}
            for i, epoch in enumerate(history.epoch)]
