/* Row kernels of a table shard on the ps: linear passes over the taken rows, no sort of
 * rows, no per-row allocation. Compiled by mpisync/native/rowslib.py (cc -O3 -ffp-contract=off:
 * every product and sum rounds on its own, in the order written here, as torch's kernels
 * of the same operations do). ``slot`` is a per-shard int64 array, -1 everywhere between
 * calls: each function leaves it so, or says who clears it. Rows are ``dim`` contiguous
 * elements; ids index rows of ``dim`` elements. Where a loop reads rows at random it
 * prefetches the rows it reads AHEAD iterations later (a shard is far larger than the
 * cache). ``div``: where not 0, each gradient element is divided by it first (the mean
 * of the taken gradients, kept as their sum until here). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define AHEAD 16
#define LANES 16
#define BLOCK 8
#define ROWS_AHEAD 8

/* x / div, where a kernel's ``how`` is 0 (no division), 1 (div a power of two: times its
 * exact inverse, bitwise the quotient) or 2 (divided). */
#define QUOT(x) (how == 0 ? (x) : how == 1 ? (x) * inv : (x) / div)

/* ``call`` (naming HOW) once with the ``how`` of ``div``, a constant there, so that the
 * compiler writes each loop without the test. */
#define DISPATCH(call)                                                                       \
    do {                                                                                     \
        int kind = how_of(div);                                                              \
        if (kind == 0) {                                                                     \
            enum { HOW = 0 };                                                                \
            call;                                                                            \
        } else if (kind == 1) {                                                              \
            enum { HOW = 1 };                                                                \
            call;                                                                            \
        } else {                                                                             \
            enum { HOW = 2 };                                                                \
            call;                                                                            \
        }                                                                                    \
    } while (0)

static inline int how_of(double div)
{
    int exp;
    if (div == 0)
        return 0;
    return frexp(div, &exp) == 0.5 && exp > -120 && exp < 120 ? 1 : 2;
}

static inline void prefetch_row(const void *row, int64_t nbytes)
{
    const char *p = (const char *)row;
    for (int64_t at = 0; at < nbytes; at += 64)
        __builtin_prefetch(p + at, 1, 3);
}

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

/* ``scatter``'s marks alone, for threads: each id's output row (its slot, given in first- */
/* seen order from ``count`` on, the id appended to ``uniq``) into ``pos[i]``, as ``~row``  */
/* at the id's first sight. Returns the new count; ``unmark`` clears the slots. */
int64_t scatter_marks(int64_t n, const int64_t *ids, int64_t *slot, int64_t *uniq,
                      int64_t count, int64_t *pos)
{
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(slot + ids[i + AHEAD], 1, 3);
        int64_t r = ids[i];
        int64_t s = slot[r];
        if (s < 0) {
            s = slot[r] = count;
            uniq[count++] = r;
            pos[i] = ~s;
        } else {
            pos[i] = s;
        }
    }
    return count;
}

/* ``merge2_rows``' order alone, for threads: the merged ids, and for each the row of a and
 * of b it takes (-1: none). Returns the ids written. */
int64_t merge2_plan(int64_t na, const int64_t *ida, int64_t nb, const int64_t *idb,
                    int64_t *ids, int64_t *from_a, int64_t *from_b)
{
    int64_t i = 0, j = 0, k = 0;
    while (i < na || j < nb) {
        if (j >= nb || (i < na && ida[i] < idb[j])) {
            ids[k] = ida[i];
            from_a[k] = i++;
            from_b[k] = -1;
        } else if (i >= na || idb[j] < ida[i]) {
            ids[k] = idb[j];
            from_a[k] = -1;
            from_b[k] = j++;
        } else {
            ids[k] = ida[i];
            from_a[k] = i++;
            from_b[k] = j++;
        }
        k++;
    }
    return k;
}

/* The positions 0..n-1 ordered by their shard, stably: torch.argsort(shard, stable=True)
 * by counting. Each shard[i] lies in [0, parts); ``counts`` (parts entries) gets each
 * shard's count, ``starts`` (parts entries) is scratch. */
void shard_order(int64_t n, const int64_t *shard, int64_t parts, int64_t *counts,
                 int64_t *starts, int64_t *order)
{
    memset(counts, 0, (size_t)parts * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++)
        counts[shard[i]]++;
    int64_t at = 0;
    for (int64_t k = 0; k < parts; k++) {
        starts[k] = at;
        at += counts[k];
    }
    for (int64_t i = 0; i < n; i++)
        order[starts[shard[i]]++] = i;
}

/* mpisync.protocol.partition.map_ids, then ``shard_order``: ``shard`` and ``local`` get each id's
 * shard and local row; ``order`` the positions by shard, stably; ``sorted_local`` the
 * local rows in that order. ``div``: 0 "mod" (shard id % parts, local id / parts), 1 "div"
 * (TensorFlow's contiguous ranges). Returns -1, having written nothing else, when an id
 * lies outside [0, num_rows); else 0. */
