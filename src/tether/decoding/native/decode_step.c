/* Prefill and decode of a Llama/Qwen2/Qwen3 model, one call each: the native form of
 * FastDecoder's Python path (src/tether/decoding/fast_decoder.py), for float32 on the CPU.
 *
 * Why it exists: at the demo's size a decode step is ~20 weight GEMMs and ~300 small tensor
 * operations; each small operation costs a framework dispatch, and the first one after each GEMM
 * runs 4-5x slower than warm because the GEMM's weights evicted its working set from L2
 * (docs/benchmarks.md). Here everything between the GEMMs is a few plain loops over buffers that
 * stay in cache. The GEMMs are MKL's, from torch's own library (addresses passed in): each
 * weight matrix is packed once per weight version into MKL's internal layout
 * (cblas_sgemm_pack), straight from the model's (out, in) parameters, so no call re-packs it
 * and no transposed copy of the weights is kept.
 *
 * The arithmetic follows the Python path op for op: RMSNorm (mean of squares, times
 * 1/sqrt(var + eps), times the weight), the q/k RMSNorm of Qwen3, rotary as
 * x*cos + swap_halves(x)*sin_signed, each new position attending to the cache and to itself,
 * attention as bias + scale*(q.k), softmax, p.v, the residual adds folded into the o and down
 * products (beta = 1, as torch.addmm), act(gate)*up. Sums reduce in another order than torch's
 * kernels, so results agree to float32 rounding (~1e-6), not bit for bit
 * (tests/integration/test_native_decode.py). Sampling (sample_rows) is the torch sampler's
 * untruncated draw from the same uniforms.
 *
 * Built by tether/decoding/native/__init__.py with the C compiler of the machine that runs it;
 * called through ctypes with raw pointers into tensors the Python side owns.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* With -DTETHER_PROFILE (TETHER_NATIVE_PROFILE=1 builds it): seconds spent in each section of
 * forward() and head(), summed over calls, for benchmarks/engine.py --profile. */
enum {
    S_NORMS, S_QKV_GEMM, S_ROTARY_KV, S_ATTENTION, S_O_GEMM, S_GATE_UP_GEMM, S_ACTIVATION, S_DOWN_GEMM,
    S_HEAD_GEMM, S_SAMPLE, S_COUNT
};
#ifdef TETHER_PROFILE
#include <time.h>
double tether_profile[S_COUNT];
static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define PROFILE_START double mark_ = now_seconds()
#define MARK(section) do { double t_ = now_seconds(); tether_profile[section] += t_ - mark_; mark_ = t_; } while (0)
#else
#define PROFILE_START do { } while (0)
#define MARK(section) do { } while (0)
#endif
int tether_profile_sections(void) { return S_COUNT; }

/* MKL's CBLAS packed-GEMM entry points and their enum values (mkl_cblas.h) */
typedef size_t (*pack_size_fn)(int identifier, int m, int n, int k);
typedef void (*pack_fn)(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                        const float *src, int ld, float *dest);
typedef void (*compute_fn)(int layout, int transa, int transb, int m, int n, int k, const float *a,
                           int lda, const float *b, int ldb, float beta, float *c, int ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, PACKED = 151, B_MATRIX = 162 };
/* the row count packing is asked for; a packed matrix serves products of any row count */
enum { PACK_ROWS = 64 };

/* and the plain Fortran-convention GEMM, for a prompt's attention (its operands change every call) */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

static pack_size_fn pack_size_ptr = 0;
static pack_fn pack_ptr = 0;
static compute_fn compute_ptr = 0;
static sgemm_fn sgemm_ptr = 0;

void tether_set_blas(void *pack_size, void *pack, void *compute, void *sgemm) {
    pack_size_ptr = (pack_size_fn)pack_size;
    pack_ptr = (pack_fn)pack;
    compute_ptr = (compute_fn)compute;
    sgemm_ptr = (sgemm_fn)sgemm;
}

/* Floats a packed copy of an (n x k) weight takes. */
int64_t tether_packed_floats(int n, int k) {
    return (int64_t)((pack_size_ptr(B_MATRIX, PACK_ROWS, n, k) + sizeof(float) - 1) / sizeof(float));
}

/* Pack w, an (n x k) row-major matrix (a Linear weight: out x in), as the right operand of
 * x @ w^T. */
void tether_pack(const float *w, int n, int k, float *dest) {
    pack_ptr(ROW_MAJOR, B_MATRIX, TRANS, PACK_ROWS, n, k, 1.0f, w, k, dest);
}

