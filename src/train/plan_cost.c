#include "plan_cost.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "model.h"
#include "run.h"
#include "schedule_sim.h"
#include "util.h"

/* One micro-batch through a stage: the forward, the backward (input gradient) and the weight
 * pass, each the ops' time plus the collectives inside it (`comm`, kept apart to report). */
typedef struct { double t[3], comm[3]; } Pass;

typedef struct {
    const Config *c;
    const Layout *L;
    const Cluster *cl;
    Profile *p;
    int th, gpu, tp, sp, N, NS, BM, T, E, recompute;
    double act_bytes, state_bytes;
    double bw_tp, bw_dp, bw_pp;  /* the cluster's stated link rate for each group (0: the profile's) */
} Ctx;

static double op(Ctx *x, const char *name, long a, long b, long c, long d) {
    long D[4] = {a, b, c, d};
    return profile_op(x->p, name, x->th, D);
}

/* A group of n ranks, `stride` apart in the world's order, stays inside one machine when
 * its span does. */
static double link_of(const Cluster *cl, int n, int stride) {
    int inside = (long)n * stride <= cl->per_host || cl->hosts == 1;
    return inside ? cl->link_intra : (cl->link_inter > 0 ? cl->link_inter : 12.5e9);
}

static void add(Pass *ps, int k, double t) { ps->t[k] += t; }
static void add_comm(Pass *ps, int k, double t) { ps->t[k] += t, ps->comm[k] += t; }

/* Tensor parallel's collectives at one point of a layer: an all-reduce of the [N, E]
 * activations, or under sequence parallel an all-gather before and a reduce-scatter after. */
static double tp_point(Ctx *x) {
    if (x->tp == 1) return 0;
    double bytes = (double)x->N * x->E * x->act_bytes;
    if (x->sp)
        return 0.5 * (profile_coll(x->p, COLL_ALLGATHER, x->tp, bytes, x->bw_tp) +
                      profile_coll(x->p, COLL_REDUCE_SCATTER, x->tp, bytes, x->bw_tp));
    return profile_coll(x->p, COLL_ALLREDUCE, x->tp, bytes, x->bw_tp);
}

/* One layer (layer.c's ops at this layout's shapes: the rank's heads and FFN units, the
 * rank's rows of the norms under sequence parallel). A split backward (zb1) runs half of
 * each product's backward (the input gradient) in B and the rest in W, where the
 * element-wise backwards run again. */
