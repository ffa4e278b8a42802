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
#include <stdlib.h>
#include <string.h>

#include "_rowmath.h"

#define AHEAD 16
#define BLOCK 8
#define ROWS_AHEAD 8


ROW_INLINE void prefetch_row(const void *row, int64_t nbytes)
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

/* Whether every one of v (n of them) lies in [0, limit). */
int all_below(int64_t n, const int64_t *v, int64_t limit)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= (uint64_t)v[i] >= (uint64_t)limit;
    return bad == 0;
}

/* Whether v (n of them) never decreases. */
int nondecreasing(int64_t n, const int64_t *v)
{
    int64_t bad = 0;
    for (int64_t i = 1; i < n; i++)
        bad |= v[i] < v[i - 1];
    return bad == 0;
}

/* The offsets of a nondecreasing ``bag`` (n of them, each in [0, bags)): offsets[b] is the
 * first position of bag b or after, offsets[bags] = n. Returns -1 (offsets unwritten)
 * where bag decreases somewhere or leaves [0, bags). */
int64_t bag_offsets(int64_t n, const int64_t *bag, int64_t bags, int64_t *offsets)
{
    for (int64_t i = 0; i < n; i++)
        if (bag[i] < 0 || bag[i] >= bags || (i && bag[i] < bag[i - 1]))
            return -1;
    int64_t b = 0;
    for (int64_t i = 0; i < n; i++)
        while (b <= bag[i])
            offsets[b++] = i;
    while (b <= bags)
        offsets[b++] = n;
    return 0;
}

/* ``bag_offsets``' inverse: bag[i] = b for i in [offsets[b], offsets[b + 1]). Returns -1
 * (bag unwritten) unless offsets[0] = 0, offsets[bags] = n and they never decrease. */
int64_t expand_offsets(int64_t bags, const int64_t *offsets, int64_t n, int64_t *bag)
{
    if (offsets[0] != 0 || offsets[bags] != n)
        return -1;
    for (int64_t b = 0; b < bags; b++)
        if (offsets[b + 1] < offsets[b])
            return -1;
    for (int64_t b = 0; b < bags; b++)
        for (int64_t i = offsets[b]; i < offsets[b + 1]; i++)
            bag[i] = b;
    return 0;
}

