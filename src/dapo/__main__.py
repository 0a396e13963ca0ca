"""``python -m dapo`` and the ``dapo`` command: Ctrl-C is held from the first line, before
the imports (:func:`dapo.process_exit.hold_interrupts`)."""

from dapo.process_exit import hold_interrupts

hold_interrupts()

from dapo.cli import run  # noqa: E402

if __name__ == "__main__":
    run()
