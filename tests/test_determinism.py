"""train.deterministic: a synchronous run stopped mid-epoch (SIGTERM, in this process) and
resumed from its backup ends with the weights of the run that was never stopped, bit for
bit, in both Kerases, in one process and under Mirrored over 2 logical CPUs.

The tasks give their examples by index (app/indexed.py), so the resumed run reads the
batches the stopped one would have: what is tested is the whole run, its input order
and the model's side (weights, optimizer slots and step, the dropout generators'
state, the kernels)."""

import dataclasses
import signal

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from app import config as cfg
from app import data, dialects, strategy, tf_internal, trainer
from app.cluster import preemption
from app.config import field
from app.task import Task
from app.tasks.mnist import Mnist
from tests.conftest import one_device_reduction_mirrored, tiny_split
from tests.probing import Probe, attach

# Mirrored over the 2 logical CPUs, summing without collective ops: in-process
# collectives of two strategies collide (conftest.one_device_reduction_mirrored).
STRATEGIES = {"default": lambda: strategy.create("default"),
              "mirrored": one_device_reduction_mirrored}
EPOCHS, STEPS = 2, 6
# SIGTERM at the end of epoch 2's third step: the backup is taken at the step after
# (the backup's callback runs before the probe's), and the rerun goes on from there.
STOP_AT, RESUMED_AT = (1, 2), (1, 4)


def _batch(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size, 8)).astype(np.float32)
    return x, np.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3]


class Regression(Task):
    """Dense, Dropout(0.5), Dense, in the Keras `keras` names, on 256 examples by index."""

    @dataclasses.dataclass(frozen=True)
    class Params:
        keras: str = field("tf_keras", choices=dialects.NAMES)

    @property
    def keras(self):
        return dialects.module(self.params.keras)

    def build_model(self):
        layers = self.keras.layers
        inputs = self.keras.Input((8,))
        hidden = layers.Dense(64, activation="relu")(inputs)
        return self.keras.Model(inputs, layers.Dense(1)(layers.Dropout(0.5)(hidden)))

    def train_source(self):
        return data.indexed_arrays(*_batch(256, seed=0))

    def eval_dataset(self, split, batch_size):
        return tf.data.Dataset.from_tensors(_batch(batch_size, seed=1)) if split == "test" else None

    def loss(self):
        return self.keras.losses.MeanSquaredError()


def _mnist(config: cfg.Config, keras: str) -> Mnist:
    """The MNIST task's CNN (its dropout 0.5) on tiny images by index (from_arrays)."""
    params = Mnist.Params(keras=keras, validation_examples=0)
    return Mnist.from_arrays(tiny_split(256), None, tiny_split(32, seed=2), params,
                             seed=config.train.seed)


TASKS = {"regression": lambda config, keras: Regression(Regression.Params(keras),
                                                         seed=config.train.seed),
         "mnist": _mnist}


def _config(deterministic: bool) -> cfg.Config:
    return cfg.load(None, [f"train.deterministic={str(deterministic).lower()}",
                           f"train.epochs={EPOCHS}", f"train.steps_per_epoch={STEPS}",
                           "train.verbose=0", "eval.test_every_epoch=false",
                           "eval.batch_size=32"])


def _train(config: cfg.Config, keras: str, workdir, kind: str, monkeypatch,
           stop_at: tuple[int, int] | None = None,
           task_name: str = "regression") -> tuple[list[np.ndarray], Probe]:
    """Every variable of the model and its optimizer after the run's last step (the
    dropout generator's state too, in Keras 3), and the probe that watched the run."""
    task = TASKS[task_name](config, keras)
    last: list[np.ndarray] = []

    def record(model, epoch, batch):
        dialect = dialects.of(model, task)
        last[:] = [np.array(v.numpy()) for v in dialect.variables(model, model.optimizer)]

    probe = attach(monkeypatch, Probe(stop_at, how="sigterm", on_batch=record))
    trainer.run(config, workdir, strategy=STRATEGIES[kind](), task=task)
    return last, probe


def _interrupted_and_resumed(config, keras, workdir, kind, monkeypatch,
                             task_name: str = "regression") -> list[np.ndarray]:
    with pytest.raises(preemption.Preempted):
        _train(config, keras, workdir, kind, monkeypatch, stop_at=STOP_AT, task_name=task_name)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the stopped run left it ignored
    resumed, probe = _train(config, keras, workdir, kind, monkeypatch, task_name=task_name)
    assert probe.seen[0] == RESUMED_AT  # mid-epoch: the backup's step, not the epoch's start
    return resumed


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest difference between two runs' weights and optimizer slots (floats)."""
    return max(float(np.max(np.abs(x.astype(np.float64) - y)))
               for x, y in zip(a, b, strict=True) if x.dtype.kind == "f")


@pytest.mark.parametrize("kind", STRATEGIES)
@pytest.mark.parametrize("keras", dialects.NAMES)
def test_a_resumed_deterministic_run_ends_with_the_uninterrupted_runs_weights(
        keras, kind, tmp_path, monkeypatch):
    config = _config(deterministic=True)
    clean, _ = _train(config, keras, tmp_path / "clean", kind, monkeypatch)
    resumed = _interrupted_and_resumed(config, keras, tmp_path / "resumed", kind, monkeypatch)
    assert len(clean) == len(resumed) > 0
    assert all(np.array_equal(a, b) for a, b in zip(clean, resumed, strict=True)), (
        max_difference(clean, resumed))
    # Both switches are process-global: off again once the run is over.
    assert not tf_internal.op_determinism_enabled()
    assert not tf_keras.backend.experimental.is_tf_random_generator_enabled()


@pytest.mark.parametrize("keras", dialects.NAMES)
def test_mnist_stopped_mid_epoch_and_resumed_ends_bit_for_bit_as_if_never_stopped(
        keras, tmp_path, monkeypatch):
    config = _config(deterministic=True)
    clean, _ = _train(config, keras, tmp_path / "clean", "default", monkeypatch,
                      task_name="mnist")
    resumed = _interrupted_and_resumed(config, keras, tmp_path / "resumed", "default",
                                       monkeypatch, task_name="mnist")
    assert all(np.array_equal(a, b) for a, b in zip(clean, resumed, strict=True)), (
        max_difference(clean, resumed))


def test_without_it_a_resumed_keras_2_run_draws_other_dropout_masks(tmp_path, monkeypatch):
    # TF1's stateful random ops keep their state in the op's kernel: the resumed run's
    # train function starts it over. (What the switch is for: the test above would
    # fail in the same way without it.)
    config = _config(deterministic=False)
    clean, _ = _train(config, "tf_keras", tmp_path / "clean", "default", monkeypatch)
    resumed = _interrupted_and_resumed(config, "tf_keras", tmp_path / "resumed", "default",
                                       monkeypatch)
    assert max_difference(clean, resumed) > 0
