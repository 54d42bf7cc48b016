/* SGD (functional.sgd_step): with momentum, state momentum_buffer (state 0) and a step counter;
 * without, neither (state 0 absent, step 0): the update is then p - lr * (g + weight_decay * p). */

#define SGD_HYPER_FIELDS(FIELD, ARRAY, S)                                                              \
    FIELD(S, float, lr)                                                                                \
    FIELD(S, float, momentum)                                                                          \
    FIELD(S, float, weight_decay)                                                                      \
    FIELD(S, float, one_minus_dampening)  /* computed in float64 and rounded once, as the compiled step */ \
    FIELD(S, int32_t, nesterov)                                                                        \
    FIELD(S, int32_t, maximize)
DECLARE_STRUCT(sgd_hyper_t, SGD_HYPER_FIELDS)

typedef struct {
    int first;  /* the first step with a buffer: it stores the gradient itself (torch.where(step == 1, ...)) */
} sgd_scalars_t;

static void sgd_prepare(const void *hyper, float step, void *scalars) {
    (void)hyper;
    ((sgd_scalars_t *)scalars)->first = step == 1.0f;
}

/* functional.sgd_step on elements 0..n-1; buffered, nesterov and bf16 are constants in each copy */
static inline __attribute__((always_inline)) void sgd_elements(const sgd_hyper_t *h, int first, int buffered, int nesterov, int bf16, int64_t n,
                                                               float *restrict p, const float *restrict g, void *restrict buf) {
    float lr = h->lr, momentum = h->momentum, wd = h->weight_decay, omd = h->one_minus_dampening;
    uint32_t flip = h->maximize ? 0x80000000u : 0;
    #pragma omp simd
    for (int64_t j = 0; j < n; j++) {
        float P = p[j], G = float_of(bits_of(g[j]) ^ flip);
        G = G + wd * P;
        if (buffered) {
            float later = read_value(buf, j, bf16) * momentum + omd * G;  /* computed either way, as torch.where */
            float B = first ? G : later;
            write_value(buf, j, B, bf16);
            G = nesterov ? G + momentum * B : B;
        }
        p[j] = P - lr * G;
    }
}

#ifdef VECTOR_LANES
/* sgd_elements with a bf16 buffer, a vector at a time from element 0 (the same operations), its
 * conversions in registers (vector.h): the compiler's vectorization of the portable loop made the
 * AVX2 build's bf16 step twice its fp32 one. AMD EPYC of family 26, one thread, in cache: AVX2
 * 0.30 -> 0.22 ns per element (fp32 0.145), AVX-512 0.147 -> 0.136. No prefetch_next: a bf16
 * buffer is stepped in place, so the chunk has nothing decoded and no next chunk to fetch.
 * Returns how many elements it stepped. */
static inline __attribute__((always_inline)) int64_t sgd_bf16_vectors(const sgd_hyper_t *h, int first, int nesterov, int64_t n, float *restrict p,
                                                                      const float *restrict g, uint16_t *restrict buf) {
    vec_t lr = vec_set1(h->lr), momentum = vec_set1(h->momentum), wd = vec_set1(h->weight_decay), omd = vec_set1(h->one_minus_dampening);
    uint32_t flip = h->maximize ? 0x80000000u : 0;
    int64_t i = 0;
    for (; i + VECTOR_LANES <= n; i += VECTOR_LANES) {
        vec_t P = vec_load(p + i), G = vec_xor_bits(vec_load(g + i), flip);
        G = vec_add(G, vec_mul(wd, P));
        vec_t B = first ? G : vec_add(vec_mul(vec_load_bf16(buf + i), momentum), vec_mul(omd, G));
        vec_store_bf16(buf + i, B);
        G = nesterov ? vec_add(G, vec_mul(momentum, B)) : B;
        vec_store(p + i, vec_sub(P, vec_mul(lr, G)));
    }
    return i;
}
#endif

static void sgd_update(const void *hyper, const void *scalars, const chunk_t *c) {
    const sgd_hyper_t *h = hyper;
    int first = ((const sgd_scalars_t *)scalars)->first, buffered = c->state[0] != NULL, nesterov = h->nesterov != 0;
    float *p = c->param;
    const float *g = c->grad;
    void *buf = c->state[0];
    int64_t i = 0;
#ifdef VECTOR_LANES
    if (buffered && c->bf16_states) i = nesterov ? sgd_bf16_vectors(h, first, 1, c->n, p, g, buf) : sgd_bf16_vectors(h, first, 0, c->n, p, g, buf);
#endif
    p += i, g += i;
    if (i) buf = (uint16_t *)buf + i;  /* only a bf16 buffer is stepped by vectors */
    switch (buffered << 2 | nesterov << 1 | c->bf16_states) {
        case 0: case 1: case 2: case 3: sgd_elements(h, first, 0, 0, 0, c->n - i, p, g, buf); break;
        case 4: sgd_elements(h, first, 1, 0, 0, c->n - i, p, g, buf); break;
        case 5: sgd_elements(h, first, 1, 0, 1, c->n - i, p, g, buf); break;
        case 6: sgd_elements(h, first, 1, 1, 0, c->n - i, p, g, buf); break;
        default: sgd_elements(h, first, 1, 1, 1, c->n - i, p, g, buf); break;
    }
}
