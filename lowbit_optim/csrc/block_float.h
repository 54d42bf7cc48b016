/* 10-bit block floating-point states (block_float.py, 10bit-sr): per value a small float of
 * exponent_bits and mantissa_bits (and a sign bit for a signed state) under its block's scale,
 * quant.small_float_codes / small_float_values; per block the codes' top 8 bits, then their low 2
 * bits four to a byte (quant.pack_codes). Writes round stochastically, the draws salted by the
 * block's index and the state's count of writes (write_salt, as bf16-sr). Scalar loops: the exact
 * operations of the compiled step (frexp and ldexp are exact; the division is IEEE's). */

/* the value of a code (quant.small_float_values) */
static inline float small_float_value(uint32_t code, int exponent_bits, int mantissa_bits, int sign_bit) {
    uint32_t magnitude = code & ((1u << (exponent_bits + mantissa_bits)) - 1);
    int32_t field = (int32_t)(magnitude >> mantissa_bits), mantissa = (int32_t)(magnitude & ((1u << mantissa_bits) - 1));
    float value = ldexpf((float)(mantissa + (field > 0 ? 1 << mantissa_bits : 0)), (field > 1 ? field : 1) + 1 - (1 << exponent_bits) - mantissa_bits);
    return sign_bit && (code >> (exponent_bits + mantissa_bits)) ? -value : value;
}

/* the code of normalized value v, rounded up where the dropped fraction exceeds u (quant.small_float_codes) */
static inline uint32_t small_float_code(float v, float u, int exponent_bits, int mantissa_bits, int sign_bit) {
    int32_t lowest = 2 - (1 << exponent_bits), largest = (1 << (exponent_bits + mantissa_bits)) - 1;
    float magnitude = fabsf(v);
    int32_t code = largest;  /* NaN, |v| > 2 */
    if (magnitude <= 2.0f) {
        int exponent;
        frexpf(magnitude, &exponent);
        int32_t binade = magnitude > 0.0f && exponent - 1 > lowest ? exponent - 1 : lowest;
        float steps = ldexpf(magnitude, mantissa_bits - binade), below = floorf(steps);
        code = (binade - lowest) * (1 << mantissa_bits) + (int32_t)below + ((steps - below) > u);
        code = code < largest ? code : largest;
    }
    return (uint32_t)code | (sign_bit ? (bits_of(v) >> 31) << (exponent_bits + mantissa_bits) : 0u);
}

/* the chunk's n values (whole blocks but the state's last) of elements start.. */
static void load_block_float(const state_t *s, int64_t start, int64_t n, float *out) {
    int64_t bs = s->block_size, bytes = bs * 10 / 8;
    int sign_bit = s->bits - s->exponent_bits - s->mantissa_bits;
    for (int64_t b = 0; b * bs < n; b++) {
        int64_t block = start / bs + b, m = n - b * bs < bs ? n - b * bs : bs;
        const uint8_t *high = (const uint8_t *)s->data + block * bytes, *low = high + bs;
        float scale = s->scale[block];
        for (int64_t i = 0; i < m; i++) {
            uint32_t code = (uint32_t)high[i] << 2 | ((low[i / 4] >> (2 * (i % 4))) & 3u);
            out[b * bs + i] = small_float_value(code, s->exponent_bits, s->mantissa_bits, sign_bit) * scale;
        }
    }
}

/* writes the padded chunk x (whole blocks) of elements start.. back: scales, then codes */
static void store_block_float(const state_t *s, int64_t start, int64_t padded, const float *x) {
    int64_t bs = s->block_size, bytes = bs * 10 / 8;
    int sign_bit = s->bits - s->exponent_bits - s->mantissa_bits;
    for (int64_t b = 0; b * bs < padded; b++) {
        int64_t block = start / bs + b;
        float scale = block_scale(x + b * bs, bs, s->scale_max);
        uint32_t salt = write_salt(*s->writes, block);
        uint8_t *high = (uint8_t *)s->data + block * bytes, *low = high + bs;
        for (int64_t i = 0; i < bs; i += 4) {
            uint32_t low_bits = 0;
            for (int64_t k = i; k < i + 4; k++) {
                float v = x[b * bs + k] / scale;
                uint32_t code = small_float_code(v, dither(v, (uint32_t)k, salt), s->exponent_bits, s->mantissa_bits, sign_bit);
                high[k] = (uint8_t)(code >> 2);
                low_bits |= (code & 3u) << (2 * (k - i));
            }
            low[i / 4] = (uint8_t)low_bits;
        }
        s->scale[block] = scale;
    }
}
