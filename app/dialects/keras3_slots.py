"""The checkpoint of a Keras 3 optimizer whose variables are sharded over ps tasks,
restorable into another number of shards (another number of ps tasks).

`keras3_ps` trains a sharded variable (a partitioner's) as one Keras variable per
shard (`ShardVariable`), so Keras 3.15's optimizer keeps one slot of each kind per
shard, and its checkpoint lists them, and the shards, by position: a backup
restored into another number of shards failed ("objects that were not bound") or,
silently, filled variables with other variables' values and shapes (tried: 2
shards into 1 left a (512,) bias holding a (392, 512) block). `checkpoint_by_table`
makes it save each slot whole, as tf_keras' optimizer does and as the model saves
its tables (`keras3_ps.ShardedTableVariable`). `tests/test_resume_shards.py`
restores a backup into 3, 1 and 2 shards and compares every slot.

This overrides TensorFlow's private `Trackable._trackable_children` (TF 2.21) on
the optimizer objects, through `app.dialects.keras3_internal`, and reads Keras 3.15's
slot names: if either moves, that test fails.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from app import tf_internal
from app.dialects import keras3_internal


def checkpoint_by_table(optimizer, parts: list[list[keras.Variable]]) -> None:
    """Make a checkpoint of `optimizer`, built for the variables of `parts`
    (`keras3_ps.trainable`'s), restorable into another number of shards: in each of its
    lists (all its variables, each kind of slot) the slots of a sharded variable's shards
    become one variable per kind of slot, saved as TensorFlow saves the sharded
    variable itself (one slice of the whole per shard), and the shards themselves,
    which the model saves whole, are left out. So for each Keras optimizer within it
    too (an optimizer pair's). Without sharded variables it stays Keras' own.

    Keras' own checkpoint lists the slots and the shards by position: restored into
    another number of shards it failed ("objects that were not bound") or, silently,
    filled variables with other variables' values and shapes. tf_keras' optimizer
    joins its slots so itself (its `_trackable_children`, which TensorFlow's
    checkpoint asks each object for, and restores by); here that one method is
    overridden on these optimizer objects, for checkpoints only.
    """
    # Keras 3.15 names a slot "<its variable's path, / as _>_<kind>" (BaseOptimizer.
    # add_variable_from_reference); a ShardVariable's path is its shard's name.
    shards = {f"{shard.path.replace('/', '_')}_": (table, index)
              for table, group in enumerate(parts) if len(group) > 1
              for index, shard in enumerate(group)}
    if not shards:
        return
    own = keras3_internal.checkpoint_children(optimizer)
    children = own("checkpoint")
    whole = _whole_slots(children[keras3_internal.OPTIMIZER_VARIABLES], shards, parts)
    lists = {name: tf_internal.tracked_list(_joined(child, whole))
             for name, child in children.items()
             if isinstance(child, list) and name != keras3_internal.OPTIMIZER_TRAINABLE_VARIABLES}

    def trackable_children(save_type="checkpoint", **kwargs):
        found = own(save_type, **kwargs)
        if save_type == "checkpoint":
            found.pop(keras3_internal.OPTIMIZER_TRAINABLE_VARIABLES, None)
            found.update(lists)
        return found

    keras3_internal.set_checkpoint_children(optimizer, trackable_children)
    for child in children.values():
        if isinstance(child, keras.optimizers.Optimizer):
            checkpoint_by_table(child, parts)


def _whole_slots(variables, shards: dict[str, tuple[int, int]],
                 parts: list[list[keras.Variable]]) -> dict[int, tf.Variable]:
    """id(slot) -> one variable of the slots of its kind of all its table's shards,
    for each slot in `variables` of one of `shards` (by name prefix: (table, shard))."""
    found: dict[tuple[int, str], list] = {}
    for variable in variables:
        prefix = max((p for p in shards if variable.name.startswith(p)), key=len, default=None)
        table, index = shards.get(prefix, (None, None))
        # Not a slot of a shard, or not a row block of its table (Adafactor's factors).
        if prefix is None or variable.shape != parts[table][index].shape:
            continue
        kind = found.setdefault((table, variable.name[len(prefix):]), [None] * len(parts[table]))
        kind[index] = variable
    whole = {}
    for slots in found.values():
        joined = tf_internal.sharded_variable([slot.value for slot in slots])
        whole.update((id(slot), joined) for slot in slots)
    return whole


def _joined(values, whole: dict[int, tf.Variable]) -> list:
    """`values` in order, each slot of a shard as its `whole` variable, once."""
    out, seen = [], set()
    for value in values:
        joined = whole.get(id(value))
        if joined is None:
            out.append(value)
        elif id(joined) not in seen:
            seen.add(id(joined))
            out.append(joined)
    return out
