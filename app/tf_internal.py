"""The TensorFlow internals this project uses, walled off here (read from TF 2.21).

Everything else uses TensorFlow's public API. If TensorFlow moves either of
these, only this module breaks, and only the runs that use it:

- `distribute_per_replica`: MultiWorkerMirroredStrategy refuses the public
  `InputReplicationMode.PER_REPLICA`; `app.strategy.MultiWorkerMirroredStrategy`
  calls TensorFlow's own per-replica input path for one-replica workers. If it
  moves, those workers fail at the first fit(); the public fallback is to drop
  the subclass (TF's MultiDeviceIterator, slower on CPUs).
- `ticks`, `sleep`: tf.data's testing sleep transformation, the one sleep that can run
  inside a remote function without burning a core. A synchronous run's workers wait
  with it for their turn (`exchange.wait_turn`), and `debug.slow_worker` (straggler
  injection) sleeps with it. If it moves, `ps.mode = "sync"` fails as its step is
  traced (tests/test_sync_ps.py); there is no public way to wait inside a remote
  function but a loop that spins.
- `exported_names`: the function through which `tf.saved_model.save` copies each
  variable into the SavedModel's graph, named as the variable is. If it moves,
  `tests/test_dialects.py` fails on an export with a layer whose name begins with
  `_`; the public way is to rename the layer.
- `op_determinism_enabled`, `disable_op_determinism`: TensorFlow exports
  `enable_op_determinism` only; `app.run.determinism` turns it off again after a run
  (tests train one config after another in one process). If they move, that
  scope fails as it ends; the public way is to leave determinism on for the
  rest of the process.
- `in_control_flow`: whether a graph being traced is a branch of `tf.cond` or a
  loop of `tf.while_loop` (autograph's `if` and `for` on tensors): ps.mode = sync
  refuses a train_step whose optimizer update runs there (`app.distribute.ps.sync`).
  If it moves, that check fails on every sync run; there is no public way to ask.
- `sharded_variable`, `tracked_list`: TensorFlow's ShardedVariable over variables
  made apart, and a list a checkpoint names the entries of, as tf_keras' optimizer
  saves its slots of a table's shards. If they move, the backup of Keras 3's loop
  fails (`tests/test_resume_shards.py`). Only a partitioner makes a ShardedVariable
  publicly; a list assigned to an attribute of a `tf.Module` is wrapped so.
- `variable_reads`: ParameterServerStrategy's cached variable reads
  (`distribute_utils.cache_variable_reads`, `ps_values.CachingVariable`), made to
  read the model's variables once per closure of several steps (`ps.read_every`) or
  as float16 (`ps.read_compression`) and to keep their gradients. If they move, such
  closures fail to trace (tests/test_steps_per_execution.py); the public way is
  `ps.read_every = 1` and `ps.read_compression = "none"`.
- `new_collective_keys`: every MirroredStrategy of a process numbers its
  collective ops from the same keys, so the second one a process trains with
  fails its first all-reduce of another shape ("Shape mismatch in the collective
  instance 100", tensorflow/tensorflow#62790); TF's own tests move the class's
  key base the same way (strategy_combinations.py). If it moves, `app.strategy`
  fails to create a MirroredStrategy (tests/test_strategy.py); the public way is
  one MirroredStrategy per process.
- `stop_thread_spinning`: makes the thread pools this process's TensorFlow starts with
  sleep at once when they have no op, rather than spin a while first (ConfigProto's
  `disable_thread_spinning`), in the eager context's config before it starts.
  `tf.distribute.Server` takes a ConfigProto, but the eager context (one process,
  Mirrored, a MultiWorkerMirrored worker, a parameter-server chief) has no public
  setter for it. Only a run with `runtime.thread_spinning = false` calls it; if it
  moves, such a run fails as it configures its runtime (tests/test_strategy.py), and
  the public way is to leave the pools spinning, TensorFlow's default.
- `is_ps_failure`: the ClusterCoordinator's own test of whether a step's error is a
  ps task's failure, which knows how a ps restarted on its address answers. If it
  moves, a chief whose ps came back before a step reached it exits 1 rather than
  203 (tests/test_runners.py); there is no public way to ask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import tensorflow as tf


def distribute_per_replica(strategy, dataset_fn, options):
    """What MirroredStrategy does for PER_REPLICA input, for a worker's one replica."""
    from tensorflow.python.distribute import input_util

    extended = strategy.extended
    return input_util.get_distributed_datasets_from_function(
        dataset_fn, extended._input_workers_with_options(options),
        [extended._make_input_context()], strategy, options)


def new_collective_keys() -> None:
    """Make the next MirroredStrategy of this process number its collective ops
    from keys no earlier one used (TF 2.21 mirrored_strategy.py,
    `_make_collective_ops_with_fallbacks`)."""
    tf.distribute.MirroredStrategy._collective_key_base += 100_000


