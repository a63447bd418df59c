/* checkpoint — a distributed checkpoint that does not depend on the layout that wrote it.
 *
 * Values are addressed in "packed order": the model's parameters without the flat layout's
 * padding, in model_tensors() order (= units 0..L+1 concatenated without padding), index in
 * [0, n_params). Each rank saves the ranges of packed order it owns to its own shard file
 * "<path>.s<step:08>.r<rank>-of-<world>"; once every shard is committed, rank 0 writes the
 * manifest at <path> and removes the shards of earlier checkpoints at that path. Every file
 * is written atomically (util AtomicFile), so a crash at any moment leaves the previous
 * manifest and its shards loadable. A reader on any layout (world size, strategy) reads just
 * the shard ranges that overlap the ranges it needs and verifies each one's checksum.
 *
 * Manifest: CkptHeader (256 bytes; world = number of shards, name_len) | CkptShardEntry[world]
 *   | the shards' base name (name_len bytes, no '/'; shards live beside the manifest)
 *   | uint64 FNV-1a 64 of everything before.
 * Shard:    CkptShardHeader (64 bytes) | CkptRange[n_ranges] | uint64 FNV-1a of header+table
 *   | per range, in table order: params[count] (| m[count] | v[count] when has_optim).
 * fp32 values and integers are little-endian. */
#ifndef MESHTRAIN_CHECKPOINT_H
#define MESHTRAIN_CHECKPOINT_H
#include <stddef.h>
#include <stdint.h>
#include "comm.h"
#include "model.h"
#include "optim.h"

#define CKPT_MAGIC "MTCKPT01"
#define CKPT_SHARD_MAGIC "MTCKRANK"
#define CKPT_VERSION 2

typedef struct {
    char magic[8];
    uint32_t version, header_bytes;
    int32_t vocab_size, embed_dim, n_heads, n_layers, context_len, tie_embeddings;
    int32_t batch_size, world, seed, step;     /* step = optimizer steps completed; world = shards */
    int32_t adam_step, has_optim;
    uint64_t loader_epoch, loader_window;
    uint64_t n_params;
    double last_loss;
    /* the optimizer and schedule, so a resumed run continues the same run */
    double lr, min_lr, beta1, beta2, eps, weight_decay, grad_clip;
    int32_t warmup_steps, total_steps, cosine;
    int32_t lr_decay_steps;                    /* the cosine's horizon (0 in older files: total_steps) */
    uint32_t name_len;                         /* manifest: length of the shards' base name */
    uint32_t flags;                            /* CKPT_MOE_BIAS, CKPT_LOSS_SCALE (0 in older files) */
    int32_t global_batch;                      /* sequences per optimizer step (0 in older files:
                                                * batch_size x world) */
    int32_t grad_accum_steps;                  /* micro-batches per step (0 in older files: 1) */
    /* the optimizer whose state has_optim files hold (OptimKind: 0 = AdamW, as in older
     * files; 1 = Adafactor, whose statistics stand in m and v's places: adafactor.h) and
     * Adafactor's settings: af_flags bit 0 relative step, bit 1 parameter scaling */
    int32_t optimizer, af_flags;
    double af_beta1, af_clip, af_decay;
    /* the run's validation, so a resumed run and eval keep it (val_batches 0 in older files:
     * not kept) */
    int32_t val_every, val_batches;
    /* mixture of experts (moe_experts 0 in older files and dense models), and its training
     * losses' weights and the bias balancing's rate, as the run used them (floats) */
    int32_t moe_experts, moe_expert_dim;
    int16_t moe_top_k, moe_shared_experts, moe_every, moe_router_sigmoid;
    float moe_capacity_factor, moe_aux_loss, moe_z_loss, moe_bias_balance;
} CkptHeader;
_Static_assert(sizeof(CkptHeader) == 256, "checkpoint header is 256 bytes");

/* flags: the MoE router's selection biases (aux-loss-free balancing) are kept beside the
 * manifest, in "<path>.s<step>.moebias" (ckpt_write_moe_bias) */
#define CKPT_MOE_BIAS 1u
/* flags: the loss scaler's keys and state are kept beside the manifest, in
 * "<path>.s<step>.lossscale" (ckpt_write_loss_scale) */
