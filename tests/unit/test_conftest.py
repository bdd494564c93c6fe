"""tests/conftest.py's checks, run by pytester on small test files next to a copy of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed  # noqa: F401  # imported once here: pytester's in-process runs drop modules first imported in them

import lightning_accel.state  # noqa: F401

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    launch: starts processes\n")
    return pytester


def test_a_leaked_variable_fails_the_test_by_name_and_is_restored(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_leak="""
        import os

        def test_leaks():
            os.environ["LA_CONFTEST_LEAK"] = "1"

        def test_after():
            assert "LA_CONFTEST_LEAK" not in os.environ

        def test_monkeypatched(monkeypatch):
            monkeypatch.setenv("LA_CONFTEST_OK", "1")
        """
    )
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-n", "0")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*test_leaks left os.environ changed: LA_CONFTEST_LEAK (restored now*"])


def test_library_side_effects_can_be_undone_on_request(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_undo="""
        import os
        import pytest

        @pytest.mark.usefixtures("undo_library_side_effects")
        def test_seeds():
            os.environ["LA_CONFTEST_SEED"] = "0"
        """
    )
    suite.runpytest_inprocess("-p", "no:cacheprovider", "-n", "0").assert_outcomes(passed=1)


def test_a_process_group_left_behind_fails_the_test_and_is_destroyed(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_group="""
        import torch.distributed as dist

        def test_starts_a_group(tmp_path):
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)

        def test_after():
            assert not dist.is_initialized()
        """
    )
    # In a fresh process: in this one, an earlier DeepSpeed test may keep its process-wide group.
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-n", "0")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_starts_a_group left the default process group initialized (destroyed now)*"])


def test_accelerator_states_are_fresh_in_each_test(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_state="""
        from lightning_accel import Accelerator
        from lightning_accel.state import PartialState

        def test_builds_one():
            Accelerator(cpu=True, gradient_accumulation_steps=3)

        def test_sees_none():
            assert not PartialState._shared_state
        """
    )
    suite.runpytest_inprocess("-p", "no:cacheprovider", "-n", "0").assert_outcomes(passed=2)


def test_tests_under_launch_get_the_marker(suite: pytest.Pytester) -> None:
    suite.mkdir("launch")
    suite.makepyfile(
        **{"launch/test_started": "def test_starts():\n    pass\n", "test_here": "def test_unit():\n    pass\n"}
    )
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-n", "0", "-m", "not launch")
    result.assert_outcomes(passed=1, deselected=1)
