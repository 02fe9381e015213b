"""`python -m tools.bench`: training throughput of each strategy, side by side.

Each row is a real `python -m app.train` run in its own process (logical
devices and thread pools are fixed when TensorFlow starts), or for the
multi-task rows a real cluster of processes from `launch.local`, on the same
model, synthetic data and global batch. Rows are interleaved over the
repeats, so a machine that slows down mid-benchmark slows every row alike.
Each row reports its median steady-state examples/s, its ratio to the
baseline row measured in the same invocation, the peak resident memory of
all its processes together, and for parameter-server rows the bytes each ps
task holds and their balance (largest / mean).

Every row starts from the plain settings (TensorFlow's own CPU kernels and
CPU allocator, float32, no XLA, one step per execution), so that a speed
switch shows up only in the row that turns it on. The `*defaults` rows run
at the project's defaults instead, what a user gets, and their ratio is to
the single process at those defaults (the `defaults` row). The row each ratio is to
runs first, whether asked for or not, and no other.

    python -m tools.bench --steps 300 --workdir runs/bench   # or: make bench

With `--link RATE` the multi-task rows run over shaped links (`launch.local
--link`), and each one's step time is set beside the least one tools.plan says
those links allow (a ps row's busiest link or read-then-push chain, a
MultiWorkerMirrored row's all-reduce); `--links A,B,C` runs them at each rate
and draws throughput against bandwidth, the single process as the ceiling:

    python -m tools.bench --links 100mbit,1gbit,10gbit --rows baseline,ps_2w2p,mwms_2w
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

from app import config as cfg
from launch import network  # the link syntax of launch.local --link
from tools import bench_report, procstat

_TRAIN = ("-m", "app.train")
_LOCAL = ("-m", "launch.local")  # one process per task, see launch/local.py
BASELINE = "baseline"


@dataclasses.dataclass(frozen=True)
class Row:
    what: str
    args: tuple[str, ...]
    base: str = BASELINE  # the row its ratio is to, measured in the same invocation


def _ps(workers: int, ps: int, *sets: str) -> tuple[str, ...]:
    return (*_LOCAL, "--workers", str(workers), "--ps", str(ps), *_sets(*sets))


def _sets(*items: str) -> tuple[str, ...]:
    return tuple(arg for item in items for arg in ("--set", item))


def _set_items(args) -> list[str]:
    """The KEY=VALUE items of `args`' `--set`s, in order (what `_sets` writes)."""
    return [args[i + 1] for i, flag in enumerate(args[:-1]) if flag == "--set"]


_BASELINE = (*_TRAIN, "--strategy", "default")


def _switch(setting: str, note: str = "") -> Row:
    """The baseline with one speed switch turned on."""
    return Row(f"baseline + {setting}{note}", (*_BASELINE, *_sets(setting)))


# The straggler rows: 3 workers, worker 2 three times as slow, on real MNIST so
# that their test accuracy means something. Their global batch (96) divides over
# the 3 or 2 workers a sync update waits for; each row sees the same examples.
_STRAGGLER = ("debug.slow_worker=2", "debug.slow_factor=3", "train.global_batch_size=96",
              "task.source=mnist", "task.validation_examples=0", "task.test_examples=0")

# Float16 both ways under parameter servers: gradients pushed and variables read.
_FP16_BOTH = ("ps.compression=fp16", "ps.read_compression=fp16")
# No task's thread pools spinning for their next op: they sleep at once.
_NOSPIN = "runtime.thread_spinning=false"

# The settings every row starts from; rows and --set may change them.
# Spinning, as TensorFlow's default and one process's: launch.local's tasks would
# not spin otherwise (launch/local.py, thread_settings); the `nospin` rows turn it off.
# A closure's steps as a loop, as before ps.unroll: the `unroll` rows unroll them.
PLAIN = ("runtime.onednn=false", "runtime.cpu_allocator=malloc", "train.precision=float32",
         "train.jit_compile=false", "train.steps_per_execution=1", "runtime.thread_spinning=true",
         "ps.unroll=false")


def _project_defaults() -> tuple[str, ...]:
    """PLAIN's settings at the project's default values, written as TOML values."""
    config = cfg.load(None)
    out = []
    for key in (item.split("=")[0] for item in PLAIN):
        section, name = key.split(".")
        out.append(f"{key}={json.dumps(getattr(getattr(config, section), name))}")
    return tuple(out)


DEFAULTS = _project_defaults()


