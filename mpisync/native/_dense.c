/* Dense kernels of the ps: the dense step's reduce, alone or with a torch optimizer's step
 * in the same pass over memory. Compiled with _rows.c into one library by
 * mpisync/native/rowslib.py (cc -O3 -ffp-contract=off: every product and sum rounds on its
 * own, in the order written here, as torch's kernels of the same operations do). */
#include <math.h>
#include <stdint.h>
#include <string.h>

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