/* Pack the row-stacked a (na x k), b (nb x k) and c (nc x k; nb, nc may be 0) as one matrix:
 * q/k/v, or gate/up. They are copied into staging ((na + nb + nc) x k) first, as MKL packs one
 * matrix a call. */
void tether_pack_stacked(const float *a, int na, const float *b, int nb, const float *c, int nc, int k,
                         float *staging, float *dest) {
    memcpy(staging, a, sizeof(float) * na * k);
    if (nb) memcpy(staging + (int64_t)na * k, b, sizeof(float) * nb * k);
    if (nc) memcpy(staging + (int64_t)(na + nb) * k, c, sizeof(float) * nc * k);
    tether_pack(staging, na + nb + nc, k, dest);
}

/* C (m x n, row stride ldc) = beta*C + A (m x k, row stride lda) @ W^T, W packed. */
static void gemm(int m, int n, int k, const float *a, int lda, const float *packed, float *c, int ldc,
                 float beta) {
    compute_ptr(ROW_MAJOR, NO_TRANS, PACKED, m, n, k, a, lda, packed, n, beta, c, ldc);
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

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps); w may be NULL (no weight); out may be x. */
static void rms_norm(const float *x, const float *w, float *out, int64_t rows, int n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        float ss = 0.0f;
        for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        if (w)
            for (int i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
        else
            for (int i = 0; i < n; i++) o[i] = xr[i] * inv;
    }
}

/* One head vector of width d, in place: RMSNorm with weight w (Qwen3's q/k norm; none when w is
 * NULL), then rotary: x*cos + swap_halves(x)*sin, sin's first half holding -sin as the Python
 * path's table does (each pair i, i + d/2 read once and written once). Written for a d the
 * compiler knows, like attend_d below. */
static inline __attribute__((always_inline)) void norm_rope_d(float *x, const float *w, const float *cos_,
                                                              const float *sin_, const int d, float eps) {
    const int half = d / 2;
    float *restrict lo = x, *restrict hi = x + half; /* the two halves: disjoint */
    if (w) {
        float ss = 0.0f;
        for (int i = 0; i < d; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int i = 0; i < d; i++) x[i] = w[i] * (x[i] * inv);
    }
    for (int i = 0; i < half; i++) {
        const float a = lo[i], b = hi[i];
        lo[i] = a * cos_[i] + b * sin_[i];
        hi[i] = b * cos_[i + half] + a * sin_[i + half];
    }
}

static void norm_rope_64(float *x, const float *w, const float *c, const float *s, float eps) {
    norm_rope_d(x, w, c, s, 64, eps);
}
static void norm_rope_128(float *x, const float *w, const float *c, const float *s, float eps) {
    norm_rope_d(x, w, c, s, 128, eps);
}
static void norm_rope_any(float *x, const float *w, const float *c, const float *s, int d, float eps) {
    norm_rope_d(x, w, c, s, d, eps);
}
static void norm_rope(float *x, const float *w, const float *c, const float *s, int d, float eps) {
    if (d == 64) norm_rope_64(x, w, c, s, eps);
    else if (d == 128) norm_rope_128(x, w, c, s, eps);
    else norm_rope_any(x, w, c, s, d, eps);
}

/* The cache's layout: per layer one buffer, (row, kv head, slot, [key | value]), each slot's key
 * and value side by side (d floats each). A (row, kv head) block's context is then one
 * contiguous run of memory, so a decode step's attention streams one sequence of lines per
 * block, and the next block's run follows it (FastDecoder's k_cache and v_cache are views). */
static inline float *slot_at(float *block, int64_t slot, int d) { return block + slot * 2 * d; }

#define PREFETCH_AHEAD 1

/* softmax(bias + scale * q.K^T) V for the `group` query heads (q: group x d, contiguous) that
 * share one KV head, over ctx cached slots of one block: each key and value is read once for
 * all of them (from L3 or memory; the queries and outputs stay in L1). sc holds group x ctx
 * scores. A query with no key to attend to (a padding position of a prompt) gets 0. While it
 * runs, the next block's next_ctx slots are prefetched, one slot per slot, towards L2 (locality
 * 1: as fast as into L1 here; without it attention took 20% longer). new_k and new_v, when
 * not NULL, are slot ctx - 1's key and value (a decode step's): attended from where they are,
 * then written into the block, after its reads (written first, the stores ran ahead of the
 * reads they then had to wait for: 5% slower attention).
 * Written for a d the compiler knows (attend() calls it with 64 and 128 as constants, and with
 * any other d as a variable): with d fixed, each dot product and output row is a few vector
 * registers, where a run-time d cost loop set-up per key that outweighed its arithmetic. */
