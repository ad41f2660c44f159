/* One-pass optimizer updates for CPU float32 leaves, built by minitrain/optim/streaming.py.

   Each update reads params, grads and state once and writes the new params and state once.
   When the outputs are fresh buffers (a pure update), the writes are non-temporal stores
   (_mm256_stream_ps), which skip the read-for-ownership a plain store makes of every output
   cache line: an out-of-place update then moves about as many bytes through DRAM as torch's
   in-place fused kernels do (Intel 64 and IA-32 Optimization Reference Manual, "Streaming
   stores"; AMD64 Architecture Programmer's Manual vol. 1, 3.9.4). When the outputs are the
   inputs (a donated update), plain stores keep the data in cache.

   The math of each rule is written once, over 8-float vectors (GCC/Clang vector extensions,
   which lower to AVX on x86 and to whatever the target has elsewhere); a ragged tail runs the
   same code on a zero-padded copy. It follows torch's fused CPU kernels and foreach paths
   (aten/src/ATen/native/cpu/Fused{Adam,SGD,Adagrad}Kernel.cpp, torch/optim/rmsprop.py).
   Scalars derived from the step (bias corrections, decayed lr) come in from Python as doubles.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define W 8      /* floats per vector */
#define ALIGN 16 /* floats: thread slices start on 64-byte boundaries */
#define MAX_PTRS 16

typedef float v8 __attribute__((vector_size(W * sizeof(float))));

static inline v8 load(const float *src) {
    v8 x;
    memcpy(&x, src, sizeof x);
    return x;
}

static inline void store(float *dst, v8 x, int nt) {
#if defined(__AVX__)
    if (nt) {
        _mm256_stream_ps(dst, (__m256)x);
        return;
    }
#endif
    (void)nt;
    memcpy(dst, &x, sizeof x);
}

static inline v8 vsqrt(v8 x) {
#if defined(__AVX__)
    return (v8)_mm256_sqrt_ps((__m256)x);
#else
    for (int k = 0; k < W; k++) x[k] = sqrtf(x[k]);
    return x;
#endif
}

