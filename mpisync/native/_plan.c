/* A table step's row update straight from its taken pieces, in one pass over the rows.
 *
 * A step's gradient for a shard is its taken pieces: rows of ids, and pooled bags (each
 * position ``i`` adds ``weights[i] * grads[bag[i]]`` to its id's row). Each distinct id's
 * gradient row is its first row copied and the later ones added, in the pieces' order.
 * Summing every id's row into one buffer and then running the optimizer over it would
 * pass twice over memory as large as the rows updated (three times for Adagrad, whose
 * new sums torch's square root reads and writes again). A plan (``plankernels.plan``)
 * says instead, for each distinct id ``u`` (``ids[u]``, in first-seen order), which rows
 * of the pieces make its gradient, in that order: ``grads[src[e]] * wt[e]`` for ``e`` in
 * ``start[u] .. start[u + 1] - 1`` (a row without weight is ``g * 1``, which is ``g``).
 * Each update kernel sums a few ids' rows into a small buffer that stays in cache and
 * updates them at once, with the products, sums and optimizer steps of ``_rows.c``'s
 * kernels in their order: the results are bitwise theirs on the summed rows. Compiled
 * with ``_rows.c``; kernels over [lo, hi) of the distinct ids, for the ps's threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "_rowmath.h"

#define PLAN_AHEAD 8
#define PLAN_BLOCK 16

/* torch's square root over n elements (MKL's ``v?Sqrt`` with torch's mode), or NULL: C's. */
typedef void (*sqrt_f32_fn)(int, const float *, float *, long long);
typedef void (*sqrt_f64_fn)(int, const double *, double *, long long);

/* ``start`` (count + 1 entries), ``src`` and ``swt`` (total each) from ``pos``
 * (``scatter_marks``' output rows, ``~row`` at an id's first sight), ``grow`` and ``wt``
 * (each position's row of the pieces and its weight): output row ``s``'s positions' rows
 * and weights, in order, at ``start[s] .. start[s + 1] - 1``. */
void plan_order(int64_t total, const int64_t *pos, const int64_t *grow, const void *wt,
                int64_t size, int64_t count, int64_t *start, int64_t *src, void *swt)
{
    for (int64_t u = 0; u <= count; u++)
        start[u] = 0;
    for (int64_t i = 0; i < total; i++) {
        int64_t s = pos[i] < 0 ? ~pos[i] : pos[i];
        start[s + 1]++;
    }
    for (int64_t u = 0; u < count; u++)
        start[u + 1] += start[u];
    for (int64_t i = 0; i < total; i++) {      /* start[s] runs ahead, then is put back */
        int64_t s = pos[i] < 0 ? ~pos[i] : pos[i];
        int64_t e = start[s]++;
        src[e] = grow[i];
        if (size == 4)
            ((float *)swt)[e] = ((const float *)wt)[i];
        else
            ((double *)swt)[e] = ((const double *)wt)[i];
    }
    for (int64_t u = count; u > 0; u--)
        start[u] = start[u - 1];
    start[0] = 0;
}

/* ``call`` (naming HOW, and ``o``: a buffer of ``count`` T, freed after) with the ``how`` */
/* of ``div``; the kernel returns 0, or -1 where there is no memory for the buffer. */
#define WITH_BUFFER(T, count, call)                                                          \
    do {                                                                                     \
        T *o = malloc((size_t)(count) * sizeof(T));                                          \
        if (!o)                                                                              \
            return -1;                                                                       \
        DISPATCH(call);                                                                      \
        free(o);                                                                             \
        return 0;                                                                            \
    } while (0)

ROW_INLINE void plan_prefetch(const void *row, int64_t nbytes)
{
    const char *p = (const char *)row;
    for (int64_t at = 0; at < nbytes; at += 64)
        __builtin_prefetch(p + at, 1, 3);
}

