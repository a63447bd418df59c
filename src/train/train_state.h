/* train_state — a training run's share of a checkpoint: the ranges of parameters and AdamW
 * moments (or Adafactor's state, adafactor.h) this rank's strategy owns, in the
 * checkpoint's packed order, staged through host memory on a device backend (downloaded
 * before a save, uploaded after a load). */
#ifndef MESHTRAIN_TRAIN_STATE_H
#define MESHTRAIN_TRAIN_STATE_H
#include "checkpoint.h"
#include "comm.h"
#include "parallel.h"
#include "step.h"

/* Collective over world: every rank saves what it owns (ckpt_save_dist). */
/* skip_embedding: this rank holds a copy of the tied embedding that another rank saves. */
int train_state_save(const char *path, const CkptHeader *h, const Comm *world, const Parallel *par, const Model *m,
                     int skip_embedding, char *err, size_t errlen);
/* The bytes of the shard file train_state_save would write on this rank (the same ranges). */
uint64_t train_state_save_bytes(const Parallel *par, const Model *m, int skip_embedding);
/* Fills what this rank owns from the checkpoint at path (any layout wrote it) and reads its
 * manifest into h. No communication; on error nothing is uploaded. */
int train_state_load(const char *path, CkptHeader *h, const Parallel *par, const Model *m, char *err, size_t errlen);
/* pipeline_schedule=2bw: this rank's weight version before the newest (the step's stash)
 * saved beside the checkpoint of `step`, or read back from the one h describes (as
 * ckpt_write_stash, ckpt_load_stash: 1 read, 0 none kept, -1 with err); through host memory on
 * a device backend, a unit at a time. Nothing to do (0) without 2bw. */
int train_stash_save(const char *path, int step, int rank, int world, const Step *st, char *err, size_t errlen);
int train_stash_load(const char *path, const CkptHeader *h, int rank, int world, Step *st, char *err, size_t errlen);
#endif
