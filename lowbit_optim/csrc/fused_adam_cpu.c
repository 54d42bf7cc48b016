/* One fused pass of Adam / AdamW over many parameters on the CPU: dequantize -> update -> quantize.
 *
 * Work is split into chunks of a few blocks; a thread decodes a chunk's states into small fp32
 * buffers that stay in L1, updates them and the parameter, and re-encodes them, so every byte of
 * state is read once and written once. The arithmetic is that of functional.adam_step as
 * torch.compile lowers it (same operations, same order, no contraction into FMAs: compile with
 * -ffp-contract=off), so this kernel and the compiled step produce the same bits.
 *
 * Speed comes from doing that arithmetic with fewer slow instructions, never from changing it:
 * fp32 parameters, gradients and states are worked on where they lie (no copies), bf16 states too
 * (converted in the update loop); the update is one vector loop; with AVX-512, a division by a
 * number shared by a block or a step (a scale, a bias correction) is a multiplication by its
 * reciprocal plus one FMA correction, which gives the correctly rounded quotient (exact_divisor
 * below); 8-bit codes decode without gathers (byte lookups, with AVX-512 VBMI) and encode with one
 * gather from a table small enough for L1.
 *
 * Three paths, one set of numbers: AVX-512 intrinsics; AVX2 intrinsics (8 lanes) for what needs
 * table lookups (decoding, encoding), which compilers do not vectorize; and portable loops, the
 * reference, which compilers vectorize for whatever they target (the update, block absmax, fp8
 * encoding, bf16 conversion) and which serve as the other paths' tails. In those, a select
 * is written as a mask or a value choice, never as a branch around arithmetic: GCC will not
 * if-convert a branch around an operation that may trap, and the loop then stays scalar.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
#define AVX2_ONLY 1
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_CODEBOOK = 2, KIND_E4M3 = 3, KIND_FACTORED = 4 };

typedef struct {
    int32_t kind;
    int32_t bits;              /* 8, or 4: two codes per byte, element 2i in the high nibble */
    int64_t block_size;        /* quantized kinds: elements per scale */
    float scale_max;           /* a block's absmax maps to this code value */
    void *data;                /* values (plain kinds) or codes */
    float *scale;              /* one per block (quantized kinds) */
    const float *codebook;     /* KIND_CODEBOOK: value of each code */
    const int32_t *base_code;  /* KIND_CODEBOOK: nearest-code tables indexed by the top 16 bits */
    const float *threshold;
    const float *thresholds;   /* KIND_CODEBOOK: the sorted decision thresholds, NaN-padded to 2**bits */
    int32_t nan_code;          /* the code the tables give NaN and infinities */
    const int32_t *near_code;  /* KIND_CODEBOOK, 8 bits: both tables packed (fused_cpu._near_code_table) */
    const uint8_t *value_bytes;  /* KIND_CODEBOOK, 8 bits: byte k of code c's value at [256 * k + c] */
    int32_t calibrated;        /* scale *= <x, x> / <x, Q(x)> (quant.calibrated_scale) */
    /* KIND_FACTORED (factored.py): data holds the row sums of the (numel / cols) x cols matrix */
    float *col;                /* its column sums */
    int64_t cols;
    float *col_scaled;         /* filled for one step: col / total, a value is row * col_scaled + zero */
    float zero;                /* total - total: 0, or NaN when the sums are not finite */
    double *col_sums;          /* filled for one step: each task's sums of the new columns */
} state_t;

typedef struct {
    int64_t numel;
    int32_t param_kind;        /* KIND_F32 or KIND_BF16 (rounded to nearest) */
    int32_t grad_kind;
    void *param;
    const void *grad;
    float *step;
    state_t exp_avg, exp_avg_sq, max_exp_avg_sq;
} param_t;

typedef struct {
    float lr, beta1, beta2, weight_decay, eps, one_minus_beta1, one_minus_beta2;
    int32_t decoupled_weight_decay, maximize, amsgrad;
} hyper_t;

#define MIN_BLOCK_SCALE 1e-12f
#define MAX_CHUNK 8192

static inline uint32_t bits_of(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float float_of(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static inline float bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float x) {  /* round to nearest even; NaN stays a quiet NaN */
    uint32_t u = bits_of(x);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = 0u - (x != x);  /* a mask, not a branch (see the top) */
    return (uint16_t)((rounded & ~nan) | (0x7FC0u & nan));
}

static inline float e4m3_to_f32(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80) << 24, exponent = (c >> 3) & 15, mantissa = c & 7;
    float magnitude = exponent ? float_of(((exponent + 120) << 23) | (mantissa << 20)) : (float)mantissa * 0.001953125f;
    if ((c & 0x7F) == 0x7F) magnitude = NAN;
    return float_of(bits_of(magnitude) | sign);
}

static inline uint8_t f32_to_e4m3(float x) {  /* round to nearest even; what rounds above 448 -> NaN, as torch */
    uint32_t u = bits_of(x), sign = (u >> 24) & 0x80;
    uint32_t a = u & 0x7FFFFFFFu;
    /* both cases computed, one selected by a mask (see the top) */
    uint32_t normal = (a + 0x7FFFFu + ((a >> 20) & 1u) - (120u << 23)) >> 20;
    normal = normal < 0x7Fu ? normal : 0x7Fu;  /* what rounds to 0x7F or above (480 and up, inf, NaN): 0x7F */
    /* below 2**-6 (subnormal, steps of 2**-9): adding 2**14, whose fp32 ulp is 2**-9, rounds to that
     * grid (to nearest even) and leaves the multiple of 2**-9 in the low mantissa bits */
    uint32_t subnormal = bits_of(float_of(a) + 16384.0f) - bits_of(16384.0f);
    uint32_t below = 0u - (a < 0x3C800000u);
    return (uint8_t)(((subnormal & below) | (normal & ~below)) | sign);
}

