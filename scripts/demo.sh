#!/usr/bin/env bash
# Set up, then run the demonstration: train, checkpoint asynchronously, get killed in the
# middle of a save, resume from the newest committed checkpoint, compare every step's loss with
# an uninterrupted run, bit for bit. Options go to the demo (--help); the last line it prints is
# the verdict, and its exit status is 0 when the curves are identical.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ckptctl.demo "$@"
