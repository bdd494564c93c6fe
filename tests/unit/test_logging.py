"""``lightning_accel.logging`` against HF accelerate's ``accelerate.logging``, in one process (the 2-process
comparison, with ``main_process_only``, ``in_order`` and ``warning_once`` on each rank, is in
``tests/scripts/clients_fixes.py``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from types import ModuleType

import accelerate.logging as hf_logging
import pytest
from accelerate.state import PartialState as HFPartialState

import lightning_accel.logging as our_logging
from lightning_accel.state import PartialState, reset_state

LIBRARIES = {"hf": (hf_logging, HFPartialState), "ours": (our_logging, PartialState)}


@pytest.fixture(autouse=True)
def _no_state() -> Iterator[None]:
    HFPartialState._reset_state()
    reset_state()
    yield
    HFPartialState._reset_state()
    reset_state()


def test_every_public_name_of_accelerates_adapter_is_here() -> None:
    public = [name for name in dir(hf_logging.MultiProcessAdapter) if not name.startswith("_")]
    missing = [name for name in public if not hasattr(our_logging.MultiProcessAdapter, name)]
    assert not missing
    assert "warning_once" in public and "process" in public and "log" in public
    for name in ("process", "log", "warning_once"):  # what Accelerate's adapter defines itself
        theirs = inspect.signature(getattr(hf_logging.MultiProcessAdapter, name))
        ours = inspect.signature(getattr(our_logging.MultiProcessAdapter, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    assert list(inspect.signature(our_logging.get_logger).parameters) == ["name", "log_level"]


def _records(library: ModuleType, state: type, caplog: pytest.LogCaptureFixture) -> list[tuple[object, ...]]:
    """What one library's logger records for the same calls (two adapters, so ``warning_once`` is per adapter)."""
    state()
    caplog.clear()
    name = "tests.logging_parity"
    with caplog.at_level(logging.DEBUG, logger=name):
        logger, again = library.get_logger(name, log_level="INFO"), library.get_logger(name)
        logger.info("info %s", "arg")
        logger.debug("hidden below INFO")
        logger.warning("everywhere", main_process_only=False)
        logger.log(logging.ERROR, "in order", in_order=True)
        for _ in range(2):
            logger.warning_once("only once")
            again.warning_once("only once")
        logger.warning_once("another", main_process_only=False)
        logger.error("with extra", extra={"k": 1})
        try:
            raise KeyError("boom")
        except KeyError:
            logger.exception("caught")
        logger.critical("critical")
    return [
        (r.levelname, r.getMessage(), r.funcName, r.lineno, r.filename, r.exc_info is not None, getattr(r, "k", None))
        for r in caplog.records
    ]


def _lines_calling(text: str) -> set[int]:
    source, first = inspect.getsourcelines(_records)
    return {first + i for i, line in enumerate(source) if text in line}


def test_the_same_calls_record_the_same_as_accelerate(caplog: pytest.LogCaptureFixture) -> None:
    hf = _records(*LIBRARIES["hf"], caplog)
    ours = _records(*LIBRARIES["ours"], caplog)
    assert len(ours) == len(hf)
    for mine, theirs in zip(ours, hf, strict=True):
        if theirs[2] == "warning_once":  # Accelerate's record names its own method; ours the caller
            assert mine[2] == "_records" and mine[3] in _lines_calling("warning_once(") and mine[4] == "test_logging.py"
            mine, theirs = mine[:2] + mine[5:], theirs[:2] + theirs[5:]
        assert mine == theirs
    messages = [record[1] for record in ours]
    assert messages.count("[RANK 0] only once") == 2  # once per adapter
    assert "[RANK 0] info arg" in messages and not any("hidden" in m for m in messages)
    assert {record[2] for record in ours} == {"_records"}  # the caller, not the adapter


def test_logging_before_any_state_logs_for_this_process(caplog: pytest.LogCaptureFixture) -> None:
    """Accelerate refuses it; ours logs as process 0 of 1 (torch.distributed's ranks where a group exists)."""
    with pytest.raises(RuntimeError, match="PartialState"):
        hf_logging.get_logger("tests.no_state").info("too early")
    with caplog.at_level(logging.INFO, logger="tests.no_state"):
        our_logging.get_logger("tests.no_state").info("before any state", in_order=True)
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] before any state"]
    assert not PartialState._shared_state  # logging did not create one (it would join a launch)


@pytest.mark.parametrize("side", ["hf", "ours"])
def test_warning_once_needs_hashable_arguments(side: str) -> None:
    library, state = LIBRARIES[side]
    state()
    with pytest.raises(TypeError, match="unhashable"):
        library.get_logger("tests.unhashable").warning_once(["a list"])