static void layer_pass(Ctx *x, int moe, int split, Pass *ps) {
    const ModelConfig mc = model_config_of(x->c);
    int tp = x->tp, N = x->N, NS = x->NS, E = x->E, Et = E / tp, NHt = mc.n_heads / tp, HD = E / mc.n_heads;
    int H = (int)(1.5 * E) / tp, B = x->BM, T = x->T;
    double f = op(x, "rmsnorm_forward", NS, E, 0, 0) + op(x, "matmul_forward", N, E, 3 * Et, 0) +
               op(x, "rope_forward", B, T, NHt, HD) + op(x, "attention_forward", B, T, NHt, HD) +
               op(x, "matmul_forward", N, Et, E, 0) + op(x, "add_rmsnorm_forward", NS, E, 0, 0);
    double mm = op(x, "matmul_backward", N, Et, E, 0) + op(x, "matmul_backward", N, E, 3 * Et, 0);
    double ew = 2 * op(x, "rmsnorm_backward", NS, E, 0, 0) + op(x, "attention_backward", B, T, NHt, HD) +
                op(x, "rope_forward", B, T, NHt, HD);
    double ffn_ew;
    if (moe) {  /* the router, the top k experts' products on N k rows (shared out evenly), the shared experts */
        int X = mc.moe_experts, k = mc.moe_top_k, He = model_moe_expert_dim(&mc), Hs = He * mc.moe_shared_experts / tp;
        long R = (long)N * k;
        f += op(x, "matmul_forward", N, E, X, 0) + op(x, "matmul_forward", R, E, 2 * He, 0) +
             op(x, "swiglu_forward", R, He, 0, 0) + op(x, "matmul_forward", R, He, E, 0);
        mm += op(x, "matmul_backward", N, E, X, 0) + op(x, "matmul_backward", R, E, 2 * He, 0) +
              op(x, "matmul_backward", R, He, E, 0);
        ffn_ew = op(x, "swiglu_backward", R, He, 0, 0);
        if (Hs > 0) {
            f += op(x, "matmul_forward", N, E, 2 * Hs, 0) + op(x, "swiglu_forward", N, Hs, 0, 0) +
                 op(x, "matmul_forward", N, Hs, E, 0);
            mm += op(x, "matmul_backward", N, E, 2 * Hs, 0) + op(x, "matmul_backward", N, Hs, E, 0);
            ffn_ew += op(x, "swiglu_backward", N, Hs, 0, 0);
        }
        int ep = x->L->ep;
        if (ep > 1) {  /* the all-to-all of the routed rows there and back, forward and backward */
            double a2a = profile_coll(x->p, COLL_ALLGATHER, ep, (double)R * E * x->act_bytes, x->bw_dp);
            add_comm(ps, 0, 2 * a2a);
            add_comm(ps, 1, 2 * a2a);
        }
    } else {
        f += op(x, "matmul_forward", N, E, 2 * H, 0) + op(x, "swiglu_forward", N, H, 0, 0) +
             op(x, "matmul_forward", N, H, E, 0);
        mm += op(x, "matmul_backward", N, E, 2 * H, 0) + op(x, "matmul_backward", N, H, E, 0);
        ffn_ew = op(x, "swiglu_backward", N, H, 0, 0);
    }
    double comm = 2 * tp_point(x);  /* after the attention's output and the FFN's down projection */
    add(ps, 0, f);
    add_comm(ps, 0, comm);
    if (split) {
        add(ps, 1, 0.5 * mm + ew + ffn_ew);
        add(ps, 2, 0.5 * mm + ew + ffn_ew);
    } else {
        add(ps, 1, mm + ew + ffn_ew);
    }
    add_comm(ps, 1, comm);
    if (x->recompute) {  /* activation checkpointing: the forward again, before the backward */
        add(ps, 1, f);
        add_comm(ps, 1, comm);
    }
}

/* The embedding (stage.c: the lookup, the rows' backward) and the head (output_norm,
 * lm_head on the rank's vocabulary, the cross-entropy, their backward). head[3]: how many
 * of lm_head's three products (logits, input gradient, weight gradient) run in F, B, W
 * (pipeline_head_placement; NULL: all in F, the backward fused into the forward). */
static void embed_pass(Ctx *x, Pass *ps) {
    add(ps, 0, op(x, "embedding_forward", x->N, x->E, 0, 0));
    add(ps, 1, op(x, "embedding_backward", x->N, x->E, 0, 0));
    if (x->tp > 1) add_comm(ps, 0, tp_point(x));  /* the vocabulary-parallel lookup's sum */
}

static void head_pass(Ctx *x, const double *head, Pass *ps) {
    const ModelConfig mc = model_config_of(x->c);
    int Vr = ((mc.vocab_size + 63) / 64 * 64) / x->tp;
    /* the head runs in chunks of rows (stage.c), each chunk's logits made and consumed at once */
    long rows = (long)acts_logit_rows(&mc, x->BM, x->T, (size_t)x->act_bytes), last;
    if (rows <= 0 || rows > x->N) rows = x->N;
    long chunks = (x->N + rows - 1) / rows;
    last = x->N - (chunks - 1) * rows;
    double logits = (chunks - 1) * (op(x, "matmul_forward", rows, x->E, Vr, 0) + op(x, "crossentropy", rows, Vr, 0, 0)) +
                    op(x, "matmul_forward", last, x->E, Vr, 0) + op(x, "crossentropy", last, Vr, 0, 0);
    double back = (chunks - 1) * op(x, "matmul_backward", rows, x->E, Vr, 0) + op(x, "matmul_backward", last, x->E, Vr, 0);
    double norm = op(x, "rmsnorm_forward", x->NS, x->E, 0, 0), nb = op(x, "rmsnorm_backward", x->NS, x->E, 0, 0);
    static const double fused[3] = {3, 0, 0};
    if (!head) head = fused;
    add(ps, 0, norm + logits);
    for (int k = 0; k < 3; k++) add(ps, k, back * (head[k] - (k == 0)) / 2);  /* F's first is the logits */
    add(ps, head[1] > 0 ? 1 : 0, nb);
    if (x->tp > 1) {  /* the statistics' gather a chunk, and the head's input gathered (or summed) and its gradient */
        add_comm(ps, 0, tp_point(x) + chunks * profile_coll(x->p, COLL_ALLGATHER, x->tp, 12.0 * rows, x->bw_tp));
        add_comm(ps, head[1] > 0 ? 1 : 0, tp_point(x));
    }
}

