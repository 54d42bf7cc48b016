/* Adam and AdamW (functional.adam_step): states exp_avg, exp_avg_sq and, with amsgrad,
 * max_exp_avg_sq (state 2: present exactly when amsgrad is on). */

#define ADAM_HYPER_FIELDS(FIELD, ARRAY, S)                                                       \
    FIELD(S, float, lr)                                                                          \
    FIELD(S, float, beta1)                                                                       \
    FIELD(S, float, beta2)                                                                       \
    FIELD(S, float, weight_decay)                                                                \
    FIELD(S, float, eps)                                                                         \
    FIELD(S, float, one_minus_beta1)  /* computed in float64 and rounded once, as torch.optim */ \
    FIELD(S, float, one_minus_beta2)                                                             \
    FIELD(S, int32_t, decoupled_weight_decay)                                                    \
    FIELD(S, int32_t, maximize)
DECLARE_STRUCT(adam_hyper_t, ADAM_HYPER_FIELDS)

typedef struct {
    float lr_times_wd, bias_correction1, sqrt_bias_correction2;
    lerp_weight_t w1, w2;  /* the moments' lerp weights */
} adam_scalars_t;

static void adam_prepare(const void *hyper, float step, void *scalars) {
    const adam_hyper_t *h = hyper;
    adam_scalars_t *k = scalars;
    k->lr_times_wd = h->lr * h->weight_decay;
    k->bias_correction1 = 1.0f - powf(h->beta1, step);
    k->sqrt_bias_correction2 = sqrtf(1.0f - powf(h->beta2, step));
    k->w1 = lerp_weight(h->one_minus_beta1);
    k->w2 = lerp_weight(h->one_minus_beta2);
}

/* functional.adam_step on elements i..n-1: the reference, the AVX-512 loop's tail and the whole
 * update elsewhere, written so that compilers vectorize it. decoupled, amsgrad and bf16 (the states
 * are bf16) are constants in each inlined copy (a branch around arithmetic would keep the loop
 * scalar); maximize is a sign flip. */
static inline __attribute__((always_inline)) void adam_elements(const adam_hyper_t *h, const adam_scalars_t *k, int decoupled, int amsgrad, int bf16,
                                                                int64_t i, int64_t n, float *restrict p, const float *restrict g,
                                                                void *restrict m, void *restrict v, void *restrict vmax) {
    /* in locals: stores to the arrays cannot change them */
    float lr = h->lr, lr_wd = k->lr_times_wd, wd = h->weight_decay, eps = h->eps;
    float bc1 = k->bias_correction1, sbc2 = k->sqrt_bias_correction2, c1 = k->w1.coeff, c2 = k->w2.coeff, w2 = k->w2.weight;
    int high1 = k->w1.high, high2 = k->w2.high;
    uint32_t flip = h->maximize ? 0x80000000u : 0;
    #pragma omp simd
    for (int64_t j = i; j < n; j++) {
        float P = p[j], G = float_of(bits_of(g[j]) ^ flip);
        if (decoupled)
            P = P - lr_wd * P;
        else
            G = G + wd * P;
        float M = lerp(read_value(m, j, bf16), G, c1, high1), V = second_moment(read_value(v, j, bf16), G, c2, high2, w2);
        write_value(m, j, M, bf16);
        write_value(v, j, V, bf16);
        if (amsgrad) {  /* torch.maximum: NaN propagates, else std::max(vmax, v) */
            float old = read_value(vmax, j, bf16);
            V = (old != old || V != V) ? NAN : (old < V ? V : old);
            write_value(vmax, j, V, bf16);
        }
        float denom = sqrtf(V) / sbc2 + eps, update = lr * (M / bc1) / denom;
        p[j] = P - unless_v_is_zero(update, V);
    }
}

