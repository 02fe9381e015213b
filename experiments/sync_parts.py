"""The parts of a MultiWorkerMirrored step, timed apart, beside one process's step.

Two MultiWorkerMirrored workers on this machine's 2 cores each compute half the
global batch on one intra-op thread (launch.local gives a task cores / workers),
all-reduce the gradients, and each applies the whole optimizer update to its own
copy of the variables. One process computes the whole batch on TensorFlow's
default threads and applies the update once. This times each part in a process of
its own, as CPU milliseconds a step (`time.process_time`, median of --repeats
blocks of --steps steps after a warm-up), with the project's defaults (oneDNN,
the MNIST task's CNN and Adam, synthetic examples):

- `forward_backward`: the loss and its gradients, as a `tf.function`;
- `update`: the optimizer's update of every variable with those gradients.

    python experiments/sync_parts.py --batch 512 --out docs/results/sync_parts_b512.json

The all-reduce is what experiments/per_step.py counts for the workers beyond
these parts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python experiments/sync_parts.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mnist.toml")
    parser.add_argument("--batch", type=int, default=512, help="the global batch")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps a timed block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks")
    parser.add_argument("--out", type=pathlib.Path, help="the JSON record to write")
    # Internal: time the parts in this process, at this batch and these threads.
    parser.add_argument("--child", nargs=2, type=int, metavar=("BATCH", "THREADS"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _cpu_ms(fn, steps: int, repeats: int) -> float:
    """Median CPU milliseconds of one call of `fn` over `repeats` blocks of `steps`."""
    fn()  # traced and warmed
    blocks = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(steps):
            fn()
        blocks.append((time.process_time() - start) * 1000 / steps)
    return round(statistics.median(blocks), 2)


def time_parts(config_path: str, batch: int, threads: int, steps: int, repeats: int) -> dict:
    """CPU ms a step of each part, in this process, at `batch` on `threads` intra-op
    threads (0: TensorFlow's default)."""
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    from app import config as cfg
    from app import dialects
    from app import task as tasks
    from app.run import optimizers

    task, config = tasks.create(cfg.load(config_path, [
        "task.source=synthetic", f"task.train_examples={batch}",
        "task.validation_examples=0", f"task.test_examples={batch}"]))
    model = task.build_model()
    optimizer = optimizers.optimizer(config, task, 1, dialects.of(model, task))
    loss_fn = task.loss()
    features, labels = next(iter(task.train_dataset(tf.distribute.InputContext(), batch)))[:2]

    @tf.function
    def forward_backward():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True))
        return tape.gradient(loss, model.trainable_variables)

    gradients = forward_backward()

    @tf.function
    def update():
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))

    return {"forward_backward": _cpu_ms(forward_backward, steps, repeats),
            "update": _cpu_ms(update, steps, repeats)}


def child(args: argparse.Namespace, batch: int, threads: int) -> dict:
    """`time_parts` in a process of its own: threads are fixed when TensorFlow starts."""
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run(
        [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps),
         "--repeats", str(args.repeats), "--child", str(batch), str(threads)],
        env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(time_parts(args.config, *args.child, args.steps, args.repeats)))
        return 0
    if args.batch % args.workers:
        print(f"error: --batch {args.batch} does not split over {args.workers} workers",
              file=sys.stderr)
        return 2
    from launch import local
    from tools import bench_report

    one = child(args, args.batch, 0)
    worker = child(args, args.batch // args.workers, local.intra_op_threads(args.workers))
    record = {
        "command": " ".join(["python experiments/sync_parts.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.date.today().isoformat(), "machine": bench_report.machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_ms_per_step": {
            "one_process": {**one, "in_all": round(sum(one.values()), 2)},
            "one_worker": {**worker, "in_all": round(sum(worker.values()), 2)},
            "workers_in_all": round(args.workers * sum(worker.values()), 2)},
    }
    bench_report.emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
