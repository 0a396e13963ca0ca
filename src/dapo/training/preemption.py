"""Stopping a run on SIGTERM, Ctrl-C or an early-warning signal, with its work saved.

Schedulers (Slurm, Kubernetes, systemd) send SIGTERM, and wait a grace period before SIGKILL.
While a run is inside :meth:`StopSignals.watching` the first such signal only asks it to
stop: a rollout step still generating or scoring is abandoned at once (nothing of it has
touched the weights, the optimizer or the data position the trainer snapshot before it),
one that is updating is finished, and the trainer then saves a checkpoint, writes
``summary.json`` marked interrupted and raises :class:`~dapo.errors.Interrupted`. Past
``checkpoint.signal_grace_s`` the process ends anyway, saying so. A second Ctrl-C stops at
once (``KeyboardInterrupt``). Under torchrun every rank learns of a signal any rank got at
the next step boundary, so all stop at the same step.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dapo.config import Config
from dapo.errors import Interrupted
from dapo.parallel import distributed as D
from dapo.process_exit import pop_interrupt
from dapo.training.checkpoint import latest_checkpoint, save_checkpoint, step_dir


class StopNow(Exception):
    """Raised by the signal handler inside :meth:`StopSignals.abortable`: the step under way
    is abandoned."""


def exit_code(name: str) -> int:
    """The shell's code for a process ended by signal ``name``: 130 for SIGINT, else 143
    (what schedulers read as "terminated")."""
    return 130 if name == "SIGINT" else 128 + signal.SIGTERM


class StopSignals:
    """The signals that stop a run with a checkpoint, and where the run may be cut short."""

    def __init__(self, cfg: Config, checkpoints: Path) -> None:
        c = cfg.checkpoint
        self.enabled = c.on_signal == "save"
        self.names = ["SIGINT", *[s for s in c.stop_signals if s != "SIGINT"]]
        self.grace_s = c.signal_grace_s
        self.requested: str | None = None  # the first signal's name
        self.stopping = False  # this rank, or another, got one: stop at this step boundary
        self.stopped_by: str | None = None  # the signal that stops the run, on every rank
        self.saved: str | None = None  # the checkpoint saved on the way out
        self.checkpoints = checkpoints
        self._abortable = False
        self._deadline: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    @contextlib.contextmanager
    def watching(self) -> Iterator[StopSignals]:
        """Handle the signals inside the block (from the main thread only; elsewhere, and
        with ``checkpoint.on_signal=exit``, they keep their default effect)."""
        installed = self.enabled and threading.current_thread() is threading.main_thread()
        if installed:
            for name in self.names:
                num = getattr(signal, name)
                self._previous[num] = signal.signal(num, self._handle)
            if pop_interrupt():  # a Ctrl-C held since start-up (dapo.process_exit)
                self._handle(signal.SIGINT, None)
        try:
            yield self
        finally:
            for num, previous in self._previous.items():
                signal.signal(num, previous)
            self._previous.clear()
            if self._deadline is not None:
                self._deadline.cancel()

    @contextlib.contextmanager
    def abortable(self, allowed: bool = True) -> Iterator[None]:
        """A stretch of work a signal may cut short (:class:`StopNow`); what it raises after
        a signal (a user worker killed along with the trainer, say) becomes ``StopNow`` too."""
        if not allowed:
            yield
            return
        self._abortable = True
        try:
            if self.requested:
                raise StopNow
            yield
        except StopNow:
            self.stopping, self.stopped_by = True, self.requested
            raise
        except BaseException as exc:
            if self.requested is None:
                raise
            self.stopping, self.stopped_by = True, self.requested
            raise StopNow from exc
        finally:
            self._abortable = False

    @contextlib.contextmanager
    def generating(self, trainer: Any) -> Iterator[None]:
        """A rollout step's generation and scoring, which a stop signal abandons in a single
        process (ranks must stop at the same step) without a producer thread: the state the
        step begins with is kept (``trainer.unsaved``, a copy: filling a batch changes what
        it holds), unless a checkpoint of this step holds it already."""
        cut = self.enabled and trainer.dist.world_size == 1
        unsaved = cut and trainer.saved_step != trainer.step
        trainer.unsaved = copy.deepcopy(trainer.state_dict()) if unsaved else None
        with self.abortable(cut):
            yield

    def should_stop(self) -> bool:
        """Whether any rank got a stop signal (every rank calls this at a step boundary)."""
        if self.enabled and not self.stopping:
            names = [self.requested]
            if D.current().world_size > 1:  # one small gather a step: the same answer on all
                names = D.all_gather_objects(self.requested)
            self.stopped_by = next((n for n in names if n is not None), None)
            self.stopping = self.stopped_by is not None
        return self.stopping

    def _handle(self, num: int, frame: Any) -> None:
        name = signal.Signals(num).name
        if self.requested is not None:
            if name == "SIGINT":  # a second Ctrl-C: stop now, no checkpoint
                raise KeyboardInterrupt
            return
        self.requested = name
        if D.current().is_main:  # os.write: print() may be in the middle of a write
            line = (
                f"{name}: stopping at the next safe point to save a checkpoint (within "
                f"checkpoint.signal_grace_s={self.grace_s:g} s; Ctrl-C again to stop at once)\n"
            )
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), line.encode())
        self._deadline = threading.Timer(self.grace_s, self._overdue, args=(name,))
        self._deadline.daemon = True
        self._deadline.start()
        if self._abortable:
            raise StopNow

    def _overdue(self, name: str) -> None:
        grace = f"checkpoint.signal_grace_s={self.grace_s:g} s"
        if self.saved is not None:  # what is left is the clean-up (workers, summary)
            line = (
                f"dapo: {name}: saved in {self.saved}, but the run did not end within {grace}; "
                "exiting now"
            )
        else:
            last = latest_checkpoint(self.checkpoints)
            saved = f"last checkpoint: {last}" if last else "no checkpoint was saved"
            line = (
                f"dapo: {name}: no checkpoint could be saved within {grace}; exiting without "
                f"it ({saved}). Raise checkpoint.signal_grace_s (below the scheduler's kill "
                "wait) or save more often (checkpoint.save_every)"
            )
        print(line, file=sys.stderr, flush=True)
        os._exit(exit_code(name))


def interrupt(trainer: Any) -> Interrupted:
    """Save the state of the last step completed (a step abandoned while generating had not
    changed it: its start state, ``trainer.unsaved``, is saved); the error that ends the run,
    with the command that resumes it (also in ``summary.json``)."""
    t, root, signals = trainer, trainer.out / "checkpoints", trainer.signals
    name = signals.stopped_by or signals.requested or "SIGTERM"
    unsaved, t.unsaved = t.unsaved, None
    if unsaved is not None and unsaved["step"] == t.step:  # a step was abandoned
        keep = t.cfg.checkpoint.keep_last
        path = save_checkpoint(root, t.step, t.model, t.learner.optimizer, unsaved, keep_last=keep)
        t.saved_step = t.step
    else:
        path = t.save() if t.saved_step != t.step else step_dir(root, t.step)
    signals.saved = str(path)
    command = f"{_launcher(t.dist.world_size)} train {t.out / 'config.yaml'} resume=true"
    t.summary["interrupted"] = {
        "signal": name,
        "step": t.step,
        "checkpoint": str(path),
        "resume": command,
    }
    return Interrupted(
        f"{name}: stopped at rollout step {t.step}, saved in {path}. Resume with: {command}",
        signal=name,
        step=t.step,
        checkpoint=str(path),
        exit_code=exit_code(name),
    )


def _launcher(world: int) -> str:
    """How this run was started: ``dapo``, or torchrun with as many ranks per node and nodes
    (a run across nodes also needs its rendezvous options again)."""
    if world == 1:
        return "dapo"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node >= world:
        return f"torchrun --nproc_per_node {world} -m dapo"
    nodes = world // max(per_node, 1)
    return f"torchrun --nnodes {nodes} --nproc_per_node {per_node} RENDEZVOUS_OPTIONS -m dapo"
