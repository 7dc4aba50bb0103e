# vpager — plain Makefile. `make` builds the libraries; `make test` runs the
# C suite; `make check` runs it plain, under ASan+UBSan and under TSan.
# SAN=address,undefined or SAN=thread builds into its own folder; DEBUG=1
# adds the invariant checks after every public call (src/invariants.c).

CC      ?= cc
SAN     ?=
OPT     ?= -O2
DEBUG   ?=
BUILD   ?= build$(if $(SAN),-$(subst $(comma),-,$(SAN)))$(if $(DEBUG),-debug)
comma   := ,

CFLAGS_BASE = -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -g $(OPT) -fPIC \
              -fvisibility=hidden -DVPAGER_BUILD -Iinclude -Isrc -Isrc/backend -pthread
ifneq ($(SAN),)
CFLAGS_BASE += -fsanitize=$(SAN) -fno-omit-frame-pointer -fno-sanitize-recover=all
LDSAN        = -fsanitize=$(SAN)
endif
ifneq ($(DEBUG),)
CFLAGS_BASE += -DVP_DEBUG
endif
CFLAGS  += $(CFLAGS_BASE)
LDLIBS  += -pthread -ldl -lrt

# Every library source, in the layer order of src/layers.txt; of the files
# marked @ (one platform's each), only this PLATFORM's (os_posix.c).
PLATFORM ?= posix
LIB_NAMES = $(shell sed -e 's/\#.*//' -e 's/^L[0-9]*//' -e 's/\*//g' \
                        src/layers.txt)
platform_src = $(patsubst %,src/%.c,$(foreach n,$(LIB_NAMES),$(if $(filter %@,$(n)),\
                 $(patsubst %@,%,$(filter %_$(1)@,$(n))),$(n))))
LIB_SRC = $(call platform_src,$(PLATFORM))
LIB_OBJ = $(LIB_SRC:src/%.c=$(BUILD)/obj/%.o)