static void adam_rest(const adam_hyper_t *h, const adam_scalars_t *k, int amsgrad, int bf16, int64_t i, const chunk_t *c) {
    int64_t n = c->n;
    float *p = c->param;
    const float *g = c->grad;
    void *m = c->state[0], *v = c->state[1], *vmax = c->state[2];
    switch (h->decoupled_weight_decay << 2 | amsgrad << 1 | bf16) {  /* a copy of the loop for each */
        case 0: adam_elements(h, k, 0, 0, 0, i, n, p, g, m, v, vmax); break;
        case 1: adam_elements(h, k, 0, 0, 1, i, n, p, g, m, v, vmax); break;
        case 2: adam_elements(h, k, 0, 1, 0, i, n, p, g, m, v, vmax); break;
        case 3: adam_elements(h, k, 0, 1, 1, i, n, p, g, m, v, vmax); break;
        case 4: adam_elements(h, k, 1, 0, 0, i, n, p, g, m, v, vmax); break;
        case 5: adam_elements(h, k, 1, 0, 1, i, n, p, g, m, v, vmax); break;
        case 6: adam_elements(h, k, 1, 1, 0, i, n, p, g, m, v, vmax); break;
        default: adam_elements(h, k, 1, 1, 1, i, n, p, g, m, v, vmax); break;
    }
}

#ifdef VECTOR_LANES
/* adam_elements' arithmetic a vector at a time from element 0, dividing by the bias corrections
 * exactly (divide.h): the scalar loop divides three times per element, and the divider is what
 * bounds it. bf16: the states are bf16, read and written in place (a constant in each inlined copy).
 * Returns how many elements it stepped. */
static inline __attribute__((always_inline)) int64_t adam_vectors(const adam_hyper_t *h, const adam_scalars_t *k, int amsgrad, int bf16, const chunk_t *c) {
    float *p = c->param;
    void *m = c->state[0], *v = c->state[1], *vmax = c->state[2];
    const float *g = c->grad;
    lerp_weight_t w1 = k->w1, w2 = k->w2;
    int high1 = w1.high, high2 = w2.high;
    divisor_t bc1 = exact_divisor(k->bias_correction1), sbc2 = exact_divisor(k->sqrt_bias_correction2);
    int root = root_ready(&sbc2);
    vec_t lr = vec_set1(h->lr), lr_wd = vec_set1(k->lr_times_wd), wd = vec_set1(h->weight_decay);
    vec_t eps = vec_set1(h->eps), w_1 = vec_set1(w1.coeff), w_2 = vec_set1(w2.coeff), weight_2 = vec_set1(w2.weight), nan = vec_set1(NAN);
    uint32_t flip = h->maximize ? 0x80000000u : 0;
    int64_t i = 0;
    for (; i + VECTOR_LANES <= c->n; i += VECTOR_LANES) {
        prefetch_next(c, i);
        vec_t P = vec_load(p + i), G = vec_xor_bits(vec_load(g + i), flip);
        if (h->decoupled_weight_decay)
            P = vec_sub(P, vec_mul(lr_wd, P));
        else
            G = vec_add(G, vec_mul(wd, P));
        vec_t M = vec_lerp(vec_read_value(m, i, bf16), G, w_1, high1);
        vec_t V = vec_second_moment(vec_read_value(v, i, bf16), G, w_2, high2, weight_2);
        vec_write_value(m, i, M, bf16);
        vec_write_value(v, i, V, bf16);
        if (amsgrad) {  /* torch.maximum, as in adam_elements */
            vec_t old = vec_read_value(vmax, i, bf16);
            V = vec_select(vec_unordered(old, V), nan, vec_select(vec_less(old, V), V, old));
            vec_write_value(vmax, i, V, bf16);
        }
        vec_t denom = vec_add(divide_root(vec_sqrt(V), &sbc2, root), eps);
        vec_t update = vec_div(vec_mul(lr, divide_moment(M, &bc1, bf16)), denom);
        vec_store(p + i, vec_sub(P, vec_unless_v_is_zero(update, V)));
    }
    return i;
}
#endif

static void adam_update(const void *hyper, const void *scalars, const chunk_t *c) {
    const adam_hyper_t *h = hyper;
    const adam_scalars_t *k = scalars;
    int amsgrad = c->state[2] != NULL, bf16 = c->bf16_states;
    int64_t i = 0;
#ifdef VECTOR_LANES
    i = bf16 ? adam_vectors(h, k, amsgrad, 1, c) : adam_vectors(h, k, amsgrad, 0, c);
#endif
    adam_rest(h, k, amsgrad, bf16, i, c);
}
