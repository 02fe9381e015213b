"""A backup restored into another number of shards, on the in-process parameter-server
cluster of conftest.py (2 workers, 2 ps, this process the chief): every table and every
optimizer slot comes back equal to the one saved, compared whole, under tf_keras' fit
(`callbacks.Backup`), the project's loop on the coordinator in both Kerases
(`coordinated.LoopBackup`) and the sync loop (`sync_ps.SyncBackup`).

A run resumed on another number of ps tasks shards its variables anew (the default
partitioner makes one shard per ps task). The restore sees the number of shards, not
which task holds each, so the test changes the partitioner's count on the one cluster:
2 shards, then 3, 1 (whole variables) and 2 again, each run restoring the last one's
backup. 2 ps tasks hold 3 shards as 3 would (round robin), and no cluster is started
per count (TF's servers outlive their tests in a process).
"""

import collections
import functools
import re
import signal

import numpy as np
import pytest

from app import config as cfg
from app import trainer
from app.cluster import preemption
from app.dialects import keras2, keras3
from app.distribute.ps import variables as ps_variables
from tests.conftest import tiny_task
from tests.probing import Interrupted, Probe, attach

pytestmark = pytest.mark.cluster

SHARDS = (2, 3, 1, 2)  # more, fewer (none), more again; each run restores the one before
STOPS = (3, 8, 13)  # the batch whose end SIGTERMs each run but the last (32 per epoch)


def _config(keras: str, optimizer: str, mode: str, by_index: bool) -> cfg.Config:
    # The MLP's kernels and biases are all sharded; its first kernel is 784 x 512.
    return cfg.load(None, ["train.epochs=1", "train.global_batch_size=16", "train.verbose=0",
                           "eval.test_every_epoch=false", "task.model=mlp",
                           f"task.keras={keras}", f"train.optimizer={optimizer}",
                           f"ps.mode={mode}", f"data.by_index={str(by_index).lower()}"])


def _shard_into(monkeypatch, strategy, count: int) -> None:
    """Make `strategy` split the variables built from now on into `count` shards, with
    the partitioner `ps.partitioner = "fixed"` gives. ParameterServerStrategy keeps
    its partitioner in `extended._variable_partitioner` (TF 2.21); the public way, a
    new strategy, would connect this process to the cluster again."""
    chosen = ps_variables.partitioner(cfg.PSConfig(partitioner="fixed", num_shards=count),
                                          num_ps=2)
    monkeypatch.setattr(strategy.extended, "_variable_partitioner", chosen)


def _state(model, keras: str) -> dict:
    """The model's variables and its optimizer's (step and slots), each one whole array
    (a sharded one's shards joined in order), and how many shards the most split has."""
    optimizer = model.optimizer
    if keras == "tf_keras":
        tables = ps_variables.gather_weights(model)
        # tf_keras keeps one ShardedVariable per slot of a sharded variable.
        slots = [np.concatenate([p.numpy() for p in v.variables]) if hasattr(v, "variables")
                 else v.numpy() for v in optimizer.variables()]
        dialect = keras2
    else:
        tables = model.get_weights()  # keras3_ps.ShardedTableVariable joins its shards
        # Keras 3 keeps a slot per shard, "<table>_part_<i>_<kind>": joined per table and kind.
        joined = collections.defaultdict(list)
        for v in optimizer.variables:
            whole = re.sub(r"_part_\d+_", "_", v.name)
            joined[whole if whole != v.name else id(v)].append(np.asarray(v))
        slots = [np.concatenate(parts) if len(parts) > 1 else parts[0]
                 for parts in joined.values()]
        dialect = keras3
    parts = [part.name for v in dialect.variables(model, optimizer)
             if ps_variables.is_variable(v) for part in getattr(v, "variables", None) or [v]]
    shards = 1 + max((int(m[1]) for name in parts if (m := re.search(r"/part_(\d+)", name))),
                     default=0)
    return {"tables": tables, "slots": slots, "shards": shards}


def _check_restored(restored: dict, saved: dict, initial: dict, shards: int) -> None:
    """`restored`, in `shards` shards, holds what was `saved`, which was trained."""
    assert restored["shards"] == shards
    for name in ("tables", "slots"):
        assert len(restored[name]) == len(saved[name]) == len(initial[name]) > 1
        for got, want, fresh in zip(restored[name], saved[name], initial[name], strict=True):
            assert got.shape == want.shape
            # Each of the new shards was saved trained: one left as it was built (an
            # Adagrad accumulator's 0.1, Adam's zeros, a new random table) fails below.
            if want.ndim:
                for part, new in zip(np.array_split(want, shards),
                                     np.array_split(fresh, shards), strict=True):
                    assert not part.size or not np.array_equal(part, new)
            np.testing.assert_array_equal(got, want)


def _run(config, workdir, strategy, cluster, monkeypatch, keras: str, stop_at) -> tuple:
    """One run in `workdir`: its state once restored (as built, if there is no backup)
    and, SIGTERMed at the end of batch `stop_at` (epoch, batch), its state once stopped:
    every scheduled step has run and the backup is saved, so what the backup holds.
    Without `stop_at` it stops once restored (None)."""
    models, restored = [], {}

    def begin(model):
        models.append(model)
        restored.update(_state(model, keras))
        if stop_at is None:
            raise Interrupted("restored")

    attach(monkeypatch, Probe(on_begin=begin, stop_at=stop_at, how="sigterm"))
    with pytest.raises(preemption.Preempted if stop_at else Interrupted):
        trainer.run(config, workdir, strategy=strategy, cluster=cluster, task=tiny_task(config))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ignored after the save; not here
    return restored, _state(models[0], keras) if stop_at else None


# The backups: tf_keras' fit (callbacks.Backup, reading the task's pipeline), the
# project's loop by index (coordinated.LoopBackup) in both Kerases, and the sync loop
# (sync_ps.SyncBackup) in both Kerases. Each Keras makes and joins its slots one way whatever
# the optimizer: Adagrad's start at 0.1, Adam's two kinds (in Keras 3 one of each per
# shard, interleaved).
@pytest.mark.parametrize("keras, optimizer, mode, by_index", [
    ("tf_keras", "adagrad", "async", False), ("tf_keras", "adagrad", "async", True),
    ("keras", "adam", "async", True), ("tf_keras", "adam", "sync", False),
    ("keras", "adagrad", "sync", False)])
def test_a_backup_restores_its_tables_and_slots_into_another_number_of_shards(
        ps_strategy, ps_cluster, tmp_path, monkeypatch, keras, optimizer, mode, by_index):
    config = _config(keras, optimizer, mode, by_index)
    run = functools.partial(_run, config, tmp_path, ps_strategy, ps_cluster, monkeypatch, keras)
    _shard_into(monkeypatch, ps_strategy, SHARDS[0])
    initial, saved = run((0, STOPS[0]))
    assert initial["shards"] == saved["shards"] == SHARDS[0]
    for count, stop in zip(SHARDS[1:], [*STOPS[1:], None], strict=True):
        _shard_into(monkeypatch, ps_strategy, count)
        restored, after = run(stop and (0, stop))
        _check_restored(restored, saved, initial, count)
        saved = after
