/* One-pass optimizer updates for CPU float32 leaves, and the Threefry counters of
   minitrain/random.py, built by minitrain/_native.py.

   Each update reads params, grads and state once and writes the new params and state once.
   When the outputs are fresh buffers (a pure update), the writes are non-temporal stores
   (_mm512_stream_ps, or _mm256_stream_ps without AVX-512), which skip the read-for-ownership
   a plain store makes of every output cache line: an out-of-place update then moves about as many bytes through DRAM as torch's
   in-place fused kernels do (Intel 64 and IA-32 Optimization Reference Manual, "Streaming
   stores"; AMD64 Architecture Programmer's Manual vol. 1, 3.9.4). When the outputs are the
   inputs (a donated update), plain stores keep the data in cache.

   The math of each rule is written once, over W-float vectors (GCC/Clang vector extensions,
   which lower to AVX on x86 and to whatever the target has elsewhere); a ragged tail runs the
   same code on a zero-padded copy. It follows torch's fused CPU kernels and foreach paths
   (aten/src/ATen/native/cpu/Fused{Adam,SGD,Adagrad}Kernel.cpp, torch/optim/rmsprop.py).
   Scalars derived from the step (bias corrections, decayed lr) come in from Python as doubles.

   The family rules (NAdam, RAdam, Adamax, Lion, schedule-free AdamW, Adadelta)
   follow minitrain's own per-leaf functions (minitrain/optim/_nadam.py, ... which follow
   torch/optim/nadam.py, radam.py, adamax.py, adadelta.py, lion-pytorch's
   Lion and schedulefree's AdamWScheduleFree). They share
   torch.optim's frame: hp[0..4] = grad_sign (-1 for maximize), l2 (g += l2 * p), lr, decay
   (p *= decay before the step: decoupled weight decay 1 - lr * wd), has_lr; the new param is
   p * decay - lr * d with has_lr, else p + d (the rule's d is the whole step).

   minitrain_sumsq reduces sum(x * x) per leaf (the global-norm clip's one pass over the
   grads), its chunks taken from the last back to the first (each chunk read upwards), so the
   last chunks it reads are the first ones the update after it reads.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* Floats per vector: 16 with AVX-512, whose 64-byte streaming store writes a whole cache
   line at once (measured 7-10% faster than two 32-byte ones for an out-of-place Adam pass on
   a 2-core Xeon), else 8. The elementwise rules give the same bits at either width. */
#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
#define VBYTES (W * 4) /* a streaming store needs its address aligned to this */
/* Four vectors per trip through each rule's loop: more independent loads in flight while the
   square roots and divisions of the vectors before them run (measured on a 2-core Xeon, in
   one process against the loop as written: AdaGrad's pure pass 1.8% faster, SGD's 0.5%). The
   math per element is unchanged. */
#if defined(__GNUC__)
#define UNROLL _Pragma("GCC unroll 4")
#else
#define UNROLL
#endif
#define ALIGN 16 /* floats: thread slices start on 64-byte boundaries */
#define MAX_PTRS 16

typedef float vf __attribute__((vector_size(W * sizeof(float))));

static inline vf load(const float *src) {
    vf x;
    memcpy(&x, src, sizeof x);
    return x;
}

static inline void store(float *dst, vf x, int nt) {
#if defined(__AVX512F__)
    if (nt) {
        _mm512_stream_ps(dst, (__m512)x);
        return;
    }
#elif defined(__AVX__)
    if (nt) {
        _mm256_stream_ps(dst, (__m256)x);
        return;
    }
#endif
    (void)nt;
    memcpy(dst, &x, sizeof x);
}

static inline vf vsqrt(vf x) {
#if defined(__AVX512F__)
    return (vf)_mm512_sqrt_ps((__m512)x);
#elif defined(__AVX__)
    return (vf)_mm256_sqrt_ps((__m256)x);
#else
    for (int k = 0; k < W; k++) x[k] = sqrtf(x[k]);
    return x;
#endif
}

static inline vf vmax(vf a, vf b) { /* torch.maximum: NaN in either gives NaN */
#if defined(__AVX512F__)
    const __m512 x = (__m512)a, y = (__m512)b;
    const __m512 max = _mm512_max_ps(x, y); /* y where either is NaN */
    return (vf)_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), max, x);