def _at_defaults(what: str, args: tuple[str, ...], *sets: str) -> Row:
    """`args` at the project's defaults, then `sets` (which may change one of PLAIN's).

    A PLAIN key that `args` sets itself (`_ps(2, 2, _NOSPIN)`) keeps the row's value: the
    defaults come after `args` on the command line, and the last `--set` wins.
    """
    own = {item.split("=")[0] for item in _set_items(args)}
    defaults = [item for item in DEFAULTS if item.split("=")[0] not in own]
    return Row(f"{what}, at the project's defaults", (*args, *_sets(*defaults, *sets)),
               base="defaults")


ROWS: dict[str, Row] = {
    "baseline": Row("plain Keras fit, one process, default strategy", _BASELINE),
    "defaults": _at_defaults("one process, default strategy", _BASELINE),
    "mwms_2w_defaults": _at_defaults("MultiWorkerMirrored, 2 worker processes", _ps(2, 0)),
    "ps_2w2p_defaults": _at_defaults("ParameterServer: chief + 2 workers + 2 ps", _ps(2, 2)),
    "defaults_spe8": _at_defaults("one process, 8 steps per execution "
                                  "(train.steps_per_execution=8)", _BASELINE,
                                  "train.steps_per_execution=8"),
    "ps_2w2p_spe8_defaults": _at_defaults(
        "ParameterServer: chief + 2 workers + 2 ps, 8 steps per closure "
        "(train.steps_per_execution=8)", _ps(2, 2), "train.steps_per_execution=8"),
    "ps_2w2p_spe8_fp16_defaults": _at_defaults(
        "ps_2w2p_spe8_defaults, gradients pushed as float16 (ps.compression=fp16)",
        _ps(2, 2, "ps.compression=fp16"), "train.steps_per_execution=8"),
    "ps_2w2p_spe8_fp16_both_defaults": _at_defaults(
        "ps_2w2p_spe8_fp16_defaults, the variables read as float16 too "
        "(ps.read_compression=fp16)",
        _ps(2, 2, *_FP16_BOTH), "train.steps_per_execution=8"),
    "ps_2w2p_spe8_fp16_both_nospin_defaults": _at_defaults(
        "ps_2w2p_spe8_fp16_both_defaults, no task's thread pools spinning "
        "(runtime.thread_spinning=false)",
        _ps(2, 2, *_FP16_BOTH, _NOSPIN),
        "train.steps_per_execution=8"),
    "ps_2w2p_spe8_fp16_both_nospin_threads2_defaults": _at_defaults(
        "ps_2w2p_spe8_fp16_both_nospin_defaults, 2 intra-op threads a task "
        "(runtime.intra_op_threads=2)",
        _ps(2, 2, *_FP16_BOTH, _NOSPIN, "runtime.intra_op_threads=2"),
        "train.steps_per_execution=8"),
    "defaults_nospin": _at_defaults("one process, its thread pools not spinning "
                                    "(runtime.thread_spinning=false)", _BASELINE,
                                    _NOSPIN),
    "sync_2w2p_nospin_defaults": _at_defaults(
        "ParameterServer sync (ps.mode=sync): chief + 2 workers + 2 ps, no task's thread "
        "pools spinning (runtime.thread_spinning=false)", _ps(2, 2, "ps.mode=sync", _NOSPIN)),
    "sync_2w2p_fp16_nospin_defaults": _at_defaults(
        "sync_2w2p_nospin_defaults, gradients deposited as float16 (ps.compression=fp16): "
        "half the bytes of each deposit and of the slots",
        _ps(2, 2, "ps.mode=sync", "ps.compression=fp16", _NOSPIN)),
    "sync_2w2p_fp16_both_nospin_defaults": _at_defaults(
        "sync_2w2p_fp16_nospin_defaults, the variables read as float16 too "
        "(ps.read_compression=fp16): half the bytes a worker reads after each update",
        _ps(2, 2, "ps.mode=sync", *_FP16_BOTH, _NOSPIN)),
    "mwms_2w_nospin_defaults": _at_defaults(
        "MultiWorkerMirrored, 2 worker processes, their thread pools not spinning "
        "(runtime.thread_spinning=false)", _ps(2, 0, _NOSPIN)),
    "ps_2w2p_nospin_defaults": _at_defaults(
        "ParameterServer: chief + 2 workers + 2 ps, no task's thread pools spinning "
        "(runtime.thread_spinning=false)", _ps(2, 2, _NOSPIN)),
    "mwms_2w_fp16_nospin_defaults": _at_defaults(
        "mwms_2w_fp16_defaults, the workers' thread pools not spinning "
        "(runtime.thread_spinning=false)",
        _ps(2, 0, "sync.compression=fp16", _NOSPIN)),
    "mwms_2w_fp16_defaults": _at_defaults(
        "MultiWorkerMirrored, 2 worker processes, float16 all-reduce (sync.compression=fp16)",
        _ps(2, 0, "sync.compression=fp16")),
    "mwms_2w_onepack_defaults": _at_defaults(
        "MultiWorkerMirrored, 2 worker processes, one all-reduce after the backward pass "
        "(sync.bytes_per_pack=0)", _ps(2, 0, "sync.bytes_per_pack=0")),
    "mwms_2w_spe8_defaults": _at_defaults(
        "MultiWorkerMirrored, 2 worker processes, 8 steps per execution "
        "(train.steps_per_execution=8)", _ps(2, 0), "train.steps_per_execution=8"),
    "mwms_2w_threads2_defaults": _at_defaults(
        "MultiWorkerMirrored, 2 worker processes of 2 intra-op threads each",
        _ps(2, 0, "runtime.intra_op_threads=2")),
    "onednn": _switch("runtime.onednn=true", " (the project's default)"),
    "bfc": _switch("runtime.cpu_allocator=bfc", " (the project's default)"),
    "spe8": _switch("train.steps_per_execution=8"),
    "nospin": _switch(_NOSPIN),
    "xla": _switch("train.jit_compile=true"),
    "bf16": _switch("train.precision=mixed_bfloat16"),
    "mirrored_1dev": Row("MirroredStrategy on one device", (*_TRAIN, "--strategy", "mirrored")),
    # The device list is filled in at run time: two logical CPUs, or GPUs (see _devices).
    "mirrored_2dev": Row("MirroredStrategy on two devices", (*_TRAIN, "--strategy", "mirrored")),
    "mwms_2w": Row("MultiWorkerMirrored, 2 worker processes", _ps(2, 0)),
    "mwms_2w_fp16": Row("the same, gradients all-reduced as float16 (sync.compression=fp16)",
                        _ps(2, 0, "sync.compression=fp16")),
    "mwms_2w_onepack": Row("the same, one all-reduce after the backward pass (TF's default)",
                           _ps(2, 0, "sync.bytes_per_pack=0")),
    "ps_2w1p": Row("ParameterServer: chief + 2 workers + 1 ps", _ps(2, 1)),
    "ps_2w2p": Row("ParameterServer: chief + 2 workers + 2 ps", _ps(2, 2)),
    # Several steps per scheduled closure (train.steps_per_execution): one scheduling round
    # trip per 8 steps. Their ratio is to the baseline at one step a call, as every row's.
    "ps_2w2p_spe8": Row("ps_2w2p, 8 steps per closure (train.steps_per_execution=8)",
                        _ps(2, 2, "train.steps_per_execution=8")),
    "ps_2w2p_spe8_once": Row("ps_2w2p_spe8, the variables read once per closure "
                             "(ps.read_every=8)",
                             _ps(2, 2, "train.steps_per_execution=8", "ps.read_every=8")),
    "ps_2w2p_spe8_every2": Row("ps_2w2p_spe8, the variables read every 2 steps (ps.read_every=2)",
                               _ps(2, 2, "train.steps_per_execution=8", "ps.read_every=2")),
    "ps_2w2p_spe8_fp16": Row("ps_2w2p_spe8, gradients pushed as float16 (ps.compression=fp16)",
                             _ps(2, 2, "train.steps_per_execution=8", "ps.compression=fp16")),
    "ps_2w2p_spe8_fp16_both": Row("ps_2w2p_spe8_fp16, the variables read as float16 too "
                                  "(ps.read_compression=fp16)",
                                  _ps(2, 2, "train.steps_per_execution=8", *_FP16_BOTH)),
    "ps_2w2p_spe8_fp16_both_every2": Row(
        "ps_2w2p_spe8_fp16_both, the variables read every 2 steps (ps.read_every=2)",
        _ps(2, 2, "train.steps_per_execution=8", *_FP16_BOTH, "ps.read_every=2")),
    "ps_2w2p_spe8_fp16_both_nospin": Row(
        "ps_2w2p_spe8_fp16_both, no task's thread pools spinning "
        "(runtime.thread_spinning=false)",
        _ps(2, 2, "train.steps_per_execution=8", *_FP16_BOTH, _NOSPIN)),
    "ps_2w2p_spe8_fp16_both_nospin_unroll": Row(
        "ps_2w2p_spe8_fp16_both_nospin, a closure's steps unrolled (ps.unroll=true)",
        _ps(2, 2, "train.steps_per_execution=8", *_FP16_BOTH, _NOSPIN, "ps.unroll=true")),
    "ps_2w2p_spe32_fp16_both_nospin_unroll": Row(
        "ps_2w2p_spe8_fp16_both_nospin_unroll at 32 steps a closure, unrolled in groups of 8 "
        "(coordinated.UNROLLED_AT_MOST)",
        _ps(2, 2, "train.steps_per_execution=32", *_FP16_BOTH, _NOSPIN, "ps.unroll=true")),
    "ps_2w2p_spe40_fp16_both_nospin_unroll": Row(
        "the same at 40 steps a closure, 5 groups of 8 (1,000 steps: no shorter closure)",
        _ps(2, 2, "train.steps_per_execution=40", *_FP16_BOTH, _NOSPIN, "ps.unroll=true")),
    "ps_2w2p_rr": Row("the same without a partitioner (TF1's round-robin placement)",
                      _ps(2, 2, "ps.partitioner=none")),
    "ps_2w2p_fp16": Row("the same as ps_2w2p, gradients pushed as float16 (ps.compression=fp16)",
                        _ps(2, 2, "ps.compression=fp16")),
    "ps_2w2p_rr_fp16": Row("ps_2w2p_rr with gradients pushed as float16",
                           _ps(2, 2, "ps.partitioner=none", "ps.compression=fp16")),
    "straggler_async": Row("ParameterServer async, 3 workers + 1 ps, worker 2 slowed 3x",
                           _ps(3, 1, *_STRAGGLER)),
    "straggler_sync_b0": Row("the same, ps.mode=sync, no backup worker",
                             _ps(3, 1, *_STRAGGLER, "ps.mode=sync")),
    "straggler_sync_b1": Row("the same, ps.mode=sync, 1 backup worker",
                             _ps(3, 1, *_STRAGGLER, "ps.mode=sync", "ps.backup_workers=1")),
    # The same two sync rows in Keras 3, each its ratio to the one without a backup worker.
    "keras3_straggler_sync_b0": Row("straggler_sync_b0 in Keras 3", _ps(
        3, 1, *_STRAGGLER, "ps.mode=sync", "task.keras=keras"), base="keras3_straggler_sync_b0"),
    "keras3_straggler_sync_b1": Row("straggler_sync_b1 in Keras 3", _ps(
        3, 1, *_STRAGGLER, "ps.mode=sync", "ps.backup_workers=1", "task.keras=keras"),
                                    base="keras3_straggler_sync_b0"),
    # Synchronous parameter servers, no straggler, in each Keras (the Keras 3 row's
    # ratio is to the tf_keras one): every update averages both workers' contributions.
    "sync_2w1p": Row("ParameterServer sync: chief + 2 workers + 1 ps (ps.mode=sync)",
                     _ps(2, 1, "ps.mode=sync")),
    "keras3_sync_2w1p": Row("sync_2w1p in Keras 3", _ps(2, 1, "ps.mode=sync", "task.keras=keras"),
                            base="sync_2w1p"),
    # The recommender rows, for `--config configs/recommender.toml --set task.table_scale=0.05`
    # (the baseline row is then the recommender in one process): the same task and
    # global batch with sharded tables on 2 ps tasks or replicated on 2 workers,
    # with tables 8 times as large, and with the hot ids at the front of each table.
    "rec_ps_2w2p": Row("recommender, ParameterServer: chief + 2 workers + 2 ps", _ps(2, 2)),
    "rec_mwms_2w": Row("recommender, MultiWorkerMirrored, 2 worker processes", _ps(2, 0)),
    "rec_ps_2w2p_8x": Row("rec_ps_2w2p with tables 8x as large (task.table_scale=0.4)",
                          _ps(2, 2, "task.table_scale=0.4")),
    "rec_mwms_2w_8x": Row("rec_mwms_2w with tables 8x as large (task.table_scale=0.4)",
                          _ps(2, 0, "task.table_scale=0.4")),
    "rec_ps_2w2p_spe8": Row("rec_ps_2w2p, 8 steps per closure (train.steps_per_execution=8)",
                            _ps(2, 2, "train.steps_per_execution=8")),
    "rec_ps_2w2p_ranked": Row("rec_ps_2w2p with the hot ids at the front of each table",
                              _ps(2, 2, "task.ids=ranked")),
    # Keras 3 beside Keras 2: each row the same strategy as its base with the model in
    # Keras 3 (the built-in tasks' `task.keras`), its ratio to that Keras 2 row.
    "keras3": Row("the baseline in Keras 3", (*_BASELINE, *_sets("task.keras=keras"))),
    "keras3_mirrored_2dev": Row("mirrored_2dev in Keras 3", (
        *_TRAIN, "--strategy", "mirrored", *_sets("task.keras=keras")), base="mirrored_2dev"),
    "keras3_mwms_2w": Row("mwms_2w in Keras 3", _ps(2, 0, "task.keras=keras"), base="mwms_2w"),
    "keras3_ps_2w2p": Row("ps_2w2p in Keras 3 (the project's loop on the coordinator)",
                          _ps(2, 2, "task.keras=keras"), base="ps_2w2p"),
    "keras3_ps_2w2p_spe8": Row("ps_2w2p_spe8 in Keras 3", _ps(2, 2, "task.keras=keras",
                                                            "train.steps_per_execution=8"),
                               base="ps_2w2p_spe8"),
    # Where Keras 3's time goes: with 8 steps per execution, the per-step work on the
    # host (the fit loop, callbacks, dispatching the step) is paid once per 8 steps.
    "keras3_spe8": Row("spe8 in Keras 3", (*_BASELINE, *_sets("task.keras=keras",
                                                               "train.steps_per_execution=8")),
                       base="spe8"),
    # The input read by index (app/indexed.py, the default) against the task's pipeline
    # (data.by_index=false): each row's ratio is to the same strategy by index.
    **{f"{row}_pipeline": Row(f"{row} reading the task's pipeline (data.by_index=false)",
                              (*args, *_sets("data.by_index=false")), base=row)
       for row, args in (("baseline", _BASELINE),
                         ("mirrored_2dev", (*_TRAIN, "--strategy", "mirrored")),
                         ("mwms_2w", _ps(2, 0)), ("ps_2w2p", _ps(2, 2)),
                         ("keras3_ps_2w2p", _ps(2, 2, "task.keras=keras")))},
}
DEFAULT_ROWS = ("baseline", "defaults", "mwms_2w_defaults", "ps_2w2p_defaults",
                "onednn", "bfc", "spe8", "xla", "mirrored_1dev", "mirrored_2dev",
                "mwms_2w", "mwms_2w_onepack", "mwms_2w_fp16", "ps_2w1p", "ps_2w2p", "ps_2w2p_rr")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mnist.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every row, e.g. train.global_batch_size=128")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--epochs", type=int, default=1,
                        help="train that many epochs over the same --steps batches (the "
                             "task's learning-rate schedule over them): the test metric after "
                             "a whole run, not only its first steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", action="store_true",
                        help="repeat r trains with train.seed = r - 1 (initial weights and "
                             "order of examples), every row alike: the test metric's spread "
                             "over seeds, and its mean, beside the median")
    parser.add_argument("--whole-test-set", action="store_true",
                        help="evaluate each run on the task's whole test set (default: one "
                             "batch): its test metric after the same training examples")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help="comma-separated subset of: " + ", ".join(ROWS))
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("runs/bench"))
    links = parser.add_mutually_exclusive_group()
    links.add_argument("--link", metavar="RATE[,DELAY]",
                       help="run the multi-task rows over links of RATE per task "
                            "(launch.local --link; needs root), e.g. 1gbit")
    links.add_argument("--links", metavar="RATE,RATE,...",
                       help="a bandwidth sweep: the multi-task rows at each rate, "
                            "e.g. 100mbit,1gbit,10gbit")
    return parser.parse_args(argv)


