"""What a float16 crossing costs the CPU, beside the bytes it saves
(docs/benchmarks.md, "Several steps per closure").

    python experiments/cast_cost.py                 # the MNIST CNN's variables, 1 thread
    python experiments/cast_cost.py --out docs/results/cast_cost.json

`ps.compression` and `ps.read_compression = "fp16"` cast every pushed gradient and
every read variable to float16 on one side and back on the other. This times, on one
intra-op thread (each task of `launch.local` has one), TensorFlow's `tf.cast` of as
many float32 elements as the MNIST CNN has parameters, both ways and to bfloat16,
beside a copy of the float32 tensor (what a crossing's bytes cost a task to move
through memory once), in nanoseconds per element, the median of `--repeats`.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

import tensorflow as tf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tools import bench_report  # noqa: E402  (run as a script, from any directory)


def per_element_ns(fn, arg, elements: int, calls: int, repeats: int) -> float:
    fn(arg)  # traced once, outside the timing
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(arg)
        out.numpy()
        samples.append((time.perf_counter() - start) / calls / elements * 1e9)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=3_274_634,
                        help="float32 elements (default: the MNIST CNN's parameters)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)  # before the first op runs
    tf.config.threading.set_inter_op_parallelism_threads(1)

    x = tf.random.normal([args.elements])
    # x * 1 writes a new float32 tensor of x's size: one pass through memory, as a copy.
    rows = {"float32 copy": (tf.function(lambda v: v * 1.0), x)}
    for dtype in (tf.float16, tf.bfloat16):
        narrow = tf.cast(x, dtype)
        rows[f"float32 -> {dtype.name}"] = (tf.function(lambda v, d=dtype: tf.cast(v, d)), x)
        rows[f"{dtype.name} -> float32"] = (tf.function(lambda v: tf.cast(v, tf.float32)),
                                            narrow)
    results = {name: round(per_element_ns(fn, arg, args.elements, args.calls, args.repeats), 3)
               for name, (fn, arg) in rows.items()}
    for name, ns in results.items():
        print(f"{name:<22} {ns:6.3f} ns an element")
    if args.out:
        bench_report.emit({"command": " ".join(["python", *sys.argv]),
                           "date": datetime.date.today().isoformat(),
                           "machine": bench_report.machine(), "tensorflow": tf.__version__,
                           "elements": args.elements, "ns_per_element": results},
                          pathlib.Path(args.out))


if __name__ == "__main__":
    main()