#elif defined(__AVX__)
    const __m256 x = (__m256)a, y = (__m256)b;
    const __m256 max = _mm256_max_ps(x, y); /* y where either is NaN */
    return (vf)_mm256_blendv_ps(max, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
#else
    for (int k = 0; k < W; k++) a[k] = a[k] >= b[k] || a[k] != a[k] ? a[k] : b[k];
    return a;
#endif
}

/* at::lerp(a, b, w): a + w * (b - a) for |w| < 0.5, else b - (1 - w) * (b - a). */
static inline vf lerp(vf a, vf b, float w, int small_w) {
    return small_w ? a + w * (b - a) : b - (1.0f - w) * (b - a);
}

static inline vf vabs(vf x) { /* |x|: clear the sign bit */
    typedef int32_t i8 __attribute__((vector_size(W * sizeof(int32_t))));
    i8 bits;
    memcpy(&bits, &x, sizeof bits);
    bits &= 0x7fffffff;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline vf vsign(vf x) { /* torch.sign: 1, -1, or +0 for zeros and NaN */
    typedef int32_t i8 __attribute__((vector_size(W * sizeof(int32_t))));
    const vf zero = {0};
    const i8 gt = x > zero, lt = x < zero; /* -1 where true */
    return __builtin_convertvector(lt - gt, vf);
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
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        vf p = load(p_in + i), g = load(g_in + i);
        if (scaled) g = g * grad_scale;
        if (decoupled) p = p * decay; /* AdamW: p *= 1 - lr * wd */
        else if (wd != 0.0f) g = g + p * wd;
        const vf m = lerp(load(m_in + i), g, w, small_w);
        const vf v = load(v_in + i) * beta2 + one_minus_beta2 * g * g;
        vf second = v;
        if (amsgrad) {
            second = vmax(load(max_in + i), v);
            store(max_out + i, second, nt);
        }
        const vf denom = vsqrt(second) * inv_bc2_sqrt + eps;
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
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf p = load(p_in + i);
        vf g = load(g_in + i);
        if (wd != 0.0f) g = g + p * wd;
        if (has_momentum) {
            const vf b = first ? g : load(b_in + i) * mu + one_minus_dampening * g;
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
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf p = load(p_in + i);
        vf g = load(g_in + i);
        if (wd != 0.0f) g = g + p * wd;
        const vf sum = load(sum_in + i) + g * g;
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
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf p = load(p_in + i);
        vf g = load(g_in + i);
        if (wd != 0.0f) g = g + p * wd;
        const vf square_avg = load(sq_in + i) * alpha + w * g * g;
        store(sq_out + i, square_avg, nt);
        vf avg;
        if (centered) {
            const vf grad_avg = lerp(load(ga_in + i), g, w, small_w);
            store(ga_out + i, grad_avg, nt);
            avg = vsqrt(square_avg - grad_avg * grad_avg) + eps;
        } else {
            avg = vsqrt(square_avg) + eps;
        }
        if (has_momentum) {
            const vf b = load(b_in + i) * mu + g / avg;
            store(b_out + i, b, nt);
            store(p_out + i, p - lr * b, nt);
        } else {
            store(p_out + i, p - lr * (g / avg), nt);
        }
    }
}


/* The family's frame (see the top of this file). */
typedef struct {
    float sign, l2, lr, decay;
    int negate, has_l2, has_lr, has_decay;
} frame_t;

static inline frame_t frame(const double *hp) {
    frame_t f = {(float)hp[0], (float)hp[1], (float)hp[2], (float)hp[3],
                 hp[0] != 1.0, hp[1] != 0.0, hp[4] != 0.0, hp[3] != 1.0};
    return f;
}

static inline vf grad_in(const frame_t *f, vf g, vf p) {
    if (f->negate) g = g * f->sign;    /* scale(-1) for maximize */
    if (f->has_l2) g = g + p * f->l2;  /* add_decayed_weights before the rule */
    return g;
}

static inline vf param_out(const frame_t *f, vf p, vf d) {
    if (!f->has_lr) return p + d;
    if (f->has_decay) p = p * f->decay; /* decoupled: p * (1 - lr * wd) */
    return p - f->lr * d;
}

/* NAdam (_nadam.py nadam_leaf). hp[5..]: 1 - beta1, beta2, 1 - beta2, eps * sqrt(bc2),
   grad_coef * sqrt(bc2), avg_coef * sqrt(bc2). ptr: p, g, exp_avg, exp_avg_sq | p, exp_avg,
   exp_avg_sq. */
static void nadam(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const frame_t f = frame(hp);
    const float w = (float)hp[5], beta2 = (float)hp[6], one_minus_beta2 = (float)hp[7];
    const float eps_root = (float)hp[8], grad_coef = (float)hp[9], avg_coef = (float)hp[10];
    const int small_w = fabsf(w) < 0.5f;
    const float *p_in = ptr[0], *g_in = ptr[1], *m_in = ptr[2], *v_in = ptr[3];
    float *p_out = ptr[4], *m_out = ptr[5], *v_out = ptr[6];
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf p = load(p_in + i), g = grad_in(&f, load(g_in + i), p);
        const vf m = lerp(load(m_in + i), g, w, small_w);
        const vf v = load(v_in + i) * beta2 + one_minus_beta2 * g * g;
        const vf d = (g * grad_coef + m * avg_coef) / (vsqrt(v) + eps_root);
        store(p_out + i, param_out(&f, p, d), nt);
        store(m_out + i, m, nt);
        store(v_out + i, v, nt);
    }
}