#define CKPT_LOSS_SCALE 2u
/* flags: the gradient compression's residuals (error feedback) are kept beside the manifest,
 * each rank's in "<path>.s<step>.ef<rank>" (ckpt_write_grad_ef) */
#define CKPT_GRAD_EF 4u
/* flags: saved by pipeline_schedule=2bw: the checkpoint holds the newest weights, and each
 * rank keeps the version before (its stages' compute weights) beside the manifest, in
 * "<path>.s<step>.stash<rank>" (ckpt_write_stash) */
#define CKPT_2BW 8u
/* flags: saved by pipeline_schedule=pipedream: as CKPT_2BW, each rank keeping every version
 * before the newest its stages hold, in the same file */
#define CKPT_PIPEDREAM 16u

typedef struct { uint64_t bytes, meta_hash, n_values, n_ranges; } CkptShardEntry;  /* in the manifest */
typedef struct {
    char magic[8];
    uint32_t version, rank, world, has_optim;
    int32_t step, reserved0;
    uint64_t n_ranges, n_values;  /* n_values = sum of the ranges' counts */
    uint64_t reserved[2];
} CkptShardHeader;
/* hash_* = FNV-1a 64 of the range's params, m, v bytes (m, v: 0 without optimizer state) */
typedef struct { uint64_t start, count, hash_params, hash_m, hash_v; } CkptRange;
_Static_assert(sizeof(CkptShardHeader) == 64 && sizeof(CkptRange) == 40 && sizeof(CkptShardEntry) == 32,
               "shard layout");

/* Ranges of packed order and where their values live in memory; m, v may be NULL when no
 * optimizer state is written or wanted. */
typedef struct { uint64_t start, count; float *params, *m, *v; } StateRange;

/* The ranges of a whole model held in one place (flat buffers with the model's padded
 * layout; mom1/mom2 may be NULL): one per unit. Returns the count, or -1 if max is too small. */
int ckpt_full_ranges(const Model *m, float *params, float *mom1, float *mom2, StateRange *out, int max);

/* Collective over `world`: each rank passes the ranges it owns; together they must cover
 * [0, n_params) exactly once. h->has_optim says whether m and v are saved (every range then
 * needs them). All ranks return 0, or all return -1 (err names the file and the problem).
 * Every rank must see the same file system at path's directory. */
int ckpt_save_dist(const char *path, const CkptHeader *h, const Comm *world, const StateRange *mine, int n_mine,
                   char *err, size_t errlen);
/* Reads the manifest into h, then fills every needed range from the shards that hold it:
 * params, and m and v too when want_optim and the range has them (a range with m = v = NULL
 * gets params only, as ZeRO's whole-parameter needs beside its moment shards). Needed ranges
 * may overlap one another. On error the needed buffers may be partly written. No communication. */
int ckpt_load_dist(const char *path, CkptHeader *h, const StateRange *need, int n_need, int want_optim,
                   char *err, size_t errlen);

/* The two halves of ckpt_save_dist, for callers (and tests) that do their own agreement:
 * the shard of one rank, then the manifest over the `world` committed shards of h->step,
 * which also removes the shards of other checkpoints at path. */
int ckpt_write_rank_file(const char *path, const CkptHeader *h, int rank, int world, const StateRange *r, int n,
                         char *err, size_t errlen);
int ckpt_write_manifest(const char *path, const CkptHeader *h, int world, char *err, size_t errlen);
/* The settings the run is in (text: the log's first line, every key and hook) beside the
 * checkpoint of `step`, as "<path>.s<step>.settings", written atomically; the next manifest
 * committed at path removes other steps' (with their shards). Informational: nothing reads
 * it back, so a run can be reproduced from any checkpoint. */
int ckpt_write_settings(const char *path, int step, const char *text, char *err, size_t errlen);
/* A MoE model's router biases (n_moe x X floats) beside the checkpoint of `step`, as
 * "<path>.s<step>.moebias" (magic, n_moe, X, the values, an FNV-1a checksum), written
 * atomically before the manifest that names the step; the next manifest committed at path
 * removes other steps'. ckpt_load_moe_bias: where h says the checkpoint keeps them
 * (CKPT_MOE_BIAS), the ones of h's step (their shape and checksum checked) into m's biases
 * (model_moe_alloc's, made here where m has none yet). 0, or -1 with err. */