static inline __attribute__((always_inline)) void attend_d(
        const float *q, int group, float *block, const float *bias, int64_t ctx, float scale, const int d,
        float *sc, float *out, const float *next, int64_t next_ctx, const float *new_k, const float *new_v) {
    const int64_t cached = new_k ? ctx - 1 : ctx;  /* slots read from the block */
    for (int64_t s = 0; s < cached; s++) {
        const float *k = slot_at(block, s, d);
        if (next && s < next_ctx)
            for (int i = 0; i < 2 * d; i += 16) __builtin_prefetch(next + s * 2 * d + i, 0, 1);
        for (int j = 0; j < group; j++) {
            const float *qj = q + (int64_t)j * d;
            float dot = 0.0f;
            for (int i = 0; i < d; i++) dot += qj[i] * k[i];
            sc[j * ctx + s] = bias[s] + scale * dot;
        }
    }
    if (new_k)
        for (int j = 0; j < group; j++) {
            const float *qj = q + (int64_t)j * d;
            float dot = 0.0f;
            for (int i = 0; i < d; i++) dot += qj[i] * new_k[i];
            sc[j * ctx + ctx - 1] = bias[ctx - 1] + scale * dot;
        }
    for (int j = 0; j < group; j++) {
        float *sj = sc + j * ctx, *oj = out + (int64_t)j * d, top = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < ctx; s++) top = sj[s] > top ? sj[s] : top;
        if (top == -INFINITY) {  /* nothing to attend to: the output is 0 */
            memset(oj, 0, sizeof(float) * d);
            continue;
        }
        for (int64_t s = 0; s < ctx; s++) {
            sj[s] = exp_f32(sj[s] - top);
            total += sj[s];
        }
        const float inv = 1.0f / total;
        float acc[d];
        for (int i = 0; i < d; i++) acc[i] = 0.0f;
        for (int64_t s = 0; s < cached; s++) {
            const float p = sj[s] * inv, *v = slot_at(block, s, d) + d;
            for (int i = 0; i < d; i++) acc[i] += p * v[i];
        }
        if (new_v) {
            const float p = sj[ctx - 1] * inv;
            for (int i = 0; i < d; i++) acc[i] += p * new_v[i];
        }
        for (int i = 0; i < d; i++) oj[i] = acc[i];
    }
    if (new_k) {  /* into the cache, once its slots are read */
        memcpy(slot_at(block, ctx - 1, d), new_k, sizeof(float) * d);
        memcpy(slot_at(block, ctx - 1, d) + d, new_v, sizeof(float) * d);
    }
}

#define ATTEND_ARGS const float *q, int group, float *block, const float *bias, int64_t ctx, float scale, \
                    float *sc, float *out, const float *next, int64_t next_ctx, const float *new_k, \
                    const float *new_v
static void attend_64(ATTEND_ARGS) {
    attend_d(q, group, block, bias, ctx, scale, 64, sc, out, next, next_ctx, new_k, new_v);
}
static void attend_128(ATTEND_ARGS) {
    attend_d(q, group, block, bias, ctx, scale, 128, sc, out, next, next_ctx, new_k, new_v);
}
static void attend_any(ATTEND_ARGS, int d) {
    attend_d(q, group, block, bias, ctx, scale, d, sc, out, next, next_ctx, new_k, new_v);
}
static void attend(ATTEND_ARGS, int d) {
    if (d == 64) attend_64(q, group, block, bias, ctx, scale, sc, out, next, next_ctx, new_k, new_v);
    else if (d == 128) attend_128(q, group, block, bias, ctx, scale, sc, out, next, next_ctx, new_k, new_v);
    else attend_any(q, group, block, bias, ctx, scale, sc, out, next, next_ctx, new_k, new_v, d);
}

/* Prompts at least this long attend through two GEMMs a head (below: the loops of attend()). */
#define GEMM_ATTENTION_MIN 32

/* Causal attention of one prompt's p positions for one query head, as two GEMMs:
 * S = scale * Q K^T (p x p, in s), then bias (the key mask) and the causal mask, a softmax per
 * row, and O = S V. q, keys and vals are the prompt's rows of the projections (row stride ld),
 * out has row stride ldo, bias is the prompt's key mask. A position with no key to attend to
 * (padding) gets 0. */
