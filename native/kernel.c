/*
 * deltackpt native chunk kernel: chunk digests (XXH3-128 + zero flags), byte-plane split/merge (optionally
 * fused with XOR against a base), frame decoding (checksum, zstd, merge, XOR) and the float32 predictions.
 * Contracts are in kernel.h; this file holds the loops and the thread fan-out.
 *
 * Portability: plain C99 + POSIX threads. The byte-plane transposes use SSE2 (baseline on x86-64) when the
 * compiler targets it, and otherwise a scalar loop that compilers vectorise with interleaved loads where the
 * target has them (e.g. NEON ld2/ld4). Both paths produce identical bytes; tests compare them with the
 * numpy reference in deltackpt/_pykernel.py. Defining DCK_NO_SIMD forces the scalar path (for testing it).
 *
 * Runtime dispatch (x86-64 with GCC or clang): AVX2 loops are compiled with a function-level target attribute,
 * as xxhash's own xxh_x86dispatch.c does, and run when the CPU has AVX2: XXH3's long-input and streaming loops
 * (the latter for frame checksums; unless the build already targets AVX2, when the header uses it directly)
 * and the predictions. The predictions also have
 * AVX-512 loops: their float64 square roots and divisions bound them, and CPUs with full-width AVX-512 units do
 * more per cycle (on AMD Zen 5 bench/kernel.py measures 2.6x for the parameter predictor, 1.6x for the second
 * moment). The streaming loops (hashes, planes) stay at AVX2: on data from memory wider registers gain nothing
 * there. Every path returns identical bits; dck_use_simd(level) limits the choice so tests can compare them.
 */
#if !defined(DCK_NO_SIMD) && !defined(DCK_NO_DISPATCH) && defined(__x86_64__) && \
    (defined(__GNUC__) || defined(__clang__))
#define DCK_AVX2 1 /* AVX2 loops, compiled with a function-level target attribute and chosen at run time */
#define DCK_TARGET_AVX2 __attribute__((__target__("avx2")))
#define DCK_TARGET_AVX512 __attribute__((__target__("avx512f,avx512vl,avx512dq")))
#define DCK_TARGET_AVX2_FMA __attribute__((__target__("avx2,fma")))
#include <immintrin.h>
#else
#define DCK_AVX2 0
#endif

#if DCK_AVX2 && !defined(__AVX2__)
#define DCK_XXH_DISPATCH 1
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 DCK_TARGET_AVX2
#else
#define DCK_XXH_DISPATCH 0
#endif

#define XXH_INLINE_ALL
#include <xxhash.h>

#if DCK_XXH_DISPATCH
/* The long-input accumulate kernel's name changed in xxhash 0.8.2 (it now loops over stripes itself). */
#if XXH_VERSION_NUMBER >= 802
#define DCK_XXH_ACC_AVX2 XXH3_accumulate_avx2
#else
#define DCK_XXH_ACC_AVX2 XXH3_accumulate_512_avx2
#endif
#endif

#include "kernel.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#if !defined(DCK_NO_SIMD) && (defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2))
#define DCK_HAVE_SSE2 1
#include <emmintrin.h>
#else
#define DCK_HAVE_SSE2 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define DCK_INLINE static inline __attribute__((always_inline))
#else
#define DCK_INLINE static inline
#endif

/* ------------------------------------------------------------------------------------------------------------
 * Run-time choice of vector loops
 * ---------------------------------------------------------------------------------------------------------- */

static int dck_simd_level = DCK_SIMD_ALL;

/* Contract: writes the unsynchronised global dck_simd_level (level, clamped); returns the previous level. */
int dck_use_simd(int level)
{
    int was = dck_simd_level;
    dck_simd_level = level < DCK_SIMD_NONE ? DCK_SIMD_NONE : level > DCK_SIMD_ALL ? DCK_SIMD_ALL : level;
    return was;
}

