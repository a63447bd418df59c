/* The whole model against the PyTorch reference (fixtures from tests/gen_fixtures.py):
 * logits, loss, every parameter gradient, then 5 AdamW steps (with clipping). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "model.h"
#include "ops.h"
#include "optim.h"
#include "pipeline.h"
#include "test.h"
#include "util.h"

typedef struct {
    int V, E, NH, L, T, B, tie, n_steps;
    int *tokens;
    float *params, *logits, loss, *grads, *step_losses, *final;
    size_t n_params;
} Fixture;

static int load_fixture(const char *path, Fixture *f) {
    char err[256];
    size_t len;
    char *buf = read_file(path, &len, err, sizeof err);
    if (!buf) { fprintf(stderr, "%s\n", err); return -1; }
    int32_t h[10];
    memcpy(h, buf, sizeof h);
    if (h[0] != 0x5846544D || h[1] != 1) { free(buf); return -1; }
    f->V = h[2]; f->E = h[3]; f->NH = h[4]; f->L = h[5]; f->T = h[6]; f->B = h[7]; f->tie = h[8]; f->n_steps = h[9];
    ModelConfig c = MODEL_CONFIG(f->V, f->E, f->NH, f->L, f->T, f->tie);
    f->n_params = model_param_count(&c);
    size_t nt = (size_t)f->n_steps * f->B * (f->T + 1), nl = (size_t)f->B * f->T * f->V;
    size_t want = sizeof h + nt * 4 + (3 * f->n_params + nl + 1 + f->n_steps) * 4;
    if (len != want) { fprintf(stderr, "%s: %zu bytes, want %zu\n", path, len, want); free(buf); return -1; }
    char *p = buf + sizeof h;
#define TAKE(dst, n) do { dst = xmalloc((n) * 4); memcpy(dst, p, (n) * 4); p += (n) * 4; } while (0)
    TAKE(f->tokens, nt);
    TAKE(f->params, f->n_params);
    TAKE(f->logits, nl);
    memcpy(&f->loss, p, 4); p += 4;
    TAKE(f->grads, f->n_params);
    TAKE(f->step_losses, (size_t)f->n_steps);
    TAKE(f->final, f->n_params);
#undef TAKE
    free(buf);
    return 0;
}

static void free_fixture(Fixture *f) {
    free(f->tokens); free(f->params); free(f->logits); free(f->grads); free(f->step_losses); free(f->final);
}

/* Copies between the fixture's packed model order and the model's flat (padded) layout. */
static void scatter(const Model *m, float *flat, const float *packed) {
    TensorInfo t[64];
    int n = model_tensors(m, t, 64);
    for (int i = 0; i < n; i++) {
        size_t k = (size_t)t[i].rows * t[i].cols;
        memcpy(flat + t[i].offset, packed, k * 4);
        packed += k;
    }
}


static void set_batch(const Fixture *f, Acts *a, int step) {
    const int *tk = f->tokens + (size_t)step * f->B * (f->T + 1);
    for (int b = 0; b < f->B; b++)
        for (int t = 0; t < f->T; t++) {
            a->inputs[b * f->T + t] = tk[b * (f->T + 1) + t];
            a->targets[b * f->T + t] = tk[b * (f->T + 1) + t + 1];
        }
}

