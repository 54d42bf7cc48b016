/* Exact division by a shared divisor (the AVX-512 and AVX2 + FMA builds: vector.h).
 *
 * Every element of a block is divided by the block's scale, every first moment by the step's bias
 * correction. With y = RN(1 / b), q = RN(a * y) is within an ulp of a / b and the FMA correction
 * q + (a - q * b) * y rounds to exactly RN(a / b) (Markstein's theorem), provided the residual
 * a - q * b is exact: a and q normal and well inside the exponent range. Lanes outside that range
 * (tiny, huge, non-finite) take a real division; +-0 comes out of the correction exact.
 *
 * It pays where the divider is the bottleneck (Adam's update: a square root and three divisions per
 * element), not where other work is (encoding: there the AVX2 build divides, measured faster, and
 * so does the AVX-512 build where the divider is fast, divide_ports_busy).
 *
 * Where the divider is fast (FAST_DIVIDER), the update's sqrt(v) / sqrt(bias correction) is a real
 * division instead: the divider then takes a square root and two divisions per element while the
 * vector ports correct the first moment's quotient, and neither waits on the other (fp32 states;
 * bf16 states, whose conversions keep the ports busy, divide the first moment too: divide_ports_busy). On an AMD EPYC
 * of family 26 (Zen 5), one thread, Adam's update of a chunk in L1 (compute_bound.py part 5): AVX2
 * build 0.50 -> 0.41 ns per element, AVX-512 0.285 -> 0.26. kernel_build.tuning() sets it for that
 * family only, where it was measured; an Emerald Rapids Xeon's divider is slower (0.215 ns per
 * division per element, README) and keeps the corrected quotient. The tests build both; either way
 * the quotient is the correctly rounded one. */
#ifndef FAST_DIVIDER
#define FAST_DIVIDER 0
#endif

#ifdef VECTOR_LANES
#include <float.h>

typedef struct {
    float b, y;
    uint32_t lo, span;  /* the FMA path serves |a| whose bits lie in [lo, lo + span) */
} divisor_t;

static divisor_t exact_divisor(float b) {
    divisor_t d = {b, 1.0f / b, 0, 0};
    if (b > 0 && d.y >= FLT_MIN && d.y <= 0x1p126f) {
        /* |a| >= 2**-96 keeps the residual normal; |q| within about 2**-99 .. 2**99 (b ~ 1 / y) keeps
         * q * b normal (the bounds need to be safe, not sharp) */
        float lo = 0x1p-99f * b, hi = 0x1p99f * b;  /* comparisons, not libm's fmaxf and fminf (b is finite) */
        lo = lo > 0x1p-96f ? lo : 0x1p-96f;
        hi = hi < FLT_MAX ? hi : FLT_MAX;
        if (lo <= hi) {
            d.lo = bits_of(lo);
            d.span = bits_of(hi) - d.lo + 1;
        }
    }
    return d;
}

/* q = a * y and its FMA correction q - (q * b - a) * y, the quotient wherever a is in the divisor's
 * range, and for a = +-0 (the negated residual is +0, and q - +0 keeps q's sign) */
static inline vec_t corrected_quotient(vec_t a, const divisor_t *d, vec_t *q) {
    vec_t y = vec_set1(d->y);
    *q = vec_mul(a, y);
    return vec_fnmadd(vec_fmsub(*q, vec_set1(d->b), a), y, *q);
}

static inline vec_t divide(vec_t a, const divisor_t *d) {
    vec_t b = vec_set1(d->b), q;
    if (d->span == 0) return vec_div(a, b);  /* no reciprocal to use (b <= 0, tiny, huge, NaN) */
    vec_t corrected = corrected_quotient(a, d, &q);
    mask_t rest = mask_and_not(vec_nonzero(a), vec_magnitude_within(a, d->lo, d->span));
    return mask_any(rest) ? vec_select(rest, vec_div(a, b), corrected) : corrected;
}

/* divide() in a loop that the vector ports bound, not the divider: encoding (every value of a block by
 * its scale) and an update that converts bf16 states in registers. A real division where the
 * divider is fast (FAST_DIVIDER), else the corrected quotient. On the AMD EPYC of family 26, one
 * thread: storing a 4bit moment 0.53 -> 0.47 ns per value; Adam's bf16 step in cache, AVX2 build
 * 0.59-0.61 -> 0.50-0.51 ns per element, AVX-512 0.32-0.33 -> 0.27 (fp32 states, which leave the
 * ports idle, keep the corrected quotient). */
static inline vec_t divide_ports_busy(vec_t a, const divisor_t *d) { return FAST_DIVIDER ? vec_div(a, vec_set1(d->b)) : divide(a, d); }

/* An encoding loop's quotients x[i .. i + VECTOR_LANES) / b for i = 0, VECTOR_LANES, ... over a block
 * of n values, each divided one vector ahead of its use. The work on a vector is a chain of
 * dependent instructions from its quotient; with the divider's latency (about 11 cycles) at the head
 * of every chain, fewer vectors fit in the core's schedulers at once. The AVX2 build divides for
 * real (measured faster there than the corrected quotient, the encoding keeping the ports busy), the
 * AVX-512 build as divide_ports_busy. On the AMD EPYC of family 26, one thread, a chunk in L1, ns per
 * value (compute_bound.py part 5): storing a 4bit moment, AVX2 build 0.76-0.77 -> 0.67-0.69 (NF4) and
 * 0.54-0.56 -> 0.52 (linear), AVX-512 0.35-0.36 -> 0.32-0.33; an fp8 one (AVX2) 0.29 -> 0.27. Two
 * vectors ahead was no faster (AVX2, 4bit), nor were the compiler-vectorized block-float encoders
 * with their quotients in a pass of their own (10bit-sr, 8bit-log: block_float.h). */
typedef struct {
    divisor_t d;
    vec_t ahead;
} quotients_t;

static inline vec_t encoding_quotient(vec_t a, const divisor_t *d) {
#ifdef AVX2_ONLY
    return vec_div(a, vec_set1(d->b));
#else
    return divide_ports_busy(a, d);
#endif
}

/* n: the values the loop will take (0: none, nothing divided) */
static inline quotients_t encoding_quotients(const float *x, int64_t n, divisor_t d) {
    quotients_t q = {d, vec_set1(0.0f)};
    if (n >= VECTOR_LANES) q.ahead = encoding_quotient(vec_load(x), &q.d);
    return q;
}

/* the quotient of the loop's next vector, x[i .. i + VECTOR_LANES) (i: 0, VECTOR_LANES, ..., each
 * taken once and in order) */
static inline vec_t next_quotient(quotients_t *q, const float *x, int64_t i, int64_t n) {
    vec_t v = q->ahead;
    if (i + 2 * VECTOR_LANES <= n) q->ahead = encoding_quotient(vec_load(x + i + VECTOR_LANES), &q->d);
    return v;
}

/* divide() for a = sqrt(v): a is NaN, +-0, +inf or in [2**-75, 2**64), so when that whole range
 * suits the divisor (root_ready), only a's special values need a lane check: they come out exact
 * as a * y. */
static inline int root_ready(const divisor_t *d) {
    return d->span != 0 && d->lo <= bits_of(0x1p-75f) && bits_of(0x1p64f) - d->lo < d->span;
}

static inline vec_t divide_root(vec_t a, const divisor_t *d, int ready) {
    if (FAST_DIVIDER) return divide_ports_busy(a, d);  /* a real division */
    if (!ready) return divide(a, d);
    vec_t q, corrected = corrected_quotient(a, d, &q);
    return vec_select(vec_zero_or_not_finite(a), q, corrected);
}
#endif