/* Contract: 1 when the AVX2 loops may run: they were compiled in, dck_use_simd allows them, the CPU has AVX2. */
static int dck_have_avx2(void)
{
#if DCK_AVX2
    __builtin_cpu_init();
    return dck_simd_level >= DCK_SIMD_AVX2 && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* Contract: 1 when the AVX-512 loops may run: they were compiled in, dck_use_simd allows them, and the CPU has
 * AVX-512 F, VL and DQ with the OS saving their registers (libgcc's and compiler-rt's feature checks include the
 * XGETBV test). */
static int dck_have_avx512(void)
{
#if DCK_AVX2
    __builtin_cpu_init();
    return dck_simd_level >= DCK_SIMD_ALL && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}

/* Contract: 1 when the AVX2 loops may run (dck_have_avx2) and the CPU has FMA as well (update-param's float32
 * loop). */
static int dck_have_fma(void)
{
#if DCK_AVX2
    return dck_have_avx2() && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------------------------------------
 * Thread fan-out
 * ---------------------------------------------------------------------------------------------------------- */

/* Work over the half-open item range [begin, end); must only write output owned by that range. */
typedef void (*dck_range_fn)(const void *ctx, size_t begin, size_t end);

struct dck_job {
    dck_range_fn fn;
    const void *ctx;
    size_t begin, end;
};

/* Contract: the pthread entry point of one range of dck_run_ranges: runs job->fn over [job->begin, job->end). */
static void *dck_job_main(void *arg)
{
    const struct dck_job *job = (const struct dck_job *)arg;
    job->fn(job->ctx, job->begin, job->end);
    return NULL;
}

/*
 * Contract: number of threads to use for `bytes` bytes of work when the caller asked for `threads`.
 * Result is in [1, DCK_MAX_THREADS] and leaves each thread at least DCK_MIN_BYTES_PER_THREAD bytes.
 */
static int dck_pick_threads(int threads, size_t bytes)
{
    size_t by_size;

    if (threads <= 1)
        return 1;
    if (threads > DCK_MAX_THREADS)
        threads = DCK_MAX_THREADS;
    by_size = bytes / DCK_MIN_BYTES_PER_THREAD;
    if (by_size < (size_t)threads)
        threads = by_size < 1 ? 1 : (int)by_size;
    return threads;
}

/*
 * Contract: runs fn over [0, n) split into at most `parts` contiguous ranges whose inner boundaries are
 * multiples of `align` (align >= 1), every item covered exactly once. Range 0 runs on the calling thread, the
 * others on new POSIX threads, all joined before returning; a range whose thread cannot be created runs on the
 * calling thread. Returns only when all of [0, n) is done.
 */
static void dck_run_ranges(dck_range_fn fn, const void *ctx, size_t n, size_t align, int parts)
{
    struct dck_job jobs[DCK_MAX_THREADS];
    pthread_t tids[DCK_MAX_THREADS];
    int started[DCK_MAX_THREADS];
    size_t units, per, extra, at;
    int p;

    units = (n + align - 1) / align;
    if (parts > DCK_MAX_THREADS)
        parts = DCK_MAX_THREADS;
    if ((size_t)parts > units)
        parts = (int)units;
    if (parts <= 1) {
        fn(ctx, 0, n);
        return;
    }
    per = units / (size_t)parts;
    extra = units % (size_t)parts;
    at = 0;
    for (p = 0; p < parts; p++) {
        size_t take = (per + ((size_t)p < extra ? 1 : 0)) * align;
        jobs[p].fn = fn;
        jobs[p].ctx = ctx;
        jobs[p].begin = at;
        jobs[p].end = (p == parts - 1 || at + take > n) ? n : at + take;
        at = jobs[p].end;
    }
    for (p = 1; p < parts; p++)
        started[p] = pthread_create(&tids[p], NULL, dck_job_main, &jobs[p]) == 0;
    fn(ctx, jobs[0].begin, jobs[0].end);
    for (p = 1; p < parts; p++) {
        if (started[p])
            pthread_join(tids[p], NULL);
        else
            fn(ctx, jobs[p].begin, jobs[p].end);
    }
}

/* ------------------------------------------------------------------------------------------------------------
 * Chunk digests
 * ---------------------------------------------------------------------------------------------------------- */

/*
 * Contract: XXH3-128 (default secret, seed 0) of inputs longer than 240 bytes, with the AVX2 kernels; same
 * signature and results as the header's XXH3_hashLong_128b_default. Only called when the CPU has AVX2.
 */
#if DCK_XXH_DISPATCH
XXH_TARGET_AVX2 static XXH128_hash_t dck_hashlong_avx2(const void *XXH_RESTRICT input, size_t len,
                                                       XXH64_hash_t seed, const void *XXH_RESTRICT secret,
                                                       size_t secret_len)
{
    (void)seed;
    (void)secret;
    (void)secret_len;
    return XXH3_hashLong_128b_internal(input, len, XXH3_kSecret, sizeof(XXH3_kSecret), DCK_XXH_ACC_AVX2,
                                       XXH3_scrambleAcc_avx2);
}
#endif

/* Contract: the fastest long-input XXH3-128 loop this CPU runs (chosen once per call, before threads start). */
static XXH3_hashLong128_f dck_pick_hashlong(void)
{
#if DCK_XXH_DISPATCH
    if (dck_have_avx2())
        return dck_hashlong_avx2;
#endif
    return XXH3_hashLong_128b_default;
}

/* Contract: XXH3_128bits(p, n), its long-input loop being hl (from dck_pick_hashlong). */
static XXH128_hash_t dck_xxh3_128(const void *p, size_t n, XXH3_hashLong128_f hl)
{
    return XXH3_128bits_internal(p, n, 0, XXH3_kSecret, sizeof(XXH3_kSecret), hl);
}

/* Source of zero bytes for hashing a chunk's leading zero run without reading it again (16 KiB, stays in L1). */
#define DCK_ZERO_BLOCK 16384
static const uint8_t dck_zero_block[DCK_ZERO_BLOCK];

/* Digest of one all-zero chunk length, remembered by one worker (never shared between threads). */
struct dck_zero_memo {
    size_t len; /* 0: empty memo (chunks are never empty) */
    XXH128_hash_t hash;
};

/*
 * Contract: length of the zero prefix of p[0..n) found by an early-exit scan: returns z with p[0..z) all zero;
 * z == n exactly when the whole range is zero; otherwise p[z..min(z+128, n)) holds a nonzero byte (the scan
 * works in 128-byte blocks and stops at the first block holding one).
 */
static size_t dck_zero_prefix(const uint8_t *p, size_t n)
{
    size_t i = 0, j;

    for (; i + 128 <= n; i += 128) {
        uint64_t w[16], acc = 0;
        memcpy(w, p + i, sizeof w);
        for (j = 0; j < 16; j++)
            acc |= w[j];
        if (acc != 0)
            return i;
    }
    for (j = i; j < n; j++)
        if (p[j] != 0)
            return i;
    return n;
}

/* Contract: feeds n zero bytes into a reset XXH3 streaming state, from the static zero block. */
static void dck_feed_zeros(XXH3_state_t *st, size_t n)
{
    while (n > 0) {
        size_t take = n < DCK_ZERO_BLOCK ? n : DCK_ZERO_BLOCK;
        XXH3_128bits_update(st, dck_zero_block, take);
        n -= take;
    }
}

/* Contract: XXH3-128 of n zero bytes, computed without touching any caller memory. */
static XXH128_hash_t dck_zeros_hash(size_t n, XXH3_hashLong128_f hl)
{
    XXH3_state_t st;

    if (n <= DCK_ZERO_BLOCK)
        return dck_xxh3_128(dck_zero_block, n, hl);
    XXH3_INITSTATE(&st);
    XXH3_128bits_reset(&st);
    dck_feed_zeros(&st, n);
    return XXH3_128bits_digest(&st);
}

/*
 * Contract: hashes one chunk p[0..n) (n >= 1) reading each of its bytes from memory once. Writes the canonical
 * XXH3-128 digest to out[0..16) and 1 or 0 to *zero (all bytes zero or not). The zero prefix found by the scan
 * is hashed from the static zero block; the remainder straight from p. memo caches the all-zero digest for one
 * length.
 */
static void dck_hash_chunk(const uint8_t *p, size_t n, uint8_t *out, uint8_t *zero, struct dck_zero_memo *memo,
                           XXH3_hashLong128_f hl)
{
    XXH128_canonical_t canon;
    XXH128_hash_t h;
    size_t z = dck_zero_prefix(p, n);

    if (z == n) {
        *zero = 1;
        if (memo->len != n) {
            memo->hash = dck_zeros_hash(n, hl);
            memo->len = n;
        }
        h = memo->hash;
    } else if (z == 0) {
        *zero = 0;
        h = dck_xxh3_128(p, n, hl);
    } else {
        XXH3_state_t st;
        *zero = 0;
        XXH3_INITSTATE(&st);
        XXH3_128bits_reset(&st);
        dck_feed_zeros(&st, z);
        XXH3_128bits_update(&st, p + z, n - z);
        h = XXH3_128bits_digest(&st);
    }
    XXH128_canonicalFromHash(&canon, h);
    memcpy(out, canon.digest, DCK_DIGEST_SIZE);
}

struct dck_digest_ctx {
    const uint8_t *buf;
    size_t len, chunk_size;
    uint8_t *digests, *zero;
    XXH3_hashLong128_f hashlong;
};

/* Contract: digests and zero flags of chunks [c0, c1); writes only digests[16*c0..16*c1) and zero[c0..c1). */
static void dck_digest_range(const void *vctx, size_t c0, size_t c1)
{
    const struct dck_digest_ctx *ctx = (const struct dck_digest_ctx *)vctx;
    struct dck_zero_memo memo = {0, {0, 0}};
    size_t c;

    for (c = c0; c < c1; c++) {
        size_t off = c * ctx->chunk_size;
        size_t n = ctx->len - off < ctx->chunk_size ? ctx->len - off : ctx->chunk_size;
        dck_hash_chunk(ctx->buf + off, n, ctx->digests + c * DCK_DIGEST_SIZE, ctx->zero + c, &memo,
                       ctx->hashlong);
    }
}

size_t dck_chunk_count(size_t len, size_t chunk_size)
{
    if (chunk_size == 0)
        return 0;
    return len / chunk_size + (len % chunk_size != 0);
}

int dck_chunk_digests(const uint8_t *buf, size_t len, size_t chunk_size, uint8_t *digests, uint8_t *zero,
                      int threads)
{
    struct dck_digest_ctx ctx;
    size_t n;

    if (chunk_size == 0)
        return DCK_EINVAL;
    if (len == 0)
        return 0;
    if (buf == NULL || digests == NULL || zero == NULL)
        return DCK_EINVAL;
    n = dck_chunk_count(len, chunk_size);
    ctx.buf = buf;
    ctx.len = len;
    ctx.chunk_size = chunk_size;
    ctx.digests = digests;
    ctx.zero = zero;
    ctx.hashlong = dck_pick_hashlong();
    dck_run_ranges(dck_digest_range, &ctx, n, 1, dck_pick_threads(threads, len));
    return 0;
}

int dck_digest(const uint8_t *buf, size_t len, uint8_t out[DCK_DIGEST_SIZE])
{
    XXH128_canonical_t canon;

    if (out == NULL || (buf == NULL && len > 0))
        return DCK_EINVAL;
    XXH128_canonicalFromHash(&canon, dck_xxh3_128(len ? buf : dck_zero_block, len, dck_pick_hashlong()));
    memcpy(out, canon.digest, DCK_DIGEST_SIZE);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
 * Byte planes
 *
 * Element i of width w occupies src[i*w .. i*w+w); plane k is dst[k*m .. k*m+m). The SSE2 path transposes
 * blocks of 16 elements (16*w bytes, w registers). Index the block's bytes by (4 + log2 w) bits: element i
 * (4 bits) above byte k (log2 w bits) in the interleaved layout, and plane k above element i in the planar
 * layout. One "stage" (unpacklo/unpackhi of register j with register j + w/2 into registers 2j and 2j+1)
 * rotates that index left by one bit; split is a rotation by 4 (4 stages), merge by log2 w (1, 2 or 3 stages).
 * ---------------------------------------------------------------------------------------------------------- */

#define DCK_PLANE_BLOCK 16 /* elements per SSE2 block */
#define DCK_PLANE_ALIGN 64 /* thread ranges start at multiples of this many elements */

#if DCK_HAVE_SSE2
/* Contract: one stage over nv registers (nv in {2, 4, 8}): out[2j] / out[2j+1] = low / high byte interleave of
 * in[j] and in[j + nv/2], for j < nv/2. */
DCK_INLINE void dck_stage(__m128i *out, const __m128i *in, const int nv)
{
    int j;
    for (j = 0; j < nv / 2; j++) {
        out[2 * j] = _mm_unpacklo_epi8(in[j], in[j + nv / 2]);
        out[2 * j + 1] = _mm_unpackhi_epi8(in[j], in[j + nv / 2]);
    }
}

/* Contract: a last stage (as dck_stage) whose 16-byte results go to d[16*r .. 16*r+16) for register r, each
 * XORed with b[16*r .. 16*r+16) first when use_base is set. */
DCK_INLINE void dck_stage_store(uint8_t *d, const uint8_t *b, const __m128i *in, const int nv, const int use_base)
{
    int j;
    for (j = 0; j < nv / 2; j++) {
        __m128i lo = _mm_unpacklo_epi8(in[j], in[j + nv / 2]);
        __m128i hi = _mm_unpackhi_epi8(in[j], in[j + nv / 2]);
        if (use_base) {
            lo = _mm_xor_si128(lo, _mm_loadu_si128((const __m128i *)(b + 32 * j)));
            hi = _mm_xor_si128(hi, _mm_loadu_si128((const __m128i *)(b + 32 * j + 16)));
        }
        _mm_storeu_si128((__m128i *)(d + 32 * j), lo);
        _mm_storeu_si128((__m128i *)(d + 32 * j + 16), hi);
    }
}

/* Contract: a first stage (as dck_stage) whose input register r is loaded from s[16*r .. 16*r+16), XORed with
 * b[16*r .. 16*r+16) when use_base is set. */
DCK_INLINE void dck_load_stage(__m128i *out, const uint8_t *s, const uint8_t *b, const int nv, const int use_base)
{
    int j;
    for (j = 0; j < nv / 2; j++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(s + 16 * j));
        __m128i y = _mm_loadu_si128((const __m128i *)(s + 16 * (j + nv / 2)));
        if (use_base) {
            x = _mm_xor_si128(x, _mm_loadu_si128((const __m128i *)(b + 16 * j)));
            y = _mm_xor_si128(y, _mm_loadu_si128((const __m128i *)(b + 16 * (j + nv / 2))));
        }
        out[2 * j] = _mm_unpacklo_epi8(x, y);
        out[2 * j + 1] = _mm_unpackhi_epi8(x, y);
    }
}
#endif

#if DCK_HAVE_SSE2
/*
 * Contract: split one block of 16 elements s[0 .. 16w) (XORed byte for byte with b[0 .. 16w) when use_base is
 * set) into planes: writes d[k*stride .. k*stride+16) for k < w, and nothing else.
 */
DCK_INLINE void dck_split_block(const uint8_t *s, const uint8_t *b, uint8_t *d, size_t stride, const int w,
                                const int use_base)
{
    __m128i a[8], t[8];
    int k;

    /* The first of the 4 stages reads (and XORs) straight from memory to keep registers free. */
    dck_load_stage(t, s, b, w, use_base);
    dck_stage(a, t, w);
    dck_stage(t, a, w);
    dck_stage(a, t, w);
    for (k = 0; k < w; k++)
        _mm_storeu_si128((__m128i *)(d + (size_t)k * stride), a[k]);
}

/*
 * Contract: merge one block of 16 elements from planes s[k*stride .. k*stride+16), k < w, into d[0 .. 16w),
 * each output byte XORed with the same byte of b[0 .. 16w) when use_base is set. Writes only d[0 .. 16w).
 */
DCK_INLINE void dck_merge_block(const uint8_t *s, const uint8_t *b, uint8_t *d, size_t stride, const int w,
                                const int use_base)
{
    __m128i a[8], t[8];
    int k;

    for (k = 0; k < w; k++)
        a[k] = _mm_loadu_si128((const __m128i *)(s + (size_t)k * stride));
    /* log2(w) stages; the last one stores (XORed) straight from the unpacks to keep registers free. */
    if (w == 2) {
        dck_stage_store(d, b, a, w, use_base);
    } else if (w == 4) {
        dck_stage(t, a, w);
        dck_stage_store(d, b, t, w, use_base);
    } else {
        dck_stage(t, a, w);
        dck_stage(a, t, w);
        dck_stage_store(d, b, a, w, use_base);
    }
}
#endif

/*
 * Large buffers go through a small tile: planes that lie a large power of two apart otherwise take turns
 * evicting 64-byte lines to the same DRAM banks and cache sets (measured 15x slower on 1 GiB at width 4). A
 * tile of DCK_PLANE_TILE elements is transposed in L1 and then moved as w runs of DCK_PLANE_TILE bytes.
 * Buffers that fit in cache are faster without the extra copy.
 */
#define DCK_PLANE_TILE 1024                          /* elements per tile (a tile buffer is 8 KiB of stack) */
#define DCK_PLANE_TILE_MIN ((size_t)8 * 1024 * 1024)   /* bytes from which the tiled path is used */
#define DCK_PLANE_STREAM_MIN ((size_t)32 * 1024 * 1024) /* ... and split writes bypass the cache */

#if DCK_HAVE_SSE2
/*
 * Contract: copies the DCK_PLANE_TILE bytes at s to d. With stream set and d 16-byte aligned the copy uses
 * non-temporal stores (no read-for-ownership, no cache pollution for outputs far larger than the cache); the
 * caller then issues _mm_sfence() before its results are handed to another thread.
 */
static void dck_put_run(uint8_t *d, const uint8_t *s, int stream)
{
    size_t q;

    if (!stream || ((uintptr_t)d & 15) != 0) {
        memcpy(d, s, DCK_PLANE_TILE);
        return;
    }
    for (q = 0; q < DCK_PLANE_TILE; q += 16)
        _mm_stream_si128((__m128i *)(d + q), _mm_loadu_si128((const __m128i *)(s + q)));
}
#endif

/*
 * Contract: split elements [i0, i1) of src (m elements of width w in {2, 4, 8}) into the planes of dst,
 * XORing each source byte with the same byte of base first when use_base is set (base is then non-NULL).
 * Writes dst[k*m + i] for i in [i0, i1), k < w, and nothing else. tiled: use the tiled path (same result);
 * stream: and write the planes with non-temporal stores where aligned (same result).
 */
DCK_INLINE void dck_split_elems(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t m, size_t i0,
                                size_t i1, const int w, const int use_base, int tiled, int stream)
{
    size_t i = i0;
    int k;

#if DCK_HAVE_SSE2
    if (tiled) {
        uint8_t tile[8 * DCK_PLANE_TILE];
        size_t j;
        for (; i + DCK_PLANE_TILE <= i1; i += DCK_PLANE_TILE) {
            for (j = 0; j < DCK_PLANE_TILE; j += DCK_PLANE_BLOCK) {
                size_t at = (i + j) * (size_t)w;
                dck_split_block(src + at, use_base ? base + at : NULL, tile + j, DCK_PLANE_TILE, w, use_base);
            }
            for (k = 0; k < w; k++)
                dck_put_run(dst + (size_t)k * m + i, tile + (size_t)k * DCK_PLANE_TILE, stream);
        }
        if (stream)
            _mm_sfence();
    }
    for (; i + DCK_PLANE_BLOCK <= i1; i += DCK_PLANE_BLOCK) {
        size_t at = i * (size_t)w;
        dck_split_block(src + at, use_base ? base + at : NULL, dst + i, m, w, use_base);
    }
#else
    (void)tiled;
    (void)stream;
#endif
    for (; i < i1; i++) {
        for (k = 0; k < w; k++) {
            uint8_t v = src[i * (size_t)w + (size_t)k];
            if (use_base)
                v ^= base[i * (size_t)w + (size_t)k];
            dst[(size_t)k * m + i] = v;
        }
    }
}

/*
 * Contract: merge elements [i0, i1) from the planes of src (m elements of width w in {2, 4, 8}) into dst,
 * XORing each output byte with the same byte of base when use_base is set. Writes dst[i*w .. i*w+w) for i in
 * [i0, i1), and nothing else. tiled: use the tiled path (same result).
 */
DCK_INLINE void dck_merge_elems(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t m, size_t i0,
                                size_t i1, const int w, const int use_base, int tiled)
{
    size_t i = i0;
    int k;

#if DCK_HAVE_SSE2
    if (tiled) {
        uint8_t tile[8 * DCK_PLANE_TILE];
        size_t j;
        for (; i + DCK_PLANE_TILE <= i1; i += DCK_PLANE_TILE) {
            for (k = 0; k < w; k++)
                memcpy(tile + (size_t)k * DCK_PLANE_TILE, src + (size_t)k * m + i, DCK_PLANE_TILE);
            for (j = 0; j < DCK_PLANE_TILE; j += DCK_PLANE_BLOCK) {
                size_t at = (i + j) * (size_t)w;
                dck_merge_block(tile + j, use_base ? base + at : NULL, dst + at, DCK_PLANE_TILE, w, use_base);
            }
        }
    }
    for (; i + DCK_PLANE_BLOCK <= i1; i += DCK_PLANE_BLOCK) {
        size_t at = i * (size_t)w;
        dck_merge_block(src + i, use_base ? base + at : NULL, dst + at, m, w, use_base);
    }
#else
    (void)tiled;
#endif
    for (; i < i1; i++) {
        for (k = 0; k < w; k++) {
            uint8_t v = src[(size_t)k * m + i];
            if (use_base)
                v ^= base[i * (size_t)w + (size_t)k];
            dst[i * (size_t)w + (size_t)k] = v;
        }
    }
}

/* Contract: dst[i] = src[i] ^ base[i] (or a copy when base is NULL) for i in [i0, i1). */
static void dck_xor_copy(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t i0, size_t i1)
{
    size_t i;

    if (base == NULL) {
        memcpy(dst + i0, src + i0, i1 - i0);
        return;
    }
    for (i = i0; i < i1; i++)
        dst[i] = src[i] ^ base[i];
}

struct dck_plane_ctx {
    const uint8_t *src, *base; /* base NULL: no XOR */
    uint8_t *dst;
    size_t m; /* elements */
    int width;
    int merge;
    int tiled;  /* buffer too large for cache: transpose through a tile */
    int stream; /* ... and far larger: split writes bypass the cache */
};

/* Contract: the plane operation described by ctx over elements [i0, i1); writes only those elements' bytes. */
static void dck_plane_range(const void *vctx, size_t i0, size_t i1)
{
    const struct dck_plane_ctx *c = (const struct dck_plane_ctx *)vctx;
    const int x = c->base != NULL;

    /* Constant width and XOR flag per call so each instance is specialised and vectorised. */
#define DCK_PLANE_CASE(W)                                                                                          \
    case W:                                                                                                        \
        if (c->merge) {                                                                                            \
            if (x)                                                                                                 \
                dck_merge_elems(c->src, c->base, c->dst, c->m, i0, i1, W, 1, c->tiled);                            \
            else                                                                                                   \
                dck_merge_elems(c->src, NULL, c->dst, c->m, i0, i1, W, 0, c->tiled);                               \
        } else {                                                                                                   \
            if (x)                                                                                                 \
                dck_split_elems(c->src, c->base, c->dst, c->m, i0, i1, W, 1, c->tiled, c->stream);                 \
            else                                                                                                   \
                dck_split_elems(c->src, NULL, c->dst, c->m, i0, i1, W, 0, c->tiled, c->stream);                    \
        }                                                                                                          \
        break;

    switch (c->width) {
    DCK_PLANE_CASE(2)
    DCK_PLANE_CASE(4)
    DCK_PLANE_CASE(8)
    default:
        dck_xor_copy(c->src, c->base, c->dst, i0, i1);
        break;
    }
#undef DCK_PLANE_CASE
}

/* Contract: validates and runs one plane operation (see kernel.h); base NULL means no XOR. */
static int dck_planes(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width, int merge,
                      int threads)
{
    struct dck_plane_ctx ctx;
    size_t body;

    if (width != 1 && width != 2 && width != 4 && width != 8)
        return DCK_EINVAL;
    if (len == 0)
        return 0;
    if (src == NULL || dst == NULL)
        return DCK_EINVAL;
    ctx.src = src;
    ctx.base = base;
    ctx.dst = dst;
    ctx.m = len / (size_t)width;
    ctx.width = width;
    ctx.merge = merge;
    ctx.tiled = len >= DCK_PLANE_TILE_MIN;
    ctx.stream = len >= DCK_PLANE_STREAM_MIN;
    body = ctx.m * (size_t)width;
    dck_run_ranges(dck_plane_range, &ctx, ctx.m, DCK_PLANE_ALIGN, dck_pick_threads(threads, len));
    dck_xor_copy(src, base, dst, body, len);
    return 0;
}

int dck_split_planes(const uint8_t *src, uint8_t *dst, size_t len, int width, int threads)
{
    return dck_planes(src, NULL, dst, len, width, 0, threads);
}

int dck_merge_planes(const uint8_t *src, uint8_t *dst, size_t len, int width, int threads)
{
    return dck_planes(src, NULL, dst, len, width, 1, threads);
}

int dck_xor_split_planes(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width,
                         int threads)
{
    if (len > 0 && base == NULL)
        return DCK_EINVAL;
    return dck_planes(src, base, dst, len, width, 0, threads);
}

int dck_merge_planes_xor(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width,
                         int threads)
{
    if (len > 0 && base == NULL)
        return DCK_EINVAL;
    return dck_planes(src, base, dst, len, width, 1, threads);
}

/* ------------------------------------------------------------------------------------------------------------
 * Frame decoding
 * ---------------------------------------------------------------------------------------------------------- */

/* One thread's decoding state: a zstd context and a scratch buffer for byte planes, freed at thread exit. A
 * scratch buffer larger than DCK_SCRATCH_KEEP is freed after each call instead of kept (large chunk sizes would
 * otherwise pin one chunk of memory per reading thread). */
#define DCK_SCRATCH_KEEP ((size_t)16 * 1024 * 1024)
struct dck_decoder {
    ZSTD_DCtx *dctx;
    uint8_t *scratch;
    size_t cap;
};

static pthread_key_t dck_decoder_key;
static pthread_once_t dck_decoder_once = PTHREAD_ONCE_INIT;
static int dck_decoder_key_ok;

/* Contract: frees a dck_decoder (the thread-exit destructor of dck_decoder_key). */
static void dck_decoder_free(void *p)
{
    struct dck_decoder *d = (struct dck_decoder *)p;
    if (d == NULL)
        return;
    ZSTD_freeDCtx(d->dctx);
    free(d->scratch);
    free(d);
}

/* Contract: creates dck_decoder_key once per process; records whether that worked. */
static void dck_decoder_key_init(void)
{
    dck_decoder_key_ok = pthread_key_create(&dck_decoder_key, dck_decoder_free) == 0;
}

/* Contract: the calling thread's decoder with at least `need` bytes of scratch, or NULL when out of memory. */
static struct dck_decoder *dck_decoder_get(size_t need)
{
    struct dck_decoder *d;

    pthread_once(&dck_decoder_once, dck_decoder_key_init);
    if (!dck_decoder_key_ok)
        return NULL;
    d = (struct dck_decoder *)pthread_getspecific(dck_decoder_key);
    if (d == NULL) {
        d = (struct dck_decoder *)calloc(1, sizeof(*d));
        if (d == NULL)
            return NULL;
        d->dctx = ZSTD_createDCtx();
        if (d->dctx == NULL || pthread_setspecific(dck_decoder_key, d) != 0) {
            dck_decoder_free(d);
            return NULL;
        }
    }
    if (d->cap < need) {
        uint8_t *p = (uint8_t *)malloc(need);
        if (p == NULL)
            return NULL;
        free(d->scratch);
        d->scratch = p;
        d->cap = need;
    }
    return d;
}

/* Contract: frees the scratch buffer of dec (NULL allowed) when it is larger than DCK_SCRATCH_KEEP. */
static void dck_decoder_trim(struct dck_decoder *dec)
{
    if (dec != NULL && dec->cap > DCK_SCRATCH_KEEP) {
        free(dec->scratch);
        dec->scratch = NULL;
        dec->cap = 0;
    }
}

/* A streaming XXH3-64 update: the header's XXH3_64bits_update, or the same with the AVX2 stripe loop. */
typedef void (*dck_xxh3_64_update_f)(XXH3_state_t *st, const void *p, size_t n);

/* Contract: XXH3_64bits_update(st, p, n) with the header's portable loops (dck_pick_update64's fallback). */
static void dck_xxh3_64_update_default(XXH3_state_t *st, const void *p, size_t n)
{
    (void)XXH3_64bits_update(st, p, n);
}

#if DCK_XXH_DISPATCH
/* Contract: XXH3_64bits_update(st, p, n) with the AVX2 accumulate and scramble loops: the same state afterwards
 * (the loops compute the same values). Only called when the CPU has AVX2. */
XXH_TARGET_AVX2 static void dck_xxh3_64_update_avx2(XXH3_state_t *st, const void *p, size_t n)
{
    (void)XXH3_update(st, (const xxh_u8 *)p, n, DCK_XXH_ACC_AVX2, XXH3_scrambleAcc_avx2);
}
#endif

/* Contract: the fastest streaming XXH3-64 update this CPU runs (chosen once per decode call). */
static dck_xxh3_64_update_f dck_pick_update64(void)
{
#if DCK_XXH_DISPATCH
    if (dck_have_avx2())
        return dck_xxh3_64_update_avx2;
#endif
    return dck_xxh3_64_update_default;
}

/* Contract: 1 when the checksum stored in frame[56..64) (little-endian) matches XXH3-64 over frame[0..56) followed
 * by frame[64..len); len >= DCK_FRAME_HEADER; update is from dck_pick_update64. */
static int dck_frame_checksum_ok(const uint8_t *frame, size_t len, dck_xxh3_64_update_f update)
{
    XXH3_state_t st;
    uint64_t want = 0;
    int i;

    for (i = 7; i >= 0; i--)
        want = (want << 8) | frame[DCK_FRAME_CHECKED + i];
    XXH3_64bits_reset(&st);
    update(&st, frame, DCK_FRAME_CHECKED);
    update(&st, frame + DCK_FRAME_HEADER, len - DCK_FRAME_HEADER);
    return XXH3_64bits_digest(&st) == want;
}

/* Contract: decompresses the single zstd frame src[0..len) into out[0..raw_len); 0 when it declares and yields
 * exactly raw_len bytes, DCK_EPAYLOAD otherwise (out then holds unspecified bytes). */
static int dck_unzstd(ZSTD_DCtx *dctx, const uint8_t *src, size_t len, uint8_t *out, size_t raw_len)
{
    unsigned long long declared = ZSTD_getFrameContentSize(src, len);
    size_t got;

    if (declared != (unsigned long long)raw_len || ZSTD_findFrameCompressedSize(src, len) != len)
        return DCK_EPAYLOAD;
    got = ZSTD_decompressDCtx(dctx, out, raw_len, src, len);
    if (ZSTD_isError(got) || got != raw_len)
        return DCK_EPAYLOAD;
    return 0;
}

/* Output bytes per step of the last frame's merge when its result is hashed in the same pass: small enough that
 * the step's output is still in L1 when it is hashed, large enough to amortise the call overhead. */
#define DCK_FUSE_BYTES ((size_t)16 * 1024)

/* Contract: dck_planes(src, base, dst, raw_len, width, merge=1, threads=1) in steps of DCK_FUSE_BYTES of output,
 * width in {1, 2, 4, 8}. With pred (then base == dst and raw_len a whole number of its elements), each step first
 * writes the prediction of its bytes into dst (dck_predict over that range: the same bytes as one call over the
 * chunk, the prediction being elementwise), so the residual is XORed onto it while it is in L1. With st, each
 * step's result is then fed in order to the streaming hash st (through update) while it is in cache: the same
 * state as one update over dst[0..raw_len) afterwards. Returns 0, or DCK_EINVAL from dck_predict (arguments the caller validated). */
static int dck_merge_steps(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t raw_len, int width,
                           const struct dck_prediction *pred, XXH3_state_t *st, dck_xxh3_64_update_f update)
{
    struct dck_plane_ctx ctx;
    size_t body, step, i, predicted = 0;

    if (raw_len == 0)
        return 0;
    ctx.src = src;
    ctx.base = base;
    ctx.dst = dst;
    ctx.m = raw_len / (size_t)width;
    ctx.width = width;
    ctx.merge = 1;
    ctx.tiled = raw_len >= DCK_PLANE_TILE_MIN;
    ctx.stream = raw_len >= DCK_PLANE_STREAM_MIN;
    body = ctx.m * (size_t)width;
    step = DCK_FUSE_BYTES / (size_t)width; /* elements; a multiple of DCK_PLANE_TILE and of DCK_PLANE_BLOCK */
    for (i = 0; i < ctx.m || predicted < raw_len; i += step) {
        size_t e = ctx.m - i < step ? ctx.m : i + step; /* (i may pass m only to predict a tail) */
        if (pred != NULL) {
            /* bytes [i*w, e*w), the last step through raw_len (so the tail is predicted too) */
            size_t hi = e >= ctx.m ? raw_len : e * (size_t)width, k;
            const uint8_t *refs[3];
            int rc;
            for (k = 0; k < (size_t)pred->nrefs; k++)
                refs[k] = pred->refs[k] + predicted;
            rc = dck_predict(pred->predictor, pred->c, pred->nc, pred->base + predicted, refs, pred->nrefs,
                             dst + predicted, hi - predicted);
            if (rc != 0)
                return rc;
            predicted = hi;
        } else {
            predicted = raw_len;
        }
        if (i < e) {
            dck_plane_range(&ctx, i, e);
            if (st != NULL)
                update(st, dst + i * (size_t)width, (e - i) * (size_t)width);
        }
        if (e >= ctx.m)
            break;
    }
    if (body < raw_len) {
        dck_xor_copy(src, base, dst, body, raw_len);
        if (st != NULL)
            update(st, dst + body, raw_len - body);
    }
    return 0;
}

/* Contract: the frame loop of dck_decode_frames (arguments validated by it): applies frames[0..n) to dst, setting
 * *bad to the frame being applied; uses (and creates on first need) the thread's decoder, stored in *decp. With pred,
 * frame 0's prediction comes from the kernel, and with hs the last frame's pass feeds the result to hs (see
 * dck_merge_steps). */
static int dck_apply_frames(const uint8_t *const *frames, const size_t *frame_lens, const int *codecs,
                            const int *widths, int n, uint8_t *dst, size_t raw_len, int *bad,
                            struct dck_decoder **decp, const struct dck_prediction *pred, XXH3_state_t *hs)
{
    dck_xxh3_64_update_f update = dck_pick_update64();
    int k, rc;

    for (k = 0; k < n; k++) {
        const uint8_t *payload = frames[k] + DCK_FRAME_HEADER;
        size_t plen = frame_lens[k] - DCK_FRAME_HEADER;
        int codec = codecs[k];

        *bad = k;
        if (!dck_frame_checksum_ok(frames[k], frame_lens[k], update))
            return DCK_ECHECKSUM;
        if (codec == DCK_CODEC_RAW) {
            if (plen != raw_len)
                return DCK_EPAYLOAD;
            if (raw_len > 0)
                memcpy(dst, payload, raw_len);
            if (hs != NULL && k == n - 1)
                update(hs, dst, raw_len);
            continue;
        }
        if (*decp == NULL && (*decp = dck_decoder_get(raw_len > 0 ? raw_len : 1)) == NULL)
            return DCK_ENOMEM;
        if (codec == DCK_CODEC_ZSTD) {
            if ((rc = dck_unzstd((*decp)->dctx, payload, plen, dst, raw_len)) != 0)
                return rc;
            if (hs != NULL && k == n - 1)
                update(hs, dst, raw_len);
            continue;
        }
        if (codec == DCK_CODEC_PREDICTED) { /* skip the prediction record: u32 length, then the record */
            size_t rec;
            if (plen < 4)
                return DCK_EPAYLOAD;
            rec = (size_t)payload[0] | (size_t)payload[1] << 8 | (size_t)payload[2] << 16 | (size_t)payload[3] << 24;
            if (rec > plen - 4)
                return DCK_EPAYLOAD;
            payload += 4 + rec;
            plen -= 4 + rec;
        }
        if ((rc = dck_unzstd((*decp)->dctx, payload, plen, (*decp)->scratch, raw_len)) != 0)
            return rc;
        /* merge_planes XOR dst works in place: every 16-byte block of base is read before the same block of
         * output is written (dck_stage_store, and the scalar loops index both identically). */
        /* A prediction the kernel computes is written a step at a time just before the residual is XORed onto
         * it; the last pass over the result hashes each step while it is in cache. */
        if ((hs != NULL && k == n - 1) || (pred != NULL && k == 0)) {
            if ((rc = dck_merge_steps((*decp)->scratch, codec >= DCK_CODEC_DELTA ? dst : NULL, dst, raw_len,
                                      widths[k], k == 0 ? pred : NULL, k == n - 1 ? hs : NULL, update)) != 0)
                return rc;
        } else
            dck_planes((*decp)->scratch, codec >= DCK_CODEC_DELTA ? dst : NULL, dst, raw_len, widths[k], 1, 1);
    }
    return 0;
}

/* Contract: for a predictor id (DCK_PREDICT_*) sets *nc and *nrefs to its numbers of coefficients and references
 * and *size to its element size in bytes (4: float32; 2: the bfloat16 predictors) and returns 1; returns 0 (and
 * sets nothing) for an unknown id. */
static int dck_predictor_shape(int predictor, int *nc, int *nrefs, size_t *size)
{
    switch (predictor) {
    case DCK_PREDICT_ADAM_V:
    case DCK_PREDICT_ADAM_V_BF16:
        *nc = 4, *nrefs = 2;
        break;
    case DCK_PREDICT_ADAM_PARAM:
    case DCK_PREDICT_ADAM_PARAM_BF16:
        *nc = 7, *nrefs = 3;
        break;
    case DCK_PREDICT_MOMENTUM_PARAM:
        *nc = 3, *nrefs = 2;
        break;
    case DCK_PREDICT_UPDATE_PARAM:
        *nc = 2, *nrefs = 1;
        break;
    default:
        return 0;
    }
    *size = predictor == DCK_PREDICT_ADAM_V_BF16 || predictor == DCK_PREDICT_ADAM_PARAM_BF16 ? 2 : 4;
    return 1;
}

/* Contract: dck_decode_frames, or dck_decode_predicted when pred is not NULL (see kernel.h). */
static int dck_decode(const uint8_t *const *frames, const size_t *frame_lens, const int *codecs, const int *widths,
                      int n, const struct dck_prediction *pred, uint8_t *dst, size_t raw_len, const uint8_t *digest,
                      int *bad)
{
    struct dck_decoder *dec = NULL;
    XXH3_state_t hs;
    int k, rc;

    if (bad == NULL || frames == NULL || frame_lens == NULL || codecs == NULL || widths == NULL || n < 1 ||
        (dst == NULL && raw_len > 0))
        return DCK_EINVAL;
    *bad = 0;
    for (k = 0; k < n; k++) {
        int w = widths[k];
        if (frames[k] == NULL || frame_lens[k] < DCK_FRAME_HEADER || codecs[k] < DCK_CODEC_RAW ||
            codecs[k] > DCK_CODEC_PREDICTED || (codecs[k] == DCK_CODEC_PREDICTED && k != 0) || (w != 1 && w != 2 && w != 4 && w != 8)) {
            *bad = k;
            return DCK_EINVAL;
        }
    }
    if (pred != NULL) {
        int j, nr = pred->nrefs;
        int nc, nrefs;
        size_t size;
        if (codecs[0] != DCK_CODEC_PREDICTED || pred->c == NULL || pred->refs == NULL ||
            !dck_predictor_shape(pred->predictor, &nc, &nrefs, &size) || pred->nc != nc || nr != nrefs ||
            raw_len % size != 0)
            return DCK_EINVAL;
        for (j = 0; j < nr && raw_len > 0; j++)
            if (pred->refs[j] == NULL)
                return DCK_EINVAL;
        if (raw_len > 0 && pred->base == NULL)
            return DCK_EINVAL;
    }
    /* With a digest, the last frame's pass over the result also feeds it to a streaming XXH3-128 (the same
     * hash as dck_digest of the result, without another pass over memory). */
    if (digest != NULL)
        XXH3_128bits_reset(&hs);
    rc = dck_apply_frames(frames, frame_lens, codecs, widths, n, dst, raw_len, bad, &dec, pred,
                          digest != NULL ? &hs : NULL);
    dck_decoder_trim(dec);
    if (rc != 0)
        return rc;
    if (digest != NULL) {
        XXH128_canonical_t canon;
        *bad = n;
        XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(&hs));
        if (memcmp(canon.digest, digest, DCK_DIGEST_SIZE) != 0)
            return DCK_EDIGEST;
    }
    *bad = 0;
    return 0;
}

int dck_decode_frames(const uint8_t *const *frames, const size_t *frame_lens, const int *codecs, const int *widths,
                      int n, uint8_t *dst, size_t raw_len, const uint8_t *digest, int *bad)
{
    return dck_decode(frames, frame_lens, codecs, widths, n, NULL, dst, raw_len, digest, bad);
}

int dck_decode_predicted(const uint8_t *const *frames, const size_t *frame_lens, const int *codecs,
                         const int *widths, int n, const struct dck_prediction *pred, uint8_t *dst, size_t raw_len,
                         const uint8_t *digest, int *bad)
{
    if (pred == NULL) {
        if (bad != NULL)
            *bad = 0;
        return DCK_EINVAL;
    }
    return dck_decode(frames, frame_lens, codecs, widths, n, pred, dst, raw_len, digest, bad);
}

/* ------------------------------------------------------------------------------------------------------------
 * Predictions
 * ---------------------------------------------------------------------------------------------------------- */

/* Elements per block of dck_predict: inputs are staged into aligned float arrays so the arithmetic loop is plain
 * and vectorizes (SSE2: two doubles per operation). */
#define DCK_PREDICT_BLOCK 512

/* Contract: dst[0..n) = the little-endian float32 values at src, each subnormal replaced by a zero of its sign. */
static void dck_f32_load(float *dst, const uint8_t *src, size_t n)
{
    uint32_t b[DCK_PREDICT_BLOCK];
    size_t i;

    memcpy(b, src, 4 * n);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (i = 0; i < n; i++)
        b[i] = __builtin_bswap32(b[i]);
#endif
    for (i = 0; i < n; i++)
        b[i] = (b[i] & 0x7f800000u) ? b[i] : (b[i] & 0x80000000u);
    memcpy(dst, b, 4 * n);
}

/* Contract: stores q[0..n) at dst as little-endian float32: canonical NaN 0x7FC00000 for a NaN, a zero of q's sign
 * when |q| < 2^-126, else q rounded to float; q is overwritten. Three plain loops, so each vectorizes: the flush
 * happens in double (what is converted is then zero or at least 2^-126, so flush-to-zero modes cannot change the
 * conversion), the NaN test on the float bits. */
static void dck_f32_store(uint8_t *dst, double *q, size_t n)
{
    float f[DCK_PREDICT_BLOCK];
    uint32_t b[DCK_PREDICT_BLOCK];
    size_t i;

    for (i = 0; i < n; i++)
        q[i] = fabs(q[i]) < 0x1p-126 ? copysign(0.0, q[i]) : q[i];
    for (i = 0; i < n; i++)
        f[i] = (float)q[i];
    memcpy(b, f, 4 * n);
    for (i = 0; i < n; i++)
        b[i] = (b[i] & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : b[i];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (i = 0; i < n; i++)
        b[i] = __builtin_bswap32(b[i]);
#endif
    memcpy(dst, b, 4 * n);
}

/* Contract: x rounded to float32 as dck_f32_store rounds a result (a zero of x's sign when |x| < 2^-126, else
 * (float)x, a NaN staying a NaN), widened back to double: update-param's first step. */
static inline double dck_round32(double x)
{
    return fabs(x) < 0x1p-126 ? copysign(0.0, x) : (double)(float)x;
}

/* Contract: a - b rounded to odd: a - b when that is a double, else whichever of the two doubles around it has
 * an odd last significand bit. Rounding that to float32 (24 bits, at least two fewer than a double's 53) then
 * rounds the exact a - b once, as a fused multiply-add would (round-to-odd; update-param's last step). Exact
 * for finite a and b whose difference does not overflow (TwoSum: s + e == a - b); a NaN or an infinity comes
 * out as a - b. */
static inline double dck_sub_odd(double a, double b)
{
    double s = a - b, bb = s - a, e = (a - (s - bb)) + (-b - bb);
    uint64_t sb, eb;

    if (!(e != 0.0) || !(fabs(s) < INFINITY))
        return s;
    memcpy(&sb, &s, 8);
    memcpy(&eb, &e, 8);
    if (!(sb & 1u))
        sb += ((sb ^ eb) >> 63) ? UINT64_MAX : 1u; /* towards e: away from zero when e has s's sign */
    memcpy(&s, &sb, 8);
    return s;
}

/* Contract: out[4*at .. 4*(at+n)) = the prediction (kernel.h) of elements [at, at+n), by the portable loops:
 * blocks of DCK_PREDICT_BLOCK staged into aligned arrays, which compilers vectorize for the build's baseline. */
static void dck_predict_portable(int predictor, const double *c, const uint8_t *base, const uint8_t *const *refs,
                                 uint8_t *out, size_t at, size_t n)
{
    float m[DCK_PREDICT_BLOCK], m1[DCK_PREDICT_BLOCK], v1[DCK_PREDICT_BLOCK], b1[DCK_PREDICT_BLOCK];
    double q[DCK_PREDICT_BLOCK];
    const int update = predictor == DCK_PREDICT_UPDATE_PARAM;
    const double c0 = c[0], c1 = c[1], c2 = update ? 0.0 : c[2];
    const double c3 = update || predictor == DCK_PREDICT_MOMENTUM_PARAM ? 0.0 : c[3];
    size_t end = at + n;

    for (; at < end; at += DCK_PREDICT_BLOCK) {
        size_t i, k = end - at < DCK_PREDICT_BLOCK ? end - at : DCK_PREDICT_BLOCK;

        dck_f32_load(m, refs[0] + 4 * at, k);
        if (!update)
            dck_f32_load(m1, refs[1] + 4 * at, k);
        dck_f32_load(b1, base + 4 * at, k);
        if (update) {
            for (i = 0; i < k; i++) /* q = f32(c0*p1) - c1*u, rounded once (m holds u, b1 holds p1) */
                q[i] = dck_sub_odd(dck_round32(c0 * (double)b1[i]), c1 * (double)m[i]);
        } else if (predictor == DCK_PREDICT_MOMENTUM_PARAM) {
            for (i = 0; i < k; i++) { /* q = c0*p1 - c1*b + c2*b1 (m holds b, m1 holds b1, b1 holds p1) */
                double u = c1 * (double)m[i];
                double r = c0 * (double)b1[i];
                r = r - u;
                u = c2 * (double)m1[i];
                q[i] = r + u;
            }
        } else if (predictor == DCK_PREDICT_ADAM_V) {
            for (i = 0; i < k; i++) { /* w = c2*v1 + c3*(g*g), g = (m - c0*m1)*c1, one rounding per step */
                double g = (double)m[i] - c0 * (double)m1[i];
                g = g * c1;
                g = g * g;
                g = g * c3;
                q[i] = c2 * (double)b1[i] + g;
            }
        } else {
            const double c4 = c[4], c5 = c[5], c6 = c[6];
            dck_f32_load(v1, refs[2] + 4 * at, k);
            for (i = 0; i < k; i++) { /* q = c4*p1 - c5*(m / (sqrt(w) + c6)) */
                double g = (double)m[i] - c0 * (double)m1[i];
                double d, u;
                g = g * c1;
                g = g * g;
                g = g * c3;
                d = sqrt(c2 * (double)v1[i] + g);
                d = d + c6;
                u = (double)m[i] / d;
                u = u * c5;
                q[i] = c4 * (double)b1[i] - u;
            }
        }
        dck_f32_store(out + 4 * at, q, k);
    }
}

#if DCK_AVX2
/* Contract: the four float32 bit patterns in b, subnormals replaced by zeros of their sign, widened to double. */
DCK_TARGET_AVX2 static inline __m256d dck_widen4(__m128i b)
{
    __m128i sub = _mm_cmpeq_epi32(_mm_and_si128(b, _mm_set1_epi32(0x7f800000)), _mm_setzero_si128());
    b = _mm_blendv_epi8(b, _mm_and_si128(b, _mm_set1_epi32((int)0x80000000u)), sub);
    return _mm256_cvtps_pd(_mm_castsi128_ps(b));
}

/* Contract: the four float32 at p (unaligned), as dck_widen4 widens them. */
DCK_TARGET_AVX2 static inline __m256d dck_load4(const uint8_t *p)
{
    return dck_widen4(_mm_loadu_si128((const __m128i *)p));
}

/* Contract: the float32 bit patterns dck_f32_store gives q's four values. */
DCK_TARGET_AVX2 static inline __m128i dck_narrow4(__m256d q)
{
    const __m256d sign = _mm256_set1_pd(-0.0);
    __m256d tiny = _mm256_cmp_pd(_mm256_andnot_pd(sign, q), _mm256_set1_pd(0x1p-126), _CMP_LT_OQ); /* NaN: no */
    __m128i b;

    q = _mm256_blendv_pd(q, _mm256_and_pd(q, sign), tiny);
    b = _mm_castps_si128(_mm256_cvtpd_ps(q));
    return _mm_blendv_epi8(b, _mm_set1_epi32(0x7fc00000), _mm_cmpgt_epi32(_mm_and_si128(b, _mm_set1_epi32(0x7fffffff)),
                                                                         _mm_set1_epi32(0x7f800000)));
}

/* Contract: stores q at p (unaligned) as dck_f32_store does for each of its four values. */
DCK_TARGET_AVX2 static inline void dck_store4(uint8_t *p, __m256d q)
{
    _mm_storeu_si128((__m128i *)p, dck_narrow4(q));
}

/* Contract: the four bfloat16 at p (unaligned) as dck_load4 reads their float32 widenings (16 zero bits
 * appended). */
DCK_TARGET_AVX2 static inline __m256d dck_load4_bf16(const uint8_t *p)
{
    return dck_widen4(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)p)), 16));
}

