"""What every test gets: fresh shared state, the ``launch`` tier, and checks that nothing leaks into the next test.

Tiers: every test under ``tests/launch/`` carries the ``launch`` marker (it starts processes: ``torch.distributed.run``,
spawned workers, a Python subprocess, the CLI launching); a test elsewhere that starts processes is marked
``@pytest.mark.launch`` where it is defined. ``pytest -m "not launch"`` runs the unit tier alone.

After each test, in this order: the Accelerator states of HF accelerate and lightning_accel are forgotten, a default
process group the test left behind is destroyed and the test fails, and an ``os.environ`` the test changed is
restored and the test fails, naming the variables. A test whose library calls change them by design (Lightning's
``seed_everything`` sets ``PL_GLOBAL_SEED``, DeepSpeed's setup ``RANK`` and a process group) says so with
``@pytest.mark.usefixtures("undo_library_side_effects")``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_LAUNCH_FOLDER = Path(__file__).parent / "launch"
_PYTEST_OWN = "PYTEST_CURRENT_TEST"  # pytest sets it for each phase of a test


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test collected from ``tests/launch/`` with ``launch``."""
    for item in items:
        if _LAUNCH_FOLDER in item.path.parents:
            item.add_marker(pytest.mark.launch)


def _reset_accelerator_states() -> None:
    """Forget HF accelerate's and lightning_accel's shared states, where the test session imported them."""
    hf_state = sys.modules.get("accelerate.state")
    if hf_state is not None:
        hf_state.AcceleratorState._reset_state(True)
        hf_state.GradientState._reset_state()
    our_state = sys.modules.get("lightning_accel.state")
    if our_state is not None:
        our_state.reset_state()


def _destroyed_process_group() -> bool:
    """Destroy the default process group if one is left; whether there was one."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    dist.destroy_process_group()
    return True


def _restored_environment(before: dict[str, str]) -> list[str]:
    """Put ``os.environ`` back to ``before``; the names of the variables that differed."""
    names = (before.keys() | os.environ.keys()) - {_PYTEST_OWN}
    changed = sorted(name for name in names if before.get(name) != os.environ.get(name))
    for name in changed:
        if name in before:
            os.environ[name] = before[name]
        else:
            del os.environ[name]
    return changed


@pytest.fixture
def undo_library_side_effects() -> Iterator[None]:
    """Restore ``os.environ`` and destroy the default process group after a test whose library calls set them."""
    environment = dict(os.environ)
    yield
    _destroyed_process_group()
    _restored_environment(environment)


@pytest.fixture(autouse=True)
def test_hygiene(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fresh Accelerator states around the test; fail it if it leaves a process group or a changed environment."""
    environment = dict(os.environ)
    _reset_accelerator_states()
    yield
    _reset_accelerator_states()
    problems = []
    if _destroyed_process_group():
        problems.append("left the default process group initialized (destroyed now)")
    changed = _restored_environment(environment)
    if changed:
        problems.append(f"left os.environ changed: {', '.join(changed)} (restored now; use monkeypatch.setenv)")
    if problems:
        pytest.fail(f"{request.node.nodeid} " + "; ".join(problems), pytrace=False)
