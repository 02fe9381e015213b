"""`python -m tools.bench_records`: training examples read by index from TFRecord files,
measured against what a task would do without it.

    python -m tools.bench_records write  --examples 16384
    python -m tools.bench_records read   --examples 200000 --files 24 --repeats 3
    python -m tools.bench_records bytes  --examples 50000
    python -m tools.bench_records memory --limit-gib 1.5 --sizes 0.5,2,8
    python -m tools.bench_records order  --epochs 3 --repeats 2

The data: `examples` tf.train.Examples of `floats` random floats (4,096: 16 KiB a
record) and a target, in `files` files written by `app.data.write_records`, read by
the `Floats` task below: by index (`data.indexed_records`, the default order for
files: windowed), or by its own `train_dataset`, the usual interleaved
`TFRecordDataset` pipeline over the same files (`data.by_index = false`).

- `write`: seconds to write the same rows with `write_records` and with a
  `tf.train.Example` built per row in Python (what `write_records` did before).
- `read`: examples/s of one process, of chief + 2 workers + 2 ps tasks and of 2
  MultiWorkerMirrored workers, each by index over its own pipeline, the rows
  interleaved over the repeats (`tools.bench.measure`).
- `bytes`: the bytes an epoch reads from the data files and from their indexes,
  counted from every read and pread call of every process of the run, as
  `strace -ff -y` shows them (Debian's strace; the run is slower under it, the
  count exact), over the data's bytes: a run of two epochs' count minus a run of
  one's, which cancels what a run reads as it starts and what it reads ahead of
  its last step. Also the one-epoch run's count alone.
- `memory`: peak resident memory of one process by index, and of each task of a
  parameter-server cluster, under `runtime.memory_limit_gib`, for data sets of each
  size given as a multiple of the limit.
- `order`: what the windowed order costs in accuracy against one permutation of all
  the examples: test accuracy of examples/mnist_png.py (MNIST as PNG records, Keras'
  convnet) after `--epochs`, its files in MNIST's order and sorted by label, one
  run per `train.seed` of `--repeats`.

Each writes its record to --out (JSON, with the command, date and machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from app import data
from app.task import Task, field
from tools import bench, bench_report

TASK = "tools.bench_records:Floats"


@dataclasses.dataclass(frozen=True)
class Params:
    records_dir: str = "runs/bench-records"
    examples: int = field(200000, above=0)
    files: int = field(24, above=0)
    floats: int = field(4096, above=0)
    hidden: int = field(64, above=0)
    # Examples the task's own pipeline shuffles among (its shuffle buffer).
    shuffle_buffer: int = field(8192, above=0)


class Floats(Task):
    """A regression on `floats` random features, its examples in TFRecord files."""

    Params = Params
    metric, higher_is_better = "mae", False

    def build_model(self):
        import keras

        return keras.Sequential([keras.Input((self.params.floats,)),
                                 keras.layers.Dense(self.params.hidden, activation="relu"),
                                 keras.layers.Dense(1)])

    def _files(self) -> list[pathlib.Path]:
        return write(pathlib.Path(self.params.records_dir), self.params.examples,
                     self.params.files, self.params.floats)

    def _spec(self):
        import tensorflow as tf

        return {"x": ([self.params.floats], tf.float32), "y": ([1], tf.float32)}

    def train_source(self):
        return data.indexed_records(self._files(), self._spec(), lambda f: (f["x"], f["y"]))

    def train_dataset(self, context, global_batch_size):
        import tensorflow as tf

        files, by_record = self.shard_files([str(p) for p in self._files()], context)
        examples = data.read_records(files, self._spec()).map(lambda f: (f["x"], f["y"]))
        if by_record:
            examples = self.shard(examples, context)
        return data.batches(examples, context.get_per_replica_batch_size(global_batch_size),
                            seed=self.pipeline_seed(context),
                            shuffle_buffer=self.params.shuffle_buffer).prefetch(tf.data.AUTOTUNE)

    def eval_dataset(self, split, batch_size):
        if split != "test":
            return None
        x, y = rows(np.random.default_rng(10**6), 256, self.params.floats)
        return data.from_arrays(x, y).batch(batch_size)

    def train_examples(self):
        return self.params.examples

    def loss(self):
        import keras

        return keras.losses.MeanSquaredError()

    def metrics(self):
        import keras

        return [keras.metrics.MeanAbsoluteError(name="mae")]


def rows(rng: np.random.Generator, n: int, floats: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(n, floats)).astype(np.float32)
    return x, x[:, :8].mean(axis=1, keepdims=True)


def write(directory: pathlib.Path, examples: int, files: int, floats: int
          ) -> list[pathlib.Path]:
    """The data set, written unless there already; file k from seed k."""
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, examples, files + 1).astype(int)
    paths = []
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        path = directory / f"floats-{examples}x{floats}-{k:05d}-of-{files:05d}.tfrecord"
        if not path.with_name(path.name + ".index").exists():
            x, y = rows(np.random.default_rng(k), hi - lo, floats)
            data.write_records(path, {"x": x, "y": y})
        paths.append(path)
    return paths


def write_per_row(path: pathlib.Path, columns: dict[str, np.ndarray]) -> None:
    """A tf.train.Example built per row in Python: `write_records` before it was
    vectorised, kept here as the reference."""
    import tensorflow as tf

    def feature(values):
        if np.issubdtype(values.dtype, np.integer):
            return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))

    count = len(next(iter(columns.values())))
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(count):
            features = {name: feature(np.ravel(values[i])) for name, values in columns.items()}
            writer.write(tf.train.Example(features=tf.train.Features(
                feature=features)).SerializeToString())


def bench_write(args) -> dict:
    x, y = rows(np.random.default_rng(0), args.examples, args.floats)
    columns = {"x": x, "y": y, "id": np.arange(args.examples)}
    seconds = {}
    with tempfile.TemporaryDirectory(dir=args.records_dir) as tmp:
        for _ in range(args.repeats):
            for name, writer in (("write_records", data.write_records),
                                 ("per_row", write_per_row)):
                start = time.perf_counter()
                writer(pathlib.Path(tmp) / f"{name}.tfrecord", columns)
                seconds.setdefault(name, []).append(time.perf_counter() - start)
        size = (pathlib.Path(tmp) / "write_records.tfrecord").stat().st_size
        same = ((pathlib.Path(tmp) / "write_records.tfrecord").stat().st_size
                == (pathlib.Path(tmp) / "per_row.tfrecord").stat().st_size)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {"bytes": size, "same_size": same, "seconds": seconds,
            "mb_per_sec": {n: round(size / s / 1e6, 1) for n, s in median.items()},
            "speedup": round(median["per_row"] / median["write_records"], 1)}


def _sets(args, *more: str) -> list[str]:
    items = [f"task.name={TASK}", f"task.records_dir={args.records_dir}",
             f"task.examples={args.examples}", f"task.files={args.files}",
             f"task.floats={args.floats}", "train.verbose=0", "eval.test_every_epoch=false",
             f"train.global_batch_size={args.batch}", *args.set, *more]
    return [a for item in items for a in ("--set", item)]


READ_ROWS = {
    "one_pipeline": ((), ("data.by_index=false",)),
    "one_by_index": ((), ()),
    "ps_pipeline": (("--workers", "2", "--ps", "2"), ("data.by_index=false",)),
    "ps_by_index": (("--workers", "2", "--ps", "2"), ()),
    "mwms_pipeline": (("--workers", "2", "--ps", "0"), ("data.by_index=false",)),
    "mwms_by_index": (("--workers", "2", "--ps", "0"), ()),
}


def _command(row: str, args, *more: str) -> list[str]:
    cluster, sets = READ_ROWS[row]
    module = ("-m", "launch.local", *cluster) if cluster else ("-m", "app.train")
    return [*module, *_sets(args, *sets, *more)]


def bench_read(args) -> dict:
    write(pathlib.Path(args.records_dir), args.examples, args.files, args.floats)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, row in enumerate(args.rows):
                steps = [f"train.steps_per_epoch={args.steps}", "train.epochs=1"]
                metrics = bench.measure(_command(row, args, *steps), pathlib.Path(tmp) / f"{r}-{i}")
                runs.setdefault(row, []).append(metrics)
                print(f"  repeat {r + 1}/{args.repeats} {row}: "
                      f"{metrics['train_examples_per_sec']:.0f} examples/s", file=sys.stderr)
    out = {}
    for row, metrics in runs.items():
        out[row] = {"examples_per_sec": statistics.median(m["train_examples_per_sec"]
                                                          for m in metrics),
                    "samples": [m["train_examples_per_sec"] for m in metrics],
                    "input": metrics[0]["input"],
                    "peak_rss_mib_by_task": metrics[0]["peak_rss_mib_by_task"]}
    for row, r in out.items():
        base = row.replace("by_index", "pipeline")
        if base != row and base in out:
            r["ratio_to_pipeline"] = round(r["examples_per_sec"]
                                           / out[base]["examples_per_sec"], 3)
    return out


# A read of strace -ff -y: `pread64(12</data/x.tfrecord>, "..."..., 16436, 0) = 16436`.
_READ = re.compile(r"^(?:pread64|read|preadv|readv)\(\d+<([^>]*)>.*\)\s+=\s+(\d+)$")


def traced_reads(args: list[str], trace: pathlib.Path) -> dict[str, int]:
    """Run `python <args>` under strace, one trace file per thread; bytes read per path."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    done = subprocess.run(["strace", "-ff", "--seccomp-bpf", "-qq", "-y", "-e",
                           "trace=read,pread64,readv,preadv", "-o", str(trace),
                           sys.executable, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"run failed: {' '.join(args)}\n{done.stdout[-3000:]}")
    read: dict[str, int] = {}
    for path in trace.parent.glob(f"{trace.name}.*"):
        for line in path.read_text(errors="replace").splitlines():
            if m := _READ.match(line):
                read[m[1]] = read.get(m[1], 0) + int(m[2])
        path.unlink()
    return read


