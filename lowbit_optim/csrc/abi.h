/* The structures Python fills and the kernel reads, declared once, and the table that tells Python
 * their layout.
 *
 * Each structure is a list of fields in an X-macro (FIELDS(FIELD, ARRAY, S)). The same list declares
 * the C struct (DECLARE_STRUCT) and the rows of the table the library exports (ABI_FIELD_ROWS:
 * structure, field, type code, offsetof, sizeof), from which kernel_abi.py builds its ctypes
 * structures when the library loads, checking every offset and size. Python keeps no copy of a
 * layout, so the two sides cannot drift apart: a field added here is a field there.
 *
 * Type codes come from the C type (_Generic): i32, i64, u64, f32, f64, ptr (any pointer); an array of
 * a structure declared here has that structure's name and a count.
 */
#include <stddef.h>
#include <stdint.h>

/* How a state, parameter or gradient is stored. The names are KernelLayout.kind's (state.py) and
 * the tensors' dtypes'; Python reads the numbers from the table (lowbit_abi_constant). */
#define KINDS(KIND) KIND(NONE, "none") KIND(F32, "f32") KIND(BF16, "bf16") KIND(CODEBOOK, "codebook") KIND(E4M3, "e4m3") KIND(FACTORED, "factored") \
    KIND(BF16_SR, "bf16-sr") KIND(BLOCK_FLOAT, "block-float")
#define DECLARE_KIND(id, name) KIND_##id,
enum { KINDS(DECLARE_KIND) };

#define MAX_STATES 3   /* states per parameter (Adam with amsgrad, AdEMAMix) */
#define MAX_CHUNK 8192 /* elements per chunk: its fp32 buffers stay in L1 / L2 */

#define DECLARE_FIELD(S, type, name) type name;
#define DECLARE_ARRAY(S, type, name, count) type name[count];
#define DECLARE_STRUCT(S, FIELDS) typedef struct { FIELDS(DECLARE_FIELD, DECLARE_ARRAY, S) } S;

/* An 8-bit codebook's nearest code as a piecewise affine map of |v| (affine_codes.py, affine.h): per
 * binary octave of |v| (2**-31 .. 1) a split and the level below it, per level an fp32 map and its
 * clamps. */
#define AFFINE_FIELDS(FIELD, ARRAY, S)          \
    FIELD(S, int32_t, zero_code)                \
    FIELD(S, float, band)                       \
    ARRAY(S, float, split, 32)                  \
    ARRAY(S, int32_t, level_low, 32)            \
    ARRAY(S, float, slope, 16)                  \
    ARRAY(S, float, offset, 16)                 \
    ARRAY(S, float, low, 16)                    \
    ARRAY(S, float, high, 16)
DECLARE_STRUCT(affine_code_t, AFFINE_FIELDS)

/* A 4-bit codebook's values or decision thresholds by bucket of v (codecs.h, bucket_count16): bucket
 * k of BUCKETS holds the v in [2k / BUCKETS - 1, 2(k + 1) / BUCKETS - 1), the last one closed at 1;
 * below[k] of the numbers are <= its start and at most one lies inside it, inside[k] (+inf: none).
 * kernel_op._buckets builds them. */
#define BUCKETS 32
#define BUCKET_FIELDS(FIELD, ARRAY, S) \
    ARRAY(S, int32_t, below, BUCKETS)  \
    ARRAY(S, float, inside, BUCKETS)
DECLARE_STRUCT(buckets_t, BUCKET_FIELDS)

