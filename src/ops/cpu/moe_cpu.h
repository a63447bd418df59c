/* moe_cpu — the cpu backend's mixture-of-experts ops (ops.h's op_moe_*), fp32: the reference
 * the cuda kernels are tested against. The products (router, experts) are ops_cpu.c's, beside
 * its sgemm; these are the routing, the dispatch and the combine. */
#ifndef MESHTRAIN_MOE_CPU_H
#define MESHTRAIN_MOE_CPU_H
void cpu_moe_topk(float *probs, int *idx, float *gate, float *lse, const float *logits, const float *bias, int N, int X,
                  int k, int sigmoid);
void cpu_moe_dispatch(int *cnt, int *pos, int *rowtok, float *gate_rows, const int *idx, const float *gate, int N,
                      int k, int X, int capacity);
void cpu_moe_stats(float *stats, const int *cnt, const float *probs, const float *lse, int N, int X);
void cpu_moe_route_backward(float *dlogits, const float *dgate_rows, const int *pos, const float *logits,
                            const float *probs, const int *idx, const float *gate, const float *lse,
                            const float *stats, float aux_scale, float z_scale, int N, int X, int k, int sigmoid);
void cpu_moe_combine(void *out, const void *ys, const float *gate, const int *pos, int N, int k, int E);
void cpu_moe_unpermute(void *dx, const void *dxs, const int *pos, int N, int k, int E, int acc);
void cpu_moe_gate_backward(float *dgate_rows, void *h, void *dh, const float *gate_rows, int P, int H);
void cpu_moe_accumulate(float *acc, const float *stats, int rows, int X, int k);
#endif
