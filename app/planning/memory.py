"""The peak memory `tools.plan` predicts for every task of a cluster, and the check
that refuses, before any process starts, a cluster shape that cannot fit
`runtime.memory_limit_gib` (`python -m tools.plan --memory-limit-gib`, and
`launch.local` when a limit is set).

Every task starts at `memory.BASELINE_BYTES` (TensorFlow imported, nothing
built). On that:

- a ps task holds its shards of the variables and their optimizer slots, and
  once more its largest shard, which is initialised into a temporary tensor and
  then assigned; under `ps.mode = "sync"`, also one slot per worker beside each
  trainable shard, dense (a table's too), float16 with `ps.compression = "fp16"`
  (app/distribute/ps/exchange.py);
- a worker holds what a step reads (the dense variables whole, the rows a batch
  looks up in a table), their gradients (as much again), two batches (the one
  in the step and one prefetched), and the step's activations (`step_bytes`);
- the chief, under parameter servers, holds no variable: the workers evaluate
  against the ps tasks and the ps tasks write the checkpoints and the export.
  It reads batches as a worker does (sampled training batches, the test set's
  ceiling for the recommender) and builds and dispatches the step's functions
  to every worker: it is counted at the baseline, two batches and
  `COORDINATOR_BYTES`;
- a MultiWorkerMirrored worker (`--ps 0`) holds every variable and slot, the
  gradients, and two batches;
- an evaluator task (`evaluator_peak`) holds the model's variables (not the
  slots), and once more the largest while a checkpoint restores into it.

The predictions beside the peaks measured with the recommender's tables at 1x,
8x and Criteo's own sizes: docs/large_models.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from app import config as cfg
from app.cluster import memory
from app.units import human_size

# A step's tensors over its layers' outputs. Fitted: the workers of
# configs/recommender_large.toml peaked at 976 and 1011 MiB evaluating batches
# of 20,000 examples (6.0 KB of layer outputs each: 114 MiB); 2 puts them at 946.
ACTIVATION_COPIES = 2
# What the chief holds beyond TensorFlow's baseline and two batches: the coordinator's
# functions, one copy per worker, its threads and their gRPC buffers. Fitted: the
# recommender's chief (chief + 2 workers + 2 or 4 ps) peaked at 749 to 899 MiB over
# six runs against the 700 MiB of baseline and batches.
COORDINATOR_BYTES = 100 << 20
# Tried in turn for "how many ps tasks would fit".
MAX_PS = 256


def batch_bytes(built) -> int:
    """Bytes of one training batch of train.global_batch_size, read from the
    training dataset's element spec (0 where the task cannot build one here)."""
    import tensorflow as tf

    batch = built.config.train.global_batch_size
    try:
        spec = built.task.train_dataset(tf.distribute.InputContext(), batch).element_spec
    except Exception:  # noqa: BLE001 - a task whose data is not reachable from here
        return 0
    total = 0
    for leaf in tf.nest.flatten(spec):
        dims = [batch if d is None else d for d in leaf.shape.as_list()]
        total += math.prod(dims) * leaf.dtype.size
    return total


def activation_bytes(model) -> int:
    """Bytes of every layer's outputs for one example, read from a functional
    model's output shapes (0 for a model whose layers have none: subclassed)."""
    total = 0
    for layer in model.layers:
        try:
            shapes = layer.output_shape
        except (AttributeError, RuntimeError):
            return 0
        for shape in shapes if isinstance(shapes, list) else [shapes]:
            if shape is None or any(d is None for d in shape[1:]):
                continue
            total += math.prod(shape[1:]) * 4  # float32; a narrower policy holds less
    return total


def step_bytes(built) -> int:
    """What a worker's step holds beyond its variables: the activations of an
    evaluation batch (eval.batch_size), or of a training batch and their
    gradients, whichever is more, each `ACTIVATION_COPIES` times the layers'
    outputs (the tensors inside a layer, a batch's copies between ops)."""
    config = built.config
    evaluated = config.eval.batch_size
    splits = [built.task.eval_examples(split) for split in ("validation", "test")]
    if None not in splits:  # None: a split of no known size; 0: no split
        evaluated = min(evaluated, max(splits))
    return ACTIVATION_COPIES * activation_bytes(built.model) * max(
        evaluated, 2 * config.train.global_batch_size)


def _bytes(variables) -> int:
    return sum(map(_variable_bytes, variables))


def _variable_bytes(variable) -> int:
    # Keras 3's variables name their dtype ("float32") and give their shape as a tuple.
    import tensorflow as tf  # started already: the model was built

    return math.prod(variable.shape) * tf.as_dtype(variable.dtype).size


def peaks(built, placement, traffic, num_workers: int = 0) -> dict[str, int]:
    """{"ps:0": bytes, ..., "worker": bytes, "chief": bytes}: each task's predicted peak
    (every worker alike); with no ps, {"worker": bytes} of MultiWorkerMirrored.
    `num_workers`: the workers whose sync slots a ps task holds (ps.mode = sync)."""
    base = memory.BASELINE_BYTES
    batches = 2 * batch_bytes(built)
    steps = step_bytes(built)
    if placement is None:  # MultiWorkerMirrored: every worker holds everything
        every, trainable = _bytes(built.created), _bytes(built.model.trainable_variables)
        return {"worker": base + every + trainable + batches + steps}
    out = {}
    for i in range(placement.num_ps):
        held = [s.bytes for s in placement.shards if s.ps_task == i]
        out[f"ps:{i}"] = base + sum(held) + max(held, default=0)
        if built.config.ps.mode == "sync" and traffic.trainable_bytes:
            out[f"ps:{i}"] += round(num_workers * traffic.trainable_bytes[i]
                                    * traffic.gradient_scale)
    out["worker"] = base + 2 * sum(traffic.read_bytes) + batches + steps
    out["chief"] = base + batches + COORDINATOR_BYTES
    return out


