"""`python -m app.train`: train a Keras model under the strategy TF_CONFIG implies.

This file is intentionally short: it parses the command line, loads the
config, reads the cluster, dispatches on this task's role and calls
`trainer.run`, where the work is done and tested.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import json
import logging
import os
import pathlib
import sys
import traceback
import typing

# Before TensorFlow is imported: its C++ INFO lines would bury the progress bar.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from app import config as cfg  # noqa: E402
from app.cluster import chief_failure, memory  # noqa: E402
from app.cluster import tf_config as clusters  # noqa: E402
from app.state import workdir as workdirs  # noqa: E402

log = logging.getLogger("app")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="TOML file of overrides, e.g. configs/mnist.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field, e.g. --set train.epochs=1 "
                             "(repeatable; the last one wins)")
    parser.add_argument("--workdir", type=pathlib.Path,
                        help="where checkpoints, logs, export and metrics.json go "
                             "(default: runs/<timestamp>)")
    parser.add_argument("--strategy", help="same as --set runtime.strategy=NAME: auto, default, "
                        "mirrored, multi_worker_mirrored or parameter_server")
    return parser.parse_args(argv)


def check_strategy(name: str | None) -> None:
    """`--strategy NAME`, refused in the words the user typed (it sets runtime.strategy,
    whose own check would name the field instead)."""
    names = cfg.choices(cfg.RuntimeConfig, "strategy")
    if name is not None and name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        raise cfg.ConfigError(f"--strategy {name!r} is not one of {', '.join(names)}"
                              + (f"; did you mean --strategy {close[0]}?" if close else ""))


def setup_logging(label: str) -> None:
    """Our INFO lines, prefixed with the task; other libraries' at WARNING and up."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{label}] %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    log.setLevel(logging.INFO)
    # TensorFlow gives its logger a handler of its own when it starts before the root
    # logger has one (`make local-cluster` starts its servers first, launch.inprocess),
    # and the logger passes its records on to the root's too: each of its warnings
    # printed twice. Through the root's alone, once, with the task's label.
    tensorflow_log = logging.getLogger("tensorflow")
    for own in list(tensorflow_log.handlers):
        tensorflow_log.removeHandler(own)
    tensorflow_log.addFilter(_by_design_retracing)


def _by_design_retracing(record: logging.LogRecord) -> bool:
    """False for TensorFlow's retracing warning about its own checkpoint reader and
    writer. `MultiDeviceSaver.save` and `.restore` trace a new function on every call
    whose variables live on several tasks, by design (TF 2.21 functional_saver.py:
    "the retrace is needed"), so from the fifth checkpoint of a parameter-server run
    on TensorFlow warned of "excessive" retracing and told the user to move a
    tf.function out of a loop that is its own."""
    message = record.getMessage()
    return not ("retracing" in message and "MultiDeviceSaver." in message)


def role(cluster: clusters.Cluster | None) -> str:
    """What this task does; the one place that decides it.

    "evaluate": the evaluator, SidecarEvaluator on the chief's checkpoints;
    "serve": a ps or worker of a parameter-server cluster, a TF server the chief drives;
    "train": everyone else (no cluster, the chief, synchronous workers) runs model.fit.
    """
    if cluster and cluster.task_type == "evaluator":
        return "evaluate"
    if cluster and cluster.num_ps and cluster.task_type in ("ps", "worker"):
        return "serve"
    return "train"