/* The first index of v (n of them, nondecreasing) whose value is at least x (n: none). */
static int64_t lower_bound(int64_t n, const int64_t *v, int64_t x)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (v[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* flags[ids[i]] = 1 for each i (a bool array's bytes; ids in it). */
void set_flags(int64_t n, const int64_t *ids, uint8_t *flags)
{
    for (int64_t i = 0; i < n; i++)
        flags[ids[i]] = 1;
}

/* An open-addressed table of ids: a power of two of at least ``want`` slots (``*shift``: */
/* 64 minus its bits), and an id's first slot by Fibonacci hashing (the top bits of the   */
/* id times 2**64 over the golden ratio). */
static inline uint64_t table_size(uint64_t want, int *shift)
{
    uint64_t size = 16;
    *shift = 60;
    while (size < want) {
        size <<= 1;
        (*shift)--;
    }
    return size;
}

static inline uint64_t table_slot(int64_t key, int shift)
{
    return (uint64_t)key * 0x9E3779B97F4A7C15ULL >> shift;
}

/* How many distinct values ``ids`` (n of them, each >= 0) hold, counted up to ``least``  */
/* (the count stops there): an open-addressed table of a power of two above 2 * least     */
/* entries. -1: no memory for the table. */
int64_t distinct_upto(int64_t n, const int64_t *ids, int64_t least)
{
    if (least <= 0)
        return 0;
    int shift;
    uint64_t size = table_size(2 * (uint64_t)least + 2, &shift), mask = size - 1;
    int64_t *table = calloc(size, sizeof(int64_t));     /* 0: empty; holds id + 1 */
    if (!table)
        return -1;
    int64_t count = 0;
    for (int64_t i = 0; i < n && count < least; i++) {
        int64_t key = ids[i] + 1;
        uint64_t h = table_slot(key, shift);
        while (table[h] != 0 && table[h] != key)
            h = (h + 1) & mask;
        if (table[h] == 0) {
            table[h] = key;
            count++;
        }
    }
    free(table);
    return count;
}

static int cmp_int64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* ``v`` (n distinct values) sorted ascending: by their offset from the least, 11 bits at a
 * time from the lowest for as many digits as the range needs (``tmp``: n more). */
static void sort_distinct(int64_t n, int64_t *v, int64_t *tmp)
{
    if (n < 64) {
        qsort(v, (size_t)n, sizeof(int64_t), cmp_int64);
        return;
    }
    int64_t lo = v[0], hi = v[0];
    for (int64_t i = 1; i < n; i++) {
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    uint64_t range = (uint64_t)hi - (uint64_t)lo;
    int64_t count[2048];
    int64_t *from = v, *to = tmp;
    for (int shift = 0; shift < 64 && (range >> shift); shift += 11) {
        memset(count, 0, sizeof(count));
        for (int64_t i = 0; i < n; i++)
            count[((uint64_t)from[i] - (uint64_t)lo) >> shift & 2047]++;
        int64_t at = 0;
        for (int d = 0; d < 2048; d++) {
            int64_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++)
            to[count[((uint64_t)from[i] - (uint64_t)lo) >> shift & 2047]++] = from[i];
        int64_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != v)
        memcpy(v, from, (size_t)n * sizeof(int64_t));
}

/* ``torch.unique(ids, sorted=True, return_inverse=True)`` without sorting every id: the   */
/* distinct ids (any int64) found with an open-addressed table, in first-seen order, then  */
/* sorted, and each position's id's place among them. Writes ``uniq`` (count of them) and  */
/* ``inverse`` (n); returns the count; -1 where there is no memory for the table, -2 where */
/* the ids collide in it so often (ids made to) that sorting them all is cheaper, -3 where */
/* the first 1,024 ids are nearly all distinct and spread wider than 2**33 (user ids, say):*/
/* sorting them all is then cheaper too.                                                   */
int64_t unique_inverse(int64_t n, const int64_t *ids, int64_t *uniq, int64_t *inverse)
{
    int shift;
    uint64_t size = table_size((uint64_t)n + (uint64_t)n / 2, &shift), mask = size - 1;
    int64_t *keys = malloc(size * sizeof(int64_t) + (size_t)n * 2 * sizeof(int64_t));
    int32_t *vals = malloc(size * sizeof(int32_t));        /* -1: empty; else a number */
    if (!keys || !vals || n >= INT32_MAX) {
        free(keys);
        free(vals);
        return -1;
    }
    int64_t *rank = keys + size, *tmp = rank + n;
    memset(vals, 0xff, size * sizeof(int32_t));
    int64_t count = 0, probes = 0, most = 16 * n + 1024;
    int64_t lo = n ? ids[0] : 0, hi = lo;
    for (int64_t i = 0; i < n && i < 1024; i++) {
        lo = ids[i] < lo ? ids[i] : lo;
        hi = ids[i] > hi ? ids[i] : hi;
    }
    for (int64_t i = 0; i < n; i++) {                   /* first-seen numbers */
        int64_t key = ids[i];
        if (i == 1024 && count >= 922 && ((uint64_t)hi - (uint64_t)lo) >> 33) {
            free(keys);
            free(vals);
            return -3;
        }
        uint64_t h = table_slot(key, shift);
        while (vals[h] >= 0 && keys[h] != key) {
            h = (h + 1) & mask;
            if (++probes > most) {                     /* ids made to collide */
                free(keys);
                free(vals);
                return -2;
            }
        }
        if (vals[h] < 0) {
            keys[h] = key;
            vals[h] = (int32_t)count;
            uniq[count++] = key;
        }
        inverse[i] = vals[h];
    }
    sort_distinct(count, uniq, tmp);
    for (int64_t j = 0; j < count; j++) {               /* first-seen number -> place */
        int64_t key = uniq[j];
        uint64_t h = table_slot(key, shift);
        while (keys[h] != key)
            h = (h + 1) & mask;
        rank[vals[h]] = j;
    }
    for (int64_t i = 0; i < n; i++)
        inverse[i] = rank[inverse[i]];
    free(keys);
    free(vals);
    return count;
}

/* ``slot[sorted[j]] = j``: the position of each distinct id in sorted order. */
void place(int64_t n, const int64_t *sorted, int64_t *slot)
{
    for (int64_t j = 0; j < n; j++)
        slot[sorted[j]] = j;
}

/* Each id's output row (given in first-seen order from ``count`` on, the id appended to  */
/* ``uniq``) into ``pos[i]``, as ``~row`` at the id's first sight: a step's plan          */
/* (``_plan.c``). ``marks[id]`` is ``gen << 32 | row`` for an id this plan has seen; any   */
/* other value (an earlier generation's, or 0) marks none, so that no plan clears its own */
/* marks. Returns the new count. */
int64_t scatter_marks(int64_t n, const int64_t *ids, int64_t *marks, int64_t gen,
                      int64_t *uniq, int64_t count, int64_t *pos)
{
    const int64_t tag = (int64_t)((uint64_t)gen << 32);
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(marks + ids[i + AHEAD], 1, 3);
        int64_t r = ids[i];
        int64_t s = marks[r];
        if ((s & ~(int64_t)0xffffffff) != tag) {
            marks[r] = tag | count;
            uniq[count] = r;
            pos[i] = ~count++;
        } else {
            pos[i] = s & 0xffffffff;
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
ROW_INLINE void bag_rows_body_##S(int64_t n, const int64_t *ids, const int64_t *bag,         \
                                  const T *weights, const T *grads, int64_t dim,             \
                                  const int64_t *slot, int64_t lo, int64_t hi, T *out)       \
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
void bag_rows_##S(int64_t n, const int64_t *ids, const int64_t *bag, const T *weights,       \
                  const T *grads, int64_t dim, const int64_t *slot, int64_t lo, int64_t hi,  \
                  T *out)                                                                    \
{                                                                                            \
    BY_DIM_##S(bag_rows_body_##S(n, ids, bag, weights, grads, DIM, slot, lo, hi, out));      \
}                                                                                            \
                                                                                             \
/* Each bag's sum of its rows: out[bag[i]] += weights[i] * rows[ids[i]], in the order of */  \
/* i, into a zeroed out (the pooled answer to a lookup); only the bags in [lo, hi).        */ \
ROW_INLINE void bag_sums_body_##S(int64_t n, const int64_t *ids, const int64_t *bag,         \
                                  const T *weights, const T *rows, int64_t dim, int64_t lo,  \
                                  int64_t hi, T *out)                                        \
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
void bag_sums_##S(int64_t n, const int64_t *ids, const int64_t *bag, const T *weights,       \
                  const T *rows, int64_t dim, int64_t lo, int64_t hi, T *out)                \
{                                                                                            \
    BY_DIM_##S(bag_sums_body_##S(n, ids, bag, weights, rows, DIM, lo, hi, out));             \
}                                                                                            \
                                                                                             \
/* ``bag_sums`` where bag never decreases: its positions of the bags in [lo, hi) are one */ \
/* stretch, found by bisection instead of passing over every position. */                  \
void bag_sums_sorted_##S(int64_t n, const int64_t *ids, const int64_t *bag,                  \
                         const T *weights, const T *rows, int64_t dim, int64_t lo,           \
                         int64_t hi, T *out)                                                 \
{                                                                                            \
    int64_t a = lower_bound(n, bag, lo), b = lower_bound(n, bag, hi);                        \
    bag_sums_##S(b - a, ids + a, bag + a, weights ? weights + a : NULL, rows, dim, lo, hi,   \
                 out);                                                                       \
}                                                                                            \
                                                                                             \
