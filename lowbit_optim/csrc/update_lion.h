/* Lion (functional.lion_step): state exp_avg. */

#define LION_HYPER_FIELDS(FIELD, ARRAY, S)                                                       \
    FIELD(S, float, lr)                                                                          \
    FIELD(S, float, weight_decay)                                                                \
    FIELD(S, float, one_minus_beta1)  /* computed in float64 and rounded once, as the compiled step */ \
    FIELD(S, float, one_minus_beta2)                                                             \
    FIELD(S, int32_t, maximize)
DECLARE_STRUCT(lion_hyper_t, LION_HYPER_FIELDS)

typedef struct {
    float lr_times_wd;
    lerp_weight_t w1, w2;
} lion_scalars_t;

static void lion_prepare(const void *hyper, float step, void *scalars) {
    const lion_hyper_t *h = hyper;
    lion_scalars_t *k = scalars;
    (void)step;
    k->lr_times_wd = h->lr * h->weight_decay;
    k->w1 = lerp_weight(h->one_minus_beta1);
    k->w2 = lerp_weight(h->one_minus_beta2);
}

static inline __attribute__((always_inline)) void lion_elements(const lion_hyper_t *h, const lion_scalars_t *k, int bf16, int64_t n,
                                                                float *restrict p, const float *restrict g, void *restrict m) {
    float lr = h->lr, lr_wd = k->lr_times_wd, c1 = k->w1.coeff, c2 = k->w2.coeff;
    int high1 = k->w1.high, high2 = k->w2.high;
    uint32_t flip = h->maximize ? 0x80000000u : 0;
    #pragma omp simd
    for (int64_t j = 0; j < n; j++) {
        float P = p[j], G = float_of(bits_of(g[j]) ^ flip), M = read_value(m, j, bf16);
        P = P - lr_wd * P;
        float U = lerp(M, G, c1, high1);
        /* torch.sign as inductor lowers it, but NaN where U is not finite (lion_step); masks, not a
         * branch around arithmetic, keep the loop vectorized */
        uint32_t not_finite = 0u - (uint32_t)!(fabsf(U) <= FLT_MAX);
        float sign = float_of(bits_of((float)((0.0f < U) - (U < 0.0f))) | (not_finite & 0x7FC00000u));
        p[j] = P - lr * sign;
        write_value(m, j, lerp(M, G, c2, high2), bf16);
    }
}

static void lion_update(const void *hyper, const void *scalars, const chunk_t *c) {
    if (c->bf16_states)
        lion_elements(hyper, scalars, 1, c->n, c->param, c->grad, c->state[0]);
    else
        lion_elements(hyper, scalars, 0, c->n, c->param, c->grad, c->state[0]);
}
