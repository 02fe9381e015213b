"""`train.deterministic`: a synchronous run whose weights are the same, bit for bit,
whether or not it was stopped and resumed from its backup.

A resumed run repeats what the uninterrupted one would have done if everything
its steps depend on is either in the backup or made again the same way:

- the weights, the optimizer's slots and its step: in both Kerases' backups;
- the initial weights: from `train.seed` (`dialects.set_random_seed`);
- the random layers' generators (dropout masks): Keras 3 keeps each in a variable
  (`SeedGenerator`), and `dialects.keras3.Backup` saves it; Keras 2 does so only
  with `use_variable_rng`, and `dialects.keras2_backup.Backup` saves it. Without it, Keras 2's
  dropout uses TF1's stateful random ops, whose state lives in the op's kernel and
  starts over in the resumed process;
- the kernels: TensorFlow's deterministic ones (`enable_op_determinism`), so that the
  same inputs give the same sums whatever order threads finish in;
- the input: the task's (the same examples in the same order after a resume).

Not under parameter servers: workers' updates reach the ps tasks in whatever order
they finish (`runners.AsyncPS` refuses the switch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow as tf

from app import dialects, tf_internal


@contextlib.contextmanager
def scope(enabled: bool) -> Iterator[None]:
    """Within it, with `enabled`: deterministic kernels, and random layers built with
    their generators' state in variables. Both settings are process-global: the
    previous ones are back when the scope ends (tests run one config after another
    in one process)."""
    if not enabled:
        yield
        return
    ops_were_deterministic = tf_internal.op_determinism_enabled()
    tf.config.experimental.enable_op_determinism()
    restore_rng = dialects.use_variable_rng()
    try:
        yield
    finally:
        restore_rng()
        if not ops_were_deterministic:
            tf_internal.disable_op_determinism()