static void attend_prompt(const float *q, const float *keys, const float *vals, int ld, const float *bias,
                          int p, int d, float scale, float *s, float *out, int ldo) {
    const float zero = 0.0f, one = 1.0f;
    /* column-major: S^T (keys x queries) = K Q^T, i.e. row-major S (queries x keys) */
    sgemm_ptr("T", "N", &p, &p, &d, &scale, keys, &ld, q, &ld, &zero, s, &p);
    for (int i = 0; i < p; i++) {
        float *row = s + (int64_t)i * p, top = -INFINITY, total = 0.0f;
        for (int j = 0; j <= i; j++) {
            row[j] = bias[j] + row[j];
            top = row[j] > top ? row[j] : top;
        }
        for (int j = i + 1; j < p; j++) row[j] = 0.0f;
        if (top == -INFINITY) {
            for (int j = 0; j <= i; j++) row[j] = 0.0f;
            continue;
        }
        for (int j = 0; j <= i; j++) {
            row[j] = exp_f32(row[j] - top);
            total += row[j];
        }
        const float inv = 1.0f / total;
        for (int j = 0; j <= i; j++) row[j] *= inv;
    }
    /* column-major: O^T (d x queries) = V^T S^T */
    sgemm_ptr("N", "N", &d, &p, &p, &one, vals, &ld, s, &p, &zero, out, &ldo);
}

static void activate(float *gate_up, int64_t rows, int inter, int gelu) {
    for (int64_t r = 0; r < rows; r++) {
        float *g = gate_up + r * 2 * inter, *u = g + inter;
        if (gelu) {
            for (int i = 0; i < inter; i++) g[i] = 0.5f * g[i] * (1.0f + erff(g[i] * 0.70710678118654752f)) * u[i];
        } else {
            for (int i = 0; i < inter; i++) g[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
        }
    }
}

/* Integer configuration, in this order (the Python side fills an int64 array). */
enum {
    C_BATCH, C_HIDDEN, C_HEADS, C_KV_HEADS, C_HEAD_DIM, C_INTER, C_VOCAB, C_LAYERS,
    C_CAPACITY, C_QK_NORM, C_QKV_BIAS, C_O_BIAS, C_GELU, C_EMBED_ROWS, C_ROWS, C_COUNT
};

/* Pointers: the root ones, then PER_LAYER for each layer. Weight matrices are packed. */
enum { P_EMBED, P_NORM, P_HEAD, P_ROTARY, P_KEY_BIAS, P_SCRATCH, P_INDEX, P_ROOT };
enum {
    L_LN1, L_LN2, L_QKV, L_QKV_BIAS, L_QK_NORM, L_O, L_O_BIAS, L_GATE_UP, L_DOWN,
    L_KV_CACHE, PER_LAYER
};

/* What the Python side must agree with, checked when the library is loaded: the interface's
 * version, then the lengths of the configuration, the root pointers, the per-layer pointers and
 * the profile's sections. */
enum { INTERFACE_VERSION = 3 };
int64_t tether_interface(int which) {
    switch (which) {
    case 0: return INTERFACE_VERSION;
    case 1: return C_COUNT;
    case 2: return P_ROOT;
    case 3: return PER_LAYER;
    case 4: return S_COUNT;
    default: return -1;
    }
}

/* The weight channel's publication of one tensor (src/tether/rollout/channel.py): copy n bytes
 * from src into dst and return the wrapping sum of dst's int64 words over the copy, its last
 * partial word read whole from dst (the block's padding after it is zero). One pass over the bytes
 * where a copy followed by a checksum reads them twice. dst is 8-byte aligned; src need not be. */
int64_t tether_copy_checksum(void *dst, const void *src, int64_t n) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    unsigned char *d = dst;
    const unsigned char *s = src;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, s + i, 32);
        memcpy(d + i, w, 32);
        s0 += w[0]; s1 += w[1]; s2 += w[2]; s3 += w[3];
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        memcpy(d + i, &w, 8);
        s0 += w;
    }
    if (i < n) {
        uint64_t w;
        memcpy(d + i, s + i, (size_t)(n - i));
        memcpy(&w, d + i, 8);
        s0 += w;
    }
    return (int64_t)(s0 + s1 + s2 + s3);
}

/* A prefill asked for more rows than its buffers were made for (cfg[C_ROWS]): apart from the
 * -1 - i of a token outside the embedding table. */
enum { ST_TOO_MANY_ROWS = -2147483647 - 1 };

