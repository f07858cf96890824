/* One decode step of a Llama/Qwen2/Qwen3 model in one call: the native form of
 * FastDecoder.decode (src/tether/decoding/fast_decoder.py), for float32 on the CPU.
 *
 * Why it exists: at the demo's size a decode step is ~20 weight GEMMs and ~300 small tensor
 * operations; each small operation costs a framework dispatch, and the first one after each GEMM
 * runs 4-5x slower than warm because the GEMM's weights evicted its working set from L2
 * (docs/benchmarks.md). Here everything between the GEMMs is a few plain loops over buffers
 * that stay in cache, and the GEMMs are the same MKL sgemm calls torch makes for `x @ w_t`
 * (torch's own sgemm_, passed in by address), so the arithmetic order of the matrix products is
 * the one the Python path has.
 *
 * Every step follows the Python path op for op: RMSNorm (mean of squares, times rsqrt(var+eps),
 * times the weight), q/k RMSNorm for Qwen3, rotary as x*cos + swap_halves(x)*sin_signed, the KV
 * write at position t, attention as bias + scale*(q.k), softmax, p.v, the residual adds folded
 * into the o and down GEMMs (beta = 1, as torch.addmm), act(gate)*up. The loops reduce in a
 * different order than torch's kernels, so results agree to float32 rounding (~1e-6), not bit
 * for bit (tests/unit/test_native_decode.py).
 *
 * Built by tether/decoding/native/__init__.py with the C compiler on the machine that runs it;
 * called through ctypes with raw pointers into tensors the Python side owns.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n,
                         const int *k, const float *alpha, const float *a, const int *lda,
                         const float *b, const int *ldb, const float *beta, float *c,
                         const int *ldc);

static sgemm_fn sgemm_ptr = 0;

#ifdef TETHER_PROFILE
#include <x86intrin.h>
double tether_prof[8];
#define MARK(i) do { uint64_t now_ = __rdtsc(); tether_prof[i] += (double)(now_ - last_); last_ = now_; } while (0)
#else
#define MARK(i) do { } while (0)
#endif

void tether_set_sgemm(void *fn) { sgemm_ptr = (sgemm_fn)fn; }

/* C (m x n, row-major) = beta*C + A (m x k) @ B (k x n), all row-major and contiguous: the
 * column-major call for C^T = B^T A^T, which is how torch calls sgemm for a row-major mm. */
static void gemm(int m, int n, int k, const float *a, const float *b, float *c, float beta) {
    const float one = 1.0f;
    sgemm_ptr("N", "N", &n, &m, &k, &one, b, &n, a, &k, &beta, c, &n);
}

/* exp(x) in float32 to about 2 ulp, written so the compiler vectorises loops that call it:
 * exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite), exp(r)
 * by Cephes' degree-6 polynomial for expf. Below -87.3 (exp underflows float32; -inf included,
 * the masked keys) it returns 0; above 88.7 it saturates at 2^127 * e^r, finite. */
static inline float exp_f32(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float xc = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    float n = floorf(xc * log2e + 0.5f);
    float r = xc - n * ln2_hi;
    r = r - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.3f ? 0.0f : p * scale;
}

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps); w may be NULL (no weight). */
static void rms_norm(const float *x, const float *w, float *out, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * n;
        float *o = out + (int64_t)r * n;
        float ss = 0.0f;
        for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        if (w)
            for (int i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
        else
            for (int i = 0; i < n; i++) o[i] = xr[i] * inv;
    }
}

/* x*cos + swap_halves(x)*sin, in place on one head vector of width d (sin's first half holds
 * -sin, as the Python path's table does). */
static void rope(float *x, const float *cos_, const float *sin_, int d, float *tmp) {
    int half = d / 2;
    for (int i = 0; i < half; i++) tmp[i] = x[i] * cos_[i] + x[i + half] * sin_[i];
    for (int i = half; i < d; i++) tmp[i] = x[i] * cos_[i] + x[i - half] * sin_[i];
    memcpy(x, tmp, sizeof(float) * d);
}

/* Integer configuration, in this order (the Python side fills an int64 array). */
enum {
    C_BATCH, C_HIDDEN, C_HEADS, C_KV_HEADS, C_HEAD_DIM, C_INTER, C_VOCAB, C_LAYERS,
    C_CAPACITY, C_QK_NORM, C_QKV_BIAS, C_O_BIAS, C_GELU, C_EMBED_ROWS, C_COUNT
};