/* RAdam (_radam.py radam_leaf). hp[5..]: 1 - beta1, beta2, 1 - beta2, eps, rectified,
   bias_correction1, factor (rect * sqrt(bc2) / bc1). ptr: as NAdam. */
static void radam(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const frame_t f = frame(hp);
    const float w = (float)hp[5], beta2 = (float)hp[6], one_minus_beta2 = (float)hp[7];
    const float eps = (float)hp[8], bc1 = (float)hp[10], factor = (float)hp[11];
    const int rectified = hp[9] != 0.0, small_w = fabsf(w) < 0.5f;
    const float *p_in = ptr[0], *g_in = ptr[1], *m_in = ptr[2], *v_in = ptr[3];
    float *p_out = ptr[4], *m_out = ptr[5], *v_out = ptr[6];
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf p = load(p_in + i), g = grad_in(&f, load(g_in + i), p);
        const vf m = lerp(load(m_in + i), g, w, small_w);
        const vf v = load(v_in + i) * beta2 + one_minus_beta2 * g * g;
        const vf d = rectified ? m * factor / (vsqrt(v) + eps) : m / bc1;
        store(p_out + i, param_out(&f, p, d), nt);
        store(m_out + i, m, nt);
        store(v_out + i, v, nt);
    }
}

/* Adamax (_adamax.py adamax_leaf). hp[5..]: 1 - beta1, beta2, eps, bias_correction1.
   ptr: p, g, exp_avg, exp_inf | p, exp_avg, exp_inf. */
static void adamax(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const frame_t f = frame(hp);
    const float w = (float)hp[5], beta2 = (float)hp[6], eps = (float)hp[7], bc1 = (float)hp[8];
    const int small_w = fabsf(w) < 0.5f;
    const float *p_in = ptr[0], *g_in = ptr[1], *m_in = ptr[2], *u_in = ptr[3];
    float *p_out = ptr[4], *m_out = ptr[5], *u_out = ptr[6];
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf p = load(p_in + i), g = grad_in(&f, load(g_in + i), p);
        const vf m = lerp(load(m_in + i), g, w, small_w);
        const vf u = vmax(load(u_in + i) * beta2, vabs(g) + eps);
        store(p_out + i, param_out(&f, p, m / u / bc1), nt);
        store(m_out + i, m, nt);
        store(u_out + i, u, nt);
    }
}

/* Lion (_lion.py lion_leaf; Chen et al. 2023, Algorithm 2). hp[5..]: 1 - beta1, 1 - beta2.
   ptr: p, g, exp_avg | p, exp_avg. */
static void lion(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const frame_t f = frame(hp);
    const float w1 = (float)hp[5], w2 = (float)hp[6];
    const int small_w1 = fabsf(w1) < 0.5f, small_w2 = fabsf(w2) < 0.5f;
    const float *p_in = ptr[0], *g_in = ptr[1], *m_in = ptr[2];
    float *p_out = ptr[3], *m_out = ptr[4];
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf p = load(p_in + i), g = grad_in(&f, load(g_in + i), p), m = load(m_in + i);
        store(p_out + i, param_out(&f, p, vsign(lerp(m, g, w1, small_w1))), nt);
        store(m_out + i, lerp(m, g, w2, small_w2), nt);
    }
}