int64_t split_ids(int64_t n, const int64_t *ids, int64_t div, int64_t num_rows, int64_t parts,
               int64_t *counts, int64_t *starts, int64_t *shard, int64_t *local,
               int64_t *order, int64_t *sorted_local)
{
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_rows)
            return -1;
    if (!div) {
        if ((parts & (parts - 1)) == 0) {        /* a power of two: a mask and a shift */
            int64_t bits = 0;
            while (((int64_t)1 << bits) < parts)
                bits++;
            for (int64_t i = 0; i < n; i++) {
                shard[i] = ids[i] & (parts - 1);
                local[i] = ids[i] >> bits;
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                int64_t q = ids[i] / parts;
                shard[i] = ids[i] - q * parts;
                local[i] = q;
            }
        }
    } else {
        int64_t per = num_rows / parts, extras = num_rows % parts;
        for (int64_t i = 0; i < n; i++) {
            int64_t id = ids[i];
            int64_t a = id / (per + 1), b = (id - extras) / per;
            int64_t k = a > b ? a : b;
            shard[i] = k;
            local[i] = k < extras ? id % (per + 1) : (id - extras) % per;
        }
    }
    shard_order(n, shard, parts, counts, starts, order);
    for (int64_t i = 0; i < n; i++)
        sorted_local[i] = local[order[i]];
    return 0;
}

#define KERNELS(T, S)                                                                        \
/* out[slot[ids[i]]] += weights[i] * grads[bag[i]], in the order of i, into a zeroed out; */ \
/* only the output rows in [lo, hi) (a thread's share: every row's additions are its own). */ \
void bag_rows_##S(int64_t n, const int64_t *ids, const int64_t *bag, const T *weights,       \
                  const T *grads, int64_t dim, const int64_t *slot, int64_t lo, int64_t hi,  \
                  T *out)                                                                    \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        int64_t s = slot[ids[i]];                                                            \
        if (s < lo || s >= hi)                                                               \
            continue;                                                                        \
        T *o = out + s * dim;                                                                \
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
/* The taken rows of a step, summed per id into ``out`` in one pass: row ``i`` of a piece   */ \
/* goes to its id's slot, copied on the id's first sight (the id then appended to ``uniq``, */ \
/* ``count`` of them so far) and added after. A rows piece: ``rows[i]`` (bag NULL); a      */ \
/* pooled piece: ``weights[i] * grads[bag[i]]`` (weights NULL: 1). Returns the new count;   */ \
/* the caller clears the slots with ``unmark`` once every piece is in.                      */ \
int64_t scatter_##S(int64_t n, const int64_t *ids, const int64_t *bag, const T *weights,     \
                    const T *rows, int64_t dim, int64_t *slot, int64_t *uniq, int64_t count, \
                    T *out)                                                                  \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            __builtin_prefetch(slot + ids[i + AHEAD], 1, 3);                                 \
        int64_t r = ids[i];                                                                  \
        int64_t s = slot[r];                                                                 \
        const T *g = rows + (bag ? bag[i] : i) * dim;                                        \
        T w = weights ? weights[i] : (T)1;                                                   \
        if (s < 0) {                                                                         \
            s = slot[r] = count;                                                             \
            uniq[count++] = r;                                                               \
            T *o = out + s * dim;                                                            \
            if (weights)                                                                     \
                for (int64_t c = 0; c < dim; c++)                                            \
                    o[c] = g[c] * w;                                                         \
            else                                                                             \
                memcpy(o, g, (size_t)dim * sizeof(T));                                       \
        } else {                                                                             \
            T *o = out + s * dim;                                                            \
            if (weights)                                                                     \
                for (int64_t c = 0; c < dim; c++) {                                          \
                    T prod = g[c] * w;                                                       \
                    o[c] = o[c] + prod;                                                      \
                }                                                                            \
            else                                                                             \
                for (int64_t c = 0; c < dim; c++)                                            \
                    o[c] = o[c] + g[c];                                                      \
        }                                                                                    \
    }                                                                                        \
    return count;                                                                            \
}                                                                                            \
                                                                                             \