/* One state of a parameter. */
#define STATE_FIELDS(FIELD, ARRAY, S)                                                                           \
    FIELD(S, int32_t, kind)                 /* KIND_*: KIND_NONE where the optimizer has no such state */    \
    FIELD(S, int32_t, bits)                 /* 8; 4: two codes per byte, element 2i in the high nibble; 10 */ \
    FIELD(S, int64_t, block_size)           /* quantized kinds: elements per scale */                         \
    FIELD(S, float, scale_max)              /* a block's largest value maps to this code value, */           \
    FIELD(S, float, scale_min)              /* or its most negative to this one (quant.block_scales) */      \
    FIELD(S, void *, data)                  /* values (plain kinds), codes, or a factored state's row sums */ \
    FIELD(S, float *, scale)                /* one per block (quantized kinds) */                             \
    FIELD(S, const float *, codebook)       /* KIND_CODEBOOK: value of each code */                           \
    FIELD(S, const int32_t *, base_code)    /* KIND_CODEBOOK: nearest-code tables by the top 16 bits */       \
    FIELD(S, const float *, threshold)                                                                        \
    FIELD(S, const float *, thresholds)     /* KIND_CODEBOOK: sorted decision thresholds, NaN-padded */       \
    FIELD(S, int32_t, nan_code)             /* the code the tables give NaN and infinities */                 \
    FIELD(S, int32_t, zero_code)            /* a positive value encoded to this code (of 0) takes */          \
    FIELD(S, int32_t, smallest_code)        /* this one, the smallest positive (OptimState.positive_floor); -1: none */ \
    FIELD(S, const int32_t *, near_code)    /* KIND_CODEBOOK, 8 bits: both tables packed in one */            \
    FIELD(S, const uint8_t *, value_bytes)  /* KIND_CODEBOOK, 8 bits: byte k of code c's value at [256k+c] */ \
    FIELD(S, const affine_code_t *, affine) /* KIND_CODEBOOK, 8 bits: its codes as an affine map (or NULL) */ \
    FIELD(S, const buckets_t *, value_buckets)     /* KIND_CODEBOOK, 4 bits: its values by bucket (or NULL) */ \
    FIELD(S, const buckets_t *, threshold_buckets) /* and its decision thresholds (or NULL) */ \
    FIELD(S, int32_t, calibrated)           /* scale *= <x, x> / <x, Q(x)> (quant.calibrated_scale) */        \
    FIELD(S, int32_t, stochastic)           /* KIND_CODEBOOK: stochastic rounding (quant.encode_stochastic) */\
    FIELD(S, float *, col)                  /* KIND_FACTORED: the column sums of the (numel/cols, cols) matrix */ \
    FIELD(S, int64_t, cols)                                                                                   \
    FIELD(S, float *, col_scaled)           /* the kernel's, for one step: col / total */                     \
    FIELD(S, float, zero)                   /* the kernel's: total - total (0, or NaN if not finite) */       \
    FIELD(S, double *, col_sums)            /* the kernel's: each task's sums of the new columns */          \
    FIELD(S, int64_t *, writes)             /* KIND_BF16_SR, KIND_BLOCK_FLOAT: its count of writes, incremented first */ \
    FIELD(S, int32_t, exponent_bits)        /* KIND_BLOCK_FLOAT: the small float's (quant.small_float_codes); */ \
    FIELD(S, int32_t, mantissa_bits)        /* bits less these two is its sign bit (1 signed, 0 not) */      \
    FIELD(S, int32_t, log_unbiased)         /* KIND_BLOCK_FLOAT: writes keep log(v) unbiased (quant.log_unbiased_threshold) */ \
    FIELD(S, int32_t, power_of_two_scale)   /* KIND_BLOCK_FLOAT: scales rounded up to a power of two */        \
    FIELD(S, float *, addend)               /* KIND_CODEBOOK: numel fp32 values added to the decoded codes, where the */ \
                                            /* format keeps a part outside them (a low-rank part), or NULL; the store */ \
                                            /* then writes the new values there and leaves the codes to Python */
DECLARE_STRUCT(state_t, STATE_FIELDS)

/* One parameter: its values, gradient, step counter and states. */
#define PARAM_FIELDS(FIELD, ARRAY, S)                                                              \
    FIELD(S, int64_t, numel)                                                                       \
    FIELD(S, int32_t, param_kind)       /* KIND_F32 or KIND_BF16 (rounded to nearest) */           \
    FIELD(S, int32_t, grad_kind)                                                                   \
    FIELD(S, void *, param)                                                                        \
    FIELD(S, const void *, grad)                                                                   \
    FIELD(S, float *, step)             /* the step counter, incremented first (NULL: none) */     \
    FIELD(S, int8_t *, correction)      /* int8-correction of a bf16 parameter (NULL: none) */     \
    ARRAY(S, state_t, state, MAX_STATES) /* in the optimizer's order */
DECLARE_STRUCT(param_t, PARAM_FIELDS)

/* ---- the table ---------------------------------------------------------------------------------- */

typedef struct {
    const char *structure, *field, *type;
    int64_t offset, size, count;
} abi_field_t;

#define SCALAR_CODE(x, other) _Generic((x), int32_t: "i32", int64_t: "i64", uint64_t: "u64", float: "f32", double: "f64", default: other)
#define TYPE_CODE(x) SCALAR_CODE(x, "ptr")
#define FIELD_ROW(S, type, name) {#S, #name, TYPE_CODE(((S *)0)->name), offsetof(S, name), sizeof(((S *)0)->name), 1},
#define ARRAY_ROW(S, type, name, count) {#S, #name, SCALAR_CODE(((S *)0)->name[0], #type), offsetof(S, name), sizeof(((S *)0)->name), count},
#define ABI_FIELD_ROWS(S, FIELDS) FIELDS(FIELD_ROW, ARRAY_ROW, S) {#S, "", "struct", 0, sizeof(S), 1},