/* Schedule-free AdamW (_schedule_free.py schedule_free_leaf; Defazio et al. 2024). hp[5..]:
   beta2, 1 - beta2, bias_correction2, eps, weight_decay, lr_t * (beta1 (1 - ckp1) - 1), ckp1,
   lr_t. ptr: y, g, z, exp_avg_sq | y, z, exp_avg_sq. */
static void sfadamw(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const frame_t f = frame(hp);
    const float beta2 = (float)hp[5], one_minus_beta2 = (float)hp[6], bc2 = (float)hp[7];
    const float eps = (float)hp[8], wd = (float)hp[9], k = (float)hp[10], ckp1 = (float)hp[11];
    const float lr_t = (float)hp[12];
    const float *y_in = ptr[0], *g_in = ptr[1], *z_in = ptr[2], *v_in = ptr[3];
    float *y_out = ptr[4], *z_out = ptr[5], *v_out = ptr[6];
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf y = load(y_in + i), g = grad_in(&f, load(g_in + i), y), z = load(z_in + i);
        const vf v = load(v_in + i) * beta2 + one_minus_beta2 * g * g;
        vf normalized = g / (vsqrt(v / bc2) + eps);
        if (wd != 0.0f) normalized = normalized + y * wd;
        store(y_out + i, param_out(&f, y, normalized * k + ckp1 * (z - y)), nt);
        store(z_out + i, z - lr_t * normalized, nt);
        store(v_out + i, v, nt);
    }
}

/* Adadelta (_adadelta.py adadelta_leaf; Zeiler 2012, Algorithm 1). hp[5..]: rho, 1 - rho,
   eps. ptr: p, g, square_avg, acc_delta | p, square_avg, acc_delta. */
static void adadelta(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const frame_t f = frame(hp);
    const float rho = (float)hp[5], one_minus_rho = (float)hp[6], eps = (float)hp[7];
    const float *p_in = ptr[0], *g_in = ptr[1], *sq_in = ptr[2], *acc_in = ptr[3];
    float *p_out = ptr[4], *sq_out = ptr[5], *acc_out = ptr[6];
    UNROLL for (int64_t i = lo; i < hi; i += W) {
        const vf p = load(p_in + i), g = grad_in(&f, load(g_in + i), p), acc = load(acc_in + i);
        const vf square_avg = load(sq_in + i) * rho + one_minus_rho * g * g;
        const vf delta = vsqrt(acc + eps) / vsqrt(square_avg + eps) * g;
        store(p_out + i, param_out(&f, p, delta), nt);
        store(sq_out + i, square_avg, nt);
        store(acc_out + i, acc * rho + one_minus_rho * delta * delta, nt);
    }
}

typedef struct {
    rule_fn update;
    int64_t inputs, pointers;
} rule_t;

static const rule_t RULES[] = {{adam, 5, 9},   {sgd, 3, 5},    {adagrad, 3, 5},
                               {rmsprop, 5, 9}, {nadam, 4, 7},  {radam, 4, 7},
                               {adamax, 4, 7},  {lion, 3, 5},   {sfadamw, 4, 7},
                               {adadelta, 4, 7}};
#define N_RULES ((int)(sizeof RULES / sizeof RULES[0]))

/* Elements [lo, hi) of one leaf: whole vectors in place, streaming only where every output is
   aligned, then the ragged end on zero-padded copies. */
