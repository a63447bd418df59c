# meshtrain — `make` builds ./meshtrain; `make test` runs every test that needs no GPU.
CC      ?= gcc
ARCH    ?= -march=x86-64-v3
OPT     ?= -O3
SAN     ?=
# Open MPI's flags, from its compiler wrapper (installed by `make deps`).
MPI_CFLAGS := $(shell mpicc --showme:compile 2>/dev/null)
MPI_LIBS   := $(shell mpicc --showme:link 2>/dev/null)
CFLAGS  += -std=c11 $(OPT) $(ARCH) -g -Wall -Wextra -fopenmp -D_DEFAULT_SOURCE -D_GNU_SOURCE -Isrc $(MPI_CFLAGS) $(SAN)
LDLIBS  += -lopenblas -lpcre2-8 -lm -fopenmp $(MPI_LIBS) $(SAN)
BUILD   ?= build

SRC      := $(wildcard src/*.c)
LIB_OBJ  := $(patsubst src/%.c,$(BUILD)/obj/%.o,$(filter-out src/main.c,$(SRC)))
TESTS    := $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c))
TOOLS    := $(patsubst tests/%.c,$(BUILD)/tests/%,$(filter-out tests/test_%.c,$(wildcard tests/*.c)))
BENCHES  := $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/*.c))

# The CUDA backend (in progress: ops and their GPU test; the trainer does not use it yet).
# Built whenever nvcc is found, so CI compiles it; `make test-gpu` runs it on a GPU machine.
NVCC     ?= $(shell command -v nvcc 2>/dev/null)
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(NVCC)))
CUDA_ARCH ?= -arch=sm_90
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublasLt -lcublas -lstdc++
GPU_TESTS := $(if $(NVCC),$(BUILD)/tests/gpu_test_ops_cuda)

.PHONY: all deps data train test test-asan check-tests bench clean cuda test-gpu
all: meshtrain

deps:
	@scripts/install-deps.sh

$(BUILD)/obj/%.o: src/%.c src/*.h | $(BUILD)/obj
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/meshtrain: $(BUILD)/obj/main.o $(LIB_OBJ)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

meshtrain: $(BUILD)/meshtrain
	cp $< $@

$(BUILD)/tests/%: tests/%.c tests/test.h $(LIB_OBJ) | $(BUILD)/tests
	$(CC) $(CFLAGS) -Itests $< $(LIB_OBJ) -o $@ $(LDLIBS)

$(BUILD)/bench/%: bench/%.c $(LIB_OBJ) | $(BUILD)/bench
	$(CC) $(CFLAGS) $< $(LIB_OBJ) -o $@ $(LDLIBS)

$(BUILD)/obj $(BUILD)/tests $(BUILD)/bench:
	mkdir -p $@

$(BUILD)/obj/ops_cuda.o: src/ops_cuda.cu src/ops_cuda.h src/ops.h | $(BUILD)/obj
	$(NVCC) -O3 $(CUDA_ARCH) -std=c++17 -Xcompiler -Wall,-Wextra -Isrc -c $< -o $@

$(BUILD)/tests/gpu_test_ops_cuda: tests/gpu/test_ops_cuda.c $(BUILD)/obj/ops_cuda.o $(BUILD)/obj/ops_cpu.o $(BUILD)/obj/util.o | $(BUILD)/tests
	$(CC) $(CFLAGS) -Itests $^ -o $@ $(LDLIBS) $(CUDA_LIBS)

cuda: $(GPU_TESTS)

# On a GPU machine: every CUDA op against the CPU op.
test-gpu: $(GPU_TESTS)
	@$(BUILD)/tests/gpu_test_ops_cuda

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
train: deps
	@$(MAKE) --no-print-directory data meshtrain
	@scripts/train-default.sh

bench: $(BENCHES)

clean:
	rm -rf build build-asan meshtrain
