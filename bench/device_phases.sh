#!/bin/bash
# bench/device_phases.sh PHASE[+PHASE...] [SECONDS]
#
# The GPU runs behind bench/RESULTS.md, grouped so that one device call
# (at most SECONDS, default 540) runs one or more phases and leaves their
# logs in $OUT/<phases>.tgz (OUT defaults to ./device-out). Each step has
# its own time limit; what did not fit is said, not run. Needs a CUDA GPU,
# and for the ComfyUI phases the test clients in build-clients/
# (bench/clients/README.md). A phase's step limits can be lowered with
# CAP_<phase>=SECONDS (the phase's long step); BEFORE=<dir> names another
# tree (a `git archive <rev>` export) for the phases that compare trees.
#
#   suites  the GPU suites: test_compat, the C runner, test_torch,
#           test_threads, test_plan_thread, test_replan, test_kept_fills,
#           test_lend, test_comfyui_gguf, test_binding (issue 30)
#   lora    bench_node --lora --runs legacy,node6,6 (issues 28, 29)
#   switch  bench_node --switch 19x38 --runs resident,node12,12 (issue 29)
#   flux22  bench_node --double 19 --single 38 --runs resident,node8,8
#   sdxl    bench_node --model sdxl --steps 4 --runs resident,node3cache,
#           node3nowarm,node3cached,3 (a first run, its first plan taken
#           at a later step, run again); SDXL_RUNS=... runs others
#   fp8     bench_headroom (NO_HEADROOM=1: not), then bench_node --fp8
#           --shape flux --dtypes fp8_e5m2 --fp8-lora on (issues 26, 29;
#           FP8_DTYPES=a,b: those dtypes), the node's limit as it moved;
#           FP8_NOKEEP=1 runs it again with VPAGER_KEEP_FILLS=0 (kept
#           fills' A/B)
#   fp8_rings  the fp8 phase's run (FP8_DTYPES, default fp8_e5m2, with the
#           LoRA) twice, its ring fixed: VPAGER_STAGING=224M, then 512M
#           (RINGS=...: others). fp8 at half its bytes plans compute-bound
#           and picks the smallest ring within RING_TIE: 224 MiB ran
#           10-19% over its prediction in one H100 call, 512 MiB 3% in
#           the next (issue 26)
#   quant   bench_node --quant scaled_fp8 --shape small --fp8-lora on, then
#           bench_gguf --qtypes Q4_K --gguf-lora both --shape small
#           (QUANT_SHAPE=flux: both on the Flux shape; GGUF_QTYPES=...:
#           other qtypes: Q8_0's half leaves room beside torch's peak
#           at 1024², Q4_K's does not; GGUF_LORA=on or off: one of the
#           two cells; GGUF_RUNS=resident,nodehalf: bench_gguf's --runs;
#           QUANT_RUNS=gguf or sfp8: one of the two) (issue 26 points 3-4)
#   before  BEFORE's tree against this one in one lease: bench_torch
#           --only 4,5,6 and the node's Flux run (issue 27)
#   node_ab BEFORE's tree against this one, the node's Flux run only
#           (--runs node6 --reps 3), alternating, AB_PAIRS times (default
#           2) each (issue 27)
#   lora_ab BEFORE's tree against this one: the LoRA workflow's node run
#           (this tree's with VPAGER_BENCH_GOVERNOR: its limit's changes)
#   prompts the node's Flux at 6 GiB beside resident and ComfyUI's path,
#           10 prompts (--reps 10): prompts 2..10's steady steps, how far
#           apart (issue 29's stable prompts, 2%); PROMPTS_RUNS=...,
#           PROMPTS_REPS=N: other runs, another number of prompts; each
#           run's plans logged (VPAGER_SCHEDULE_LOG: a slow one replayed)
#   copy_probe  bench/copy_queue_probe.py --sm-fill --vpager 0,8,16,32:
#           the client's pageable copy behind a fill queued at once, cut,
#           paced by a second thread, read by SMs (all, or a few Triton
#           programs), a matmul loop beside the few-program fills, and
#           the library's own fill by its copy engine and by SMs
#           (vp_prefetch_sm, its bytes checked) (issue 29's pause)
#   flux_diag  the node's Flux at 6 GiB beside resident, 10 steps, with
#           VPAGER_BENCH_STEP_STATS (each step's ring and stream waits)
#           and VPAGER_BENCH_TIMELINE=5 (step 5 module by module, leads),
#           VPAGER_BENCH_KINETO=7 (step 7's copies and kernels as the GPU
#           ran them: the link slow or idle, bench/copy_trace.py),
#           VPAGER_BENCH_START_PROFILE=1 (the host's work from step 5's
#           start to its first call, under cProfile: COMFYUI_PROFILE),
#           compared by bench/step_timeline.py: where the steps run over
#           the plan's prediction (issue 29's 1.05 x L); DIAG_RUNS=...:
#           other runs (the timeline compares run_resident and the last)
#   forward_start  bench_forward_start.py: a root forward's host time
#           before its first unit, resident against paged, and the
#           driver's memory queries with vpager's pages mapped (no
#           ComfyUI)
#   unit_host  bench/unit_host.py: one unit's host time on the per-unit
#           path (resident, streamed) and held, against torch's own call,
#           and where it goes (enter, acquire, leave, release) (no ComfyUI;
#           issue 29: the node's Flux step is the host's)
#   flux_rings the node's Flux at 6 GiB beside resident, as it picks its
#           ring and with the ring fixed (bench_node's ring<MiB> runs;
#           FLUX_RINGS="288 320 378 512" by default), 4 prompts each: which
#           ring runs best on one machine against what each plan predicts
#           (issue 29's 1.05 x L)
#   flux22_ab  BEFORE's node run of the 22 GiB model at 8 GiB, then this
#           tree's with resident and ComfyUI's path (--reps 4): issue 28's
#           RSS rows and the step against the tree before it
#   switch_ab  BEFORE's node run of the 22 GiB model at 12 GiB (its bench
#           has no --switch: the switch's second model alone), then this
#           tree's --switch 19x38 run with resident and ComfyUI's path
#   cgroup  bench_node --double 19 --single 38 --switch 8x16 --cgroup-gib 32
#           --runs resident,node8,8: the 22 GiB model then a 9.4 GiB one
#           in a 32 GiB memory cgroup, the resident reference outside it
#           (issue 28 point 4)
#   decode  bench_torch --only 6 at 1/2 four ways: as it is, the plans on
#           the forward's thread (VPAGER_PLAN_THREAD=0), no placement
#           before the first forward (VPAGER_PLACE_EARLY=0), a placement
#           in steps (VPAGER_PLACE_STEPS=1) (issue 27's decode)
#   first   bench_node --runs resident,node6cache,node6nowarm,node6cached,
#           6,node4,node4nowarm,node4cached --reps 2: a model's first
#           prompt as its first run (node6cache, which writes its plan;
#           the cold forward planned at its own end, VPAGER_COLD_WORK),
#           with the first plan taken at a later step (nowarm), and run
#           again (the cached runs plan from the remembered work:
#           VPAGER_PLAN_CACHE, the key without the budget) (issue 29);
#           RUNS=... runs others ("node6nowarm.2": node6nowarm again)
#
# Example (the device tool, carrying build-clients):
#   bash bench/device_phases.sh suites+lora 560
PHASES=${1:?"usage: bench/device_phases.sh PHASE[+PHASE...] [SECONDS]"}
LIMIT=${2:-540}
START=$(date +%s)
cd "$(dirname "$0")/.." || exit 1
R=$PWD
C=$R/build-clients
OUT=${OUT:-$R/device-out}
L=$OUT/$PHASES
KNOWN="suites lora switch flux22 sdxl fp8 quant before lora_ab decode"
KNOWN="$KNOWN cgroup first node_ab flux22_ab switch_ab flux_diag prompts"
KNOWN="$KNOWN fp8_rings flux_rings forward_start copy_probe unit_host"
for PH in ${PHASES//+/ }; do
  case " $KNOWN " in
    *" $PH "*) ;;
    *) echo "device_phases.sh: unknown phase '$PH' (phases: $KNOWN)" >&2
       exit 2 ;;
  esac
  case $PH in before|lora_ab|node_ab|flux22_ab|switch_ab)
    [ -d "${BEFORE:-}" ] || {
      echo "device_phases.sh: phase '$PH' needs BEFORE=<another tree's" \
           "folder>; BEFORE='${BEFORE:-}' is none" >&2
      exit 2; } ;;
  esac