def bench_bytes(args) -> dict:
    files = write(pathlib.Path(args.records_dir), args.examples, args.files, args.floats)
    size = sum(p.stat().st_size for p in files)
    config = dict(item.split("=", 1) for item in args.set)
    window = (int(config.get("data.shard_examples", 1024))
              * int(config.get("data.window_shards", 8)))
    out = {"data_bytes": size, "window_bytes": round(window * size / args.examples)}
    data_files = {str(p.resolve()) for p in files}
    with tempfile.TemporaryDirectory() as tmp:
        for row in args.rows:
            out[row] = {}
            for epochs in (1, 2):
                read = traced_reads([*_command(row, args, f"train.epochs={epochs}"),
                                     "--workdir", f"{tmp}/{row}-{epochs}"],
                                    pathlib.Path(tmp) / "trace")
                out[row][f"{epochs}_epoch_run"] = {
                    "data_bytes_read": sum(n for path, n in read.items() if path in data_files),
                    "index_bytes_read": sum(
                        n for path, n in read.items()
                        if path.endswith(".index") and path[:-len(".index")] in data_files)}
            runs = out[row]["1_epoch_run"], out[row]["2_epoch_run"]
            for kind in ("data", "index"):
                epoch = runs[1][f"{kind}_bytes_read"] - runs[0][f"{kind}_bytes_read"]
                out[row][f"epoch_{kind}_read_over_data"] = round(epoch / size, 4)
            out[row]["one_epoch_run_read_over_data"] = round(
                runs[0]["data_bytes_read"] / size, 3)
            print(f"  {row}: an epoch reads {out[row]['epoch_data_read_over_data']} of the "
                  f"data and {out[row]['epoch_index_read_over_data']} in its indexes; a run of "
                  f"one epoch {out[row]['one_epoch_run_read_over_data']}", file=sys.stderr)
    return out


