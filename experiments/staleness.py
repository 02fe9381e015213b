"""What one update of staleness costs in the task's test metric, in one process.

Asynchronous parameter servers with 2 workers apply each worker's gradients to
parameters that the other worker has updated meanwhile: a gradient is computed on
parameters about one update old. This trains the task's model in one process as a
synchronous step would (`--delays 0`) and with every gradient computed on the
parameters of `delay` updates before the one it is applied to, on the same
batches, at the same seeds, with the task's optimizer and learning-rate schedule,
then reports each run's test metric (the task's headline: MNIST's accuracy) on the
whole test set, evaluated as the trainer evaluates it:

    python experiments/staleness.py --set train.global_batch_size=512 --steps 100 \\
        --epochs 1 --seeds 5 --out docs/results/staleness_b512_1epoch.json

No cluster and no timing: what it isolates is staleness itself, which the async
rows of tools.bench have as well as their scheduling's.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _delays(text: str) -> list[int]:
    """--delays: comma-separated whole numbers of updates, from 0."""
    wrong = argparse.ArgumentTypeError(
        f"{text!r}: give whole numbers of updates from 0, e.g. 0,1")
    try:
        delays = [int(d) for d in text.split(",")]
    except ValueError:
        raise wrong from None
    if min(delays) < 0:
        raise wrong
    return delays


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python experiments/staleness.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mnist.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. train.global_batch_size=512")
    parser.add_argument("--steps", type=int, default=100, help="steps an epoch")
    parser.add_argument("--epochs", type=int, default=1,
                        help="epochs over the same --steps batches")
    parser.add_argument("--delays", type=_delays, default=[0, 1],
                        help="comma-separated staleness, in updates, of every gradient")
    parser.add_argument("--seeds", type=int, default=3, help="train.seed 0 .. seeds - 1")
    parser.add_argument("--out", type=pathlib.Path, help="the JSON record to write")
    # Internal: one run in this process, at this delay and seed.
    parser.add_argument("--child", nargs=2, type=int, metavar=("DELAY", "SEED"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def train(args: argparse.Namespace, delay: int, seed: int) -> tuple[str, float]:
    """(the task's test metric's name, its value) after `args.epochs` x `args.steps`
    steps whose gradients are each computed on the parameters of `delay` updates
    before."""
    import tensorflow as tf

    from app import config as cfg
    from app import dialects
    from app import task as tasks
    from app.run import optimizers

    sets = [*args.set, "task.validation_examples=0", f"train.epochs={args.epochs}",
            f"train.seed={seed}"]
    batch = cfg.load(args.config, sets).train.global_batch_size
    task, config = tasks.create(cfg.load(args.config, [
        *sets, f"task.train_examples={args.steps * batch}"]))
    task.keras.utils.set_random_seed(seed)
    model = task.build_model()
    # At delay 0 the gradients are the model's own: a synchronous step, no copies.
    reader = task.build_model() if delay else model
    dialect = dialects.of(model, task)
    optimizer = optimizers.optimizer(config, task, args.steps, dialect)
    loss_fn = task.loss()

    @tf.function
    def gradients(features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, reader(features, training=True))
        return tape.gradient(loss, reader.trainable_variables)

    @tf.function
    def apply(grads):
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    # The parameters of the last `delay` + 1 versions, oldest first.
    versions = collections.deque([model.get_weights()] if delay else [], maxlen=delay + 1)
    batches = iter(task.train_dataset(tf.distribute.InputContext(), batch).repeat())
    for _ in range(args.epochs * args.steps):
        features, labels = next(batches)[:2]
        if delay:
            reader.set_weights(versions[0])
        apply(gradients(features, labels))
        if delay:
            versions.append(model.get_weights())
    # The task's own headline metric, as the trainer evaluates it (the optimizer has done).
    dialect.compile(model, optimizer, task, config.train)
    return (f"test_{task.metric}",
            dialect.evaluate(model, task.eval_dataset("test", 1000))[task.metric])


def child(args: argparse.Namespace, delay: int, seed: int) -> tuple[str, float]:
    """`train` in a process of its own (a fresh TensorFlow for every run)."""
    argv = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps),
            "--epochs", str(args.epochs), "--child", str(delay), str(seed)]
    for item in args.set:
        argv += ["--set", item]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run(argv, env=env, cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(train(args, *args.child)))
        return 0
    if min(args.steps, args.epochs, args.seeds) < 1:
        print("error: --steps, --epochs and --seeds must each be at least 1", file=sys.stderr)
        return 2
    from tools import bench_report

    runs, metric = {}, ""
    for delay in args.delays:
        measured = [child(args, delay, seed) for seed in range(args.seeds)]
        metric, samples = measured[0][0], [round(value, 6) for _, value in measured]
        runs[str(delay)] = {metric: samples, "mean": round(statistics.mean(samples), 5)}
        print(f"delay {delay}: {metric} {samples}", file=sys.stderr)
    record = {
        "command": " ".join(["python experiments/staleness.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.date.today().isoformat(), "machine": bench_report.machine(),
        "steps": args.steps, "epochs": args.epochs, "seeds": list(range(args.seeds)),
        "by_delay": runs,
    }
    if "0" in runs:  # per seed, each delay's metric minus no delay's, in points (x 100)
        record["points_behind_no_delay"] = {
            delay: [round(100 * (a - b), 2) for a, b in zip(
                run[metric], runs["0"][metric], strict=True)]
            for delay, run in runs.items() if delay != "0"}
    bench_report.emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
