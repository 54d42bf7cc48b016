/* assign: the state takes the gradient's values; the parameter stays as it is. Not an optimizer but
 * the kernel's encoders as an update, for a format that finishes its writes outside the kernel: a
 * low-rank state (LowRankState) gets its new values through its addend, fits its low-rank part to
 * them in Python and has the kernel encode the residual so (fused_cpu.step passes it as parameter
 * and gradient). No hyper-parameters, no per-step scalars. */

#define ASSIGN_HYPER_FIELDS(FIELD, ARRAY, S)
DECLARE_STRUCT(assign_hyper_t, ASSIGN_HYPER_FIELDS)

typedef struct {
    char none;
} assign_scalars_t;

static void assign_prepare(const void *hyper, float step, void *scalars) { (void)hyper, (void)step, (void)scalars; }

static void assign_update(const void *hyper, const void *scalars, const chunk_t *c) {
    (void)hyper, (void)scalars;
    memmove(c->state[0], c->grad, (size_t)c->n * sizeof(float));  /* a plain fp32 state may be its own gradient */
}