def bench_memory(args) -> dict:
    out = {"limit_gib": args.limit_gib, "sizes": {}}
    record = 4 * args.floats + 32  # a record's bytes with its frame, about
    with tempfile.TemporaryDirectory() as tmp:
        for times in args.sizes:
            examples = int(times * args.limit_gib * 2**30 / record)
            sized = argparse.Namespace(**{**vars(args), "examples": examples})
            files = write(pathlib.Path(args.records_dir), examples, args.files, args.floats)
            size = sum(p.stat().st_size for p in files)
            result = {"data_bytes": size, "examples": examples}
            for row in args.rows:
                metrics = bench.measure(
                    _command(row, sized, "train.epochs=1",
                             f"runtime.memory_limit_gib={args.limit_gib}"),
                    pathlib.Path(tmp) / f"{times}-{row}")
                result[row] = {"peak_rss_mib_by_task": metrics["peak_rss_mib_by_task"],
                               "steps": metrics["steps"]}
                print(f"  {times}x the limit ({size / 2**30:.2f} GiB), {row}: peak RSS "
                      f"{metrics['peak_rss_mib_by_task']} MiB", file=sys.stderr)
            out["sizes"][str(times)] = result
            if not args.keep:
                for p in files:
                    p.unlink()
                    p.with_name(p.name + ".index").unlink()
    return out


