/* The fused CPU step: every parameter's optimizer step in one call, one pass over memory
 * (dequantize -> update -> quantize per chunk of blocks).
 *
 * The arithmetic is that of the optimizer's functional.py step as torch.compile lowers it (same
 * operations, same order, no contraction into FMAs: built with -ffp-contract=off), so this kernel
 * and the compiled step produce the same bits. Speed comes from doing that arithmetic with fewer
 * slow instructions, never from changing it.
 *
 * Three paths, one set of numbers: AVX-512 intrinsics; AVX2 intrinsics (8 lanes) for table lookups
 * (decoding, encoding), which compilers do not vectorize, and for Adam's and AdEMAMix's updates with exact division
 * (written once for both ISAs over vector.h); and portable loops, the reference, which compilers
 * vectorize for whatever they target (the other updates, block absmax, fp8 encoding, bf16
 * conversion) and which serve as the other paths' tails. In those, a select is written as a mask or
 * a value choice, never as a branch around arithmetic: GCC will not if-convert a branch around an
 * operation that may trap, and the loop then stays scalar.
 *
 * One concern per file, in the order they build on each other:
 *   abi.h        the structures Python fills, declared once, and their exported layout table
 *   convert.h    fp32 bits, bf16 and fp8 e4m3 conversions
 *   vector.h     fp32 vectors of either ISA for the loops written by hand (AVX-512, AVX2)
 *   divide.h     exact division by a shared divisor (with vector.h)
 *   lookup.h     AVX2 table lookups: gathers, or scalar loads where gathers are slow
 *   affine.h     AVX-512 8-bit codes without gathers: a codebook as a piecewise affine map
 *   codecs.h     one block: decode, block scale, nearest-code encoding, calibrated scales
 *   stochastic.h one block: stochastic rounding between codes
 *   factored.h   factored states: rows and columns summed in double, per task
 *   block_float.h block floating-point states (10bit-sr, 8bit-log): a small float per value, rounded stochastically
 *   chunk_io.h   one chunk of any kind as fp32: load before the update, store after
 *   update.h     the update stage's interface (chunk_t, optimizer_t) and helpers
 *   update_*.h   one optimizer's update each (update_assign.h: the encoders as an update)
 *   scheduler.h  chunks, tasks and the OpenMP loop
 *   products.h   the low-rank states' matrix products, in one summation order
 *   orthonormal.h the low-rank states' QR, in one order
 *   test_hooks.h entry points for the tests
 * This file lists the optimizers and exports the entry points.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_ONLY 1  /* the AVX2 + FMA build (every AVX2 CPU has FMA); AVX2 alone takes the portable loops */
#endif

#include "abi.h"
#include "convert.h"
#include "vector.h"
#include "divide.h"
#include "lookup.h"
#include "affine.h"
#include "codecs.h"
#include "factored.h"
#include "block_float.h"
#include "chunk_io.h"
#include "update.h"
#include "update_adam.h"
#include "update_sgd.h"
#include "update_lion.h"
#include "update_ademamix.h"
#include "update_muon.h"
#include "update_assign.h"
#include "scheduler.h"
#include "products.h"
#include "orthonormal.h"
#include "test_hooks.h"

/* The optimizers: name (fused_cpu's), hyper-parameter struct and its fields, state names (in
 * param_t.state's order), how many of them are required, whether it takes bf16 states in place,
 * per-step scalars, prepare, update. */