done
mkdir -p "$L"
export PYTHONUNBUFFERED=1

left() { echo $(( LIMIT - ($(date +%s) - START) )); }
# The phase's long step: CAP_<phase> seconds, else what is left.
cap() { local v=CAP_$PH; echo "${!v:-$(left)}"; }
# step NAME SECONDS CMD...: CMD's output in $L/NAME.log, the lines that
# match $GREP (its last $TAILN) printed.
step() {
  local n=$1 t=$2 l s rc
  shift 2
  l=$(left)
  if [ "$l" -lt 20 ]; then echo "== $n: not run (no time left)"; return; fi
  [ "$t" -gt "$l" ] && t=$l
  s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$L/$n.log" 2>&1
  rc=$?
  echo "== $n rc=$rc $(( $(date +%s) - s ))s"
  grep -E "$GREP" "$L/$n.log" | tail -"${TAILN:-40}"
}
# The node's bench in tree $1 (it lived in integrations/comfyui before
# issue 27 moved it to bench/).
node_bench() {
  if [ -f "$1/bench/bench_node.py" ]; then echo "$1/bench/bench_node.py"
  else echo "$1/integrations/comfyui/bench_node.py"; fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader 2>/dev/null
# (The device's copy may carry a stale .git: the sources' sha1 names them.)
echo "tree: $(python3 -c 'import sys; sys.path.insert(0, "bench")
import benchlib; print(benchlib.source_rev())' 2>/dev/null ||
  git rev-parse --short HEAD 2>/dev/null || echo "not a git checkout")"