TEST_SRC = $(wildcard tests/*.c)
TEST_OBJ = $(TEST_SRC:tests/%.c=$(BUILD)/tests/%.o)

VERSION = 0.1.0
PREFIX ?= /usr/local

all: $(BUILD)/libvpager.so $(BUILD)/libvpager.a $(BUILD)/vpager.pc

$(BUILD)/obj/%.o: src/%.c $(wildcard src/*.h src/backend/*.h) include/vpager.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libvpager.so: $(LIB_OBJ)
	$(CC) -shared -Wl,-soname,libvpager.so.0 -Wl,--no-undefined $(LDSAN) -o $@ $^ $(LDLIBS)

$(BUILD)/libvpager.a: $(LIB_OBJ)
	rm -f $@ && ar rcs $@ $^

# The .pc names PREFIX: made again when PREFIX differs from the last build's.
$(BUILD)/prefix.stamp: FORCE | $(BUILD)
	@echo '$(PREFIX)' | cmp -s - $@ || echo '$(PREFIX)' > $@

$(BUILD)/vpager.pc: Makefile $(BUILD)/prefix.stamp | $(BUILD)
	printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: vpager\nDescription: demand paging of model weights into GPU memory\nVersion: %s\nLibs: -L$${libdir} -lvpager\nLibs.private: -pthread -ldl -lrt\nCflags: -I$${includedir}\n' '$(PREFIX)' '$(VERSION)' > $@

$(BUILD) $(BUILD)/obj $(BUILD)/tests $(BUILD)/bench $(BUILD)/demo:
	mkdir -p $@

# Tests link the static library so they may reach internal helpers too.
$(BUILD)/tests/%.o: tests/%.c $(wildcard tests/*.h src/*.h src/backend/*.h) include/vpager.h | $(BUILD)/tests
	$(CC) $(CFLAGS) -Itests -c $< -o $@

$(BUILD)/tests/runner: $(TEST_OBJ) $(BUILD)/libvpager.a
	$(CC) $(LDSAN) -o $@ $(TEST_OBJ) $(BUILD)/libvpager.a $(LDLIBS)

test: $(BUILD)/tests/runner check-exports
	$(BUILD)/tests/runner

# Only vp_ symbols may leave the shared library.
check-exports: $(BUILD)/libvpager.so
	@bad=$$(nm -D --defined-only $< | awk '{print $$3}' | grep -v '^vp_' || true); \
	if [ -n "$$bad" ]; then echo "exported non-vp_ symbols: $$bad"; exit 1; fi; \
	echo "exports: only vp_ symbols"

# The layering of src/layers.txt, proved from the object files.
check-layers: $(LIB_OBJ)
	@sh tools/check_layers.sh src/layers.txt $(BUILD)/obj

# Our CUDA driver declarations must match the toolkit's cuda.h, where the
# toolkit is installed (vpager itself builds without it).
CUDA_INC ?= /usr/local/cuda/include
NVCC ?= /usr/local/cuda/bin/nvcc
check-abi:
	@if [ -f $(CUDA_INC)/cuda.h ]; then \
	  $(CC) -std=c11 -Wall -Wextra -Werror -Wincompatible-pointer-types \
	    -I$(CUDA_INC) -Isrc -Isrc/backend -Iinclude -fsyntax-only tools/cuda_abi_check.c && \
	  echo "cuda_abi.h matches $(CUDA_INC)/cuda.h"; \
	else echo "check-abi: skipped, no $(CUDA_INC)/cuda.h"; fi
	@if [ -x $(dir $(NVCC))ptxas ]; then mkdir -p $(BUILD) && \
	  sed -n 's/^  "\(.*\)\\n"$$/\1/p' src/backend/pull_ptx.h | \
	    sed 's/\\"/"/g; s/\\\\/\\/g' > $(BUILD)/pull_check.ptx && \
	  $(dir $(NVCC))ptxas -arch=sm_75 $(BUILD)/pull_check.ptx \
	    -o $(BUILD)/pull_check.cubin && \
	  echo "pull_ptx.h assembles (ptxas, sm_75)"; \
	else echo "check-abi: pull_ptx.h not assembled, no ptxas"; fi

# The PTX of the CUDA backend's copy by SMs (src/backend/pull.cu), kept in
# the tree as a C string so that vpager builds without a toolkit; run
# after a change to pull.cu (needs nvcc). It declares PTX ISA 7.0 (CUDA
# 11.0), not the toolkit's own, so that older drivers JIT it too: the
# kernel uses nothing newer (ptxas checks it for sm_75 and sm_90).
pull-ptx:
	@mkdir -p $(BUILD) && \
	$(NVCC) -arch=compute_75 -ptx src/backend/pull.cu -o $(BUILD)/pull.ptx && \
	{ echo '/* Generated from pull.cu by `make pull-ptx` (nvcc -arch=compute_75 -ptx,'; \
	  echo ' * PTX ISA 7.0 declared); do not edit: change pull.cu and regenerate. */'; \
	  echo 'static const char vp__pull_ptx[] ='; \
	  sed 's/^\.version .*/.version 7.0/; s/\\/\\\\/g; s/"/\\"/g; s/^/  "/; s/$$/\\n"/' \
	    $(BUILD)/pull.ptx; \
	  echo '  ;'; } > src/backend/pull_ptx.h

# The HIP backend against ROCm's headers (Debian's libamdhip64-dev: ROCm
# 5.2; or /opt/rocm): it builds, and hip_abi.h matches
# hip/hip_runtime_api.h, so a signature that drifts fails here. Unlike
# check-abi it fails without the headers: CI installs them. Then the pager
# suite runs through the backend on a stand-in runtime (hip/ tests).
HIP_INC ?= $(firstword $(patsubst %/hip/hip_runtime_api.h,%,$(wildcard \
             /usr/include/hip/hip_runtime_api.h \
             /opt/rocm/include/hip/hip_runtime_api.h)) /usr/include)
check-hip: $(BUILD)/obj/backend/hip.o $(BUILD)/obj/backend/vmm.o \
           $(BUILD)/tests/runner $(BUILD)/tests/libfakehip.so
	@if [ ! -f $(HIP_INC)/hip/hip_runtime_api.h ]; then \
	  echo "check-hip: no $(HIP_INC)/hip/hip_runtime_api.h: install ROCm's" \
	       "HIP headers (apt-get install libamdhip64-dev) or set HIP_INC"; \
	  exit 1; fi
	$(CC) -std=c11 -Wall -Wextra -Werror -Wincompatible-pointer-types \
	  -D__HIP_PLATFORM_AMD__ $(filter-out -I/usr/include,-I$(HIP_INC)) \
	  -Isrc -Isrc/backend -Iinclude -fsyntax-only tools/hip_abi_check.c
	@v=$$(sed -n 's/^#define HIP_VERSION_M[AI][JN]OR //p' \
	  $(HIP_INC)/hip/hip_version.h | paste -sd.); \
	echo "check-hip: hip.c builds; hip_abi.h matches" \
	  "$(HIP_INC)/hip/hip_runtime_api.h (HIP $$v)"
	TEST_HIP_LIBRARY=$(CURDIR)/$(BUILD)/tests/libfakehip.so \
	  $(BUILD)/tests/runner hip/

# A stand-in HIP runtime over host memory: check-hip runs the pager suite
# through the HIP backend on it (tests/fakehip/fake_hip.c; the device
# memory both stand-ins share: tests/fakegpu/).
FAKE_VMM = tests/fakegpu/fake_vmm.c tests/fakegpu/fake_vmm.h
FAKE_CC = $(CC) -std=c11 -Wall -Wextra -Werror -O2 -fPIC -shared \
	  -fvisibility=hidden -Itests/fakegpu
$(BUILD)/tests/libfakehip.so: tests/fakehip/fake_hip.c $(FAKE_VMM) | $(BUILD)/tests
	$(FAKE_CC) -o $@ $(filter %.c,$^) -pthread

# The CUDA backend on a stand-in driver (tests/fakecuda/fake_cuda.c),
# found by its usual name first on LD_LIBRARY_PATH: the cuda/ tests
# through cuda.c and vmm.c without a GPU. The runner skips, saying why,
# the tests that load PTX and call the driver themselves (test_gpu.c); a
# backend that does not open at all (a "skip cuda/*" line) fails here.
check-cuda-fake: $(BUILD)/tests/runner $(BUILD)/fakecuda/libcuda.so.1
	@LD_LIBRARY_PATH=$(CURDIR)/$(BUILD)/fakecuda$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} \
	  $(BUILD)/tests/runner cuda/ >$(BUILD)/fakecuda/runner.log 2>&1; \
	rc=$$?; cat $(BUILD)/fakecuda/runner.log; \
	if grep -q '^skip cuda/\*' $(BUILD)/fakecuda/runner.log; then \
	  echo "check-cuda-fake: the CUDA backend did not open on the stand-in"; \
	  exit 1; fi; exit $$rc

