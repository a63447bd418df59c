/* pipeline — how a model is cut into pipeline stages: contiguous units, the embedding on the
 * first stage and the head on the last, each stage at least one layer but the last, which
 * may hold the head alone (0 layers: its Stage is the head's unit only). `auto` starts from
 * the split that balances the estimated time of each stage (FLOPs of forward + backward per
 * token, with the embedding and the head counted) and moves layers while the schedule's
 * simulated step shortens; explicit layer counts ("5,4,4,3") are taken as given. */
#ifndef MESHTRAIN_PIPELINE_H
#define MESHTRAIN_PIPELINE_H
#include <stddef.h>
#include "model.h"
#include "schedule.h"

/* Fills stages[0..p) for a model of c at context T. spec: "auto" or p comma-separated layer
 * counts summing to n_layers, each >= 1 but the last of several (0: the head alone). auto:
 * the min-max FLOPs split, each stage a layer (the last none only where p = n_layers + 1).
 * Returns -1 with a one-line err (naming pipeline_split or
 * pipeline_parallel_size) on an impossible split. */
int pipeline_split(const ModelConfig *c, int T, int p, const char *spec, Stage *stages, char *err, size_t errlen);
/* The same for interleaving: p x v stages, of which rank r computes stages c x p + r. With
 * "auto" the contiguous min-max split is then moved a layer at a time between neighbouring
 * stages (the last may give away its last layer, keeping the head alone) while that lowers the largest rank's load (the sum of its v stages: what the
 * steady state waits for), then the spread of the ranks' loads (their squares' sum), then
 * the largest stage's; explicit counts are taken as given. */
int pipeline_split_ranks(const ModelConfig *c, int T, int p, int v, const char *spec, Stage *stages, char *err,
                         size_t errlen);
/* What a run uses: pipeline_split_ranks, then with "auto" the split whose simulated step
 * under kind over m micro-batches (schedule_makespan with split_ok, zb1_max_in_flight and pipeline_stage_costs for head) is
 * shortest, a last stage holding the head alone among them: of every split where there are few enough, else from the balanced one by moving
 * a layer at a time (never longer than it; bounded work, half a second at most). */
int pipeline_split_schedule(const ModelConfig *c, int T, int p, int v, ScheduleKind kind, int m, int split_ok,
                            int zb1_max_in_flight, const double *head, const char *spec, Stage *stages, char *err,
                            size_t errlen);
/* The stages pipeline rank `rank` of p computes when the split has p x v stages: stages
 * c x p + rank for c = 0..v-1 (interleaved; v = 1: stage `rank`), into out[0..v). */
void pipeline_rank_stages(const Stage *split, int p, int v, int rank, Stage *out);
/* The messages of a rank computing stages s[0..n): *fwd, it sends activations to the next
 * rank and receives their gradients (one of its stages lacks the head); *bwd, it receives
 * activations from the rank before and sends their gradients (one lacks the embedding). */
void pipeline_rank_messages(const ModelConfig *c, const Stage *s, int n, int *fwd, int *bwd);
/* "embedding, layers 0-3" / "layers 4-7, head"; chunks joined by " + ". */
void pipeline_describe(const ModelConfig *c, const Stage *s, int n, char *buf, size_t len);
/* Each of stages s[0..n)'s estimated forward, backward (input gradient) and weight-pass
 * time per token, into out[i x 3 + 0..2], in FLOPs at a layer forward's rate (each pass's
 * FLOPs times its measured time per FLOP, pipeline.c): what the simulated schedules are
 * built for.
 * head[0..3): how many of the head's three matmuls (logits, input gradient, weight
 * gradient; 2 E V FLOPs per token each, a recomputed one counting again) fall in the last
 * stage's F, B and W; NULL: {3, 0, 0}, the model's head, whose backward is fused into the
 * forward. Other values evaluate moving it (bench/pp_sim.c). */
void pipeline_stage_costs(const ModelConfig *c, int T, const Stage *s, int n, const double *head, double *out);
/* schedule_build's split_ok for a run: SCHED_SPLIT_NONE with activation checkpointing;
 * SCHED_SPLIT_ANY where a micro-batch's tokens x embed_dim reach 2^22 (interleaved may then
 * split its backward), else SCHED_SPLIT_ZB1. A split backward's passes are separate, smaller
 * kernels: on four H100s (the post's model, p = 4) interleaved's split lists ran 7% faster
 * at 4096 tokens a micro-batch and 13% slower at 1024 (zb1 at 1024: 0.87x 1F1B). */
int pipeline_split_backward_ok(const ModelConfig *c, int micro_tokens, int recompute);
/* Where a run's schedule puts the head's three products, for the two functions above: NULL
 * (in F) unless schedule_head_split, then {1, 1, 1} (zb1) or {1, 2, 0} (GPipe: no W). */
const double *pipeline_head_placement(ScheduleKind kind, int p);
/* Estimated FLOPs per token (forward + backward) of stage s: what `auto` balances. */
double pipeline_stage_flops(const ModelConfig *c, int T, const Stage *s);
#endif
