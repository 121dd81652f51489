#!/usr/bin/env bash
# Short fuzzing run of every target, starting from the checked-in seeds.
#
#   fuzz/smoke.sh                  # 60 s per target
#   FUZZ_SECONDS=600 fuzz/smoke.sh # longer
#   fuzz/smoke.sh segment_decode   # one target
#
# Installs cargo-fuzz if it is missing. libFuzzer needs unstable compiler flags;
# RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them. Inputs are copied into the
# scratch corpus fuzz/corpus/<target>/ (git-ignored), so fuzz/seeds/ is never written.
# Exits non-zero if any target crashes; the reproducer is in fuzz/artifacts/<target>/.
set -uo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"
if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    targets=(segment_decode reservation_races run_decode)
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz"
    # A debug build of the driver: it only runs cargo and the fuzzer, and builds in half
    # the time.
    cargo install cargo-fuzz --locked --debug || exit 1
fi

failed=()
for target in "${targets[@]}"; do
    corpus="fuzz/corpus/$target"
    mkdir -p "$corpus"
    cp fuzz/seeds/"$target"/* "$corpus"/
    echo "== $target: ${seconds}s from $(ls "$corpus" | wc -l) inputs"
    if ! RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir fuzz "$target" "$corpus" -- \
        -max_total_time="$seconds" -timeout=20 -print_final_stats=1; then
        failed+=("$target")
    fi
done

if [ "${#failed[@]}" -gt 0 ]; then
    echo "crashed: ${failed[*]} (reproducers in fuzz/artifacts/)" >&2
    exit 1
fi
echo "no crashes"