/* ---- exact division by a shared divisor -------------------------------------------------------
 * Every element of a block is divided by the block's scale, every first moment by the step's bias
 * correction. With y = RN(1 / b), q = RN(a * y) is within an ulp of a / b and the FMA correction
 * q + (a - q * b) * y rounds to exactly RN(a / b) (Markstein's theorem), provided the residual
 * a - q * b is exact: a and q normal and well inside the exponent range. Lanes outside that range
 * (tiny, huge, non-finite) take a real division; zero is exact as a * y. AVX-512 only: the other
 * paths divide (with AVX2, 8-lane divisions measured faster than the corrected products). */
#ifdef __AVX512F__
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

/* ---- the hot loops over one block: decode, absmax, encode ---------------------------------------
 * With AVX-512 (the library is built with -march=native) they are written with intrinsics: the
 * compiler does not vectorize table gathers indexed by bytes. With AVX2 only, decoding and encoding
 * are intrinsics too: the same loops with 8 lanes, dividing. The portable loops are the reference,
 * the tails and everything elsewhere; all compute exactly the same values. */

#ifdef AVX2_ONLY
/* table[idx] for a 16-entry table held in two registers (idx in 0..15) */
static inline __m256 lookup16(__m256 low, __m256 high, __m256i idx) {
    __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  /* bit 3 on top: blendv's selector */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, idx), _mm256_permutevar8x32_ps(high, idx), upper);
}

/* the low bytes of 8 int32 lanes, stored as 8 bytes */
static inline void store_low_bytes(uint8_t *dst, __m256i x) {
    __m256i bytes = _mm256_shuffle_epi8(x, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                              0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    __m256i packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i *)dst, _mm256_castsi256_si128(packed));
}
#endif

static float e4m3_values[256];  /* KIND_E4M3 decodes through this table like a codebook */
static uint8_t e4m3_value_bytes[4 * 256];

__attribute__((constructor)) static void fill_e4m3_values(void) {
    for (int c = 0; c < 256; c++) {
        e4m3_values[c] = e4m3_to_f32((uint8_t)c);
        for (int k = 0; k < 4; k++) e4m3_value_bytes[256 * k + c] = (uint8_t)(bits_of(e4m3_values[c]) >> (8 * k));
    }
}

/* out[i] = codebook[code i] * scale for the m codes starting at element 0 of a block; value_bytes
 * (8-bit codes) holds the codebook's values byte by byte */
static void decode_block(const uint8_t *c, int bits, const float *codebook, const uint8_t *value_bytes, float scale, int64_t m, float *out) {
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 s = _mm512_set1_ps(scale);
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    if (bits == 8) {
        /* No gathers: byte k of 64 values at once is a 256-entry byte lookup (two vpermi2b and a
         * blend on the code's top bit); interleaving the four bytes makes the floats. The codes are
         * first transposed in 4-byte groups so that the interleave leaves the values in order. */
        __m512i table[4][4];
        for (int k = 0; k < 4; k++)
            for (int q = 0; q < 4; q++) table[k][q] = _mm512_loadu_si512(value_bytes + 256 * k + 64 * q);
        __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        for (; i + 64 <= m; i += 64) {
            __m512i codes = _mm512_permutexvar_epi32(transpose, _mm512_loadu_si512(c + i));
            __mmask64 high = _mm512_movepi8_mask(codes);
            __m512i b[4];
            for (int k = 0; k < 4; k++)
                b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(table[k][0], codes, table[k][1]),
                                              _mm512_permutex2var_epi8(table[k][2], codes, table[k][3]));
            __m512i low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
            __m512i low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23)), s));
            _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23)), s));
            _mm512_storeu_ps(out + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23)), s));
            _mm512_storeu_ps(out + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23)), s));
        }
    }
#endif
    if (bits == 8) {
        for (; i + 16 <= m; i += 16) {
            __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + i)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, codebook, 4), s));
        }
    } else {
        __m512 table = _mm512_loadu_ps(codebook);  /* 16 values: one register, a permute decodes */
        __m512i shifts = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        for (; i + 16 <= m; i += 16) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(c + i / 2));
            __m512i twice = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  /* b0 b0 b1 b1 ... */
            __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(twice, shifts), _mm512_set1_epi32(15));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), s));
        }
    }
#elif defined(AVX2_ONLY)
    __m256 s = _mm256_set1_ps(scale);
    if (bits == 8) {
        for (; i + 8 <= m; i += 8) {
            __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + i)));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(codebook, idx, 4), s));
        }
    } else {
        __m256 low = _mm256_loadu_ps(codebook), high = _mm256_loadu_ps(codebook + 8);
        __m256i shifts = _mm256_setr_epi32(4, 0, 12, 8, 20, 16, 28, 24);  /* code 2k: byte k's high nibble */
        for (; i + 8 <= m; i += 8) {
            int32_t four;  /* 8 codes, in every lane */
            memcpy(&four, c + i / 2, 4);
            __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(four), shifts), _mm256_set1_epi32(15));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(lookup16(low, high, idx), s));
        }
    }
#endif
    (void)value_bytes;
    for (; i < m; i++) {
        uint8_t code = bits == 8 ? c[i] : (i & 1 ? c[i / 2] & 15 : c[i / 2] >> 4);
        out[i] = codebook[code] * scale;
    }
}

