"""An MLflow client that sends again what MLflow's async queue failed to store.

The queue writes batches on a thread of its own and, where a request fails, logs "Failed to log run
data" and drops the batch. MLflow's HTTP client retries a request it could not send, but not one
whose response was cut mid-body (a server killed while answering): that batch's metrics may or may
not be stored, and nothing sends them again. This client keeps each batch it hands the queue until
a flush (``confirm``, after the queue is drained): if any failed, every batch since the last flush
is sent again, synchronously. The queue merges batches before writing, and only the merged one
carries the error, hence "every". A SQL store keeps a metric's (value, step, timestamp) once, so
batches that did arrive are not doubled.

A module of its own so that importing the logger does not import MLflow (0.8 s).
"""

from __future__ import annotations

import logging

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

log = logging.getLogger(__name__)


class ResendingClient(MlflowClient):
    def __init__(self, tracking_uri: str):
        super().__init__(tracking_uri)
        # (the queue's operations, or None for a batch known not to be stored; run id, metrics, params, tags)
        self._unconfirmed: list[tuple] = []

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        # Copies: the queue extends a batch's own lists with the batches it merges into it.
        batch = (run_id, list(metrics), list(params), list(tags))
        operations = super().log_batch(run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)
        if operations is not None:  # asynchronous
            self._unconfirmed.append((operations, *batch))
        return operations

    @property
    def unconfirmed(self) -> int:
        """Batches handed to the queue since the last ``confirm``."""
        return len(self._unconfirmed)

    def confirm(self, last: bool = False) -> None:
        """After the queue is drained: send again, synchronously, every batch since the last call if any
        failed. Batches that still fail wait for the next call; at the ``last`` one they are reported lost."""
        batches, self._unconfirmed = self._unconfirmed, []
        failures = [error for operations, *_ in batches if (error := _failure(operations)) is not None]
        if not failures:
            return
        log.warning(
            "MLflow: %d of %d batches since the last flush were not stored (%s); sending all %d again",
            len(failures), len(batches), failures[0], len(batches),
        )  # fmt: skip
        for index, (_, run_id, metrics, params, tags) in enumerate(batches):
            try:
                super().log_batch(run_id, metrics=metrics, params=params, tags=tags, synchronous=True)
            except MlflowException as error:
                left = [(None, *batch[1:]) for batch in batches[index:]]
                self._unconfirmed = left + self._unconfirmed
                metrics_left = [metric for _, _, metrics, _, _ in left for metric in metrics]
                steps = sorted({metric.step for metric in metrics_left})
                what = f"{len(metrics_left)} metric values of steps {steps[0]}..{steps[-1]}" if steps else "params/tags"
                if last:
                    log.error("MLflow: %s were not stored and are lost: %s", what, error)
                    self._unconfirmed = []
                else:
                    log.error("MLflow: %s are not stored yet (%s); sent again at the next flush", what, error)
                return


def _failure(operations) -> MlflowException | None:
    if operations is None:  # a batch whose sending failed before
        return MlflowException("not sent")
    try:
        operations.wait()
    except MlflowException as error:
        return error
    return None