#define PLAN_KERNELS(T, S)                                                                   \
/* Output row u's gradient into o (its first row, then each later one added); the rows of */ \
/* output row u + PLAN_AHEAD / 2 are fetched meanwhile. */                                   \
ROW_INLINE void plan_grad_##S(int64_t u, int64_t hi, const int64_t *start,                   \
                           const int64_t *src, const T *wt, const T *grads,                  \
                              int64_t dim, T *o)                                             \
{                                                                                            \
    if (u + PLAN_AHEAD / 2 < hi)                                                             \
        for (int64_t f = start[u + PLAN_AHEAD / 2]; f < start[u + PLAN_AHEAD / 2 + 1]; f++)  \
            plan_prefetch(grads + src[f] * dim, dim * (int64_t)sizeof(T));                   \
    int64_t e = start[u], end = start[u + 1];                                                \
    const T *g = grads + src[e] * dim;                                                       \
    T w = wt[e];                                                                             \
    for (int64_t c = 0; c < dim; c++)                                                        \
        o[c] = g[c] * w;                                                                     \
    for (e++; e < end; e++) {                                                                \
        g = grads + src[e] * dim;                                                            \
        w = wt[e];                                                                           \
        for (int64_t c = 0; c < dim; c++) {                                                  \
            T prod = g[c] * w;                                                               \
            o[c] = o[c] + prod;                                                              \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The square root the Adagrad kernel takes, in place over n elements (``root``, or C's): */ \
/* ``plankernels.torch_sqrt`` compares it with torch's. */                                   \
void plan_sqrt_##S(int64_t n, T *x, void *root, long long mode)                              \
{                                                                                            \
    if (root)                                                                                \
        ((sqrt_##S##_fn)root)((int)n, x, x, mode);                                           \
    else                                                                                     \
        for (int64_t c = 0; c < n; c++)                                                      \
            x[c] = SQRT_##S(x[c]);                                                           \
}                                                                                            \
                                                                                             \
/* The gradient rows of [lo, hi), written (for an optimizer without a planned kernel). */    \
ROW_INLINE void plan_rows_body_##S(int64_t lo, int64_t hi, const int64_t *start,             \
                                   const int64_t *src, const T *wt, const T *grads,          \
                                   int64_t dim, T *out)                                      \
{                                                                                            \
    for (int64_t u = lo; u < hi; u++)                                                        \
        plan_grad_##S(u, hi, start, src, wt, grads, dim, out + u * dim);                     \
}                                                                                            \
                                                                                             \
void plan_rows_##S(int64_t lo, int64_t hi, const int64_t *start, const int64_t *src,         \
                   const T *wt, const T *grads, int64_t dim, T *out)                         \
{                                                                                            \
    BY_DIM_##S(plan_rows_body_##S(lo, hi, start, src, wt, grads, DIM, out));                 \
}                                                                                            \
                                                                                             \
/* ``axpy_rows`` on the output rows [lo, hi): param[id] = fma(alpha, sign * (g / div),     */ \
/* param[id]).                                                                              */ \
ROW_INLINE void plan_axpy_body_##S(int64_t lo, int64_t hi, const int64_t *ids,               \
 const int64_t *start, const int64_t *src, const T *wt,                                      \
 const T *grads, int64_t dim, int how, T div, T inv, T sign, T alpha, T *param, T *o)        \
{                                                                                            \
    for (int64_t u = lo; u < hi; u++) {                                                      \
        if (u + PLAN_AHEAD < hi)                                                             \
            plan_prefetch(param + ids[u + PLAN_AHEAD] * dim, dim * (int64_t)sizeof(T));      \
        plan_grad_##S(u, hi, start, src, wt, grads, dim, o);                                 \
        axpy_row_##S(o, param + ids[u] * dim, dim, how, div, inv, sign, alpha);                \
    }                                                                                        \
}                                                                                            \
                                                                                             \
int plan_axpy_##S(int64_t lo, int64_t hi, const int64_t *ids, const int64_t *start,          \
                  const int64_t *src, const T *wt, const T *grads,                           \
                  int64_t dim, T div, T sign, T alpha, T *param)                             \
{                                                                                            \
    WITH_BUFFER(T, dim,                                                                      \
                BY_DIM_##S(plan_axpy_body_##S(lo, hi, ids, start, src, wt, grads, DIM, HOW,  \
                                              div, (T)1 / div, sign, alpha, param, o)));     \
}                                                                                            \
                                                                                             \
