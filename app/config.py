"""Run configuration: defaults in one place, TOML override files, `--set` last.

The defaults below *are* the default run (`configs/mnist.toml` only names
them). Every other config file changes a few fields. Unknown keys, wrong
types and impossible values raise `ConfigError`, which the command line turns
into exit code 2 with the message alone.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import tomllib


class ConfigError(ValueError):
    """A user-facing configuration mistake. The message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # "mnist" (IDX files in `dir`), "tfds:<name>" or "synthetic".
    name: str = "mnist"
    # Directory of the IDX files; empty means the copy bundled with the project.
    dir: str = ""
    # Use only the first N training / test examples (0 = all). For smoke runs:
    # test accuracy is then over N images, and metrics.json says so.
    train_examples: int = 0
    test_examples: int = 0
    # Held out from the end of the training set for per-epoch validation, as the
    # classic MNIST examples did (55,000 train / 5,000 validation).
    validation_examples: int = 5000
    shuffle_buffer: int = 60000
    # Random translation of up to this many pixels in each direction (0 = off).
    augment_shift: int = 0
    # How the training data is split over the input pipelines (one per worker),
    # as tf.data's AutoShardPolicy names it. "auto": every source here is read
    # into memory, so "data". "data": pipeline i of n takes examples i, i+n, ...
    # (disjoint, together the whole set). "off": every pipeline reads the whole
    # set, each in its own shuffled order. ("file" needs a source stored as at
    # least one file per worker, which none of these sources is.)
    shard_policy: str = "auto"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "cnn"  # "cnn" or "mlp"
    dropout: float = 0.5


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # Tuned on real MNIST (README: Results): batch 32 and one annealed cosine
    # cycle per epoch put the first epoch above 99.0% test accuracy; batch 64
    # and 128 reach 98.95% and 98.68% there.
    epochs: int = 5
    global_batch_size: int = 32
    optimizer: str = "adam"  # "adam" or "sgd"
    learning_rate: float = 1e-3
    # "cosine" decays to `final_lr_fraction * learning_rate` over the whole run;
    # "cosine_restarts" does so every `lr_cycle_epochs`, each cycle starting
    # `lr_cycle_decay` times lower than the one before (SGDR, Loshchilov & Hutter).
    lr_schedule: str = "cosine_restarts"  # "cosine", "cosine_restarts" or "constant"
    final_lr_fraction: float = 0.01
    lr_cycle_epochs: int = 1
    lr_cycle_decay: float = 0.8
    # Speed switches (measured by `python -m app.bench`; README: Performance).
    # Steps per call of the compiled train function: fewer Python round trips.
    steps_per_execution: int = 1
    # Compile the train step with XLA.
    jit_compile: bool = False
    # "float32", or "mixed_bfloat16" / "mixed_float16": compute in 16 bits,
    # keep variables and the logits in float32 (Keras mixed precision).
    precision: str = "float32"
    seed: int = 0
    # Keras verbosity: "auto" shows a progress bar on a terminal.
    verbose: str = "auto"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    # Evaluate on the test set after every epoch too (not only at the end), so the
    # learning curve is on record. Costs about one forward pass of the test set.
    test_every_epoch: bool = True
    batch_size: int = 1000


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    # "auto" picks from TF_CONFIG and the local devices; see app/strategy.py.
    strategy: str = "auto"
    # Split the CPU into N logical devices (0 = leave it whole), so that
    # MirroredStrategy can run on a CPU-only machine.
    cpu_devices: int = 0
    # Split the first GPU into N logical GPUs (0 = leave the GPUs as they are),
    # each with `gpu_device_memory_mib` of memory: Mirrored on a one-GPU machine.
    gpu_devices: int = 0
    gpu_device_memory_mib: int = 4096
    # oneDNN kernels for CPU ops. TensorFlow turns them on by itself only on
    # CPUs with AVX-512 and newer; on the 2-core AVX2 machine of README:
    # Performance they trained the CNN 1.4x and 1.6x as fast in two runs.
    # Set before TF starts (app/train.py), as TF_ENABLE_ONEDNN_OPTS.
    onednn: bool = True
    # Where TensorFlow's CPU tensors get their memory when oneDNN is off (with
    # oneDNN on, TensorFlow always uses its oneDNN allocator, itself a BFC pool).
    # Set before TF starts (app/train.py), as TF_CPU_ALLOCATOR_USE_BFC.
    # "bfc": TensorFlow's best-fit-with-coalescing pool, which keeps freed memory
    #   for the next step's tensors;
    # "malloc": TensorFlow's default. Tensors over glibc's mmap threshold are
    #   mapped and unmapped every step, so each step faults their pages in and
    #   the kernel zeroes them again: at batch 512 that cost parameter-server
    #   workers most of all (README: Performance).
    cpu_allocator: str = "bfc"
    # TensorFlow thread pools (0 = TensorFlow's default).
    intra_op_threads: int = 0
    inter_op_threads: int = 0


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    connect_timeout_s: int = 120


