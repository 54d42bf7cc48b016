/* The update stage: an optimizer's arithmetic on one chunk of fp32 values, apart from how the
 * values are stored.
 *
 * The driver (scheduler.h) decodes a chunk and calls the optimizer's update with n elements of the
 * parameter, the gradient and each state as fp32 arrays (bf16 parameters and gradients converted,
 * quantized and factored states decoded, fp32 tensors where they lie); the update overwrites the
 * parameter and state arrays with the new values, and the driver converts and encodes them back.
 * An optimizer that declares bf16_in_place gets bf16 states as they lie instead (uint16_t arrays,
 * chunk.bf16_states) when all its states are bf16: converting inside its loop is faster than
 * converting through buffers.
 *
 * Adding an elementwise optimizer (update_adam.h is the example):
 * 1. its hyper-parameters: a FIELDS X-macro and DECLARE_STRUCT (abi.h). Python fills the struct by
 *    field name from the table the library exports (kernel_abi.py): no Python copy of it;
 * 2. its per-step scalars (a struct) and prepare(hyper, step, scalars): once per parameter and step,
 *    after the driver has incremented the step counter (step: its new value, 0 without a counter);
 * 3. update(hyper, scalars, chunk): its functional.py step, the same operations in the same order,
 *    so that it gives the compiled step's bits (the file is built with -ffp-contract=off);
 * 4. a line in OPTIMIZERS (fused_step.c).
 * A loop written with vector intrinsics (vector.h) calls prefetch_next once per vector.
 */

typedef struct {
    int64_t n;
    float *param;            /* read and written */
    const float *grad;
    void *state[MAX_STATES]; /* float arrays, or uint16_t (bf16) where bf16_states; NULL: absent
                              * (an optional state, e.g. amsgrad's, not given) */
    int bf16_states;
    /* the next chunk's parameter and gradient as stored (prefetch_next); NULL: none to fetch */
    const char *next_param, *next_grad;
    int param_bytes, grad_bytes;  /* per element */
} chunk_t;

typedef struct {
    const char *name;
    const char *hyper_struct;  /* the name of its hyper-parameter struct in the ABI table */
    const char *state_names;   /* its states in param_t.state's order, comma-separated (for messages) */
    int required;              /* the first `required` of them must be given; the others are optional */
    int bf16_in_place;
    size_t scalars_size;
    void (*prepare)(const void *hyper, float step, void *scalars);
    void (*update)(const void *hyper, const void *scalars, const chunk_t *chunk);
} optimizer_t;

/* ---- helpers for update functions --------------------------------------------------------------- */

/* In a hand-written vector loop, once per vector starting at element i: requests the next chunk's
 * parameter and gradient at i, every 16 elements (a cache line of fp32; bf16 lines are asked for
 * twice; a bf16 parameter's int8-correction not at all). Why: scheduler.h, step_chunk. */
static inline void prefetch_next(const chunk_t *c, int64_t i) {
    if (c->next_param && (i & 15) == 0) {
        __builtin_prefetch(c->next_param + i * c->param_bytes, 1);
        __builtin_prefetch(c->next_grad + i * c->grad_bytes, 0);
    }
}

/* torch.lerp as torch.compile lowers it: start + w * (end - start) for |w| < 0.5, else
 * end - (1 - w) * (end - start); the multiplication by 1.0 it leaves in is exact and dropped.
 * A lerp_weight_t holds coeff = w, or -(1 - w) where high. */
typedef struct {
    float coeff;
    int high;
    float weight;  /* w itself */
} lerp_weight_t;

static inline lerp_weight_t lerp_weight(float w) {
    lerp_weight_t l = {w, fabsf(w) >= 0.5f, w};
    if (l.high) l.coeff = -(1.0f - w);
    return l;
}

static inline float lerp(float start, float end, float coeff, int high) {
    return (high ? end : start) + coeff * (end - start);
}

/* Adam's and AdEMAMix's second moment, lerp(v, g * g, w); where g * g overflows and g is finite,
 * (v - w v) + (w g) g, which keeps a gradient spike up to ~5.8e20 finite (functional._second_moment) */
static inline float second_moment(float v, float g, float coeff, int high, float w) {
    float square = g * g, lerped = lerp(v, square, coeff, high), spike = (v - w * v) + (w * g) * g;
    uint32_t overflow = 0u - (uint32_t)((square == INFINITY) & (fabsf(g) != INFINITY));  /* a mask, not a branch: the loop vectorizes */
    return float_of((bits_of(spike) & overflow) | (bits_of(lerped) & ~overflow));
}

/* Adam's and AdEMAMix's update, but none where the second moment v is 0 (functional.adam_step):
 * a mask, not a branch around the division, which would keep the loop scalar */
static inline float unless_v_is_zero(float update, float v) {
    return float_of(bits_of(update) & (0u - (uint32_t)(v != 0.0f)));
}

#ifdef VECTOR_LANES
static inline vec_t vec_lerp(vec_t start, vec_t end, vec_t coeff, int high) {  /* lerp, a vector at a time */
    return vec_add(high ? end : start, vec_mul(coeff, vec_sub(end, start)));
}

/* second_moment, a vector at a time; a spike is rare, so a branch around its arithmetic */
static inline vec_t vec_second_moment(vec_t v, vec_t g, vec_t coeff, int high, vec_t w) {
    vec_t square = vec_mul(g, g), lerped = vec_lerp(v, square, coeff, high);
    mask_t overflow = vec_equal(square, vec_set1(INFINITY));
    if (__builtin_expect(mask_any(overflow), 0)) {
        vec_t spike = vec_add(vec_sub(v, vec_mul(w, v)), vec_mul(vec_mul(w, g), g));
        lerped = vec_select(mask_and_not(overflow, vec_zero_or_not_finite(g)), spike, lerped);
    }
    return lerped;
}

/* a first moment divided by its bias correction (exactly: divide.h) in a vector update; bf16 states'
 * conversions keep the vector ports busy, so there the divider takes it where it is fast */
static inline vec_t divide_moment(vec_t m, const divisor_t *bias_correction, int bf16) {
    return bf16 ? divide_ports_busy(m, bias_correction) : divide(m, bias_correction);
}

static inline vec_t vec_unless_v_is_zero(vec_t update, vec_t v) {  /* unless_v_is_zero, a vector at a time */
    vec_t zero = vec_set1(0.0f);
    return vec_select(vec_equal(v, zero), zero, update);
}
#endif

/* an operand of the update: fp32 values, or bf16 values (bf16 states, read and written in place) */
static inline float read_value(const void *x, int64_t j, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[j]) : ((const float *)x)[j];
}

static inline void write_value(void *x, int64_t j, float value, int bf16) {
    if (bf16)
        ((uint16_t *)x)[j] = f32_to_bf16(value);
    else
        ((float *)x)[j] = value;
}

#ifdef VECTOR_LANES  /* the same, a vector at a time from element j */
static inline vec_t vec_read_value(const void *x, int64_t j, int bf16) {
    return bf16 ? vec_load_bf16((const uint16_t *)x + j) : vec_load((const float *)x + j);
}

static inline void vec_write_value(void *x, int64_t j, vec_t value, int bf16) {
    if (bf16)
        vec_store_bf16((uint16_t *)x + j, value);
    else
        vec_store((float *)x + j, value);
}
#endif