def link_list(args: argparse.Namespace) -> list[str | None]:
    """The links the multi-task rows run over: [None] for loopback as it is.
    ValueError naming the one that cannot be read."""
    texts = [args.link] if args.link else (args.links.split(",") if args.links else [None])
    for text in texts:
        if text is not None:
            network.parse_link(text)
    return texts


def multi_task(row: str) -> bool:
    """Whether `row` is a cluster of processes (launch.local), which links can shape."""
    return ROWS[row].args[:2] == _LOCAL


def entries(rows: list[str], links: list[str | None]) -> list[tuple[str, str, str | None]]:
    """(name, row, link) of each run: a multi-task row once per link ("ps_2w2p@1gbit"
    in a sweep), a single-process row once, with no link."""
    out = []
    for row in rows:
        for link in (links if multi_task(row) else [None]):
            out.append((f"{row}@{link}" if len(links) > 1 and link else row, row, link))
    return out


def train_args(config_path: str, overrides: list[str], steps: int,
               whole_test_set: bool = False, epochs: int = 1) -> list[str]:
    """app.train arguments for a run of exactly `epochs` x `steps` steps of pure
    training (each epoch over the same `steps` batches of examples), then one batch
    of test examples, or the task's whole test set (its test metric then compares the
    rows' accuracy after the same examples)."""
    if epochs < 1:
        raise ValueError(f"--epochs must be at least 1, not {epochs}")
    config = cfg.load(config_path, [*PLAIN, *overrides])
    batch = config.train.global_batch_size
    fixed = [f"task.train_examples={steps * batch}",
             "task.validation_examples=0", f"train.epochs={epochs}",
             "eval.test_every_epoch=false", "train.verbose=0",
             *([] if whole_test_set else [f"task.test_examples={batch}"])]
    if config.task.name == "mnist" and not any(o.startswith("task.source=") for o in overrides):
        fixed.insert(0, "task.source=synthetic")  # no files to read; --set task.source=mnist does
    return ["--config", config_path, *_sets(*PLAIN, *overrides, *fixed)]


