"""What every test gets: fresh shared state, the ``launch`` tier, and checks that nothing leaks into the next test.

Tiers: every test under ``tests/launch/`` carries the ``launch`` marker (it starts processes: ``torch.distributed.run``,
spawned workers, a Python subprocess, the CLI launching); a test elsewhere that starts processes is marked
``@pytest.mark.launch`` where it is defined. ``pytest -m "not launch"`` runs the unit tier alone, on 2 pytest-xdist
workers (whole files per worker) unless ``-n`` is given (``-n 0``: in this process).

After each test, in this order: the Accelerator states of HF accelerate and lightning_accel are forgotten, a default
process group the test started and left behind is destroyed and the test fails, and an ``os.environ`` the test changed
is restored and the test fails, naming the variables. A test whose library calls change them by design (Lightning's
``seed_everything`` sets ``PL_GLOBAL_SEED``, DeepSpeed's setup ``RANK``) says so with
``@pytest.mark.usefixtures("undo_library_side_effects")``; one that starts DeepSpeed, whose group lives as long as the
process, with ``process_wide_group``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ("pytester",)  # tests/unit/test_conftest.py runs this file's checks on small test files

_LAUNCH_FOLDER = Path(__file__).parent / "launch"
_UNIT_TIER = ("not launch",)
_PYTEST_OWN = "PYTEST_CURRENT_TEST"  # pytest sets it for each phase of a test
# Set once per process by whichever test first reaches the library, and meant to stay: importing lightning.fabric
# (or deepspeed), torch inductor's first cache lookup, PJRT's runtime start (the XLA stage).
_SET_ONCE_PER_PROCESS = frozenset(
    {
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "TORCHINDUCTOR_CACHE_DIR",
        "GRPC_VERBOSITY",
        "PJRT_DYNAMIC_PLUGINS",
        "TF_CPP_MIN_LOG_LEVEL",
        "XLA_FLAGS",
    }
)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Run ``-m "not launch"`` on 2 xdist workers, a file to a worker, if pytest-xdist is there and ``-n`` is not."""
    if os.environ.get("PYTEST_XDIST_WORKER") or hasattr(config, "workerinput"):
        return  # a worker must not start workers of its own (that recursion was a fork bomb)
    if config.option.markexpr.replace("'", '"') not in _UNIT_TIER or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.option.numprocesses is None and not config.option.collectonly:
        config.option.numprocesses = 2
        config.option.dist = "loadfile"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test collected from ``tests/launch/`` with ``launch``; run ``process_wide_group`` tests last.

    The group such a test keeps would meet every later test in the process (a forked launcher inherits it, a second
    ``init_process_group`` is refused), so they go to the end, in their order.
    """
    for item in items:
        if _LAUNCH_FOLDER in item.path.parents:
            item.add_marker(pytest.mark.launch)
    items.sort(key=lambda item: "process_wide_group" in getattr(item, "fixturenames", ()))


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
    if not _process_group_initialized():
        return False
    sys.modules["torch.distributed"].destroy_process_group()
    return True


def _restored_environment(before: dict[str, str]) -> list[str]:
    """Put ``os.environ`` back to ``before``, set-once variables aside; the names of the variables that differed."""
    names = (before.keys() | os.environ.keys()) - {_PYTEST_OWN} - _SET_ONCE_PER_PROCESS
    changed = sorted(name for name in names if before.get(name) != os.environ.get(name))
    for name in changed:
        if name in before:
            os.environ[name] = before[name]
        else:
            del os.environ[name]
    return changed


@pytest.fixture
def undo_library_side_effects() -> Iterator[None]:
    """Restore ``os.environ`` after a test whose library calls set variables by design (``seed_everything``, ...)."""
    environment = dict(os.environ)
    yield
    _restored_environment(environment)


@pytest.fixture
def process_wide_group() -> None:
    """The test starts DeepSpeed, whose communication state keeps the default process group for the process's life.

    The group is not destroyed after the test: DeepSpeed's cached groups would point at a destroyed one in the next.
    """


def _process_group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


@pytest.fixture(autouse=True)
def test_hygiene(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fresh Accelerator states around the test; fail it if it leaves a process group or a changed environment."""
    environment = dict(os.environ)
    group_before = _process_group_initialized()
    _reset_accelerator_states()
    yield
    _reset_accelerator_states()
    problems = []
    keeps_group = "process_wide_group" in request.fixturenames
    if not group_before and not keeps_group and _destroyed_process_group():
        problems.append("left the default process group initialized (destroyed now)")
    changed = _restored_environment(environment)
    if changed:
        problems.append(f"left os.environ changed: {', '.join(changed)} (restored now; use monkeypatch.setenv)")
    if problems:
        pytest.fail(f"{request.node.nodeid} " + "; ".join(problems), pytrace=False)