$(BUILD)/fakecuda/libcuda.so.1: tests/fakecuda/fake_cuda.c $(FAKE_VMM) \
                                src/backend/cuda_abi.h
	@mkdir -p $(@D)
	$(FAKE_CC) -Isrc/backend -Wl,-soname,libcuda.so.1 -o $@ \
	  $(filter %.c,$^) -pthread

# The Python tests on the simulated device: the binding (no torch needed)
# and vpager.torch (skips without torch; CI installs Debian's python3-torch).
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
check-python: $(BUILD)/libvpager.so
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_binding.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_torch.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_threads.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_replan.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_plan_thread.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_kept_fills.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_lend.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_config.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_stats.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_pins.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_progress.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_hostmem.py
	$(PYTHON) tests/python/test_schedule.py
	PYTHONPATH=python:python/compat VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) tests/python/test_compat.py
	PYTHONPATH=python:python/compat VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) tests/python/test_compat_malloc_graph.py
	PYTHONPATH=python:integrations:python/compat VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) tests/python/test_windows.py
	VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) bench/comfyui_run.py --check
	$(PYTHON) tests/python/test_bench_node.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_ledger.py
	PYTHONPATH=python:integrations VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_governor.py
	PYTHONPATH=python:integrations VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) tests/python/test_comfyui_node.py
	PYTHONPATH=python:integrations VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) tests/python/test_comfyui_quantized.py
	PYTHONPATH=python:integrations VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) tests/python/test_comfyui_gguf.py
	PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	  $(PYTHON) tests/python/test_bench_torch.py
	VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) bench/bench_load.py --dry-run >/dev/null
	VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) bench/bench_kept_copy.py --dry-run >/dev/null
	VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) bench/bench_marks.py --dry-run >/dev/null
	VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) bench/bench_forward_start.py --dry-run >/dev/null
	VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so $(PYTHON) bench/unit_host.py --dry-run >/dev/null

