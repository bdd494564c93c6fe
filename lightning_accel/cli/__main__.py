"""``python -m lightning_accel.cli``: the ``lightning-accel`` command."""

import sys

from lightning_accel.cli import main

if __name__ == "__main__":
    sys.exit(main())
