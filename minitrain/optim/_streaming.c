/* One-pass optimizer updates for CPU float32 leaves, built by minitrain/optim/streaming.py.

   Each update reads params, grads and state once and writes the new params and state once.
   When the outputs are fresh buffers (a pure update), the writes are non-temporal stores
   (_mm256_stream_ps), which skip the read-for-ownership a plain store makes of every output
   cache line: an out-of-place update then moves as many bytes through DRAM as torch's
   in-place fused kernels do (Intel 64 and IA-32 Optimization Reference Manual, 9.5 "Streaming
   stores"; AMD64 Architecture Programmer's Manual vol. 1, 3.9.4). When the outputs are the
   inputs (a donated update), plain stores keep the data in cache.

   The math of each rule follows torch's fused CPU kernels and foreach paths
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

#define BLOCK 512 /* elements computed into stack buffers before they are stored */
#define ALIGN 16  /* elements: thread slices start on 64-byte boundaries */

typedef void (*range_fn)(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt);

/* Copy n floats from an L1-resident block to dst, streaming when asked and dst is aligned. */
static void put(float *dst, const float *src, int64_t n, int nt) {
#if defined(__AVX__)
    if (nt && ((uintptr_t)dst % 32) == 0) {
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
        for (; j < n; j++) dst[j] = src[j];
        return;
    }
#endif
    (void)nt;
    memcpy(dst, src, (size_t)n * sizeof(float));
}

/* Adam / AdamW. hp: beta1, beta2, eps, weight_decay, lr, step_size (lr / bias_correction1),
   bias_correction2_sqrt, decoupled (1 AdamW, 0 Adam), amsgrad (0 or 1).
   ptr: p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, p_out, exp_avg_out, exp_avg_sq_out,
   max_exp_avg_sq_out (the max pointers are unused without amsgrad). */
static void adam_range(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const float beta2 = (float)hp[1], eps = (float)hp[2], wd = (float)hp[3];
    const float w = (float)(1.0 - hp[0]);            /* lerp weight of exp_avg.lerp_(g, 1-beta1) */
    const float one_minus_beta2 = (float)(1.0 - hp[1]);
    const float decay = (float)(1.0 - hp[4] * hp[3]); /* AdamW: p *= 1 - lr * wd */
    const float step_size = (float)hp[5], inv_bc2_sqrt = (float)(1.0 / hp[6]);
    const int decoupled = hp[7] != 0.0, amsgrad = hp[8] != 0.0;
    const int small_w = fabsf(w) < 0.5f; /* at::lerp's two forms, chosen per weight */
    const float *p = ptr[0], *g = ptr[1], *m = ptr[2], *v = ptr[3], *vmax = ptr[4];
    float *p_out = ptr[5], *m_out = ptr[6], *v_out = ptr[7], *vmax_out = ptr[8];
    float bp[BLOCK], bm[BLOCK], bv[BLOCK], bx[BLOCK];
    for (int64_t i = lo; i < hi; i += BLOCK) {
        const int64_t n = hi - i < BLOCK ? hi - i : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            float pj = p[i + j], gj = g[i + j];
            if (decoupled) pj *= decay;
            else gj += pj * wd;
            const float mj = m[i + j];
            const float mn = small_w ? mj + w * (gj - mj) : gj - (1.0f - w) * (gj - mj);
            const float vn = v[i + j] * beta2 + one_minus_beta2 * gj * gj;
            float second = vn;
            if (amsgrad) {
                second = vmax[i + j] > vn ? vmax[i + j] : vn;
                bx[j] = second;
            }
            const float denom = sqrtf(second) * inv_bc2_sqrt + eps;
            bp[j] = pj - step_size * mn / denom;
            bm[j] = mn;
            bv[j] = vn;
        }
        put(p_out + i, bp, n, nt);
        put(m_out + i, bm, n, nt);
        put(v_out + i, bv, n, nt);
        if (amsgrad) put(vmax_out + i, bx, n, nt);
    }
}