/* out[i] = rows[ids[i]] (a rows answer to a lookup, straight into its message). */          \
ROW_INLINE void gather_body_##S(int64_t n, const int64_t *ids, const T *rows, int64_t dim,   \
                                T *out)                                                      \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            prefetch_row(rows + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));             \
        memcpy(out + i * dim, rows + ids[i] * dim, (size_t)dim * sizeof(T));                 \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void gather_##S(int64_t n, const int64_t *ids, const T *rows, int64_t dim, T *out)           \
{                                                                                            \
    BY_DIM_##S(gather_body_##S(n, ids, rows, DIM, out));                                     \
}                                                                                            \
                                                                                             \
/* Adagrad's accumulator on rows: x = sign * (grad / div); sum[id] += x * x;               */ \
/* out = the new sum[id] (torch then takes out's square root: its sqrt is its own).        */ \
ROW_INLINE void adagrad_sum_body_##S(int64_t n, const int64_t *ids, const T *grad,           \
                                     int64_t dim, int how, T div, T inv, T sign, T *sum,     \
                                     T *out)                                                 \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            prefetch_row(sum + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));              \
        adagrad_sum_row_##S(grad + i * dim, sum + ids[i] * dim, out + i * dim, dim, how, div, \
                            inv, sign);                                                      \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void adagrad_sum_rows_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim, T div,  \
                          T sign, T *sum, T *out)                                            \
{                                                                                            \
    DISPATCH(BY_DIM_##S(adagrad_sum_body_##S(n, ids, grad, DIM, HOW, div, (T)1 / div,        \
                                             sign, sum, out)));                              \
}                                                                                            \
                                                                                             \
