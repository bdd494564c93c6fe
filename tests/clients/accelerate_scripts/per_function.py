"""Run one of Accelerate's test scripts unmodified, recording the outcome of each test function it calls.

Usage (one process per rank, e.g. under ``python -m torch.distributed.run``)::

    python per_function.py SCRIPT.py OUT_DIR [script arguments...]

The script is imported as a module named after its file (so pickling its functions works), every function it defines
is wrapped, and then its ``if __name__ == "__main__":`` block runs in the module's namespace, in the script's own order.
A wrapped function called from that block (not from another wrapped function) is one *test function*: its outcome
(passed / failed / skipped, with the last line of the error) goes to ``OUT_DIR/rank<RANK>.jsonl`` as soon as it ends,
and a failure does not stop the block, so later functions still run. The id is the function's name, with its
arguments when they are plain values (``training_check(use_seedable_sampler=True)``) and ``#2``, ``#3`` ... when an
id repeats. The block itself is recorded as ``<main>``.

The default process-group timeout is cut to ``CLIENT_PG_TIMEOUT`` seconds (90 by default): when one rank fails before
a collective that the other rank is waiting in, the waiting rank fails after that timeout instead of 30 minutes.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

_START_PID = os.getpid()
_NOT_TESTS = {"main", "_mp_fn"}


class Recorder:
    """Writes one JSON line per outermost wrapped call of this process."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"rank{os.environ.get('RANK', '0')}.jsonl"
        self.path.unlink(missing_ok=True)
        self.depth = 0
        self.active = False
        self.seen: Counter[str] = Counter()

    def unique(self, base: str) -> str:
        self.seen[base] += 1
        return base if self.seen[base] == 1 else f"{base}#{self.seen[base]}"

    def write(self, test_id: str, outcome: str, error: str, seconds: float) -> None:
        line = {"id": test_id, "outcome": outcome, "error": error, "seconds": round(seconds, 3)}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def _plain(value: Any) -> str | None:
    """A short, side-independent text for a plain argument value; None for anything else."""
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, dict) and all(_plain(v) is not None for v in value.values()):
        return "{" + ",".join(f"{k}={_plain(v)}" for k, v in value.items()) + "}"
    return None


def _call_id(func: FunctionType, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return func.__name__
    shown = [f"{name}={_plain(value)}" for name, value in bound.arguments.items() if _plain(value) is not None]
    return f"{func.__name__}({', '.join(shown)})" if shown else func.__name__


def _last_line(error: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
    return f"{type(error).__name__}: {text[-1][:300]}" if text else type(error).__name__


def _outcome(error: BaseException) -> str:
    names = {cls.__name__ for cls in type(error).__mro__}
    return "skipped" if names & {"SkipTest", "Skipped"} else "failed"


def _wrap(func: FunctionType, recorder: Recorder) -> Any:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outermost = recorder.active and recorder.depth == 0 and os.getpid() == _START_PID
        if not outermost:
            recorder.depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                recorder.depth -= 1
        test_id = recorder.unique(_call_id(func, args, kwargs))
        start = time.monotonic()
        recorder.depth += 1
        try:
            result = func(*args, **kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as error:
            traceback.print_exc()
            recorder.write(test_id, _outcome(error), _last_line(error), time.monotonic() - start)
            return None
        finally:
            recorder.depth -= 1
        recorder.write(test_id, "passed", "", time.monotonic() - start)
        return result

    return wrapper


def _main_block(source: str, filename: str) -> ast.Module:
    """The body of the script's ``if __name__ == "__main__":`` statement, as a module of its own."""
    for node in ast.parse(source, filename).body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__":
            return ast.Module(body=node.body, type_ignores=[])
    raise SystemExit(f"{filename} has no `if __name__ == '__main__':` block")


def _short_timeout() -> None:
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(seconds=float(os.environ.get("CLIENT_PG_TIMEOUT", "90")))


def _load(script: Path) -> ModuleType:
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(script.stem, script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[script.stem] = module
    spec.loader.exec_module(module)
    return module


def run(script: Path, out: Path, argv: list[str]) -> int:
    """Import ``script``, wrap its functions, run its main block; 0 when the block itself got to its end."""
    _short_timeout()
    # Under the alias, finding ``accelerate`` imports lightning_accel (and through Lightning, torchmetrics, which
    # imports transformers): a script that imports transformers first would find it half initialised. A user who
    # changed the imports never meets this, so import ``accelerate`` first on both sides.
    import accelerate  # noqa: F401

    recorder = Recorder(out)
    sys.argv = [str(script), *argv]
    module = _load(script)
    for name, value in list(vars(module).items()):
        if isinstance(value, FunctionType) and value.__module__ == module.__name__ and name not in _NOT_TESTS:
            setattr(module, name, _wrap(value, recorder))
    block = compile(_main_block(script.read_text(), str(script)), str(script), "exec")
    recorder.active = True
    start = time.monotonic()
    try:
        exec(block, vars(module))
    except BaseException as error:
        traceback.print_exc()
        recorder.write("<main>", _outcome(error), _last_line(error), time.monotonic() - start)
        return 1
    recorder.write("<main>", "passed", "", time.monotonic() - start)
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), sys.argv[3:]))