/* Parameters (elements) of a unit on one tensor-parallel rank. */
static double layer_params(const ModelConfig *c, int l, int tp) {
    double E = c->embed_dim, p = 2 * E + (4 * E * E) / tp;
    if (model_layer_is_moe(c, l)) {
        double He = model_moe_expert_dim(c);
        p += E * c->moe_experts + 3 * E * He * c->moe_experts + 3 * E * He * c->moe_shared_experts / tp;
    } else {
        p += 3 * E * (int)(1.5 * E) / tp;
    }
    return p;
}

static double vocab_params(const ModelConfig *c, int tp) {
    return (double)((c->vocab_size + 63) / 64 * 64) / tp * c->embed_dim;
}

/* The stage's units' parameters on a rank, and how many units. */
static double stage_params(const ModelConfig *c, const Stage *s, int tp, int *units) {
    double n = 0;
    int first = stage_first_layer(s), nl = stage_n_layers(c, s);
    for (int l = first; l < first + nl; l++) n += layer_params(c, l, tp);
    *units = nl;
    if (s->first == 0) n += vocab_params(c, tp), ++*units;
    if (s->last == c->n_layers + 1) n += c->embed_dim + (c->tie_embeddings ? 0 : vocab_params(c, tp)), ++*units;
    return n;
}

/* A stage's passes for one micro-batch, with FSDP's gathers (and ZeRO-2's and FSDP's
 * reduce-scatters) of its units, which run once a micro-batch. */
static void stage_pass(Ctx *x, const Stage *s, const double *head, int split, Pass *ps) {
    const ModelConfig mc = model_config_of(x->c);
    memset(ps, 0, sizeof *ps);
    int first = stage_first_layer(s), nl = stage_n_layers(&mc, s);
    if (s->first == 0) embed_pass(x, ps);
    Pass one[2];
    int have[2] = {0, 0};
    for (int l = first; l < first + nl; l++) {
        int moe = model_layer_is_moe(&mc, l);
        if (!have[moe]) memset(&one[moe], 0, sizeof one[moe]), layer_pass(x, moe, split, &one[moe]), have[moe] = 1;
        for (int k = 0; k < 3; k++) ps->t[k] += one[moe].t[k], ps->comm[k] += one[moe].comm[k];
    }
    if (s->last == mc.n_layers + 1) head_pass(x, head, ps);
    ParallelKind kind = strategy_of(x->c);
    int units, g = x->L->group;
    double bytes = stage_params(&mc, s, x->tp, &units) * x->state_bytes;
    if (g > 1 && (kind == PAR_FSDP || kind == PAR_HYBRID)) {
        double ag = units * profile_coll(x->p, COLL_ALLGATHER, g, bytes / units, x->bw_dp);
        double rs = units * profile_coll(x->p, COLL_REDUCE_SCATTER, g, bytes / units, x->bw_dp);
        add_comm(ps, 0, ag);
        add_comm(ps, 1, ag + rs);
        if (!strcmp(x->c->offload, "params")) {  /* the shards come in from the host before each gather */
            double in = bytes / g / profile_rate(x->p, x->gpu ? "h2d" : "copy");
            add(ps, 0, in);
            add(ps, 1, in);
        }
    } else if (g > 1 && kind == PAR_ZERO2) {
        add_comm(ps, 1, units * profile_coll(x->p, COLL_REDUCE_SCATTER, g, bytes / units, x->bw_dp));
    }
}