/* the block's scale: absmax (at least MIN_BLOCK_SCALE; NaN if any value is NaN) / scale_max */
static float block_scale(const float *restrict x, int64_t bs, float scale_max) {
    /* magnitudes compared as integers: the order of floats, with NaN above infinity (compilers
     * vectorize this as well as the AVX-512 intrinsics it replaces) */
    uint32_t top = 0;
    #pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < bs; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    return (top > 0x7F800000u ? NAN : fmaxf(float_of(top), MIN_BLOCK_SCALE)) / scale_max;
}

/* For a calibrated scale (quant.calibrated_scale): the products v * v and v * Q(v) of each normalized
 * value v and its code's value, in double (exact), as encode_block finds them. */
typedef struct {
    double *vv, *vq;  /* NULL: the format is not calibrated */
    const float *values;  /* the value of each code */
} calibration_t;

#ifdef __AVX512F__
static inline void store_products(const calibration_t *cal, int64_t i, __m512 v, __m512 q) {
    __m512d v_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v)), q_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(q));
    __m512d v_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m512d q_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q), 1)));
    _mm512_storeu_pd(cal->vv + i, _mm512_mul_pd(v_lo, v_lo));
    _mm512_storeu_pd(cal->vv + i + 8, _mm512_mul_pd(v_hi, v_hi));
    _mm512_storeu_pd(cal->vq + i, _mm512_mul_pd(v_lo, q_lo));
    _mm512_storeu_pd(cal->vq + i + 8, _mm512_mul_pd(v_hi, q_hi));
}
#endif

#ifdef AVX2_ONLY
static inline void store_products8(const calibration_t *cal, int64_t i, __m256 v, __m256 q) {
    __m256d v_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), v_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    __m256d q_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(q)), q_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(q, 1));
    _mm256_storeu_pd(cal->vv + i, _mm256_mul_pd(v_lo, v_lo));
    _mm256_storeu_pd(cal->vv + i + 4, _mm256_mul_pd(v_hi, v_hi));
    _mm256_storeu_pd(cal->vq + i, _mm256_mul_pd(v_lo, q_lo));
    _mm256_storeu_pd(cal->vq + i + 4, _mm256_mul_pd(v_hi, q_hi));
}
#endif

static inline void store_product(const calibration_t *cal, int64_t i, float v, uint8_t code) {
    cal->vv[i] = (double)v * (double)v;
    cal->vq[i] = (double)v * (double)cal->values[code];
}

/* codes (one byte each) of the values x / scale: the exact nearest codebook value, or e4m3 rounding */
static void encode_block(const state_t *s, const float *restrict x, float scale, int64_t bs, uint8_t *restrict codes, const calibration_t *cal) {
    int64_t i = 0;
#ifdef __AVX512F__
    divisor_t d = exact_divisor(scale);
    if (s->kind == KIND_E4M3) {  /* f32_to_e4m3, 16 at a time */
        __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), two14 = _mm512_castps_si512(_mm512_set1_ps(16384.0f));
        for (; i + 16 <= bs; i += 16) {
            __m512 v = divide(_mm512_loadu_ps(x + i), &d);
            __m512i u = _mm512_castps_si512(v), a = _mm512_and_si512(u, magnitude);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
            __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, odd), _mm512_set1_epi32(0x7FFFF - (120 << 23))), 20);
            __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(two14))), two14);
            __m512i code = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3C800000)), subnormal);
            code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x43F00000)), _mm512_set1_epi32(0x7F));
            code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80)));
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
            if (cal->vv) store_products(cal, i, v, _mm512_i32gather_ps(code, e4m3_values, 4));
        }
    } else if (s->bits == 4) {
        __m512i nan_code = _mm512_set1_epi32(s->nan_code), non_finite_key = _mm512_set1_epi32(0x7F80), low15 = _mm512_set1_epi32(0x7FFF);
        __m512 values = _mm512_loadu_ps(s->codebook);
        /* 15 thresholds fit in a register: the code is how many are <= v, found by a 4-step binary
         * search with permutes (the tables' answer, without their two gathers) */
        __m512 thresholds = _mm512_loadu_ps(s->thresholds);
        for (; i + 16 <= bs; i += 16) {
            __m512 v = divide(_mm512_loadu_ps(x + i), &d);
            __m512i code = _mm512_setzero_si512();
            for (int step = 8; step >= 1; step /= 2) {
                __m512i probe = _mm512_add_epi32(code, _mm512_set1_epi32(step - 1));
                __mmask16 up = _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(probe, thresholds), _CMP_GE_OQ);
                code = _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(step));
            }
            __m512i key = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 16), low15);
            code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(key, non_finite_key), nan_code);
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
            if (cal->vv) store_products(cal, i, v, _mm512_permutexvar_ps(code, values));
        }
    } else {
        /* one gather from the packed table (fused_cpu._near_code_table) by the value's top 16 bits,
         * then base + 1 where its low 16 bits (complemented if negative), on top, exceed the entry */
        for (; i + 16 <= bs; i += 16) {
            __m512 v = divide(_mm512_loadu_ps(x + i), &d);
            __m512i bits = _mm512_castps_si512(v);
            __m512i entry = _mm512_i32gather_epi32(_mm512_srli_epi32(bits, 16), s->near_code, 4);
            __m512i low = _mm512_slli_epi32(_mm512_xor_si512(bits, _mm512_srai_epi32(bits, 31)), 16);
            __m512i code = _mm512_mask_sub_epi32(entry, _mm512_cmpgt_epu32_mask(low, entry), entry, _mm512_set1_epi32(-1));
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));  /* the low bytes */
            if (cal->vv) store_products(cal, i, v, _mm512_i32gather_ps(_mm512_and_si512(code, _mm512_set1_epi32(0xFF)), s->codebook, 4));
        }
    }