/* Pointers: the root ones, then PER_LAYER for each layer. */
enum { P_EMBED, P_NORM, P_HEAD_T, P_ROTARY, P_KEY_BIAS, P_SCRATCH, P_ROOT };
enum {
    L_LN1, L_LN2, L_QKV_T, L_QKV_BIAS, L_QK_NORM, L_O_T, L_O_BIAS, L_GATE_UP_T, L_DOWN_T,
    L_K_CACHE, L_V_CACHE, PER_LAYER
};

/* Floats of scratch one step needs (the Python side allocates it). */
int64_t tether_scratch_floats(const int64_t *cfg) {
    int64_t b = cfg[C_BATCH], h = cfg[C_HIDDEN], d = cfg[C_HEAD_DIM], s = cfg[C_CAPACITY];
    int64_t qkv = (cfg[C_HEADS] + 2 * cfg[C_KV_HEADS]) * d;
    int64_t group = cfg[C_HEADS] / cfg[C_KV_HEADS];
    return b * h * 2 + b * qkv + b * cfg[C_HEADS] * d + b * 2 * cfg[C_INTER] + group * s + d;
}

/* softmax(bias + scale * q.K^T) V for one query head over ctx positions; scores in sc (ctx). */
static void attend(const float *q, const float *keys, const float *vals, const float *bias, int ctx,
                   float scale, int d, float *sc, float *out) {
    float top = -INFINITY;
    for (int s = 0; s < ctx; s++) {
        const float *k = keys + (int64_t)s * d;
        float dot = 0.0f;
        for (int i = 0; i < d; i++) dot += q[i] * k[i];
        sc[s] = bias[s] + scale * dot;
        top = sc[s] > top ? sc[s] : top;
    }
    float total = 0.0f;
    for (int s = 0; s < ctx; s++) {
        sc[s] = exp_f32(sc[s] - top);
        total += sc[s];
    }
    const float inv = 1.0f / total;
    memset(out, 0, sizeof(float) * d);
    for (int s = 0; s < ctx; s++) {
        const float p = sc[s] * inv, *v = vals + (int64_t)s * d;
        for (int i = 0; i < d; i++) out[i] += p * v[i];
    }
}