static void run_range(const rule_t *rule, const double *hp, float *const *ptr, int64_t lo,
                      int64_t hi, int nt) {
    for (int64_t k = rule->inputs; k < rule->pointers; k++)
        if (ptr[k] && ((uintptr_t)(ptr[k] + lo) % VBYTES) != 0) nt = 0;
    const int64_t whole = lo + (hi - lo) / W * W;
    if (whole > lo) rule->update(hp, ptr, lo, whole, nt);
    if (whole == hi) return;
    float pad[MAX_PTRS][W] __attribute__((aligned(64)));
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

/* The work is cut into chunks of at most CHUNK elements, none spanning two leaves, handed
   to the threads one at a time (OpenMP dynamic schedule): a thread that the OS deschedules
   (another process on its core) holds up one chunk, not a fixed half of the update. Chunk
   starts are multiples of CHUNK within a leaf, so 64-byte aligned where the leaf is. */
#define CHUNK 32768

typedef struct {
    int64_t n_chunks, *first; /* first[leaf]: index of the leaf's first chunk; first[n] = n_chunks */
} chunks_t;

static int chunks_make(chunks_t *c, const int64_t *sizes, int64_t n_leaves) {
    c->first = (int64_t *)malloc((size_t)(n_leaves + 1) * sizeof(int64_t));
    if (!c->first) return -1;
    int64_t n = 0;
    for (int64_t leaf = 0; leaf < n_leaves; leaf++) {
        c->first[leaf] = n;
        n += (sizes[leaf] + CHUNK - 1) / CHUNK;
    }
    c->first[n_leaves] = n;
    c->n_chunks = n;
    return 0;
}

/* The leaf of chunk `k` (binary search over first[]) and its element range [lo, hi). */
static int64_t chunk_range(const chunks_t *c, const int64_t *sizes, int64_t n_leaves, int64_t k,
                           int64_t *lo, int64_t *hi) {
    int64_t a = 0, b = n_leaves - 1;
    while (a < b) { /* the last leaf whose first chunk is <= k (empty leaves have none) */
        const int64_t mid = (a + b + 1) / 2;
        if (c->first[mid] <= k) a = mid;
        else b = mid - 1;
    }
    while (c->first[a + 1] <= k) a++; /* step past empty leaves sharing this first index */
    *lo = (k - c->first[a]) * CHUNK;
    *hi = *lo + CHUNK < sizes[a] ? *lo + CHUNK : sizes[a];
    return a;
}

/* Run rule `rule` (0 Adam, 1 SGD, 2 AdaGrad, 3 RMSprop, 4 NAdam, 5 RAdam, 6 Adamax, 7 Lion,
   8 schedule-free AdamW, 9 Adadelta) over n_leaves leaves of `sizes` elements, on up to
   n_threads threads. Leaf i is member i % members of stacked leaf i / members: `ptrs` holds
   n_ptrs pointers per stacked leaf (the rule's inputs, then its outputs; NULL for unused
   buffers), member m's slice starting m * sizes[i] elements past them; it reads its
   hyperparameters at hp + (i / members) * leaf_stride + (i % members) * member_stride (0 and 0:
   all share one row). Built with -fopenmp, the library's libgomp.so.1 resolves to the copy
   torch has already loaded, so the update runs on torch's own OpenMP threads. Returns 0, or
   -1 (nothing done) for an unknown rule, pointer or member count, -2 when out of memory. */
int minitrain_update(int rule, const double *hp, int64_t leaf_stride, int64_t member_stride,
                     float *const *ptrs, const int64_t *sizes, int64_t n_leaves, int64_t members,
                     int64_t n_ptrs, int n_threads, int nontemporal) {
    if (rule < 0 || rule >= N_RULES || n_ptrs != RULES[rule].pointers || members < 1 ||
        n_leaves % members != 0)
        return -1;
    const rule_t *r = &RULES[rule];
    int64_t total = 0;
    for (int64_t leaf = 0; leaf < n_leaves; leaf++) total += padded(sizes[leaf]);
    if (n_threads < 1 || (int64_t)n_threads * 16384 > total) n_threads = 1; /* small: one thread */
    chunks_t c;
    if (chunks_make(&c, sizes, n_leaves) != 0) return -2;
#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads)
#endif
    {
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1) nowait
#endif
        for (int64_t k = 0; k < c.n_chunks; k++) {
            int64_t lo, hi;
            const int64_t i = chunk_range(&c, sizes, n_leaves, k, &lo, &hi);
            const int64_t leaf = i / members, member = i % members;
            float *slice[MAX_PTRS];
            for (int64_t j = 0; j < n_ptrs; j++) {
                float *stacked = ptrs[leaf * n_ptrs + j];
                slice[j] = stacked ? stacked + member * sizes[i] : NULL;
            }
            run_range(r, hp + leaf * leaf_stride + member * member_stride, slice, lo, hi,
                      nontemporal);
        }
#if defined(__AVX__)
        if (nontemporal) _mm_sfence(); /* streaming stores are weakly ordered: drain them */
#endif
    }
    (void)n_threads;
    free(c.first);
    return 0;
}