/* Adagrad's update once torch took the square root: x = sign * (grad / div);             */ \
/* param[id] = fma(alpha, x / (std + eps), param[id]), as torch's per-row axpy rounds. */    \
ROW_INLINE void adagrad_apply_body_##S(int64_t n, const int64_t *ids, const T *grad,         \
                                       const T *std, int64_t dim, int how, T div, T inv,     \
                                       T sign, T eps, T alpha, T *param)                     \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            prefetch_row(param + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));            \
        adagrad_apply_row_##S(grad + i * dim, std + i * dim, param + ids[i] * dim, dim, how, \
                              div, inv, sign, eps, alpha);                                   \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void adagrad_apply_rows_##S(int64_t n, const int64_t *ids, const T *grad, const T *std,      \
                            int64_t dim, T div, T sign, T eps, T alpha, T *param)            \
{                                                                                            \
    DISPATCH(BY_DIM_##S(adagrad_apply_body_##S(n, ids, grad, std, DIM, HOW, div,             \
                                               (T)1 / div, sign, eps, alpha, param)));       \
}                                                                                            \
                                                                                             \
/* param[id] = fma(alpha, sign * (grad / div), param[id]): torch's dense += alpha * sparse. */ \
ROW_INLINE void axpy_body_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim,     \
                              int how, T div, T inv, T sign, T alpha, T *param)              \
{                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                        \
        if (i + AHEAD < n)                                                                   \
            prefetch_row(param + ids[i + AHEAD] * dim, dim * (int64_t)sizeof(T));            \
        axpy_row_##S(grad + i * dim, param + ids[i] * dim, dim, how, div, inv, sign, alpha);   \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void axpy_rows_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim, T div, T sign, \
                   T alpha, T *param)                                                        \
{                                                                                            \
    DISPATCH(BY_DIM_##S(axpy_body_##S(n, ids, grad, DIM, HOW, div, (T)1 / div, sign,         \
                                      alpha, param)));                                       \
}                                                                                            \
                                                                                             \
/* Two pieces of sorted distinct ids merged: each id once, in order; a's row, plus b's    */ \
/* where both have it; divided by ``div`` unless it is 0. Returns the ids written. */        \
int64_t merge2_rows_##S(int64_t na, const int64_t *ida, const T *ra, int64_t nb,             \
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
void merge2_fill_##S(int64_t lo, int64_t hi, const int64_t *from_a, const T *ra,             \
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
static inline void rowwise_block_##S(int64_t m, int64_t left, const int64_t *ids,            \
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
    for (int64_t l = 0; l < m; l++)                                                          \
        mult[l] = rowwise_mult_##S(sum + (ids ? ids[l] : first + l), mult[l], dim, lr, eps);   \
    for (int64_t l = 0; l < m; l++)                                                          \
        rowwise_apply_row_##S(grad + l * dim, param + (ids ? ids[l] : first + l) * dim, dim, \
                              how, div, inv, sign, mult[l]);                                 \
}                                                                                            \
                                                                                             \
void rowwise_rows_##S(int64_t n, const int64_t *ids, const T *grad, int64_t dim, T div,      \
                      T sign, T lr, T eps, T *sum, T *param)                                 \
{                                                                                            \
    for (int64_t i = 0; i < n; i += BLOCK) {                                                 \
        int64_t m = n - i < BLOCK ? n - i : BLOCK;                                           \
        const int64_t *at = ids ? ids + i : NULL;                                            \
        DISPATCH(rowwise_block_##S(m, n - i, at, i, grad + i * dim, dim, HOW, div, (T)1 / div, \
                                   sign, lr, eps, sum, param));                              \
    }                                                                                        \
}

SQUARES(float, f32)
SQUARES(double, f64)
ROW_STEPS(float, f32)
ROW_STEPS(double, f64)

KERNELS(float, f32)
KERNELS(double, f64)
