#!/bin/sh
# make check: every suite, each one's whole output in build/check/<step>.log;
# on the terminal one line a step and one summary line at the end (the
# suites print ~8,000 lines, mostly libFuzzer's, and some deliberately
# broken devices log errors that would alarm a reader of a passing run).
# A failed step prints its log's last lines. Usage: tools/check.sh MAKE
make=${1:-make}
logs=build/check
mkdir -p "$logs"
rm -f "$logs"/*.log

# The fuzzers need clang's libFuzzer runtime: say so now, not after the
# rest has run (Debian: clang libclang-rt-14-dev).
if ! printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n)'\
' { return 0; }' | ${FUZZ_CC:-clang} -fsanitize=fuzzer -x c - \
    -o "$logs/probe" >/dev/null 2>&1; then
  echo "check: clang's libFuzzer runtime is missing (make fuzz needs it):" \
       "apt-get install clang libclang-rt-14-dev"
  exit 1
fi
rm -f "$logs/probe"

passed=0 failed=0 skipped=0 bad_steps=""

# The sum of a log's "N passed, N failed[, N skipped]" lines.
count() {
  awk '/^[0-9]+ passed, [0-9]+ failed/ {
         p += $1; f += $3; if ($5 ~ /^[0-9]+$/) s += $5 }
       /^[0-9]+ skipped$/ { s += $1 }
       END { printf "%d %d %d\n", p, f, s }' "$1"
}

step() {
  name=$1
  shift
  log="$logs/$name.log"
  start=$(date +%s)
  "$@" >"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  set -- $(count "$log")
  passed=$((passed + $1)) failed=$((failed + $2)) skipped=$((skipped + $3))
  case $name in
    fuzz) what=$(grep -c '^Done [0-9]* runs' "$log")" harnesses ran clean" ;;
    *) what="$1 passed, $2 failed, $3 skipped" ;;
  esac
  if [ $rc -eq 0 ]; then
    printf 'check: %-14s ok    %s (%s s)\n' "$name" "$what" "$secs"
  else
    printf 'check: %-14s FAIL  %s (%s s); %s ends:\n' "$name" "$what" \
           "$secs" "$log"
    tail -n 30 "$log" | sed 's/^/    /'
    bad_steps="$bad_steps $name"
  fi
}

step abi "$make" check-abi
step hip "$make" check-hip
step cuda-fake "$make" check-cuda-fake
step test "$make" test
step layers "$make" check-layers
step python "$make" check-python
step notorch "$make" check-notorch
step install "$make" check-install
step asan "$make" test SAN=address,undefined OPT=-O1 DEBUG=1
step tsan "$make" test SAN=thread OPT=-O1
step windows "$make" check-windows
step fuzz "$make" fuzz

echo "check: $passed passed, $failed failed, $skipped skipped" \
     "(logs in $logs/)"
if [ -n "$bad_steps" ]; then
  echo "check: FAILED:$bad_steps"
  exit 1
fi