#define SUMSQ_BLOCK 4096 /* floats per block: summed in float vectors, then into a double */

#define SUMSQ_STREAMS 4 /* sub-ranges of a chunk read side by side */

/* sum(x * x) over x[lo, hi): SUMSQ_STREAMS equal sub-ranges read side by side, block by block
   upwards, then the ragged end. One ascending stream per core keeps too few lines in flight to
   fill the memory bus; four streams give the hardware prefetcher four to run ahead on, as the
   update kernels' four inputs do (measured on a 2-core EPYC after a fused AdamW step: 32 MB of
   grads in 0.93-1.13 ms against 1.06-1.50 ms with one stream; 16 KiB blocks taken downwards
   were slower still). Each block's float vectors go into one double. */
static double sumsq_range(const float *x, int64_t lo, int64_t hi) {
    enum { S = SUMSQ_STREAMS, STEP = SUMSQ_BLOCK / SUMSQ_STREAMS };
    const int64_t quarter = (hi - lo) / (S * W) * W; /* whole vectors per sub-range */
    double total = 0.0;
    for (int64_t a = 0; a < quarter; a += STEP) {
        const int64_t b = a + STEP < quarter ? a + STEP : quarter;
        vf acc[S];
        for (int s = 0; s < S; s++) acc[s] = (vf){0};
        for (int64_t i = a; i < b; i += W)
            for (int s = 0; s < S; s++) {
                const vf v = load(x + lo + s * quarter + i);
                acc[s] += v * v;
            }
        vf sum = acc[0];
        for (int s = 1; s < S; s++) sum += acc[s];
        double block = 0.0;
        for (int k = 0; k < W; k++) block += (double)sum[k];
        total += block;
    }
    for (int64_t i = lo + S * quarter; i < hi; i++) total += (double)x[i] * (double)x[i];
    return total;
}

/* out[leaf] = sum of x * x over leaf `leaf` (float32, sizes[leaf] elements), accumulated in
   double, on up to n_threads threads. Chunks are taken from the last to the first, so the
   chunks read last are the first ones an update after it reads; each chunk's sum is kept and
   a leaf's chunks are added in order, so the result does not depend on the threads. Returns
   0, or -2 when out of memory. */
int minitrain_sumsq(const float *const *ptrs, const int64_t *sizes, int64_t n_leaves,
                    int n_threads, double *out) {
    int64_t total = 0;
    for (int64_t leaf = 0; leaf < n_leaves; leaf++) total += padded(sizes[leaf]);
    if (n_threads < 1 || (int64_t)n_threads * 16384 > total) n_threads = 1;
    chunks_t c;
    if (chunks_make(&c, sizes, n_leaves) != 0) return -2;
    double *partial = (double *)malloc((size_t)(c.n_chunks + 1) * sizeof(double));
    if (!partial) {
        free(c.first);
        return -2;
    }
#if defined(_OPENMP)
#pragma omp parallel for num_threads(n_threads) schedule(dynamic, 1)
#endif
    for (int64_t j = 0; j < c.n_chunks; j++) {
        const int64_t k = c.n_chunks - 1 - j;
        int64_t lo, hi;
        const int64_t leaf = chunk_range(&c, sizes, n_leaves, k, &lo, &hi);
        partial[k] = sumsq_range(ptrs[leaf], lo, hi);
    }
    (void)n_threads;
    for (int64_t leaf = 0; leaf < n_leaves; leaf++) {
        double sum = 0.0;
        for (int64_t k = c.first[leaf]; k < c.first[leaf + 1]; k++) sum += partial[k];
        out[leaf] = sum;
    }
    free(partial);
    free(c.first);
    return 0;
}

/* DP-SGD's private sum (Abadi et al. 2016, Algorithm 1; optax's
   differentially_private_aggregate), leaf l's rows at rows[l], (batch, cols[l]) float32: each
   example's L2 norm over all its rows (sumsq_range's sums), its weight
   w_b = coef / max(norm_b, clip) (a NaN norm gives a NaN weight, as torch.clamp does), then per
   leaf out = base + noise_coef * noise + sum_b w_b * row_b (bases[l] 0: no base), DP_COLS
   columns a task. Returns 0, or 1 where memory runs out. */
