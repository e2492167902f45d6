#!/usr/bin/env bash
# The downstream install that docs/install.md documents, as a user's CI would run it:
# build a wheel from this clone, install it with the testing extra into a fresh virtual
# environment outside the clone, and run a downstream test file (.ci/downstream_test.py:
# teleopt.testing's pytest plugin and strategies) from a temporary directory.
#
# --system-site-packages lets the environment reuse the torch, hypothesis and pytest that
# are already installed instead of downloading them again; the test asserts that teleopt
# itself is imported from the installed wheel, not from the clone.
set -euo pipefail
cd "$(dirname "$0")/.."
clone=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --no-build-isolation: the installed setuptools builds it (pyproject.toml needs setuptools>=64), nothing downloaded
python -m pip wheel --no-deps --no-build-isolation --quiet -w "$work/dist" .
wheel=$(ls "$work"/dist/teleopt-*.whl)
python -m venv --system-site-packages --without-pip "$work/venv"  # the system's pip installs into it
"$work/venv/bin/python" -m pip install --quiet "${wheel}[testing]"
mkdir "$work/project"
cp .ci/downstream_test.py "$work/project/test_downstream.py"
cd "$work/project"
TELEOPT_CLONE=$clone "$work/venv/bin/python" -m pytest -q -p no:cacheprovider test_downstream.py
echo "== downstream install and test: $SECONDS s"
