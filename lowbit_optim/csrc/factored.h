/* Factored states (factored.py): a second moment kept as the row and column sums of its
 * (numel / cols, cols) matrix. A chunk is whole rows; a value reads as row * (col / total) + zero.
 *
 * Rows and columns are summed in double, in an order that does not depend on the threads or the
 * vector width: a parameter's chunks are split into at most MAX_TASKS tasks (scheduler.h), each
 * with its own running column sums, added in task order at the end of the step. */
#include <float.h>
#include <stdlib.h>

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

/* The values of the rows starting at element start (n elements, whole rows) into buffer. A 1-D
 * state (one column) in one flat loop, which compilers vectorize: the nested one with rows of one
 * element made its step about 5x slower per element. */
static void load_factored(const state_t *s, int64_t start, int64_t n, float *buffer) {
    const float *row = (const float *)s->data + start / s->cols;
    if (s->cols == 1) {
        float scaled = s->col_scaled[0], zero = s->zero;
        for (int64_t r = 0; r < n; r++) buffer[r] = row[r] * scaled + zero;
        return;
    }
    for (int64_t r = 0; r * s->cols < n; r++)
        for (int64_t c = 0; c < s->cols; c++) buffer[r * s->cols + c] = row[r] * s->col_scaled[c] + s->zero;
}

/* The new values x of those rows: their row sums, and their columns added to col_sums (the running
 * column sums of the chunk's task). A 1-D state's row sums are its values (sum_of one value: v +
 * 0, so -0 becomes +0), and its column's share is the chunk's sum_of. */
static void store_factored(const state_t *s, int64_t start, int64_t n, const float *x, double *col_sums) {
    float *row = (float *)s->data + start / s->cols;
    if (s->cols == 1) {
        for (int64_t r = 0; r < n; r++) row[r] = x[r] + 0.0f;
        col_sums[0] += sum_of(x, n);
        return;
    }
    for (int64_t r = 0; r * s->cols < n; r++) {
        const float *values = x + r * s->cols;
        row[r] = (float)sum_of(values, s->cols);
        for (int64_t c = 0; c < s->cols; c++) col_sums[c] += (double)values[c];
    }
}

/* The floats kept for col / total in a factored state's scratch: cols, rounded up so that the
 * column sums (doubles) after them align */
static int64_t scaled_floats(const state_t *s) { return (s->cols + 1) / 2 * 2; }

/* The scratch a factored state needs for one step of `tasks` tasks: col / total, then each task's
 * column sums (none for another kind of state) */
static size_t factored_scratch_bytes(const state_t *s, int64_t tasks) {
    if (s->kind != KIND_FACTORED) return 0;
    return (size_t)scaled_floats(s) * sizeof(float) + (size_t)(tasks * s->cols) * sizeof(double);
}

/* A factored state's fields for one step, in the scratch at *next (factored_scratch_bytes of it):
 * col / total (total = the column sums' sum, 1 where it is 0, as factored.py reads it) and each
 * task's column sums (zeroed by the task itself: start_factored_task). */
static void begin_factored(state_t *s, int64_t tasks, char **next) {
    s->col_scaled = NULL;
    s->col_sums = NULL;
    if (s->kind != KIND_FACTORED) return;
    s->col_scaled = (float *)*next;
    s->col_sums = (double *)(s->col_scaled + scaled_floats(s));
    *next += factored_scratch_bytes(s, tasks);
    float total = (float)sum_of(s->col, s->cols);
    if (total == 0.0f) total = 1.0f;  /* as factored.py's _total: zeros read as zeros, NaN stays NaN */
    for (int64_t c = 0; c < s->cols; c++) s->col_scaled[c] = s->col[c] / total;
    s->zero = total - total;
}

/* A task's running column sums start at zero (written by the thread that steps the task) */
static void start_factored_task(const state_t *s, int64_t task) {
    if (s->kind == KIND_FACTORED) memset(s->col_sums + task * s->cols, 0, (size_t)s->cols * sizeof(double));
}

/* After the step: the new column sums, the tasks' sums added in task order (ok: the step ran). */
static void end_factored(state_t *s, int64_t tasks, int ok) {
    if (s->kind != KIND_FACTORED || !s->col_sums) return;
    if (ok)
        for (int64_t c = 0; c < s->cols; c++) {
            double sum = 0;
            for (int64_t i = 0; i < tasks; i++) sum += s->col_sums[i * s->cols + c];
            s->col[c] = (float)sum;
        }
    s->col_scaled = NULL;
    s->col_sums = NULL;
}