/* Contract: stores q at p (unaligned) as dck_store4 computes each float32, then rounded to bfloat16 as
 * dck_bf16_narrow does (the canonical NaN 0x7FC00000 rounds to 0x7FC0 by the same sum). */
DCK_TARGET_AVX2 static inline void dck_store4_bf16(uint8_t *p, __m256d q)
{
    __m128i b = dck_narrow4(q);

    b = _mm_add_epi32(_mm_add_epi32(b, _mm_set1_epi32(0x7fff)),
                      _mm_and_si128(_mm_srli_epi32(b, 16), _mm_set1_epi32(1)));
    b = _mm_srli_epi32(b, 16);
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi32(b, b));
}

/* Contract: dck_sub_odd of each of the four pairs (a, b). */
DCK_TARGET_AVX2 static inline __m256d dck_sub_odd4(__m256d a, __m256d b)
{
    const __m256d sign = _mm256_set1_pd(-0.0);
    const __m256i one = _mm256_set1_epi64x(1), zero = _mm256_setzero_si256();
    __m256d s = _mm256_sub_pd(a, b), bb = _mm256_sub_pd(s, a);
    __m256d e = _mm256_add_pd(_mm256_sub_pd(a, _mm256_sub_pd(s, bb)), _mm256_sub_pd(_mm256_xor_pd(b, sign), bb));
    __m256d inexact = _mm256_and_pd(_mm256_cmp_pd(e, _mm256_setzero_pd(), _CMP_NEQ_OQ),
                                    _mm256_cmp_pd(_mm256_andnot_pd(sign, s), _mm256_set1_pd(INFINITY), _CMP_LT_OQ));
    __m256i sb = _mm256_castpd_si256(s);
    __m256i even = _mm256_cmpeq_epi64(_mm256_and_si256(sb, one), zero);
    /* +1 where e has s's sign, else -1 */
    __m256i step = _mm256_or_si256(one, _mm256_sub_epi64(zero, _mm256_srli_epi64(
                                                                  _mm256_xor_si256(sb, _mm256_castpd_si256(e)), 63)));

    step = _mm256_and_si256(step, _mm256_and_si256(_mm256_castpd_si256(inexact), even));
    return _mm256_castsi256_pd(_mm256_add_epi64(sb, step));
}

