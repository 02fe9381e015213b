"""Why more data trained a worse recommender (issue 35): the experiments, as commands.

    python experiments/recommender_bisect.py reference              # generator vs its definition
    python experiments/recommender_bisect.py scan --stop 30000000   # draws that reached 1.0
    python experiments/recommender_bisect.py step [--old-uniform]   # one step on such a batch
    python experiments/recommender_bisect.py windows --offsets 0,5000000 [--old-uniform]

`reference` recomputes each example's 26 ids from the module's definition in
plain Python (splitmix64 hashes, inverse-CDF Zipf draws, the id permutation)
at indices from 0 to 20M and counts the ids that differ from the generator's:
none, at every index range. `scan` finds, with the same hashes in numpy, the
examples one of whose 24-bit float32 draws (13 dense counts, the click) has
all its bits set: (2^24 - 0.5) / 2^24 rounds to 1.0 in float32, and erfinv(1)
made that dense count inf. About one example in 2^24 / 13 (19 in [0, 30M),
the first 4,576,485); it then prints those examples as the generator makes
them now. `step` trains a fresh DLRM one step on the 64 examples that end
with the first of them and names the weights that are no longer finite.
`windows` trains the recommender_large settings (table_scale 0.01, one pass at
batch 2048, one process) on [offset, offset + examples) for each offset, all
against the test set after [0, examples), and reports the non-finite examples
each window holds, the test AUC and the export's non-finite weights.

`--old-uniform` puts back the generator's draws as they were before the fix
(no clamp below 1), so the failure can be reproduced from this file. The
script turns on oneDNN as `python -m app.train` does (it decides how far the
NaN spreads); `TF_ENABLE_ONEDNN_OPTS=0` before the command turns it off.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys

import numpy as np

# As `python -m app.train` sets them for these settings, before TensorFlow starts:
# oneDNN's kernels (which TensorFlow leaves off on this CPU) and the BFC pool.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from app import config as cfg  # noqa: E402
from app import strategy, trainer  # noqa: E402
from app.tasks import ctr_data, dlrm  # noqa: E402

SETTINGS = ["task.table_scale=0.01", "runtime.memory_limit_gib=0", "train.epochs=1",
            "train.global_batch_size=2048", "train.verbose=0", "eval.test_every_epoch=false",
            "task.traffic_batches=0"]
TOP = (1 << 24) - 1  # a 24-bit draw with every bit set


def old_uniform(bits, width, dtype):
    """ctr_data._uniform before the fix: (low + 0.5) / 2^width, which rounds to 1.0
    in float32 when the low 24 bits are all ones."""
    low = tf.bitwise.bitwise_and(bits, tf.constant((1 << width) - 1, tf.uint64))
    return (tf.cast(low, dtype) + 0.5) / float(1 << width)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash(keys: list[int], index: np.ndarray) -> np.ndarray:
    """ctr_data.hash64 in numpy: [len(index), len(keys)]."""
    with np.errstate(over="ignore"):
        return _mix(index.astype(np.uint64)[:, None] * np.uint64(ctr_data._GOLDEN)
                    + np.array(keys, np.uint64))


def reference(generator: ctr_data.Generator) -> None:
    """Each example's ids as the module's docstring defines them, in plain Python floats."""
    keys = [ctr_data.key(generator.seed, 1, f) for f in range(len(generator.rows))]
    laws = generator.laws
    for start in (0, 1_000_000, 2_000_000, 4_194_300, 4_576_480, 10_000_000, 20_000_000):
        index = np.arange(start, start + 64)
        bits = _hash(keys, index)
        expected = np.zeros(bits.shape, np.int64)
        for (n, f), b in np.ndenumerate(bits):
            u = ((int(b) & ((1 << 53) - 1)) + 0.5) / 2**53
            s, rows = laws[f].exponent, laws[f].rows
            x = (math.exp(u * laws[f]._span()) if abs(1 - s) < 1e-9
                 else (1 + u * laws[f]._span()) ** (1 / (1 - s)))
            rank = min(max(math.floor(x) - 1, 0), rows - 1)
            expected[n, f] = generator.id_map.ids_of(f, np.array([rank]))[0]
        got = generator.examples(tf.constant(index, tf.int64))[0]["cat"].numpy()
        print(f"examples [{start}, {start + 64}): {int(np.sum(got != expected))} of "
              f"{expected.size} ids differ from the definition")


def top_draws(seed: int, start: int, stop: int) -> list[tuple[int, str]]:
    """(index, which draw) of the examples in [start, stop) whose dense or click
    draw has its low 24 bits all set."""
    keys = ([ctr_data.key(seed, 2, j) for j in range(ctr_data.NUM_DENSE)]
            + [ctr_data.key(seed, 3, 0)])
    names = [f"dense {j}" for j in range(ctr_data.NUM_DENSE)] + ["click"]
    found = []
    for lo in range(start, stop, 1 << 20):
        index = np.arange(lo, min(stop, lo + (1 << 20)))
        rows, cols = np.nonzero((_hash(keys, index) & np.uint64(TOP)) == np.uint64(TOP))
        found += [(int(index[r]), names[c]) for r, c in zip(rows, cols, strict=True)]
    return found


def scan(generator: ctr_data.Generator, start: int, stop: int) -> None:
    found = top_draws(generator.seed, start, stop)
    print(f"{len(found)} examples in [{start}, {stop}) have a 24-bit draw of all ones "
          f"(expected {(stop - start) * 14 / 2**24:.1f}):")
    if not found:
        return
    features, _, probability = generator.examples(tf.constant([i for i, _ in found], tf.int64))
    for (index, draw), dense, p in zip(found, features["dense"].numpy(), probability.numpy(),
                                       strict=True):
        print(f"  {index:>10}  {draw:<8}  largest dense count {dense.max():g}  "
              f"teacher's probability {p:.6f}")


def step(generator: ctr_data.Generator) -> None:
    first = top_draws(generator.seed, 0, 30_000_000)[0][0]
    features, clicks, _ = generator.examples(tf.range(first - 63, first + 1, dtype=tf.int64))
    keras.utils.set_random_seed(0)
    model = dlrm.model(generator.rows, 16, (64,), (128, 64), ctr_data.NUM_DENSE)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy(from_logits=True))
    loss = model.train_on_batch(features, clicks)
    bad = [w.name for w in model.weights if not np.all(np.isfinite(w.numpy()))]
    print(f"one step on examples [{first - 63}, {first + 1}): largest dense count "
          f"{features['dense'].numpy().max():g}, loss {loss:.4f}, non-finite weights: "
          f"{', '.join(bad) or 'none'}")


def windows(offsets: list[int], examples: int, zipf: float, workdir: pathlib.Path) -> None:
    for offset in offsets:
        overrides = [*SETTINGS, f"task.zipf_exponent={zipf}", f"task.train_examples={examples}",
                     f"task.train_offset={offset}"]
        run = workdir / f"offset_{offset}"
        config = cfg.load("configs/recommender_large.toml", overrides)
        strategy.configure_runtime(config.runtime)  # as the command line does
        metrics = trainer.run(config, run)
        inside = top_draws(0, offset, offset + examples)
        nan = [v.name for v in tf.saved_model.load(str(run / "export")).variables
               if not np.all(np.isfinite(v.numpy()))]
        print(f"RESULT window [{offset}, {offset + examples}): {len(inside)} examples with a "
              f"draw of 1.0 (first {inside[0][0] if inside else '-'}); test AUC "
              f"{metrics['test_auc']:.4f}, Bayes {metrics['bayes_test_auc']:.4f}, gap "
              f"{metrics['test_auc_gap']:.4f}; non-finite weights in the export: "
              f"{', '.join(nan) or 'none'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("check", choices=("reference", "scan", "step", "windows"))
    parser.add_argument("--old-uniform", action="store_true",
                        help="the generator's draws as before the fix")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--stop", type=int, default=30_000_000)
    parser.add_argument("--offsets", default="0,5000000")
    parser.add_argument("--examples", type=int, default=3_000_000)
    parser.add_argument("--zipf", type=float, default=2.0)
    parser.add_argument("--workdir", default="runs/bisect")
    args = parser.parse_args()
    if args.old_uniform:
        ctr_data._uniform = old_uniform
    generator = ctr_data.Generator(ctr_data.table_rows(0.01), args.zipf)
    if args.check == "reference":
        reference(generator)
    elif args.check == "scan":
        scan(generator, args.start, args.stop)
    elif args.check == "step":
        step(generator)
    else:
        windows([int(o) for o in args.offsets.split(",")], args.examples, args.zipf,
                pathlib.Path(args.workdir) / ("old_uniform" if args.old_uniform else "fixed"))


if __name__ == "__main__":
    main()
