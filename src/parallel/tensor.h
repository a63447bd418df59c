/* tensor — Megatron-LM tensor parallel, applied from outside the model: the model lays out
 * a tensor-parallel rank's slices (model_init_layout_tp) and sums its branch outputs and
 * input gradients through m->tp; this file gives it the mesh's tp group for that: the
 * collectives, or the sums and gathers fused into the products (MESHTRAIN_TP_FUSED). */
#ifndef MESHTRAIN_TENSOR_H
#define MESHTRAIN_TENSOR_H
#include "mesh.h"
#include "model.h"

/* Points m->tp at the mesh's tensor-parallel group (nothing to do at tp = 1), with sequence
 * parallel (m->sp) or without, and sets the chunks its collectives are split into
 * (m->tp_chunks): MESHTRAIN_TP_CHUNKS (1 to TP_MAX_CHUNKS; 1: one collective each, beside
 * no product, the default). A malformed value ends the run (exit 2). copy_engines (what
 * tensor_parallel_ce_possible said): the model gets the allocator that puts the activation
 * buffers its collectives run over in NCCL windows (comm_alloc), and the collectives run on
 * the copy engines. */
void tensor_parallel_attach(Model *m, const Mesh *mesh, int sequence_parallel, int copy_engines);
/* MESHTRAIN_TP_CE=1 (0 or unset: 0; anything else ends the run, exit 2) asks for that path. */
int tensor_parallel_ce_asked(void);
/* Whether it is taken: asked on every rank of the mesh's tp group, on GPUs whose tp group
 * can take the copy-engine path (comm_copy_engines_possible: one machine, NCCL 2.28+,
 * copy_engines=true); elsewhere nothing changes. Decided once, before the memory estimate
 * and tensor_parallel_attach: every rank of the tp group calls it together. */
int tensor_parallel_ce_possible(const Mesh *mesh);
/* Whether the tp group's collectives run on the copy engines (after the model's activations
 * are allocated: comm_alloc made the group's all-to-all buffer). */
int tensor_parallel_on_copy_engines(const Mesh *mesh);
/* The row-parallel products' sums, and sequence parallel's gathers, fused into the products
 * (ModelTp's fused_sum_begin and fused_gather_begin): on GPUs of one machine with peer
 * access, each rank sends the other ranks' rows of its product into their memory (CUDA IPC)
 * with no collective on the SMs; on CPU ranks the same data flow over MPI. Its mode
 * (MESHTRAIN_TP_FUSED, a benchmark knob; a malformed value ends the run, exit 2): 0, the
 * collectives; 1, the products' stores go straight into the other ranks' slots; 2, the parts
 * are made in local staging and copied by copy engine while the rank's own rows are made;
 * 3, each product runs once on all its rows, then the other ranks' blocks are copied out
 * (and a gather's product waits for every block); 4, mode 2's gathers, and the sums' products
 * in groups of two blocks of rows (t even, from 4), each group's blocks out as it is made.
 * Unset: 2 on GPUs at tp = 2 and 4, else 0. tensor_parallel_fused_open sets it up for sums
 * of up to N rows (collective over the tp group, after tensor_parallel_attach) and says whether it
 * is taken (on GPUs where it cannot be, every rank keeps the collectives). */
int tensor_parallel_fused_mode(int tp_size, int gpu);
/* The same before the ranks are known (die_once needs them): whether the mode may be other
 * than 0, a malformed value counting as such (the run then ends at tensor_parallel_fused_mode). */
int tensor_parallel_fused_early(int tp_size, int gpu);
int tensor_parallel_fused_open(const Model *m, const Mesh *mesh, size_t N);
/* The device memory it takes on a GPU for sums of up to N rows of E (for the estimate). */
size_t tensor_parallel_fused_bytes(int tp, size_t N, size_t E, size_t act_size);
/* The sums fused so far (on this rank; every rank of the group alike). */
unsigned long long tensor_parallel_fused_count(void);
/* Under the fused modes on GPUs (without MESHTRAIN_TP_CE) the buffers the collectives run
 * over (ModelTp's alloc) are mapped by every rank of the group, so that a gather writes each
 * rank's rows straight into the others' buffers: what such a buffer of `bytes` takes more
 * than its bytes rounded to 64 (whole pages; for the memory estimate). */
size_t tensor_parallel_buffer_extra(size_t bytes);
/* Whether such buffers were mapped (the fused gathers then write straight into them). */
int tensor_parallel_gathers_direct(void);
/* MESHTRAIN_TP_WHOLE_COLS (default 0): under the fused modes the products after a gather with
 * at most that many output columns run once on all rows (ModelTp's gather_whole_cols); a
 * malformed value ends the run (exit 2). */
int tensor_parallel_whole_cols(void);
/* Frees it (collective over the tp group). */
void tensor_parallel_fused_close(void);
#endif
