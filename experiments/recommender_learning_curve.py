"""The recommender's learning curve: the test AUC's gap to the Bayes ceiling against
the examples of one pass, for ids from Zipf laws of exponent 2.0 and 1.05.

    python experiments/recommender_learning_curve.py
    python experiments/recommender_learning_curve.py --examples 30000000 --zipf 2.0

Each point trains configs/recommender_large.toml's model in one process on
examples [0, n): tables at 1% of Criteo's sizes (task.table_scale = 0.01), one
pass at batch 2048, no memory limit; the test set is the 200,000 examples after
them. The gap is then split in two with the planted teacher:

- the data's part: the Bayes AUC less the AUC of the teacher with the terms of
  every test id seen fewer than k times in the n training examples set to their
  mean, 0 (`ctr_data.Generator.logit`'s `known`), for k = 1 (never seen) and
  k = 10: ids too rare in the training data to learn from;
- the model's part: what is left, the teacher that knows the seen ids less the
  trained model.

Beside them: the fraction of test examples with at least one id seen fewer than
k times, counted, and predicted from the Zipf laws alone (each rank r of a table
seen Poisson(n p_r) times). Points are added to those already in
docs/results/recommender_learning_curve.json (a rerun of a point replaces it), which is
written after each, with the chart docs/results/recommender_learning_curve.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere

from app import config as cfg  # noqa: E402
from app import strategy, trainer  # noqa: E402
from app.tasks import ctr_data  # noqa: E402

SETTINGS = ["task.table_scale=0.01", "runtime.memory_limit_gib=0", "train.epochs=1",
            "train.global_batch_size=2048", "train.verbose=0", "eval.test_every_epoch=false",
            "task.traffic_batches=0"]
RARE = (1, 10)  # an id seen fewer than k times in training counts as unknown
TEST = 200_000  # configs/recommender_large.toml's test examples
OUT = ROOT / "docs" / "recommender_learning_curve"


def id_counts(generator: ctr_data.Generator, n: int) -> list[np.ndarray]:
    """How often each row of each table is looked up in examples [0, n)."""
    ids = tf.function(generator.ids)
    counts = [np.zeros(rows, np.int64) for rows in generator.rows]
    for start in range(0, n, 1 << 20):
        batch = ids(tf.range(start, min(n, start + (1 << 20)), dtype=tf.int64)).numpy()
        for f, c in enumerate(counts):
            c += np.bincount(batch[:, f], minlength=len(c))
    return counts


def predicted_rare(generator: ctr_data.Generator, n: int, k: int) -> float:
    """P(a test example has an id seen fewer than k times in n examples), from the laws."""
    known = 1.0
    for law in generator.laws:
        p = law.probabilities(0, law.rows)
        mean = n * p
        below = sum(np.exp(-mean + j * np.log(np.maximum(mean, 1e-300)) - math.lgamma(j + 1))
                    for j in range(k))
        known *= 1 - float(np.sum(p * below))
    return 1 - known


def split_gap(generator: ctr_data.Generator, n: int) -> dict:
    """The Bayes AUC of test examples [n, n + TEST), and for each k of RARE the AUC
    of the teacher that does not know the ids seen fewer than k times in [0, n)."""
    counts = id_counts(generator, n)
    features, clicks, probability = generator.examples(tf.range(n, n + TEST, dtype=tf.int64))
    y, ids = clicks.numpy()[:, 0], features["cat"].numpy()
    figures = {"bayes_test_auc": round(ctr_data.auc(y, probability.numpy()), 6)}
    for k in RARE:
        known = np.stack([counts[f][ids[:, f]] >= k for f in range(ids.shape[1])], 1)
        logit = generator.logit(features["dense"], features["cat"], tf.constant(known))
        figures[f"teacher_auc_without_ids_seen_under_{k}"] = round(ctr_data.auc(y, logit), 6)
        figures[f"test_examples_with_an_id_seen_under_{k}"] = round(
            float(np.mean(~known.all(1))), 6)
        figures[f"predicted_examples_with_an_id_seen_under_{k}"] = round(
            predicted_rare(generator, n, k), 6)
    return figures


def point(zipf: float, n: int, workdir: pathlib.Path) -> dict:
    overrides = [*SETTINGS, f"task.zipf_exponent={zipf}", f"task.train_examples={n}"]
    config = cfg.load(str(ROOT / "configs/recommender_large.toml"), overrides)
    strategy.configure_runtime(config.runtime)  # as the command line does
    metrics = trainer.run(config, workdir / f"zipf{zipf}_n{n}")
    generator = ctr_data.Generator(ctr_data.table_rows(0.01), zipf)
    result = {"zipf_exponent": zipf, "train_examples": n,
              "test_auc": round(metrics["test_auc"], 6),
              "test_auc_gap": metrics["test_auc_gap"],
              "train_examples_per_sec": metrics["train_examples_per_sec"],
              "wall_seconds": metrics["wall_seconds"], **split_gap(generator, n)}
    assert result["bayes_test_auc"] == metrics["bayes_test_auc"], (result, metrics)
    for k in RARE:
        data = result["bayes_test_auc"] - result[f"teacher_auc_without_ids_seen_under_{k}"]
        result[f"gap_data_ids_seen_under_{k}"] = round(data, 6)
        result[f"gap_model_ids_seen_under_{k}"] = round(metrics["test_auc_gap"] - data, 6)
    return result


def chart(points: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for zipf, color in ((2.0, "tab:blue"), (1.05, "tab:red")):
        rows = sorted((p for p in points if p["zipf_exponent"] == zipf),
                      key=lambda p: p["train_examples"])
        if not rows:
            continue
        x = [p["train_examples"] for p in rows]
        ax.plot(x, [p["test_auc_gap"] for p in rows], "o-", color=color,
                label=f"Zipf {zipf}: trained model")
        for k, style in zip(RARE, ("--", ":"), strict=True):
            ax.plot(x, [p[f"gap_data_ids_seen_under_{k}"] for p in rows], style, color=color,
                    label=f"Zipf {zipf}: teacher without ids seen < {k}x")
    ax.set_xscale("log")
    ax.set_xlabel("training examples (one pass, batch 2048)")
    ax.set_ylabel("Bayes test AUC - test AUC")
    ax.set_title("Recommender, tables 1% of Criteo's, one process")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", default="1000000,3000000,10000000")
    parser.add_argument("--zipf", default="2.0,1.05")
    parser.add_argument("--workdir", default="runs/learning_curve")
    args = parser.parse_args()
    json_path = OUT.with_suffix(".json")
    record = json.loads(json_path.read_text()) if json_path.exists() else {"points": []}
    record.update({
        "command": "python experiments/recommender_learning_curve.py " + " ".join(sys.argv[1:]),
        "settings": "configs/recommender_large.toml with " + " ".join(SETTINGS),
        "machine": {"cpu": "AMD EPYC", "cores": 2, "gpus": 0}})
    for zipf in (float(z) for z in args.zipf.split(",")):
        for n in (int(e) for e in args.examples.split(",")):
            result = {**point(zipf, n, pathlib.Path(args.workdir)),
                      "date": datetime.date.today().isoformat()}
            record["points"] = [p for p in record["points"]
                                if (p["zipf_exponent"], p["train_examples"]) != (zipf, n)]
            record["points"].append(result)
            record["points"].sort(key=lambda p: (-p["zipf_exponent"], p["train_examples"]))
            json_path.write_text(json.dumps(record, indent=2) + "\n")
            chart(record["points"], OUT.with_suffix(".png"))
            print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