/* Element loads and stores of the vector loops: float32, or bfloat16 when bf16 (loop-invariant, so the
 * compiler takes the test out of the loops). */
#define DCK_LOAD4(p, i) (bf16 ? dck_load4_bf16((p) + 2 * (i)) : dck_load4((p) + 4 * (i)))
#define DCK_STORE4(p, i, q) (bf16 ? dck_store4_bf16((p) + 2 * (i), (q)) : dck_store4((p) + 4 * (i), (q)))
#define DCK_LOAD8(p, i) (bf16 ? dck_load8_bf16((p) + 2 * (i)) : dck_load8((p) + 4 * (i)))
#define DCK_STORE8(p, i, q) (bf16 ? dck_store8_bf16((p) + 2 * (i), (q)) : dck_store8((p) + 4 * (i), (q)))

/* Contract: as dck_predict_portable over elements [0, n), n % 4 == 0, four at a time in AVX registers: the same
 * correctly rounded operations in the same order, so the same bits; with bf16, over bfloat16 elements as
 * dck_predict_bf16 computes them. Only called when the CPU has AVX2. */
DCK_TARGET_AVX2 static void dck_predict_avx2(int predictor, const double *c, const uint8_t *base,
                                             const uint8_t *const *refs, uint8_t *out, size_t n, int bf16)
{
    const int update = predictor == DCK_PREDICT_UPDATE_PARAM;
    const __m256d c0 = _mm256_set1_pd(c[0]), c1 = _mm256_set1_pd(c[1]), c2 = _mm256_set1_pd(update ? 0.0 : c[2]),
                  c3 = _mm256_set1_pd(update || predictor == DCK_PREDICT_MOMENTUM_PARAM ? 0.0 : c[3]);
    size_t i;

    if (update) {
        for (i = 0; i < n; i += 4) {
            __m256d q = dck_widen4(dck_narrow4(_mm256_mul_pd(c0, DCK_LOAD4(base, i))));
            DCK_STORE4(out, i, dck_sub_odd4(q, _mm256_mul_pd(c1, DCK_LOAD4(refs[0], i))));
        }
    } else if (predictor == DCK_PREDICT_MOMENTUM_PARAM) {
        for (i = 0; i < n; i += 4) {
            __m256d q = _mm256_sub_pd(_mm256_mul_pd(c0, DCK_LOAD4(base, i)),
                                      _mm256_mul_pd(c1, DCK_LOAD4(refs[0], i)));
            DCK_STORE4(out, i, _mm256_add_pd(q, _mm256_mul_pd(c2, DCK_LOAD4(refs[1], i))));
        }
    } else if (predictor == DCK_PREDICT_ADAM_V) {
        for (i = 0; i < n; i += 4) {
            __m256d g = _mm256_sub_pd(DCK_LOAD4(refs[0], i), _mm256_mul_pd(c0, DCK_LOAD4(refs[1], i)));
            g = _mm256_mul_pd(g, c1);
            g = _mm256_mul_pd(g, g);
            g = _mm256_mul_pd(g, c3);
            DCK_STORE4(out, i, _mm256_add_pd(_mm256_mul_pd(c2, DCK_LOAD4(base, i)), g));
        }
    } else {
        const __m256d c4 = _mm256_set1_pd(c[4]), c5 = _mm256_set1_pd(c[5]), c6 = _mm256_set1_pd(c[6]);
        for (i = 0; i < n; i += 4) {
            __m256d m = DCK_LOAD4(refs[0], i);
            __m256d g = _mm256_sub_pd(m, _mm256_mul_pd(c0, DCK_LOAD4(refs[1], i)));
            __m256d d, u;
            g = _mm256_mul_pd(g, c1);
            g = _mm256_mul_pd(g, g);
            g = _mm256_mul_pd(g, c3);
            d = _mm256_sqrt_pd(_mm256_add_pd(_mm256_mul_pd(c2, DCK_LOAD4(refs[2], i)), g));
            d = _mm256_add_pd(d, c6);
            u = _mm256_div_pd(m, d);
            u = _mm256_mul_pd(u, c5);
            DCK_STORE4(out, i, _mm256_sub_pd(_mm256_mul_pd(c4, DCK_LOAD4(base, i)), u));
        }
    }
}