/* ``adagrad_sum_rows``, torch's square root and ``adagrad_apply_rows`` on the output rows */ \
/* [lo, hi), PLAN_BLOCK at a time: x = sign * (g / div); sum[id] += x * x;                */ \
/* param[id] = fma(alpha, x / (sqrt(sum[id]) + eps), param[id]).                           */ \
ROW_INLINE void plan_adagrad_body_##S(int64_t lo, int64_t hi, const int64_t *ids,            \
 const int64_t *start, const int64_t *src, const T *wt,                                      \
 const T *grads, int64_t dim, int how, T div, T inv, T sign, T eps, T alpha, T *sum,         \
 T *param, sqrt_##S##_fn root, long long mode, T *o, T *d)                                   \
{                                                                                            \
    for (int64_t b = lo; b < hi; b += PLAN_BLOCK) {                                          \
        int64_t m = hi - b < PLAN_BLOCK ? hi - b : PLAN_BLOCK;                               \
        for (int64_t l = 0; l < m; l++) {                                                    \
            int64_t u = b + l;                                                               \
            if (u + PLAN_AHEAD < hi) {                                                       \
                plan_prefetch(sum + ids[u + PLAN_AHEAD] * dim, dim * (int64_t)sizeof(T));    \
                plan_prefetch(param + ids[u + PLAN_AHEAD] * dim, dim * (int64_t)sizeof(T));  \
            }                                                                                \
            plan_grad_##S(u, hi, start, src, wt, grads, dim, o + l * dim);                   \
            adagrad_sum_row_##S(o + l * dim, sum + ids[u] * dim, d + l * dim, dim, how, div, \
                                inv, sign);                                                  \
        }                                                                                    \
        plan_sqrt_##S(m * dim, d, (void *)root, mode);                                       \
        for (int64_t l = 0; l < m; l++)                                                      \
            adagrad_apply_row_##S(o + l * dim, d + l * dim, param + ids[b + l] * dim, dim, how, \
                                  div, inv, sign, eps, alpha);                               \
    }                                                                                        \
}                                                                                            \
                                                                                             \
int plan_adagrad_##S(int64_t lo, int64_t hi, const int64_t *ids, const int64_t *start,       \
                     const int64_t *src, const T *wt, const T *grads,                        \
                     int64_t dim, T div, T sign, T eps, T alpha, T *sum, T *param,           \
                     void *root, long long mode)                                             \
{                                                                                            \
    WITH_BUFFER(T, 2 * PLAN_BLOCK * dim,                                                     \
                BY_DIM_##S(plan_adagrad_body_##S(lo, hi, ids, start, src, wt, grads, DIM,    \
                                                 HOW, div, (T)1 / div, sign, eps, alpha,     \
                                                 sum, param, (sqrt_##S##_fn)root, mode, o,   \
                                                 o + PLAN_BLOCK * dim)));                    \
}                                                                                            \
                                                                                             \
/* ``rowwise_rows`` on the output rows [lo, hi), PLAN_BLOCK at a time (its BLOCK's steps   */ \
/* per row, in its order: squares, accumulator, multiplier, update).                       */ \
ROW_INLINE void plan_rowwise_body_##S(int64_t lo, int64_t hi, const int64_t *ids,            \
 const int64_t *start, const int64_t *src, const T *wt,                                      \
 const T *grads, int64_t dim, int how, T div, T inv, T sign, T lr, T eps, T *total,          \
 T *param, T *o)                                                                             \
{                                                                                            \
    T mult[PLAN_BLOCK];                                                                      \
    for (int64_t b = lo; b < hi; b += PLAN_BLOCK) {                                          \
        int64_t m = hi - b < PLAN_BLOCK ? hi - b : PLAN_BLOCK;                               \
        for (int64_t l = 0; l < m; l++) {                                                    \
            int64_t u = b + l;                                                               \
            if (u + PLAN_AHEAD < hi) {                                                       \
                plan_prefetch(param + ids[u + PLAN_AHEAD] * dim, dim * (int64_t)sizeof(T));  \
                __builtin_prefetch(total + ids[u + PLAN_AHEAD], 1, 3);                       \
            }                                                                                \
            plan_grad_##S(u, hi, start, src, wt, grads, dim, o + l * dim);                   \
            mult[l] = squares_##S(o + l * dim, dim, how, div, inv, sign);                    \
        }                                                                                    \
        for (int64_t l = 0; l < m; l++)                                                      \
            mult[l] = rowwise_mult_##S(total + ids[b + l], mult[l], dim, lr, eps);             \
        for (int64_t l = 0; l < m; l++)                                                      \
            rowwise_apply_row_##S(o + l * dim, param + ids[b + l] * dim, dim, how, div, inv, \
                                  sign, mult[l]);                                            \
    }                                                                                        \
}                                                                                            \
                                                                                             \
int plan_rowwise_##S(int64_t lo, int64_t hi, const int64_t *ids, const int64_t *start,       \
                     const int64_t *src, const T *wt, const T *grads,                        \
                     int64_t dim, T div, T sign, T lr, T eps, T *total, T *param)            \
{                                                                                            \
    WITH_BUFFER(T, PLAN_BLOCK * dim,                                                         \
                BY_DIM_##S(plan_rowwise_body_##S(lo, hi, ids, start, src, wt, grads, DIM,    \
                                                 HOW, div, (T)1 / div, sign, lr, eps, total, \
                                                 param, o)));                                \
}

SQUARES(float, f32)
SQUARES(double, f64)
ROW_STEPS(float, f32)
ROW_STEPS(double, f64)

PLAN_KERNELS(float, f32)
PLAN_KERNELS(double, f64)
