# In-tree libFuzzer harnesses (issue 11). Included by the top Makefile:
#
#   include tests/fuzz/fuzz.mk
#
# which must define LIB_SRC (the library's sources, wherever they live).
# Everything here builds with clang into build-fuzz/, the library from
# $(LIB_SRC) with the harnesses' sanitizers, so source moves are followed.
#
#   make fuzz                       every harness FUZZ_SECONDS (60) seconds
#   make fuzz FUZZ_SECONDS=600      longer
#   make fuzz FUZZ_TARGETS=api      one harness (api, safetensors, options,
#                                   ledger)
#   make fuzz-build                 only build build-fuzz/fuzz_*
#
# A run fails (non-zero exit) on any finding: crash, sanitizer report, leak,
# timeout, or a harness check (fuzz_api's model). Findings are written to
# build-fuzz/artifacts/; see tests/fuzz/README.md to reproduce one.

FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= api safetensors options ledger
FUZZ_BUILD   ?= build-fuzz
FUZZ_DIR     := tests/fuzz
# Extra libFuzzer flags for every run, e.g. FUZZ_FLAGS='-jobs=2 -workers=2'.
FUZZ_FLAGS   ?=

FUZZ_SAN     = -fsanitize=address,undefined -fno-sanitize-recover=all \
               -fno-omit-frame-pointer
# Take the top Makefile's -D/-I/-std/visibility flags (so new ones follow),
# but not its warnings-as-errors, optimisation or sanitizer choice.
# VP_DEBUG: the library re-checks its page counts after every public call
# (src/invariants.c) and aborts on a mismatch, a finding like any other.
FUZZ_CFLAGS  = $(filter-out -Werror -O% -fsanitize=% -fno-sanitize-recover% \
                 -fPIC,$(CFLAGS_BASE)) \
               -std=c11 -D_GNU_SOURCE -DVPAGER_BUILD -fvisibility=hidden \
               -DVP_DEBUG \
               -Isrc -Isrc/backend -Iinclude -pthread -g -O1 \
               -Wno-unused-parameter $(FUZZ_SAN)
FUZZ_LIB_OBJ = $(patsubst %.c,$(FUZZ_BUILD)/obj/%.o,$(LIB_SRC))
FUZZ_HDRS    = $(wildcard include/*.h src/*.h src/*/*.h)
FUZZ_BINS    = $(patsubst %,$(FUZZ_BUILD)/fuzz_%,$(FUZZ_TARGETS))

# The library: coverage-instrumented (fuzzer-no-link), same sanitizers.
$(FUZZ_BUILD)/obj/%.o: %.c $(FUZZ_HDRS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZ_BUILD)/fuzz_%: $(FUZZ_DIR)/fuzz_%.c $(FUZZ_DIR)/fuzz_common.h \
                      $(FUZZ_LIB_OBJ) $(FUZZ_HDRS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -I$(FUZZ_DIR) $< \
	  $(FUZZ_LIB_OBJ) -o $@ $(LDLIBS) -pthread -ldl -lrt

fuzz-build: $(FUZZ_BINS)

# Each harness: new inputs go to build-fuzz/corpus/<name> (the in-tree seeds
# in tests/fuzz/corpus/<name> are only read), findings to
# build-fuzz/artifacts/. -timeout: one input running 20 s is a hang.
fuzz: $(FUZZ_BINS)
	@set -e; for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t $(FUZZ_BUILD)/artifacts; \
	  dict=; [ -f $(FUZZ_DIR)/$$t.dict ] && dict=-dict=$(FUZZ_DIR)/$$t.dict; \
	  echo "fuzz: $$t for $(FUZZ_SECONDS) s"; \
	  $(FUZZ_BUILD)/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=20 \
	    -rss_limit_mb=4096 -print_final_stats=1 $$dict \
	    -artifact_prefix=$(FUZZ_BUILD)/artifacts/$$t- $(FUZZ_FLAGS) \
	    $(FUZZ_BUILD)/corpus/$$t $(FUZZ_DIR)/corpus/$$t \
	    || { echo "fuzz: $$t FAILED: see $(FUZZ_BUILD)/artifacts/$$t-*"; \
	         exit 1; }; \
	done

.PHONY: fuzz fuzz-build