static void check_fixture(const char *path) {
    Fixture f;
    if (load_fixture(path, &f)) { CHECK(0, "cannot load %s (run python3 tests/gen_fixtures.py)", path); return; }
    ModelConfig c = MODEL_CONFIG(f.V, f.E, f.NH, f.L, f.T, f.tie);
    Model m;
    model_init_layout(&m, &c, 3, 1);  /* odd padding: the layout must not matter */
    CHECK(m.n_params == f.n_params, "param count %zu vs %zu", m.n_params, f.n_params);
    scatter(&m, m.params, f.params);
    Acts a;
    acts_alloc(&a, &m, f.B, f.T, 1);
    CHECK(a.logit_rows == a.N, "fixture logits fit one chunk");

    set_batch(&f, &a, 0);
    float loss = model_step(&m, &a, 0, 0.0f, NULL);
    /* the logits' rows are ops_logit_stride(V) apart: compact them first */
    int ldl = ops_logit_stride(f.V);
    float *lg = xmalloc((size_t)f.B * f.T * f.V * sizeof(float));
    for (size_t r = 0; r < (size_t)f.B * f.T; r++)
        memcpy(lg + r * f.V, (const float *)a.logits + r * ldl, (size_t)f.V * sizeof(float));
    double le = norm_rel_err(lg, f.logits, (size_t)f.B * f.T * f.V);
    free(lg);
    CHECK(le < 1e-4, "%s logits rel err %.3g", path, le);
    CHECK(rel_err(loss, f.loss) < 1e-5, "%s forward loss %.7f vs torch %.7f", path, loss, f.loss);

    memset(m.grads, 0, m.n_flat * 4);
    loss = model_step(&m, &a, 1, 1.0f, NULL);
    CHECK(rel_err(loss, f.loss) < 1e-5, "%s loss %.7f vs torch %.7f", path, loss, f.loss);
    float *want = xaligned_alloc(m.n_flat * 4);
    scatter(&m, want, f.grads);
    TensorInfo t[64];
    int nt = model_tensors(&m, t, 64);
    for (int i = 0; i < nt; i++) {
        size_t k = (size_t)t[i].rows * t[i].cols;
        double e = norm_rel_err(m.grads + t[i].offset, want + t[i].offset, k);
        CHECK(e < 1e-4, "%s grad of %s rel err %.3g", path, t[i].name, e);
    }
    /* padding never receives gradient */
    for (int u = 0; u < m.n_units; u++)
        for (size_t j = m.units[u].n; j < m.units[u].n_padded; j++)
            CHECK(m.grads[m.units[u].offset + j] == 0.0f, "padding gradient in unit %d", u);

    /* 5 AdamW steps as torch: lr 1e-3, wd 0.01, clip 1.0 */
    scatter(&m, m.params, f.params);
    OptimConfig oc = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .grad_clip = 1.0,
                      .decay_steps = f.n_steps};
    OptimUnit *units = xcalloc((size_t)m.n_units, sizeof *units);
    for (int u = 0; u < m.n_units; u++) units[u] = (OptimUnit){unit_params(&m, u), unit_grads(&m, u), NULL};
    Optimizer *opt = optim_create(&(OptimSetup){&oc, &m, 1, 0, 0, 0, units});  /* the whole model, one process */
    free(units);
    for (int s = 0; s < f.n_steps; s++) {
        set_batch(&f, &a, s);
        memset(m.grads, 0, m.n_flat * 4);
        float l = model_step(&m, &a, 1, 1.0f, NULL);
        CHECK(rel_err(l, f.step_losses[s]) < 1e-4, "%s step %d loss %.7f vs torch %.7f", path, s + 1, l,
              f.step_losses[s]);
        double norm = grad_norm(m.grads, m.n_flat);
        optim_begin(opt, &oc);
        optim_update(opt, 0, m.n_units, clip_scale(&oc, norm));
    }
    scatter(&m, want, f.final);
    double pe = norm_rel_err(m.params, want, m.n_flat);
    CHECK(pe < 1e-4, "%s params after %d steps rel err %.3g", path, f.n_steps, pe);
    free(want);
    optim_free(opt);
    acts_free(&a);
    model_free(&m);
    free_fixture(&f);
}

/* The model cut into p stages (pipeline_split), each with its own Acts, the stage outputs
 * and input gradients passed along by hand as a pipeline would send them: the loss and
 * every gradient match PyTorch's as the whole model's do. */
static void check_stages(const char *path) {
    Fixture f;
    if (load_fixture(path, &f)) { CHECK(0, "cannot load %s", path); return; }
    ModelConfig c = MODEL_CONFIG(f.V, f.E, f.NH, f.L, f.T, f.tie);
    Model m;
    model_init_layout(&m, &c, 1, 1);
    scatter(&m, m.params, f.params);
    float *want = xaligned_alloc(m.n_flat * 4);
    scatter(&m, want, f.grads);
    size_t NE = (size_t)f.B * f.T * f.E * sizeof(float);
    for (int p = 2; p <= f.L; p++) {
        Stage st[8];
        Acts a[8];
        char err[256];
        CHECK(pipeline_split(&c, f.T, p, "auto", st, err, sizeof err) == 0, "%s", err);
        for (int i = 0; i < p; i++) {
            acts_alloc_stage(&a[i], &m, &st[i], f.B, f.T, 1);
            set_batch(&f, &a[i], 0);
        }
        memset(m.grads, 0, m.n_flat * 4);
        for (int i = 0; i < p; i++) {
            if (i > 0) memcpy(model_stage_input(&m, &a[i]), model_stage_output(&m, &st[i - 1], &a[i - 1], 1), NE);
            model_forward(&m, &st[i], &a[i], 1, 1.0f, NULL);
        }
        for (int i = p - 1; i >= 0; i--) {
            if (i < p - 1) memcpy(model_stage_grad(&a[i]), model_stage_grad(&a[i + 1]), NE);
            model_backward(&m, &st[i], &a[i], NULL);
        }
        float loss = model_loss(&a[p - 1]);
        CHECK(rel_err(loss, f.loss) < 1e-5, "%s p=%d loss %.7f vs torch %.7f", path, p, loss, f.loss);
        double e = norm_rel_err(m.grads, want, m.n_flat);
        CHECK(e < 1e-4, "%s p=%d gradients rel err %.3g", path, p, e);
        for (int i = 0; i < p; i++) acts_free(&a[i]);
    }
    free(want);
    model_free(&m);
    free_fixture(&f);
}