#elif defined(AVX2_ONLY)
    __m256 divisor = _mm256_set1_ps(scale);
    if (s->kind == KIND_E4M3) {  /* f32_to_e4m3, 8 at a time (compilers vectorize it, with many more packs) */
        __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
        __m256 two14 = _mm256_set1_ps(16384.0f);
        for (; i + 8 <= bs; i += 8) {
            __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), divisor);
            __m256i u = _mm256_castps_si256(v), a = _mm256_and_si256(u, magnitude);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
            __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, odd), _mm256_set1_epi32(0x7FFFF - (120 << 23))), 20);
            normal = _mm256_min_epu32(normal, _mm256_set1_epi32(0x7F));
            __m256i subnormal = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), two14)), _mm256_castps_si256(two14));
            __m256i code = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a));
            code = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
            store_low_bytes(codes + i, code);
            if (cal->vv) store_products8(cal, i, v, _mm256_i32gather_ps(e4m3_values, code, 4));
        }
    } else if (s->kind == KIND_CODEBOOK && s->bits == 4) {
        /* the AVX-512 loop's binary search for how many thresholds are <= v: step k probes one of
         * 2**k thresholds (t[7]; t[3] or t[11]; t[1, 5, 9, 13]; the even ones), a permute away */
        const float *t = s->thresholds;
        __m256 t7 = _mm256_set1_ps(t[7]), t3 = _mm256_set1_ps(t[3]), t11 = _mm256_set1_ps(t[11]);
        __m256 odd = _mm256_setr_ps(t[1], t[5], t[9], t[13], 0, 0, 0, 0);
        __m256 even = _mm256_setr_ps(t[0], t[2], t[4], t[6], t[8], t[10], t[12], t[14]);
        __m256 q_low = _mm256_loadu_ps(s->codebook), q_high = _mm256_loadu_ps(s->codebook + 8);
        __m256i nan_code = _mm256_set1_epi32(s->nan_code), magnitude = _mm256_set1_epi32(0x7FFFFFFF);
        for (; i + 8 <= bs; i += 8) {
            __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), divisor);
            __m256 up8 = _mm256_cmp_ps(v, t7, _CMP_GE_OQ);
            __m256 up4 = _mm256_cmp_ps(v, _mm256_blendv_ps(t3, t11, up8), _CMP_GE_OQ);
            __m256i code = _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(up8), _mm256_set1_epi32(8)),
                                           _mm256_and_si256(_mm256_castps_si256(up4), _mm256_set1_epi32(4)));
            __m256 up2 = _mm256_cmp_ps(v, _mm256_permutevar8x32_ps(odd, _mm256_srli_epi32(code, 2)), _CMP_GE_OQ);
            code = _mm256_or_si256(code, _mm256_and_si256(_mm256_castps_si256(up2), _mm256_set1_epi32(2)));
            __m256 up1 = _mm256_cmp_ps(v, _mm256_permutevar8x32_ps(even, _mm256_srli_epi32(code, 1)), _CMP_GE_OQ);
            code = _mm256_or_si256(code, _mm256_and_si256(_mm256_castps_si256(up1), _mm256_set1_epi32(1)));
            __m256i non_finite = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), magnitude), _mm256_set1_epi32(0x7F7FFFFF));
            code = _mm256_blendv_epi8(code, nan_code, non_finite);
            store_low_bytes(codes + i, code);
            if (cal->vv) store_products8(cal, i, v, lookup16(q_low, q_high, code));
        }
    } else if (s->kind == KIND_CODEBOOK) {
        __m256i sign = _mm256_set1_epi32(INT32_MIN);  /* flipped: an unsigned comparison as a signed one */
        for (; i + 8 <= bs; i += 8) {
            __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), divisor);
            __m256i bits = _mm256_castps_si256(v);
            __m256i entry = _mm256_i32gather_epi32((const int *)s->near_code, _mm256_srli_epi32(bits, 16), 4);
            __m256i low = _mm256_slli_epi32(_mm256_xor_si256(bits, _mm256_srai_epi32(bits, 31)), 16);
            __m256i up = _mm256_cmpgt_epi32(_mm256_xor_si256(low, sign), _mm256_xor_si256(entry, sign));
            __m256i code = _mm256_sub_epi32(entry, up);  /* entry + 1 where low > entry */
            store_low_bytes(codes + i, code);  /* the low bytes */
            if (cal->vv) store_products8(cal, i, v, _mm256_i32gather_ps(s->codebook, _mm256_and_si256(code, _mm256_set1_epi32(0xFF)), 4));
        }
    }
#endif
    /* the rest (all of it without AVX-512 or AVX2): fp8 rounding, which compilers vectorize, or the
     * nearest-code tables (scalar, unless the target has gathers: faster than a vectorized count of
     * thresholds with 4 lanes) */
    int64_t first = i;
    if (s->kind == KIND_E4M3) {
        #pragma omp simd
        for (int64_t j = first; j < bs; j++) codes[j] = f32_to_e4m3(x[j] / scale);
    } else {  /* the nearest-code tables: base_code, plus one where v reaches the bucket's threshold */
        for (int64_t j = first; j < bs; j++) {
            float v = x[j] / scale;
            uint32_t bucket = bits_of(v) >> 16;
            codes[j] = (uint8_t)(s->base_code[bucket] + (v >= s->threshold[bucket]));
        }
    }
    if (cal->vv)
        for (int64_t j = first; j < bs; j++) store_product(cal, j, x[j] / scale, codes[j]);
}