int ckpt_write_moe_bias(const char *path, int step, const float *bias, int n_moe, int X, char *err, size_t errlen);
int ckpt_load_moe_bias(const char *path, const CkptHeader *h, Model *m, char *err, size_t errlen);
/* A loss scaler (its keys and state: the scale, its trackers, the steps skipped) beside the
 * checkpoint of `step`, as "<path>.s<step>.lossscale" (magic, the fields, an FNV-1a checksum),
 * written atomically before the manifest that names the step, by one rank (every rank's is
 * the same); removed with its step's other files. ckpt_load_loss_scale: where h says the
 * checkpoint keeps one (CKPT_LOSS_SCALE), the one of h's step into *s and 1; 0 where it keeps
 * none; -1 with err. */
/* The gradient compression's residuals of one rank (rank of world; kind: the compression):
 * e[n_e] then f[n_f], atomic and checksummed. ckpt_load_grad_ef reads them back where the
 * checkpoint keeps them (CKPT_GRAD_EF) for the same world, compression and sizes: 1; 0 where
 * it keeps none or another layout's (the caller then starts them at zero); -1 with err where
 * the file is missing or corrupt. */
int ckpt_write_grad_ef(const char *path, int step, int rank, int world, int kind, const float *e, size_t n_e,
                       const float *f, size_t n_f, char *err, size_t errlen);
int ckpt_load_grad_ef(const char *path, const CkptHeader *h, int rank, int world, int kind, float *e, size_t n_e,
                      float *f, size_t n_f, char *err, size_t errlen);
/* pipeline_schedule=2bw: this rank's weight version before the newest, as the ops compute
 * with it: n pieces (each unit's, of bytes[i] at piece[i], host memory), written one after
 * another into one file, atomic and checksummed, without a copy of them all; ckpt_load_stash
 * reads them back into the pieces where the checkpoint keeps one for the same world and sizes
 * (1), 0 where it keeps none, -1 with err where it is missing, corrupt or of another layout. */
int ckpt_write_stash(const char *path, int step, int rank, int world, void *const *piece, const size_t *bytes, int n,
                     char *err, size_t errlen);
int ckpt_load_stash(const char *path, const CkptHeader *h, int rank, int world, void *const *piece,
                    const size_t *bytes, int n, char *err, size_t errlen);
int ckpt_write_loss_scale(const char *path, int step, const LossScaler *s, char *err, size_t errlen);
int ckpt_load_loss_scale(const char *path, const CkptHeader *h, LossScaler *s, char *err, size_t errlen);
/* Bytes of a shard file holding n_ranges ranges of n_values values in all, and of the
 * manifest at path for `world` shards (what a save will need on disk). */
uint64_t ckpt_rank_file_bytes(uint64_t n_ranges, uint64_t n_values, int has_optim);
uint64_t ckpt_manifest_bytes(const char *path, int world);

/* Reads and checks the manifest alone (magic, version, config, sizes, checksum). */
int ckpt_read_header(const char *path, CkptHeader *h, char *err, size_t errlen);
void ckpt_model_config(const CkptHeader *h, ModelConfig *c);

/* One process holding the whole model (a world of one). ckpt_load fills opt's moments and
 * step unless opt is NULL (parameters only). */
int ckpt_save(const char *path, const CkptHeader *h, const Model *m, const AdamState *opt, char *err, size_t errlen);
int ckpt_load(const char *path, CkptHeader *h, Model *m, AdamState *opt, char *err, size_t errlen);
/* Builds a host model (model_init_layout, allocated) of the checkpoint's shape and loads its
 * parameters, whatever world size or strategy wrote it: eval, sample, export and tools; a MoE
 * model's router biases too (model_moe_alloc's, on the active backend), where it has them. */
int ckpt_load_model(const char *path, CkptHeader *h, Model *m, char *err, size_t errlen);
#endif
