/* The row kernels' shared arithmetic (``_rows.c``, ``_plan.c``): the division by ``div``,
 * the dispatch on its kind, and a row's sum of squares. Included by both; the library's
 * build hashes this file with them (``rowslib``). */
#ifndef MPISYNC_ROWMATH_H
#define MPISYNC_ROWMATH_H

#include <math.h>
#include <stdint.h>

#define LANES 16

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

/* ``call`` (naming DIM) with DIM the row width ``dim``: for float32 rows (BY_DIM_f32), a
 * constant where it is one of the usual embedding widths, so that the compiler writes
 * each row's loops out in full (a fifth less time a row at 64 floats); else ``dim``
 * itself. The arithmetic is the same. */
#define BY_DIM_f32(call)                                                                     \
    do {                                                                                     \
        switch (dim) {                                                                       \
        case 16: { enum { DIM = 16 }; call; break; }                                         \
        case 32: { enum { DIM = 32 }; call; break; }                                         \
        case 64: { enum { DIM = 64 }; call; break; }                                         \
        case 128: { enum { DIM = 128 }; call; break; }                                       \
        default: { const int64_t DIM = dim; call; break; }                                   \
        }                                                                                    \
    } while (0)
#define BY_DIM_f64(call)                                                                     \
    do {                                                                                     \
        const int64_t DIM = dim;                                                             \
        call;                                                                                \
    } while (0)

/* A row step or a kernel's body: always inlined, so that BY_DIM's constant reaches it. */
#define ROW_INLINE static inline __attribute__((always_inline))

static inline int how_of(double div)
{
    int exp;
    if (div == 0)
        return 0;
    return frexp(div, &exp) == 0.5 && exp > -120 && exp < 120 ? 1 : 2;
}

#define FMA_f32 fmaf
#define FMA_f64 fma
#define SQRT_f32 sqrtf
#define SQRT_f64 sqrt

/* squares(g): a row's sum of squares of x = sign * (g / div) in LANES partial sums, lane j
 * adding the squares of columns j, j + LANES, ... in order, then halved: lane[j] +=
 * lane[j + h] for h = LANES / 2, ..., 1; lane 0 is the sum. */
#define SQUARES(T, S)                                                                        \
ROW_INLINE T squares_##S(const T *g, int64_t dim, int how, T div, T inv, T sign)             \
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
}

/* One row's steps, shared by the kernels over summed rows (``_rows.c``) and over a plan     */
/* (``_plan.c``); x = sign * (g / div) for each of the row's ``dim`` elements.               */
#define ROW_STEPS(T, S)                                                                      \
/* Adagrad's accumulator: s += x * x; out = the new s. */                                    \
ROW_INLINE void adagrad_sum_row_##S(const T *g, T *s, T *out, int64_t dim, int how,          \
                                    T div, T inv, T sign)                                    \
{                                                                                            \
    for (int64_t c = 0; c < dim; c++) {                                                      \
        T x = QUOT(g[c]) * sign;                                                             \
        T sq = x * x;                                                                        \
        T acc = s[c] + sq;                                                                   \
        s[c] = acc;                                                                          \
        out[c] = acc;                                                                        \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Adagrad's update once the square roots ``root`` are taken: p = fma(alpha, x / (root +   */ \
/* eps), p), as torch's per-row axpy rounds. */                                              \
ROW_INLINE void adagrad_apply_row_##S(const T *g, const T *root, T *p, int64_t dim,          \
                                      int how, T div, T inv, T sign, T eps, T alpha)         \
{                                                                                            \
    for (int64_t c = 0; c < dim; c++) {                                                      \
        T x = QUOT(g[c]) * sign;                                                             \
        T den = root[c] + eps;                                                               \
        p[c] = FMA_##S(alpha, x / den, p[c]);                                                \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The row-wise accumulator and multiplier of a row whose sum of squares is ``squares``: */  \
/* total += squares / dim; mult = -(lr / (sqrt(total) + eps)). */                            \
ROW_INLINE T rowwise_mult_##S(T *total, T squares, int64_t dim, T lr, T eps)                 \
{                                                                                            \
    T acc = *total + squares / (T)dim;                                                       \
    *total = acc;                                                                            \
    T std = SQRT_##S(acc) + eps;                                                             \
    return -(lr / std);                                                                      \
}                                                                                            \
                                                                                             \
/* torch's dense += alpha * sparse on a row: p = fma(alpha, x, p). */                         \
ROW_INLINE void axpy_row_##S(const T *g, T *p, int64_t dim, int how, T div, T inv,           \
                             T sign, T alpha)                                                \
{                                                                                            \
    for (int64_t c = 0; c < dim; c++)                                                        \
        p[c] = FMA_##S(alpha, QUOT(g[c]) * sign, p[c]);                                      \
}                                                                                            \
                                                                                             \
/* The row-wise update with the row's multiplier: p += x * mult. */                          \
ROW_INLINE void rowwise_apply_row_##S(const T *g, T *p, int64_t dim, int how, T div,         \
                                      T inv, T sign, T mult)                                 \
{                                                                                            \
    for (int64_t c = 0; c < dim; c++) {                                                      \
        T x = QUOT(g[c]) * sign;                                                             \
        T prod = x * mult;                                                                   \
        p[c] = p[c] + prod;                                                                  \
    }                                                                                        \
}

#endif