/* quant.calibrated_scale: scale * sum(v * v) / sum(v * Q(v)) over the block, the sums taken by
 * halves in quant.pairwise_sum's order (consumes the products), so that the result is the compiled
 * step's, bit for bit. */
static float calibrated_scale(const calibration_t *cal, float scale, int64_t bs) {
    double *vv = cal->vv, *vq = cal->vq;
    for (int64_t half = bs / 2; half >= 1; half /= 2)
        for (int64_t i = 0; i < half; i++) {
            vv[i] = vv[i] + vv[i + half];
            vq[i] = vq[i] + vq[i + half];
        }
    double c = vv[0] / vq[0];
    if (!(isfinite(c) && c > 0)) c = 1.0;
    return (float)((double)scale * c);
}

/* ---- reading and writing one chunk as fp32 ---------------------------------------------------- */

/* A parameter's or gradient's n values as fp32: in place, or converted from bf16 into buffer. */
static float *load_values(int32_t kind, const void *src, int64_t start, int64_t n, float *buffer) {
    if (kind == KIND_F32) return (float *)src + start;
    const uint16_t *h = (const uint16_t *)src + start;
    for (int64_t i = 0; i < n; i++) buffer[i] = bf16_to_f32(h[i]);
    return buffer;
}

static void store_values(int32_t kind, void *dst, int64_t start, int64_t n, const float *x) {
    if (kind == KIND_F32) return;  /* updated in place */
    uint16_t *h = (uint16_t *)dst + start;
    for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(x[i]);
}

/* The chunk's n values of a state: fp32 states in place, the others decoded into buffer. */
static float *load_state(const state_t *s, int64_t start, int64_t n, float *buffer) {
    if (s->kind == KIND_F32 || s->kind == KIND_BF16) return load_values(s->kind, s->data, start, n, buffer);
    if (s->kind == KIND_FACTORED) {  /* the chunk is whole rows: row * (col / total) + (total - total) */
        const float *row = (const float *)s->data + start / s->cols;
        for (int64_t r = 0; r * s->cols < n; r++)
            for (int64_t c = 0; c < s->cols; c++) buffer[r * s->cols + c] = row[r] * s->col_scaled[c] + s->zero;
        return buffer;
    }
    int64_t bs = s->block_size;
    const float *codebook = s->kind == KIND_E4M3 ? e4m3_values : s->codebook;
    const uint8_t *value_bytes = s->kind == KIND_E4M3 ? e4m3_value_bytes : s->value_bytes;
    for (int64_t b = 0; b * bs < n; b++) {
        int64_t first = start + b * bs;
        int64_t m = n - b * bs < bs ? n - b * bs : bs;
        const uint8_t *c = (const uint8_t *)s->data + (s->bits == 8 ? first : first / 2);
        decode_block(c, s->bits, codebook, value_bytes, s->scale[first / bs], m, buffer + b * bs);
    }
    return buffer;
}

/* The sum of n values in double, in an order that does not depend on how the loop is vectorized:
 * eight running sums (element i goes to i % 8), added pairwise at the end. */
static double sum_of(const float *x, int64_t n) {
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)  /* written so that it vectorizes */
        for (int j = 0; j < 8; j++) lane[j] += (double)x[i + j];
    for (int j = 0; i < n; i++, j++) lane[j] += (double)x[i];
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* Writes back what load_state gave (nothing to do for fp32 states, updated in place). x holds the
 * chunk's n values and room up to the next block boundary (zero-padded here, as the compiled step
 * pads the last block); it is overwritten. A factored state's chunk (whole rows) sets its rows' sums
 * and adds its columns to col_sums, the running column sums of the chunk's task. */
static void store_state(const state_t *s, int64_t start, int64_t n, float *x, double *col_sums) {
    if (s->kind == KIND_F32 || s->kind == KIND_BF16) {
        store_values(s->kind, s->data, start, n, x);
        return;
    }
    if (s->kind == KIND_FACTORED) {
        float *row = (float *)s->data + start / s->cols;
        for (int64_t r = 0; r * s->cols < n; r++) {
            const float *values = x + r * s->cols;
            row[r] = (float)sum_of(values, s->cols);
            for (int64_t c = 0; c < s->cols; c++) col_sums[c] += (double)values[c];
        }
        return;
    }
    int64_t bs = s->block_size;
    int64_t padded = (n + bs - 1) / bs * bs;
    for (int64_t i = n; i < padded; i++) x[i] = 0.0f;
    uint8_t codes[MAX_CHUNK];
    double vv[s->calibrated ? bs : 1], vq[s->calibrated ? bs : 1];
    calibration_t cal = {s->calibrated ? vv : NULL, s->calibrated ? vq : NULL, s->kind == KIND_E4M3 ? e4m3_values : s->codebook};
    /* every block's scale first: the encoding loops then never wait on a block's scalar work */
    float scales[MAX_CHUNK / 2];
    for (int64_t b = 0; b * bs < padded; b++) scales[b] = block_scale(x + b * bs, bs, s->scale_max);
    uint8_t *dst = s->bits == 8 ? (uint8_t *)s->data + start : codes;
    for (int64_t b = 0; b * bs < padded; b++) {
        encode_block(s, x + b * bs, scales[b], bs, dst + b * bs, &cal);
        s->scale[(start + b * bs) / bs] = cal.vv ? calibrated_scale(&cal, scales[b], bs) : scales[b];
    }
    if (s->bits == 4) {
        uint8_t *packed = (uint8_t *)s->data + start / 2;
        for (int64_t i = 0; i < padded / 2; i++) packed[i] = (uint8_t)((codes[2 * i] << 4) | codes[2 * i + 1]);
    }
}