/* The buffers a forward over up to cfg[C_ROWS] rows at once needs: floats, then int64s. */
int64_t tether_scratch_floats(const int64_t *cfg) {
    int64_t n = cfg[C_ROWS], h = cfg[C_HIDDEN], d = cfg[C_HEAD_DIM];
    int64_t qkv = (cfg[C_HEADS] + 2 * cfg[C_KV_HEADS]) * d;
    const int64_t group = cfg[C_HEADS] / cfg[C_KV_HEADS], cap = cfg[C_CAPACITY];
    /* scores: a step's (group x cap), or a long prompt's (p x p, p < cap) */
    return n * (2 * h + qkv + cfg[C_HEADS] * d + 2 * cfg[C_INTER]) + (group > cap ? group : cap) * cap;
}

int64_t tether_index_ints(const int64_t *cfg) { return 4 * cfg[C_ROWS]; }

/* Every layer over `rows` new positions whose input embeddings are in the scratch's x. Row n
 * writes its K/V at slot slot[n] of cache row cache_row[n] (and of the `copies - 1` cache rows
 * after it: a prompt's group of samples), is rotated to position pos[n], and attends over slots
 * 0 .. ctx[n] - 1 of that cache row. */
static void forward(const int64_t *cfg, float eps, float scale, void **ptrs, int64_t rows,
                    const int64_t *cache_row, const int64_t *slot, const int64_t *pos, const int64_t *ctx,
                    int64_t copies, int64_t prompt_len) {
    const int hid = (int)cfg[C_HIDDEN], heads = (int)cfg[C_HEADS], kvh = (int)cfg[C_KV_HEADS];
    const int d = (int)cfg[C_HEAD_DIM], inter = (int)cfg[C_INTER], layers = (int)cfg[C_LAYERS];
    const int64_t cap = cfg[C_CAPACITY], kv_block = cap * 2 * d; /* floats a (row, kv head) block takes */
    const int group = heads / kvh, width = (heads + 2 * kvh) * d;
    /* a decode step (one new slot a row, the last it attends to) writes each key and value inside
     * attention, into lines it reads next, instead of in a pass of their own */
    const int decoding = copies == 1 && prompt_len == 0;
    const float *rotary = ptrs[P_ROTARY], *key_bias = ptrs[P_KEY_BIAS];
    float *x = ptrs[P_SCRATCH];          /* (rows, hid): the residual stream */
    float *nrm = x + rows * hid;         /* (rows, hid): normalised input of a projection */
    float *qkv = nrm + rows * hid;       /* (rows, width) */
    float *att = qkv + rows * width;     /* (rows, heads*d) */
    float *gate_up = att + rows * heads * d; /* (rows, 2*inter) */
    float *scores = gate_up + rows * 2 * inter; /* (group, cap), or a long prompt's (p, p) */
    PROFILE_START;

    for (int l = 0; l < layers; l++) {
        void **lp = ptrs + P_ROOT + (int64_t)l * PER_LAYER;
        const float *qkv_bias = lp[L_QKV_BIAS], *qk_norm = lp[L_QK_NORM], *o_bias = lp[L_O_BIAS];
        float *kv = lp[L_KV_CACHE];

        rms_norm(x, lp[L_LN1], nrm, rows, hid, eps);
        MARK(S_NORMS);
        if (qkv_bias) {  /* bias + h W^T, the bias as the product's starting value (torch.addmm) */
            for (int64_t r = 0; r < rows; r++) memcpy(qkv + r * width, qkv_bias, sizeof(float) * width);
            gemm((int)rows, width, hid, nrm, hid, lp[L_QKV], qkv, width, 1.0f);
        } else {
            gemm((int)rows, width, hid, nrm, hid, lp[L_QKV], qkv, width, 0.0f);
        }
        MARK(S_QKV_GEMM);
        for (int64_t r = 0; r < rows; r++) {
            float *row = qkv + r * width;
            const float *cs = rotary + pos[r] * 2 * d, *sn = cs + d; /* (2, 1, d): cos, signed sin */
            for (int hh = 0; hh < heads + kvh; hh++)
                norm_rope(row + (int64_t)hh * d, qk_norm ? qk_norm + (int64_t)hh * d : 0, cs, sn, d, eps);
            for (int64_t c = 0; c < (decoding ? 0 : copies); c++)  /* a decode step writes in attention */
                for (int g = 0; g < kvh; g++) {
                    float *at = slot_at(kv + ((cache_row[r] + c) * kvh + g) * kv_block, slot[r], d);
                    memcpy(at, row + (int64_t)(heads + g) * d, sizeof(float) * d);
                    memcpy(at + d, row + (int64_t)(heads + kvh + g) * d, sizeof(float) * d);
                }
        }
        MARK(S_ROTARY_KV);
        /* all of this call's K/V are in place: attend (a prompt's positions see each other) */
        if (prompt_len >= GEMM_ATTENTION_MIN) {  /* a prefill of long prompts: GEMMs per head */
            const int p = (int)prompt_len;
            for (int64_t base = 0; base < rows; base += p)
                for (int g = 0; g < kvh; g++) {
                    const int64_t block = cache_row[base] * kvh + g;
                    for (int j = 0; j < group; j++) {
                        const int hh = g * group + j;
                        const float *rows0 = qkv + base * width;
                        attend_prompt(rows0 + (int64_t)hh * d, rows0 + (int64_t)(heads + g) * d,
                                      rows0 + (int64_t)(heads + kvh + g) * d, width, key_bias + block * cap,
                                      p, d, scale, scores, att + base * heads * d + (int64_t)hh * d, heads * d);
                    }
                }
        } else
        for (int64_t r = 0; r < rows; r++) {
            const float *row = qkv + r * width;
            for (int g = 0; g < kvh; g++) {  /* query heads g*group .. are kv head g's */
                const int64_t block = cache_row[r] * kvh + g;
                /* the block attended PREFETCH_AHEAD (row, kv head) pairs later, to prefetch while
                 * this one is read (1 measured best here; 2 and 3 were slower) */
                const int64_t ahead = r * kvh + g + PREFETCH_AHEAD, r2 = ahead / kvh;
                const int more = r2 < rows;
                const int64_t next = more ? cache_row[r2] * kvh + ahead % kvh : 0;
                attend(row + (int64_t)g * group * d, group, kv + block * kv_block, key_bias + block * cap, ctx[r],
                       scale, scores, att + r * heads * d + (int64_t)g * group * d, more ? kv + next * kv_block : 0,
                       more ? ctx[r2] : 0, decoding ? row + (int64_t)(heads + g) * d : 0,
                       decoding ? row + (int64_t)(heads + kvh + g) * d : 0, d);
            }
        }
        MARK(S_ATTENTION);
        if (o_bias) {  /* x + (att W_o^T + b_o), as the Python path adds them */
            gemm((int)rows, hid, heads * d, att, heads * d, lp[L_O], nrm, hid, 0.0f);
            for (int64_t r = 0; r < rows; r++)
                for (int i = 0; i < hid; i++) x[r * hid + i] += nrm[r * hid + i] + o_bias[i];
        } else {
            gemm((int)rows, hid, heads * d, att, heads * d, lp[L_O], x, hid, 1.0f);
        }
        MARK(S_O_GEMM);
        rms_norm(x, lp[L_LN2], nrm, rows, hid, eps);
        MARK(S_NORMS);
        gemm((int)rows, 2 * inter, hid, nrm, hid, lp[L_GATE_UP], gate_up, 2 * inter, 0.0f);
        MARK(S_GATE_UP_GEMM);
        activate(gate_up, rows, inter, (int)cfg[C_GELU]);
        MARK(S_ACTIVATION);
        /* x += act(gate)*up @ W_down^T: the activation sits in gate's half, rows 2*inter apart */
        gemm((int)rows, hid, inter, gate_up, 2 * inter, lp[L_DOWN], x, hid, 1.0f);
        MARK(S_DOWN_GEMM);
    }
}