# `make install PREFIX=...` after a plain `make` installs a .pc naming
# that PREFIX.
check-install: all
	@d=$$(mktemp -d) && $(MAKE) -s install PREFIX=/opt/vp DESTDIR=$$d >/dev/null && \
	  grep -qx 'prefix=/opt/vp' $$d/opt/vp/lib/pkgconfig/vpager.pc && \
	  echo "check-install: vpager.pc names PREFIX=/opt/vp" && rm -rf $$d || \
	  { echo "check-install: the installed vpager.pc does not name PREFIX"; exit 1; }

# The Python tests on a machine without torch: skips, no crash.
check-notorch: $(BUILD)/libvpager.so
	$(MAKE) -s check-python PYTHON="env PYTHONPATH=$(CURDIR)/tests/python/notorch:python:integrations:python/compat $(PYTHON)"

# Every suite: one line a step and a summary line; each step's whole
# output in build/check/<step>.log (tools/check.sh).
check:
	@sh tools/check.sh "$(MAKE)"

# Windows: vpager.dll, libvpager.a and the C test runner cross-built with
# mingw-w64 into WIN_BUILD (src/os_win32.c for the platform), the suite run
# under Wine on the simulated device in a Wine prefix of its own (made once:
# wineboot). Debian: apt-get install mingw-w64 wine64. The runner lists the
# tests Windows cannot run (TEST_EXCLUDED) with their reasons.
WIN_CC     ?= x86_64-w64-mingw32-gcc
WIN_AR     ?= x86_64-w64-mingw32-ar
WIN_OBJDUMP ?= x86_64-w64-mingw32-objdump
WIN_NM     ?= x86_64-w64-mingw32-nm
WIN_BUILD  ?= build-win
WINE       ?= $(firstword $(wildcard /usr/lib/wine/wine64) wine64)
WINESERVER ?= $(firstword $(wildcard /usr/lib/wine/wineserver) wineserver)
# __USE_MINGW_ANSI_STDIO: mingw's own printf, with C99's %zu and %llu.
WIN_CFLAGS  = -std=c11 -D__USE_MINGW_ANSI_STDIO=1 -Wall -Wextra -Werror -g \
              -O2 -DVPAGER_BUILD -Iinclude -Isrc -Isrc/backend
WIN_LIB_OBJ = $(patsubst src/%.c,$(WIN_BUILD)/obj/%.o,$(call platform_src,win32))
WIN_TEST_OBJ = $(TEST_SRC:tests/%.c=$(WIN_BUILD)/tests/%.o)
# A test's time limit under Wine, whose process start is slow: the 64
# processes of sim/ledger_join_leave_many took 110 s on a 2-core machine
# (60 s is the runner's default).
WIN_TEST_TIMEOUT ?= 300
WIN_ENV     = WINEPREFIX=$(CURDIR)/$(WIN_BUILD)/wine WINEDEBUG=-all \
              TEST_TIMEOUT=$(WIN_TEST_TIMEOUT)