/* ---- the update ------------------------------------------------------------------------------ */

typedef struct {
    float lr_times_wd, bias_correction1, sqrt_bias_correction2;
} scalars_t;

/* torch.lerp as torch.compile lowers it: start + w * (end - start) for |w| < 0.5, else
 * end - (1 - w) * (end - start); the multiplication by 1.0 it leaves in is exact and dropped.
 * (coeff: w, or -(1 - w) where high.) */
static inline float lerp(float start, float end, float coeff, int high) {
    return (high ? end : start) + coeff * (end - start);
}

typedef struct {
    float c1, c2;  /* the moments' lerp coefficients */
    int high1, high2;
} weights_t;

static weights_t lerp_weights(const hyper_t *h) {
    float w1 = h->one_minus_beta1, w2 = h->one_minus_beta2;
    weights_t w = {w1, w2, fabsf(w1) >= 0.5f, fabsf(w2) >= 0.5f};
    if (w.high1) w.c1 = -(1.0f - w1);
    if (w.high2) w.c2 = -(1.0f - w2);
    return w;
}

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

/* functional.adam_step on elements i..n-1: the reference, the AVX-512 loop's tail and the whole
 * update elsewhere, written so that compilers vectorize it. decoupled, amsgrad and bf16 (the
 * states are bf16) are constants in each inlined copy (branches around arithmetic, see the top);
 * maximize is a sign flip. */
static inline __attribute__((always_inline)) void update_elements(const hyper_t *h, const scalars_t *k, const weights_t *w, int decoupled, int amsgrad, int bf16,
                                                                  int64_t i, int64_t n, float *restrict p, const float *restrict g,
                                                                  void *restrict m, void *restrict v, void *restrict vmax) {
    /* in locals: stores to the arrays cannot change them */
    float lr = h->lr, lr_wd = k->lr_times_wd, wd = h->weight_decay, eps = h->eps;
    float bc1 = k->bias_correction1, sbc2 = k->sqrt_bias_correction2, c1 = w->c1, c2 = w->c2;
    int high1 = w->high1, high2 = w->high2;
    uint32_t flip = h->maximize ? 0x80000000u : 0;
    #pragma omp simd
    for (int64_t j = i; j < n; j++) {
        float P = p[j], G = float_of(bits_of(g[j]) ^ flip);
        if (decoupled)
            P = P - lr_wd * P;
        else
            G = G + wd * P;
        float M = lerp(read_value(m, j, bf16), G, c1, high1), V = lerp(read_value(v, j, bf16), G * G, c2, high2);
        write_value(m, j, M, bf16);
        write_value(v, j, V, bf16);
        if (amsgrad) {  /* torch.maximum: NaN propagates, else std::max(vmax, v) */
            float old = read_value(vmax, j, bf16);
            V = (old != old || V != V) ? NAN : (old < V ? V : old);
            write_value(vmax, j, V, bf16);
        }
        float denom = sqrtf(V) / sbc2 + eps;
        p[j] = P - lr * (M / bc1) / denom;
    }
}

static void update_rest(const hyper_t *h, const scalars_t *k, const weights_t *w, int bf16, int64_t i, int64_t n, float *p, const float *g, void *m, void *v,
                        void *vmax) {
    switch (h->decoupled_weight_decay << 2 | h->amsgrad << 1 | bf16) {  /* a copy of the loop for each */
        case 0: update_elements(h, k, w, 0, 0, 0, i, n, p, g, m, v, vmax); break;
        case 1: update_elements(h, k, w, 0, 0, 1, i, n, p, g, m, v, vmax); break;
        case 2: update_elements(h, k, w, 0, 1, 0, i, n, p, g, m, v, vmax); break;
        case 3: update_elements(h, k, w, 0, 1, 1, i, n, p, g, m, v, vmax); break;
        case 4: update_elements(h, k, w, 1, 0, 0, i, n, p, g, m, v, vmax); break;
        case 5: update_elements(h, k, w, 1, 0, 1, i, n, p, g, m, v, vmax); break;
        case 6: update_elements(h, k, w, 1, 1, 0, i, n, p, g, m, v, vmax); break;
        default: update_elements(h, k, w, 1, 1, 1, i, n, p, g, m, v, vmax); break;
    }
}

/* bf16 states: the portable loop, which reads and writes them in place (faster than converting
 * them into buffers and back, with AVX-512 too) */
static void update_bf16_states(const hyper_t *h, const scalars_t *k, int64_t n, float *p, const float *g, uint16_t *m, uint16_t *v, uint16_t *vmax) {
    weights_t w = lerp_weights(h);
    update_rest(h, k, &w, 1, 0, n, p, g, m, v, vmax);
}

