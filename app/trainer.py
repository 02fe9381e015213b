"""Training: a task, a runner for the strategy, fit, exact evaluation, export, report.

`run` is what `python -m app.train` calls; tests call it with an injected
strategy and a small task, so no cluster and no files outside the workdir.
It reads as the same short sequence whatever the strategy: everything that
differs lives in the runner (`app.run.runners`).
"""

from __future__ import annotations

import logging
import pathlib
import resource
import time
from typing import Any

import tensorflow as tf

from app import data, dialects, indexed
from app import task as tasks
from app.cluster import memory
from app.config import Config, ConfigError
from app.distribute import data_service
from app.run import callbacks, determinism, optimizers, runners
from app.state import workdir as workdirs
from app.state.workdir import METRICS_FILE, ExportFailed, resume_shape, storage_error, write_json
from app.task import Task
from app.units import human_size

log = logging.getLogger(__name__)


def run(config: Config, workdir: pathlib.Path, *,
        strategy: tf.distribute.Strategy | None = None, task: Task | None = None,
        cluster=None, prepare: bool = False) -> dict[str, Any]:
    """Train as `config` says; write checkpoints, logs, export and metrics.json to `workdir`.

    `prepare`: first create `workdir` and write config.toml there (`workdir.prepare`,
    as `python -m app.train` does), once the strategy and every setting of the run
    have been checked, so that a mistake leaves nothing written.
    """
    if task is None:
        task, config = tasks.create(config)
    runner = runners.create(config, cluster, strategy)
    runner.check()  # before anything is written
    if prepare:
        workdirs.prepare(pathlib.Path(workdir), config)
    steps_per_epoch = _steps_per_epoch(config, task)
    # Keras' dtype policy is global; it applies to every layer built during the run.
    restore_precision = dialects.set_precision(config.train.precision)
    data.use_storage(workdir)  # large in-memory arrays go through files there
    try:
        # Before the backup is restored: a run it cannot resume under is refused untouched.
        resume_shape(pathlib.Path(workdir), runner.shape, runner.writes)
        # Before the model is built (its random layers pick their generators then).
        with runner.guard(pathlib.Path(workdir)), determinism.scope(config.train.deterministic):
            return _train(config, pathlib.Path(workdir), task, runner, steps_per_epoch)
    except (OSError, tf.errors.OpError) as e:
        # A full or read-only workdir mid-run: one line that names it, exit code 2.
        raise storage_error(e, pathlib.Path(workdir)) or e from None
    finally:
        restore_precision()
        data.use_storage(None)


def _train(config: Config, workdir: pathlib.Path, task: Task, runner: runners.SingleHost,
           steps_per_epoch: int) -> dict[str, Any]:
    start = time.perf_counter()
    dialects.set_random_seed(config.train.seed)
    log.info("%s: %d replica(s), task %s, %d steps per epoch", runner.name, runner.num_replicas,
             config.task.name, steps_per_epoch)
    reading = _input(config, task, runner, steps_per_epoch)
    model = runner.build(
        task, lambda dialect: optimizers.optimizer(config, task, steps_per_epoch, dialect))
    for line in runner.report():
        log.info("%s", line)
    evaluate = runner.evaluator(model, task)
    test_ds = data.exact(task.eval_dataset("test", config.eval.batch_size))
    throughput = callbacks.Throughput(config.train.global_batch_size,
                                      coordinator=runner.batches_scheduled_on)
    outdir = runner.outdir(workdir)
    run_callbacks = callbacks.for_training(
        config, workdir, outdir, model, throughput, _evaluations(config, task, evaluate, test_ds),
        resumable=runner.resumable, dialect=runner.dialect)
    train_fn = runner.train_fn(task)
    if config.data.service:
        train_fn = data_service.Reader(config.data.service, str(workdir.resolve()),
                                       config.task.name,
                                       config.cluster.connect_timeout_s).wrap(train_fn)
    history = runner.fit(model, train_fn, run_callbacks, steps_per_epoch, workdir)
    test = evaluate(test_ds)
    export_failure = _export(runner, task, model, outdir, workdir)
    metrics = {**_common(config, task, runner, history, model, test, throughput,
                         earlier=callbacks.earlier_history(run_callbacks)),
               "keras": runner.dialect.NAME, **reading,
               "wall_seconds": round(time.perf_counter() - start, 2),
               **runner.metrics(model), **task.report(model, test)}
    if export_failure:
        metrics["export_error"] = export_failure
    if runner.writes:
        write_json(workdir / METRICS_FILE, metrics)  # the evaluator may be waiting for it
    runner.finish(outdir, workdir)
    if export_failure:
        raise ExportFailed(
            f"the export failed ({export_failure}); the run trained and wrote metrics.json, "
            "its checkpoints and, in Keras 3, model.keras: docs/troubleshooting.md says how "
            f"to export from them (exit code {ExportFailed.exit_code})", metrics)
    return metrics