/* Contract: the eight float32 bit patterns in b, subnormals replaced by zeros of their sign, widened to double. */
DCK_TARGET_AVX512 static inline __m512d dck_widen8(__m256i b)
{
    __mmask8 sub = _mm256_testn_epi32_mask(b, _mm256_set1_epi32(0x7f800000));
    b = _mm256_mask_and_epi32(b, sub, b, _mm256_set1_epi32((int)0x80000000u));
    return _mm512_cvtps_pd(_mm256_castsi256_ps(b));
}

/* Contract: the eight float32 at p (unaligned), as dck_widen8 widens them. */
DCK_TARGET_AVX512 static inline __m512d dck_load8(const uint8_t *p)
{
    return dck_widen8(_mm256_loadu_si256((const __m256i *)p));
}

/* Contract: the float32 bit patterns dck_f32_store gives q's eight values. */
DCK_TARGET_AVX512 static inline __m256i dck_narrow8(__m512d q)
{
    const __m512d sign = _mm512_set1_pd(-0.0);
    __mmask8 tiny = _mm512_cmp_pd_mask(_mm512_andnot_pd(sign, q), _mm512_set1_pd(0x1p-126), _CMP_LT_OQ);
    __m256i b;

    q = _mm512_mask_and_pd(q, tiny, q, sign);
    b = _mm256_castps_si256(_mm512_cvtpd_ps(q));
    return _mm256_mask_mov_epi32(b, _mm256_cmpgt_epi32_mask(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)),
                                                             _mm256_set1_epi32(0x7f800000)),
                                 _mm256_set1_epi32(0x7fc00000));
}

