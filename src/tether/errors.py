"""Tether's exceptions, one small tree.

    TetherError                   every error Tether raises on purpose
    ├── ConfigError               a recipe, override or flag is wrong; the message says what to change
    │   └── PluginError           a plug-in (run.plugins) failed to import or registered something wrong
    ├── ControlError              the control plane's rules were broken
    │   ├── StaleBatchError       a batch is staler than the budget (``async.on_stale=error``)
    │   └── AdmissionStallError   nothing in flight or ready and no launch allowed (a bug, never a hang)
    ├── QueueClosedError          a rollout-batch queue was closed while someone used it
    ├── QueueTimeoutError         a blocking queue call ran past its timeout
    ├── NothingLearnedError       a run trained its batches and committed no update; says why
    ├── RolloutError              generation or scoring failed; carries the worker, batch and cause
    │   └── WorkerRestartLimitError  a worker died past rollout.max_worker_restarts replacements
    ├── LearnerLostError          the learner's Ray actor, or one of its ranks, died or stopped answering
    ├── LearnerError              an exception inside a learner rank; carries the rank's traceback
    ├── LearnerMemoryError        the learner ran out of memory; says in which phase and what lowers it
    ├── RunBusyError              another process holds the run directory's lock
    ├── CheckpointError           a checkpoint could not be written; the last good one is kept
    ├── DataError                 a dataset file, row or column is unusable; names file, row, expectation
    ├── RewardError               a reward function is missing, has the wrong signature, or returned junk
    ├── LossError                 a plug-in's loss returned the wrong shape, no gradient, junk or NaN
    └── NativeDecoderError        rollout.decoder=native, and the native decoder cannot run; says why

    KeyboardInterrupt
    └── StopRequested             SIGINT or SIGTERM asked the run to stop (it saves, then exits)

User mistakes raise ``ConfigError``; internal invariants use ``assert``.
"""

from __future__ import annotations


class TetherError(Exception):
    """Base of every error Tether raises on purpose."""


class ConfigError(TetherError, ValueError):
    """A recipe key, value, override or flag is wrong. The message names the fix."""


class PluginError(ConfigError):
    """A plug-in named by ``run.plugins`` failed to import, or registered something wrong (a name
    taken, an object that lacks what its kind needs)."""


class ControlError(TetherError):
    """A control-plane rule was violated (versions, budget, admission)."""


class StaleBatchError(ControlError):
    """A rollout batch is staler than the staleness budget when it is about to train."""


class AdmissionStallError(ControlError):
    """Nothing is in flight or ready and admission opens no slot: the loop would hang."""


class QueueClosedError(TetherError):
    """The rollout-batch queue was closed."""


class QueueTimeoutError(TetherError, TimeoutError):
    """A blocking get or put on the rollout-batch queue did not finish in time."""


class NothingLearnedError(TetherError):
    """Every batch of a run was trained and no update was committed: each had nothing to learn
    from or a non-finite gradient. The run directory is complete; the weights are unchanged."""


class RolloutError(TetherError):
    """Generating or scoring a rollout batch failed.

    ``worker`` and ``batch_index`` say where; ``remote_traceback`` holds the original traceback
    text when the failure happened in another thread or process.
    """

    def __init__(
        self,
        message: str,
        *,
        worker: str | None = None,
        batch_index: int | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        self.worker = worker
        self.batch_index = batch_index
        self.remote_traceback = remote_traceback
        where = []
        if worker is not None:
            where.append(f"worker {worker}")
        if batch_index is not None:
            where.append(f"batch {batch_index}")
        text = f"{', '.join(where)}: {message}" if where else message
        if remote_traceback:
            text = f"{text}\n\nOriginal traceback:\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.message = message


class WorkerRestartLimitError(RolloutError):
    """A rollout worker died after ``rollout.max_worker_restarts`` replacements
    (``rollout.on_worker_loss: replace``); the message names the worker, the count and the key."""


class LearnerLostError(TetherError):
    """The learner's Ray actor (``ray.learner: actor``), or one of its ranks
    (``train.world_size`` > 1), died or stopped answering."""


class LearnerError(TetherError):
    """An exception inside a learner rank process; the message ends with its traceback."""

    def __init__(self, message: str, *, remote_traceback: str = "") -> None:
        self.remote_traceback = remote_traceback
        if remote_traceback:
            message = f"{message}\n\nOriginal traceback:\n{remote_traceback.rstrip()}"
        super().__init__(message)


class LearnerMemoryError(TetherError):
    """The learner ran out of memory (``torch.OutOfMemoryError``, ``MemoryError``): the message
    names the phase (π_old, an update's forward and backward, the optimizer step, a publication)
    and the keys that lower it (``tether.train.memory``)."""


class DataError(TetherError, ValueError):
    """A dataset is empty, unreadable, or lacks a column; the message names the file and row."""


class RewardError(TetherError):
    """A reward function could not be loaded, or returned something other than a finite number."""


class LossError(TetherError):
    """A loss a plug-in registered (``tether.register_loss``) returned per-column losses of the
    wrong shape or without a gradient, metrics that are not numbers, or non-finite values."""


class RunBusyError(TetherError):
    """The run directory is locked by another live process (a run or a resume in progress)."""


class CheckpointError(TetherError):
    """Writing a checkpoint failed (disk full, permissions); nothing partial is left behind."""


class StopRequested(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM) reached the run. A ``KeyboardInterrupt`` so that every
    layer unwinds as it does for Ctrl-C; ``signal_name`` says which one, for the exit status."""

    def __init__(self, signal_name: str = "SIGINT") -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process killed by it (130, 143)."""
        import signal

        return 128 + int(signal.Signals[self.signal_name])


class NativeDecoderError(TetherError, RuntimeError):
    """``rollout.decoder=native`` but the native decoder cannot run here: no C compiler, a failed
    build (its output included), a torch without MKL's packed GEMM, or a model that is not float32
    on the CPU. The message says which, and that ``auto`` or ``python`` decode without it."""
