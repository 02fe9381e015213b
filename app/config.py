"""Run configuration: defaults in one place, TOML override files, `--set` last.

The defaults below *are* the default run (`configs/mnist.toml` only names
them). Every other config file changes a few fields. Unknown keys, wrong
types and impossible values raise `ConfigError`, which the command line turns
into exit code 2 with the message alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import tomllib
import typing
from collections.abc import Mapping
from typing import Any

# The smallest runtime.memory_limit_gib: TensorFlow's import alone holds 0.6 GiB
# resident (app/cluster/memory.py), and a task builds a model and a batch besides.
MIN_MEMORY_LIMIT_GIB = 1.0


# host:port where host is a name, an IPv4 address or a bracketed IPv6 address.
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def is_address(text: str) -> bool:
    """Whether `text` is host:port with a port in 1..65535 (TF_CONFIG's, data.service's)."""
    match = _ADDRESS.match(text)
    return bool(match) and 0 < int(match.group(2)) < 65536


class ConfigError(ValueError):
    """A user-facing configuration mistake. The message names the field and the fix."""


def field(default: Any, *, choices: tuple[str, ...] = (), minimum: float | None = None,
          maximum: float | None = None, above: float | None = None,
          below: float | None = None) -> Any:
    """A config field with its default and the values it accepts: one of `choices`, or
    a number >= `minimum` / > `above` and <= `maximum` / < `below`. `check_section`
    enforces them, for the sections here and for a task's own `Params`."""
    rules = {k: v for k, v in (("choices", choices), ("minimum", minimum),
                               ("maximum", maximum), ("above", above), ("below", below))
             if v not in (None, ())}
    return dataclasses.field(default=default, metadata=rules)


