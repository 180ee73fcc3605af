#!/usr/bin/env bash
# Set up, then run the demonstration: train, checkpoint asynchronously, get killed in the
# middle of a save, resume from the newest committed checkpoint, compare the loss curve.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ckptctl.demo "$@"
