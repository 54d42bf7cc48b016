/* Number formats: fp32 bits, bf16 and fp8 e4m3, each rounded to nearest even as torch rounds.
 * Selects are masks, not branches (see fused_step.c): the loops that call these vectorize. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float float_of(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static inline float bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

/* the spacing of bf16 numbers at a bf16 value x (precision.bf16_ulp): 2**(exponent - 7); 0 for zero
 * and subnormals */
static inline float bf16_ulp(float x) { return float_of(bits_of(x) & 0x7F800000u) * 0.0078125f; }

static inline uint16_t f32_to_bf16(float x) {  /* round to nearest even; NaN stays a quiet NaN */
    uint32_t u = bits_of(x);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = 0u - (x != x);
    return (uint16_t)((rounded & ~nan) | (0x7FC0u & nan));
}

/* e4m3 -> fp32: a normal code's magnitude bits shifted into place (E4M3_SHIFT) plus the difference of
 * the exponent biases (E4M3_BIAS: 127 - 7); magnitude E4M3_NAN is NaN (shared with the AVX2 decoder) */
#define E4M3_SHIFT 20
#define E4M3_BIAS (120u << 23)
#define E4M3_NAN 0x7F

static inline float e4m3_to_f32(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80) << 24, magnitude_bits = c & 0x7Fu;
    float magnitude = magnitude_bits >= 8 ? float_of((magnitude_bits << E4M3_SHIFT) + E4M3_BIAS) : (float)(c & 7) * 0.001953125f;
    if (magnitude_bits == E4M3_NAN) magnitude = NAN;
    return float_of(bits_of(magnitude) | sign);
}

static inline uint8_t f32_to_e4m3(float x) {  /* round to nearest even; what rounds above 448 -> NaN, as torch */
    uint32_t u = bits_of(x), sign = (u >> 24) & 0x80;
    uint32_t a = u & 0x7FFFFFFFu;
    /* both cases computed, one selected by a mask */
    uint32_t normal = (a + 0x7FFFFu + ((a >> 20) & 1u) - (120u << 23)) >> 20;
    normal = normal < 0x7Fu ? normal : 0x7Fu;  /* what rounds to 0x7F or above (480 and up, inf, NaN): 0x7F */
    /* below 2**-6 (subnormal, steps of 2**-9): adding 2**14, whose fp32 ulp is 2**-9, rounds to that
     * grid (to nearest even) and leaves the multiple of 2**-9 in the low mantissa bits */
    uint32_t subnormal = bits_of(float_of(a) + 16384.0f) - bits_of(16384.0f);
    uint32_t below = 0u - (a < 0x3C800000u);
    return (uint8_t)(((subnormal & below) | (normal & ~below)) | sign);
}

/* e4m3 decodes through a table like a codebook (and byte by byte, for the VBMI decoder) */
static float e4m3_values[256];
static uint8_t e4m3_value_bytes[4 * 256];

__attribute__((constructor)) static void fill_e4m3_values(void) {
    for (int c = 0; c < 256; c++) {
        e4m3_values[c] = e4m3_to_f32((uint8_t)c);
        for (int k = 0; k < 4; k++) e4m3_value_bytes[256 * k + c] = (uint8_t)(bits_of(e4m3_values[c]) >> (8 * k));
    }
}