static inline v8 vmax(v8 a, v8 b) { /* torch.maximum: NaN in either gives NaN */
#if defined(__AVX__)
    const __m256 x = (__m256)a, y = (__m256)b;
    const __m256 max = _mm256_max_ps(x, y); /* y where either is NaN */
    return (v8)_mm256_blendv_ps(max, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
#else
    for (int k = 0; k < W; k++) a[k] = a[k] >= b[k] || a[k] != a[k] ? a[k] : b[k];
    return a;
#endif
}

/* at::lerp(a, b, w): a + w * (b - a) for |w| < 0.5, else b - (1 - w) * (b - a). */
static inline v8 lerp(v8 a, v8 b, float w, int small_w) {
    return small_w ? a + w * (b - a) : b - (1.0f - w) * (b - a);
}

/* Each rule updates elements [lo, hi) of one leaf, hi - lo a multiple of W. ptr holds the
   leaf's inputs, then its outputs; hp the rule's hyperparameters. */
typedef void (*rule_fn)(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt);

/* Adam / AdamW. hp: beta1, beta2, eps, weight_decay, lr, step_size (lr / bias_correction1),
   bias_correction2_sqrt, decoupled (1 AdamW, 0 Adam), amsgrad, grad_scale (the grads are
   multiplied by it first, in float32: a global-norm clip folded into the same pass).
   ptr: p, g, exp_avg, exp_avg_sq, max_exp_avg_sq | p, exp_avg, exp_avg_sq, max_exp_avg_sq. */
static void adam(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const float w = (float)(1.0 - hp[0]), beta2 = (float)hp[1], one_minus_beta2 = (float)(1.0 - hp[1]);
    const float eps = (float)hp[2], wd = (float)hp[3], decay = (float)(1.0 - hp[4] * hp[3]);
    const float step_size = (float)hp[5], inv_bc2_sqrt = (float)(1.0 / hp[6]);
    const int decoupled = hp[7] != 0.0, amsgrad = hp[8] != 0.0, small_w = fabsf(w) < 0.5f;
    const float grad_scale = (float)hp[9];
    const int scaled = grad_scale != 1.0f;
    const float *p_in = ptr[0], *g_in = ptr[1], *m_in = ptr[2], *v_in = ptr[3], *max_in = ptr[4];
    float *p_out = ptr[5], *m_out = ptr[6], *v_out = ptr[7], *max_out = ptr[8];
    for (int64_t i = lo; i < hi; i += W) {
        v8 p = load(p_in + i), g = load(g_in + i);
        if (scaled) g = g * grad_scale;
        if (decoupled) p = p * decay; /* AdamW: p *= 1 - lr * wd */
        else if (wd != 0.0f) g = g + p * wd;
        const v8 m = lerp(load(m_in + i), g, w, small_w);
        const v8 v = load(v_in + i) * beta2 + one_minus_beta2 * g * g;
        v8 second = v;
        if (amsgrad) {
            second = vmax(load(max_in + i), v);
            store(max_out + i, second, nt);
        }
        const v8 denom = vsqrt(second) * inv_bc2_sqrt + eps;
        store(p_out + i, p - step_size * m / denom, nt);
        store(m_out + i, m, nt);
        store(v_out + i, v, nt);
    }
}

/* SGD. hp: lr, momentum, dampening, weight_decay, nesterov, first_step, has_momentum.
   ptr: p, g, momentum_buffer | p, momentum_buffer. */
static void sgd(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const float lr = (float)hp[0], mu = (float)hp[1], one_minus_dampening = (float)(1.0 - hp[2]);
    const float wd = (float)hp[3];
    const int nesterov = hp[4] != 0.0, first = hp[5] != 0.0, has_momentum = hp[6] != 0.0;
    const float *p_in = ptr[0], *g_in = ptr[1], *b_in = ptr[2];
    float *p_out = ptr[3], *b_out = ptr[4];
    for (int64_t i = lo; i < hi; i += W) {
        const v8 p = load(p_in + i);
        v8 g = load(g_in + i);
        if (wd != 0.0f) g = g + p * wd;
        if (has_momentum) {
            const v8 b = first ? g : load(b_in + i) * mu + one_minus_dampening * g;
            store(b_out + i, b, nt);
            g = nesterov ? g + mu * b : b;
        }
        store(p_out + i, p - lr * g, nt);
    }
}

/* AdaGrad. hp: clr (lr / (1 + (step - 1) * lr_decay)), weight_decay, eps.
   ptr: p, g, sum | p, sum. */
static void adagrad(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const float clr = (float)hp[0], wd = (float)hp[1], eps = (float)hp[2];
    const float *p_in = ptr[0], *g_in = ptr[1], *sum_in = ptr[2];
    float *p_out = ptr[3], *sum_out = ptr[4];
    for (int64_t i = lo; i < hi; i += W) {
        const v8 p = load(p_in + i);
        v8 g = load(g_in + i);
        if (wd != 0.0f) g = g + p * wd;
        const v8 sum = load(sum_in + i) + g * g;
        store(p_out + i, p - clr * g / (vsqrt(sum) + eps), nt);
        store(sum_out + i, sum, nt);
    }
}

/* RMSprop. hp: lr, alpha, eps, weight_decay, momentum, centered, has_momentum.
   ptr: p, g, square_avg, momentum_buffer, grad_avg | p, square_avg, momentum_buffer,
   grad_avg. */
static void rmsprop(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const float lr = (float)hp[0], alpha = (float)hp[1], w = (float)(1.0 - hp[1]);
    const float eps = (float)hp[2], wd = (float)hp[3], mu = (float)hp[4];
    const int centered = hp[5] != 0.0, has_momentum = hp[6] != 0.0, small_w = fabsf(w) < 0.5f;
    const float *p_in = ptr[0], *g_in = ptr[1], *sq_in = ptr[2], *b_in = ptr[3], *ga_in = ptr[4];
    float *p_out = ptr[5], *sq_out = ptr[6], *b_out = ptr[7], *ga_out = ptr[8];
    for (int64_t i = lo; i < hi; i += W) {
        const v8 p = load(p_in + i);
        v8 g = load(g_in + i);
        if (wd != 0.0f) g = g + p * wd;
        const v8 square_avg = load(sq_in + i) * alpha + w * g * g;
        store(sq_out + i, square_avg, nt);
        v8 avg;
        if (centered) {
            const v8 grad_avg = lerp(load(ga_in + i), g, w, small_w);
            store(ga_out + i, grad_avg, nt);
            avg = vsqrt(square_avg - grad_avg * grad_avg) + eps;
        } else {
            avg = vsqrt(square_avg) + eps;
        }
        if (has_momentum) {
            const v8 b = load(b_in + i) * mu + g / avg;
            store(b_out + i, b, nt);
            store(p_out + i, p - lr * b, nt);
        } else {
            store(p_out + i, p - lr * (g / avg), nt);
        }
    }
}

typedef struct {
    rule_fn update;
    int64_t inputs, pointers;
} rule_t;

static const rule_t RULES[] = {{adam, 5, 9}, {sgd, 3, 5}, {adagrad, 3, 5}, {rmsprop, 5, 9}};

/* Elements [lo, hi) of one leaf: whole vectors in place, streaming only where every output is
   aligned, then the ragged end on zero-padded copies. */
static void run_range(const rule_t *rule, const double *hp, float *const *ptr, int64_t lo,
                      int64_t hi, int nt) {
    for (int64_t k = rule->inputs; k < rule->pointers; k++)
        if (ptr[k] && ((uintptr_t)(ptr[k] + lo) % 32) != 0) nt = 0;
    const int64_t whole = lo + (hi - lo) / W * W;
    if (whole > lo) rule->update(hp, ptr, lo, whole, nt);
    if (whole == hi) return;
    float pad[MAX_PTRS][W] __attribute__((aligned(32)));
    float *local[MAX_PTRS];
    const size_t bytes = (size_t)(hi - whole) * sizeof(float);
    for (int64_t k = 0; k < rule->pointers; k++) {
        memset(pad[k], 0, sizeof pad[k]);
        local[k] = ptr[k] ? pad[k] : NULL;
        if (ptr[k] && k < rule->inputs) memcpy(pad[k], ptr[k] + whole, bytes);
    }
    rule->update(hp, local, 0, W, 0);
    for (int64_t k = rule->inputs; k < rule->pointers; k++)
        if (ptr[k]) memcpy(ptr[k] + whole, pad[k], bytes);
}

static int64_t padded(int64_t size) { return (size + ALIGN - 1) / ALIGN * ALIGN; }

/* Thread `rank` of `team` takes an equal share of all leaves' elements laid end to end, in
   64-byte-aligned slices. */
static void work(const rule_t *rule, const double *hp, float *const *ptrs, const int64_t *sizes,
                 int64_t n_leaves, int64_t total, int rank, int team, int nt) {
    const int64_t n_ptrs = rule->pointers;
    const int64_t begin = total * rank / team / ALIGN * ALIGN;
    const int64_t end = rank + 1 == team ? total : total * (rank + 1) / team / ALIGN * ALIGN;
    int64_t offset = 0;
    for (int64_t leaf = 0; leaf < n_leaves && offset < end; leaf++) {
        const int64_t lo = begin > offset ? begin - offset : 0;
        const int64_t hi = end - offset < sizes[leaf] ? end - offset : sizes[leaf];
        if (lo < hi) run_range(rule, hp, ptrs + leaf * n_ptrs, lo, hi, nt);
        offset += padded(sizes[leaf]);
    }
#if defined(__AVX__)
    if (nt) _mm_sfence(); /* streaming stores are weakly ordered: drain them here */
#endif
}

/* Run rule `rule` (0 Adam, 1 SGD, 2 AdaGrad, 3 RMSprop) over n_leaves leaves of `sizes`
   elements, on up to n_threads threads. `ptrs` holds n_ptrs pointers per leaf (the rule's
   inputs, then its outputs; NULL for unused buffers). Built with -fopenmp, the library's
   libgomp.so.1 resolves to the copy torch has already loaded, so the update runs on torch's
   own OpenMP threads. Returns 0, or -1 (nothing done) for an unknown rule or pointer count. */
int minitrain_update(int rule, const double *hp, float *const *ptrs, const int64_t *sizes,
                     int64_t n_leaves, int64_t n_ptrs, int n_threads, int nontemporal) {
    if (rule < 0 || rule > 3 || n_ptrs != RULES[rule].pointers) return -1;
    int64_t total = 0;
    for (int64_t leaf = 0; leaf < n_leaves; leaf++) total += padded(sizes[leaf]);
    if (n_threads < 1 || (int64_t)n_threads * 16384 > total) n_threads = 1; /* small: one thread */
#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads)
    work(&RULES[rule], hp, ptrs, sizes, n_leaves, total, omp_get_thread_num(),
         omp_get_num_threads(), nontemporal);
#else
    (void)n_threads;
    work(&RULES[rule], hp, ptrs, sizes, n_leaves, total, 0, 1, nontemporal);
#endif
    return 0;
}
