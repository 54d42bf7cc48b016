/* Exact division by a shared divisor (AVX-512 only).
 *
 * Every element of a block is divided by the block's scale, every first moment by the step's bias
 * correction. With y = RN(1 / b), q = RN(a * y) is within an ulp of a / b and the FMA correction
 * q + (a - q * b) * y rounds to exactly RN(a / b) (Markstein's theorem), provided the residual
 * a - q * b is exact: a and q normal and well inside the exponent range. Lanes outside that range
 * (tiny, huge, non-finite) take a real division; zero is exact as a * y. The other paths divide
 * (with AVX2, 8-lane divisions measured faster than the corrected products). */
#ifdef __AVX512F__
#include <float.h>
#include <immintrin.h>

typedef struct {
    float b, y;
    uint32_t lo, span;  /* the FMA path serves |a| whose bits lie in [lo, lo + span) */
} divisor_t;

static divisor_t exact_divisor(float b) {
    divisor_t d = {b, 1.0f / b, 0, 0};
    if (b > 0 && d.y >= FLT_MIN && d.y <= 0x1p126f) {
        /* |a| >= 2**-96 keeps the residual normal; |q| within about 2**-99 .. 2**99 (b ~ 1 / y) keeps
         * q * b normal (the bounds need to be safe, not sharp) */
        float lo = fmaxf(0x1p-96f, 0x1p-99f * b), hi = fminf(0x1p99f * b, FLT_MAX);
        if (lo <= hi) {
            d.lo = bits_of(lo);
            d.span = bits_of(hi) - d.lo + 1;
        }
    }
    return d;
}

/* q = a * y and its FMA correction, the quotient wherever a is in the divisor's range */
static inline __m512 corrected_quotient(__m512 a, const divisor_t *d, __m512 *q) {
    __m512 y = _mm512_set1_ps(d->y);
    *q = _mm512_mul_ps(a, y);
    return _mm512_fmadd_ps(_mm512_fnmadd_ps(*q, _mm512_set1_ps(d->b), a), y, *q);
}

static inline __m512 divide(__m512 a, const divisor_t *d) {
    __m512 b = _mm512_set1_ps(d->b), q;
    if (d->span == 0) return _mm512_div_ps(a, b);  /* no reciprocal to use (b <= 0, tiny, huge, NaN) */
    __m512 corrected = corrected_quotient(a, d, &q);
    __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7FFFFFFF));
    __mmask16 in_range = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(magnitude, _mm512_set1_epi32((int32_t)d->lo)), _mm512_set1_epi32((int32_t)d->span));
    __mmask16 rest = (__mmask16)(~in_range & _mm512_test_epi32_mask(magnitude, magnitude));
    __m512 out = _mm512_mask_blend_ps(in_range, q, corrected);
    return rest ? _mm512_mask_div_ps(out, rest, a, b) : out;
}

/* divide() for a = sqrt(v): a is NaN, +-0, +inf or in [2**-75, 2**64), so when that whole range
 * suits the divisor (root_ready), only a's special values need a lane check: they come out exact
 * as a * y. */
static inline int root_ready(const divisor_t *d) {
    return d->span != 0 && d->lo <= bits_of(0x1p-75f) && bits_of(0x1p64f) - d->lo < d->span;
}

static inline __m512 divide_root(__m512 a, const divisor_t *d, int ready) {
#ifdef __AVX512DQ__
    if (ready) {
        __m512 q, corrected = corrected_quotient(a, d, &q);
        return _mm512_mask_mov_ps(corrected, _mm512_fpclass_ps_mask(a, 0x9F), q);  /* NaN, zeros, infinities */
    }
#endif
    (void)ready;
    return divide(a, d);
}
#endif
