/* tensor — Megatron-LM tensor parallel, applied from outside the model: the model lays out
 * a tensor-parallel rank's slices (model_init_layout_tp) and sums its branch outputs and
 * input gradients through m->tp; this file gives it the mesh's tp group for that: the
 * collectives, or the sums and gathers fused into the products. */
#ifndef MESHTRAIN_TENSOR_H
#define MESHTRAIN_TENSOR_H
#include "mesh.h"
#include "model.h"

/* How the row-parallel products' sums and sequence parallel's gathers travel (the key
 * tp_comm): auto = fused on GPUs at tp = 2 and 4, the collectives elsewhere; collectives =
 * NCCL's (or MPI's) all-reduce, reduce-scatter and all-gather; fused = fused into the
 * products (below). */
typedef enum { TP_COMM_AUTO, TP_COMM_COLLECTIVES, TP_COMM_FUSED } TpComm;
/* Whether a run of tp ranks (on GPUs or not) asks for the fused sums (0 at tp = 1). auto
 * takes them on GPUs at tp = 2 and 4, where they were measured to pay; tp 8 is unmeasured,
 * and CPU ranks gain nothing by them. */
int tensor_parallel_fused_wanted(TpComm comm, int tp_size, int gpu);

typedef struct {
    int sequence_parallel;  /* m->sp: the residual stream and the norms split by rows too */
    int fused;              /* tensor_parallel_fused_wanted's answer */
} TpOptions;
/* Points m->tp at the mesh's tensor-parallel group (nothing to do at tp = 1), with sequence
 * parallel or without, and the sums fused or not. */
void tensor_parallel_attach(Model *m, const Mesh *mesh, const TpOptions *o);
/* The row-parallel products' sums, and sequence parallel's gathers, fused into the products
 * (ModelTp's fused_sum_begin and fused_gather_begin): on GPUs of one machine with peer
 * access, each rank makes the other ranks' rows of its product in local staging and a copy
 * engine moves them into their memory (CUDA IPC) while it makes its own, with no collective
 * on the SMs; on CPU ranks the same data flow over MPI. tensor_parallel_fused_open sets it up
 * for sums of up to N rows (collective over the tp group, after tensor_parallel_attach) and
 * says whether it is taken (on GPUs where it cannot be, every rank keeps the collectives). */
int tensor_parallel_fused_open(const Model *m, const Mesh *mesh, size_t N);
/* The device memory it takes on a GPU for sums of up to N rows of E (for the estimate). */
size_t tensor_parallel_fused_bytes(int tp, size_t N, size_t E, size_t act_size);
/* The sums fused so far (on this rank; every rank of the group alike). */
unsigned long long tensor_parallel_fused_count(void);
/* Under the fused sums on GPUs the buffers the collectives run over (ModelTp's alloc) are
 * mapped by every rank of the group, so that a gather writes each rank's rows straight into
 * the others' buffers: what such a buffer of `bytes` takes more than its bytes rounded to 64
 * (whole pages; for the memory estimate). */
size_t tensor_parallel_buffer_extra(size_t bytes);
/* Whether such buffers were mapped (the fused gathers then write straight into them). */
int tensor_parallel_gathers_direct(void);
/* Frees it (collective over the tp group). */
void tensor_parallel_fused_close(void);
#endif