/* ``scatter`` in two passes, for threads: ``scatter_marks`` (once) gives each position   */ \
/* its output row ``pos[i]`` (``~row`` at the id's first sight); ``scatter_fill`` then     */ \
/* writes the output rows in [lo, hi) only, each with the copy and additions ``scatter``  */ \
/* makes, in the same order.                                                               */ \
void scatter_fill_##S(int64_t n, const int64_t *pos, const int64_t *bag, const T *weights,   \
                      const T *rows, int64_t dim, int64_t lo, int64_t hi, T *out)            \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        int64_t s = pos[i] < 0 ? ~pos[i] : pos[i];                                           \
        if (s < lo || s >= hi)                                                               \
            continue;                                                                        \
        const T *g = rows + (bag ? bag[i] : i) * dim;                                        \
        T w = weights ? weights[i] : (T)1;                                                   \
        T *o = out + s * dim;                                                                \
        if (pos[i] < 0) {                                                                    \
            if (weights)                                                                     \
                for (int64_t c = 0; c < dim; c++)                                            \
                    o[c] = g[c] * w;                                                         \
            else                                                                             \
                memcpy(o, g, (size_t)dim * sizeof(T));                                       \
        } else if (weights) {                                                                \
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
/* Each bag's sum of its rows: out[bag[i]] += weights[i] * rows[ids[i]], in the order of */ \
/* i, into a zeroed out (the pooled answer to a lookup); only the bags in [lo, hi).        */ \
void bag_sums_##S(int64_t n, const int64_t *ids, const int64_t *bag, const T *weights,       \
                  const T *rows, int64_t dim, int64_t lo, int64_t hi, T *out)                \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n && bag[i + AHEAD] >= lo && bag[i + AHEAD] < hi)                    \
            prefetch_row(rows + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));             \
        if (bag[i] < lo || bag[i] >= hi)                                                     \
            continue;                                                                        \
        const T *r = rows + ids[i] * dim;                                                    \
        T *o = out + bag[i] * dim;                                                           \
        if (weights) {                                                                       \
            T w = weights[i];                                                                \
            for (int64_t c = 0; c < dim; c++) {                                              \
                T prod = r[c] * w;                                                           \
                o[c] = o[c] + prod;                                                          \
            }                                                                                \
        } else {                                                                             \
            for (int64_t c = 0; c < dim; c++)                                                \
                o[c] = o[c] + r[c];                                                          \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* out[i] = rows[ids[i]] (a rows answer to a lookup, straight into its message). */         \
void gather_##S(int64_t n, const int64_t *ids, const T *rows, int64_t dim, T *out)          \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            prefetch_row(rows + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));             \
        memcpy(out + i * dim, rows + ids[i] * dim, (size_t)dim * sizeof(T));                 \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Adagrad's accumulator on rows: x = sign * (grad / div); sum[id] += x * x;               */ \
/* out = the new sum[id] (torch then takes out's square root: its sqrt is its own).        */ \
static inline void adagrad_sum_body_##S(int64_t n, const int64_t *ids, const T *grad,       \
                                        int64_t dim, int how, T div, T inv, T sign, T *sum,  \
                                        T *out)                                              \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            prefetch_row(sum + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));              \
        T *s = sum + ids[i] * dim;                                                           \
        const T *g = grad + i * dim;                                                         \
        T *o = out + i * dim;                                                                \
        for (int64_t c = 0; c < dim; c++) {                                                  \
            T x = QUOT(g[c]) * sign;                                                         \
            T sq = x * x;                                                                    \
            T acc = s[c] + sq;                                                               \
            s[c] = acc;                                                                      \
            o[c] = acc;                                                                      \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void adagrad_sum_rows_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim, T div, \
                          T sign, T *sum, T *out)                                            \
{                                                                                            \
    DISPATCH(adagrad_sum_body_##S(n, ids, grad, dim, HOW, div, (T)1 / div, sign, sum, out)); \
}                                                                                            \
                                                                                             \
/* Adagrad's update once torch took the square root: x = sign * (grad / div);             */ \
/* param[id] = fma(alpha, x / (std + eps), param[id]), as torch's per-row axpy rounds. */    \
static inline void adagrad_apply_body_##S(int64_t n, const int64_t *ids, const T *grad,     \
                                          const T *std, int64_t dim, int how, T div, T inv,  \
                                          T sign, T eps, T alpha, T *param)                  \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            prefetch_row(param + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));            \
        T *p = param + ids[i] * dim;                                                         \
        const T *g = grad + i * dim;                                                         \
        const T *d = std + i * dim;                                                          \
        for (int64_t c = 0; c < dim; c++) {                                                  \
            T x = QUOT(g[c]) * sign;                                                         \
            T den = d[c] + eps;                                                              \
            p[c] = FMA_##S(alpha, x / den, p[c]);                                            \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void adagrad_apply_rows_##S(int64_t n, const int64_t *ids, const T *grad, const T *std,     \
                            int64_t dim, T div, T sign, T eps, T alpha, T *param)            \
{                                                                                            \
    DISPATCH(adagrad_apply_body_##S(n, ids, grad, std, dim, HOW, div, (T)1 / div, sign, eps, \
                                    alpha, param));                                          \
}                                                                                            \
                                                                                             \