/* logits (n x vocab) = head(norm(rows of x)): `which` picks the n rows. */
static void head(const int64_t *cfg, float eps, void **ptrs, int64_t rows, const int64_t *which, int64_t n,
                 float *logits) {
    const int hid = (int)cfg[C_HIDDEN];
    float *x = ptrs[P_SCRATCH], *nrm = x + rows * hid;
    PROFILE_START;
    for (int64_t i = 0; i < n; i++) memcpy(nrm + i * hid, x + which[i] * hid, sizeof(float) * hid);
    rms_norm(nrm, ptrs[P_NORM], nrm, n, hid, eps);
    MARK(S_NORMS);
    gemm((int)n, (int)cfg[C_VOCAB], hid, nrm, hid, ptrs[P_HEAD], logits, (int)cfg[C_VOCAB], 0.0f);
    MARK(S_HEAD_GEMM);
}

/* Returns 0, or -1 - i when ids[i] is not in the embedding table (nothing is written then). */
/* ids[i * stride] for i < n. */
static int embed(const int64_t *cfg, void **ptrs, const int64_t *ids, int64_t n, int64_t stride) {
    const int hid = (int)cfg[C_HIDDEN];
    const float *table = ptrs[P_EMBED];
    float *x = ptrs[P_SCRATCH];
    for (int64_t i = 0; i < n; i++)
        if (ids[i * stride] < 0 || ids[i * stride] >= cfg[C_EMBED_ROWS]) return (int)(-1 - i);
    for (int64_t i = 0; i < n; i++) memcpy(x + i * hid, table + ids[i * stride] * hid, sizeof(float) * hid);
    return 0;
}

