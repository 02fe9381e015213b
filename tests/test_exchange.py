"""The exchange of ps.mode = sync (app/distribute/ps/exchange.py), on this process's CPU:
which contributions an update may take, and which parts of an epoch are handed out
again. The runs themselves: tests/test_sync_ps.py."""

import numpy as np
import tensorflow as tf

from app.distribute.ps.exchange import PART_ENDED, PART_PENDING, PART_TAKEN, Exchange, slot_bytes


def _exchange(workers: int = 3, required: int = 2, parts: int = 4) -> Exchange:
    variable = tf.Variable(tf.zeros([2]))
    return Exchange(workers, required, "/cpu:0", [variable], lambda v: v, parts=parts)


def _marks(exchange: Exchange, marked, part_of, arrived) -> None:
    exchange.marked.assign(np.array(marked, np.int64))
    exchange.part_of.assign(np.array(part_of, np.int64))
    exchange.arrived.assign(np.array(arrived, np.float64))


def test_an_update_takes_each_part_once_the_first_contribution_to_come_with_it():
    exchange = _exchange()
    # Workers 0 and 2 hold part 1 (a contribution run again): the earlier, worker 2, counts.
    _marks(exchange, marked=[0, 0, 0], part_of=[1, 3, 1], arrived=[3.0, 2.0, 1.0])
    assert int(exchange.ready()) == 2
    waited = exchange._waited(exchange.version.read_value()).numpy()
    assert np.isinf(waited[0]) and list(waited[1:]) == [2.0, 1.0]
    exchange.parts.assign(np.array([0, PART_TAKEN, 0, 0], np.int32))  # part 1 taken already
    assert int(exchange.ready()) == 1
    _marks(exchange, marked=[0, -1, 5], part_of=[3, 3, 0], arrived=[1.0, 0.5, 0.1])
    assert int(exchange.ready()) == 1  # worker 1 holds nothing, worker 2 another version


def test_the_parts_handed_out_again_are_those_no_update_can_take():
    exchange = _exchange()
    exchange.parts.assign(np.array([PART_ENDED, PART_PENDING, PART_ENDED, PART_TAKEN],
                                   np.int32))
    # Part 2's contribution is marked with the current version: the next update may take it.
    _marks(exchange, marked=[0, -1, -1], part_of=[2, -1, -1], arrived=[1.0, 0.0, 0.0])
    assert exchange.dropped().numpy().tolist() == [0]
    assert exchange.parts.numpy().tolist() == [PART_PENDING, PART_PENDING, PART_ENDED,
                                               PART_TAKEN]
    exchange.version.assign(1)  # updated without it: part 2 is lost too
    assert exchange.dropped().numpy().tolist() == [2]


def test_a_worker_holding_a_part_an_earlier_update_took_has_its_turn_back():
    """A backup copy of a part whose original an update took can never be taken: its
    worker must not wait for the version to move (with the straggler waiting for the
    same, nothing moved it)."""
    variable = tf.Variable(tf.zeros([2]))
    exchange = Exchange(2, 1, "/cpu:0", [variable], lambda v: v, parts=4)

    def deposit(worker: int, part: int) -> None:
        exchange.deposit([tf.ones([2])], [variable], exchange.version.read_value(),
                         tf.constant(worker), tf.constant(part, tf.int64))

    def holds() -> list[bool]:
        return [bool(exchange.holds_turn(tf.constant(w))) for w in (0, 1)]

    deposit(1, 2)  # the original of part 2, on version 0
    assert holds() == [False, True]
    exchange.update(lambda grads, variables: None, tf.constant(False))  # takes it
    assert int(exchange.version.numpy()) == 1 and holds() == [False, False]
    deposit(0, 2)  # the copy of part 2, on version 1: no update can take it
    deposit(1, 1)
    assert int(exchange.ready()) == 1 and holds() == [False, True]
    # An update choosing worker 1 marks it chosen, then its part taken: while the
    # update reads worker 1's slots, worker 1 still waits.
    exchange.chosen_at.scatter_update(tf.IndexedSlices(tf.constant([1], tf.int64), [1]))
    exchange.parts.scatter_update(tf.IndexedSlices(tf.constant([PART_TAKEN]), [1]))
    assert holds() == [False, True]


def test_the_slots_take_a_dense_copy_of_each_variable_per_worker_in_the_push_dtype():
    table, bias = tf.Variable(tf.zeros([1000, 8])), tf.Variable(tf.zeros([8]))
    assert slot_bytes([table, bias], 3, lambda v: v) == {table.device: 3 * 8008 * 4}
    assert slot_bytes([table], 2, lambda v: v, tf.float16) == {table.device: 2 * 8000 * 2}
