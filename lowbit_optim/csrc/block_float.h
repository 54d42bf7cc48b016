/* Block floating-point states (block_float.py: 10bit-sr, 8bit-log): per value a small float of
 * exponent_bits and mantissa_bits (and a sign bit for a signed state) under its block's scale,
 * quant.small_float_codes / small_float_values; per block the codes' top 8 bits, then for 10-bit
 * codes their low 2 bits four to a byte (quant.pack_codes). Writes round stochastically, the draws
 * salted by the block's index and the state's count of writes (write_salt, as bf16-sr), unbiased in
 * value or (log_unbiased) in log. The arithmetic is the compiled step's, on exponent bits (no
 * frexp / ldexp calls) and integers, and written without branches, so that compilers vectorize the
 * loops for whatever they target. */
#ifndef LOG_THRESHOLD_BITS
#error "build with -DLOG_THRESHOLD_BITS from quant, as kernel_build.py does"
#endif

/* 2**e as fp32 (e within fp32's normal exponents): quant.power_of_two */
static inline float power_of_two(int32_t e) { return float_of((uint32_t)(e + 127) << 23); }

/* the value of a code (quant.small_float_values) */
static inline float small_float_value(uint32_t code, int exponent_bits, int mantissa_bits, int sign_bit) {
    uint32_t magnitude = code & ((1u << (exponent_bits + mantissa_bits)) - 1);
    int32_t field = (int32_t)(magnitude >> mantissa_bits), mantissa = (int32_t)(magnitude & ((1u << mantissa_bits) - 1));
    float significand = (float)(mantissa + (field > 0 ? 1 << mantissa_bits : 0));
    float value = significand * power_of_two((field > 1 ? field : 1) + 1 - (1 << exponent_bits) - mantissa_bits);
    uint32_t negative = sign_bit ? (code >> (exponent_bits + mantissa_bits)) & 1u : 0u;
    return float_of(bits_of(value) | negative << 31);
}

/* quant.power_of_two_at_least: the smallest power of two >= finite positive x (at most 2**127; 2**-126 for a subnormal x) */
static inline float power_of_two_at_least(float x) {
    float up = float_of((bits_of(x) + 0x7FFFFFu) & 0xFF800000u);
    up = up < 0x1p127f ? up : 0x1p127f;
    return (bits_of(x) & 0x7F800000u) != 0x7F800000u ? up : x;
}

/* quant.log_unbiased_threshold: the fraction of a spacing above below (whole spacings) that a value
 * must exceed to round up with draw u so that the log of the result is unbiased, in fixed point:
 * the coefficients as quotients of exact integers, then int32 arithmetic */
static inline float log_unbiased_threshold(float u, int32_t below) {
    const int32_t one = 1 << LOG_THRESHOLD_BITS;
    int32_t drawn = (int32_t)(u * (float)one);
    float k = (float)(below + (below == 0));  /* k = 0 is masked below; as 1 its b * drawn stays within int32 */
    int32_t a = (int32_t)((float)(10 * one) / (20.0f * k + 13.0f)), b = (int32_t)((float)(5 * one) / ((30.0f * k + 30.0f) * k + 3.0f));
    int32_t w = (drawn * (one - drawn)) >> LOG_THRESHOLD_BITS;
    int32_t c = (w * (a + ((b * drawn) >> LOG_THRESHOLD_BITS))) >> LOG_THRESHOLD_BITS;
    int32_t zero = -(int32_t)(below == 0);  /* a mask, not ?: so that GCC vectorizes the loop */
    return (float)((drawn - c) & ~zero) * (1.0f / (float)one);
}

/* the code of normalized value v, rounded up where the dropped fraction exceeds u (log_unbiased:
 * the threshold log_unbiased_threshold gives u); unsigned, a nonzero v never takes code 0
 * (quant.small_float_codes) */
static inline uint32_t small_float_code(float v, float u, int exponent_bits, int mantissa_bits, int sign_bit, int log_unbiased) {
    int32_t lowest = 2 - (1 << exponent_bits), largest = (1 << (exponent_bits + mantissa_bits)) - 1;
    uint32_t magnitude_bits = bits_of(v) & 0x7FFFFFFFu;
    float magnitude = float_of(magnitude_bits);
    int32_t binade = (int32_t)(magnitude_bits >> 23) - 127;
    binade = binade > lowest ? binade : lowest;
    int inside = magnitude <= 2.0f;  /* not NaN or beyond the largest value */
    float product = magnitude * power_of_two(mantissa_bits - binade);
    float steps = float_of(bits_of(product) & (0u - (uint32_t)inside));  /* 0 outside; a mask: GCC keeps a ?: here scalar */
    int32_t below = (int32_t)steps;  /* floor: steps >= 0 */
    float threshold = log_unbiased ? log_unbiased_threshold(u, below) : u;
    int32_t code = (binade - lowest) * (1 << mantissa_bits) + below + ((steps - (float)below) > threshold);
    code = (inside & (code < largest)) ? code : largest;
    code += (code == 0) & (magnitude_bits != 0) & !sign_bit;  /* an unsigned code keeps a nonzero value above 0 */
    return (uint32_t)code | ((bits_of(v) >> 31) * (uint32_t)sign_bit) << (exponent_bits + mantissa_bits);
}

