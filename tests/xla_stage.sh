#!/usr/bin/env bash
# The XLA stage: a second virtual environment pinned to torch 2.9.0 + torch-xla 2.9.0 (PJRT's CPU runtime), then
# tests/unit/strategies/test_xla.py on one PJRT CPU device against plain PyTorch. Usage: bash tests/xla_stage.sh (from anywhere).
# .ci/run runs it after the main suite. The first run downloads about 3 GB (PyPI's torch 2.9.0 wheel brings the CUDA
# libraries) and took 4 to 9 minutes on a 2-core machine (227 s idle, 550 s while other jobs loaded it); later runs
# reuse .venv-xla and take about a minute. With --install-only it installs .venv-xla's packages (not the project) and stops: .ci/run starts that in
# the background beside the main suite (the download is network-bound), then runs the tests after it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${XLA_VENV:-.venv-xla}
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import torch_xla" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.9.0" "torch-xla==2.9.0" "lightning>=2.5,<2.7" pytest
fi
[[ "${1:-}" == "--install-only" ]] && exit 0
# The project itself only now: an editable install rewrites lightning_accel.egg-info, which the main suite reads.
"$VENV/bin/pip" install -q -e .
PJRT_DEVICE=CPU timeout 600 "$VENV/bin/python" -m pytest -p no:cacheprovider tests/unit/strategies/test_xla.py -q