/* Contract: stores q at p (unaligned) as dck_f32_store does for each of its eight values. */
DCK_TARGET_AVX512 static inline void dck_store8(uint8_t *p, __m512d q)
{
    _mm256_storeu_si256((__m256i *)p, dck_narrow8(q));
}

/* Contract: the eight bfloat16 at p (unaligned) as dck_load8 reads their float32 widenings. */
DCK_TARGET_AVX512 static inline __m512d dck_load8_bf16(const uint8_t *p)
{
    return dck_widen8(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Contract: stores q at p (unaligned) as dck_store8 computes each float32, then rounded to bfloat16 as
 * dck_bf16_narrow does. */
DCK_TARGET_AVX512 static inline void dck_store8_bf16(uint8_t *p, __m512d q)
{
    __m256i b = dck_narrow8(q);

    b = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)),
                         _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
    _mm_storeu_si128((__m128i *)p, _mm256_cvtepi32_epi16(_mm256_srli_epi32(b, 16)));
}

/* Contract: dck_sub_odd of each of the eight pairs (a, b). */
DCK_TARGET_AVX512 static inline __m512d dck_sub_odd8(__m512d a, __m512d b)
{
    const __m512d sign = _mm512_set1_pd(-0.0);
    const __m512i one = _mm512_set1_epi64(1), zero = _mm512_setzero_si512();
    __m512d s = _mm512_sub_pd(a, b), bb = _mm512_sub_pd(s, a);
    __m512d e = _mm512_add_pd(_mm512_sub_pd(a, _mm512_sub_pd(s, bb)), _mm512_sub_pd(_mm512_xor_pd(b, sign), bb));
    __m512i sb = _mm512_castpd_si512(s);
    __mmask8 fix = _mm512_cmp_pd_mask(e, _mm512_setzero_pd(), _CMP_NEQ_OQ) &
                   _mm512_cmp_pd_mask(_mm512_andnot_pd(sign, s), _mm512_set1_pd(INFINITY), _CMP_LT_OQ) &
                   _mm512_testn_epi64_mask(sb, one);
    /* +1 where e has s's sign, else -1 */
    __m512i step = _mm512_or_si512(one, _mm512_sub_epi64(zero, _mm512_srli_epi64(
                                                               _mm512_xor_si512(sb, _mm512_castpd_si512(e)), 63)));

    return _mm512_castsi512_pd(_mm512_mask_add_epi64(sb, fix, sb, step));
}

