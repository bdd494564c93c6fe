"""pytest plugin of the peer stage: say which library answers to ``accelerate`` and which modules were aliased.

Loaded with ``-p peer_plugin`` (this folder is on ``PYTHONPATH``). Under the alias it stops the run before any test
when ``accelerate.Accelerator`` is not lightning_accel's, so a pass count can never be HF's by mistake.
"""

from __future__ import annotations

import os
from typing import Any

import pytest


def _aliased() -> bool:
    return os.environ.get("LIGHTNING_ACCEL_ALIAS") == "1"


def pytest_report_header(config: pytest.Config) -> list[str]:
    import accelerate

    lines = [f"peer: accelerate resolves to {accelerate.__name__} ({accelerate.__file__})"]
    lines.append(f"peer: accelerate.Accelerator is {accelerate.Accelerator.__module__}.Accelerator")
    if _aliased():
        import lightning_accel

        if accelerate.Accelerator is not lightning_accel.Accelerator:
            raise pytest.UsageError("LIGHTNING_ACCEL_ALIAS=1 but accelerate.Accelerator is not lightning_accel's")
        lines.append("peer: accelerate.Accelerator is lightning_accel.Accelerator: True")
    return lines


def pytest_terminal_summary(terminalreporter: Any) -> None:
    log = os.environ.get("LIGHTNING_ACCEL_ALIAS_LOG")
    if not _aliased() or not log or not os.path.exists(log):
        return
    pids: set[str] = set()
    modules: set[str] = set()
    with open(log) as f:
        for line in f:
            pid, _, mapping = line.strip().partition(" ")
            pids.add(pid)
            modules.add(mapping)
    terminalreporter.write_sep("-", f"aliased modules ({len(modules)}, in {len(pids)} processes)")
    for mapping in sorted(modules):
        terminalreporter.write_line(mapping)
