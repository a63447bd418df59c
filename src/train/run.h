/* run — what the subcommands that run the model share (train.c, infer.c). */
#ifndef MESHTRAIN_RUN_H
#define MESHTRAIN_RUN_H
#include "comm.h"
#include "config.h"
#include "data.h"
#include "estimate.h"
#include "model.h"
#include "ops.h"
#include "optim.h"
#include "parallel.h"
#include "tensor.h"

ModelConfig model_config_of(const Config *c);
/* The optimizer and schedule keys (lr_decay_steps as given: 0 stays 0). */
OptimConfig optim_config_of(const Config *c);
/* Starts the ops backend of `device` (ops_init) or exits 2 with its one-line reason. */
void ops_init_or_die(const char *device, int threads);
/* The data-parallel strategy the keys ask for (fsdp, shard_strategy, zero_opt). */
ParallelKind strategy_of(const Config *c);
/* How tensor parallel's sums and gathers travel (tp_comm). */
TpComm tp_comm_of(const Config *c);
/* The keys attention and deterministic, for ops_set_options and the estimate. */
OpsOptions ops_options_of(const Config *c);
/* 1 when the run computes in bf16 (precision=mixed, or auto on cuda). */
OpsPrecision precision_of(const Config *c);
/* acts_alloc / acts_bytes' `training` for a training run: 1, or ACTS_RECOMPUTE. */
int train_acts_mode(const Config *c);
/* The estimate's input for a run of these keys over `world` ranks (shard_size of them per
 * shard group; oc must outlive it); the copy-engine paths off and no data mapped, for the
 * caller to set as the run will take them. */
EstimateInput estimate_input_of(const Config *c, int world, int shard_size, const OptimConfig *oc);
/* A card's dense bf16 tensor-core peak in FLOP/s, by its product name (as the driver gives
 * it: "NVIDIA H200"), from the vendor's datasheets; 0 where the card is not known. */
double card_peak_flops(const char *name);
void mkdir_p(const char *dir);
void mkdir_parent(const char *path);
/* Opens a shard or exits 2 with a line that says how to make it. */
void open_shard_or_die(Shard *s, const char *path, const char *what);
/* The same as a set-up failure (f) instead of an exit; -1 on failure. A shard whose
 * vocabulary is larger than the model's (vocab > 0) is refused: its ids would index past
 * the embedding. */
int open_shard_checked(Shard *s, const char *path, const char *what, int vocab, Fail *f);
/* Whether a file can be made at path (its folder created if need be): a probe file is
 * created beside it and removed, so that a run finds out before its first step, not after
 * its last. -1 with f set when not. */
int check_writable(const char *path, const char *what, Fail *f);
/* What a run will write into one file system: bytes at path (its folder's file system). */
typedef struct { const char *path, *what; double bytes; } DiskNeed;
/* Collective over world: whether each file system the ranks will write has room for all
 * of it. The needs of ranks that see the same file system on the same machine are summed
 * (every rank's checkpoint shard goes beside ckpt_path); a network file system that
 * several machines share is checked per machine. -1 with f set (the same on every rank)
 * where one has not. */
int check_disk_space(const Comm *world, const DiskNeed *needs, int n, Fail *f);
/* Windows of T+1 tokens in a shard. */
size_t shard_windows(const Shard *s, int T);
/* Mean loss of the first max_batches global batches of the validation shard, rank r of w
 * taking its slice of each (the caller averages over ranks). hooks may be NULL. */
double evaluate(Model *m, Acts *a, const Shard *val, int max_batches, int rank, int world, const UnitHooks *hooks);
#endif