/* Contract: as dck_predict_avx2 with n % 8 == 0, eight elements at a time: the same operations in the same order
 * (rounding to nearest, as every 512-bit operation here does without embedded rounding), so the same bits.
 * Only called when dck_have_avx512(). */
DCK_TARGET_AVX512 static void dck_predict_avx512(int predictor, const double *c, const uint8_t *base,
                                                 const uint8_t *const *refs, uint8_t *out, size_t n, int bf16)
{
    const int update = predictor == DCK_PREDICT_UPDATE_PARAM;
    const __m512d c0 = _mm512_set1_pd(c[0]), c1 = _mm512_set1_pd(c[1]), c2 = _mm512_set1_pd(update ? 0.0 : c[2]),
                  c3 = _mm512_set1_pd(update || predictor == DCK_PREDICT_MOMENTUM_PARAM ? 0.0 : c[3]);
    size_t i;

    if (update) {
        for (i = 0; i < n; i += 8) {
            __m512d q = dck_widen8(dck_narrow8(_mm512_mul_pd(c0, DCK_LOAD8(base, i))));
            DCK_STORE8(out, i, dck_sub_odd8(q, _mm512_mul_pd(c1, DCK_LOAD8(refs[0], i))));
        }
    } else if (predictor == DCK_PREDICT_MOMENTUM_PARAM) {
        for (i = 0; i < n; i += 8) {
            __m512d q = _mm512_sub_pd(_mm512_mul_pd(c0, DCK_LOAD8(base, i)),
                                      _mm512_mul_pd(c1, DCK_LOAD8(refs[0], i)));
            DCK_STORE8(out, i, _mm512_add_pd(q, _mm512_mul_pd(c2, DCK_LOAD8(refs[1], i))));
        }
    } else if (predictor == DCK_PREDICT_ADAM_V) {
        for (i = 0; i < n; i += 8) {
            __m512d g = _mm512_sub_pd(DCK_LOAD8(refs[0], i), _mm512_mul_pd(c0, DCK_LOAD8(refs[1], i)));
            g = _mm512_mul_pd(g, c1);
            g = _mm512_mul_pd(g, g);
            g = _mm512_mul_pd(g, c3);
            DCK_STORE8(out, i, _mm512_add_pd(_mm512_mul_pd(c2, DCK_LOAD8(base, i)), g));
        }
    } else {
        const __m512d c4 = _mm512_set1_pd(c[4]), c5 = _mm512_set1_pd(c[5]), c6 = _mm512_set1_pd(c[6]);
        for (i = 0; i < n; i += 8) {
            __m512d m = DCK_LOAD8(refs[0], i);
            __m512d g = _mm512_sub_pd(m, _mm512_mul_pd(c0, DCK_LOAD8(refs[1], i)));
            __m512d d, u;
            g = _mm512_mul_pd(g, c1);
            g = _mm512_mul_pd(g, g);
            g = _mm512_mul_pd(g, c3);
            d = _mm512_sqrt_pd(_mm512_add_pd(_mm512_mul_pd(c2, DCK_LOAD8(refs[2], i)), g));
            d = _mm512_add_pd(d, c6);
            u = _mm512_div_pd(m, d);
            u = _mm512_mul_pd(u, c5);
            DCK_STORE8(out, i, _mm512_sub_pd(_mm512_mul_pd(c4, DCK_LOAD8(base, i)), u));
        }
    }
}

/* update-param in float32 (dck_update_avx512, dck_update_avx2): where c0 and c1 are float32 numbers, c0*p1 and
 * c1*u are exact in double, so the definition's two roundings are a float32 multiply and a float32 fused
 * multiply-add (which rounds the exact q - c1*u once), except at the bottom of the normal range: the definition
 * flushes by the exact value, the hardware rounds to a subnormal (or, with flush-to-zero on, to zero) or up to
 * 2^-126. A group of elements where q or the result is at most 2^-126 in magnitude (q = 0 with p1 = 0 aside) is
 * therefore computed again by the double loops. */

/* Contract: 1 when c0 and c1 are float32 numbers (the float32 loops apply). */
static inline int dck_update_f32(const double *c)
{
    return (double)(float)c[0] == c[0] && (double)(float)c[1] == c[1];
}

/* Contract: as dck_predict_avx512 of update-param over elements [0, n), n % 16 == 0, sixteen at a time in float32
 * (above); c0 and c1 are float32 numbers. Only called when dck_have_avx512(). */