#define DP_COLS 256

static void private_norm(int64_t b, int64_t n_leaves, const int64_t *cols,
                         const uint64_t *rows, double clip, double coef, float *weights) {
    double sq = 0.0;
    for (int64_t l = 0; l < n_leaves; l++)
        sq += sumsq_range((const float *)rows[l] + b * cols[l], 0, cols[l]);
    const double norm = sqrt(sq);
    weights[b] = (float)(coef / (norm < clip ? clip : norm));
}

static void private_columns(int64_t l, int64_t lo, int64_t batch, const int64_t *cols,
                            const uint64_t *rows, const uint64_t *bases, const uint64_t *noise,
                            float noise_coef, const uint64_t *outs, const float *weights) {
    const int64_t hi = lo + DP_COLS < cols[l] ? lo + DP_COLS : cols[l];
    const float *base = (const float *)bases[l], *z = (const float *)noise[l];
    float acc[DP_COLS], *out = (float *)outs[l];
    for (int64_t j = lo; j < hi; j++) acc[j - lo] = (base ? base[j] : 0.0f) + noise_coef * z[j];
    for (int64_t b = 0; b < batch; b++) {
        const float w = weights[b], *row = (const float *)rows[l] + b * cols[l];
        for (int64_t j = lo; j < hi; j++) acc[j - lo] += w * row[j];
    }
    memcpy(out + lo, acc, (size_t)(hi - lo) * sizeof(float));
}

int minitrain_private_sum(int64_t n_leaves, int64_t batch, const int64_t *cols,
                          const uint64_t *rows, const uint64_t *bases, const uint64_t *noise,
                          const uint64_t *outs, double clip, double coef, double noise_coef,
                          int n_threads) {
    int64_t tasks = 0, work = 0;
    for (int64_t l = 0; l < n_leaves; l++) {
        tasks += (cols[l] + DP_COLS - 1) / DP_COLS;
        work += batch * cols[l];
    }
    int64_t *task = malloc((size_t)(2 * tasks + 1) * sizeof *task), t = 0; /* (leaf, lo) */
    float *weights = malloc((size_t)batch * sizeof *weights);
    if (!task || !weights) {
        free(task);
        free(weights);
        return 1;
    }
    for (int64_t l = 0; l < n_leaves; l++)
        for (int64_t lo = 0; lo < cols[l]; lo += DP_COLS, t += 2) {
            task[t] = l;
            task[t + 1] = lo;
        }
#define PRIVATE_COLUMNS(k) \
    private_columns(task[2 * (k)], task[2 * (k) + 1], batch, cols, rows, bases, noise, \
                    (float)noise_coef, outs, weights)
    if (n_threads > 1 && work >= ((int64_t)1 << 20)) { /* small: no OpenMP region */
#if defined(_OPENMP)
#pragma omp parallel for num_threads(n_threads) schedule(static)
#endif
        for (int64_t b = 0; b < batch; b++)
            private_norm(b, n_leaves, cols, rows, clip, coef, weights);
#if defined(_OPENMP)
#pragma omp parallel for num_threads(n_threads) schedule(static)
#endif
        for (int64_t k = 0; k < tasks; k++) PRIVATE_COLUMNS(k);
    } else {
        for (int64_t b = 0; b < batch; b++)
            private_norm(b, n_leaves, cols, rows, clip, coef, weights);
        for (int64_t k = 0; k < tasks; k++) PRIVATE_COLUMNS(k);
    }
#undef PRIVATE_COLUMNS
    free(task);
    free(weights);
    return 0;
}

#define THREEFRY_BLOCK 1024 /* counters per thread's turn */

static inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

/* What minitrain_threefry writes for counter j: its two words (out[2j], out[2j + 1]), their
   xor (both int64), or from the xor w the uniform low + span * u, at least low, in float
   (u = (w >> 9) * 2^-23) or in double (u = w * 2^-32): random.py's uniform, whose torch ops round
   the same where span is a power of two (span * u is then exact). */
enum { THREEFRY_PAIRS, THREEFRY_XOR, THREEFRY_FLOAT, THREEFRY_DOUBLE };