/* The prompts ids (u x p, left-padded; positions their rotary positions, padding's 0) run once
 * each; their K/V fill slots 0 .. p-1 of the `repeats` cache rows of each prompt's group.
 * logits (u x vocab): the next-token logits after each prompt. Returns as embed(), or
 * ST_TOO_MANY_ROWS when u * p exceeds the rows the buffers were made for (nothing is written). */
int tether_prefill(const int64_t *cfg, float eps, float scale, void **ptrs, const int64_t *ids,
                   const int64_t *positions, int64_t u, int64_t p, int64_t repeats, float *logits) {
    const int64_t rows = u * p;
    if (rows > cfg[C_ROWS]) return ST_TOO_MANY_ROWS;
    int status = embed(cfg, ptrs, ids, rows, 1);
    if (status != 0) return status;
    int64_t *cache_row = ptrs[P_INDEX], *slot = cache_row + rows, *ctx = slot + rows, *last = ctx + rows;
    for (int64_t i = 0; i < rows; i++) {
        cache_row[i] = (i / p) * repeats;
        slot[i] = i % p;
        ctx[i] = i % p + 1;  /* causal; padding is the key mask's -inf */
    }
    forward(cfg, eps, scale, ptrs, rows, cache_row, slot, positions, ctx, repeats, p);
    for (int64_t i = 0; i < u; i++) last[i] = i * p + p - 1;
    head(cfg, eps, ptrs, rows, last, u, logits);
    return 0;
}

/* One step: append tokens[b] at slot t of every row, write the next logits (batch x vocab),
 * advance next_pos. t is the number of slots already in the cache. Returns as embed(). */
static int decode_step(const int64_t *cfg, float eps, float scale, void **ptrs, int64_t t,
                       const int64_t *tokens, int64_t stride, int64_t *next_pos, float *logits) {
    const int64_t b = cfg[C_BATCH];
    int status = embed(cfg, ptrs, tokens, b, stride);
    if (status != 0) return status;
    int64_t *cache_row = ptrs[P_INDEX], *slot = cache_row + b, *ctx = slot + b;
    for (int64_t r = 0; r < b; r++) {
        cache_row[r] = r;
        slot[r] = t;
        ctx[r] = t + 1;
    }
    forward(cfg, eps, scale, ptrs, b, cache_row, slot, next_pos, ctx, 1, 0);
    head(cfg, eps, ptrs, b, cache_row, b, logits);  /* every row: cache_row[r] = r */
    for (int64_t r = 0; r < b; r++) next_pos[r] += 1;
    return 0;
}

int tether_decode_step(const int64_t *cfg, float eps, float scale, void **ptrs, int64_t t,
                       const int64_t *tokens, int64_t *next_pos, float *logits) {
    return decode_step(cfg, eps, scale, ptrs, t, tokens, 1, next_pos, logits);
}

/* log(x) in float32 to about 1 ulp, written so the compiler vectorises loops that call it:
 * x = 2^e * m with m in [sqrt(1/2), sqrt(2)), log(x) = e ln 2 + log(m), log(m) by Cephes'
 * polynomial for logf. 0 gives -inf and +inf gives +inf (as torch.log); subnormals are scaled
 * into range first; negative x is not handled (no caller passes one). */
static inline float log_f32(float x) {
    const int sub = x < 1.17549435e-38f;  /* subnormal (or 0): scale by 2^25 */
    const float xs = sub ? x * 33554432.0f : x;
    int32_t bits;
    memcpy(&bits, &xs, sizeof bits);
    int32_t e = ((bits >> 23) & 0xff) - 126 - (sub ? 25 : 0);
    const int32_t mant = (bits & 0x007fffff) | 0x3f000000; /* m in [0.5, 1) */
    float m;
    memcpy(&m, &mant, sizeof m);
    const int low = m < 0.707106781186547524f;
    e = low ? e - 1 : e;
    m = low ? m + m - 1.0f : m - 1.0f;
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    const float fe = (float)e;
    y += -2.12194440e-4f * fe;
    y += -0.5f * z;
    float r = m + y + 0.693359375f * fe;
    r = x == 0.0f ? -INFINITY : r;
    return x == INFINITY ? INFINITY : r;
}