DCK_TARGET_AVX512 static void dck_update_avx512(const double *c, const uint8_t *base, const uint8_t *u, uint8_t *out,
                                                size_t n)
{
    const __m512 c0 = _mm512_set1_ps((float)c[0]), c1 = _mm512_set1_ps((float)c[1]), tiny = _mm512_set1_ps(0x1p-126f);
    const __m512i expo = _mm512_set1_epi32(0x7f800000), sign = _mm512_set1_epi32((int)0x80000000u);
    size_t i;

    for (i = 0; i < n; i += 16) {
        __m512i pb = _mm512_loadu_si512((const void *)(base + 4 * i)), ub = _mm512_loadu_si512((const void *)(u + 4 * i));
        __m512 q, r;
        __mmask16 slow;

        pb = _mm512_mask_and_epi32(pb, _mm512_testn_epi32_mask(pb, expo), pb, sign); /* subnormals: zeros */
        ub = _mm512_mask_and_epi32(ub, _mm512_testn_epi32_mask(ub, expo), ub, sign);
        q = _mm512_mul_ps(c0, _mm512_castsi512_ps(pb));
        r = _mm512_fnmadd_ps(c1, _mm512_castsi512_ps(ub), q);
        slow = (_mm512_cmp_ps_mask(_mm512_abs_ps(q), tiny, _CMP_LE_OQ) &
                _mm512_test_epi32_mask(pb, _mm512_set1_epi32(0x7fffffff))) |
               _mm512_cmp_ps_mask(_mm512_abs_ps(r), tiny, _CMP_LE_OQ);
        if (slow) {
            const uint8_t *refs[1] = {u + 4 * i};
            dck_predict_avx512(DCK_PREDICT_UPDATE_PARAM, c, base + 4 * i, refs, out + 4 * i, 16, 0);
            continue;
        }
        _mm512_storeu_si512((void *)(out + 4 * i),
                            _mm512_mask_mov_epi32(_mm512_castps_si512(r), _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q),
                                                  _mm512_set1_epi32(0x7fc00000)));
    }
}

/* Contract: as dck_predict_avx2 of update-param over elements [0, n), n % 8 == 0, eight at a time in float32
 * (above); c0 and c1 are float32 numbers. Only called when dck_have_fma(). */
DCK_TARGET_AVX2_FMA static void dck_update_avx2(const double *c, const uint8_t *base, const uint8_t *u, uint8_t *out,
                                                size_t n)
{
    const __m256 c0 = _mm256_set1_ps((float)c[0]), c1 = _mm256_set1_ps((float)c[1]), tiny = _mm256_set1_ps(0x1p-126f);
    const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i expo = _mm256_set1_epi32(0x7f800000), sign = _mm256_set1_epi32((int)0x80000000u);
    const __m256i zero = _mm256_setzero_si256();
    size_t i;

    for (i = 0; i < n; i += 8) {
        __m256i pb = _mm256_loadu_si256((const __m256i *)(base + 4 * i));
        __m256i ub = _mm256_loadu_si256((const __m256i *)(u + 4 * i));
        __m256 q, r, slow;

        pb = _mm256_blendv_epi8(pb, _mm256_and_si256(pb, sign), _mm256_cmpeq_epi32(_mm256_and_si256(pb, expo), zero));
        ub = _mm256_blendv_epi8(ub, _mm256_and_si256(ub, sign), _mm256_cmpeq_epi32(_mm256_and_si256(ub, expo), zero));
        q = _mm256_mul_ps(c0, _mm256_castsi256_ps(pb));
        r = _mm256_fnmadd_ps(c1, _mm256_castsi256_ps(ub), q);
        slow = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(_mm256_and_ps(q, mag), tiny, _CMP_LE_OQ),
                                          _mm256_cmp_ps(_mm256_castsi256_ps(pb), _mm256_setzero_ps(), _CMP_NEQ_OQ)),
                            _mm256_cmp_ps(_mm256_and_ps(r, mag), tiny, _CMP_LE_OQ));
        if (_mm256_movemask_ps(slow)) {
            const uint8_t *refs[1] = {u + 4 * i};
            dck_predict_avx2(DCK_PREDICT_UPDATE_PARAM, c, base + 4 * i, refs, out + 4 * i, 8, 0);
            continue;
        }
        _mm256_storeu_si256((__m256i *)(out + 4 * i),
                            _mm256_blendv_epi8(_mm256_castps_si256(r), _mm256_set1_epi32(0x7fc00000),
                                               _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q))));
    }
}
#endif

/* Contract: computes elements [0, done) of the prediction with the widest vector loops the CPU has (and
 * dck_use_simd allows) and returns done: n rounded down to their width, 0 without them. predictor is a float32
 * one (1-3, 6); bf16: the elements are bfloat16 (dck_predict_bf16's result). */
static size_t dck_predict_vector(int predictor, const double *c, const uint8_t *base, const uint8_t *const *refs,
                                 uint8_t *out, size_t n, int bf16)
{
    size_t done = 0;

#if DCK_AVX2
    int avx512 = dck_have_avx512();

    if (predictor == DCK_PREDICT_UPDATE_PARAM && dck_update_f32(c) && (avx512 || dck_have_fma())) {
        done = n - n % 16;
        if (avx512)
            dck_update_avx512(c, base, refs[0], out, done);
        else
            dck_update_avx2(c, base, refs[0], out, done);
    } else if (avx512) {
        done = n - n % 8;
        dck_predict_avx512(predictor, c, base, refs, out, done, bf16);
    } else if (dck_have_avx2()) {
        done = n - n % 4;
        dck_predict_avx2(predictor, c, base, refs, out, done, bf16);
    }
#else
    (void)predictor, (void)c, (void)base, (void)refs, (void)out, (void)n, (void)bf16;
#endif
    return done;
}

/* Contract: dck_predict of a float32 predictor (1-3, 6) over n elements, inputs and arguments already checked. */
static void dck_predict_f32(int predictor, const double *c, const uint8_t *base, const uint8_t *const *refs,
                            uint8_t *out, size_t n)
{
    size_t done = dck_predict_vector(predictor, c, base, refs, out, n, 0);

    dck_predict_portable(predictor, c, base, refs, out, done, n - done);
}

/* Elements per block of a bfloat16 prediction: its inputs are widened into float32 blocks on the stack, predicted
 * as float32 and narrowed back (5 blocks of 2 KiB). */
#define DCK_BF16_BLOCK 512

/* Contract: dst[0..4n) = the n little-endian bfloat16 values at src widened exactly to little-endian float32 (16
 * zero bits appended); n <= DCK_BF16_BLOCK. Staged through aligned arrays so the loop vectorizes. */
static void dck_bf16_widen(uint8_t *dst, const uint8_t *src, size_t n)
{
    uint16_t h[DCK_BF16_BLOCK];
    uint32_t w[DCK_BF16_BLOCK];
    size_t i;

    memcpy(h, src, 2 * n);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (i = 0; i < n; i++)
        h[i] = __builtin_bswap16(h[i]);
#endif
    for (i = 0; i < n; i++)
        w[i] = (uint32_t)h[i] << 16;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (i = 0; i < n; i++)
        w[i] = __builtin_bswap32(w[i]);
#endif
    memcpy(dst, w, 4 * n);
}

/* Contract: dst[0..2n) = the n little-endian float32 values at src rounded to bfloat16: to nearest, ties to even,
 * on the 16 bits dropped (the largest finite floats round to infinity); a NaN becomes 0x7FC0; n <=
 * DCK_BF16_BLOCK. */
static void dck_bf16_narrow(uint8_t *dst, const uint8_t *src, size_t n)
{
    uint32_t w[DCK_BF16_BLOCK];
    uint16_t h[DCK_BF16_BLOCK];
    size_t i;

    memcpy(w, src, 4 * n);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (i = 0; i < n; i++)
        w[i] = __builtin_bswap32(w[i]);
#endif
    for (i = 0; i < n; i++) {
        uint32_t b = w[i];
        h[i] = (uint16_t)(((b & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (i = 0; i < n; i++)
        h[i] = __builtin_bswap16(h[i]);
#endif
    memcpy(dst, h, 2 * n);
}

/* Contract: dck_predict of a bfloat16 predictor (4, 5) over n elements, inputs and arguments already checked:
 * float32 predictor - DCK_PREDICT_BF16 over the widened inputs, each result narrowed (dck_bf16_narrow). The
 * vector loops load and store bfloat16 themselves; the rest (all of it without them) is widened into float32
 * blocks on the stack. */
static void dck_predict_bf16(int predictor, const double *c, const uint8_t *base, const uint8_t *const *refs,
                             int nrefs, uint8_t *out, size_t n)
{
    uint8_t wb[4 * DCK_BF16_BLOCK], wr[3][4 * DCK_BF16_BLOCK], wo[4 * DCK_BF16_BLOCK];
    const uint8_t *pr[3] = {wr[0], wr[1], wr[2]};
    size_t at = dck_predict_vector(predictor - DCK_PREDICT_BF16, c, base, refs, out, n, 1);
    int k;

    for (; at < n; at += DCK_BF16_BLOCK) {
        size_t m = n - at < DCK_BF16_BLOCK ? n - at : DCK_BF16_BLOCK;
        dck_bf16_widen(wb, base + 2 * at, m);
        for (k = 0; k < nrefs; k++)
            dck_bf16_widen(wr[k], refs[k] + 2 * at, m);
        dck_predict_f32(predictor - DCK_PREDICT_BF16, c, wb, pr, wo, m);
        dck_bf16_narrow(out + 2 * at, wo, m);
    }
}

int dck_predict(int predictor, const double *c, int nc, const uint8_t *base, const uint8_t *const *refs, int nrefs,
                uint8_t *out, size_t len)
{
    int want_nc, want_nrefs, k;
    size_t size;

    if (c == NULL || refs == NULL || !dck_predictor_shape(predictor, &want_nc, &want_nrefs, &size) ||
        nc != want_nc || nrefs != want_nrefs || len % size != 0)
        return DCK_EINVAL;
    if (len > 0 && (base == NULL || out == NULL))
        return DCK_EINVAL;
    for (k = 0; k < nrefs && len > 0; k++)
        if (refs[k] == NULL)
            return DCK_EINVAL;
    if (size == 2)
        dck_predict_bf16(predictor, c, base, refs, nrefs, out, len / 2);
    else
        dck_predict_f32(predictor, c, base, refs, out, len / 4);
    return 0;
}
