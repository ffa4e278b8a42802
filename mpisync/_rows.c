/* Row kernels of a table shard on the ps: linear passes over the taken rows, no sort of
 * rows, no per-row allocation. Compiled by mpisync/kernels.py (cc -O3 -ffp-contract=off:
 * every product and sum rounds on its own, in the order written here, as torch's kernels
 * of the same operations do). ``slot`` is a per-shard int64 array, -1 everywhere between
 * calls: each function leaves it so. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The distinct ids of ``ids`` (n of them, each in [0, rows)), in first-seen order, into
 * ``uniq``; their count is returned. ``slot`` is marked for each; ``unmark`` clears it. */
int64_t mark_ids(int64_t n, const int64_t *ids, int64_t *slot, int64_t *uniq)
{
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = ids[i];
        if (slot[r] < 0) {
            slot[r] = count;
            uniq[count++] = r;
        }
    }
    return count;
}

void unmark(int64_t n, const int64_t *uniq, int64_t *slot)
{
    for (int64_t j = 0; j < n; j++)
        slot[uniq[j]] = -1;
}

/* ``slot[sorted[j]] = j``: the position of each distinct id in sorted order. */
void place(int64_t n, const int64_t *sorted, int64_t *slot)
{
    for (int64_t j = 0; j < n; j++)
        slot[sorted[j]] = j;
}

#define KERNELS(T, S)                                                                        \
/* out[slot[ids[i]]] += weights[i] * grads[bag[i]], in the order of i, into a zeroed out. */ \
void bag_rows_##S(int64_t n, const int64_t *ids, const int64_t *bag, const T *weights,       \
                  const T *grads, int64_t dim, const int64_t *slot, T *out)                  \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T *o = out + slot[ids[i]] * dim;                                                     \
        const T *g = grads + bag[i] * dim;                                                   \
        if (weights) {                                                                       \
            T w = weights[i];                                                                \
            for (int64_t c = 0; c < dim; c++) {                                              \
                T prod = g[c] * w;                                                           \
                o[c] = o[c] + prod;                                                          \
            }                                                                                \
        } else {                                                                             \
            for (int64_t c = 0; c < dim; c++)                                                \
                o[c] = o[c] + g[c];                                                          \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Adagrad's accumulator on rows: x = sign * grad; sum[id] += x * x; out = the new sum[id] */ \
/* (torch then takes out's square root, adds eps and divides: its sqrt is its own). */     \
void adagrad_sum_rows_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim, T sign,\
                          T *sum, T *out)                                                    \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T *s = sum + ids[i] * dim;                                                           \
        const T *g = grad + i * dim;                                                         \
        T *o = out + i * dim;                                                                \
        for (int64_t c = 0; c < dim; c++) {                                                  \
            T x = g[c] * sign;                                                               \
            T sq = x * x;                                                                    \
            T acc = s[c] + sq;                                                               \
            s[c] = acc;                                                                      \
            o[c] = acc;                                                                      \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Adagrad's update once torch took the square root: x = sign * grad;                     */ \
/* param[id] = fma(alpha, x / (std + eps), param[id]), as torch's per-row axpy rounds. */    \
void adagrad_apply_rows_##S(int64_t n, const int64_t *ids, const T *grad, const T *std,     \
                            int64_t dim, T sign, T eps, T alpha, T *param)                   \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T *p = param + ids[i] * dim;                                                         \
        const T *g = grad + i * dim;                                                         \
        const T *d = std + i * dim;                                                          \
        for (int64_t c = 0; c < dim; c++) {                                                  \
            T x = g[c] * sign;                                                               \
            T den = d[c] + eps;                                                              \
            p[c] = FMA_##S(alpha, x / den, p[c]);                                            \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* param[id] = fma(alpha, sign * grad, param[id]): torch's dense += alpha * sparse. */       \
void axpy_rows_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim, T sign,        \
                   T alpha, T *param)                                                        \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T *p = param + ids[i] * dim;                                                         \
        const T *g = grad + i * dim;                                                         \
        for (int64_t c = 0; c < dim; c++)                                                    \
            p[c] = FMA_##S(alpha, g[c] * sign, p[c]);                                        \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Two pieces of sorted distinct ids merged: each id once, in order; a's row, plus b's    */ \
/* where both have it; divided by ``div`` unless it is 0. Returns the ids written. */        \
int64_t merge2_rows_##S(int64_t na, const int64_t *ida, const T *ra, int64_t nb,            \
                        const int64_t *idb, const T *rb, int64_t dim, T div,                 \
                        int64_t *ids, T *out)                                                \
{                                                                                            \
    int64_t i = 0, j = 0, k = 0;                                                             \
    while (i < na || j < nb) {                                                               \
        T *o = out + k * dim;                                                                \
        if (j >= nb || (i < na && ida[i] < idb[j])) {                                        \
            ids[k] = ida[i];                                                                 \
            memcpy(o, ra + i * dim, (size_t)dim * sizeof(T));                                \
            i++;                                                                             \
        } else if (i >= na || idb[j] < ida[i]) {                                             \
            ids[k] = idb[j];                                                                 \
            memcpy(o, rb + j * dim, (size_t)dim * sizeof(T));                                \
            j++;                                                                             \
        } else {                                                                             \
            const T *a = ra + i * dim, *b = rb + j * dim;                                    \
            ids[k] = ida[i];                                                                 \
            for (int64_t c = 0; c < dim; c++)                                                \
                o[c] = a[c] + b[c];                                                          \
            i++;                                                                             \
            j++;                                                                             \
        }                                                                                    \
        if (div != 0)                                                                        \
            for (int64_t c = 0; c < dim; c++)                                                \
                o[c] = o[c] / div;                                                           \
        k++;                                                                                 \
    }                                                                                        \
    return k;                                                                                \
}                                                                                            \
                                                                                             \
/* Row-wise Adagrad's update once torch made each row's multiplier (negated):             */ \
/* param[id] = param[id] + (sign * grad) * mult[i], as torch's index_add_ of the product. */ \
void rowwise_apply_rows_##S(int64_t n, const int64_t *ids, const T *grad, const T *mult,    \
                            int64_t dim, T sign, T *param)                                   \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T *p = param + ids[i] * dim;                                                         \
        const T *g = grad + i * dim;                                                         \
        T m = mult[i];                                                                       \
        for (int64_t c = 0; c < dim; c++) {                                                  \
            T prod = (g[c] * sign) * m;                                                      \
            p[c] = p[c] + prod;                                                              \
        }                                                                                    \
    }                                                                                        \
}

#define FMA_f32 fmaf
#define FMA_f64 fma

KERNELS(float, f32)
KERNELS(double, f64)