@dataclasses.dataclass(frozen=True)
class PSConfig:
    # How large variables are split into ShardedVariables over the `ps` tasks:
    # "min_size": shards of at least `shard_bytes`, at most one per ps task
    #   (small variables stay whole; the big dense kernel spreads evenly);
    # "max_size": shards of at most `shard_bytes`;
    # "fixed": `num_shards` shards for every variable (0 = one per ps task);
    # "none": whole variables, placed round-robin as TF1 did.
    partitioner: str = "min_size"
    shard_bytes: int = 256 << 10
    num_shards: int = 0
    # "async": each worker's update is applied as it arrives (the classic
    # ps/worker default, Keras fit). "sync": every update averages the
    # gradients of the first `workers - backup_workers` workers computed on the
    # current parameters and drops the rest (app/sync_ps.py). In sync mode
    # train.global_batch_size is the examples per update, split over those workers.
    mode: str = "async"
    backup_workers: int = 0
    # "fp16": in async mode each worker pushes its gradients to the ps tasks as
    # float16, and the ps casts them back to float32 for the update: half the
    # bytes of every push (the variables are still read as float32).
    # "none": float32 both ways.
    compression: str = "none"


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    # MultiWorkerMirroredStrategy's all-reduce: "auto" lets TensorFlow pick,
    # "ring" (gRPC, CPU or GPU) or "nccl" (GPUs only).
    collective: str = "auto"
    # "fp16": each all-reduce sends the gradients as float16 (Horovod's
    # Compression.fp16, PyTorch DDP's fp16_compress_hook): half the bytes, the
    # sum cast back to float32 before the update. "none": float32 all the way.
    compression: str = "none"
    # Gradients are all-reduced in packs, last layer first, each closed once it
    # holds more than this many bytes (TensorFlow's
    # CommunicationOptions.bytes_per_pack). A pack is sent as soon as its
    # gradients exist, so the last layers' all-reduce overlaps the backward
    # pass of the first ones. 0: one pack after the whole backward pass
    # (TensorFlow's default).
    bytes_per_pack: int = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    # Straggler injection (parameter-server runs): worker `slow_worker` sleeps
    # after computing each gradient until its step took `slow_factor` times as
    # long. -1 = off.
    slow_worker: int = -1
    slow_factor: float = 1.0
    # Log `step S` every N steps of training (0 = never), on every training task:
    # the fault tests read it to kill a task at a known step.
    log_every_steps: int = 0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    keep: int = 3
    # Back up the training state (<workdir>/backup) every N steps as well as at
    # each epoch's end, so a killed run resumes at most N steps behind where it
    # died (0 = at epoch ends only). Each backup writes the model and its
    # optimizer slots: on the CNN about 40 MB.
    every_steps: int = 0


