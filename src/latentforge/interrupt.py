"""Stop a long job on a signal at a safe point, with its work saved, so that a rerun resumes.

A preemptible machine, Kubernetes, a scheduler's time limit or Ctrl-C send SIGTERM or SIGINT;
SLURM sends a warning signal ahead of the time limit when asked (``sbatch --signal=USR1@120``).
While a :class:`StopOnSignal` is entered, these signals only *record* a stop request: the job
(training, VAE training, encoding) looks at it between its steps, never in the middle of one,
writes a complete checkpoint through its usual atomic path, and its command exits with
:data:`EXIT_INTERRUPTED`, so that a scheduler can requeue the job and the rerun resumes.

A signal never raises in the middle of a write (the default SIGINT handler would raise
KeyboardInterrupt anywhere). A second signal while stopping only prints that the save is under
way: the checkpoint being written is published by an atomic rename, so even the SIGKILL that
follows a scheduler's grace period leaves the previous checkpoint loadable.

On several ranks the signal may reach one rank only: :meth:`StopOnSignal.agreed` combines the
ranks' requests with one all-reduce of a single number (``World.any_rank``), so that all ranks
stop after the same step.

A data-loading worker gets the signals too when they go to the whole process group (Ctrl-C in a
terminal, ``timeout``, ``kill -- -PGID``) or to every process of a job: torch's workers die on
SIGTERM, and the dying worker then raised in the middle of the parent's step. The workers therefore
ignore the signals their parent is catching when another process sends them (:func:`ignore_in_worker`,
their ``worker_init_fn``); the parent's own SIGTERM still ends them.

Python signal handlers can only be installed by the main thread; elsewhere (a Ray Train worker
runs its loop in a thread) the job is stopped through a stop file instead, which the launcher
creates when it receives the signal.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from latentforge.errors import Problems

__all__ = ["EXIT_INTERRUPTED", "InterruptConfig", "StopOnSignal", "caught_signals", "ignore_in_worker",
           "signal_number"]

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL, "a temporary failure; the user is invited to retry": the command stopped
# on a signal after saving its work; rerunning it resumes. Distinct from 0 (done), 1 (a crash),
# 2 (bad input) and 130 (interrupted before anything could be saved).
EXIT_INTERRUPTED = 75

_NEVER = ("SIGKILL", "SIGSTOP")  # cannot be caught


def signal_number(name: str) -> int:
    """``"USR1"`` or ``"SIGUSR1"`` -> its number; raises ValueError on an unknown name."""
    full = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    if full in _NEVER or not hasattr(signal.Signals, full) or full.startswith("SIG_"):
        raise ValueError(full)
    return int(signal.Signals[full])


@dataclass
class InterruptConfig:
    """What a job does on SIGINT, SIGTERM and ``extra_signal``."""

    save_on_signal: bool = field(default=True, metadata={
        "help": "finish the current step, save a checkpoint and exit with code 75 (rerun to resume); "
                "false = the signals end the job at once as usual (work since the last checkpoint is lost)"})
    extra_signal: str = field(default="SIGUSR1", metadata={
        "help": "one more signal that stops the job with a checkpoint, e.g. SLURM's sbatch --signal=USR1@120; "
                "empty = none"})
    grace_seconds: float = field(default=30.0, metadata={
        "help": "the notice between the signal and the SIGKILL that follows it (spot instances: 30-120 s, "
                "Kubernetes terminationGracePeriodSeconds: 30 s); a checkpoint that takes longer is warned about"})
    check_every_steps: int = field(default=1, metadata={
        "help": "steps between the ranks' agreement on a stop request (one all-reduce of one number); "
                "a stop then waits for up to this many steps"})

    def validate(self) -> None:
        problems = Problems()
        if self.extra_signal:
            try:
                signal_number(self.extra_signal)
            except ValueError:
                problems.add(f"extra_signal: {self.extra_signal!r} is not a signal that can be caught here "
                             "(e.g. SIGUSR1, SIGUSR2, SIGHUP; empty = none)")
        if not self.grace_seconds >= 0:
            problems.add(f"grace_seconds: must be >= 0, got {self.grace_seconds}; "
                         "the seconds a stop signal leaves to save")
        if self.check_every_steps < 1:
            problems.add(f"check_every_steps: must be >= 1, got {self.check_every_steps}; "
                         "1 = check for a stop signal every step")
        problems.raise_if_any()

    def signals(self) -> list[int]:
        out = [int(signal.SIGINT), int(signal.SIGTERM)]
        if self.extra_signal and signal_number(self.extra_signal) not in out:
            out.append(signal_number(self.extra_signal))
        return out


class StopOnSignal:
    """While entered (``with``), the configured signals record a stop request instead of ending
    the process; leaving restores the previous handlers. See the module docstring.

    ``stop_file``: a path whose existence also requests a stop (for jobs that do not run in the
    main thread, see the module docstring); ``what``: the job's name in messages; ``on_signal``:
    called once, at the first signal (a launcher passes the request on to its workers); ``stopping``:
    what the job does on it, as the first message says."""

    def __init__(self, cfg: InterruptConfig | None = None, stop_file: str | os.PathLike | None = None,
                 what: str = "latentforge", on_signal: Callable[[], None] | None = None,
                 stopping: str = "stopping after the current step with a checkpoint"):
        self.cfg = cfg or InterruptConfig()
        self.stop_file = Path(stop_file) if stop_file else None
        self.what = what
        self.stopping = stopping  # what the first signal's message says the job does
        self.signal_name: str | None = None  # of the first signal received
        self.num_signals = 0
        self.received_at = 0.0  # time.monotonic() of the first signal
        self.saving = False  # set by the job while it writes a checkpoint
        self.on_signal = on_signal
        self._previous: dict[int, Any] = {}

    # ------------------------------------------------------------------ handlers

    def __enter__(self) -> "StopOnSignal":
        if not self.cfg.save_on_signal or threading.current_thread() is not threading.main_thread():
            return self
        for num in self.cfg.signals():
            self._previous[num] = signal.signal(num, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for num, handler in self._previous.items():
            signal.signal(num, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between two bytecodes, possibly in the middle of a write: it only
        # records, and says so on stderr (os.write: no buffered stream is re-entered).
        name = signal.Signals(signum).name
        self.num_signals += 1
        if self.signal_name is None:
            self.signal_name = name
            self.received_at = time.monotonic()
            text = f"{self.what}: {name} received: {self.stopping} (rerun the same command to resume)"
            if self.on_signal is not None:
                self.on_signal()
        elif self.saving:
            text = (f"{self.what}: {name} received again: the checkpoint is being written "
                    f"({time.monotonic() - self.received_at:.0f} s since the first signal); it is atomic, "
                    "so stopping now keeps the previous one")
        else:
            text = f"{self.what}: {name} received again: already stopping after the current step"
        try:
            os.write(sys.stderr.fileno(), (text + "\n").encode())
        except (OSError, ValueError):  # no usable stderr
            pass

    # ------------------------------------------------------------------ queries

    @property
    def requested(self) -> bool:
        """Has this process been asked to stop (a signal, or the stop file)?"""
        if self.signal_name is None and self.stop_file is not None and self.stop_file.exists():
            self.signal_name = "stop file"
            self.received_at = time.monotonic()
        return self.signal_name is not None

    def agreed(self, any_rank: Callable[[bool], bool] | None, step: int) -> bool:
        """Do the ranks stop after ``step``? Every ``check_every_steps`` steps, the OR of the ranks'
        requests (``any_rank``: an all-reduce; None = one process), so all ranks answer alike.
        Every rank must call this at every step."""
        if any_rank is None:
            return self.requested
        if step % self.cfg.check_every_steps:
            return False
        stop = any_rank(self.requested)
        if stop and self.signal_name is None:
            self.signal_name = "another rank's signal"
            self.received_at = time.monotonic()
        return stop

    def warn_if_slow(self, seconds: float, what: str = "a checkpoint") -> None:
        """A save of ``seconds`` longer than the grace period would be cut short by the SIGKILL."""
        if self.cfg.save_on_signal and self.cfg.grace_seconds and seconds > self.cfg.grace_seconds:
            log.warning("%s took %.1f s, longer than interrupt.grace_seconds=%g s: a save on a signal may be "
                        "killed before it completes (the previous checkpoint is then kept)", what, seconds,
                        self.cfg.grace_seconds)


def caught_signals() -> tuple[int, ...]:
    """The signals this process routes to a :class:`StopOnSignal` now (none outside one)."""
    out = []
    for num in (int(s) for s in signal.valid_signals()):
        if num in (int(signal.SIGKILL), int(signal.SIGSTOP)):
            continue
        try:
            handler = signal.getsignal(num)
        except (OSError, ValueError):
            continue
        if isinstance(getattr(handler, "__self__", None), StopOnSignal):
            out.append(num)
    return tuple(out)


def ignore_in_worker(signals: Sequence[int], worker_id: int = 0) -> None:
    """A data-loading worker's ``worker_init_fn`` (bound to its parent's :func:`caught_signals` with
    ``functools.partial``, so that it also works with the "spawn" start method): ignore those
    signals when anyone but the parent sends them, so that one sent to the whole process group stops
    the parent at its next step and does not kill the worker under it.

    SIGTERM from the parent still ends the worker, as torch's own handler does: the parent sends it
    to a worker that did not exit when asked, and at its exit to every worker still alive (after a
    crash, a traceback may hold a loader open). A worker that ignored it too would leave the parent
    waiting for it for ever. So SIGTERM is blocked and taken by a thread that reads who sent it
    (``sigwaitinfo``); where that call does not exist (macOS), torch's handler is left as it is. A
    worker whose parent died exits by itself (torch checks every few seconds)."""
    for num in signals:
        if num != signal.SIGTERM:
            signal.signal(num, signal.SIG_IGN)
        elif hasattr(signal, "sigwaitinfo"):
            _sigterm_only_from(os.getppid())


def _sigterm_only_from(parent: int) -> None:
    """This process exits on SIGTERM from ``parent`` (exit code 0, as torch's worker handler does)
    and ignores it from any other sender. Called before the process starts threads of its own, so
    that they inherit the blocked mask and the waiting thread alone takes the signal."""
    def take() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=take, name="sigterm-from-parent", daemon=True).start()