static void activate(float *gate_up, int rows, int inter, int gelu) {
    for (int r = 0; r < rows; r++) {
        float *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        if (gelu) {
            for (int i = 0; i < inter; i++) g[i] = 0.5f * g[i] * (1.0f + erff(g[i] * 0.70710678118654752f)) * u[i];
        } else {
            for (int i = 0; i < inter; i++) g[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
        }
    }
}

/* One step: append tokens[b] at position t of every row, write the next logits (batch x vocab),
 * advance next_pos. t is the number of positions already in the cache. Returns 0, or -1 - r when
 * row r's token is not in the embedding table (nothing is written then). */
int tether_decode_step(const int64_t *cfg, float eps, float scale, void **ptrs, int64_t t,
                        const int64_t *tokens, int64_t *next_pos, float *logits) {
    const int b = (int)cfg[C_BATCH], hid = (int)cfg[C_HIDDEN], heads = (int)cfg[C_HEADS];
    const int kvh = (int)cfg[C_KV_HEADS], d = (int)cfg[C_HEAD_DIM], inter = (int)cfg[C_INTER];
    const int vocab = (int)cfg[C_VOCAB], layers = (int)cfg[C_LAYERS];
    const int64_t cap = cfg[C_CAPACITY];
    const int group = heads / kvh, width = (heads + 2 * kvh) * d, ctx = (int)t + 1;
    const float *embed = ptrs[P_EMBED], *rotary = ptrs[P_ROTARY], *key_bias = ptrs[P_KEY_BIAS];

    float *x = ptrs[P_SCRATCH];               /* (b, hid): the residual stream */
    float *nrm = x + (int64_t)b * hid;        /* (b, hid): normalised input of a projection */
    float *qkv = nrm + (int64_t)b * hid;      /* (b, width) */
    float *att = qkv + (int64_t)b * width;    /* (b, heads*d) */
    float *gate_up = att + (int64_t)b * heads * d; /* (b, 2*inter) */
    float *scores = gate_up + (int64_t)b * 2 * inter; /* (group, cap) */
    float *tmp = scores + (int64_t)group * cap;        /* (d) */

#ifdef TETHER_PROFILE
    uint64_t last_ = __rdtsc();
#endif
    for (int r = 0; r < b; r++)
        if (tokens[r] < 0 || tokens[r] >= cfg[C_EMBED_ROWS]) return -1 - r;
    for (int r = 0; r < b; r++)
        memcpy(x + (int64_t)r * hid, embed + tokens[r] * hid, sizeof(float) * hid);

    for (int l = 0; l < layers; l++) {
        void **lp = ptrs + P_ROOT + (int64_t)l * PER_LAYER;
        const float *qkv_bias = lp[L_QKV_BIAS], *qk_norm = lp[L_QK_NORM], *o_bias = lp[L_O_BIAS];
        float *kc = lp[L_K_CACHE], *vc = lp[L_V_CACHE];

        rms_norm(x, lp[L_LN1], nrm, b, hid, eps);
        MARK(0);
        if (qkv_bias) {  /* bias + h W^T, the bias as the product's starting value (torch.addmm) */
            for (int r = 0; r < b; r++) memcpy(qkv + (int64_t)r * width, qkv_bias, sizeof(float) * width);
            gemm(b, width, hid, nrm, lp[L_QKV_T], qkv, 1.0f);
        } else {
            gemm(b, width, hid, nrm, lp[L_QKV_T], qkv, 0.0f);
        }
        MARK(1);
        for (int r = 0; r < b; r++) {
            float *row = qkv + (int64_t)r * width;
            /* (2, 1, d) per position: cos, then sign-folded sin */
            const float *cs = rotary + next_pos[r] * 2 * d, *sn = cs + d;
            for (int hh = 0; hh < heads + kvh; hh++) {
                float *v = row + (int64_t)hh * d;
                if (qk_norm) rms_norm(v, qk_norm + (int64_t)hh * d, v, 1, d, eps);
                rope(v, cs, sn, d, tmp);
            }
            for (int g = 0; g < kvh; g++) {
                int64_t at = (((int64_t)r * kvh + g) * cap + t) * d;
                memcpy(kc + at, row + (int64_t)(heads + g) * d, sizeof(float) * d);
                memcpy(vc + at, row + (int64_t)(heads + kvh + g) * d, sizeof(float) * d);
            }
            /* attention of this row's query heads over its positions 0..t, a kv head at a time */
            for (int g = 0; g < kvh; g++) {
                const int64_t block = ((int64_t)r * kvh + g) * cap;
                for (int j = 0; j < group; j++) {
                    const int hh = g * group + j;
                    attend(row + (int64_t)hh * d, kc + block * d, vc + block * d, key_bias + block, ctx,
                           scale, d, scores, att + (int64_t)r * heads * d + (int64_t)hh * d);
                }
            }
        }
        MARK(2);
        if (o_bias) {  /* x + (att W_o^T + b_o), as the Python path adds them */
            gemm(b, hid, heads * d, att, lp[L_O_T], nrm, 0.0f);
            for (int r = 0; r < b; r++)
                for (int i = 0; i < hid; i++) x[(int64_t)r * hid + i] += nrm[(int64_t)r * hid + i] + o_bias[i];
        } else {
            gemm(b, hid, heads * d, att, lp[L_O_T], x, 1.0f);
        }
        MARK(3);
        rms_norm(x, lp[L_LN2], nrm, b, hid, eps);
        MARK(0);
        gemm(b, 2 * inter, hid, nrm, lp[L_GATE_UP_T], gate_up, 0.0f);
        MARK(4);
        activate(gate_up, b, inter, (int)cfg[C_GELU]);
        MARK(5);
        /* x += act(gate)*up @ W_down^T: the activation sits in gate's half, rows 2*inter apart */
        {
            const float one = 1.0f;
            const int lda = 2 * inter;
            sgemm_ptr("N", "N", &hid, &b, &inter, &one, lp[L_DOWN_T], &hid, gate_up, &lda, &one, x, &hid);
        }
        MARK(6);
    }
    rms_norm(x, ptrs[P_NORM], nrm, b, hid, eps);
    MARK(0);
    gemm(b, vocab, hid, nrm, ptrs[P_HEAD_T], logits, 0.0f);
    MARK(7);
    for (int r = 0; r < b; r++) next_pos[r] += 1;
    return 0;
}
