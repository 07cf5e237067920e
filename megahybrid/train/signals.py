"""Stop signals of `megahybrid train`: SIGTERM, SIGUSR1 and Ctrl-C (SIGINT).

Installed first thing by the CLI (before torch is imported), so no signal ends a run silently. During start-up
there is nothing to save: a stop signal raises `Interrupted` at once and the CLI prints what happened and exits
with EXIT_REQUEUE. Once the trainer is set up (`defer()`), a signal is only recorded: the loop finishes its step,
saves and exits with EXIT_REQUEUE. A second Ctrl-C after that raises `Interrupted(abort=True)` at once (exit
EXIT_ABORTED, no save; the run resumes from its last checkpoint).
"""
import os
import signal

EXIT_REQUEUE, EXIT_ABORTED = 3, 130
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Interrupted(BaseException):
    """A stop signal that cannot wait for the end of a step. BaseException, like KeyboardInterrupt, so that no
    `except Exception` swallows it."""

    def __init__(self, signal_name: str, abort: bool):
        super().__init__(signal_name)
        self.signal_name, self.abort = signal_name, abort

    @property
    def exit_code(self) -> int:
        return EXIT_ABORTED if self.abort else EXIT_REQUEUE

    def message(self) -> str:
        if self.abort:
            return (f"error: second {self.signal_name}: aborted without saving; exit code {EXIT_ABORTED} (the next "
                    "start resumes from the last checkpoint)")
        return (f"received {self.signal_name} during start-up, before the first step: nothing to save; exiting with "
                f"code {EXIT_REQUEUE} so the launcher can requeue (the next start resumes from the last checkpoint)")


class StopRequest:
    """The process's stop-signal state (one per process: see `install_stop_handlers`)."""

    def __init__(self):
        self.signal_name = None
        self.deferring = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.deferring:
            raise Interrupted(name, abort=False)
        if self.signal_name is not None and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third Ctrl-C must not kill the clean abort's exit
            raise Interrupted(name, abort=True)
        if self.signal_name is None:  # os.write, not print: a handler may run in the middle of a print
            os.write(2, f"received {name}: saving at the end of this step (Ctrl-C again aborts without saving)\n"
                     .encode())
            self.signal_name = name

    def defer(self) -> None:
        """From now on a stop is recorded and handled by the training loop."""
        self.deferring = True

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


_CURRENT: StopRequest | None = None


def install_stop_handlers() -> StopRequest:
    """The process's one stop state, its handlers (re)installed: a new run in the same process starts clean."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = StopRequest()
    _CURRENT.signal_name, _CURRENT.deferring = None, False
    _CURRENT.install()  # every call: an earlier run's abort left Ctrl-C ignored
    return _CURRENT