def evaluator_peak(built) -> int:
    """The evaluator task's peak: SidecarEvaluator restores each checkpoint into a
    whole model of its own."""
    variables = built.model.variables
    largest = max(map(_variable_bytes, variables), default=0)
    return memory.BASELINE_BYTES + _bytes(variables) + largest


def check(built, num_ps: int, num_workers: int, limit_gib: float, place: Callable,
          placed: tuple | None = None) -> dict[str, int]:
    """Each task's predicted peak; ConfigError naming the first task over
    `limit_gib`, its peak, and how many ps tasks would fit (if any would).
    `place(built, num_ps)` spreads the variables over ps tasks (`tools.plan.place`,
    passed in: tools.plan imports this module); `placed`: its result for `num_ps`
    when the caller has it already."""
    if placed is None:
        placed = place(built, num_ps) if num_ps else (None, None)
    predicted = peaks(built, *placed, num_workers)
    limit = limit_gib * memory.GIB
    over = [(task, nbytes) for task, nbytes in predicted.items() if nbytes > limit]
    if not limit_gib or not over:
        return predicted
    # A chief or worker over the limit is not helped by more ps tasks: name it first.
    stuck = [(t, b) for t, b in over if not t.startswith("ps:")]
    task, nbytes = max(stuck or over, key=lambda item: item[1])
    head = (f"{task} would peak at {human_size(nbytes)}, over runtime.memory_limit_gib = "
            f"{limit_gib:g} GiB ({human_size(round(limit))}), "
            f"{num_ps} ps and {num_workers} worker(s)")
    if not num_ps:
        raise cfg.ConfigError(f"{head}: every MultiWorkerMirrored worker holds the whole "
                              "model and its slots; raise the limit, or train with ps tasks")
    if stuck:
        raise cfg.ConfigError(
            f"{head}: no number of ps tasks fits, since the {task} holds "
            f"{'its batches' if task == 'chief' else 'its step'}"
            f"; raise the limit to at least {math.ceil(nbytes / memory.GIB * 10) / 10:g} GiB")
    more = _ps_tasks_that_fit(built, num_ps + 1, limit, place, num_workers)
    if more:
        raise cfg.ConfigError(f"{head}: {more} ps tasks would fit (--ps {more}), or raise "
                              "the limit")
    raise cfg.ConfigError(f"{head}: not even {MAX_PS} ps tasks fit (a shard larger than the "
                          "limit: lower ps.shard_bytes or use ps.partitioner = \"max_size\"); "
                          "raise the limit")


def _ps_tasks_that_fit(built, first: int, limit: float, place: Callable,
                       num_workers: int) -> int | None:
    """The fewest ps tasks, `first` or more, whose predicted peaks are within `limit` bytes."""
    for num_ps in range(first, MAX_PS + 1):
        ps_peaks = peaks(built, *place(built, num_ps), num_workers)
        if max(b for t, b in ps_peaks.items() if t.startswith("ps:")) <= limit:
            return num_ps
    return None


def fewest_ps(built, num_workers: int, limit_gib: float, place: Callable) -> int:
    """The fewest ps tasks over which every task fits `limit_gib` (`tools.plan` without
    `--ps`); `check`'s ConfigError when no number does (a chief or worker over the
    limit whatever the ps tasks, or a shard larger than it)."""
    limit = limit_gib * memory.GIB
    placed = place(built, 1)
    if any(nbytes > limit for task, nbytes in peaks(built, *placed, num_workers).items()
           if not task.startswith("ps:")):  # more ps tasks do not help: check says so
        check(built, 1, num_workers, limit_gib, place, placed=placed)
    fewest = _ps_tasks_that_fit(built, 1, limit, place, num_workers) or MAX_PS
    check(built, fewest, num_workers, limit_gib, place)
    return fewest


def report(predicted: dict[str, int], limit_gib: float) -> list[str]:
    """Lines of each task's predicted peak, beside the limit."""
    limit = f"runtime.memory_limit_gib = {limit_gib:g}" if limit_gib else "no memory limit"
    lines = [f"predicted peak memory per task ({human_size(memory.BASELINE_BYTES)} of it "
             f"TensorFlow's own, app/planning/memory.py; {limit}):"]
    return lines + [f"  {task:<8} {human_size(nbytes):>10}" for task, nbytes in predicted.items()]


def check_evaluator(config: cfg.Config) -> None:
    """Refuse, before building it, a model whose copy cannot fit this task's
    `runtime.memory_limit_gib`: SidecarEvaluator restores each checkpoint into a
    whole model of its own, which tables sharded over ps tasks may not fit in."""
    limit = config.runtime.memory_limit_gib
    if not limit:
        return
    from app.planning import model  # builds the model: imports TensorFlow

    peak = evaluator_peak(model.build(config))
    if peak > limit * memory.GIB:
        raise cfg.ConfigError(
            f"the evaluator task would peak at {human_size(peak)}, over "
            f"runtime.memory_limit_gib = {limit:g} GiB: it restores each checkpoint into a "
            "whole model of its own. Evaluate on the workers instead, which read only the "
            "rows they need from the ps tasks: drop the evaluator task and set "
            "eval.test_every_epoch = true (or give the task a validation split); or raise "
            "the limit")