def bench_order(args) -> dict:
    out: dict[str, dict] = {}
    runs = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.repeats):
            for by_label in (False, True):
                for order in ("windowed", "global"):
                    sets = [f"task.records_dir={args.records_dir}",
                            f"task.sorted_by_label={str(by_label).lower()}",
                            f"data.order={order}", f"train.epochs={args.epochs}",
                            f"train.seed={seed}", "train.verbose=0", *args.set]
                    command = ["-m", "app.train", "--set", "task.name=examples.mnist_png:MnistPng",
                               *(a for item in sets for a in ("--set", item))]
                    name = f"{'sorted_by_label' if by_label else 'mnist_order'}/{order}"
                    runs += 1
                    metrics = bench.measure(command, pathlib.Path(tmp) / f"run{runs}")
                    row = out.setdefault(name, {"test_accuracy": [], "examples_per_sec": []})
                    row["test_accuracy"].append(metrics["test_accuracy"])
                    row["examples_per_sec"].append(metrics["train_examples_per_sec"])
                    print(f"  seed {seed} {name}: test accuracy {metrics['test_accuracy']:.4f}",
                          file=sys.stderr)
    for row in out.values():
        row["mean_test_accuracy"] = round(statistics.mean(row["test_accuracy"]), 4)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench_records",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("write", "read", "bytes", "memory", "order"))
    p.add_argument("--records-dir", default="runs/bench-records")
    p.add_argument("--examples", type=int, default=200000)
    p.add_argument("--files", type=int, default=24)
    p.add_argument("--floats", type=int, default=4096)
    p.add_argument("--batch", type=int, default=32, help="train.global_batch_size")
    p.add_argument("--steps", type=int, default=300, help="steps per `read` run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=None, help="comma-separated subset of: "
                   + ", ".join(READ_ROWS))
    p.add_argument("--limit-gib", type=float, default=1.5)
    p.add_argument("--sizes", default="0.5,2,8",
                   help="`memory`: data sizes as multiples of --limit-gib")
    p.add_argument("--keep", action="store_true", help="`memory`: keep the data written")
    p.add_argument("--epochs", type=int, default=3, help="`order`: epochs per run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run")
    p.add_argument("--out", type=pathlib.Path, help="where to write the JSON record")
    args = p.parse_args(argv)
    default_rows = {"read": ["one_pipeline", "one_by_index", "ps_pipeline", "ps_by_index"],
                    "bytes": ["one_by_index", "mwms_by_index", "ps_by_index"],
                    "memory": ["one_by_index", "ps_by_index"]}.get(args.what, [])
    args.rows = args.rows.split(",") if args.rows else default_rows
    unknown = [r for r in args.rows if r not in READ_ROWS]
    if unknown:
        p.error(f"--rows: unknown row(s) {unknown}; rows are {list(READ_ROWS)}")
    args.sizes = [float(s) for s in args.sizes.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pathlib.Path(args.records_dir).mkdir(parents=True, exist_ok=True)
    result = {"write": bench_write, "read": bench_read, "bytes": bench_bytes,
              "memory": bench_memory, "order": bench_order}[args.what](args)
    report = {"command": " ".join(["python -m tools.bench_records",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "date": datetime.date.today().isoformat(), "machine": bench_report.machine(),
              "result": result}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