/* One token per row of logits (rows x vocab), as tether/decoding/sampling.py's untruncated
 * sampler draws it: the row over temperature (none when it is 1; 0 means greedy, at temperature
 * 1) as log-probabilities, log_softmax's way (x - max - log(sum(exp(x - max)))), written over
 * the logits in place; then the argmax of logp - log(-log(u)) for the row's uniforms u (the
 * Gumbel-max draw of sampling.categorical), or of logp itself when greedy (u is NULL). Writes
 * each row's token and its log-probability at tokens[r * stride], logps[r * stride]. */
static void sample_rows(float *logits, int64_t rows, int64_t vocab, float temperature, const float *u,
                   int64_t *tokens, float *logps, int64_t stride) {
    PROFILE_START;
    for (int64_t r = 0; r < rows; r++) {
        float *x = logits + r * vocab, top = -INFINITY, total = 0.0f;
        if (temperature != 1.0f && temperature != 0.0f)
            for (int64_t i = 0; i < vocab; i++) x[i] = x[i] / temperature;
        for (int64_t i = 0; i < vocab; i++) top = x[i] > top ? x[i] : top;
        for (int64_t i = 0; i < vocab; i++) total += exp_f32(x[i] - top);
        const float lse = logf(total);
        for (int64_t i = 0; i < vocab; i++) x[i] = (x[i] - top) - lse;
        int64_t best = 0;
        if (u) {  /* in chunks: the keys vectorised into g, then a scan for the first largest */
            const float *ur = u + r * vocab;
            float g[256], best_g = -INFINITY;
            for (int64_t at = 0; at < vocab; at += 256) {
                const int64_t n = vocab - at < 256 ? vocab - at : 256;
                for (int64_t i = 0; i < n; i++) g[i] = x[at + i] - log_f32(-log_f32(ur[at + i]));
                for (int64_t i = 0; i < n; i++)
                    if (g[i] > best_g) { best_g = g[i]; best = at + i; }
            }
        } else {
            for (int64_t i = 1; i < vocab; i++)
                if (x[i] > x[best]) best = i;
        }
        tokens[r * stride] = best;
        logps[r * stride] = x[best];
    }
    MARK(S_SAMPLE);
}

/* Up to n decode steps with sampling, as tether/decoding/sampling.sample runs them (n = 1
 * between polls for new weights; the whole loop when nothing can change them): column col of
 * tokens and logps
 * (row stride `stride`) holds the tokens sampled last; step k appends column col + k to the
 * cache (slot t + k) and samples column col + k + 1 from uniforms u + k * rows * vocab (NULL:
 * greedy). After each new column, a row that is not yet done and sampled one of the n_stop
 * stop ids is done (done[r] = 1) with lengths[r] = that column + 1, and when every row is done
 * the run ends. Returns the steps run, or, when a token is outside the embedding table, -1 minus
 * its row (the steps before it stand; *ran says how many). */
int64_t tether_decode_run(const int64_t *cfg, float eps, float scale, void **ptrs, int64_t t, int64_t n,
                          int64_t *tokens, float *logps, int64_t stride, int64_t col, int64_t *next_pos,
                          float *logits, float temperature, const float *u, const int64_t *stop, int64_t n_stop,
                          uint8_t *done, int64_t *lengths, int64_t *ran) {
    const int64_t rows = cfg[C_BATCH], vocab = cfg[C_VOCAB];
    *ran = 0;
    for (int64_t k = 0; k < n; k++) {
        const int64_t c = col + k;
        int status = decode_step(cfg, eps, scale, ptrs, t + k, tokens + c, stride, next_pos, logits);
        if (status != 0) return status;
        sample_rows(logits, rows, vocab, temperature, u ? u + k * rows * vocab : 0, tokens + c + 1, logps + c + 1,
                      stride);
        *ran = k + 1;
        if (n_stop == 0) continue;
        int all = 1;
        for (int64_t r = 0; r < rows; r++) {
            if (!done[r]) {
                const int64_t tok = tokens[r * stride + c + 1];
                for (int64_t i = 0; i < n_stop; i++)
                    if (tok == stop[i]) {
                        done[r] = 1;
                        lengths[r] = c + 2;
                        break;
                    }
            }
            all &= done[r];
        }
        if (all) break;
    }
    return *ran;
}