#define OPTIMIZERS(OPTIMIZER) \
    OPTIMIZER(adam, adam_hyper_t, ADAM_HYPER_FIELDS, "exp_avg,exp_avg_sq,max_exp_avg_sq", 2, 1, adam_scalars_t, adam_prepare, adam_update) \
    OPTIMIZER(sgd, sgd_hyper_t, SGD_HYPER_FIELDS, "momentum_buffer", 0, 1, sgd_scalars_t, sgd_prepare, sgd_update) \
    OPTIMIZER(lion, lion_hyper_t, LION_HYPER_FIELDS, "exp_avg", 1, 1, lion_scalars_t, lion_prepare, lion_update) \
    OPTIMIZER(ademamix, ademamix_hyper_t, ADEMAMIX_HYPER_FIELDS, "exp_avg,exp_avg_slow,exp_avg_sq", 3, 1, ademamix_scalars_t, ademamix_prepare, ademamix_update) \
    OPTIMIZER(muon, muon_hyper_t, MUON_HYPER_FIELDS, "momentum_buffer", 1, 1, muon_scalars_t, muon_prepare, muon_update) \
    OPTIMIZER(assign, assign_hyper_t, ASSIGN_HYPER_FIELDS, "state", 1, 0, assign_scalars_t, assign_prepare, assign_update)

#define OPTIMIZER_ROW(name, hyper, FIELDS, states, required, bf16, scalars, prepare, update) \
    {#name, #hyper, states, required, bf16, sizeof(scalars), prepare, update},
static const optimizer_t optimizers[] = {OPTIMIZERS(OPTIMIZER_ROW)};
#define OPTIMIZER_COUNT ((int64_t)(sizeof(optimizers) / sizeof(optimizers[0])))

/* Steps every parameter once with optimizer number `optimizer` (lowbit_abi_optimizer's order);
 * hyper points to its hyper-parameter struct. Returns 0; nothing was stepped where 1: out of memory,
 * 2: chunks larger than MAX_CHUNK; -1: no such optimizer. */
int lowbit_step(int64_t optimizer, param_t *params, int64_t count, const void *hyper, int threads) {
    if (optimizer < 0 || optimizer >= OPTIMIZER_COUNT) return -1;
    return step_params(&optimizers[optimizer], params, count, hyper, threads);
}

/* ---- the layout table (abi.h), read by kernel_abi.py when the library loads -------------------- */

#define HYPER_ROWS(name, hyper, FIELDS, ...) ABI_FIELD_ROWS(hyper, FIELDS)
static const abi_field_t abi_fields[] = {ABI_FIELD_ROWS(state_t, STATE_FIELDS) ABI_FIELD_ROWS(param_t, PARAM_FIELDS) ABI_FIELD_ROWS(affine_code_t, AFFINE_FIELDS) ABI_FIELD_ROWS(buckets_t, BUCKET_FIELDS) OPTIMIZERS(HYPER_ROWS)};

/* Row i of the field table (a struct's own size is the row with field ""); 0 past the end. */
int lowbit_abi_field(int64_t i, const char **structure, const char **field, const char **type, int64_t *offset, int64_t *size, int64_t *count) {
    if (i < 0 || i >= (int64_t)(sizeof(abi_fields) / sizeof(abi_fields[0]))) return 0;
    const abi_field_t *f = &abi_fields[i];
    *structure = f->structure, *field = f->field, *type = f->type, *offset = f->offset, *size = f->size, *count = f->count;
    return 1;
}

#define KIND_ROW(id, name) {"kind", name, KIND_##id},
static const struct {
    const char *group, *name;
    int64_t value;
} abi_constants[] = {KINDS(KIND_ROW){"limit", "max_chunk", MAX_CHUNK}, {"limit", "max_states", MAX_STATES}};

/* Constant i: the kinds by KernelLayout's names, and limits; 0 past the end. */
int lowbit_abi_constant(int64_t i, const char **group, const char **name, int64_t *value) {
    if (i < 0 || i >= (int64_t)(sizeof(abi_constants) / sizeof(abi_constants[0]))) return 0;
    *group = abi_constants[i].group, *name = abi_constants[i].name, *value = abi_constants[i].value;
    return 1;
}

/* Optimizer i: its name, hyper-parameter struct, state names and number of required states; 0 past
 * the end. */
int lowbit_abi_optimizer(int64_t i, const char **name, const char **hyper_struct, const char **state_names, int64_t *required) {
    if (i < 0 || i >= OPTIMIZER_COUNT) return 0;
    const optimizer_t *o = &optimizers[i];
    *name = o->name, *hyper_struct = o->hyper_struct, *state_names = o->state_names, *required = o->required;
    return 1;
}