def _export(runner: runners.SingleHost, task: Task, model, outdir: pathlib.Path,
            workdir: pathlib.Path) -> str | None:
    """Export the trained model (each file whole or absent); what went wrong, in one
    line, if it could not be. A trained run is not lost to its export: the caller
    writes metrics.json either way. A full or read-only workdir is raised as such."""
    try:
        runner.dialect.export(task.serving_model(runner.serving(model)), outdir)
    except Exception as e:  # noqa: BLE001 - a model Keras trains may still fail to export
        if storage_error(e, workdir) is not None:
            raise
        log.debug("the export failed", exc_info=True)
        first_line = (str(e).strip().splitlines() or [""])[0]
        log.warning("the export failed: %s: %s", type(e).__name__, first_line)
        return f"{type(e).__name__}: {first_line}"
    return None


# How the run reads its training examples, and what that keeps across failures and
# resumes: metrics.json's `input` and `input_guarantee`.
BY_INDEX = {"input": "by_index", "input_guarantee": "exactly_once"}
# Under parameter servers, a closure the coordinator runs again after its worker died
# (train.steps_per_execution steps) may have had updates of its steps applied already:
# at one step a closure, about 4 worker deaths in 10 here (docs/data_service.md, "Read
# by index").
BY_INDEX_PS = {"input": "by_index", "input_guarantee": "exactly_once_but_rerun_steps"}
PIPELINE = {"input": "pipeline", "input_guarantee": "none"}
SERVICE = {"input": "data_service", "input_guarantee": "at_most_once"}


def _input(config: Config, task: Task, runner: runners.SingleHost,
           steps_per_epoch: int) -> dict[str, str]:
    """Read the task's examples by index when it gives them so and the run can; log
    which guarantee the run has."""
    source = task.train_source()
    if config.data.service:
        log.info("input: the tf.data service; each example at most once per epoch, those "
                 "in flight at a failure lost%s",
                 " (the task's examples by index are not read through the service)"
                 if source else "")
        return SERVICE
    if source is None or not config.data.by_index:
        why = (f"task {config.task.name} gives only train_dataset" if source is None
               else "data.by_index = false")
        log.info("input: a pipeline (%s); a failure or a resume re-reads or skips examples "
                 "(docs/tasks.md: Task.train_source)", why)
        return PIPELINE
    order = _order(config, source, steps_per_epoch)
    runner.read_by_index(source, order)
    reruns = runner.reruns_applied_steps
    log.info("input: by index, %d examples%s, in an order of (train.seed, epoch): %s; every "
             "example once per epoch across failures and resumes%s", source.size,
             f" from files of {human_size(source.stored_bytes)}"
             if source.stored_bytes else "", order.describe(),
             ", but for the steps of a closure run again after its worker died, which "
             "may have been applied already" if reruns else "")
    if source.stored_bytes and order.shard and runner.reads_ahead:
        _check_window(config, source, order)
    if config.data.shard_policy != "auto":
        log.warning("data.shard_policy = %s does not apply to examples read by index: each "
                    "input pipeline takes its part of every global batch (data.by_index = "
                    "false reads the task's train_dataset, where it applies)",
                    config.data.shard_policy)
    return BY_INDEX_PS if reruns else BY_INDEX


def _order(config: Config, source: indexed.Source, steps_per_epoch: int) -> indexed.Order:
    """The order of data.order: windowed for examples read from files, unless asked."""
    windowed = config.data.order == "windowed" or (config.data.order == "auto"
                                                   and source.span is not None)
    return indexed.Order(source.size, config.train.global_batch_size, steps_per_epoch,
                         config.train.seed,
                         shard=config.data.shard_examples if windowed else 0,
                         window=config.data.window_shards if windowed else 0)


# Windows of records a reader holds at once (indexed.dataset): the one its batches are
# taken from and the one read ahead. Measured: peak resident memory grew by 1.9 times a
# window's bytes from windows of 2 shards to 8 (817 to 1007 MiB, 16 KiB records).
WINDOWS_HELD = 2