def row_args(row: str, base_args: list[str], gpus: int, link: str | None = None) -> list[str]:
    """The command line of `row`: its module, the shared arguments, then its own settings."""
    module, rest = ROWS[row].args[:2], list(ROWS[row].args[2:])
    if row in ("mirrored_2dev", "keras3_mirrored_2dev", "mirrored_2dev_pipeline"):
        rest += _devices(gpus)
    if link and multi_task(row):
        rest += ["--link", link]
    return [*module, *base_args, *rest]


def row_cluster(row: str) -> tuple[int, int, list[str]]:
    """(workers, ps tasks, --set items) of a multi-task row."""
    args = ROWS[row].args
    value = {flag: args[i + 1] for i, flag in enumerate(args) if flag.startswith("--")}
    return int(value["--workers"]), int(value["--ps"]), _set_items(args)


def plan_bound(row: str, link: str, config_path: str, overrides: list[str]
               ) -> tuple[float, str] | None:
    """tools.plan's least step time of multi-task row `row` over `link`, in seconds,
    and what sets it ("what ps:1 sends"); None for a single-process row."""
    if not multi_task(row):
        return None
    from app.planning import (  # builds the model: TensorFlow, only when a link asks for it
        model as plan,
    )

    workers, num_ps, sets = row_cluster(row)
    config = cfg.load(config_path, [*PLAIN, *overrides, *sets])
    rate_bits = network.parse_link(link).rate_bits
    if not num_ps:
        return plan.allreduce_bytes(config, workers) * 8 / rate_bits, "each worker's all-reduce"
    _, traffic = plan.predict(config, num_ps)
    return plan.step_time_bound(traffic, workers, rate_bits)