/* the chunk's n values (whole blocks but the state's last) of elements start.. */
static void load_block_float(const state_t *s, int64_t start, int64_t n, float *out) {
    int64_t bs = s->block_size, bytes = bs * s->bits / 8;
    int exponent_bits = s->exponent_bits, mantissa_bits = s->mantissa_bits, sign_bit = s->bits - exponent_bits - mantissa_bits;
    for (int64_t b = 0; b * bs < n; b++) {
        int64_t block = start / bs + b, m = n - b * bs < bs ? n - b * bs : bs;
        const uint8_t *high = (const uint8_t *)s->data + block * bytes, *low = high + bs;
        float scale = s->scale[block], *values = out + b * bs;
        if (s->bits == 8) {
            for (int64_t i = 0; i < m; i++) values[i] = small_float_value(high[i], exponent_bits, mantissa_bits, sign_bit) * scale;
            continue;
        }
        /* one byte per value, so that the loop below reads every array in order. Four low-plane bytes
         * (a little-endian word: value l's bits at 2l) make 16 at a time by variable shifts: GCC left
         * the nested loop scalar, and decoding both 10bit-sr moments of an Adam chunk took 0.53 ns per
         * value, 0.33 so (AMD EPYC of family 26, 1 thread; AVX2 build 0.72 -> 0.55) */
        uint8_t low_bits[MAX_CHUNK];
        int64_t j = 0;
#ifdef __AVX512F__
        __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), three = _mm512_set1_epi32(3);
        for (; j + 4 <= bs / 4; j += 4) {
            int32_t word;
            memcpy(&word, low + j, 4);
            _mm_storeu_si128((__m128i *)(low_bits + 4 * j), _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(word), shifts), three)));
        }
#elif defined(AVX2_ONLY)
        __m256i first = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), second = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30), three = _mm256_set1_epi32(3);
        for (; j + 4 <= bs / 4; j += 4) {
            int32_t word;
            memcpy(&word, low + j, 4);
            __m256i all = _mm256_set1_epi32(word);
            store_low_bytes(low_bits + 4 * j, _mm256_and_si256(_mm256_srlv_epi32(all, first), three));
            store_low_bytes(low_bits + 4 * j + 8, _mm256_and_si256(_mm256_srlv_epi32(all, second), three));
        }
#endif
        for (; j < bs / 4; j++)
            for (int k = 0; k < 4; k++) low_bits[4 * j + k] = (uint8_t)(low[j] >> (2 * k) & 3u);
        for (int64_t i = 0; i < m; i++)
            values[i] = small_float_value((uint32_t)high[i] << 2 | low_bits[i], exponent_bits, mantissa_bits, sign_bit) * scale;
    }
}

/* writes the padded chunk x (whole blocks) of elements start.. back: per block its scale, its
 * codes, then their byte (8-bit codes) or their two planes (10-bit) */
static void store_block_float(const state_t *s, int64_t start, int64_t padded, const float *x) {
    int64_t bs = s->block_size, bytes = bs * s->bits / 8;
    int exponent_bits = s->exponent_bits, mantissa_bits = s->mantissa_bits, sign_bit = s->bits - exponent_bits - mantissa_bits;
    uint16_t codes[MAX_CHUNK];
    for (int64_t b = 0; b * bs < padded; b++) {
        int64_t block = start / bs + b;
        const float *values = x + b * bs;
        float scale = block_scale(values, bs, s->scale_max, s->scale_min);
        scale = s->power_of_two_scale ? power_of_two_at_least(scale) : scale;
        uint32_t salt = write_salt(*s->writes, block);
        uint32_t term = salt;
        if (s->log_unbiased)  /* two loops: GCC 12 left one loop testing the flag scalar (10x slower) */
            for (int32_t i = 0; i < (int32_t)bs; i++) {
                float v = values[i] / scale;
                codes[i] = (uint16_t)small_float_code(v, dither_of_term(v, term), exponent_bits, mantissa_bits, sign_bit, 1);
                term += DITHER_PLACE;
            }
        else
            for (int32_t i = 0; i < (int32_t)bs; i++) {
                float v = values[i] / scale;
                codes[i] = (uint16_t)small_float_code(v, dither_of_term(v, term), exponent_bits, mantissa_bits, sign_bit, 0);
                term += DITHER_PLACE;
            }
        uint8_t *high = (uint8_t *)s->data + block * bytes, *low = high + bs;
        s->scale[block] = scale;
        if (s->bits == 8) {
            for (int64_t i = 0; i < bs; i++) high[i] = (uint8_t)codes[i];
            continue;
        }
        for (int64_t i = 0; i < bs; i++) high[i] = (uint8_t)(codes[i] >> 2);
        for (int64_t j = 0; j < bs / 4; j++)  /* a byte per index: GCC vectorizes it (as i += 4 it would scatter) */
            low[j] = (uint8_t)((codes[4 * j] & 3) | (codes[4 * j + 1] & 3) << 2 | (codes[4 * j + 2] & 3) << 4 | (codes[4 * j + 3] & 3) << 6);
    }
}