static void test_stages_untied(void) { check_stages("tests/fixtures/model_small.bin"); }
static void test_stages_tied(void) { check_stages("tests/fixtures/model_tied.bin"); }

static void test_against_torch_untied(void) { check_fixture("tests/fixtures/model_small.bin"); }
static void test_against_torch_tied(void) { check_fixture("tests/fixtures/model_tied.bin"); }

static void test_param_counts(void) {
    ModelConfig a = MODEL_CONFIG(50257, 1024, 8, 16, 256, 0), b = a, c = MODEL_CONFIG(50257, 4096, 32, 48, 256, 0);
    b.tie_embeddings = 1;
    CHECK(model_param_count(&a) == 245566464ULL, "%zu", model_param_count(&a));
    CHECK(model_param_count(&b) == 194103296ULL, "%zu", model_param_count(&b));
    CHECK(model_param_count(&c) == 7257206784ULL, "%zu", model_param_count(&c));
}

static void test_layout_padding(void) {
    ModelConfig c = MODEL_CONFIG(97, 32, 4, 2, 16, 0);
    for (int pad = 1; pad <= 8; pad++) {
        Model m;
        model_init_layout(&m, &c, pad, 0);
        size_t off = 0;
        for (int u = 0; u < m.n_units; u++) {
            CHECK(m.units[u].offset == off, "units are contiguous");
            CHECK(m.units[u].n_padded % pad == 0 && m.units[u].n_padded % 16 == 0, "unit %d padded to %d", u, pad);
            CHECK(m.units[u].n_padded >= m.units[u].n, "padding");
            off += m.units[u].n_padded;
        }
        CHECK(off == m.n_flat, "flat length");
        model_free(&m);
    }
}

static void test_init_statistics(void) {
    ModelConfig c = MODEL_CONFIG(500, 64, 4, 4, 16, 0);
    Model m;
    model_init_layout(&m, &c, 1, 1);
    model_init_weights(&m, 7);
    TensorInfo t[64];
    int n = model_tensors(&m, t, 64);
    for (int i = 0; i < n; i++) {
        size_t k = (size_t)t[i].rows * t[i].cols;
        double s = 0, s2 = 0;
        for (size_t j = 0; j < k; j++) { s += m.params[t[i].offset + j]; s2 += m.params[t[i].offset + j] * (double)m.params[t[i].offset + j]; }
        double mean = s / k, sd = sqrt(s2 / k - mean * mean);
        if (strstr(t[i].name, "norm")) CHECK(mean == 1.0 && sd < 1e-6, "%s", t[i].name);
        else {
            double want = (strstr(t[i].name, "att_out") || strstr(t[i].name, "down")) ? 0.02 / sqrt(8.0) : 0.02;
            CHECK(fabs(sd - want) / want < 0.1, "%s std %.4f want %.4f", t[i].name, sd, want);
        }
    }
    model_free(&m);
}

/* rng_jump(k) is k draws; the init's blocks and ranges are its one sequential stream per
 * tensor: any range of a unit is the same values as the whole unit, which are each
 * tensor's stream drawn in order (seeded by tensor index, as model_init_unit documents). */