static void update_chunk(const hyper_t *h, const scalars_t *k, int64_t n, float *p, const float *g, float *m, float *v, float *vmax) {
    weights_t w = lerp_weights(h);
    int64_t i = 0;
#ifdef __AVX512F__
    float c1 = w.c1, c2 = w.c2;
    int high1 = w.high1, high2 = w.high2;
    divisor_t bc1 = exact_divisor(k->bias_correction1), sbc2 = exact_divisor(k->sqrt_bias_correction2);
    int root = root_ready(&sbc2);
    __m512 lr = _mm512_set1_ps(h->lr), lr_wd = _mm512_set1_ps(k->lr_times_wd), wd = _mm512_set1_ps(h->weight_decay);
    __m512 eps = _mm512_set1_ps(h->eps), w_1 = _mm512_set1_ps(c1), w_2 = _mm512_set1_ps(c2), nan = _mm512_set1_ps(NAN);
    __m512i flip = _mm512_set1_epi32(h->maximize ? (int32_t)0x80000000u : 0);
    for (; i + 16 <= n; i += 16) {
        __m512 P = _mm512_loadu_ps(p + i);
        __m512 G = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_loadu_ps(g + i)), flip));
        if (h->decoupled_weight_decay)
            P = _mm512_sub_ps(P, _mm512_mul_ps(lr_wd, P));
        else
            G = _mm512_add_ps(G, _mm512_mul_ps(wd, P));
        __m512 M = _mm512_loadu_ps(m + i), V = _mm512_loadu_ps(v + i), G2 = _mm512_mul_ps(G, G);
        M = _mm512_add_ps(high1 ? G : M, _mm512_mul_ps(w_1, _mm512_sub_ps(G, M)));
        V = _mm512_add_ps(high2 ? G2 : V, _mm512_mul_ps(w_2, _mm512_sub_ps(G2, V)));
        _mm512_storeu_ps(m + i, M);
        _mm512_storeu_ps(v + i, V);
        if (h->amsgrad) {
            __m512 old = _mm512_loadu_ps(vmax + i);
            __mmask16 either_nan = _mm512_cmp_ps_mask(old, V, _CMP_UNORD_Q);
            V = _mm512_mask_mov_ps(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(old, V, _CMP_LT_OQ), old, V), either_nan, nan);
            _mm512_storeu_ps(vmax + i, V);
        }
        __m512 denom = _mm512_add_ps(divide_root(_mm512_sqrt_ps(V), &sbc2, root), eps);
        P = _mm512_sub_ps(P, _mm512_div_ps(_mm512_mul_ps(lr, divide(M, &bc1)), denom));
        _mm512_storeu_ps(p + i, P);
    }
#endif
    update_rest(h, k, &w, 0, i, n, p, g, m, v, vmax);
}

static void step_chunk(const param_t *t, const hyper_t *h, const scalars_t *k, int64_t start, int64_t n, int64_t task) {
    float p_buffer[MAX_CHUNK], g_buffer[MAX_CHUNK], m_buffer[MAX_CHUNK], v_buffer[MAX_CHUNK], vmax_buffer[MAX_CHUNK];
    float *p = load_values(t->param_kind, t->param, start, n, p_buffer);
    const float *g = load_values(t->grad_kind, t->grad, start, n, g_buffer);
    if (t->exp_avg.kind == KIND_BF16 && t->exp_avg_sq.kind == KIND_BF16 && (!h->amsgrad || t->max_exp_avg_sq.kind == KIND_BF16)) {
        uint16_t *m = (uint16_t *)t->exp_avg.data + start, *v = (uint16_t *)t->exp_avg_sq.data + start;
        update_bf16_states(h, k, n, p, g, m, v, h->amsgrad ? (uint16_t *)t->max_exp_avg_sq.data + start : NULL);
    } else {
        float *m = load_state(&t->exp_avg, start, n, m_buffer);
        float *v = load_state(&t->exp_avg_sq, start, n, v_buffer);
        float *vmax = h->amsgrad ? load_state(&t->max_exp_avg_sq, start, n, vmax_buffer) : vmax_buffer;
        update_chunk(h, k, n, p, g, m, v, vmax);
        store_state(&t->exp_avg, start, n, m, t->exp_avg.col_sums + task * t->exp_avg.cols);
        store_state(&t->exp_avg_sq, start, n, v, t->exp_avg_sq.col_sums + task * t->exp_avg_sq.cols);
        if (h->amsgrad) store_state(&t->max_exp_avg_sq, start, n, vmax, t->max_exp_avg_sq.col_sums + task * t->max_exp_avg_sq.cols);
    }
    store_values(t->param_kind, t->param, start, n, p);
}

static int64_t gcd(int64_t a, int64_t b) { return b ? gcd(b, a % b) : a; }

/* Elements per chunk: a whole number of blocks of every quantized state and of rows of every
 * factored one (fused_cpu.chunk_unit); about 1024, which keeps the buffers in L1. */
static int64_t chunk_size(const param_t *t) {
    int64_t unit = 1;
    const state_t *states[3] = {&t->exp_avg, &t->exp_avg_sq, &t->max_exp_avg_sq};
    for (int i = 0; i < 3; i++) {
        int64_t size = states[i]->kind == KIND_FACTORED ? states[i]->cols : states[i]->kind >= KIND_CODEBOOK ? states[i]->block_size : 1;
        if (size > 0) unit = unit / gcd(unit, size) * size;
    }
    return unit * (unit < 1024 ? 1024 / unit : 1);
}

/* A parameter's chunks are split into tasks, each stepped by one thread in order. A parameter with a
 * factored state has at most MAX_TASKS, each with its own running column sums, added in task order
 * at the end: the sums then do not depend on the threads. The others have a task per chunk. */
#define MAX_TASKS 32

static int has_factored(const param_t *t) {
    return t->exp_avg.kind == KIND_FACTORED || t->exp_avg_sq.kind == KIND_FACTORED || t->max_exp_avg_sq.kind == KIND_FACTORED;
}