def add_bounds(results: dict[str, dict], bounds: dict[str, tuple[float, str]]) -> None:
    """Set each bounded row's measured step time beside tools.plan's bound."""
    for name, (seconds, binding) in bounds.items():
        r = results[name]
        r["plan_bound_ms"], r["plan_bound_link"] = round(seconds * 1000, 1), binding
        if r["steps_per_sec"]:
            r["step_ms"] = round(1000 / r["steps_per_sec"], 1)
            r["step_over_bound"] = round(r["step_ms"] / r["plan_bound_ms"], 3)


def _devices(gpus: int) -> list[str]:
    """Two replicas: two GPUs, one GPU split in two, or the CPU split in two."""
    if gpus >= 2:
        return []  # MirroredStrategy takes all the real GPUs
    if gpus == 1:
        return list(_sets("runtime.gpu_devices=2"))
    return list(_sets("runtime.cpu_devices=2"))


class RunFailed(RuntimeError):
    """A benchmark run that exited non-zero; `reason`, the first `error:` line it wrote
    (app.train's and launch.local's one-line reasons), or ''."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


# "error: ..." as app.train writes it, or "[chief:0] error: ..." through launch.local.
_ERROR_LINE = re.compile(r"^(?:\[[\w:]+\] )?error: (.*)$", re.MULTILINE)


def measure(args: list[str], workdir: pathlib.Path) -> dict:
    """Run `python <args>` once; its metrics.json, with the peak memory of all its
    processes and the CPU seconds they used, summed by cluster task type."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    with open(workdir.with_suffix(".log"), "w") as log:
        process = subprocess.Popen([sys.executable, *args, "--workdir", str(workdir)],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
        peak, cpu, peaks, reads = 0, {}, {}, {}
        while process.poll() is None:
            pids = procstat.tree(process.pid)
            peak = max(peak, procstat.rss(pids))
            # A process that has ended keeps its last reading.
            cpu.update(procstat.cpu_seconds(pids))
            peaks.update(procstat.peak_rss(pids))
            reads.update(procstat.read_chars(pids))
            time.sleep(0.2)
    if process.returncode:
        output = workdir.with_suffix(".log").read_text()
        said = _ERROR_LINE.search(output)
        raise RunFailed(f"benchmark run failed: {' '.join(args)}\n{output[-3000:]}",
                        said.group(1) if said else "")
    metrics = json.loads((workdir / "metrics.json").read_text())
    if carried := link_bytes(workdir.with_suffix(".log").read_text()):
        metrics["link_mib"] = carried
    metrics["peak_memory_mib"] = round(peak / 2**20, 1)
    by_task: dict[str, float] = {}
    for task, seconds in cpu.values():
        by_task[task] = round(by_task.get(task, 0) + seconds, 1)
    metrics["cpu_seconds"] = by_task
    largest: dict[str, float] = {}
    for task, peak_bytes in peaks.values():
        largest[task] = max(largest.get(task, 0), round(peak_bytes / 2**20, 1))
    metrics["peak_rss_mib_by_task"] = largest
    # Bytes read by every process of the run, up to its last poll (a process that ends
    # between two polls loses what it read after the last one).
    metrics["bytes_read"] = sum(chars for _, chars in reads.values())
    return metrics


_CARRIED = re.compile(r"bytes through each task's link: (.*)$", re.MULTILINE)
_TASK_BYTES = re.compile(r"(\S+) in ([\d.]+) MiB out ([\d.]+) MiB")


def link_bytes(log: str) -> dict[str, list[float]]:
    """{task: [MiB into its link, MiB out of it]} over a run with --link, as launch.local
    reports them when the run ends; {} without links."""
    found = _CARRIED.findall(log)
    return {task: [float(into), float(out)]
            for task, into, out in _TASK_BYTES.findall(found[-1])} if found else {}


def run(schedule: list[tuple[str, str, str | None]], base_args: list[str], repeats: int,
        gpus: int, tmp: pathlib.Path, seeds: bool = False
        ) -> tuple[dict[str, dict], dict[str, str]]:
    """Measure each (name, row, link) of `schedule` `repeats` times, interleaved, repeat r
    at `train.seed = r` if `seeds`; (the summary of the runs that finished, the error of
    each row with a failed run). A failed run does not stop the others: a long sweep keeps
    what it measured."""
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in schedule}
    failed: dict[str, str] = {}
    for r in range(repeats):
        for i, (name, row, link) in enumerate(schedule):
            try:
                seed = _sets(f"train.seed={r}") if seeds else ()
                metrics = measure([*row_args(row, base_args, gpus, link), *seed],
                                  tmp / f"{r}-{i}")
            except RuntimeError as e:
                failed.setdefault(name, str(e))
                reason = getattr(e, "reason", "")
                print(f"  repeat {r + 1}/{repeats} {name}: failed"
                      + (f": {reason}" if reason else ""), file=sys.stderr)
                continue
            if link:
                metrics["link"] = link
            runs[name].append(metrics)
            print(f"  repeat {r + 1}/{repeats} {name}: "
                  f"{metrics['train_examples_per_sec']:.0f} examples/s", file=sys.stderr)
    done = {name: metrics for name, metrics in runs.items() if metrics}
    return (summarize(done, seeds) if done else {}), failed