def exit_now(code: int) -> typing.NoReturn:
    """End a task at once (os._exit), its streams flushed.

    Its TF server cannot be stopped, and at the interpreter's exit the server's
    threads can hold the process up: a ps that had served a chief killed
    earlier outlived "the chief has finished" by more than 15 s, until SIGTERM.
    A serving task has nothing left to save.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def limit_memory(runtime: cfg.RuntimeConfig, label: str) -> None:
    """`runtime.memory_limit_gib` on this process, before TensorFlow's allocator takes
    any memory: the limit holds from there, and an allocation it refuses ends the task
    with the named error wherever it fails (`memory.catch_failed_allocations`)."""
    if runtime.memory_limit_gib:
        memory.follow_threads(runtime.memory_limit_gib)
        memory.catch_failed_allocations(label, runtime.memory_limit_gib)
        log.info("memory limit %g GiB (RLIMIT_DATA, beside the address space of the "
                 "threads' stacks)", runtime.memory_limit_gib)


def pooled_allocator(runtime: cfg.RuntimeConfig, cluster: clusters.Cluster | None) -> bool:
    """Whether this task may use a pooling CPU allocator (BFC: TensorFlow's, or
    oneDNN's), as `runtime.cpu_allocator` and `runtime.onednn` ask.

    Not a ps task under a memory limit: a BFC pool grows by regions of twice
    the last, allocated whole, and RLIMIT_DATA counts what is allocated, not what
    is touched. A ps holding 1.5 GiB of tables and slots under a 2 GiB limit
    had 2.2 GiB allocated and died in gRPC (a segfault, not the named error)
    when the next region did not fit. With malloc, what a ps allocates is what
    it holds; a ps gathers and scatters rows, which oneDNN does not speed up."""
    return not (runtime.memory_limit_gib and cluster and cluster.task_type == "ps")


def serve(cluster: clusters.Cluster, config: cfg.Config,
          workdir: pathlib.Path | None) -> typing.NoReturn:
    """A ps or worker task of a parameter-server cluster: serve the chief, then exit
    (0 once the chief has finished: it said so, or `workdir` holds the finished run)."""
    # TensorFlow starts here, after all checks.
    from app.cluster import preemption, serving

    stopping = preemption.outlive_the_chief()  # SIGTERM: until the chief has gone
    # Returns once the chief has finished; raises TaskLost (a chief that does not
    # come back) or Preempted (SIGTERM), exit codes schedulers retry.
    try:
        serving.serve(cluster, config.runtime,
                               wait_s=config.cluster.connect_timeout_s, stopping=stopping,
                               finished=lambda: workdir is not None and workdirs.finished(workdir))
    except clusters.TaskLost as e:
        print(f"error: {e}", file=sys.stderr)
        exit_now(e.exit_code)
    # The chief records its own in metrics.json (peak_rss_mib).
    log.info("peak resident memory %.1f MiB", memory.peak_rss_bytes() / 2**20)
    exit_now(0)


def lost(cluster: clusters.Cluster | None, code: int) -> int:
    """`code`, the exit code of a `TaskLost` (203) or `Preempted` (204) handled
    already; a task that would not exit cleanly with it exits with it at once.

    A parameter-server chief that lost a ps went on, at the interpreter's exit,
    calling it for seconds (and the ps restarted on its port: "Unable to find a
    context_id ... Perhaps the worker was restarted"), the coordinator's threads
    still running: in a full `make test` on a loaded machine one such chief
    printed its error and no exit with 203 followed, as the chief whose ps ran out
    of memory segfaulted there (main, below).

    A MultiWorkerMirrored worker preempted (its backup saved with the others') or
    that lost a peer: at the interpreter's exit TensorFlow's coordination service
    waits for peers that have left already. In a fresh-clone `make test`, worker 0
    printed "preempted ... backup saved", worker 1 exited with 204, and worker 0
    was still there 30 s later, when the launcher killed it (-9).

    Garbage is collected first, as at a normal exit: a summary writer deleted
    flushes TensorBoard's events.
    """
    ps_chief = chief_failure.applies(cluster) and code == clusters.TaskLost.exit_code
    synchronous_worker = bool(cluster and cluster.is_multi_task and not cluster.num_ps)
    if not (ps_chief or synchronous_worker):
        return code
    gc.collect()
    exit_now(code)


def failed(cluster: clusters.Cluster | None, config: cfg.Config | None, code: int,
           reason: str) -> int:
    """`code`, once a parameter-server chief has told its ps and worker tasks that it
    failed for good, so that they stop too instead of waiting for it
    (app/cluster/chief_failure.py)."""
    wait_s = (config or cfg.Config()).cluster.connect_timeout_s
    chief_failure.tell(cluster, code, reason, wait_s)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = args.set + ([f"runtime.strategy={args.strategy}"] if args.strategy else [])
    label, cluster, config, lost_code = "local", None, None, 0
    try:
        check_strategy(args.strategy)
        config = cfg.load(args.config, overrides)
        cluster = clusters.read()
        pool = pooled_allocator(config.runtime, cluster)
        # Read once, when TensorFlow starts (below, after all checks).
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if config.runtime.onednn and pool else "0"
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = (
            "true" if config.runtime.cpu_allocator == "bfc" and pool else "false")
        label = cluster.label if cluster else "local"
        setup_logging(label)
        limit_memory(config.runtime, label)
        task = role(cluster)
        if task == "train":
            clusters.check_strategy(config.runtime.strategy, cluster)
        if task == "evaluate":
            if args.workdir is None:
                raise cfg.ConfigError(
                    "the evaluator task needs --workdir: the chief's workdir, whose "
                    "checkpoints it evaluates (a directory both can reach)")
            from app import strategy  # TensorFlow starts here, after all checks.
            from app.planning import memory as plan_memory
            from app.run import evaluator

            # Its thread pools, as every task's, before its first op (the memory check's).
            strategy.configure_runtime(config.runtime)
            plan_memory.check_evaluator(config)  # before the evaluator builds its model
            section = evaluator.run(config, args.workdir)
            print(f"eval: {json.dumps({k: v for k, v in section.items() if k != 'evaluations'})}")
            return 0
        if task == "serve":
            serve(cluster, config, args.workdir)
        workdir = args.workdir or workdirs.default_path()
        workdirs.refuse_finished(workdir)  # at once: a chief's ps and workers wait for it
        from app import task as tasks  # TensorFlow starts here (and the task's own code).

        task, config = tasks.create(config)
        workdirs.check(workdir, config)  # before connecting; written once all is checked
        log.info("workdir %s", workdir)

        from app import strategy, trainer

        strategy.configure_runtime(config.runtime)
        metrics = trainer.run(config, workdir, task=task, cluster=cluster, prepare=True)
    except cfg.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return failed(cluster, config, 2, str(e))
    except clusters.TaskLost as e:
        print(f"error: {e}", file=sys.stderr)
        lost_code = e.exit_code  # left outside this block: its traceback holds the run
    except workdirs.ExportFailed as e:
        # The run finished (its ps and worker tasks were told so) but for the export.
        print(trainer.summary_line(e.metrics))
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if not memory.is_out_of_memory(e):
            if not chief_failure.applies(cluster):
                raise
            traceback.print_exc()  # as Python would, before the chief tells its tasks
            return failed(cluster, config, 1, f"{type(e).__name__}: {e}")
        print(f"error: {memory.message(e, label, config.runtime.memory_limit_gib)}",
              file=sys.stderr)
        # At once: a chief whose ps ran out returned from here into a segfault (-11)
        # at the interpreter's exit, its cluster's threads still running.
        exit_now(memory.EXIT_CODE)
    if lost_code:
        return lost(cluster, lost_code)
    print(trainer.summary_line(metrics))
    if chief_failure.applies(cluster):
        # At once: its ps and worker tasks were told it finished. A coordinator that
        # recovered a worker was left, at the interpreter's exit, in its __del__
        # waiting for a lock its preemption thread (a daemon, stopped) held: the
        # chief never exited (seen with the project's own loop, a worker SIGKILLed).
        exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