def _check_window(config: Config, source: indexed.Source, order: indexed.Order) -> None:
    """Refuse a window of records that would not fit in runtime.memory_limit_gib beside
    what a task holds anyway; warn when it would take more than half of it."""
    held = WINDOWS_HELD * order.window_examples * source.stored_bytes / source.size
    limit = config.runtime.memory_limit_gib * memory.GIB
    what = (f"data.window_shards = {order.window} windows of {order.window_examples} examples "
            f"(data.shard_examples = {order.shard}) hold about {human_size(held)} of "
            f"records, {WINDOWS_HELD} windows at a time")
    if limit and held > limit - memory.BASELINE_BYTES:
        raise ConfigError(f"{what}: more than runtime.memory_limit_gib = "
                          f"{config.runtime.memory_limit_gib:g} GiB allows beside the "
                          f"{human_size(memory.BASELINE_BYTES)} a task holds anyway; "
                          "lower data.window_shards or data.shard_examples")
    if limit and held > limit / 2:
        log.warning("%s: more than half of runtime.memory_limit_gib = %g GiB", what,
                    config.runtime.memory_limit_gib)


def _steps_per_epoch(config: Config, task: Task) -> int:
    """`train.steps_per_epoch`, else one pass over the task's training examples."""
    if config.train.steps_per_epoch:
        return config.train.steps_per_epoch
    examples = task.train_examples()
    if examples is None and (source := task.train_source()) is not None:
        examples = source.size
    if examples is None:
        raise ConfigError(
            f"task {config.task.name} reads training data without end; set "
            "train.steps_per_epoch (e.g. --set train.steps_per_epoch=1000)")
    if examples < config.train.global_batch_size:
        raise ConfigError(
            f"train.global_batch_size ({config.train.global_batch_size}) is larger than the "
            f"training set ({examples} examples); lower it")
    return examples // config.train.global_batch_size


def _evaluations(config: Config, task: Task, evaluate: runners.Evaluate,
                 test_ds: tf.data.Dataset) -> list[callbacks.Evaluation]:
    """Validation after each epoch when the task has a validation split, and the test
    set too with `eval.test_every_epoch`, each exact under every strategy."""
    evaluations = []
    validation = task.eval_dataset("validation", config.eval.batch_size)
    if validation is not None:
        evaluations.append(callbacks.Evaluation(data.exact(validation), evaluate, "val_",
                                                task.metric))
    if config.eval.test_every_epoch:
        evaluations.append(callbacks.Evaluation(test_ds, evaluate, "test_", task.metric))
    return evaluations


def _common(config: Config, task: Task, runner: runners.SingleHost,
            history, model, test: dict[str, float],
            throughput: callbacks.Throughput, earlier: list[dict]) -> dict[str, Any]:
    """The fields metrics.json has for every run; `earlier`: the history rows of the
    epochs an interrupted run finished before this run resumed it."""
    examples_per_sec = throughput.examples_per_sec()
    examples = task.eval_examples("test")
    return {
        "task": config.task.name,
        "metric": f"test_{task.metric}",
        "higher_is_better": task.higher_is_better,
        "strategy": runner.name,
        "num_replicas": runner.num_replicas,
        "num_workers": runner.num_workers,
        "num_ps": runner.num_ps,
        "global_batch_size": config.train.global_batch_size,
        "epochs_completed": history.epoch[-1] + 1 if history.epoch else config.train.epochs,
        "steps": int(model.optimizer.iterations.numpy()),  # the same in both Kerases
        **{f"test_{name}": float(value) for name, value in test.items()},
        **({"num_test_examples": examples} if examples is not None else {}),
        "train_examples_per_sec": examples_per_sec,
        "train_steps_per_sec": round(examples_per_sec / config.train.global_batch_size, 3),
        "precision": config.train.precision,
        "jit_compile": config.train.jit_compile,
        "steps_per_execution": config.train.steps_per_execution,
        "cpu_allocator": config.runtime.cpu_allocator,
        **peak_memory_mib(),
        "history": earlier + _history(history),
    }


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


def summary_line(metrics: dict[str, Any]) -> str:
    """The one-line result printed last: the headline metric first."""
    headline = metrics["metric"]
    examples = (f" ({metrics['num_test_examples']} test examples)"
                if "num_test_examples" in metrics else "")
    return (f"{headline}={metrics[headline]:.4f} test_loss={metrics['test_loss']:.4f}{examples} "
            f"epochs={metrics['epochs_completed']} steps={metrics['steps']} "
            f"strategy={metrics['strategy']} replicas={metrics['num_replicas']} "
            f"workers={metrics['num_workers']} ps={metrics['num_ps']} "
            f"batch={metrics['global_batch_size']} "
            f"train_examples_per_sec={metrics['train_examples_per_sec']:.0f} "
            f"wall_seconds={metrics['wall_seconds']:.1f}")


def _history(history) -> list[dict[str, float]]:
    keys = sorted(history.history)
    return [{"epoch": epoch + 1, **{k: round(float(history.history[k][i]), 6) for k in keys}}
            for i, epoch in enumerate(history.epoch)]