/* param[id] = fma(alpha, sign * (grad / div), param[id]): torch's dense += alpha * sparse. */\
static inline void axpy_body_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim,  \
                                 int how, T div, T inv, T sign, T alpha, T *param)           \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            prefetch_row(param + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));            \
        T *p = param + ids[i] * dim;                                                         \
        const T *g = grad + i * dim;                                                         \
        for (int64_t c = 0; c < dim; c++)                                                    \
            p[c] = FMA_##S(alpha, QUOT(g[c]) * sign, p[c]);                                  \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void axpy_rows_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim, T div, T sign, \
                   T alpha, T *param)                                                        \
{                                                                                            \
    DISPATCH(axpy_body_##S(n, ids, grad, dim, HOW, div, (T)1 / div, sign, alpha, param));    \
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
/* ``merge2_rows``' output rows [lo, hi) from its plan (``merge2_plan``: the row of a and  */ \
/* of b each output row takes, -1 for none), with the same copies, sums and divisions.    */ \
void merge2_fill_##S(int64_t lo, int64_t hi, const int64_t *from_a, const T *ra,            \
                     const int64_t *from_b, const T *rb, int64_t dim, T div, T *out)         \
{                                                                                            \
    for (int64_t k = lo; k < hi; k++) {                                                      \
        T *o = out + k * dim;                                                                \
        int64_t i = from_a[k], j = from_b[k];                                                \
        if (j < 0) {                                                                         \
            memcpy(o, ra + i * dim, (size_t)dim * sizeof(T));                                \
        } else if (i < 0) {                                                                  \
            memcpy(o, rb + j * dim, (size_t)dim * sizeof(T));                                \
        } else {                                                                             \
            const T *a = ra + i * dim, *b = rb + j * dim;                                    \
            for (int64_t c = 0; c < dim; c++)                                                \
                o[c] = a[c] + b[c];                                                          \
        }                                                                                    \
        if (div != 0)                                                                        \
            for (int64_t c = 0; c < dim; c++)                                                \
                o[c] = o[c] / div;                                                           \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Row-wise Adagrad on n rows (row ids[i], or row i where ids is NULL) with gradient rows  */ \
/* grad: g = sign * (grad / div); sum[id] += squares(g) / dim; mult = lr / (sqrt(sum[id]) */ \
/* + eps); param[id] += g * -mult. squares(g): LANES partial sums, lane j adding the       */ \
/* squares of columns j, j + LANES, ... in order, then halved: lane[j] += lane[j + h] for  */ \
/* h = LANES / 2, ..., 1; lane 0 is the sum (mpisync/tables/rowwise.py: same in torch).    */ \
/* BLOCK rows at a time: their squares, then their multipliers, then their updates.        */ \
static inline T squares_##S(const T *g, int64_t dim, int how, T div, T inv, T sign)          \
{                                                                                            \
    int64_t full = dim / LANES * LANES;                                                      \
    T lane[LANES];                                                                           \
    for (int64_t j = 0; j < LANES; j++)                                                      \
        lane[j] = 0;                                                                         \
    for (int64_t c = 0; c < full; c += LANES)                                                \
        for (int64_t j = 0; j < LANES; j++) {                                                \
            T x = QUOT(g[c + j]) * sign;                                                     \
            T sq = x * x;                                                                    \
            lane[j] = lane[j] + sq;                                                          \
        }                                                                                    \
    for (int64_t j = 0; full + j < dim; j++) {                                               \
        T x = QUOT(g[full + j]) * sign;                                                      \
        T sq = x * x;                                                                        \
        lane[j] = lane[j] + sq;                                                              \
    }                                                                                        \
    for (int64_t h = LANES / 2; h >= 1; h /= 2)                                              \
        for (int64_t j = 0; j < h; j++)                                                      \
            lane[j] = lane[j] + lane[j + h];                                                 \
    return lane[0];                                                                          \
}                                                                                            \
                                                                                             \
static inline void rowwise_block_##S(int64_t m, int64_t left, const int64_t *ids,           \
                                     int64_t first,                                          \
                                     const T *grad, int64_t dim, int how, T div, T inv,      \
                                     T sign, T lr, T eps, T *sum, T *param)                  \
{                                                                                            \
    T mult[BLOCK];                                                                           \
    for (int64_t l = 0; l < m; l++) {                                                        \
        if (ids && l + ROWS_AHEAD < left) {                                                  \
            prefetch_row(param + ids[l + ROWS_AHEAD] * dim, dim * (int64_t)sizeof(T));       \
            __builtin_prefetch(sum + ids[l + ROWS_AHEAD], 1, 3);                             \
        }                                                                                    \
        mult[l] = squares_##S(grad + l * dim, dim, how, div, inv, sign);                     \
    }                                                                                        \
    for (int64_t l = 0; l < m; l++) {                                                        \
        int64_t r = ids ? ids[l] : first + l;                                                \
        T total = sum[r] + mult[l] / (T)dim;                                                 \
        sum[r] = total;                                                                      \
        mult[l] = total;                                                                     \
    }                                                                                        \
    for (int64_t l = 0; l < m; l++) {                                                        \
        T std = SQRT_##S(mult[l]) + eps;                                                     \
        mult[l] = -(lr / std);                                                               \
    }                                                                                        \
    for (int64_t l = 0; l < m; l++) {                                                        \
        T *p = param + (ids ? ids[l] : first + l) * dim;                                     \
        const T *g = grad + l * dim;                                                         \
        for (int64_t c = 0; c < dim; c++) {                                                  \
            T x = QUOT(g[c]) * sign;                                                         \
            T prod = x * mult[l];                                                            \
            p[c] = p[c] + prod;                                                              \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void rowwise_rows_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim, T div,     \
                      T sign, T lr, T eps, T *sum, T *param)                                 \
{                                                                                            \
    for (int64_t i = 0; i < n; i += BLOCK) {                                                 \
        int64_t m = n - i < BLOCK ? n - i : BLOCK;                                           \
        const int64_t *at = ids ? ids + i : NULL;                                            \
        DISPATCH(rowwise_block_##S(m, n - i, at, i, grad + i * dim, dim, HOW, div, (T)1 / div,\
                                   sign, lr, eps, sum, param));                              \
    }                                                                                        \
}

#define FMA_f32 fmaf
#define FMA_f64 fma
#define SQRT_f32 sqrtf
#define SQRT_f64 sqrt

KERNELS(float, f32)
KERNELS(double, f64)

/* The ps's dense reduce: ``out`` = ``in[0]`` + ``in[1]`` + ... (in that order), times
 * ``inv`` where ``scale`` (the exact inverse of a power-of-two count: bitwise the
 * quotient), in one pass over memory for two gradients (torch: an add, a multiply and,
 * for the finiteness check, a sum: three). Returns whether every element of ``out`` is
 * finite. ``sum_but_last`` sums every gradient but the last into ``out`` (none for two)
 * and ``mean_at`` finishes element ``i`` (``dense_sgd`` below does the same). */
#define DENSE(T, S, U, EXPMASK)                                                              \
static inline const T *sum_but_last_##S(int64_t n, const T *const *in, int64_t k, T *out)   \
{                                                                                            \
    const T *a = in[0];                                                                      \
    for (int64_t j = 1; j + 1 < k; j++) {        /* all but the last: sums, in order */      \
        for (int64_t i = 0; i < n; i++)                                                      \
            out[i] = a[i] + in[j][i];                                                        \
        a = out;                                                                             \
    }                                                                                        \
    return a;                                                                                \
}                                                                                            \
                                                                                             \
static inline __attribute__((always_inline)) T                                              \
mean_at_##S(int64_t i, const T *a, const T *b, int scale, T inv, T *out, int store, U *bad) \
{                                                                                            \
    T x = b ? a[i] + b[i] : a[i];                                                            \
    if (scale)                                                                               \
        x = x * inv;                                                                         \
    if (store)                                                                               \
        out[i] = x;                                                                          \
    U bits;                                                                                  \
    memcpy(&bits, &x, sizeof bits);                                                          \
    *bad |= (bits & EXPMASK) == EXPMASK;                                                     \
    return x;                                                                                \
}                                                                                            \
                                                                                             \
static inline U last_pass_##S(int64_t n, const T *a, const T *b, int scale, T inv, T *out)  \
{                                                                                            \
    U bad = 0;                                                                               \
    for (int64_t i = 0; i < n; i++)                                                          \
        mean_at_##S(i, a, b, scale, inv, out, 1, &bad);                                         \
    return bad;                                                                              \
}                                                                                            \
                                                                                             \
int64_t dense_mean_##S(int64_t n, const T *const *in, int64_t k, int scale, T inv, T *out)  \
{                                                                                            \
    U bad;                                                                                   \
    if (k == 1) {                                                                            \
        bad = scale ? last_pass_##S(n, in[0], NULL, 1, inv, out)                             \
                    : last_pass_##S(n, in[0], NULL, 0, inv, out);                            \
        return !bad;                                                                         \
    }                                                                                        \
    const T *a = sum_but_last_##S(n, in, k, out);                                            \
    bad = scale ? last_pass_##S(n, a, in[k - 1], 1, inv, out)                                \
                : last_pass_##S(n, a, in[k - 1], 0, inv, out);                               \
    return !bad;                                                                             \
}

DENSE(float, f32, uint32_t, 0x7f800000u)
DENSE(double, f64, uint64_t, 0x7ff0000000000000ull)

/* The mean of ``k`` >= 2 gradients as ``dense_mean`` takes it (a power-of-two count, its
 * inverse ``inv``) and, in the same pass, torch.optim.SGD's update of the parameters
 * ``p`` with it (one trip through memory instead of two): for each element, torch's
 * operations in torch's order, each rounded as torch rounds it (its ``add_(x, alpha=a)``
 * is one fused multiply-add; ``kernels.sgd_exact`` checks that on this machine before the
 * ps uses this). ``wd`` (weight decay, when ``decay``) adds ``wd * p``; with ``buf`` (the
 * momentum buffer, already made) ``buf = buf * mom + damp1 * g`` and the step follows
 * ``buf``; then ``p += neg_lr * g``. ``out`` gets the mean as ``dense_mean`` writes it
 * where ``store`` (else it is only scratch: nothing reads a stepped bucket's mean, and
 * writing it is a quarter of the pass's memory traffic). Returns whether every mean is
 * finite (the parameters are updated either way). Each of the eight settings is compiled
 * on its own (vectorized). */
#define DENSE_SGD(T, S, U, FMA)                                                              \
static inline __attribute__((always_inline)) U                                               \
sgd_pass_##S(int64_t n, const T *a, const T *b, T inv, T *out, int store, T *restrict p,     \
             T *restrict buf, T neg_lr, int decay, T wd, T mom, T damp1)                     \
{                                                                                            \
    U bad = 0;                                                                               \
    _Pragma("GCC ivdep")                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T g = mean_at_##S(i, a, b, 1, inv, out, store, &bad);                                \
        if (decay)                                                                           \
            g = FMA(p[i], wd, g);                                                            \
        if (buf) {                                                                           \
            T v = buf[i] * mom;                                                              \
            g = buf[i] = FMA(g, damp1, v);                                                   \
        }                                                                                    \
        p[i] = FMA(g, neg_lr, p[i]);                                                         \
    }                                                                                        \
    return bad;                                                                              \
}                                                                                            \
                                                                                             \
static inline __attribute__((always_inline)) U                                               \
sgd_settings_##S(int64_t n, const T *a, const T *b, T inv, T *out, int store, T *p, T *buf,  \
                 T neg_lr, int decay, T wd, T mom, T damp1)                                  \
{                                                                                            \
    if (buf)                                                                                 \
        return decay ? sgd_pass_##S(n, a, b, inv, out, store, p, buf, neg_lr, 1, wd, mom,    \
                                    damp1)                                                   \
                     : sgd_pass_##S(n, a, b, inv, out, store, p, buf, neg_lr, 0, 0, mom,     \
                                    damp1);                                                  \
    return decay ? sgd_pass_##S(n, a, b, inv, out, store, p, NULL, neg_lr, 1, wd, 0, 0)      \
                 : sgd_pass_##S(n, a, b, inv, out, store, p, NULL, neg_lr, 0, 0, 0, 0);      \
}                                                                                            \
                                                                                             \
