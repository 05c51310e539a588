/* Fused float32 products for small-batch decoding on CPU (gridrl rollout node).
 *
 * One call computes, for x (M, K) row-major and a weight W (N, K) packed once by
 * gridrl.rollout.backends.cpu_kernels.pack_weight:
 *
 *     acc = x W^T + u B^T                 (u (M, R): a LoRA adapter's x A^T, optional)
 *     acc = r * acc                       (eps >= 0: r[m] = 1 / sqrt(mean(x[m]^2) + eps),
 *                                          RMSNorm, its weight folded into W and A)
 *     acc = acc + bias + add              (bias (N,), add (M, N): a residual; optional)
 *     out = acc                           (swiglu == 0; out (M, N), may alias add)
 *     out = silu(acc_gate) * acc_up       (swiglu == 1; W stacks gate and up, out (M, N/2))
 *
 * Why: at a decode batch of a few rows every product is a matrix-vector-like pass over the
 * weight, bound by memory bandwidth, and the elementwise work around it costs more in
 * separate kernels (each reloading the activations after the weights flushed the caches)
 * than in the product's epilogue. The packed layout streams each weight once, in order,
 * with a software prefetch a few KB ahead: blocks of NB output columns, and within a block
 * every k holds the NB (swiglu: 2 NB, gate then up) weights of that input column.
 *
 * Layouts: plain W packed [ceil(N/NB)][K][NB]; swiglu [ceil(H/NB)][K][2 NB] with H = N/2;
 * B packed the same way with R in place of K. Padded columns are zero and never stored.
 * Threads: OpenMP over column blocks (the caller's libgomp team: torch's).
 */
#include <math.h>
#include <stddef.h>

#define NB 16
#define CHUNK 8                /* rows per register tile */
#define PREFETCH_BYTES 4096

typedef float v16 __attribute__((vector_size(NB * sizeof(float))));

static inline v16 load16(const float *p) {
    v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* acc[m] += sum_k x[m, k] * w[k, 0:NB] over a tile of `rows` rows (w rows `stride` floats apart). */
static inline void tile(const float *x, int rows, int ldx, int depth, const float *w, int stride,
                        v16 *acc) {
    if (rows == CHUNK) {
        for (int k = 0; k < depth; k++) {
            __builtin_prefetch(w + (size_t)k * stride + PREFETCH_BYTES / sizeof(float));
            v16 wv = load16(w + (size_t)k * stride);
#pragma GCC unroll 8
            for (int m = 0; m < CHUNK; m++) acc[m] += x[(size_t)m * ldx + k] * wv;
        }
    } else {
        for (int k = 0; k < depth; k++) {
            __builtin_prefetch(w + (size_t)k * stride + PREFETCH_BYTES / sizeof(float));
            v16 wv = load16(w + (size_t)k * stride);
            for (int m = 0; m < rows; m++) acc[m] += x[(size_t)m * ldx + k] * wv;
        }
    }
}

/* tile() for the gate (w[k, 0:NB]) and up (w[k, NB:2 NB]) halves of a swiglu block at once. */
static inline void tile2(const float *x, int rows, int ldx, int depth, const float *w,
                         v16 *gate, v16 *up) {
    const int stride = 2 * NB;
    if (rows == CHUNK) {
        for (int k = 0; k < depth; k++) {
            __builtin_prefetch(w + (size_t)k * stride + PREFETCH_BYTES / sizeof(float));
            v16 g = load16(w + (size_t)k * stride), v = load16(w + (size_t)k * stride + NB);
#pragma GCC unroll 8
            for (int m = 0; m < CHUNK; m++) {
                gate[m] += x[(size_t)m * ldx + k] * g;
                up[m] += x[(size_t)m * ldx + k] * v;
            }
        }
    } else {
        for (int k = 0; k < depth; k++) {
            __builtin_prefetch(w + (size_t)k * stride + PREFETCH_BYTES / sizeof(float));
            v16 g = load16(w + (size_t)k * stride), v = load16(w + (size_t)k * stride + NB);
            for (int m = 0; m < rows; m++) {
                gate[m] += x[(size_t)m * ldx + k] * g;
                up[m] += x[(size_t)m * ldx + k] * v;
            }
        }
    }
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* Returns 0, or -1 on bad arguments (nothing written). */
int gridrl_decode_linear(const float *x, int M, int K, const float *wp, int N,
                         const float *u, int R, const float *bp,
                         float eps, const float *bias, const float *add, int swiglu,
                         float *out) {
    if (M < 1 || K < 1 || N < 1 || (swiglu && (N % 2 || bias || add)) || (u && R < 1))
        return -1;
    const int width = swiglu ? N / 2 : N;      /* output columns */
    const int nblocks = (width + NB - 1) / NB;
    const int stride = swiglu ? 2 * NB : NB;   /* floats per k in a block */
    float scale[M];
    for (int m = 0; m < M; m++) {
        scale[m] = 1.0f;
        if (eps >= 0) {
            double ss = 0;
            for (int k = 0; k < K; k++) ss += (double)x[(size_t)m * K + k] * x[(size_t)m * K + k];
            scale[m] = (float)(1.0 / sqrt(ss / K + eps));
        }
    }
#pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const float *wb = wp + (size_t)b * K * stride;
        const float *bb = u ? bp + (size_t)b * R * stride : NULL;
        const int cols = width - b * NB < NB ? width - b * NB : NB;
        for (int m0 = 0; m0 < M; m0 += CHUNK) {
            const int rows = M - m0 < CHUNK ? M - m0 : CHUNK;
            v16 acc[CHUNK], acc2[CHUNK];
            for (int m = 0; m < CHUNK; m++) acc[m] = acc2[m] = (v16){0};
            if (swiglu) {
                tile2(x + (size_t)m0 * K, rows, K, K, wb, acc, acc2);
                if (u) tile2(u + (size_t)m0 * R, rows, R, R, bb, acc, acc2);
            } else {
                tile(x + (size_t)m0 * K, rows, K, K, wb, stride, acc);
                if (u) tile(u + (size_t)m0 * R, rows, R, R, bb, stride, acc);
            }
            for (int m = 0; m < rows; m++) {
                const float s = scale[m0 + m];
                float *o = out + (size_t)(m0 + m) * width + (size_t)b * NB;
                if (swiglu) {
                    for (int i = 0; i < cols; i++) o[i] = silu(s * acc[m][i]) * (s * acc2[m][i]);
                } else {
                    const float *a = add ? add + (size_t)(m0 + m) * N + (size_t)b * NB : NULL;
                    for (int i = 0; i < cols; i++) {
                        float y = s * acc[m][i];
                        if (bias) y += bias[b * NB + i];
                        if (a) y += a[i];
                        o[i] = y;
                    }
                }
            }
        }
    }
    return 0;
}