make -j16 build/libvpager.so > "$L/build.log" 2>&1 ||
  { tail -30 "$L/build.log"; exit 1; }
export VPAGER_LIBRARY=$R/build/libvpager.so
if [ -n "${BEFORE:-}" ]; then
  B=$(cd "$BEFORE" && pwd)
  (cd "$B" && make -j16 build/libvpager.so > "$L/build-before.log" 2>&1) ||
    tail -20 "$L/build-before.log"
fi
PP="env PYTHONPATH=python:integrations:python/compat"
N="python3 bench/bench_node.py --comfyui $C/ComfyUI"

for PH in ${PHASES//+/ }; do
  case $PH in
  copy_probe)
    GREP='.'
    TAILN=40 step copy_probe 150 $PP python3 bench/copy_queue_probe.py \
      --sm-fill --vpager 0,8,16,32 ;;
  unit_host)
    GREP='.'
    TAILN=14 step unit_host 120 $PP python3 bench/unit_host.py ;;
  forward_start)
    GREP='.'
    TAILN=8 step forward_start 120 python3 bench/bench_forward_start.py ;;
  suites)
    GREP='passed|failed|FAIL|Error|error:|Traceback'
    make -j16 build/tests/runner > "$L/build-runner.log" 2>&1 ||
      tail -20 "$L/build-runner.log"
    TAILN=12 step test_compat 150 $PP python3 tests/python/test_compat.py
    TAILN=8 step runner 150 build/tests/runner
    for t in test_torch test_threads test_plan_thread test_replan \
             test_kept_fills test_lend test_comfyui_gguf test_binding; do
      TAILN=12 step $t 120 $PP python3 tests/python/$t.py
    done ;;
  lora)
    GREP='steady|first prompt|x L|latents|RSS|budget|LoRA|Error|Traceback'
    TAILN=80 VPAGER_SCHEDULE_LOG=1 step lora "$(cap)" \
      $N --lora --runs legacy,node6,6 --out "$L/lora" ;;
  switch)
    GREP='steady|first prompt|x L|latents|RSS|budget|switch|Error|Traceback'
    TAILN=80 VPAGER_SCHEDULE_LOG=1 step switch "$(cap)" \
      $N --switch 19x38 --runs resident,node12,12 --out "$L/switch" ;;
  flux22)
    GREP='steady|first prompt|x L|latents|RSS|budget|Error|Traceback'
    TAILN=80 VPAGER_SCHEDULE_LOG=1 step flux22 "$(cap)" \
      $N --double 19 --single 38 --runs resident,node8,8 --reps 2 \
      --out "$L/flux22" ;;
  first)
    GREP='steady|first prompt|x L|latents|budget|copied on the device|remembered|Error|Traceback'
    TAILN=80 VPAGER_SCHEDULE_LOG=1 step first "$(cap)" \
      $N --runs "${RUNS:-resident,node6cache,node6nowarm,node6cached,6,node4,node4nowarm,node4cached}" \
      --reps 2 --out "$L/first" ;;
  sdxl)
    GREP='steady|first prompt|x L|latents|RSS|budget|Error|Traceback'
    TAILN=60 VPAGER_SCHEDULE_LOG=1 step sdxl "$(cap)" \
      $N --model sdxl --steps 4 \
      --runs "${SDXL_RUNS:-resident,node3cache,node3nowarm,node3cached,3}" \
      --out "$L/sdxl" ;;
  fp8)
    GREP='steady|x L|latents|RSS|budget|LoRA|headroom|free|Error|Traceback'
    [ -z "$NO_HEADROOM" ] && TAILN=40 step headroom 120 $PP python3 bench/bench_headroom.py
    TAILN=60 VPAGER_BENCH_GOVERNOR=1 step fp8 "$(cap)" $N --fp8 \
      --shape flux --dtypes "${FP8_DTYPES:-fp8_e5m2}" --fp8-lora on \
      --out "$L/fp8"
    # The node's limit as torch's peak moved (the fills' patch math)
    GREP='governor: limit'
    TAILN=30 step fp8_limit 10 sh -c "cat $L/fp8/*/run_nodehalf.log"
    # The same without kept fills (each streamed patch computed at fill).
    if [ -n "$FP8_NOKEEP" ]; then
      TAILN=60 VPAGER_KEEP_FILLS=0 step fp8nokeep "$(cap)" $N --fp8 \
        --shape flux --dtypes fp8_e5m2 --fp8-lora on --out "$L/fp8nokeep"
    fi ;;
  fp8_rings)
    GREP='steady|x L|latents|budget|Error|Traceback'
    set -- ${RINGS:-224M 512M}
    for RING; do    # each its share of the time left
      TAILN=12 VPAGER_SCHEDULE_LOG=1 VPAGER_STAGING=$RING step fp8_$RING \
        "$(( $(cap) / $# ))" $N --fp8 --shape flux --dtypes "${FP8_DTYPES:-fp8_e5m2}" \
        --fp8-lora on --out "$L/fp8_$RING"
      shift
    done ;;
  quant)
    GREP='steady|x L|latents|RSS|budget|LoRA|Q4_K|equal|Error|Traceback'
    case " ${QUANT_RUNS:-sfp8 gguf} " in *" sfp8 "*)
      TAILN=60 step sfp8 300 $N --quant scaled_fp8 --shape "${QUANT_SHAPE:-small}" \
        --fp8-lora on --out "$L/sfp8" ;; esac
    case " ${QUANT_RUNS:-sfp8 gguf} " in *" gguf "*)
      TAILN=60 step gguf "$(cap)" python3 bench/bench_gguf.py \
        --comfyui "$C/ComfyUI" --qtypes "${GGUF_QTYPES:-Q4_K}" \
        --gguf-lora "${GGUF_LORA:-both}" --shape "${QUANT_SHAPE:-small}" --timeout 400 \
        ${GGUF_RUNS:+--runs "$GGUF_RUNS"} ;; esac ;;
  before)
    GREP='ms|x L|settled|Error|Traceback|MET|MISSED'
    TAILN=30 step torch_after 170 python3 bench/bench_torch.py \
      --only 4,5,6 --budgets 0.5 --iters 3
    TAILN=30 step torch_before 170 env VPAGER_LIBRARY="$B/build/libvpager.so" \
      PYTHONPATH="$B/python" python3 "$B/bench/bench_torch.py" \
      --only 4,5,6 --budgets 0.5 --iters 3
    GREP='steady|x L|latents|Error|Traceback'
    TAILN=30 step node_before 150 env VPAGER_LIBRARY="$B/build/libvpager.so" \
      python3 "$(node_bench "$B")" --comfyui "$C/ComfyUI" --runs node6 \
      --reps 2 --out "$L/node_before"
    TAILN=30 step node_after "$(cap)" $N --runs resident,node6 --reps 2 \
      --out "$L/node_after" ;;
  node_ab)
    GREP='rep[0-9]: steady|Error|Traceback'
    for i in $(seq "${AB_PAIRS:-2}"); do
      TAILN=6 step node_before$i 90 env VPAGER_LIBRARY="$B/build/libvpager.so" \
        python3 "$(node_bench "$B")" --comfyui "$C/ComfyUI" --runs node6 \
        --reps 3 --out "$L/node_before$i"
      TAILN=6 step node_after$i 90 $N --runs node6 --reps 3 \
        --out "$L/node_after$i"
    done ;;
  lora_ab)
    GREP='steady|x L|latents|RSS|LoRA|Error|Traceback'
    TAILN=40 VPAGER_SCHEDULE_LOG=1 step lora_before 200 \
      env VPAGER_LIBRARY="$B/build/libvpager.so" python3 "$(node_bench "$B")" \
      --comfyui "$C/ComfyUI" --lora --runs legacy,node6 \
      --out "$L/lora_before"
    TAILN=40 VPAGER_SCHEDULE_LOG=1 VPAGER_BENCH_GOVERNOR=1 step lora_after \
      "$(cap)" $N --lora --runs legacy,node6 --out "$L/lora_after"
    # The node's limit as torch's peak moved (a LoRA's patches: issue 28)
    GREP='governor: limit'
    TAILN=20 step lora_limit 10 cat "$L/lora_after/run_node6.log" ;;
  prompts)
    GREP='steady|x L|latents|apart|per-unit path|Error|Traceback'
    TAILN=40 VPAGER_SCHEDULE_LOG=1 step prompts "$(cap)" $N \
      --runs "${PROMPTS_RUNS:-resident,node6,6}" \
      --reps "${PROMPTS_REPS:-10}" --out "$L/prompts" ;;
  flux_rings)
    GREP='steady|x L|latents|Error|Traceback'
    RR=resident,node6
    for r in ${FLUX_RINGS:-288 320 378 512}; do RR=$RR,node6ring$r; done
    TAILN=40 VPAGER_SCHEDULE_LOG=1 step flux_rings "$(cap)" $N --runs "$RR" \
      --reps 4 --out "$L/flux_rings"
    GREP='schedule \(forward'
    TAILN=40 step flux_rings_plans 10 sh -c \
      "grep -o 'schedule (forward [0-9]*): <[^>]*>; ring [0-9]*' $L/flux_rings/run_node6*.log" ;;
  flux_diag)
    GREP='steady|x L|latents|Error|Traceback'
    TAILN=30 VPAGER_SCHEDULE_LOG=1 VPAGER_BENCH_STEP_STATS=1 \
      VPAGER_BENCH_TIMELINE=5 VPAGER_BENCH_START_PROFILE=1 \
      VPAGER_BENCH_KINETO=7 step flux_diag "$(cap)" $N --steps 10 \
      --runs "${DIAG_RUNS:-resident,node6}" --out "$L/flux_diag"
    NR=${DIAG_RUNS:-resident,node6}; NR=run_${NR##*,}.log
    GREP='step [0-9]+ \(|schedule \(forward'
    TAILN=40 step flux_steps 10 cat "$L/flux_diag/$NR"
    GREP='.'
    TAILN=40 step flux_timeline 30 python3 bench/step_timeline.py \
      "$L/flux_diag/run_resident.log" "$L/flux_diag/$NR"
    TAILN=10 step flux_copies 10 python3 bench/copy_trace.py \
      "$L/flux_diag/run_resident.log" "$L/flux_diag/$NR" ;;
  flux22_ab|switch_ab)
    GREP='steady|x L|latents|RSS|budget|switch|Error|Traceback'
    if [ "$PH" = flux22_ab ]; then BUD=8; MORE="--double 19 --single 38"
    else BUD=12; MORE="--switch 19x38"; fi
    TAILN=30 step ${PH%_ab}_before 200 env VPAGER_LIBRARY="$B/build/libvpager.so" \
      python3 "$(node_bench "$B")" --comfyui "$C/ComfyUI" --double 19 \
      --single 38 --runs node$BUD --reps 4 --out "$L/${PH%_ab}_before"
    # shellcheck disable=SC2086
    TAILN=60 step ${PH%_ab}_after "$(cap)" $N $MORE \
      --runs resident,node$BUD,$BUD --reps 4 --out "$L/${PH%_ab}_after" ;;
  cgroup)
    GREP='steady|x L|latents|RSS|cgroup|OOM|NOT RUN|Error|Traceback'
    TAILN=60 step cgroup "$(cap)" $N --double 19 --single 38 --switch 8x16 \
      --cgroup-gib 32 --runs resident,node8,8 --reps 2 --out "$L/cgroup" ;;
  decode)
    GREP='prefill|decode|schedule|Error|Traceback'
    for v in default VPAGER_PLAN_THREAD=0 VPAGER_PLACE_EARLY=0 \
             VPAGER_PLACE_STEPS=1; do
      TAILN=12 step "llama_${v%%=*}" 100 env ${v/default/} python3 \
        bench/bench_torch.py --only 6 --budgets 0.5 --iters 3
    done ;;
  esac
done
cd "$OUT" && tar czf "${PHASES//+/_}.tgz" "$PHASES" && rm -rf "$PHASES"
echo "done in $(( $(date +%s) - START )) s: $OUT/${PHASES//+/_}.tgz"