def summarize(runs: dict[str, list[dict]], seeds: bool = False) -> dict[str, dict]:
    """Per row: median examples/s, ratio to its base row (None if it has no run), peak
    memory, ps figures; the test metric of each repeat, and with `seeds` (a seed a
    repeat) their mean."""
    results = {}
    for row, metrics in runs.items():
        samples = [m["train_examples_per_sec"] for m in metrics]
        tested = [m.get(m.get("metric"), 0) for m in metrics]
        results[row] = {
            "what": ROWS[row.split("@")[0]].what,
            "examples_per_sec": statistics.median(samples),
            "samples": samples,
            "steps_per_sec": statistics.median(m.get("train_steps_per_sec", 0) for m in metrics),
            # The task's headline metric (test_accuracy for MNIST; app/task.py).
            "metric": metrics[0].get("metric", "test_accuracy"),
            "test_metric": statistics.median(tested),
            "test_metric_samples": tested,
            "peak_memory_mib": max(m["peak_memory_mib"] for m in metrics),
            "cpu_seconds": {task: statistics.median(m["cpu_seconds"].get(task, 0)
                                                    for m in metrics)
                            for task in metrics[0].get("cpu_seconds", {})},
            "num_replicas": metrics[0]["num_replicas"],
        }
        if seeds:
            results[row]["test_metric_mean"] = round(statistics.mean(tested), 6)
        for key in ("mode", "backup_workers", "stale_dropped", "contributions", "link",
                    "test_auc", "bayes_test_auc", "ps_traffic"):
            if key in metrics[0]:
                results[row][key] = metrics[0][key]
        if "link_mib" in metrics[0]:  # the whole run's bytes (start, evaluation, export too)
            results[row]["link_mib"] = {
                task: [statistics.median(m["link_mib"][task][i] for m in metrics) for i in (0, 1)]
                for task in metrics[0]["link_mib"]}
            results[row]["link_mib_per_step"] = {
                task: [round(statistics.median(m["link_mib"][task][i] / m["steps"]
                                               for m in metrics), 3) for i in (0, 1)]
                for task in metrics[0]["link_mib"]}
        results[row]["peak_rss_mib_by_task"] = {
            task: max(m.get("peak_rss_mib_by_task", {}).get(task, 0) for m in metrics)
            for task in metrics[0].get("peak_rss_mib_by_task", {})}
        if "ps_bytes" in metrics[0]:
            results[row]["ps_bytes"] = metrics[0]["ps_bytes"]
            results[row]["ps_balance"] = metrics[0]["ps_balance"]
    for name, r in results.items():
        row, _, link = name.partition("@")
        base = ROWS[row].base
        # main() runs every base row: a multi-task one at each link of a sweep. A base
        # whose every run failed leaves no ratio (None), not one to another row.
        r["ratio_to"] = next((b for b in (f"{base}@{link}", base) if b in results), None)
        r["ratio"] = (round(r["examples_per_sec"] / results[r["ratio_to"]]["examples_per_sec"], 3)
                      if r["ratio_to"] else None)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row.strip() for row in args.rows.split(",")]
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        print(f"error: --rows: unknown row(s) {unknown}; rows are {list(ROWS)}", file=sys.stderr)
        return 2
    # The rows the ratios are to, first; no other (the `*_defaults` rows' is `defaults`).
    bases = list(dict.fromkeys(ROWS[row].base for row in rows))
    rows = [*bases, *(row for row in rows if row not in bases)]
    try:
        links = link_list(args)
        if links != [None] and (problem := network.preflight()):
            raise ValueError(problem)  # before any row runs, not in the first cluster's log
        base_args = train_args(args.config, args.set, args.steps, args.whole_test_set,
                               args.epochs)
    except (cfg.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    schedule = entries(rows, links)
    bounds = {name: bound for name, row, link in schedule
              if link and (bound := plan_bound(row, link, args.config, args.set))}
    host = bench_report.machine()
    command = " ".join(["python -m tools.bench", *(sys.argv[1:] if argv is None else argv)])
    args.workdir.mkdir(parents=True, exist_ok=True)
    # The machine is shared: how loaded it was, as `uptime` says, when the rows ran.
    load = {"date": datetime.date.today().isoformat(),
            "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory() as tmp:
        results, failed = run(schedule, base_args, args.repeats, host["gpus"], pathlib.Path(tmp),
                              args.seeds)
    load["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    for error in failed.values():
        print(f"error: {error}", file=sys.stderr)
    if not results:
        return 1
    add_bounds(results, {name: bound for name, bound in bounds.items() if name in results})
    report = {"command": command, "machine": host, **load, "steps": args.steps,
              **({"epochs": args.epochs} if args.epochs > 1 else {}),
              "repeats": args.repeats,
              **({"seeds": list(range(args.repeats))} if args.seeds else {}),
              **({"links": links} if links != [None] else {}),
              "rows": results, **({"failed": failed} if failed else {})}
    (args.workdir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    drawn = bench_report.draw(report, args.workdir / "bench.png")
    print(bench_report.text(results))
    print(f"wrote {args.workdir / 'bench.json'}"
          + (f" and {args.workdir / 'bench.png'}" if drawn else f" ({bench_report.NO_CHART})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