# The built-in tasks (app/tasks/): the name `task.name` gives, the class it stands for.
BUILTIN_TASKS = {"mnist": "app.tasks.mnist:Mnist",
                 "recommender": "app.tasks.recommender:Recommender"}


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What to train: the task, and its own parameters as the other keys of `[task]`."""

    # A built-in task ("mnist", "recommender") or an import path "package.module:ClassName"
    # (app/task.py), found from the current directory and PYTHONPATH.
    name: str = "mnist"
    # The other keys of [task]: the task's own parameters, checked by its Params
    # dataclass (for mnist: app/tasks/mnist.py).
    params: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the training input pipelines run and how the data is divided among them."""

    # How the training data is split over the input pipelines (one per worker),
    # as tf.data's AutoShardPolicy names it. "data": pipeline i of n takes
    # records i, i+n, ... (disjoint, together the whole set). "file": pipeline i
    # reads files i, i+n, ... (a task that reads at least one file per worker).
    # "auto": by file where the task has enough files, else by record. "off":
    # every pipeline reads the whole set, each in its own shuffled order (under
    # parameter servers, in one order: app/task.py, Task.pipeline_seed).
    shard_policy: str = field("auto", choices=("auto", "data", "file", "off"))
    # The tf.data service dispatcher's host:port (app/distribute/data_service.py): the
    # training input pipelines then run in its tf.data workers, sharded among all
    # trainers on demand (shard_policy does not apply), and not in the trainers.
    # "" = off. `launch.local --data-workers N` starts a service and sets it.
    service: str = ""
    # Read the training examples by index when the task gives them so
    # (Task.train_source): one global order of (train.seed, epoch), every example
    # once per epoch across failures, resumes and changes of cluster shape
    # (app/indexed.py). false: the task's train_dataset pipeline (shard_policy applies).
    by_index: bool = True
    # The order examples read by index come in, within each epoch. "global": one
    # permutation of all the examples, so a batch reads from anywhere in the data.
    # "windowed": the examples in shards of `shard_examples` consecutive indices,
    # the shards permuted, then the examples shuffled within each window of
    # `window_shards` shards (as MosaicML Streaming shuffles): a reader holds one
    # window of records and reads each shard in one pass, at the cost of a
    # shuffle over a window rather than the whole set (docs/tasks.md says what
    # it cost). "auto": windowed for examples read from files
    # (data.indexed_records, data.indexed_arrays above 8 MiB), global for
    # examples in memory. Both are functions of (train.seed, epoch, index)
    # alone: a resume on any number of workers reads the same order.
    order: str = field("auto", choices=("auto", "global", "windowed"))
    # Consecutive examples per shard of the windowed order.
    shard_examples: int = field(1024, above=0)
    # Shards per window of the windowed order: a reader holds up to 2 windows of
    # records (the one in use and the one read ahead), e.g. 2 x 8 x 1024 examples
    # of 16 KiB: 256 MiB.
    window_shards: int = field(8, above=0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The optimisation: length, batch, optimizer, learning-rate schedule, speed switches."""

    # Passes over the training data (each `steps_per_epoch` steps long).
    epochs: int = field(5, above=0)
    # Steps per epoch; 0 = one pass over the task's training examples. Needed
    # for a task whose training data has no end.
    steps_per_epoch: int = field(0, minimum=0)
    # The examples of one optimizer step, split evenly over the replicas that
    # compute it. Under parameter servers each worker's step is one whole batch;
    # with ps.mode = "sync", one update's examples split over the workers it waits for.
    global_batch_size: int = field(32, above=0)
    # The optimizer, unless the task's `optimizer()` gives its own ("sgd" uses
    # momentum 0.9).
    optimizer: str = field("adam", choices=("adam", "sgd", "adagrad"))
    # The peak learning rate: where each schedule starts.
    learning_rate: float = field(1e-3, above=0)
    # "cosine" decays to `final_lr_fraction * learning_rate` over the whole run;
    # "cosine_restarts" does so every `lr_cycle_epochs`, each cycle starting
    # `lr_cycle_decay` times lower than the one before (SGDR, Loshchilov & Hutter).
    lr_schedule: str = field("cosine_restarts",
                             choices=("cosine", "cosine_restarts", "constant"))
    # Where a cosine schedule ends, as a fraction of `learning_rate`.
    final_lr_fraction: float = field(0.01, minimum=0, maximum=1)
    # Epochs per cycle of "cosine_restarts".
    lr_cycle_epochs: int = field(1, above=0)
    # Each "cosine_restarts" cycle's peak, as a multiple of the one before.
    lr_cycle_decay: float = field(0.8, above=0)
    # Steps per call of the compiled train function: fewer Python round trips;
    # under parameter servers, steps per scheduled closure (a closure run again after
    # its worker died runs them all again); 1 in ps.mode = "sync".
    steps_per_execution: int = field(1, above=0)
    # Compile the train step with XLA.
    jit_compile: bool = False
    # "float32", or "mixed_bfloat16" / "mixed_float16": compute in 16 bits,
    # keep variables and the logits in float32 (Keras mixed precision).
    precision: str = field("float32", choices=("float32", "mixed_bfloat16", "mixed_float16"))
    # Random seed: the weights' initialisation and the task's shuffles (Task.seed).
    seed: int = field(0, minimum=0)
    # Resume bit for bit: a synchronous run (one process, Mirrored,
    # MultiWorkerMirrored) stopped and resumed from its backup ends with the
    # weights of the same run never stopped, if its input goes on where it stopped
    # too (the task's). TensorFlow runs its deterministic kernels
    # (enable_op_determinism: slower on GPUs, and an op without one fails), and
    # Keras 2's random layers (Dropout, ...) draw from a tf.random.Generator whose
    # state the backup holds (other numbers than without it; Keras 3's layers
    # always keep theirs there). Without it a resumed Keras 2 run draws its first
    # steps' dropout masks again. Refused under parameter servers (updates arrive
    # in no fixed order). docs/restarts.md, "Resuming bit for bit".
    deterministic: bool = False
    # Keras verbosity: "auto" shows a progress bar on a terminal.
    verbose: str = field("auto", choices=("auto", "0", "1", "2"))


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation: every example of the task's validation and test splits, exactly once."""

    # Evaluate on the test set after every epoch too (not only at the end), so the
    # learning curve is on record. Costs about one forward pass of the test set.
    test_every_epoch: bool = True
    # Examples per evaluation batch.
    batch_size: int = field(1000, above=0)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """The strategy, the devices and TensorFlow's CPU settings of each process."""

    # "auto" picks from TF_CONFIG and the local devices; see app/strategy.py.
    strategy: str = field("auto", choices=(
        "auto", "default", "mirrored", "multi_worker_mirrored", "parameter_server"))
    # Split the CPU into N logical devices (0 = leave it whole), so that
    # MirroredStrategy can run on a CPU-only machine.
    cpu_devices: int = field(0, minimum=0)
    # Split the first GPU into N logical GPUs (0 = leave the GPUs as they are),
    # each with `gpu_device_memory_mib` of memory: Mirrored on a one-GPU machine.
    gpu_devices: int = field(0, minimum=0)
    # The memory of each logical GPU that `gpu_devices` makes.
    gpu_device_memory_mib: int = field(4096, above=0)
    # oneDNN kernels for CPU ops. TensorFlow turns them on by itself only on
    # CPUs with AVX-512 and newer; this turns them on everywhere. Set before
    # TF starts (app/train.py), as TF_ENABLE_ONEDNN_OPTS.
    onednn: bool = True
    # Where TensorFlow's CPU tensors get their memory when oneDNN is off (with
    # oneDNN on, TensorFlow always uses its oneDNN allocator, itself a BFC pool).
    # Set before TF starts (app/train.py), as TF_CPU_ALLOCATOR_USE_BFC.
    # "bfc": TensorFlow's best-fit-with-coalescing pool, which keeps freed memory
    #   for the next step's tensors; "malloc": TensorFlow's default, which maps
    #   and unmaps tensors above glibc's mmap threshold every step.
    cpu_allocator: str = field("bfc", choices=("bfc", "malloc"))
    # Threads that run one op (0 = TensorFlow's default). launch.local sets it
    # to cores / workers unless given.
    intra_op_threads: int = field(0, minimum=0)
    # Ops run at once (0 = TensorFlow's default). launch.local sets it to
    # workers + 1 unless given: fewer can deadlock a ps serving every worker.
    inter_op_threads: int = field(0, minimum=0)
    # Whether TensorFlow's thread pools, in every task, spin a while for their next op
    # before they sleep (TensorFlow's default: less latency, more CPU); false: they
    # sleep at once, and leave the cores to the other tasks of a cluster that shares
    # them (ConfigProto's disable_thread_spinning; docs/benchmarks.md). Fixed when
    # TensorFlow starts, as the thread counts are. launch.local sets it to false
    # unless given: its tasks share one host's cores; launch.slurm too, for the tasks
    # that share a node.
    thread_spinning: bool = True
    # The memory each task may use, in GiB (0 = no limit): set in each task's
    # own process before TensorFlow starts, as RLIMIT_DATA (app/cluster/memory.py says
    # why not a cgroup or RLIMIT_AS). A task that outgrows it stops with exit
    # code 5, naming itself and the limit. tools.plan and launch.local refuse a
    # cluster whose predicted peak per task exceeds it; give the launcher's
    # resources the same limit (launch/k8s, launch/slurm/train.sbatch).
    memory_limit_gib: float = field(0.0, minimum=0)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """How long the tasks of a parameter-server cluster wait for each other."""

    # Seconds the chief waits for every ps and worker task to accept
    # connections before it stops with exit code 2, naming the missing ones;
    # that a ps or worker task waits for a chief that left without
    # finishing to come back, before it exits 203 to be restarted; and that a
    # chief that failed for good (exit 1 or 2) waits to tell them so.
    connect_timeout_s: int = field(120, above=0)


@dataclasses.dataclass(frozen=True)
class PSConfig:
    """Parameter-server training: variable placement, update mode, gradient compression."""

    # How large variables are split into ShardedVariables over the `ps` tasks:
    # "min_size": shards of at least `shard_bytes`, at most one per ps task
    #   (small variables stay whole; the big dense kernel spreads evenly);
    # "max_size": shards of at most `shard_bytes`;
    # "fixed": `num_shards` shards for every variable (0 = one per ps task);
    # "none": whole variables, placed round-robin as TF1 did.
    partitioner: str = field("min_size", choices=("min_size", "max_size", "fixed", "none"))
    # The shard size bound of "min_size" (at least) and "max_size" (at most).
    shard_bytes: int = field(256 << 10, above=0)
    # Shards per variable with "fixed" (0 = one per ps task).
    num_shards: int = field(0, minimum=0)
    # "async": each worker's update is applied as it arrives (the classic
    # ps/worker default, Keras fit). "sync": every update averages the
    # gradients of the first `workers - backup_workers` workers computed on the
    # current parameters and drops the rest (app/distribute/ps/sync.py). In sync mode
    # train.global_batch_size is the examples per update, split over those workers.
    mode: str = field("async", choices=("async", "sync"))
    # With mode = "sync": the workers whose gradients an update does not wait
    # for (fewer than the workers).
    backup_workers: int = field(0, minimum=0)
    # "fp16": each worker pushes its gradients to the ps tasks as float16, and
    # the ps casts them back to float32 for the update: half the bytes of every
    # push (the reads: read_compression); in sync mode the ps tasks
    # also hold the workers' gradients as float16, half the memory.
    # "none": float32 pushes.
    compression: str = field("none", choices=("none", "fp16"))
    # In async mode, in the project's loop (a task read by index, any Keras 3 task):
    # the steps of a scheduled closure (train.steps_per_execution) read the model's
    # variables from the ps tasks once every `read_every` of them (a table's lookups
    # are still made each step). 1: every step reads them. m > 1: fewer bytes, but a
    # step's gradient is of the weights as they were up to m - 1 of the worker's own
    # updates before, beside the other workers' (docs/benchmarks.md). At most
    # train.steps_per_execution: each closure starts with a read.
    read_every: int = field(1, above=0)
    # In the project's loop (as read_every; in ps.mode = sync too, where each
    # contribution reads the variables after each update): "fp16": each read of the
    # model's float32 variables crosses from the ps tasks as float16 (the ps casts, the
    # worker casts back), half the bytes of every read; the forward and backward pass
    # see the weights rounded to float16, and the update is applied to the float32
    # variables on the ps tasks. No staleness beyond async's own. "none": float32.
    read_compression: str = field("none", choices=("none", "fp16"))
    # In the project's loop (as read_every): a closure's train.steps_per_execution
    # steps traced one after another, rather than as a loop that the ps tasks run an
    # iteration at a time (at 8 steps and batch 32: 1.02 times as fast in one run, the
    # ps tasks with 11% less CPU; docs/benchmarks.md), but a closure's function takes
    # that many times as long to trace, once for each number of steps a closure runs
    # (an epoch's last may run fewer). Beyond 8 steps, a loop over groups of at most 8
    # steps, each group unrolled: tracing never costs more than 8 steps' worth.
    # false: a loop, traced once.
    unroll: bool = True


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """Synchronous all-reduce (MultiWorkerMirroredStrategy; `compression` also Mirrored)."""

    # MultiWorkerMirroredStrategy's all-reduce: "auto" lets TensorFlow pick,
    # "ring" (gRPC, CPU or GPU) or "nccl" (GPUs only).
    collective: str = field("auto", choices=("auto", "ring", "nccl"))
    # "fp16": each all-reduce sends the gradients as float16 (Horovod's
    # Compression.fp16, PyTorch DDP's fp16_compress_hook): half the bytes, the
    # sum cast back to float32 before the update. "none": float32 all the way.
    compression: str = field("none", choices=("none", "fp16"))
    # Gradients are all-reduced in packs, last layer first, each closed once it
    # holds more than this many bytes (TensorFlow's
    # CommunicationOptions.bytes_per_pack). A pack is sent as soon as its
    # gradients exist, so the last layers' all-reduce overlaps the backward
    # pass of the first ones. 0: one pack after the whole backward pass
    # (TensorFlow's default).
    bytes_per_pack: int = field(4 * 1024 * 1024, minimum=0)


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    """Fault injection for tests and benchmarks."""

    # Straggler injection (parameter-server runs): worker `slow_worker` sleeps
    # after computing each gradient until its step took `slow_factor` times as
    # long. -1 = off.
    slow_worker: int = field(-1, minimum=-1)
    # How many times as long the slow worker's steps take.
    slow_factor: float = field(1.0, minimum=1)
    # Log `step S` every N steps of training (0 = never), on every training task:
    # the fault tests read it to kill a task at a known step.
    log_every_steps: int = field(0, minimum=0)
    # Once training passes step N (0 = never), wait until the file `hold_file`
    # exists before the next step: a fault test kills a task there, while the run
    # still needs it, then creates the file. Under a ClusterCoordinator the steps
    # scheduled so far run on, and none is scheduled past N until then.
    hold_at_step: int = field(0, minimum=0)
    # The file that ends the hold of `hold_at_step`, on every task that reaches it.
    hold_file: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The per-epoch checkpoints in `<workdir>/checkpoints` (the evaluator reads them)
    and the backup in `<workdir>/backup` that a stopped run resumes from."""

    # Checkpoints kept: the newest ones.
    keep: int = field(3, above=0)
    # Back up the training state (<workdir>/backup) every N steps as well as at
    # each epoch's end, so a killed run resumes at most N steps behind where it
    # died (0 = at epoch ends only). Each backup writes the model and its
    # optimizer slots.
    every_steps: int = field(0, minimum=0)


@dataclasses.dataclass(frozen=True)
class Config:
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    cluster: ClusterConfig = ClusterConfig()
    ps: PSConfig = PSConfig()
    sync: SyncConfig = SyncConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    debug: DebugConfig = DebugConfig()


def load(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at `path`, then `key=value` overrides; validated.

    The task's own parameters (the rest of [task]) are checked when the task is
    found (`app.task.create`), since that may import the user's code.
    """
    tree = to_dict(Config())
    if path:
        _merge(tree, _read_toml(path), source=path)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.epochs=3")
        _set_dotted(tree, key.strip(), _parse_value(text.strip()), source="--set")
    config = _build(tree)
    validate(config)
    return config


def sources(argv: typing.Sequence[str]) -> tuple[str | None, list[str]]:
    """The `--config` path (or None) and the `--set` items of an `app.train` command
    line, the rest ignored: what a launcher reads of the arguments it hands on."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    parser.add_argument("--set", action="append", default=[])
    given = parser.parse_known_args(list(argv))[0]
    return given.config, given.set


def chosen(path: str | None = None, overrides: typing.Sequence[str] = ()) -> set[str]:
    """The dotted keys (`runtime.thread_spinning`) that the TOML file at `path` and the
    `key=value` overrides set, whatever their values: what a launcher's own defaults
    must leave alone. Input that `load` would refuse is left for it to report: an
    unreadable file sets nothing here."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    try:
        tree = _read_toml(path) if path else {}
    except ConfigError:
        tree = {}
    return keys | {f"{section}.{key}" for section, values in tree.items()
                   if isinstance(values, dict) for key in values}


def unless_chosen(settings: Mapping[str, Any], argv: typing.Sequence[str]) -> list[str]:
    """`--set key=value` for each of a launcher's own `settings` that the `app.train`
    command line `argv` does not choose (`chosen`, in its `--config` file or `--set`s)."""
    given = chosen(*sources(argv))
    return [arg for key, value in settings.items() if key not in given
            for arg in ("--set", f"{key}={value}")]


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """{section: {key: value}}, with the task's parameters inside [task] beside its name."""
    tree = {f.name: dataclasses.asdict(getattr(config, f.name))
            for f in dataclasses.fields(config)}
    tree["task"] = {"name": config.task.name, **config.task.params}
    return tree


def flatten(config: Config) -> dict[str, Any]:
    """{"section.key": value} for every field."""
    return {f"{s}.{k}": v for s, values in to_dict(config).items() for k, v in values.items()}


def to_toml(config: Config) -> str:
    """Serialise to TOML that `load` reads back to an equal Config."""
    lines = []
    for section, values in to_dict(config).items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


def validate(config: Config) -> None:
    """Every section's field rules, and the checks that span fields; the task's
    parameters and the batch/replica check come later (task, runner)."""
    for section in dataclasses.fields(config):
        if section.name != "task":
            check_section(section.name, getattr(config, section.name))
    limit = config.runtime.memory_limit_gib
    if 0 < limit < MIN_MEMORY_LIMIT_GIB:
        raise ConfigError(
            f"runtime.memory_limit_gib = {limit:g} is below the {MIN_MEMORY_LIMIT_GIB:g} GiB "
            "a task needs to start TensorFlow at all (app/cluster/memory.py); give at least "
            f"{MIN_MEMORY_LIMIT_GIB:g}, or 0 for no limit")
    if config.debug.hold_at_step and not config.debug.hold_file:
        raise ConfigError(f"debug.hold_at_step = {config.debug.hold_at_step} needs "
                          "debug.hold_file: the file whose creation ends the hold")
    address = config.data.service.removeprefix("grpc://")
    if address and not is_address(address):
        raise ConfigError(f"data.service = {config.data.service!r} is not a dispatcher's "
                          "host:port (e.g. localhost:5050); set it to the address of `python "
                          "-m app.distribute.data_service dispatcher`, or to \"\" to read input "
                          "in the trainers")
    if not config.task.name:
        raise ConfigError(f"task.name is empty; name a built-in task ({', '.join(BUILTIN_TASKS)}) "
                          "or an import path like 'my_package.my_module:MyTask'")
    task_target(config.task.name)  # before TensorFlow is imported, which finding it does


def task_target(name: str) -> str:
    """The import path `module:ClassName` that `task.name` stands for (a built-in
    task's, or the name itself); ConfigError when it is neither. Reads nothing and
    imports nothing: `app.task.find` imports it."""
    target = BUILTIN_TASKS.get(name, name)
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr.isidentifier():
        close = difflib.get_close_matches(name, BUILTIN_TASKS, n=1)
        raise ConfigError(
            f"task.name = {name!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor "
            "an import path like 'my_package.my_module:MyTask'"
            + (f"; did you mean {close[0]}?" if close else ""))
    return target


def choices(section: type, name: str) -> tuple[str, ...]:
    """The values that field `name` of the config section class `section` accepts."""
    return next(f.metadata["choices"] for f in dataclasses.fields(section) if f.name == name)


def check_section(name: str, values: Any) -> None:
    """Check each field of the dataclass instance `values` against its `field` rules."""
    for f in dataclasses.fields(values):
        value, rules = getattr(values, f.name), f.metadata
        if "choices" in rules and value not in rules["choices"]:
            raise ConfigError(f"{name}.{f.name} = {value!r} is not one of "
                              f"{', '.join(rules['choices'])}")
        if not _within(value, rules):
            raise ConfigError(f"{name}.{f.name} = {value} must be {_bounds(rules)}")


def _within(value: Any, rules: Mapping[str, Any]) -> bool:
    return not (("minimum" in rules and value < rules["minimum"])
                or ("above" in rules and value <= rules["above"])
                or ("maximum" in rules and value > rules["maximum"])
                or ("below" in rules and value >= rules["below"]))


def _bounds(rules: Mapping[str, Any]) -> str:
    """"> 0", ">= 1", "in [0, 1)": the accepted range, as the error states it."""
    low = ("[", rules["minimum"]) if "minimum" in rules else ("(", rules.get("above"))
    high = ("]", rules["maximum"]) if "maximum" in rules else (")", rules.get("below"))
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    return f"{'<=' if high[0] == ']' else '<'} {high[1]}"


def build_section(name: str, kind: type, values: Mapping[str, Any]) -> Any:
    """An instance of the dataclass `kind` from `values`: unknown keys, wrong types
    and values outside each field's rules raise ConfigError naming `name.key`."""
    defaults = {f.name: getattr(kind(), f.name) for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        known = ", ".join(defaults) or "none"
        raise ConfigError(f"unknown key '{name}.{unknown[0]}'; keys of [{name}] are {known}")
    try:
        instance = kind(**{k: _coerce(f"{name}.{k}", defaults[k], v) for k, v in values.items()})
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a Params' own __post_init__ check
        raise ConfigError(f"[{name}]: {e}") from None
    check_section(name, instance)
    return instance


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as e:  # a directory, no permission to read it
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror}); give a TOML "
                          "file's path") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None


