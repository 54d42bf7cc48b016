/* AVX-512: 16 codes of an 8-bit codebook by its affine map (affine_codes.py explains and checks it),
 * with every table in registers: no gather. On an AMD EPYC of family 26 (Zen 5) a 16-lane gather
 * from the 64k-entry table cost 0.33 ns per element, more than the rest of storing a state. The
 * kernel takes it where gathers are slow (SLOW_GATHERS, lookup.h: AMD's cores); Intel's cores, with
 * faster gathers and two ports for AVX-512 arithmetic, keep the measured gather (not re-measured).
 *
 * The lanes the map cannot decide (close to a threshold, near a split, above 1, NaN) come back in
 * *doubtful; the caller takes the table's codes there, of the exact quotient (v may be x times the
 * scale's reciprocal: see affine_codes.py). Stage timings on that EPYC (compute_bound.py, one
 * thread, 8bit): storing a moment 0.445 ns per element with the gather, 0.28 with the map. */
#ifndef AFFINE_SMALLEST
#error "build with -DAFFINE_SMALLEST=<affine_codes.SMALLEST>, as kernel_build.py does"
#endif

#ifdef __AVX512F__
typedef struct {
    __m512 split_low, split_high, slope, offset, low, high, band;
    __m512i level_low_low, level_low_high, zero_code, band_width;
} affine_t;

static inline affine_t affine_registers(const affine_code_t *m) {
    affine_t r;
    r.split_low = _mm512_loadu_ps(m->split), r.split_high = _mm512_loadu_ps(m->split + 16);
    r.level_low_low = _mm512_loadu_si512(m->level_low), r.level_low_high = _mm512_loadu_si512(m->level_low + 16);
    r.slope = _mm512_loadu_ps(m->slope), r.offset = _mm512_loadu_ps(m->offset);
    r.low = _mm512_loadu_ps(m->low), r.high = _mm512_loadu_ps(m->high);
    r.band = _mm512_set1_ps(m->band);
    r.band_width = _mm512_set1_epi32((int32_t)(bits_of(1.0f - m->band) - bits_of(m->band)));
    r.zero_code = _mm512_set1_epi32(m->zero_code);
    return r;
}

/* the lanes more than 3 ulps from the split: a level is that of x's own threshold count unless an
 * ulp or two of error (an inexact quotient; a tie, where a negative value counts a threshold equal to
 * it the other way) can move x across the split */
static inline __mmask16 far_from_split(__m512 x, __m512 split) {
    __m512i apart = _mm512_sub_epi32(_mm512_castps_si512(x), _mm512_castps_si512(split));
    return _mm512_cmpgt_epu32_mask(_mm512_add_epi32(apart, _mm512_set1_epi32(3)), _mm512_set1_epi32(6));
}

static inline __m512i affine_codes16(const affine_t *r, __m512 v, __mmask16 *doubtful) {
    __m512 a = _mm512_abs_ps(v);
    __m512 x = _mm512_max_ps(_mm512_set1_ps(AFFINE_SMALLEST), a);  /* NaN stays: max gives its second operand */
    /* the octave: the permutes read the exponent's low 5 bits, 96 (AFFINE_SMALLEST's) .. 127 -> 0 .. 31 */
    __m512i octave = _mm512_srli_epi32(_mm512_castps_si512(x), 23);
    __m512 split = _mm512_permutex2var_ps(r->split_low, octave, r->split_high);
    __m512i level = _mm512_permutex2var_epi32(r->level_low_low, octave, r->level_low_high);
    level = _mm512_mask_sub_epi32(level, _mm512_cmp_ps_mask(x, split, _CMP_GE_OQ), level, _mm512_set1_epi32(-1));
    __m512 t = _mm512_fmadd_ps(x, _mm512_permutexvar_ps(level, r->slope), _mm512_permutexvar_ps(level, r->offset));
    t = _mm512_min_ps(_mm512_permutexvar_ps(level, r->high), _mm512_max_ps(_mm512_permutexvar_ps(level, r->low), t));  /* NaN stays */
#ifdef __AVX512DQ__
    __m512 fraction = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF);  /* t - floor(t) */
#else
    __m512 fraction = _mm512_sub_ps(t, _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#endif
    /* band <= fraction <= 1 - band as one unsigned comparison of bits (NaN's lie above) */
    __m512i from_band = _mm512_sub_epi32(_mm512_castps_si512(fraction), _mm512_castps_si512(r->band));
    __mmask16 sure = _mm512_mask_cmple_epu32_mask(far_from_split(x, split) & _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_LE_OQ), from_band, r->band_width);
    *doubtful = (__mmask16)~sure;
    /* t >= 1/2 with v's sign, truncated: +-n; then zero_code + n, or zero_code - n but at least 0 */
    __m512i sign = _mm512_set1_epi32(INT32_MIN);
    __m512i count = _mm512_cvttps_epi32(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(sign, _mm512_castps_si512(v), _mm512_castps_si512(t), 0xCA)));
    return _mm512_max_epi32(_mm512_add_epi32(r->zero_code, count), _mm512_setzero_si512());
}
#endif
