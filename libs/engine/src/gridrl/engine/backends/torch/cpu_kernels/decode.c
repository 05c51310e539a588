/* Fused float32 kernels for small-batch decoding on CPU (gridrl rollout node).
 *
 * gridrl_decode_linear: a projection and the elementwise work around it. One call computes,
 * for x (M, K) row-major and a weight W (N, K) packed once by
 * gridrl.engine.backends.torch.cpu_kernels.pack_weight:
 *
 *     acc = x W^T + (x A^T) B^T           (a LoRA adapter's A (R, K) and B (N, R); optional)
 *                                         (seg: per row m the ranks [seg[2m], seg[2m+1]) of
 *                                          A/B that apply to it, the others count 0: several
 *                                          adapters' factors stacked along R, each row
 *                                          reading only its own -- S-LoRA/Punica batching)
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
 * B packed the same way with R in place of K; A plain row-major (R, K). Padded columns are
 * zero and never stored. W is float32 or bfloat16 (widened to float32 as it is read: half
 * the bytes a step, the same float32 arithmetic); A and B are float32.
 * Threads: OpenMP over column blocks (the caller's libgomp team: torch's), statically or
 * dynamically assigned (gridrl_set_dynamic_blocks).
 *
 * gridrl_decode_attention: one decode token's attention in a layer, see its comment.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NB 16
#define PREFETCH_BYTES 4096
/* VW: floats in one vector register (AVX-512: 16, else 8, e.g. AVX2), so that a block row of
 * NB weights is NV registers. Rows per register tile (CHUNK): its accumulators (rows x NV
 * registers; a swiglu tile twice that) plus a broadcast input must fit in the registers, or
 * every FMA goes through the stack. AVX-512 (32 registers): 8 rows, gate and up together.
 * Otherwise (AVX2: 16 registers): 6 rows (12 accumulators), and a swiglu block's gate and up
 * halves as two plain tiles (SPLIT_SWIGLU) -- the same sums, each lane's in k order, so the
 * results do not depend on the choice. Measured on a 2-core AVX2 EPYC against 4 rows and
 * 2-row swiglu tiles: 16 rows x (576 -> 960) 151 -> 119 us, (576 -> 2 x 1536) 559 -> 464 us
 * (bench/decode_kernels.py has the comparison with oneDNN). */
#if defined(__AVX512F__)
#define VW 16
#define CHUNK 8
#define SPLIT_SWIGLU 0
#else
#define VW 8
#define CHUNK 6
#define SPLIT_SWIGLU 1
#endif
#define NV (NB / VW)

typedef float vf __attribute__((vector_size(VW * sizeof(float))));

static inline vf loadv(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

/* Weights come as float32 or as bfloat16 (the high 16 bits of a float32, round to nearest
 * even when packed): a bfloat16 block row is widened to float32 in registers (zero-extend,
 * shift left 16: exact) and the products and sums run in float32 as for a float32 weight.
 * At a decode batch every weight element is read once a step for a few FMAs, so halving the
 * bytes read is what matters where the pass is memory-bound; no bf16 arithmetic instruction
 * is needed (AVX2 has none). */
typedef unsigned short bf16;
typedef unsigned short vh __attribute__((vector_size(VW * sizeof(unsigned short))));
typedef unsigned int vu __attribute__((vector_size(VW * sizeof(unsigned int))));

static inline vf loadw_f32(const float *p) { return loadv(p); }

static inline vf loadw_bf16(const bf16 *p) {
#if VW == 16 && defined(__AVX512F__)
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
#elif VW == 8 && defined(__AVX2__)
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
#else  /* gcc 12 turns this into two half-width widenings and an insert on AVX2 */
    vh h;
    __builtin_memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    __builtin_memcpy(&v, &u, sizeof v);
    return v;
#endif
}

/* The tiles for a weight of element type WT read with LOADW:
 * tile_rows_SFX: acc[m, 0:NB] += sum_k x[m, k] * w[k, 0:NB] for `rows` (a compile-time
 * constant once inlined) rows; w's rows are `stride` elements apart, acc is (rows, NB). The
 * sums run in local registers, each lane's in k order.
 * tile2_rows_SFX: the same for the gate (w[k, 0:NB]) and up (w[k, NB:2 NB]) halves of a
 * swiglu block.
 * tile_SFX / tile2_SFX: the tiles of up to CHUNK rows, each row count its own unrolled copy. */
#define DEFINE_TILES(SFX, WT, LOADW)                                                         \
static inline __attribute__((always_inline)) void tile_rows_##SFX(                          \
        const int rows, const float *restrict x, int ldx, int depth, const WT *restrict w,   \
        int stride, float *restrict acc) {                                                   \
    vf a[CHUNK][NV];                                                                         \
    _Pragma("GCC unroll 8")                                                                  \
    for (int m = 0; m < rows; m++)                                                           \
        for (int j = 0; j < NV; j++) a[m][j] = loadv(acc + m * NB + j * VW);                 \
    for (int k = 0; k < depth; k++) {                                                        \
        __builtin_prefetch(w + (size_t)k * stride + PREFETCH_BYTES / sizeof(WT));            \
        vf wv[NV];                                                                           \
        for (int j = 0; j < NV; j++) wv[j] = LOADW(w + (size_t)k * stride + j * VW);         \
        _Pragma("GCC unroll 8")                                                              \
        for (int m = 0; m < rows; m++) {                                                     \
            const float xm = x[(size_t)m * ldx + k];                                         \
            for (int j = 0; j < NV; j++) a[m][j] += xm * wv[j];                              \
        }                                                                                    \
    }                                                                                        \
    _Pragma("GCC unroll 8")                                                                  \
    for (int m = 0; m < rows; m++)                                                           \
        for (int j = 0; j < NV; j++) storev(acc + m * NB + j * VW, a[m][j]);                 \
}                                                                                            \
                                                                                             \
