#!/usr/bin/env bash
# Fuzzing (issue 8, "Hostile input"; docs/fuzzing.md): builds the libFuzzer
# targets in fuzz/ (clang, ASan + UBSan) into build-fuzz/ and runs each for
# SECONDS (default 300), starting from the committed seed corpus
# fuzz/corpus/<name>/ after replaying fuzz/regressions/<name>/.  New corpus
# entries go to build-fuzz/corpus/<name>/, crashes to build-fuzz/artifacts/.
#
#   scripts/fuzz.sh [-t SECONDS] [-j JOBS] [NAME ...]   NAME: e.g. side_channel_msg
#   scripts/fuzz.sh --run BINARY SECONDS                 one target, as ctest runs it
#
# Exit status 1 when any target found a crash, leak or UB (the input is named).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

run_one() { # BINARY SECONDS [WORK_CORPUS_DIR [ARTIFACT_DIR]]
    local bin=$1 secs=$2 work=${3:-} art=${4:-}
    local name
    name=$(basename "$bin")
    name=${name#fuzz_}
    local regs=() f
    for f in "$ROOT/fuzz/regressions/$name"/*; do
        [ -f "$f" ] && regs+=("$f")
    done
    if [ ${#regs[@]} -gt 0 ]; then
        echo "fuzz: $name: replaying ${#regs[@]} regression input(s)"
        "$bin" -runs=1 "${regs[@]}" >/dev/null 2>"${TMPDIR:-/tmp}/fuzz-$name-regs.log" || {
            cat "${TMPDIR:-/tmp}/fuzz-$name-regs.log" >&2
            echo "fuzz: $name: a regression input fails again" >&2
            return 1
        }
    fi
    local tmp_work=""
    if [ -z "$work" ]; then
        tmp_work=$(mktemp -d)
        work=$tmp_work
    fi
    [ -n "$art" ] || art=$work/artifacts
    mkdir -p "$work" "$art"
    local dict=()
    [ -f "$ROOT/fuzz/dict/$name.dict" ] && dict=("-dict=$ROOT/fuzz/dict/$name.dict")
    local rc=0 log="$work/$name.log" t0=$SECONDS
    "$bin" -max_total_time="$secs" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="$art/" "${dict[@]}" "$work" "$ROOT/fuzz/corpus/$name" >"$log" 2>&1 || rc=$?
    local execs cov
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1 || true)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
    echo "fuzz: $name: ${execs:-?} execs in $((SECONDS - t0))s, coverage ${cov:-?} edges, corpus $(ls "$work" | grep -vc -e '\.log$' -e '^artifacts$' || true) units, exit $rc"
    if [ $rc -ne 0 ]; then
        grep -E 'ERROR|SUMMARY|runtime error|==[0-9]+==|Test unit written|abort' "$log" | head -30 >&2
        echo "fuzz: $name FAILED (log: $log; inputs: $art)" >&2
        [ -n "$tmp_work" ] && cp -r "$art" "${TMPDIR:-/tmp}/fuzz-$name-artifacts" 2>/dev/null &&
            echo "fuzz: crashing inputs copied to ${TMPDIR:-/tmp}/fuzz-$name-artifacts" >&2
    fi
    [ -n "$tmp_work" ] && rm -rf "$tmp_work"
    return $rc
}

if [ "${1:-}" = "--run" ]; then
    run_one "$2" "$3"
    exit $?
fi

SECS=300
JOBS=${JOBS:-2}
while getopts "t:j:" o; do
    case $o in
    t) SECS=$OPTARG ;;
    j) JOBS=$OPTARG ;;
    *) sed -n '2,12p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))

B="$ROOT/build-fuzz"
cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_C_COMPILER=clang -DDISAGG_FUZZ=ON >/dev/null
ninja -C "$B" -j "$JOBS" fuzz

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for f in "$B"/fuzz_*; do
        [ -x "$f" ] && names+=("$(basename "${f#"$B"/fuzz_}")")
    done
fi
fail=0
for n in "${names[@]}"; do
    run_one "$B/fuzz_$n" "$SECS" "$B/corpus/$n" "$B/artifacts/$n" || fail=1
done
exit $fail