static void test_init_ranges(void) {
    uint64_t ks[] = {0, 1, 2, 63, 64, 1000, 123457, (1ULL << 33) + 5};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
        Rng a, b;
        rng_seed(&a, 99);
        rng_seed(&b, 99);
        uint64_t k = ks[i] < 200000 ? ks[i] : 0;
        for (uint64_t j = 0; j < k; j++) rng_u64(&a);
        rng_jump(&b, k);
        CHECK(rng_u64(&a) == rng_u64(&b), "jump %llu", (unsigned long long)k);
    }
    Rng c, d;  /* a long jump composes: 2^33 + 5 = (2^33) + 5 */
    rng_seed(&c, 5); rng_seed(&d, 5);
    rng_jump(&c, (1ULL << 33) + 5);
    rng_jump(&d, 1ULL << 33); rng_jump(&d, 5);
    CHECK(c.s == d.s, "jump composes");

    ModelConfig mc = MODEL_CONFIG(300, 640, 4, 2, 16, 0);  /* tensors larger than one init block */
    Model m;
    model_init_layout(&m, &mc, 3, 0);
    int u = 1;
    size_t n = m.units[u].n_padded;
    float *whole = xmalloc(n * sizeof(float)), *part = xmalloc(n * sizeof(float));
    model_init_unit(&m, u, whole, 11);
    size_t cuts[] = {0, 1, 262143, 262145, n / 3, 2 * n / 3, n - 1, n};
    int bad = 0;
    for (size_t i = 0; i + 1 < sizeof cuts / sizeof cuts[0]; i++) {
        model_init_range(&m, u, cuts[i], cuts[i + 1], part + cuts[i], 11);
    }
    bad += memcmp(whole, part, n * sizeof(float)) != 0;
    CHECK(!bad, "ranges differ from the whole unit");
    /* the first tensor of the layer that is drawn (qkv) against its stream drawn in order */
    TensorInfo t[32];
    int nt = model_tensors(&m, t, 32), q = -1;
    for (int i = 0; i < nt; i++) if (strstr(t[i].name, "blocks.0.qkv")) q = i;
    Rng r;
    rng_seed(&r, 11 * 1000003ULL + (uint64_t)q);
    size_t off = t[q].offset - m.units[u].offset, k = (size_t)t[q].rows * t[q].cols;
    for (size_t j = 0; j < k && !bad; j++) bad += whole[off + j] != 0.02f * rng_normal(&r);
    CHECK(!bad, "qkv is not its stream in order");
    free(whole); free(part);
    model_free(&m);
}

/* Tensor parallel's layout: each rank's units are runs (model_tp_runs) that cover them in
 * order, land inside the whole model's unit, and together cover every element of it once
 * (what every rank holds alike, the replicated runs, counted once); a rank's init is the
 * whole model's values at those places; the vocabulary rows are [v0, v0 + Vr) of the
 * padded vocabulary's equal ranges (the last rank's short). */
static void tp_layout_case(int tp, int tied) {
    ModelConfig mc = MODEL_CONFIG(300, 32, 4, 2, 16, tied);  /* vocabulary 300 pads to 320 */
    Model w;
    model_init_layout(&w, &mc, 1, 0);
    int bad = 0;
    for (int u = 0; u < w.n_units; u++) {
        size_t wn = w.units[u].n;
        if (!wn) continue;
        float *whole = xmalloc(w.units[u].n_padded * sizeof(float));
        unsigned char *seen = xcalloc(wn, 1);
        model_init_unit(&w, u, whole, 7);
        for (int r = 0; r < tp; r++) {
            Model m;
            model_init_layout_tp(&m, &mc, 1, 0, NULL, 0, tp, r);
            bad += m.Vt != 320 / tp || m.v0 != r * m.Vt || m.Vr != (r + 1 < tp ? m.Vt : 300 - r * m.Vt);
            float *mine = xmalloc(m.units[u].n_padded * sizeof(float));
            model_init_unit(&m, u, mine, 7);
            TpRun runs[256];
            int n = model_tp_runs(&m, u, runs, 256);
            size_t at = 0;
            for (int i = 0; i < n; i++) {
                const TpRun *q = &runs[i];
                bad += q->local != at || q->global + q->n > wn;  /* in order, inside the whole */
                at += q->n;
                if (q->global + q->n > wn) continue;
                bad += memcmp(mine + q->local, whole + q->global, q->n * sizeof(float)) != 0;
                if (!q->replicated || r == 0)
                    for (size_t j = 0; j < q->n; j++) seen[q->global + j]++;
            }
            bad += at != m.units[u].n;
            free(mine);
            model_free(&m);
        }
        for (size_t j = 0; j < wn; j++) bad += seen[j] != 1;
        free(whole); free(seen);
    }
    CHECK(!bad, "tp=%d tied=%d: %d layout or init mismatches", tp, tied, bad);
    model_free(&w);
}

static void test_tp_layout(void) {
    for (int tied = 0; tied < 2; tied++) {
        tp_layout_case(2, tied);
        tp_layout_case(4, tied);
    }
}

int main(void) {
    ops_init("cpu", 0, NULL, 0);
    RUN(test_init_ranges);
    RUN(test_param_counts);
    RUN(test_layout_padding);
    RUN(test_init_statistics);
    RUN(test_against_torch_untied);
    RUN(test_against_torch_tied);
    RUN(test_stages_untied);
    RUN(test_stages_tied);
    RUN(test_tp_layout);
    return TEST_SUMMARY();
}
