"""A callback that watches a run from inside `trainer.run` and stops it where a test says."""

import os
import signal

from app.run import callbacks


class Interrupted(RuntimeError):
    """A crash the test made (as SIGKILL would, but leaving the process alive)."""


class Probe(callbacks.Callback):
    """Records the (epoch, batch) of every batch end; at `stop_at` it sends this process
    SIGTERM ("sigterm") or raises `Interrupted` ("crash"). `on_begin(model)` runs when
    training begins (after any restore), `on_batch(model, epoch, batch)` at each batch end."""

    def __init__(self, stop_at: tuple[int, int] | None = None, how: str = "crash",
                 on_begin=None, on_batch=None):
        super().__init__()
        self._supports_tf_logs = True  # batch hooks under tf_keras' ParameterServerStrategy
        self.stop_at, self.how, self.on_begin, self.on_batch = stop_at, how, on_begin, on_batch
        self.seen: list[tuple[int, int]] = []
        self._epoch = 0

    def on_train_begin(self, logs=None):
        if self.on_begin:
            self.on_begin(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self._epoch, int(batch)))
        if self.on_batch:
            self.on_batch(self.model, self._epoch, int(batch))
        if (self._epoch, batch) != self.stop_at:
            return
        if self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            raise Interrupted(f"stopped at epoch {self._epoch + 1}, batch {batch}")


_FOR_TRAINING = callbacks.for_training


def attach(monkeypatch, probe: Probe) -> Probe:
    """Make `trainer.run` add `probe` last to its callbacks (replacing an earlier probe)."""
    monkeypatch.setattr(callbacks, "for_training",
                        lambda *args, **kwargs: [*_FOR_TRAINING(*args, **kwargs), probe])
    return probe