def ticks(microseconds: tf.Tensor):
    """Inside a tf.function, an iterator each `next` of which sleeps `microseconds`
    (and gives 0), without holding a core. Make it once, before a loop that waits:
    making an iterator is most of a sleep's cost (below).

    Its dataset is neither autotuned nor rewritten. With tf.data's defaults a sleep of
    1 ms made in a loop cost 2.8 ms of CPU and took 5.3 ms: a worker waiting for its
    turn in a synchronous run kept half a core busy. Without them a sleep made in the
    loop costs 0.7 ms of CPU, a `next` of one iterator 0.2 ms (`experiments/sleep_cost.py`).
    """
    from tensorflow.python.data.experimental.ops.testing import sleep as transformation

    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.apply_default_optimizations = False
    delays = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).repeat().apply(
        transformation(microseconds))
    return iter(delays.with_options(options))


def sleep(microseconds: tf.Tensor) -> tf.Tensor:
    """Sleep `microseconds` once inside a tf.function, without holding a core (`ticks`)."""
    return next(ticks(microseconds))


def in_control_flow(graph, outer) -> bool:
    """Whether `graph`, traced within `outer`, is inside a `tf.cond` branch or a
    `tf.while_loop` body or condition (TF 2.21 control_flow_v2_func_graphs.py)."""
    from tensorflow.python.ops import control_flow_v2_func_graphs as flow

    while graph is not None and graph is not outer:
        if isinstance(graph, flow.ControlFlowFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def uninitialized_variable(shape, dtype, name=None, trainable=None):
    """A resource variable of `shape` and `dtype` that holds no value."""
    from tensorflow.python.ops import resource_variable_ops

    return resource_variable_ops.UninitializedVariable(
        shape=shape, dtype=tf.as_dtype(dtype), name=name,
        trainable=True if trainable is None else trainable)


def sharded_variable(parts: list[tf.Variable]):
    """One variable of `parts`, row blocks in order: checkpointed as a partitioner's
    ShardedVariable, one slice of the whole per part, so that it restores into any
    other number of parts (tf_keras 2.21 optimizer.py, `_ShardedVariableBuilder`)."""
    return tf.__internal__.distribute.ShardedVariable(parts)


def tracked_list(values: list):
    """`values` as a list a checkpoint saves entry by entry, named by position."""
    return tf.__internal__.tracking.wrap(list(values))


@contextlib.contextmanager
def exported_names(rename: Callable[[str], str]) -> Iterator[None]:
    """Within it, a SavedModel being written names the copy of each variable `name`
    `rename(name)`; the variables themselves keep their names.

    `tf.saved_model.save` copies each variable into the graph it writes under the
    variable's own name, as a root name scope (TF 2.21 resource_variable_ops.py,
    `copy_to_graph_uninitialized`), and a root scope may not begin with `_`. A
    Keras 3 variable is named after its layer, which Keras names after its class
    in snake case: a layer class `_TokenAndPosition` names its variables
    `__token_and_position/...`, which train (eager scopes are not checked) and
    cannot be exported ("is not a valid root scope name"). No TensorFlow or Keras
    issue covers this (searched); pytorch/xla#5738 renames its variables for the
    same reason.
    """
    from tensorflow.python.ops import resource_variable_ops

    copy = resource_variable_ops.copy_to_graph_uninitialized
    resource_variable_ops.copy_to_graph_uninitialized = (
        lambda var: copy(_Renamed(var, rename(var._shared_name))))
    try:
        yield
    finally:
        resource_variable_ops.copy_to_graph_uninitialized = copy


class _Renamed:
    """`variable` under another `_shared_name`, for `copy_to_graph_uninitialized`."""

    def __init__(self, variable, name: str):
        self._variable, self._shared_name = variable, name

    def __getattr__(self, attribute):
        return getattr(self._variable, attribute)


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism` is in force."""
    from tensorflow.python.framework import config

    return config.is_op_determinism_enabled()


def disable_op_determinism() -> None:
    """Undo `tf.config.experimental.enable_op_determinism` (TF 2.21 exports no way to)."""
    from tensorflow.python.framework import config

    config.disable_op_determinism()


def stop_thread_spinning() -> None:
    """Make the pools sleep when idle; before TensorFlow starts, as its thread counts.

    Raises RuntimeError once the context has started with its pools spinning.
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    if ctx._config is not None and ctx._config.experimental.disable_thread_spinning:
        return
    if ctx._context_handle is not None:
        raise RuntimeError("thread spinning cannot be changed after initialization")
    if ctx._config is None:
        ctx._config = tf.compat.v1.ConfigProto()
    ctx._config.experimental.disable_thread_spinning = True


class _Reads:
    """What `variable_reads` keeps while a function is traced: where the closure's graph
    is, which variables it reads so (by id), whether once (`cache`, and the value read
    of each so far) and whether as float16 (`half`)."""

    def __init__(self, graph, ids: set[int], cache: bool = True, half: bool = False):
        self.graph, self.ids, self.values = graph, ids, {}
        self.cache, self.half = cache, half


_reads_state: _Reads | None = None
_tf_cached_read_value = None  # CachingVariable's own, once `variable_reads` replaced it


def _parts(variable) -> list:
    """A ShardedVariable's parts, or the variable itself."""
    return list(variable.variables) if isinstance(
        variable, tf.__internal__.distribute.ShardedVariable) else [variable]


def _cached_read_value(self):
    """CachingVariable.cached_read_value under `variable_reads` (see there)."""
    from tensorflow.python.eager import record
    from tensorflow.python.ops import resource_variable_ops

    state = _reads_state
    if state is None:  # TensorFlow's own caching scope (tf_keras' exact evaluation)
        return _tf_cached_read_value(self)
    if id(self) not in state.ids:
        return self._v.read_value()  # read as usual, every time
    value = state.values.get(id(self)) if state.cache else None
    if value is None:
        # Cached: made in the closure's graph, before its loop of steps (the one read);
        # with the steps unrolled (ps.unroll), where the run's first step reads, after
        # the updates before it (TensorFlow orders ops on one variable as traced).
        where = state.graph.as_default() if state.cache else contextlib.nullcontext()
        with record.stop_recording(), where:
            if state.half and self.dtype == tf.float32:
                with tf.device(self._v.device):
                    half = tf.cast(self._v.read_value(), tf.float16)
                with tf.device("CPU:0"):
                    value = tf.cast(half, tf.float32)
            else:
                with tf.device("CPU:0"):
                    value = tf.identity(self._v.read_value())
        if state.cache:
            state.values[id(self)] = value
    # For the tapes, a read of the variable, as ResourceVariable._read_variable_op
    # records one: the gradient of the value is the variable's.
    resource_variable_ops.variable_accessed(self._v)
    result = tf.identity(value)
    record.record_operation("ReadVariableOp", [result], [self._v.handle],
                            backward_function=lambda x: [x], forward_function=lambda x: [x])
    return result


@contextlib.contextmanager
def variable_reads(variables: list, cache: bool = True, half: bool = False) -> Iterator[None]:
    """While a closure's function is traced within it, each of `variables` (a
    ParameterServerStrategy's, or ShardedVariables of them) that it reads whole is read
    from its ps task: with `cache`, once, where the function begins, and every later
    read in the function (each step of its loop) takes that value; otherwise where
    each read is. With `half`, a float32 variable is cast to float16 on its ps task
    and back to float32 on the worker: half the bytes cross. A gradient of such a read
    is the variable's, and updates go to the variable on its ps task. Sparse reads
    (embedding lookups) and the other variables (the optimizer's slots and step, the
    metrics) are read as usual, when they are used.

    TensorFlow 2.21 wraps every variable of a ParameterServerStrategy in a
    `ps_values.CachingVariable`, whose reads within `distribute_utils.
    cache_variable_reads()` are cached where they are first made (tf_keras' exact
    evaluation uses it). That is not enough to train: a first read inside a loop of
    steps is made again every step, every variable read is cached (an optimizer's
    slots too), and a cached read is no read for a GradientTape, so the gradients are
    None. Here the scope is entered with `CachingVariable.cached_read_value` replaced
    to cache only `variables`, in the closure's graph, and to record each read for
    the tapes. If these move, the first closure of a run with
    train.steps_per_execution > 1 and ps.read_every > 1, or with ps.read_compression =
    "fp16", fails to trace (tests/test_steps_per_execution.py); the public way is to
    read every step, as float32."""
    global _reads_state, _tf_cached_read_value
    from tensorflow.python.distribute import distribute_utils, ps_values

    if _tf_cached_read_value is None:
        _tf_cached_read_value = ps_values.CachingVariable.cached_read_value
        ps_values.CachingVariable.cached_read_value = _cached_read_value
    ids = {id(part) for v in variables for part in _parts(v)
           if isinstance(part, ps_values.CachingVariable)}
    _reads_state = _Reads(tf.compat.v1.get_default_graph(), ids, cache, half)
    try:
        with distribute_utils.cache_variable_reads():
            yield
    finally:
        _reads_state = None


def is_ps_failure(error: tf.errors.OpError) -> bool:
    """Whether the ClusterCoordinator counts `error`, raised by a step, as a ps task's
    failure (TF 2.21 cluster_coordinator.py, `_is_ps_failure`): a ps unreachable, or
    restarted on its address, so that it no longer knows the chief's context ("Unable
    to find a context_id") or, once the coordinator has made that again, the tensors
    its variables were ("Unable to find the relevant tensor remote_handle")."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    test = getattr(cluster_coordinator, "_is_ps_failure", None)
    return bool(test and test(error))  # moved: the error is raised as it is