$(WIN_BUILD)/obj/%.o: src/%.c $(wildcard src/*.h src/backend/*.h) include/vpager.h
	@mkdir -p $(dir $@)
	$(WIN_CC) $(WIN_CFLAGS) -c $< -o $@

# -Wno-unused-function: a test TEST_EXCLUDED here leaves its helpers unused.
$(WIN_BUILD)/tests/%.o: tests/%.c $(wildcard tests/*.h src/*.h src/backend/*.h) include/vpager.h
	@mkdir -p $(dir $@)
	$(WIN_CC) $(WIN_CFLAGS) -Wno-unused-function -Itests -c $< -o $@

# The DLL exports the public vp_ functions only (a .def made from the
# objects; the rest stays inside, as -fvisibility=hidden keeps it on
# Linux); libgcc linked in: it needs only Windows' own DLLs.
$(WIN_BUILD)/vpager.def: $(WIN_LIB_OBJ)
	{ echo EXPORTS; $(WIN_NM) -g --defined-only $^ | \
	  awk '$$2 == "T" && $$3 ~ /^vp_[a-z0-9]/ {print "  " $$3}' | sort -u; } > $@

$(WIN_BUILD)/vpager.dll: $(WIN_LIB_OBJ) $(WIN_BUILD)/vpager.def
	$(WIN_CC) -shared -static-libgcc -o $@ $^ \
	  -Wl,--out-implib,$(WIN_BUILD)/libvpager.dll.a

$(WIN_BUILD)/libvpager.a: $(WIN_LIB_OBJ)
	rm -f $@ && $(WIN_AR) rcs $@ $^

# Static: winpthreads (the tests' threads) in the .exe, no DLL to find.
$(WIN_BUILD)/tests/runner.exe: $(WIN_TEST_OBJ) $(WIN_BUILD)/libvpager.a
	$(WIN_CC) -static -o $@ $(WIN_TEST_OBJ) $(WIN_BUILD)/libvpager.a -lpthread

$(WIN_BUILD)/wine/system.reg:
	@mkdir -p $(WIN_BUILD)/wine
	$(WIN_ENV) $(WINE) wineboot -i

# WIN_TESTS: the runner's name filters (all tests when empty).
check-windows: $(WIN_BUILD)/vpager.dll $(WIN_BUILD)/libvpager.a $(WIN_BUILD)/tests/runner.exe $(WIN_BUILD)/wine/system.reg
	@names=$$($(WIN_OBJDUMP) -p $(WIN_BUILD)/vpager.dll | awk '/^\[Ordinal\/Name Pointer\] Table/ \
	  {t = 1; next} t && NF == 0 {t = 0} t {print $$NF}'); \
	bad=$$(echo "$$names" | grep -v '^vp_' || true); \
	if [ -n "$$bad" ]; then echo "vpager.dll exports non-vp_ symbols: $$bad"; exit 1; fi; \
	echo "vpager.dll exports $$(echo "$$names" | wc -l) functions, only vp_ ones"
	@$(WIN_ENV) $(WINE) $(WIN_BUILD)/tests/runner.exe $(WIN_TESTS); rc=$$?; \
	  $(WIN_ENV) $(WINESERVER) -k 2>/dev/null; exit $$rc

# libFuzzer harnesses (clang): make fuzz [FUZZ_SECONDS=60] (tests/fuzz/README.md)
include tests/fuzz/fuzz.mk

$(BUILD)/demo/demo: demo/demo.c $(BUILD)/libvpager.a | $(BUILD)/demo
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libvpager.a $(LDLIBS)

# The torch demo runs under the first of DEMO_PYTHONS that imports torch:
# the python3 on PATH (a virtual environment's, with CUDA torch) first.
DEMO_PYTHONS ?= python3 $(PYTHON)
demo: $(BUILD)/demo/demo $(BUILD)/libvpager.so
	$(BUILD)/demo/demo
	@for py in $(DEMO_PYTHONS); do \
	  if $$py -c 'import torch' 2>/dev/null; then \
	    echo; PYTHONPATH=python VPAGER_LIBRARY=$(CURDIR)/$(BUILD)/libvpager.so \
	    $$py demo/torch_demo.py; exit $$?; fi; \
	done; echo "torch demo skipped: torch is not importable ($(DEMO_PYTHONS))"

$(BUILD)/bench/%: bench/%.c $(BUILD)/libvpager.a | $(BUILD)/bench
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libvpager.a $(LDLIBS)

# bench_cuda exits 0 with a message when no GPU is usable.
bench: $(BUILD)/bench/bench_hotpath $(BUILD)/bench/bench_cuda
	$(BUILD)/bench/bench_hotpath
	$(BUILD)/bench/bench_cuda

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 include/vpager.h $(DESTDIR)$(PREFIX)/include/
	install -m 755 $(BUILD)/libvpager.so $(DESTDIR)$(PREFIX)/lib/libvpager.so.0
	ln -sf libvpager.so.0 $(DESTDIR)$(PREFIX)/lib/libvpager.so
	install -m 644 $(BUILD)/libvpager.a $(DESTDIR)$(PREFIX)/lib/
	install -m 644 $(BUILD)/vpager.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/

clean:
	rm -rf build build-*

.PHONY: all test check check-windows check-abi pull-ptx check-hip check-cuda-fake check-exports check-layers check-python check-notorch check-install FORCE demo bench install clean fuzz fuzz-build
.SECONDARY:
