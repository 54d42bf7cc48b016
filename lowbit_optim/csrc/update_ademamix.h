/* AdEMAMix (functional.ademamix_step): states exp_avg, exp_avg_slow, exp_avg_sq. alpha, beta3 and
 * their warm-up lengths are doubles: prepare computes the warm-ups in float64 and rounds once, as the
 * compiled graph does. */

#define ADEMAMIX_HYPER_FIELDS(FIELD, ARRAY, S)                                                   \
    FIELD(S, float, lr)                                                                          \
    FIELD(S, float, beta1)                                                                       \
    FIELD(S, float, beta2)                                                                       \
    FIELD(S, float, weight_decay)                                                                \
    FIELD(S, float, eps)                                                                         \
    FIELD(S, float, one_minus_beta1)  /* computed in float64 and rounded once */                 \
    FIELD(S, float, one_minus_beta2)                                                             \
    FIELD(S, double, alpha)                                                                      \
    FIELD(S, double, t_alpha)                                                                    \
    FIELD(S, double, beta3)                                                                      \
    FIELD(S, double, t_beta3)                                                                    \
    FIELD(S, int32_t, schedule_alpha)                                                            \
    FIELD(S, int32_t, schedule_beta3)                                                            \
    FIELD(S, int32_t, maximize)
DECLARE_STRUCT(ademamix_hyper_t, ADEMAMIX_HYPER_FIELDS)

typedef struct {
    float lr_times_wd, bias_correction1, sqrt_bias_correction2, alpha;
    lerp_weight_t w1, w2, w3;
} ademamix_scalars_t;

static inline double min_nan(double a, double b) {  /* torch.minimum: NaN propagates */
    return (a != a || b != b) ? NAN : (a < b ? a : b);
}

static void ademamix_prepare(const void *hyper, float step, void *scalars) {
    const ademamix_hyper_t *h = hyper;
    ademamix_scalars_t *k = scalars;
    double n = step, alpha = h->alpha, beta3 = h->beta3;
    if (h->schedule_alpha) alpha = min_nan(n * alpha / h->t_alpha, alpha);
    if (h->schedule_beta3) {
        double log_beta1 = log((double)h->beta1), log_beta3 = log(beta3), fraction = n / h->t_beta3;
        beta3 = min_nan(exp(log_beta1 * log_beta3 / ((1 - fraction) * log_beta3 + fraction * log_beta1)), beta3);
    }
    k->alpha = (float)alpha;
    k->lr_times_wd = h->lr * h->weight_decay;
    k->bias_correction1 = 1.0f - powf(h->beta1, step);
    k->sqrt_bias_correction2 = sqrtf(1.0f - powf(h->beta2, step));
    k->w1 = lerp_weight(h->one_minus_beta1);
    k->w2 = lerp_weight(h->one_minus_beta2);
    k->w3 = lerp_weight((float)(1 - beta3));
}

/* functional.ademamix_step on elements i..n-1: the reference, the vector loop's tail and the whole
 * update elsewhere (compilers vectorize it) */
static inline __attribute__((always_inline)) void ademamix_elements(const ademamix_hyper_t *h, const ademamix_scalars_t *k, int bf16, int64_t i,
                                                                    int64_t n, float *restrict p, const float *restrict g, void *restrict m,
                                                                    void *restrict m_slow, void *restrict v) {
    float lr = h->lr, lr_wd = k->lr_times_wd, eps = h->eps, alpha = k->alpha;
    float bc1 = k->bias_correction1, sbc2 = k->sqrt_bias_correction2, c1 = k->w1.coeff, c2 = k->w2.coeff, c3 = k->w3.coeff, w2 = k->w2.weight;
    int high1 = k->w1.high, high2 = k->w2.high, high3 = k->w3.high;
    uint32_t flip = h->maximize ? 0x80000000u : 0;
    #pragma omp simd
    for (int64_t j = i; j < n; j++) {
        float P = p[j], G = float_of(bits_of(g[j]) ^ flip);
        P = P - lr_wd * P;
        float M = lerp(read_value(m, j, bf16), G, c1, high1);
        float S = lerp(read_value(m_slow, j, bf16), G, c3, high3);
        float V = second_moment(read_value(v, j, bf16), G, c2, high2, w2);
        write_value(m, j, M, bf16);
        write_value(m_slow, j, S, bf16);
        write_value(v, j, V, bf16);
        float denom = sqrtf(V) / sbc2 + eps, update = lr * (M / bc1 + alpha * S) / denom;
        p[j] = P - unless_v_is_zero(update, V);
    }
}

#ifdef VECTOR_LANES
/* ademamix_elements' arithmetic a vector at a time from element 0, dividing by the bias corrections
 * exactly as Adam's vector loop does (adam_vectors): of the scalar loop's three divisions per
 * element one is a real division (two with FAST_DIVIDER, all three there for bf16 states). bf16:
 * the states are bf16, in place. Returns how many elements it stepped. */
static inline __attribute__((always_inline)) int64_t ademamix_vectors(const ademamix_hyper_t *h, const ademamix_scalars_t *k, int bf16, const chunk_t *c) {
    float *p = c->param;
    void *m = c->state[0], *m_slow = c->state[1], *v = c->state[2];
    const float *g = c->grad;
    int high1 = k->w1.high, high2 = k->w2.high, high3 = k->w3.high;
    divisor_t bc1 = exact_divisor(k->bias_correction1), sbc2 = exact_divisor(k->sqrt_bias_correction2);
    int root = root_ready(&sbc2);
    vec_t lr = vec_set1(h->lr), lr_wd = vec_set1(k->lr_times_wd), eps = vec_set1(h->eps), alpha = vec_set1(k->alpha);
    vec_t w_1 = vec_set1(k->w1.coeff), w_2 = vec_set1(k->w2.coeff), w_3 = vec_set1(k->w3.coeff), weight_2 = vec_set1(k->w2.weight);
    uint32_t flip = h->maximize ? 0x80000000u : 0;
    int64_t i = 0;
    for (; i + VECTOR_LANES <= c->n; i += VECTOR_LANES) {
        prefetch_next(c, i);
        vec_t P = vec_load(p + i), G = vec_xor_bits(vec_load(g + i), flip);
        P = vec_sub(P, vec_mul(lr_wd, P));
        vec_t M = vec_lerp(vec_read_value(m, i, bf16), G, w_1, high1);
        vec_t S = vec_lerp(vec_read_value(m_slow, i, bf16), G, w_3, high3);
        vec_t V = vec_second_moment(vec_read_value(v, i, bf16), G, w_2, high2, weight_2);
        vec_write_value(m, i, M, bf16);
        vec_write_value(m_slow, i, S, bf16);
        vec_write_value(v, i, V, bf16);
        vec_t denom = vec_add(divide_root(vec_sqrt(V), &sbc2, root), eps);
        vec_t update = vec_div(vec_mul(lr, vec_add(divide_moment(M, &bc1, bf16), vec_mul(alpha, S))), denom);
        vec_store(p + i, vec_sub(P, vec_unless_v_is_zero(update, V)));
    }
    return i;
}
#endif

static void ademamix_update(const void *hyper, const void *scalars, const chunk_t *c) {
    const ademamix_hyper_t *h = hyper;
    const ademamix_scalars_t *k = scalars;
    int bf16 = c->bf16_states;
    int64_t i = 0;
#ifdef VECTOR_LANES
    i = bf16 ? ademamix_vectors(h, k, 1, c) : ademamix_vectors(h, k, 0, c);
#endif
    if (bf16)
        ademamix_elements(h, k, 1, i, c->n, c->param, c->grad, c->state[0], c->state[1], c->state[2]);
    else
        ademamix_elements(h, k, 0, i, c->n, c->param, c->grad, c->state[0], c->state[1], c->state[2]);
}
