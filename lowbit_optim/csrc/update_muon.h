/* Muon's elementwise part before the Newton-Schulz iterations (functional.muon_momentum): state
 * momentum_buffer. Its "parameter" is the output, what the iterations orthogonalize (the momentum,
 * or Nesterov's look-ahead): the caller passes a bf16 tensor for it, the iterations' first rounding,
 * and applies the orthogonalized update itself (Muon._fused_step). */

#define MUON_HYPER_FIELDS(FIELD, ARRAY, S)                                                              \
    FIELD(S, float, momentum)                                                                           \
    FIELD(S, float, one_minus_momentum)  /* computed in float64 and rounded once, as the compiled step */ \
    FIELD(S, int32_t, nesterov)
DECLARE_STRUCT(muon_hyper_t, MUON_HYPER_FIELDS)

typedef struct {
    lerp_weight_t average, look_ahead;
} muon_scalars_t;

static void muon_prepare(const void *hyper, float step, void *scalars) {
    const muon_hyper_t *h = hyper;
    muon_scalars_t *k = scalars;
    (void)step;
    k->average = lerp_weight(h->one_minus_momentum);
    k->look_ahead = lerp_weight(h->momentum);
}

static inline __attribute__((always_inline)) void muon_elements(const muon_scalars_t *k, int nesterov, int bf16, int64_t n,
                                                                float *restrict out, const float *restrict g, void *restrict buf) {
    float c1 = k->average.coeff, c2 = k->look_ahead.coeff;
    int high1 = k->average.high, high2 = k->look_ahead.high;
    #pragma omp simd
    for (int64_t j = 0; j < n; j++) {
        float G = g[j], M = lerp(read_value(buf, j, bf16), G, c1, high1);
        write_value(buf, j, M, bf16);
        out[j] = nesterov ? lerp(G, M, c2, high2) : M;
    }
}

static void muon_update(const void *hyper, const void *scalars, const chunk_t *c) {
    switch ((((const muon_hyper_t *)hyper)->nesterov != 0) << 1 | c->bf16_states) {
        case 0: muon_elements(scalars, 0, 0, c->n, c->param, c->grad, c->state[0]); break;
        case 1: muon_elements(scalars, 0, 1, c->n, c->param, c->grad, c->state[0]); break;
        case 2: muon_elements(scalars, 1, 0, c->n, c->param, c->grad, c->state[0]); break;
        default: muon_elements(scalars, 1, 1, c->n, c->param, c->grad, c->state[0]); break;
    }
}