/* SGD. hp: lr, momentum, dampening, weight_decay, nesterov, first_step, has_momentum.
   ptr: p, g, momentum_buffer, p_out, momentum_buffer_out. */
static void sgd_range(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const float lr = (float)hp[0], mu = (float)hp[1], damp = (float)(1.0 - hp[2]);
    const float wd = (float)hp[3];
    const int nesterov = hp[4] != 0.0, first = hp[5] != 0.0, has_momentum = hp[6] != 0.0;
    const float *p = ptr[0], *g = ptr[1], *b = ptr[2];
    float *p_out = ptr[3], *b_out = ptr[4];
    float bp[BLOCK], bb[BLOCK];
    for (int64_t i = lo; i < hi; i += BLOCK) {
        const int64_t n = hi - i < BLOCK ? hi - i : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            const float pj = p[i + j];
            float gj = g[i + j] + pj * wd;
            if (has_momentum) {
                const float bn = first ? gj : b[i + j] * mu + damp * gj;
                bb[j] = bn;
                gj = nesterov ? gj + mu * bn : bn;
            }
            bp[j] = pj - lr * gj;
        }
        put(p_out + i, bp, n, nt);
        if (has_momentum) put(b_out + i, bb, n, nt);
    }
}

/* AdaGrad. hp: clr (lr / (1 + (step - 1) * lr_decay)), weight_decay, eps.
   ptr: p, g, sum, p_out, sum_out. */
static void adagrad_range(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const float clr = (float)hp[0], wd = (float)hp[1], eps = (float)hp[2];
    const float *p = ptr[0], *g = ptr[1], *s = ptr[2];
    float *p_out = ptr[3], *s_out = ptr[4];
    float bp[BLOCK], bs[BLOCK];
    for (int64_t i = lo; i < hi; i += BLOCK) {
        const int64_t n = hi - i < BLOCK ? hi - i : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            const float pj = p[i + j];
            const float gj = g[i + j] + pj * wd;
            const float sn = s[i + j] + gj * gj;
            bs[j] = sn;
            bp[j] = pj - clr * gj / (sqrtf(sn) + eps);
        }
        put(p_out + i, bp, n, nt);
        put(s_out + i, bs, n, nt);
    }
}

/* RMSprop. hp: lr, alpha, eps, weight_decay, momentum, centered, has_momentum.
   ptr: p, g, square_avg, momentum_buffer, grad_avg, and the same three buffers' outputs after
   p_out: p_out, square_avg_out, momentum_buffer_out, grad_avg_out. */
static inline __attribute__((always_inline)) void rmsprop_body(
    const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt,
    const int centered, const int has_momentum) {
    const float lr = (float)hp[0], alpha = (float)hp[1], eps = (float)hp[2];
    const float wd = (float)hp[3], mu = (float)hp[4];
    const float w = (float)(1.0 - hp[1]);
    const int small_w = fabsf(w) < 0.5f;
    const float *p = ptr[0], *g = ptr[1], *sq = ptr[2], *b = ptr[3], *ga = ptr[4];
    float *p_out = ptr[5], *sq_out = ptr[6], *b_out = ptr[7], *ga_out = ptr[8];
    float bp[BLOCK], bsq[BLOCK], bb[BLOCK], bga[BLOCK];
    for (int64_t i = lo; i < hi; i += BLOCK) {
        const int64_t n = hi - i < BLOCK ? hi - i : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            const float pj = p[i + j];
            const float gj = g[i + j] + pj * wd;
            const float sqn = sq[i + j] * alpha + w * gj * gj;
            bsq[j] = sqn;
            float avg;
            if (centered) {
                const float gaj = ga[i + j];
                const float gan = small_w ? gaj + w * (gj - gaj) : gj - (1.0f - w) * (gj - gaj);
                bga[j] = gan;
                avg = sqrtf(sqn - gan * gan) + eps;
            } else {
                avg = sqrtf(sqn) + eps;
            }
            if (has_momentum) {
                const float bn = b[i + j] * mu + gj / avg;
                bb[j] = bn;
                bp[j] = pj - lr * bn;
            } else {
                bp[j] = pj - lr * (gj / avg);
            }
        }
        put(p_out + i, bp, n, nt);
        put(sq_out + i, bsq, n, nt);
        if (has_momentum) put(b_out + i, bb, n, nt);
        if (centered) put(ga_out + i, bga, n, nt);
    }
}

