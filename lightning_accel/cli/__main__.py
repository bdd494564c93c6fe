"""``python -m lightning_accel.cli``: the ``lightning-accel`` command."""

import sys

from lightning_accel.cli import main

sys.exit(main())
