"""What the workers and the chief of a synchronous run share on the ps tasks.

Every worker has a slot of its own beside each variable, on that variable's ps
task. A worker's contribution (`deposit`) writes its gradients into its slots and
then marks them, on ps:0, with the parameter version it read before its forward
pass. The chief's update (`update`) picks the first N slots marked with the
current version, averages them where the variables live, applies the mean with
the model's optimizer and, once every variable holds its new value, moves the
version on. A contribution marked with an older version, or one beyond the N
taken, is never read: it is dropped.

What makes each update exact (N contributions, all computed on the version it
updates, the same N for every variable), in the order the graphs enforce:

- worker: (1) wait while its slots hold a contribution to the current version;
  (2) read the version k; (3) every read of the model's variables after (2);
  (4) the gradients into its slots, then the mark k (after the slot writes).
- chief: (a) choose N workers marked k; (b) average their slots, update the
  variables; (c) after a read of every updated variable: version k + 1.

A chosen contribution read every variable after update k - 1 had written it
((2) after (c) of k - 1) and before update k writes any ((4) before (a), and (b)
depends on (a)). A chosen slot is not written while it is read: its worker waits
at (1) until (c). TensorFlow orders ops on one variable in program order, and
nothing else (a control dependency on a variable adds no edge), so each of these
edges is a data dependency or a control dependency on a tensor or an op.

TF1's `SyncReplicasOptimizer` and this project's earlier sync mode used one
`ConditionalAccumulator` per variable instead: each takes the first N gradients
*it* receives, so two variables could average different workers' gradients, more
than N when one arrives while it is taken, and nothing ordered the version's
increment after the variables' updates (a contribution could read version k + 1
and parameters of version k). A slot per worker costs more memory on the ps tasks:
`workers` copies of the gradients (`ps.compression = fp16` halves them), dense:
a sparse gradient (an embedding table's rows) is sent and held as the whole table's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from app import tf_internal

# How often a worker that already contributed to the current version looks again.
WAIT_POLL_US = 1000
# What became of a part of the epoch (`Exchange.parts`): handed out or to be; its
# contribution ended (deposited or not, not taken yet); an update took it.
PART_PENDING, PART_ENDED, PART_TAKEN = 0, 1, 2


def slot_bytes(variables: Sequence, num_workers: int, tf_variable: Callable[[Any], Any],
               push_dtype: tf.DType | None = None) -> dict[str, int]:
    """The bytes the slots of `variables` take (an `Exchange`'s), by ps task (device),
    before any is made: `num_workers` dense copies of each variable (of each shard of
    a sharded one), in `push_dtype` if given."""
    held: dict[str, int] = {}
    for variable in variables:
        storage = tf_variable(variable)
        for part in getattr(storage, "variables", [storage]):
            dtype = push_dtype or part.dtype
            held[part.device] = (held.get(part.device, 0)
                                 + num_workers * part.shape.num_elements() * dtype.size)
    return held


class Exchange:
    """The version, the workers' slots and marks, and the counts of a sync run.

    `tf_variable(v)` gives the TensorFlow variable behind a model variable `v` (its
    Keras); `push_dtype` is the dtype gradients are sent and held in (None: the
    variable's)."""

    def __init__(self, num_workers: int, required: int, device: str, variables: Sequence,
                 tf_variable: Callable[[Any], tf.Variable], push_dtype: tf.DType | None = None,
                 parts: int = 0):
        """Slots for each of `variables` (a model's trainable variables; made here, out of
        any strategy's scope, so that each is beside its variable). With `parts`, each
        contribution trains on a numbered part of an epoch (`PART_*`: what became of
        each; an update never takes a part twice)."""
        self.num_workers, self.required = num_workers, required
        self.tf_variable, self.push_dtype = tf_variable, push_dtype
        self.device = device
        with tf.device(device):
            # The number of updates applied: the parameters' version.
            self.version = tf.Variable(0, dtype=tf.int64, trainable=False, name="sync_version")
            # Per worker: the version its slots hold a contribution to, and when it came.
            self.marked = tf.Variable(tf.fill([num_workers], tf.constant(-1, tf.int64)),
                                      trainable=False, name="sync_marked")
            self.arrived = tf.Variable(tf.zeros([num_workers], tf.float64), trainable=False,
                                       name="sync_arrived")
            self.pushed = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                                      name="sync_pushed")
            self.taken = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                                     name="sync_taken")
            # Contributions ended (scheduled minus ended: the ones outstanding).
            self.ended = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                     name="sync_ended")
            # Set while the chief waits for every contribution to end: none waits its turn.
            self.draining = tf.Variable(False, trainable=False, name="sync_draining")
            # Per worker, the part its slots hold; per part of the epoch, its state.
            self.part_of = tf.Variable(tf.fill([num_workers], tf.constant(-1, tf.int64)),
                                       trainable=False, name="sync_part_of")
            self.parts = tf.Variable(tf.zeros([max(parts, 1)], tf.int32), trainable=False,
                                     name="sync_parts")
            # Per worker, the version of the last update that chose its contribution.
            self.chosen_at = tf.Variable(tf.fill([num_workers], tf.constant(-1, tf.int64)),
                                         trainable=False, name="sync_chosen_at")
        self.num_parts = parts
        self._slots: dict[int, tf.Variable] = {}
        for variable in variables:
            storage = tf_variable(variable)
            for part in getattr(storage, "variables", [storage]):  # a ShardedVariable's shards
                with tf.device(part.device):
                    self._slots[id(part)] = tf.Variable(
                        tf.zeros([num_workers, *part.shape], push_dtype or part.dtype),
                        trainable=False, name="sync_slot")
        # (model variable, its slot) of each gradient a contribution deposits, in order.
        self.deposited: list[tuple[Any, tf.Variable]] = []

    # -- on a worker -----------------------------------------------------------------------

    def wait_turn(self, worker: tf.Tensor) -> tf.Tensor:
        """Once `worker`'s slots hold no contribution to the current version that an
        update may take or is reading (they are read until the update is applied), or
        the chief is draining (no update runs then).

        A contribution to a part of the epoch an earlier update took (a backup copy
        handed out at an epoch's tail, whose original was taken before the copy ran)
        can never be taken: waiting on it held this worker until the version moved,
        and with the other worker the straggler that waits for the version to move,
        nothing moved it (a 300 s hang in tests/test_sync_ps.py). Such a worker goes on.
        The update marks `chosen_at` before it marks the parts it takes: a worker that
        sees its part taken and then reads `chosen_at` knows whether it is being read."""
        tick = tf_internal.ticks(tf.constant(WAIT_POLL_US, tf.int64))

        def waiting(slept):
            return self.holds_turn(worker)

        def sleep(slept):
            return slept + next(tick)

        return tf.while_loop(waiting, sleep, [tf.constant(0, tf.int64)])[0]

    def holds_turn(self, worker: tf.Tensor) -> tf.Tensor:
        """Whether `worker`'s slots hold a contribution to the current version that an
        update may still take or is reading, while the chief is not draining (`wait_turn`)."""
        version = self.version.read_value()
        turn = tf.logical_and(tf.gather(self.marked, worker) == version,
                              tf.logical_not(self.draining.read_value()))
        if not self.num_parts:
            return turn
        part = tf.maximum(tf.gather(self.part_of, worker), 0)
        taken = tf.gather(self.parts, part) == PART_TAKEN
        with tf.control_dependencies([taken]):  # read after the part's state
            chosen = tf.gather(self.chosen_at, worker) == version
        return tf.logical_and(turn, tf.logical_or(tf.logical_not(taken), chosen))

    def deposit(self, grads: Sequence, variables: Sequence, version: tf.Tensor,
                worker: tf.Tensor, part: tf.Tensor | None = None) -> tf.Tensor:
        """While a contribution traces: write `grads` into `worker`'s slots of
        `variables`, then mark them with `version` (and `part`, the number of the part
        of the epoch it trained on); nothing while the chief drains. Returns whether it
        deposited, once it has."""
        values, self.deposited = [], []
        for grad, variable in zip(grads, variables, strict=True):
            if grad is None:  # Keras skips such a variable, and so does the update
                continue
            value = tf.convert_to_tensor(grad)  # IndexedSlices: dense (see the module)
            values.append(tf.cast(value, self.push_dtype) if self.push_dtype else value)
            self.deposited.append((variable, self._slot(variable)))

        def write() -> tf.Tensor:
            index = [[worker]]
            writes = [slot.scatter_nd_update(index, value[None]).op
                      for (_, slot), value in zip(self.deposited, values, strict=True)]
            if part is not None:
                # Before the version's mark: an update that sees the mark reads this part,
                # not the one of the worker's previous contribution.
                writes.append(self.part_of.scatter_nd_update(index, [part]).op)
            with tf.control_dependencies(writes):
                marks = [self.marked.scatter_nd_update(index, [version]),
                         self.arrived.scatter_nd_update(index, [tf.timestamp()]),
                         self.pushed.scatter_nd_add(index, [tf.constant(1, tf.int64)])]
            with tf.control_dependencies(marks):
                return tf.constant(True)

        # A conditional of the exchange's own variables only: around the train step, a
        # lookup table's per-worker resource could not be found ("You must feed a value
        # for placeholder tensor ... with dtype resource").
        return tf.cond(self.draining.read_value(), lambda: tf.constant(False), write)

    def finish(self, part: tf.Tensor, after: tf.Tensor | None) -> tf.Operation:
        """`part` (an epoch's) ended, after `after` (its deposit): taken already, or
        to be taken only while its worker's mark is the current version."""
        with tf.control_dependencies([] if after is None else [after]):
            ended = tf.IndexedSlices(tf.constant([PART_ENDED]), tf.reshape(part, [1]))
            return self.parts.scatter_max(ended).op

    def slot_bytes(self) -> dict[str, int]:
        """The bytes the slots hold, by ps task (device)."""
        held: dict[str, int] = {}
        for slot in self._slots.values():
            nbytes = slot.shape.num_elements() * slot.dtype.size
            held[slot.device] = held.get(slot.device, 0) + nbytes
        return held

    def knows(self, variable) -> bool:
        """Whether `variable` has slots (is one of the variables the exchange was made for)."""
        return id(self.tf_variable(variable)) in self._slots

    def _slot(self, variable) -> tf.Variable:
        return self._slots[id(self.tf_variable(variable))]

    # -- on the chief ----------------------------------------------------------------------

    def ready(self) -> tf.Tensor:
        """How many workers' slots hold a contribution an update may take now (ps:0)."""
        with tf.device(self.device):
            waited = self._waited(self.version.read_value())
            return tf.reduce_sum(tf.cast(waited < float("inf"), tf.int64))

    def _waited(self, version: tf.Tensor) -> tf.Tensor:
        """Per worker, when its contribution to `version` came; inf for a worker with none,
        or with a part of the epoch already taken, or taken by an earlier worker."""
        when = tf.where(self.marked.read_value() == version, self.arrived.read_value(),
                        tf.constant(float("inf"), tf.float64))
        if not self.num_parts:
            return when
        # A contribution run again (its first worker died after its deposit) holds a
        # part that another may hold too: the first to come is the one that counts.
        part = self.part_of.read_value()
        fresh = tf.gather(self.parts, tf.maximum(part, 0)) != PART_TAKEN
        same = tf.equal(part[:, None], part[None, :]) & (when[None, :] < when[:, None])
        first = tf.logical_not(tf.reduce_any(same & (when[None, :] < float("inf")), axis=1))
        return tf.where(fresh & first, when, tf.constant(float("inf"), tf.float64))

    def dropped(self) -> tf.Tensor:
        """The parts of the epoch whose contribution ended without being taken, and that
        no update can take any more (ps:0), set pending again: the chief hands them out
        anew."""
        with tf.device(self.device):
            parts = self.parts.read_value()
            # Read after the parts' states: a contribution marks its worker before it ends.
            with tf.control_dependencies([parts]):
                held = tf.where(self.marked.read_value() == self.version.read_value(),
                                self.part_of.read_value(), tf.constant(-1, tf.int64))
            ended = tf.equal(parts, PART_ENDED)
            waiting = tf.reduce_any(tf.equal(tf.range(self.num_parts, dtype=tf.int64)[:, None],
                                             held[None, :]), axis=1)
            lost = tf.cast(tf.where(ended & tf.logical_not(waiting))[:, 0], tf.int64)
            with tf.control_dependencies([self.parts.scatter_update(tf.IndexedSlices(
                    tf.fill(tf.shape(lost), PART_PENDING), lost))]):
                return tf.identity(lost)

    def update(self, apply: Callable[[list, list], Any], then_drain: tf.Tensor) -> tf.Tensor:
        """Apply the mean of the first `required` contributions to the current version
        with `apply(grads, variables)`, then move the version on; with `then_drain`,
        the contributions waiting their turn see the new version with `draining` set
        (they end without running). Returns how many contributions of each worker it
        took. Called once `ready()` reached `required`."""
        with tf.device(self.device):
            version = self.version.read_value()
            chosen = tf.math.top_k(-self._waited(version), k=self.required).indices
            if self.num_parts:
                taken_parts = tf.gather(self.part_of, chosen)
                # Before the parts are marked taken (`wait_turn`).
                mark = self.chosen_at.scatter_update(tf.IndexedSlices(
                    tf.fill([self.required], version), chosen))
                with tf.control_dependencies([mark.op]):
                    take = self.parts.scatter_update(tf.IndexedSlices(
                        tf.fill([self.required], PART_TAKEN), taken_parts)).op
        means, variables = [], []
        for variable, slot in self.deposited:
            storage = self.tf_variable(variable)
            with tf.device(storage.device):
                rows = tf.cast(slot.sparse_read(chosen), storage.dtype)
                means.append(tf.reduce_mean(rows, axis=0))
            variables.append(variable)
        apply(means, variables)
        # Each variable's read comes after its update (same variable, program order):
        # the new version is announced only once every variable holds it.
        updated = [self.tf_variable(v).read_value() for v in variables]
        if self.num_parts:
            updated.append(take)
        with tf.device(self.device), tf.control_dependencies(updated):
            taken = tf.reduce_sum(tf.one_hot(chosen, self.num_workers, dtype=tf.int64), axis=0)
            drain = self.draining.assign(then_drain, read_value=False)
            with tf.control_dependencies([drain]):
                done = [self.version.assign_add(1, read_value=False),
                        self.taken.assign_add(taken, read_value=False)]
        with tf.control_dependencies(done):
            return tf.identity(taken)

