# meshtrain — `make` builds ./meshtrain; `make test` runs every test that needs no GPU.
CC      ?= gcc
ARCH    ?= -march=x86-64-v3
OPT     ?= -O3
SAN     ?=
# Open MPI's flags, from its compiler wrapper (installed by `make deps`).
MPI_CFLAGS := $(shell mpicc --showme:compile 2>/dev/null)
MPI_LIBS   := $(shell mpicc --showme:link 2>/dev/null)
CFLAGS  += -std=c11 $(OPT) $(ARCH) -g -Wall -Wextra -fopenmp -D_DEFAULT_SOURCE -D_GNU_SOURCE $(INC) $(MPI_CFLAGS) $(SAN)
LDLIBS  += -lopenblas -lpcre2-8 -lm -fopenmp $(MPI_LIBS) $(SAN)
BUILD   ?= build
# src/ is in folders by layer (cli, data, model, ops/cpu, ops/cuda, parallel, train); every
# folder is an include path, so `#include "x.h"` finds x.h wherever it lives.
SRC_DIRS := $(sort $(shell find src -type d))
INC      := $(addprefix -I,$(SRC_DIRS))
HDRS     := $(shell find src -name '*.h')
CUDA_DIR := src/ops/cuda

# The CUDA backend (src/ops/cuda/ops_cuda.cu) is built and linked in whenever nvcc is found, so CI
# compiles it; `make NVCC=` builds without it (device=cuda then says so; use a fresh
# BUILD dir or `make clean` when switching). The binary runs device=cpu on machines
# without a GPU or driver: nothing calls CUDA until device=cuda.
NVCC     ?= $(shell command -v nvcc 2>/dev/null)
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(NVCC)))
CUDA_ARCH ?= -arch=sm_90
# The wgmma attention backward (attn_wgmma_bwd.cu) needs the architecture-specific sm_90a target
# (wgmma); its cubin runs on compute capability 9.0 only, which attn_wgmma_device_ok checks.
WGMMA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a
ifneq ($(NVCC),)
CUDA_OBJ := $(BUILD)/obj/ops/cuda/ops_cuda.o $(BUILD)/obj/ops/cuda/attn_bf16.o $(BUILD)/obj/ops/cuda/attn_cudnn.o \
            $(BUILD)/obj/ops/cuda/attn_wgmma_bwd.o
# cuDNN's fused attention (attn_cudnn.cu): built against cudnn_graph.h where the toolkit has it,
# libcudnn opened with dlopen at run time; without the header it compiles to "not available".
CUDNN_DEF := $(if $(wildcard $(CUDA_HOME)/include/cudnn_graph.h /usr/include/cudnn_graph.h \
               /usr/include/x86_64-linux-gnu/cudnn_graph.h),,-DMESHTRAIN_NO_CUDNN)
CFLAGS   += -DMESHTRAIN_CUDA
# cuBLASLt is not linked: ops_cuda.cu opens it when device=cuda starts (through this RUNPATH).
LDLIBS   += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -ldl -lstdc++
# NCCL (several GPUs: mpirun -np N ... device=cuda), in CUDA builds where nccl.h and
# libnccl are found; else device=cuda with more than one process says this build has none.
# `make NCCL_INC=` builds without it; NCCL_INC=DIR NCCL_LIB=DIR point at another install.
NCCL_INC ?= $(firstword $(foreach d,$(CUDA_HOME)/include $(wildcard $(CUDA_HOME)/targets/*/include) /usr/include \
              /usr/local/include,$(if $(wildcard $(d)/nccl.h),$(d))))
NCCL_LIB ?= $(firstword $(foreach d,$(CUDA_HOME)/lib64 $(CUDA_HOME)/lib $(wildcard $(CUDA_HOME)/targets/*/lib) \
              /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib,$(if $(wildcard $(d)/libnccl.so*),$(d))))
ifneq ($(and $(NCCL_INC),$(NCCL_LIB)),)
CFLAGS   += -DMESHTRAIN_NCCL -isystem $(CUDA_HOME)/include $(if $(filter-out /usr/include $(CUDA_HOME)/include,$(NCCL_INC)),-isystem $(NCCL_INC))
LDLIBS   += -L$(NCCL_LIB) -Wl,-rpath,$(NCCL_LIB) -lnccl
endif
endif