int plan_threads(const Cluster *cl, int world) {
    if (cl->gpu) return 0;
    int on_host = world < cl->per_host ? world : cl->per_host;
    int t = cl->cores / (on_host > 0 ? on_host : 1);
    return t > 0 ? t : 1;
}

void plan_cost(const Config *c, const Layout *L, const Cluster *cl, Profile *p, StepCost *out) {
    memset(out, 0, sizeof *out);
    const ModelConfig mc = model_config_of(c);
    Ctx x = {c, L, cl, p, plan_threads(cl, L->world), cl->gpu, L->tp, 0, 0, 0, L->BM, c->context_len, c->embed_dim,
             c->activation_checkpointing, 4, 4, 0, 0, 0};
    OpsPrecision prec = precision_of(c);
    x.act_bytes = (double)ops_act_size_of(prec);
    x.state_bytes = cl->gpu && prec != OPS_FP32 ? 2 : (double)ops_state_size_of(prec);  /* (gathered in the compute type) */
    x.sp = L->tp > 1 && c->sequence_parallel;
    x.N = L->BM * c->context_len;
    x.NS = x.sp ? x.N / L->tp : x.N;
    x.bw_tp = link_of(cl, L->tp, 1);
    x.bw_dp = link_of(cl, L->dp, L->tp);
    x.bw_pp = link_of(cl, L->pp, L->tp * L->dp);
    double bw_world = link_of(cl, L->world, 1);
    out->threads = x.th;
    /* CPU ranks beyond the cores share them: a rank computes slower by how many want a core */
    int on_host = L->world < cl->per_host ? L->world : cl->per_host;
    double crowd = cl->gpu ? 1 : (double)on_host * x.th / (cl->cores > 0 ? cl->cores : 1);
    int G = L->pp * L->v;
    double compute = 0, inner = 0, bubble = 0, p2p = 0, busy_comm = 0;
    if (L->pp == 1) {
        Stage whole = {0, mc.n_layers + 1};
        Pass ps;
        stage_pass(&x, &whole, NULL, 0, &ps);
        double t = ps.t[0] + ps.t[1] + ps.t[2], cm = ps.comm[0] + ps.comm[1] + ps.comm[2];
        double slow = crowd > 1 ? crowd : 1;
        compute = L->M * (t - cm) * slow;
        inner = L->M * cm;
    } else {
        double *cost = xcalloc((size_t)G * 3, sizeof(double)), *cm = xcalloc((size_t)G, sizeof(double));
        const double *head = pipeline_head_placement(L->sched, L->pp);
        for (int g = 0; g < G; g++) {
            Pass ps;
            stage_pass(&x, &L->stages[g], head, L->sc[0].split_backward, &ps);
            for (int k = 0; k < 3; k++) cost[g * 3 + k] = ps.t[k];
            cm[g] = ps.comm[0] + ps.comm[1] + ps.comm[2];
        }
        int rows = x.N / (x.sp ? L->tp : 1);
        double link = profile_coll(p, COLL_SENDRECV, 2, (double)rows * x.E * x.act_bytes, x.bw_pp);
        SimStep s0, s1;
        /* ranks that wait leave their cores to the others: the crowding applies to the share
         * of the step the ranks compute, found by a first simulation */
        schedule_simulate(L->sc, L->pp, cost, 0, &s0, NULL);
        double util = s0.makespan > 0 ? s0.busy_mean / s0.makespan : 1, slow = crowd * util > 1 ? crowd * util : 1;
        double *scaled = xmalloc(sizeof(double) * (size_t)G * 3);
        for (int g = 0; g < G; g++) {
            double share = cost[g * 3] + cost[g * 3 + 1] + cost[g * 3 + 2];
            double f = share > 0 ? 1 + (slow - 1) * (1 - cm[g] / share) : 1;  /* (its collectives are not slowed) */
            for (int k = 0; k < 3; k++) scaled[g * 3 + k] = cost[g * 3 + k] * f;
        }
        schedule_simulate(L->sc, L->pp, scaled, 0, &s0, NULL);
        schedule_simulate(L->sc, L->pp, scaled, link, &s1, NULL);
        /* the busiest rank's communication inside its stages (its chunks' share) */
        for (int r = 0; r < L->pp; r++) {
            double b = 0, bc = 0;
            for (int ch = 0; ch < L->v; ch++) {
                int g = ch * L->pp + r;
                b += L->M * (scaled[g * 3] + scaled[g * 3 + 1] + scaled[g * 3 + 2]);
                bc += L->M * cm[g];
            }
            if (b >= s0.busy_max - 1e-12) busy_comm = bc;
        }
        compute = s0.busy_max - busy_comm;
        inner = busy_comm;
        bubble = s0.bubble;
        p2p = s1.makespan - s0.makespan;
        free(cost); free(cm); free(scaled);
    }
    /* after the last backward: the data-parallel reductions of the rank's stage(s) */
    ParallelKind kind = strategy_of(c);
    int g = L->group, dp = L->dp, units = 0;
    double params = 0;
    for (int ch = 0; ch < L->v; ch++) {  /* the most loaded rank's units: rank 0's (the embedding) or the last's */
        int u0;
        Stage s0 = L->pp > 1 ? L->stages[ch * L->pp] : (Stage){0, mc.n_layers + 1};
        params += stage_params(&mc, &s0, L->tp, &u0);
        units += u0;
    }
    if (L->pp > 1) {
        double pl = 0;
        int ul = 0;
        for (int ch = 0; ch < L->v; ch++) {
            int u;
            pl += stage_params(&mc, &L->stages[ch * L->pp + L->pp - 1], L->tp, &u);
            ul += u;
        }
        if (pl > params) params = pl, units = ul;
    }
    double bytes = params * x.state_bytes, end = 0;
    double bucket = c->bucket_mb > 0 ? c->bucket_mb * 1e6 : bytes / units;
    if (dp > 1) {
        switch (kind) {
        case PAR_DDP: {
            int n = (int)ceil(bytes / bucket);
            end = n * profile_coll(p, COLL_ALLREDUCE, dp, bytes / n, x.bw_dp);
            break;
        }
        case PAR_ZERO1:
            end = units * (profile_coll(p, COLL_REDUCE_SCATTER, dp, bytes / units, x.bw_dp) +
                           profile_coll(p, COLL_ALLGATHER, dp, bytes / units, x.bw_dp));
            break;
        case PAR_ZERO2: end = units * profile_coll(p, COLL_ALLGATHER, dp, bytes / units, x.bw_dp); break;
        case PAR_HYBRID:
            if (dp > g) end = units * profile_coll(p, COLL_ALLREDUCE, dp / g, bytes / g / units, link_of(cl, dp / g, L->tp * g));
            break;
        default: break;
        }
    }
    /* the optimizer over the rank's share; the gradients zeroed; offload's copies */
    int sharded = kind != PAR_DDP;
    double upd = params / (sharded ? g : 1);
    long n = (long)upd;
    long D[4] = {n, 0, 0, 0};
    int off = strcmp(c->offload, "none") != 0;
    double adam = 0;
    if (off && cl->gpu) {
        int ht = cl->cores / (cl->per_host > 0 ? cl->per_host : 1);
        adam = profile_op(p, "adamw_host", ht > 0 ? ht : 1, D);
    } else {
        adam = profile_op(p, "adamw", x.th, D) * (crowd > 1 ? crowd : 1);
    }
    if (!strcmp(c->optimizer, "adafactor")) adam *= 0.8;
    out->optim = adam + params * x.state_bytes / profile_rate(p, "copy");
    if (off)  /* the gradients out and the parameters back */
        out->host = cl->gpu ? upd * x.state_bytes / profile_rate(p, "d2h") + upd * x.act_bytes / profile_rate(p, "h2d")
                            : 2 * upd * 4 / profile_rate(p, "copy");
    /* the step's small collectives over the world: the loss, the clipping norm, the stop */
    double small = 3 * profile_coll(p, COLL_ALLREDUCE, L->world, 8, bw_world);
    out->compute = compute;
    out->comm = inner + p2p + end + small;
    out->bubble = bubble;
    out->step = out->compute + out->comm + out->bubble + out->optim + out->host;
    out->tokens_per_s = out->step > 0 ? (double)c->batch_size * c->grad_accum_steps * dp * c->context_len / out->step : 0;
}