int64_t dense_sgd_##S(int64_t n, const T *const *in, int64_t k, T inv, T *out, int store,   \
                      T *p, T *buf, T neg_lr, int decay, T wd, T mom, T damp1)              \
{                                                                                            \
    const T *a = sum_but_last_##S(n, in, k, out), *b = in[k - 1];                            \
    U bad = store ? sgd_settings_##S(n, a, b, inv, out, 1, p, buf, neg_lr, decay, wd, mom,  \
                                     damp1)                                                  \
                  : sgd_settings_##S(n, a, b, inv, out, 0, p, buf, neg_lr, decay, wd, mom,  \
                                     damp1);                                                 \
    return !bad;                                                                             \
}

DENSE_SGD(float, f32, uint32_t, fmaf)
DENSE_SGD(double, f64, uint64_t, fma)

/* torch.optim.Adam's (and AdamW's) update as torch's single-tensor loop does it (without
 * amsgrad), in two passes around torch's own square root (``torch.sqrt`` calls MKL, whose
 * results are not always the correctly rounded ones a C ``sqrt`` gives; torch's
 * ``kernels.adam_exact`` checks the rest on this machine before the ps uses this). Each
 * element gets torch's operations in torch's order, each rounded as torch's kernels round
 * it. ``adam_moments``: the mean of ``k`` >= 2 gradients as ``dense_mean`` takes it, then
 * ``keep`` = 1 - lr * weight decay multiplies the parameter (``decoupled``: AdamW), or
 * ``g += wd * p`` (``decay``: Adam's weight decay, torch's ``add(p, alpha=wd)``, one fused
 * multiply-add); ``m.lerp_(g, w1)`` (a fused multiply-add from ``m`` when ``|w1| < 0.5``,
 * else from ``g``); ``v = v * b2`` then ``v += s2 * g * g`` (``addcmul_``: the first
 * product rounded, the second fused). Returns whether every element of ``out`` is finite.
 * ``adam_update``, with ``root`` = torch.sqrt(v): ``denom = root / bc2 + eps``, then
 * ``p += neg_step * m / denom`` (``addcdiv_``: each operation rounded). */
