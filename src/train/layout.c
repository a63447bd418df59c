#include "layout.h"
#include <stdlib.h>
#include <string.h>
#include "mesh.h"
#include "run.h"
#include "tensor.h"
#include "util.h"

int layout_init(Layout *L, const Config *c, int world, char *err, size_t errlen) {
    memset(L, 0, sizeof *L);
    L->world = world;
    L->tp = c->tensor_parallel_size;
    L->pp = c->pipeline_parallel_size;
    L->ep = c->expert_parallel_size;
    ParallelKind kind = strategy_of(c);
    int hybrid_group = kind == PAR_HYBRID ? c->shard_group_size : 0;
    if (mesh_check(world, L->tp, L->pp, hybrid_group, L->ep, err, errlen)) return -1;
    L->dp = world / (L->tp * L->pp);
    L->group = hybrid_group > 0 ? hybrid_group : L->dp;
    L->K = c->grad_accum_steps;
    L->M = L->pp > 1 ? c->micro_batches * L->K : L->K;  /* as train runs it */
    L->BM = L->pp > 1 ? c->batch_size / c->micro_batches : c->batch_size;
    L->v = L->pp > 1 ? config_virtual_stages(c) : 1;
    L->sched = SCHED_1F1B;
    schedule_kind_parse(c->pipeline_schedule, &L->sched);  /* the key's choices are the kinds */
    int gpu = !strcmp(c->device, "cuda");
    L->oc = optim_config_of(c);
    /* DDP's copy-engine all-to-all buffer; the pipeline's receive rings (pp_copy_engines);
     * tensor parallel's fused sums (tp_comm): counted where the keys ask for them */
    L->ein = estimate_input_of(c, world, L->group, &L->oc);
    L->ein.ddp_copy_engines = c->copy_engines && L->dp > 1;
    L->ein.pp_copy_engines = L->pp > 1 && c->pp_copy_engines;
    L->ein.tp_fused = tensor_parallel_fused_wanted(tp_comm_of(c), L->tp, gpu);
    estimate_memory(&L->ein, &L->whole);
    L->most = L->whole.total;
    L->host_most = L->whole.host;
    if (L->pp == 1) return 0;
    ModelConfig mc = model_config_of(c);
    int G = L->pp * L->v;
    L->stages = xcalloc((size_t)G, sizeof *L->stages);
    L->stage_cost = xcalloc((size_t)G * 3, sizeof(double));
    L->sc = xcalloc((size_t)L->pp, sizeof *L->sc);
    L->stage_mem = xcalloc((size_t)L->pp, sizeof *L->stage_mem);
    L->split_ok = pipeline_split_backward_ok(&mc, L->BM * c->context_len, c->activation_checkpointing);
    const double *head = pipeline_head_placement(L->sched, L->pp);
    if (pipeline_split_schedule(&mc, c->context_len, L->pp, L->v, L->sched, L->M, L->split_ok, c->zb1_max_in_flight,
                                head, c->pipeline_split, L->stages, err, errlen)) {
        layout_free(L);
        return -1;
    }
    pipeline_stage_costs(&mc, c->context_len, L->stages, G, head, L->stage_cost);
    L->most = L->host_most = 0;
    for (int s = 0; s < L->pp; s++) {
        Stage mine[SCHED_MAX_CHUNKS];
        if (schedule_build(&L->sc[s], L->sched, L->pp, s, L->M, L->v, L->split_ok, c->zb1_max_in_flight, L->stage_cost,
                           err, errlen)) {
            layout_free(L);
            return -1;
        }
        pipeline_rank_stages(L->stages, L->pp, L->v, s, mine);
        L->stage_mem[s] = L->whole;
        estimate_stage(&L->stage_mem[s], &L->ein, mine, &L->sc[s], L->BM);
        if (L->stage_mem[s].total > L->most) L->most = L->stage_mem[s].total;
        if (L->stage_mem[s].host > L->host_most) L->host_most = L->stage_mem[s].host;
    }
    return 0;
}

void layout_free(Layout *L) {
    for (int s = 0; L->sc && s < L->pp; s++) schedule_free(&L->sc[s]);
    free(L->sc);
    free(L->stages);
    free(L->stage_cost);
    free(L->stage_mem);
    L->sc = NULL, L->stages = NULL, L->stage_cost = NULL, L->stage_mem = NULL;
}