def _merge(tree: dict, updates: dict, source: str) -> None:
    for section, values in updates.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{source}: top-level key {section!r} must be a [section]; "
                f"sections are {', '.join(tree)}")
        for key, value in values.items():
            _set_dotted(tree, f"{section}.{key}", value, source)


def _set_dotted(tree: dict, dotted: str, value: Any, source: str) -> None:
    section, _, key = dotted.partition(".")
    if section == "task" and key != "name" and key:  # the task's own parameter: checked later
        tree[section][key] = value
        return
    if section not in tree:
        raise ConfigError(
            f"{source}: unknown section {section!r} in {dotted!r}; "
            f"sections are {', '.join(tree)}")
    if key not in tree[section]:
        raise ConfigError(
            f"{source}: unknown key {dotted!r}; keys of [{section}] are "
            f"{', '.join(tree[section])}")
    tree[section][key] = _coerce(dotted, tree[section][key], value)


def _coerce(dotted: str, default: Any, value: Any) -> Any:
    """Accept `value` only if it has the default's type (ints widen to floats)."""
    kind = type(default)
    if kind is float and type(value) is int:
        return float(value)
    if kind is str and type(value) in (int, float):
        return str(value)  # lets `--set train.verbose=2` through
    if type(value) is not kind:
        raise ConfigError(
            f"{dotted} = {value!r} has type {type(value).__name__}, expected "
            f"{kind.__name__} (e.g. {dotted} = {json.dumps(default)})")
    return value


def _parse_value(text: str) -> Any:
    """`--set` values are TOML values; a bare word is taken as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _build(tree: dict[str, dict[str, Any]]) -> Config:
    hints = typing.get_type_hints(Config)
    task = dict(tree["task"])
    sections = {name: hints[name](**tree[name]) for name in hints if name != "task"}
    return Config(task=TaskConfig(task.pop("name"), task), **sections)