#define DENSE_ADAM(T, S, U, FMA)                                                             \
static inline __attribute__((always_inline)) U                                               \
moments_pass_##S(int64_t n, const T *a, const T *b, T inv, T *out, T *restrict p,            \
                 T *restrict m, T *restrict v, int decay, T wd, int decoupled, T keep,       \
                 int small, T w1, T b2, T s2)                                                \
{                                                                                            \
    U bad = 0;                                                                               \
    const T w1m1 = w1 - (T)1;                                                                \
    _Pragma("GCC ivdep")                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T g = mean_at_##S(i, a, b, 1, inv, out, 1, &bad);                                       \
        if (decoupled)                                                                       \
            p[i] = p[i] * keep;                                                              \
        else if (decay)                                                                      \
            g = FMA(p[i], wd, g);                                                            \
        T d = g - m[i];                                                                      \
        m[i] = small ? FMA(w1, d, m[i]) : FMA(w1m1, d, g);                                   \
        v[i] = FMA(s2 * g, g, v[i] * b2);                                                    \
    }                                                                                        \
    return bad;                                                                              \
}                                                                                            \
                                                                                             \
int64_t adam_moments_##S(int64_t n, const T *const *in, int64_t k, T inv, T *out, T *p,     \
                         T *m, T *v, int decay, T wd, int decoupled, T keep, int small,      \
                         T w1, T b2, T s2)                                                   \
{                                                                                            \
    const T *a = sum_but_last_##S(n, in, k, out), *b = in[k - 1];                            \
    U bad;                                                                                   \
    if (decoupled)                                                                           \
        bad = small ? moments_pass_##S(n, a, b, inv, out, p, m, v, 0, 0, 1, keep, 1, w1, b2, s2) \
                    : moments_pass_##S(n, a, b, inv, out, p, m, v, 0, 0, 1, keep, 0, w1, b2, s2);\
    else if (decay)                                                                          \
        bad = small ? moments_pass_##S(n, a, b, inv, out, p, m, v, 1, wd, 0, 1, 1, w1, b2, s2) \
                    : moments_pass_##S(n, a, b, inv, out, p, m, v, 1, wd, 0, 1, 0, w1, b2, s2);\
    else                                                                                     \
        bad = small ? moments_pass_##S(n, a, b, inv, out, p, m, v, 0, 0, 0, 1, 1, w1, b2, s2)  \
                    : moments_pass_##S(n, a, b, inv, out, p, m, v, 0, 0, 0, 1, 0, w1, b2, s2); \
    return !bad;                                                                             \
}                                                                                            \
                                                                                             \