/* Counters start + lo.. start + hi (at most THREEFRY_BLOCK) of minitrain_threefry: a plain
   loop over counters in uint32 lanes, which the compiler vectorises (the rounds unrolled,
   every rotation a constant), then a loop that writes them out as `mode` says. */
static void threefry_range(const uint32_t ks[3], int64_t start, int64_t lo, int64_t hi,
                           int mode, double low, double span, void *out) {
    static const int R[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
    uint32_t y0[THREEFRY_BLOCK], y1[THREEFRY_BLOCK];
    const int m = (int)(hi - lo);
    for (int j = 0; j < m; j++) {
        const uint64_t i = (uint64_t)(start + lo + j);
        uint32_t x0 = (uint32_t)(i >> 32) + ks[0], x1 = (uint32_t)i + ks[1];
        for (int g = 0; g < 5; g++) {
            for (int r = 0; r < 4; r++) {
                x0 += x1;
                x1 = rotl32(x1, R[g % 2][r]) ^ x0;
            }
            x0 += ks[(g + 1) % 3];
            x1 += ks[(g + 2) % 3] + (uint32_t)(g + 1);
        }
        y0[j] = x0;
        y1[j] = x1;
    }
    int64_t *words = (int64_t *)out + lo, *pairs = (int64_t *)out + 2 * lo;
    float *floats = (float *)out + lo;
    double *doubles = (double *)out + lo;
    const float low_f = (float)low, span_f = (float)span;
    for (int j = 0; j < m; j++) {
        const uint32_t w = y0[j] ^ y1[j];
        if (mode == THREEFRY_PAIRS) {
            pairs[2 * j] = y0[j];
            pairs[2 * j + 1] = y1[j];
        } else if (mode == THREEFRY_XOR) {
            words[j] = w;
        } else if (mode == THREEFRY_FLOAT) {
            const float v = low_f + span_f * ((float)(w >> 9) * 0x1p-23f);
            floats[j] = v < low_f ? low_f : v;
        } else {
            const double v = low + span * ((double)w * 0x1p-32);
            doubles[j] = v < low ? low : v;
        }
    }
}

/* Threefry-2x32-20 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3";
   Random123's threefry2x32 with Skein's key schedule k0, k1, k0 ^ k1 ^ 0x1BD11BDA) of the
   counters start..start + n, counter i as the words (i >> 32, i & 0xFFFFFFFF): random.py's
   _rounds. Writes each counter as `mode` says (THREEFRY_PAIRS...), on up to n_threads threads
   for large n. Returns 0. */
int minitrain_threefry(uint32_t k0, uint32_t k1, int64_t start, int64_t n, int mode,
                       double low, double span, void *out, int n_threads) {
    const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
    const int64_t blocks = (n + THREEFRY_BLOCK - 1) / THREEFRY_BLOCK;
    if (n_threads < 1 || (int64_t)n_threads * 16 > blocks) { /* small: no OpenMP region */
        for (int64_t lo = 0; lo < n; lo += THREEFRY_BLOCK)
            threefry_range(ks, start, lo, n - lo < THREEFRY_BLOCK ? n : lo + THREEFRY_BLOCK, mode,
                           low, span, out);
        return 0;
    }
#if defined(_OPENMP)
#pragma omp parallel for num_threads(n_threads) schedule(static)
#endif
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * THREEFRY_BLOCK;
        const int64_t hi = n - lo < THREEFRY_BLOCK ? n : lo + THREEFRY_BLOCK;
        threefry_range(ks, start, lo, hi, mode, low, span, out);
    }
    return 0;
}

/* split(k)'s two keys into keys[0..3] (random.split), then minitrain_threefry's draw `mode`
   of counters 0..n under the second: random.py's _split_normal in one call. Returns 0. */
int minitrain_split_draw(uint32_t k0, uint32_t k1, int64_t n, int mode, double low, double span,
                         int64_t *keys, void *out, int n_threads) {
    minitrain_threefry(k0, k1, 0, 2, THREEFRY_PAIRS, 0.0, 1.0, keys, 1);
    return minitrain_threefry((uint32_t)keys[2], (uint32_t)keys[3], 0, n, mode, low, span, out,
                              n_threads);
}