/* One copy of the loop per combination of flags, so that each vectorizes without branches. */
static void rmsprop_range(const double *hp, float *const *ptr, int64_t lo, int64_t hi, int nt) {
    const int centered = hp[5] != 0.0, has_momentum = hp[6] != 0.0;
    if (centered && has_momentum) rmsprop_body(hp, ptr, lo, hi, nt, 1, 1);
    else if (centered) rmsprop_body(hp, ptr, lo, hi, nt, 1, 0);
    else if (has_momentum) rmsprop_body(hp, ptr, lo, hi, nt, 0, 1);
    else rmsprop_body(hp, ptr, lo, hi, nt, 0, 0);
}

static const range_fn RULES[] = {adam_range, sgd_range, adagrad_range, rmsprop_range};
#define N_RULES ((int)(sizeof(RULES) / sizeof(RULES[0])))

typedef struct {
    range_fn fn;
    const double *hp;
    float *const *ptrs; /* n_leaves rows of n_ptrs pointers */
    const int64_t *sizes;
    int64_t n_leaves, n_ptrs, total;
    int n_threads, nt;
} job_t;

typedef struct {
    const job_t *job;
    int rank;
} worker_t;

static int64_t align_down(int64_t x) { return x / ALIGN * ALIGN; }

/* Thread `rank` takes an equal share of all leaves' elements laid end to end. */
static void *work(void *arg) {
    const worker_t *worker = (const worker_t *)arg;
    const job_t *job = worker->job;
    const int64_t begin = align_down(job->total * worker->rank / job->n_threads);
    const int64_t end = worker->rank + 1 == job->n_threads
        ? job->total : align_down(job->total * (worker->rank + 1) / job->n_threads);
    int64_t offset = 0;
    for (int64_t leaf = 0; leaf < job->n_leaves && offset < end; leaf++) {
        const int64_t size = job->sizes[leaf];
        const int64_t lo = begin > offset ? begin - offset : 0;
        const int64_t hi = end - offset < size ? end - offset : size;
        if (lo < hi) job->fn(job->hp, job->ptrs + leaf * job->n_ptrs, lo, hi, job->nt);
        offset += (size + ALIGN - 1) / ALIGN * ALIGN; /* each leaf starts a fresh slice */
    }
#if defined(__AVX__)
    if (job->nt) _mm_sfence(); /* streaming stores are weakly ordered: drain them here */
#endif
    return NULL;
}

/* Run rule `rule` over n_leaves leaves on up to n_threads threads. Built with -fopenmp, the
   library's libgomp.so.1 resolves to the copy torch has already loaded, so the update runs on
   torch's own (already spinning) OpenMP threads. Returns 0, or -1 (nothing done) for an
   unknown rule. */
int minitrain_update(int rule, const double *hp, float *const *ptrs, const int64_t *sizes,
                     int64_t n_leaves, int64_t n_ptrs, int n_threads, int nontemporal) {
    if (rule < 0 || rule >= N_RULES) return -1;
    int64_t total = 0;
    for (int64_t leaf = 0; leaf < n_leaves; leaf++) total += (sizes[leaf] + ALIGN - 1) / ALIGN * ALIGN;
    if (n_threads < 1 || (int64_t)n_threads * 16384 > total) n_threads = 1; /* small: one thread */
    job_t job = {RULES[rule], hp, ptrs, sizes, n_leaves, n_ptrs, total, 1, nontemporal};
#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads) firstprivate(job)
    {
        job.n_threads = omp_get_num_threads();
        worker_t worker = {&job, omp_get_thread_num()};
        work(&worker);
    }
#else
    worker_t worker = {&job, 0};
    work(&worker);
#endif
    return 0;
}