void adam_update_##S(int64_t n, T *restrict p, const T *restrict m, const T *restrict root, \
                     T bc2, T eps, T neg_step)                                               \
{                                                                                            \
    for (int64_t i = 0; i < n; i++)                                                          \
        p[i] = p[i] + (neg_step * m[i]) / (root[i] / bc2 + eps);                             \
}

DENSE_ADAM(float, f32, uint32_t, fmaf)
DENSE_ADAM(double, f64, uint64_t, fma)

/* torch.optim.Adagrad's update as torch's single-tensor loop does it, in two passes around
 * torch's own square root (as Adam's above; ``kernels.adagrad_exact`` checks it on this
 * machine). ``adagrad_sums``: the mean of ``k`` >= 2 gradients as ``dense_mean`` takes it,
 * ``g += wd * p`` (``decay``: torch's ``add(p, alpha=wd)``, one fused multiply-add), then
 * ``sum += g * g`` (``addcmul_`` with value 1: one fused multiply-add). Returns whether
 * every element of ``out`` is finite. ``adagrad_update``, with ``root`` = torch.sqrt(sum)
 * and the mean in ``out`` (the parameters unchanged since, so ``g`` is made again):
 * ``p += neg_clr * g / (root + eps)`` (``addcdiv_``: each operation rounded). */
#define DENSE_ADAGRAD(T, S, U, FMA)                                                          \
static inline __attribute__((always_inline)) U                                               \
sums_pass_##S(int64_t n, const T *a, const T *b, T inv, T *out, const T *restrict p,         \
              T *restrict sum, int decay, T wd)                                              \
{                                                                                            \
    U bad = 0;                                                                               \
    _Pragma("GCC ivdep")                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T g = mean_at_##S(i, a, b, 1, inv, out, 1, &bad);                                       \
        if (decay)                                                                           \
            g = FMA(p[i], wd, g);                                                            \
        sum[i] = FMA(g, g, sum[i]);                                                          \
    }                                                                                        \
    return bad;                                                                              \
}                                                                                            \
                                                                                             \
int64_t adagrad_sums_##S(int64_t n, const T *const *in, int64_t k, T inv, T *out,           \
                         const T *p, T *sum, int decay, T wd)                                \
{                                                                                            \
    const T *a = sum_but_last_##S(n, in, k, out), *b = in[k - 1];                            \
    U bad = decay ? sums_pass_##S(n, a, b, inv, out, p, sum, 1, wd)                          \
                  : sums_pass_##S(n, a, b, inv, out, p, sum, 0, 0);                          \
    return !bad;                                                                             \
}                                                                                            \
                                                                                             \
static inline __attribute__((always_inline)) void                                           \
adagrad_pass_##S(int64_t n, T *restrict p, const T *restrict mean,                          \
                 const T *restrict root, int decay, T wd, T eps, T neg_clr)                  \
{                                                                                            \
    _Pragma("GCC ivdep")                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T g = decay ? FMA(p[i], wd, mean[i]) : mean[i];                                      \
        p[i] = p[i] + (neg_clr * g) / (root[i] + eps);                                       \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void adagrad_update_##S(int64_t n, T *p, const T *mean, const T *root, int decay, T wd,     \
                        T eps, T neg_clr)                                                    \
{                                                                                            \
    if (decay)                                                                               \
        adagrad_pass_##S(n, p, mean, root, 1, wd, eps, neg_clr);                             \
    else                                                                                     \
        adagrad_pass_##S(n, p, mean, root, 0, 0, eps, neg_clr);                              \
}

DENSE_ADAGRAD(float, f32, uint32_t, fmaf)
DENSE_ADAGRAD(double, f64, uint64_t, fma)

/* torch.optim.RMSprop's update as torch's single-tensor loop does it, in two passes around
 * torch's own square root (as Adam's above; ``kernels.rmsprop_exact`` checks it on this
 * machine). ``rmsprop_sums``: the mean of ``k`` >= 2 gradients as ``dense_mean`` takes it,
 * ``g += wd * p`` (``decay``: torch's ``add(p, alpha=wd)``, one fused multiply-add), then
 * ``v = v * alpha`` and ``v += s * g * g`` (``addcmul_`` with value ``s`` = 1 - alpha: the
 * first product rounded, the second fused); with ``ga`` (centered) ``ga.lerp_(g, s)`` (a
 * fused multiply-add from ``ga`` when ``|s| < 0.5``, else from ``g``) and ``c = v - ga *
 * ga`` into ``centered`` (``addcmul(ga, ga, value=-1)``: one fused multiply-add). Returns
 * whether every element of ``out`` is finite. ``rmsprop_update``, with ``root`` =
 * torch.sqrt(v or c) and the mean in ``out`` (the parameters unchanged since, so ``g`` is
 * made again): ``avg = root + eps``; with ``buf`` (momentum) ``buf = buf * mom + g / avg``
 * (``addcdiv_`` with value 1: each operation rounded) and ``p += neg_lr * buf`` (one fused
 * multiply-add), else ``p += neg_lr * g / avg`` (``addcdiv_``: each operation rounded). */