SRC      := $(sort $(shell find src -name '*.c'))
LIB_OBJ  := $(patsubst src/%.c,$(BUILD)/obj/%.o,$(filter-out src/cli/main.c,$(SRC))) $(CUDA_OBJ)
TESTS    := $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c))
TOOLS    := $(patsubst tests/%.c,$(BUILD)/tests/%,$(filter-out tests/test_%.c,$(wildcard tests/*.c)))
BENCHES  := $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/*.c))
# GPU tests (tests/gpu/test_*.c and *.sh): built here, run by `make test-gpu` on a GPU machine.
GPU_TESTS := $(if $(NVCC),$(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu_%,$(wildcard tests/gpu/test_*.c)) $(BUILD)/tests/gpu_test_attn_bf16 \
             $(BUILD)/tests/gpu_test_attn_wgmma_bwd)

.PHONY: all deps deps-build data train test test-asan check-tests bench clean cuda test-gpu install
all: meshtrain

# `make install` puts meshtrain on PATH: $(PREFIX)/bin/meshtrain (PREFIX=$$HOME/.local needs no root).
PREFIX ?= /usr/local
install: meshtrain
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 0755 meshtrain $(DESTDIR)$(PREFIX)/bin/meshtrain

# Every package: building, training and the tests (Slurm and munge among them).
deps:
	@scripts/install-deps.sh

# Building and training only (no Slurm daemons on a machine that just trains).
deps-build:
	@scripts/install-deps.sh build

$(BUILD)/obj/%.o: src/%.c $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/meshtrain: $(BUILD)/obj/cli/main.o $(LIB_OBJ)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

meshtrain: $(BUILD)/meshtrain
	cp $< $@

$(BUILD)/tests/%: tests/%.c tests/test.h $(LIB_OBJ) | $(BUILD)/tests
	$(CC) $(CFLAGS) -Itests $< $(LIB_OBJ) -o $@ $(LDLIBS)

$(BUILD)/bench/%: bench/%.c $(LIB_OBJ) | $(BUILD)/bench
	$(CC) $(CFLAGS) $< $(LIB_OBJ) -o $@ $(LDLIBS)

$(BUILD)/tests $(BUILD)/bench:
	mkdir -p $@

$(BUILD)/obj/ops/cuda/ops_cuda.o: $(CUDA_DIR)/ops_cuda.cu $(CUDA_DIR)/*.cuh $(CUDA_DIR)/ops_cuda.h src/ops/ops.h $(CUDA_DIR)/attn_bf16.h \
                                  $(CUDA_DIR)/attn_cudnn.h $(CUDA_DIR)/attn_wgmma_bwd.h
	@mkdir -p $(dir $@)
	$(NVCC) -O3 $(CUDA_ARCH) -std=c++17 -Xcompiler -Wall,-Wextra -DMESHTRAIN_CUDA $(INC) -c $< -o $@

$(BUILD)/tests/gpu_%: tests/gpu/%.c tests/test.h tests/gpu/bf16_check.h $(LIB_OBJ) | $(BUILD)/tests
	$(CC) $(CFLAGS) -Itests $< $(LIB_OBJ) -o $@ $(LDLIBS)

# bf16 flash attention (tensor cores, mma.sync): its own object, linked wherever ops_cuda.o is,
# and a standalone GPU test program built by nvcc.
$(BUILD)/obj/ops/cuda/attn_bf16.o: $(CUDA_DIR)/attn_bf16.cu $(CUDA_DIR)/attn_bf16.h $(CUDA_DIR)/sfu.cuh $(CUDA_DIR)/bf16x2.cuh
	@mkdir -p $(dir $@)
	$(NVCC) -O3 $(CUDA_ARCH) -std=c++17 -Xcompiler -Wall,-Wextra -DMESHTRAIN_CUDA $(INC) -c $< -o $@

# Hopper's wgmma + TMA attention backward: sm_90a only (see WGMMA_ARCH).
$(BUILD)/obj/ops/cuda/attn_wgmma_bwd.o: $(CUDA_DIR)/attn_wgmma_bwd.cu $(CUDA_DIR)/attn_wgmma_bwd.h $(CUDA_DIR)/wgmma_util.cuh $(CUDA_DIR)/sfu.cuh $(CUDA_DIR)/bf16x2.cuh
	@mkdir -p $(dir $@)
	$(NVCC) -O3 $(WGMMA_ARCH) -std=c++17 -Xcompiler -Wall,-Wextra -DMESHTRAIN_CUDA $(INC) -c $< -o $@

$(BUILD)/obj/ops/cuda/attn_cudnn.o: $(CUDA_DIR)/attn_cudnn.cu $(CUDA_DIR)/attn_cudnn.h
	@mkdir -p $(dir $@)
	$(NVCC) -O3 $(CUDA_ARCH) -std=c++17 -Xcompiler -Wall,-Wextra $(CUDNN_DEF) $(INC) -c $< -o $@

$(BUILD)/tests/gpu_test_attn_bf16: tests/gpu/test_attn_bf16.cu tests/gpu/cu_report.h $(CUDA_DIR)/attn_bf16.h $(BUILD)/obj/ops/cuda/attn_bf16.o | $(BUILD)/tests
	$(NVCC) -O3 $(CUDA_ARCH) -std=c++17 -Xcompiler -Wall,-Wextra $(INC) $< $(BUILD)/obj/ops/cuda/attn_bf16.o -o $@

# The wgmma backward against attn_bf16_backward, and both timed (a GPU test program built by nvcc).
$(BUILD)/tests/gpu_test_attn_wgmma_bwd: tests/gpu/test_attn_wgmma_bwd.cu tests/gpu/cu_report.h tests/gpu/attn_test_util.h \
                                        $(CUDA_DIR)/attn_wgmma_bwd.h $(CUDA_DIR)/attn_bf16.h \
                                        $(BUILD)/obj/ops/cuda/attn_wgmma_bwd.o $(BUILD)/obj/ops/cuda/attn_bf16.o | $(BUILD)/tests
	$(NVCC) -O3 $(CUDA_ARCH) -std=c++17 -Xcompiler -Wall,-Wextra,-fopenmp $(INC) $< $(BUILD)/obj/ops/cuda/attn_wgmma_bwd.o \
	    $(BUILD)/obj/ops/cuda/attn_bf16.o -lgomp -o $@

# Probes built by nvcc (`make cuda` builds them): how fast each GPU's blocks reach all the
# others (copy engines against SM stores; two GPUs or more), the pattern of tensor parallel's
# fused gathers
PROBES := $(if $(NVCC),$(BUILD)/bench/ce_p2p_probe $(BUILD)/bench/lt_algos_probe)
$(BUILD)/bench/ce_p2p_probe: bench/ce_p2p_probe.cu | $(BUILD)/bench
	$(NVCC) -O2 $(CUDA_ARCH) -Xcompiler -Wall,-Wextra $< -o $@
# ... and the speed cuBLASLt's first heuristic choice leaves at the step's products
$(BUILD)/bench/lt_algos_probe: bench/lt_algos_probe.cu | $(BUILD)/bench
	$(NVCC) -O2 $(CUDA_ARCH) -Xcompiler -Wall,-Wextra $< -o $@ -lcublasLt

# Everything `make test-gpu` runs, without running it (a build to carry to a GPU machine).
cuda: $(BUILD)/meshtrain $(TOOLS) $(GPU_TESTS) $(PROBES)

# On a GPU machine: every CUDA op against the CPU op, and whole training runs on CUDA
# against the CPU (tests/gpu/). Ends with "N passed, N failed", like `make test`.
test-gpu: $(BUILD)/meshtrain $(TOOLS) $(GPU_TESTS)
	@scripts/run-tests.sh $(BUILD) gpu

data:
	@scripts/fetch-data.sh

# Builds the test binaries and meshtrain, then runs them all; ends with "N passed, N failed".
check-tests: $(BUILD)/meshtrain $(TESTS) $(TOOLS) $(GPU_TESTS)
	@scripts/run-tests.sh $(BUILD)

test: deps
	@$(MAKE) --no-print-directory data
	@$(MAKE) --no-print-directory check-tests

# Same tests under AddressSanitizer + UndefinedBehaviorSanitizer, in their own build dir.
test-asan: deps
	@$(MAKE) --no-print-directory data
	@MESHTRAIN_SANITIZED=1 $(MAKE) --no-print-directory check-tests BUILD=build-asan OPT=-O1 \
	  SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"

# The README's train command: a small default model on the mirrored TinyStories text.
train: deps-build
	@$(MAKE) --no-print-directory data meshtrain
	@scripts/train-default.sh

bench: $(BENCHES)

clean:
	rm -rf build build-asan meshtrain
