"""What a sleep inside a tf.function costs: CPU and wall time a sleep of 1 ms, three ways.

    python experiments/sleep_cost.py [--sleeps 500] [--microseconds 1000]

A synchronous run's workers wait for their turn in a loop that sleeps
(`exchange.wait_turn`); TensorFlow has no sleep op but tf.data's testing one, so each
way below sleeps with it, in a `tf.while_loop` of `--sleeps` iterations, timed after a
first run traces it:

- `default`: a new iterator each sleep, over a dataset with tf.data's defaults (how
  `tf_internal.sleep` was made until 2026-12-02);
- `one-shot`: a new iterator each sleep, not autotuned or rewritten (`tf_internal.sleep`);
- `ticks`: one such iterator made before the loop, a `next` each sleep (`tf_internal.ticks`).
"""

from __future__ import annotations

import argparse
import resource
import time

import tensorflow as tf
from tensorflow.python.data.experimental.ops.testing import sleep as transformation

from app import tf_internal


def _default_sleep(microseconds):
    delay = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).apply(
        transformation(microseconds))
    return next(iter(delay))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(way: str, sleeps: int, microseconds: int) -> tuple[float, float]:
    """(CPU µs, wall µs) a sleep, `sleeps` sleeps made `way`."""
    @tf.function
    def loop():
        us = tf.constant(microseconds, tf.int64)
        tick = tf_internal.ticks(us) if way == "ticks" else None
        sleep = {"default": lambda: _default_sleep(us), "one-shot": lambda: tf_internal.sleep(us),
                 "ticks": lambda: next(tick)}[way]
        return tf.while_loop(lambda i: i < sleeps, lambda i: i + 1 + 0 * sleep(),
                             [tf.constant(0, tf.int64)])

    loop()
    cpu, wall = _cpu_s(), time.perf_counter()
    loop()
    return (1e6 * (_cpu_s() - cpu) / sleeps, 1e6 * (time.perf_counter() - wall) / sleeps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sleeps", type=int, default=500)
    parser.add_argument("--microseconds", type=int, default=1000)
    args = parser.parse_args()
    print(f"{args.sleeps} sleeps of {args.microseconds} µs in a tf.while_loop")
    print(f"{'way':<10}{'CPU µs a sleep':>16}{'wall µs a sleep':>17}")
    for way in ("default", "one-shot", "ticks"):
        cpu, wall = measure(way, args.sleeps, args.microseconds)
        print(f"{way:<10}{cpu:>16.0f}{wall:>17.0f}")


if __name__ == "__main__":
    main()