/* A factored state's fields for one step: col / total (total = the column sums' sum, at least
 * FLT_MIN, as factored.py reads it) and zeroed column sums for each task. Returns 0, or 1 if out of
 * memory. */
static int begin_factored(state_t *s, int64_t tasks) {
    s->col_scaled = NULL;
    s->col_sums = NULL;
    if (s->kind != KIND_FACTORED) return 0;
    s->col_scaled = malloc((s->cols > 0 ? s->cols : 1) * sizeof(float));
    s->col_sums = calloc(tasks * s->cols > 0 ? tasks * s->cols : 1, sizeof(double));
    if (!s->col_scaled || !s->col_sums) return 1;
    float total = (float)sum_of(s->col, s->cols);
    if (total < FLT_MIN) total = FLT_MIN;  /* clamp(min=tiny); NaN stays NaN */
    for (int64_t c = 0; c < s->cols; c++) s->col_scaled[c] = s->col[c] / total;
    s->zero = total - total;
    return 0;
}

/* After the step: the new column sums, the tasks' sums added in task order. */
static void end_factored(state_t *s, int64_t tasks, int ok) {
    if (s->kind != KIND_FACTORED) return;
    if (ok)
        for (int64_t c = 0; c < s->cols; c++) {
            double sum = 0;
            for (int64_t i = 0; i < tasks; i++) sum += s->col_sums[i * s->cols + c];
            s->col[c] = (float)sum;
        }
    free(s->col_scaled);
    free(s->col_sums);
}

int lowbit_max_chunk(void) { return MAX_CHUNK; }

/* For the tests: the values of a state's first n elements as load_state decodes them. */
void lowbit_decode(const state_t *s, int64_t n, float *out) {
    float *values = load_state(s, 0, n, out);
    if (values != out) memcpy(out, values, n * sizeof(float));
}

/* For the tests: the codes encode_block gives n normalized values (one byte each; scale 1). */
void lowbit_encode(const state_t *s, const float *v, int64_t n, uint8_t *codes) {
    calibration_t none = {NULL, NULL, NULL};
    encode_block(s, v, 1.0f, n, codes, &none);
}

/* For the tests: out[i] = a[i] / b, divided as the kernel divides by a block's scale, or (root) as
 * the update divides square roots by sqrt(1 - beta2**t). */
void lowbit_divide(const float *a, int64_t n, float b, int root, float *out) {
    int64_t i = 0;
#ifdef __AVX512F__
    divisor_t d = exact_divisor(b);
    int ready = root && root_ready(&d);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(a + i);
        _mm512_storeu_ps(out + i, root ? divide_root(x, &d, ready) : divide(x, &d));
    }
#endif
    (void)root;
    for (; i < n; i++) out[i] = a[i] / b;
}

/* Steps every parameter once; returns 0 (1: out of memory, nothing stepped). The tasks of all
 * parameters are shared among the threads. */
int lowbit_adam_step(param_t *params, int64_t count, const hyper_t *h, int threads) {
    int64_t *first_task = malloc((count + 1) * sizeof(int64_t));
    scalars_t *k = malloc((count ? count : 1) * sizeof(scalars_t));
    int failed = !first_task || !k;
    int64_t prepared = 0;  /* parameters whose factored states got their fields (or tried to) */
    if (first_task) first_task[0] = 0;
    while (!failed && prepared < count) {
        param_t *t = &params[prepared];
        int64_t size = chunk_size(t), chunks = (t->numel + size - 1) / size;
        int64_t tasks = has_factored(t) && chunks > MAX_TASKS ? MAX_TASKS : chunks;
        first_task[prepared + 1] = first_task[prepared] + tasks;
        failed = begin_factored(&t->exp_avg, tasks) | begin_factored(&t->exp_avg_sq, tasks) | begin_factored(&t->max_exp_avg_sq, tasks);
        prepared++;
    }
    if (!failed) {
        for (int64_t j = 0; j < count; j++) {
            const param_t *t = &params[j];
            float step = *t->step + 1.0f;
            *t->step = step;
            k[j].lr_times_wd = h->lr * h->weight_decay;
            k[j].bias_correction1 = 1.0f - powf(h->beta1, step);
            k[j].sqrt_bias_correction2 = sqrtf(1.0f - powf(h->beta2, step));
        }
        int64_t total = first_task[count];
        #pragma omp parallel for schedule(dynamic, 8) num_threads(threads)
        for (int64_t c = 0; c < total; c++) {
            int64_t lo = 0, hi = count - 1;  /* the parameter this task belongs to */
            while (lo < hi) {
                int64_t mid = (lo + hi + 1) / 2;
                if (first_task[mid] <= c) lo = mid; else hi = mid - 1;
            }
            const param_t *t = &params[lo];
            int64_t size = chunk_size(t), chunks = (t->numel + size - 1) / size;
            int64_t task = c - first_task[lo], tasks = first_task[lo + 1] - first_task[lo];
            for (int64_t chunk = task * chunks / tasks; chunk < (task + 1) * chunks / tasks; chunk++) {
                int64_t start = chunk * size;
                step_chunk(t, h, &k[lo], start, t->numel - start < size ? t->numel - start : size, task);
            }
        }
    }
    for (int64_t j = 0; j < prepared; j++) {
        param_t *t = &params[j];
        int64_t tasks = first_task[j + 1] - first_task[j];
        end_factored(&t->exp_avg, tasks, !failed);
        end_factored(&t->exp_avg_sq, tasks, !failed);
        end_factored(&t->max_exp_avg_sq, tasks, !failed);
    }
    free(first_task);
    free(k);
    return failed;
}