@dataclasses.dataclass(frozen=True)
class Config:
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    cluster: ClusterConfig = ClusterConfig()
    ps: PSConfig = PSConfig()
    sync: SyncConfig = SyncConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    debug: DebugConfig = DebugConfig()


_CHOICES = {
    "data.shard_policy": ("auto", "data", "off"),
    "model.name": ("cnn", "mlp"),
    "train.optimizer": ("adam", "sgd"),
    "train.lr_schedule": ("cosine", "cosine_restarts", "constant"),
    "train.verbose": ("auto", "0", "1", "2"),
    "train.precision": ("float32", "mixed_bfloat16", "mixed_float16"),
    "ps.partitioner": ("min_size", "max_size", "fixed", "none"),
    "ps.mode": ("async", "sync"),
    "ps.compression": ("none", "fp16"),
    "sync.collective": ("auto", "ring", "nccl"),
    "sync.compression": ("none", "fp16"),
    "runtime.cpu_allocator": ("bfc", "malloc"),
    "runtime.strategy": (
        "auto", "default", "mirrored", "multi_worker_mirrored", "parameter_server"),
}
_POSITIVE = ("train.epochs", "train.global_batch_size", "train.steps_per_execution",
             "eval.batch_size", "cluster.connect_timeout_s", "ps.shard_bytes", "checkpoint.keep",
             "train.learning_rate", "train.lr_cycle_epochs", "train.lr_cycle_decay",
             "runtime.gpu_device_memory_mib")
_NON_NEGATIVE = ("data.train_examples", "data.test_examples", "data.validation_examples",
                 "data.shuffle_buffer", "data.augment_shift", "runtime.cpu_devices",
                 "runtime.gpu_devices",
                 "runtime.intra_op_threads", "runtime.inter_op_threads", "train.seed",
                 "ps.num_shards", "ps.backup_workers", "sync.bytes_per_pack",
                 "checkpoint.every_steps", "debug.log_every_steps")


def load(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at `path`, then `key=value` overrides; validated."""
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


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)


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
    """Checks that need no cluster; the batch/replica check lives with the strategy."""
    flat = flatten(config)
    if config.data.shard_policy == "file":
        raise ConfigError(
            "data.shard_policy = 'file' needs a source stored as at least one file per "
            f"worker, but data.name = {config.data.name!r} is read into memory; use auto "
            "(data), data or off")
    for key, allowed in _CHOICES.items():
        if flat[key] not in allowed:
            raise ConfigError(f"{key} = {flat[key]!r} is not one of {', '.join(allowed)}")
    for key in _POSITIVE:
        if flat[key] <= 0:
            raise ConfigError(f"{key} = {flat[key]} must be > 0")
    for key in _NON_NEGATIVE:
        if flat[key] < 0:
            raise ConfigError(f"{key} = {flat[key]} must be >= 0")
    if config.debug.slow_worker < -1:
        raise ConfigError(f"debug.slow_worker = {config.debug.slow_worker} must be a worker "
                          "index, or -1 for none")
    if config.debug.slow_factor < 1:
        raise ConfigError(f"debug.slow_factor = {config.debug.slow_factor} must be >= 1")
    if not 0 <= config.model.dropout < 1:
        raise ConfigError(f"model.dropout = {config.model.dropout} must be in [0, 1)")
    if not 0 <= config.train.final_lr_fraction <= 1:
        raise ConfigError(
            f"train.final_lr_fraction = {config.train.final_lr_fraction} must be in [0, 1]")
    name = config.data.name
    if name not in ("mnist", "synthetic") and not (name.startswith("tfds:") and len(name) > 5):
        raise ConfigError(
            f"data.name = {name!r} is not one of mnist, synthetic, tfds:<name> "
            "(e.g. tfds:fashion_mnist)")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
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
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    return Config(**{name: hints[name](**tree[name]) for name in sections})
