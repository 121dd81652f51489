#!/usr/bin/env bash
# The Python binding's checks and tests: rustfmt and clippy on the PyO3 crate, then the
# package built into a fresh virtualenv (maturin and pytest from PyPI) and its pytest
# suite run against it.
#
#   bash python/test.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

cargo fmt --manifest-path "$here/Cargo.toml" -- --check
cargo clippy --manifest-path "$here/Cargo.toml" -- -D warnings

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
if ! python3 -m venv "$scratch/venv" 2>/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$scratch/venv"
fi
"$scratch/venv/bin/pip" install -q "maturin>=1.7,<2" "pytest>=8" uvicorn httpx starlette fastapi
"$scratch/venv/bin/pip" install -q "$here"
# From outside the source tree, so that the installed package is the one imported.
cd "$scratch"
"$scratch/venv/bin/pytest" -q -p no:cacheprovider "$here/tests"
