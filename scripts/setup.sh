#!/usr/bin/env bash
# Create .venv and install ckptctl with its test dependencies. Idempotent; used by demo.sh,
# test.sh and CI. torch is pinned (the CPU build on this machine's disk) by the test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check 'torch==2.13.0'
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# An editable install places no data files, so `man ckptctl` would find nothing: link the manual
# pages into the venv, where man looks when .venv/bin is on PATH (tests/test_install.py).
for page in man/*.[0-9]; do
  section=${page##*.}
  mkdir -p ".venv/share/man/man$section"
  ln -sfn "$PWD/$page" ".venv/share/man/man$section/"
done
find .venv/share/man -xtype l -delete  # pages renamed or removed since the last setup
# A layout plugin as a separate distribution registers one (tests/test_layout_conformance.py).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e tests/plugins/ckptctl-toy-layout
# Other tools' checkpoints are tested as those tools write them (tests/test_frameworks.py skips,
# naming the package, without them). torch==2.13.0 is pinned in the extra so pip never replaces it.
.venv/bin/python -m pip install -q --disable-pip-version-check 'torch==2.13.0' -e '.[frameworks]'
# groff lints the manual pages (tests/test_manpages.py skips without it); install it where we may.
if ! command -v groff >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq groff-base >/dev/null) ||
    echo "setup.sh: could not install groff-base; the man page lint will be skipped" >&2
fi