static inline __attribute__((always_inline)) void tile2_rows_##SFX(                         \
        const int rows, const float *restrict x, int ldx, int depth, const WT *restrict w,   \
        float *restrict gate, float *restrict up) {                                          \
    const int stride = 2 * NB;                                                               \
    vf g[CHUNK][NV], u[CHUNK][NV];                                                           \
    _Pragma("GCC unroll 8")                                                                  \
    for (int m = 0; m < rows; m++)                                                           \
        for (int j = 0; j < NV; j++) {                                                       \
            g[m][j] = loadv(gate + m * NB + j * VW);                                         \
            u[m][j] = loadv(up + m * NB + j * VW);                                           \
        }                                                                                    \
    for (int k = 0; k < depth; k++) {                                                        \
        __builtin_prefetch(w + (size_t)k * stride + PREFETCH_BYTES / sizeof(WT));            \
        vf gv[NV], uv[NV];                                                                   \
        for (int j = 0; j < NV; j++) {                                                       \
            gv[j] = LOADW(w + (size_t)k * stride + j * VW);                                  \
            uv[j] = LOADW(w + (size_t)k * stride + NB + j * VW);                             \
        }                                                                                    \
        _Pragma("GCC unroll 8")                                                              \
        for (int m = 0; m < rows; m++) {                                                     \
            const float xm = x[(size_t)m * ldx + k];                                         \
            for (int j = 0; j < NV; j++) {                                                   \
                g[m][j] += xm * gv[j];                                                       \
                u[m][j] += xm * uv[j];                                                       \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    _Pragma("GCC unroll 8")                                                                  \
    for (int m = 0; m < rows; m++)                                                           \
        for (int j = 0; j < NV; j++) {                                                       \
            storev(gate + m * NB + j * VW, g[m][j]);                                         \
            storev(up + m * NB + j * VW, u[m][j]);                                           \
        }                                                                                    \
}                                                                                            \
                                                                                             \
static void tile_##SFX(const float *x, int rows, int ldx, int depth, const WT *w, int stride, \
                       float *acc) {                                                         \
    switch (rows) {                                                                          \
    TILE_CASES(SFX)                                                                          \
    default: tile_rows_##SFX(1, x, ldx, depth, w, stride, acc); break;                       \
    }                                                                                        \
}                                                                                            \
                                                                                             \
static void tile2_##SFX(const float *x, int rows, int ldx, int depth, const WT *w,          \
                        float *gate, float *up) {                                            \
    if (SPLIT_SWIGLU) {                                                                      \
        tile_##SFX(x, rows, ldx, depth, w, 2 * NB, gate);                                    \
        tile_##SFX(x, rows, ldx, depth, w + NB, 2 * NB, up);                                 \
        return;                                                                              \
    }                                                                                        \
    switch (rows) {                                                                          \
    TILE2_CASES(SFX)                                                                         \
    default: tile2_rows_##SFX(1, x, ldx, depth, w, gate, up); break;                         \
    }                                                                                        \
}

#define TILE_CASE(SFX, n) case n: tile_rows_##SFX(n, x, ldx, depth, w, stride, acc); break;
#define TILE2_CASE(SFX, n) case n: tile2_rows_##SFX(n, x, ldx, depth, w, gate, up); break;
#if CHUNK >= 8
#define TILE_CASES(SFX) TILE_CASE(SFX, 8) TILE_CASE(SFX, 7) TILE_CASE(SFX, 6) TILE_CASE(SFX, 5) \
    TILE_CASE(SFX, 4) TILE_CASE(SFX, 3) TILE_CASE(SFX, 2)
#define TILE2_CASES(SFX) TILE2_CASE(SFX, 8) TILE2_CASE(SFX, 7) TILE2_CASE(SFX, 6)             \
    TILE2_CASE(SFX, 5) TILE2_CASE(SFX, 4) TILE2_CASE(SFX, 3) TILE2_CASE(SFX, 2)
#else  /* 6-row tiles; tile2 always splits (SPLIT_SWIGLU), so it has no tiles of its own */
#define TILE_CASES(SFX) TILE_CASE(SFX, 6) TILE_CASE(SFX, 5) TILE_CASE(SFX, 4) TILE_CASE(SFX, 3) \
    TILE_CASE(SFX, 2)
#define TILE2_CASES(SFX)
#endif

DEFINE_TILES(f32, float, loadw_f32)
DEFINE_TILES(bf16, bf16, loadw_bf16)

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

typedef int vi __attribute__((vector_size(VW * sizeof(int))));

/* The sum of a vector's lanes, by halving in registers. */
static inline float hsum(vf v) {
#if VW == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* sum_k p[k] q[k] over n floats, VW lanes at a time. */
static inline float dot(const float *p, const float *q, int n) {
    vf acc = {0};
    int k = 0;
    for (; k + VW <= n; k += VW) acc += loadv(p + k) * loadv(q + k);
    float s = hsum(acc);
    for (; k < n; k++) s += p[k] * q[k];
    return s;
}

/* How a product's column blocks go to the team's threads: 0 static (each thread one
 * contiguous run of blocks, decided up front), 1 dynamic (threads take blocks as they finish
 * their last: a thread that shares its core with another process does less, instead of the
 * whole team waiting for it). Set per process by gridrl_set_dynamic_blocks; either way every
 * output column is computed the same way, so the results do not depend on it. */
static int dynamic_blocks = 0;

void gridrl_set_dynamic_blocks(int on) { dynamic_blocks = on != 0; }

/* One column block of gridrl_decode_linear (see there), all M rows. */
static inline void linear_block(int b, const float *x, int M, int K, const void *wp,
                                int weight_bf16, int width, int stride, const float *u,
                                int R, const float *bp, const float *scale, const float *bias,
                                const float *add, int N, int swiglu, float *out) {
    const size_t at = (size_t)b * K * stride;
    const float *wf = weight_bf16 ? NULL : (const float *)wp + at;
    const bf16 *wh = weight_bf16 ? (const bf16 *)wp + at : NULL;
    const float *bb = u ? bp + (size_t)b * R * stride : NULL;
    const int cols = width - b * NB < NB ? width - b * NB : NB;
    for (int m0 = 0; m0 < M; m0 += CHUNK) {
        const int rows = M - m0 < CHUNK ? M - m0 : CHUNK;
        float acc[CHUNK * NB] __attribute__((aligned(64))) = {0};
        float acc2[CHUNK * NB] __attribute__((aligned(64))) = {0};
        const float *xm = x + (size_t)m0 * K;
        if (swiglu) {
            if (wh) tile2_bf16(xm, rows, K, K, wh, acc, acc2);
            else tile2_f32(xm, rows, K, K, wf, acc, acc2);
            if (u) tile2_f32(u + (size_t)m0 * R, rows, R, R, bb, acc, acc2);
        } else {
            if (wh) tile_bf16(xm, rows, K, K, wh, stride, acc);
            else tile_f32(xm, rows, K, K, wf, stride, acc);
            if (u) tile_f32(u + (size_t)m0 * R, rows, R, R, bb, stride, acc);
        }
        for (int m = 0; m < rows; m++) {
            const float s = scale[m0 + m];
            float *o = out + (size_t)(m0 + m) * width + (size_t)b * NB;
            if (swiglu) {
                for (int i = 0; i < cols; i++)
                    o[i] = silu(s * acc[m * NB + i]) * (s * acc2[m * NB + i]);
            } else {
                const float *r = add ? add + (size_t)(m0 + m) * N + (size_t)b * NB : NULL;
                for (int i = 0; i < cols; i++) {
                    float y = s * acc[m * NB + i];
                    if (bias) y += bias[b * NB + i];
                    if (r) y += r[i];
                    o[i] = y;
                }
            }
        }
    }
}

/* wp: the packed weight, float32 (weight_bf16 == 0) or bfloat16 (1); the LoRA factors are
 * float32 either way. Returns 0, or -1 on bad arguments or no memory (nothing written). */
int gridrl_decode_linear(const float *x, int M, int K, const void *wp, int weight_bf16, int N,
                         const float *a, int R, const float *bp, const int *seg,
                         float eps, const float *bias, const float *add, int swiglu,
                         float *out) {
    if (M < 1 || K < 1 || N < 1 || (swiglu && (N % 2 || bias || add)) || (a && R < 1))
        return -1;
    const int width = swiglu ? N / 2 : N;      /* output columns */
    const int nblocks = (width + NB - 1) / NB;
    const int stride = swiglu ? 2 * NB : NB;   /* elements per k in a block */
    float scale_stack[64], u_stack[512];
    float *scale = M <= 64 ? scale_stack : malloc(sizeof(float) * M);
    float *u = !a ? NULL : M * R <= 512 ? u_stack : malloc(sizeof(float) * M * R);
    if (!scale || (a && !u)) {
        if (scale != scale_stack) free(scale);
        if (u != u_stack) free(u);
        return -1;
    }
    const int dynamic = dynamic_blocks;
#pragma omp parallel
    {
        /* prologue: the rows' RMSNorm scales and the LoRA input u = x A^T (M, R) */
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            scale[m] = 1.0f;
            if (eps >= 0) {
                const float *xm = x + (size_t)m * K;
                double ss = 0;
                for (int k = 0; k < K; k++) ss += (double)xm[k] * xm[k];
                scale[m] = (float)(1.0 / sqrt(ss / K + eps));
            }
        }
        if (a) {
#pragma omp for schedule(static)
            for (int i = 0; i < M * R; i++) {
                const int m = i / R, r = i % R;
                u[i] = seg && (r < seg[2 * m] || r >= seg[2 * m + 1]) ? 0.0f
                       : dot(x + (size_t)m * K, a + (size_t)r * K, K);
            }
        }
        if (dynamic) {
#pragma omp for schedule(dynamic, 1)
            for (int b = 0; b < nblocks; b++)
                linear_block(b, x, M, K, wp, weight_bf16, width, stride, u, R, bp, scale, bias,
                             add, N, swiglu, out);
        } else {
#pragma omp for schedule(static)
            for (int b = 0; b < nblocks; b++)
                linear_block(b, x, M, K, wp, weight_bf16, width, stride, u, R, bp, scale, bias,
                             add, N, swiglu, out);
        }
    }
    if (scale != scale_stack) free(scale);
    if (u && u != u_stack) free(u);
    return 0;
}

/* One decode token's self-attention for a batch of B rows, in one call:
 *
 *   q, k = rotary(q), rotary(k)       pairs (2j, 2j+1) of each head turned by angle j:
 *                                     (a, b) -> (a c_j - b s_j, a s_j + b c_j)
 *   kcache[b, g, col] = k; vcache[b, g, col] = v
 *   out[b, h] = softmax(scale * q_h . kcache[b, h / G, 0..col] + mask[b, 0..col])
 *               @ vcache[b, h / G, 0..col]         (G = HQ / HKV query heads per kv head)
 *
 * qkv: (B, (HQ + 2 HKV) D), each row q heads, k heads, v heads (q, k in interleaved-pair
 * order); cos, sin: (B, D/2) the rows' rotary angles' cosines and sines; kcache, vcache:
 * (B, HKV, W, D) contiguous, column `col` < W written here; mask: NULL or additive, row b at
 * mask + b * mask_ld, columns 0..col; out: (B, HQ D). Returns 0, or -1 on bad arguments or
 * no memory. Threads: OpenMP over (row, kv head).
 */
int gridrl_decode_attention(const float *qkv, int B, int HQ, int HKV, int D,
                            const float *cos, const float *sin,
                            float *kcache, float *vcache, int W, int col,
                            const float *mask, long mask_ld, float scale, float *out) {
    if (B < 1 || HKV < 1 || HQ % HKV || D < 2 || D % 2 || col < 0 || col >= W) return -1;
    const int G = HQ / HKV, half = D / 2, L = col + 1;
    const long row = (long)(HQ + 2 * HKV) * D;
    int failed = 0;
#pragma omp parallel
    {
        /* per thread: the G rotated query heads (G, D) and their scores (G, L) */
        float *qrot = malloc(sizeof(float) * G * D), *scores = malloc(sizeof(float) * G * L);
        if (!qrot || !scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < B * HKV; task++) {
            if (!qrot || !scores) continue;
            const int b = task / HKV, g = task % HKV;
            const float *c = cos + (size_t)b * half, *s = sin + (size_t)b * half;
            const float *kin = qkv + b * row + (long)(HQ + g) * D;
            const float *vin = qkv + b * row + (long)(HQ + HKV + g) * D;
            float *kc = kcache + ((size_t)b * HKV + g) * W * D;
            float *vc = vcache + ((size_t)b * HKV + g) * W * D;
            for (int j = 0; j < half; j++) {
                const float a0 = kin[2 * j], a1 = kin[2 * j + 1];
                kc[(size_t)col * D + 2 * j] = a0 * c[j] - a1 * s[j];
                kc[(size_t)col * D + 2 * j + 1] = a0 * s[j] + a1 * c[j];
            }
            for (int i = 0; i < D; i++) vc[(size_t)col * D + i] = vin[i];
            for (int h = 0; h < G; h++) {
                const float *qin = qkv + b * row + (long)(g * G + h) * D;
                float *q = qrot + (size_t)h * D;
                for (int j = 0; j < half; j++) {
                    const float a0 = qin[2 * j], a1 = qin[2 * j + 1];
                    q[2 * j] = a0 * c[j] - a1 * s[j];
                    q[2 * j + 1] = a0 * s[j] + a1 * c[j];
                }
            }
            /* scores (G, L): blocks of four keys (kept in L1 for the G heads), four
               independent accumulator chains */
            const float *mrow = mask ? mask + b * mask_ld : NULL;
            int t = 0;
            if (D % VW == 0) {
                for (; t + 4 <= L; t += 4) {
                    const float *k0 = kc + (size_t)t * D;
                    for (int h = 0; h < G; h++) {
                        const float *q = qrot + (size_t)h * D;
                        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                        for (int d = 0; d < D; d += VW) {
                            const vf qv = loadv(q + d);
                            a0 += qv * loadv(k0 + d);
                            a1 += qv * loadv(k0 + D + d);
                            a2 += qv * loadv(k0 + 2 * D + d);
                            a3 += qv * loadv(k0 + 3 * D + d);
                        }
                        float *sh = scores + (size_t)h * L + t;
                        sh[0] = hsum(a0), sh[1] = hsum(a1), sh[2] = hsum(a2), sh[3] = hsum(a3);
                    }
                }
            }
            for (; t < L; t++)
                for (int h = 0; h < G; h++)
                    scores[(size_t)h * L + t] = dot(qrot + (size_t)h * D, kc + (size_t)t * D, D);
            for (int h = 0; h < G; h++) {  /* softmax of each head's row */
                float *sh = scores + (size_t)h * L, top = -INFINITY, total = 0;
                for (t = 0; t < L; t++) {
                    sh[t] = scale * sh[t] + (mrow ? mrow[t] : 0.0f);
                    top = sh[t] > top ? sh[t] : top;
                }
                for (t = 0; t < L; t++) total += (sh[t] = expf(sh[t] - top));
                const float inv = 1.0f / total;
                for (t = 0; t < L; t++) sh[t] *= inv;
            }
            /* out_h = sum_t p[h, t] v_t: 16 dims at a time in registers, four keys' chains */
            float *o = out + (size_t)b * HQ * D + (size_t)g * G * D;  /* the G heads' outputs */
            for (int h = 0; h < G; h++) {
                const float *ph = scores + (size_t)h * L;
                float *oh = o + (size_t)h * D;
                int d = 0;
                for (; d + VW <= D; d += VW) {
                    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    const float *v0 = vc + d;
                    for (t = 0; t + 4 <= L; t += 4) {
                        a0 += ph[t] * loadv(v0 + (size_t)t * D);
                        a1 += ph[t + 1] * loadv(v0 + (size_t)(t + 1) * D);
                        a2 += ph[t + 2] * loadv(v0 + (size_t)(t + 2) * D);
                        a3 += ph[t + 3] * loadv(v0 + (size_t)(t + 3) * D);
                    }
                    for (; t < L; t++) a0 += ph[t] * loadv(v0 + (size_t)t * D);
                    const vf sum = (a0 + a1) + (a2 + a3);
                    __builtin_memcpy(oh + d, &sum, sizeof sum);
                }
                for (; d < D; d++) {
                    float acc = 0;
                    for (t = 0; t < L; t++) acc += ph[t] * vc[(size_t)t * D + d];
                    oh[d] = acc;
                }
            }
        }
        free(qrot);
        free(scores);
    }
    return failed ? -1 : 0;
}