#define DENSE_RMSPROP(T, S, U, FMA)                                                          \
static inline __attribute__((always_inline)) U                                               \
squares_pass_##S(int64_t n, const T *a, const T *b, T inv, T *out, const T *restrict p,      \
                 T *restrict v, int ctr, T *restrict ga, T *restrict centered, int decay,    \
                 T wd, T alpha, T s, int small)                                              \
{                                                                                            \
    U bad = 0;                                                                               \
    const T sm1 = s - (T)1;                                                                  \
    _Pragma("GCC ivdep")                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T g = mean_at_##S(i, a, b, 1, inv, out, 1, &bad);                                       \
        if (decay)                                                                           \
            g = FMA(p[i], wd, g);                                                            \
        T sq = FMA(s * g, g, v[i] * alpha);                                                  \
        v[i] = sq;                                                                           \
        if (ctr) {                                                                           \
            T d = g - ga[i];                                                                 \
            T avg = small ? FMA(s, d, ga[i]) : FMA(sm1, d, g);                               \
            ga[i] = avg;                                                                     \
            centered[i] = FMA(-avg, avg, sq);                                                \
        }                                                                                    \
    }                                                                                        \
    return bad;                                                                              \
}                                                                                            \
                                                                                             \
int64_t rmsprop_sums_##S(int64_t n, const T *const *in, int64_t k, T inv, T *out,            \
                         const T *p, T *v, T *ga, T *centered, int decay, T wd, T alpha,     \
                         T s, int small)                                                     \
{                                                                                            \
    const T *a = sum_but_last_##S(n, in, k, out), *b = in[k - 1];                            \
    U bad;                                                                                   \
    if (!ga)                                                                                 \
        bad = decay ? squares_pass_##S(n, a, b, inv, out, p, v, 0, NULL, NULL, 1, wd,        \
                                       alpha, s, 0)                                          \
                    : squares_pass_##S(n, a, b, inv, out, p, v, 0, NULL, NULL, 0, 0,         \
                                       alpha, s, 0);                                         \
    else if (decay)                                                                          \
        bad = small ? squares_pass_##S(n, a, b, inv, out, p, v, 1, ga, centered, 1, wd,      \
                                       alpha, s, 1)                                          \
                    : squares_pass_##S(n, a, b, inv, out, p, v, 1, ga, centered, 1, wd,      \
                                       alpha, s, 0);                                         \
    else                                                                                     \
        bad = small ? squares_pass_##S(n, a, b, inv, out, p, v, 1, ga, centered, 0, 0,       \
                                       alpha, s, 1)                                          \
                    : squares_pass_##S(n, a, b, inv, out, p, v, 1, ga, centered, 0, 0,       \
                                       alpha, s, 0);                                         \
    return !bad;                                                                             \
}                                                                                            \
                                                                                             \
static inline __attribute__((always_inline)) void                                            \
rmsprop_pass_##S(int64_t n, T *restrict p, const T *restrict mean, const T *restrict root,   \
                 int with_buf, T *restrict buf, int decay, T wd, T eps, T mom, T neg_lr)     \
{                                                                                            \
    _Pragma("GCC ivdep")                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                        \
        T g = decay ? FMA(p[i], wd, mean[i]) : mean[i];                                      \
        T avg = root[i] + eps;                                                               \
        if (with_buf) {                                                                      \
            T kept = buf[i] * mom;                                                           \
            T next = kept + g / avg;                                                         \
            buf[i] = next;                                                                   \
            p[i] = FMA(next, neg_lr, p[i]);                                                  \
        } else {                                                                             \
            p[i] = p[i] + (neg_lr * g) / avg;                                                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void rmsprop_update_##S(int64_t n, T *p, const T *mean, const T *root, T *buf, int decay,    \
                        T wd, T eps, T mom, T neg_lr)                                        \
{                                                                                            \
    if (buf && decay)                                                                        \
        rmsprop_pass_##S(n, p, mean, root, 1, buf, 1, wd, eps, mom, neg_lr);                 \
    else if (buf)                                                                            \
        rmsprop_pass_##S(n, p, mean, root, 1, buf, 0, 0, eps, mom, neg_lr);                  \
    else if (decay)                                                                          \
        rmsprop_pass_##S(n, p, mean, root, 0, NULL, 1, wd, eps, 0, neg_lr);                  \
    else                                                                                     \
        rmsprop_pass_##S(n, p, mean, root, 0, NULL, 0, 0, eps, 0, neg_lr);                   \
}

DENSE_RMSPROP(float, f32, uint32_t, fmaf)
DENSE_RMSPROP(double, f64, uint64_t, fma)
