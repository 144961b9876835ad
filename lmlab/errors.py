"""The error types for problems a user causes and for runs stopped on purpose."""


class ConfigError(ValueError):
    """Raised before long work starts; the message says what was wrong and how to fix it."""


# Every stop signal (SIGINT, SIGTERM) a run of this process took, also one that came too late to stop it (in its last
# step or validation): a sweep that runs its jobs here starts no further job (lmlab.cli.app).
STOP_SIGNALS: list[int] = []


class RunInterrupted(Exception):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM after saving a checkpoint; the message says how to resume.

    `exit_code` is the shell's convention for the signal (128 + its number)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):  # picklable across the processes of a multi-process run
        return type(self), (str(self), self.exit_code)
