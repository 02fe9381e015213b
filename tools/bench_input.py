"""`python -m tools.bench_input`: does a tf.data worker of its own pay for an input-bound task?

MNIST's MLP with `task.preprocess_rounds` of CPU work per training image (a
stand-in for decoding and augmentation). Every process is pinned to one core
with `taskset`, standing for a machine of its own. Measured one after another:

- preprocess: the input pipeline alone on core 0, examples/s;
- train_cached: training alone on core 0, on batches cached in memory;
- trainer_alone: on core 0, the trainer doing both, as without the service;
- with_service: the same trainer on core 0, its input from one tf.data worker
  (and the dispatcher) pinned to core 1.

The trainer's input wait is the time its loop spends in `next()` on the
iterator, as a fraction of its time. The with_service limit is the slower stage's
rate. `--rounds 0` (the default) first measures the two stages and picks the
rounds at which preprocessing costs what training does (equal stage costs).

    python -m tools.bench_input                 # equal stage costs
    python -m tools.bench_input --rounds 8      # a given cost
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

from launch.ports import Ports

TRAINER_CORE, DATA_CORE = "0", "1"
STAGES = ("preprocess", "train_cached", "trainer_alone", "with_service")


def pinned(core: str, *args: str) -> list[str]:
    return ["taskset", "-c", core, sys.executable, "-m", *args]


# -- one stage, in a process of its own -------------------------------------------------


def measure(stage: str, rounds: int, batch: int, seconds: float, service: str) -> dict:
    """Examples/s of `stage` (and the trainer's input wait) over about `seconds`."""
    import tensorflow as tf

    from app.distribute import data_service
    from app.tasks.mnist import Mnist, Params

    task = Mnist(Params(model="mlp", preprocess_rounds=rounds))
    context = tf.distribute.InputContext()
    if stage == "with_service":
        reader = data_service.Reader(service, f"bench-input-{os.getpid()}", "mnist", 60)
        dataset = reader.wrap(functools.partial(task.train_dataset,
                                                global_batch_size=batch))(context)
    else:
        dataset = task.train_dataset(context, batch)
    if stage == "train_cached":
        dataset = dataset.take(20).cache().repeat()
    iterator = iter(dataset)
    step = None if stage == "preprocess" else train_step(task)
    for _ in range(20):  # warm-up: tracing, buffers filled
        batch_ = next(iterator)
        if step:
            step(*batch_)
    steps, waited = 0, 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        before = time.perf_counter()
        batch_ = next(iterator)
        waited += time.perf_counter() - before
        if step:
            step(*batch_)
        steps += 1
    if step:
        float(step.loss)  # the last step done
    elapsed = time.perf_counter() - start
    return {"stage": stage, "rounds": rounds, "examples_per_sec": round(steps * batch / elapsed),
            "input_wait": round(waited / elapsed, 3), "steps": steps}


def train_step(task):
    """One SGD step of the task's model as a tf.function, (images, labels) -> None."""
    import tensorflow as tf
    import tf_keras as keras

    model, loss_fn = task.build_model(), task.loss()
    optimizer = keras.optimizers.Adam(1e-3)

    @tf.function
    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables, strict=True))
        step.loss.assign(loss)

    step.loss = tf.Variable(0.0)
    return step


# -- the bench: every stage, pinned -------------------------------------------------------


def run_stage(stage: str, rounds: int, args: argparse.Namespace, service: str = "") -> dict:
    command = pinned(TRAINER_CORE, "tools.bench_input", "--stage", stage, "--rounds", str(rounds),
                     "--batch", str(args.batch), "--seconds", str(args.seconds),
                     "--service", service)
    done = subprocess.run(command, capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if done.returncode:
        raise RuntimeError(f"stage {stage} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{stage:>14}  rounds {rounds:>3}  {result['examples_per_sec']:>7} examples/s  "
          f"input wait {result['input_wait']:.0%}", flush=True)
    return result


def equal_rounds(args: argparse.Namespace) -> int:
    """The rounds at which preprocessing runs at training's rate: its time per
    example is linear in the rounds, measured at two of them."""
    train = run_stage("train_cached", 0, args)["examples_per_sec"]
    low, high = 2, 10
    cost = {r: 1 / run_stage("preprocess", r, args)["examples_per_sec"] for r in (low, high)}
    per_round = (cost[high] - cost[low]) / (high - low)
    rounds = round(low + (1 / train - cost[low]) / per_round)
    print(f"equal stage costs at {rounds} rounds", flush=True)
    return max(rounds, 1)


@contextlib.contextmanager
def data_service_on(core: str):
    """A dispatcher and one tf.data worker, both pinned to `core`; its address."""
    with Ports() as ports:  # the dispatcher's, held until it has stopped (launch/ports.py)
        port = ports.take()
        address = f"localhost:{port}"
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        processes = [subprocess.Popen(pinned(core, "app.distribute.data_service", "dispatcher",
                                             "--port", str(port)), **quiet)]
        processes.append(subprocess.Popen(pinned(core, "app.distribute.data_service", "worker",
                                                 "--dispatcher", address), **quiet))
        try:
            yield address
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=30)


def bench(args: argparse.Namespace) -> dict:
    rounds = args.rounds or equal_rounds(args)
    results = {stage: run_stage(stage, rounds if stage != "train_cached" else 0, args)
               for stage in STAGES[:3]}
    with data_service_on(DATA_CORE) as address:
        results["with_service"] = run_stage("with_service", rounds, args, address)
    rate = {stage: r["examples_per_sec"] for stage, r in results.items()}
    limit = min(rate["preprocess"], rate["train_cached"])
    summary = {
        "speedup_vs_trainer_alone": round(rate["with_service"] / rate["trainer_alone"], 3),
        "fraction_of_slower_stage": round(rate["with_service"] / limit, 3),
        "stage_cost_ratio": round(rate["train_cached"] / rate["preprocess"], 3),
    }
    print(f"with the service: {summary['speedup_vs_trainer_alone']}x the trainer alone, "
          f"{summary['fraction_of_slower_stage']:.0%} of the slower stage's rate "
          f"({limit} examples/s)", flush=True)
    return {"command": "python -m tools.bench_input " + " ".join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(), "machine": machine(),
            "batch": args.batch, "rounds": rounds, "results": results, **summary}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} cores, {cpu}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_input",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=0,
                        help="task.preprocess_rounds; 0 = equal stage costs, measured")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0, help="per stage")
    parser.add_argument("--out", default="runs/bench_input/bench_input.json")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--service", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage:
        print(json.dumps(measure(args.stage, args.rounds, args.batch, args.seconds,
                                 args.service)))
        return 0
    if (os.cpu_count() or 1) < 2:
        print("error: the bench pins the trainer and the tf.data worker to two cores; this "
              "machine has one", file=sys.stderr)
        return 2
    result = bench(args)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
