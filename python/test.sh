#!/usr/bin/env bash
# The Python binding's checks and tests: rustfmt and clippy on the PyO3 crate; an abi3
# wheel built with maturin; that wheel installed into a fresh virtualenv whose PATH has no
# Rust toolchain; its stubs checked against the module with mypy's stubtest; and the
# pytest suite run against it.
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
"$scratch/venv/bin/pip" install -q "maturin>=1.7,<2" "pytest>=8" uvicorn httpx starlette fastapi mypy \
    "celery[redis]>=5.7,<6"
# The dev profile: a wheel with debug assertions on, built in about half the time of the
# release one (`pip install ./python` builds that).
"$scratch/venv/bin/maturin" build --quiet --manifest-path "$here/Cargo.toml" \
    --out "$scratch/wheels"
# The wheel needs no toolchain: installed with the PATH holding only the system's tools.
env PATH=/usr/bin:/bin "$scratch/venv/bin/pip" install -q --no-index "$scratch/wheels"/oncedb-*.whl
# From outside the source tree, so that the installed package is the one imported.
cd "$scratch"
"$scratch/venv/bin/python" -m mypy.stubtest oncedb._oncedb --allowlist "$here/stubtest-allowlist.txt"
"$scratch/venv/bin/pytest" -q -p no:cacheprovider "$here/tests"
