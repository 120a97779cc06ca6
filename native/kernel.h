/*
 * deltackpt native chunk kernel: the inner loops under deltackpt.kernel.
 *
 * Where it sits: `native/_kernel.pyx` adapts Python buffers to these functions and calls them with the GIL
 * released; policy (chunk sizes, thread counts, which codec runs) stays in Python. Every function here returns
 * results bit-identical to the scalar reference in `deltackpt/_pykernel.py`; the tests check that.
 *
 * Conventions shared by all functions:
 * - Buffers are raw bytes. `len` counts bytes. A pointer may be NULL only when its length is 0.
 * - Outputs do not overlap inputs: the adapter reads an input that a plane function's output overlaps from a
 *   copy, and refuses an overlap for decode_frames and predict. (dck_decode_frames itself merges in place,
 *   dst being also the XOR base, which its merge loops allow.)
 * - `threads` <= 1, or an input too small to be worth splitting (under DCK_MIN_BYTES_PER_THREAD bytes per
 *   thread), runs inline on the calling thread. Otherwise the work is split statically into contiguous ranges,
 *   one per POSIX thread, the calling thread taking the first; no scratch memory is shared between threads and
 *   each thread writes a disjoint part of the output. A thread that cannot be created has its range run inline,
 *   so results never depend on `threads`.
 * - Return value: 0 on success, DCK_EINVAL when an argument is out of its domain (nothing is written then), for
 *   every function but dck_chunk_count (returns a count of chunks) and dck_use_simd (returns the previous
 *   level); dck_decode_frames has error codes of its own besides.
 */
#ifndef DELTACKPT_KERNEL_H
#define DELTACKPT_KERNEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Size of one digest in bytes (XXH3-128, canonical big-endian form). */
#define DCK_DIGEST_SIZE 16
/* Error code: an argument is outside its domain. */
#define DCK_EINVAL (-1)
/* Smallest share of the input, in bytes, that justifies one more thread. */
#define DCK_MIN_BYTES_PER_THREAD ((size_t)256 * 1024)
/* Upper bound on the number of threads one call uses. */
#define DCK_MAX_THREADS 64

/*
 * Number of chunks a buffer of `len` bytes splits into at `chunk_size`: ceil(len / chunk_size).
 * Requires chunk_size > 0 (returns 0 otherwise). An empty buffer has no chunks.
 */
size_t dck_chunk_count(size_t len, size_t chunk_size);

/*
 * Chunk digests and zero flags, in one pass over memory.
 *
 * Inputs:  buf[0..len), chunk_size > 0, threads (any value; see conventions).
 * Outputs: for each chunk c in [0, n) with n = dck_chunk_count(len, chunk_size), chunk c being
 *          buf[c*chunk_size .. min((c+1)*chunk_size, len)) (only the last may be short):
 *            digests[16*c .. 16*c+16) = XXH128_canonicalFromHash(XXH3_128bits(chunk)), i.e. the bytes
 *                                       xxhash.xxh3_128_digest(chunk) returns;
 *            zero[c] = 1 if every byte of the chunk is 0, else 0.
 *          `digests` holds n*16 bytes, `zero` n bytes.
 * Memory is read once: each chunk's leading zero run is found first (an early-exit scan, a few bytes long for
 * ordinary data) and is hashed from a static zero block instead of being read again; the rest of the chunk is
 * then hashed from the buffer. All-zero chunks of one length share one digest computation per thread.
 * Returns DCK_EINVAL when chunk_size == 0 or a needed pointer is NULL.
 */
int dck_chunk_digests(const uint8_t *buf, size_t len, size_t chunk_size, uint8_t *digests, uint8_t *zero,
                      int threads);

/*
 * Digest of a whole buffer: out[0..16) = canonical XXH3-128 of buf[0..len). Single-threaded.
 * Returns DCK_EINVAL when out is NULL, or buf is NULL with len > 0.
 */
int dck_digest(const uint8_t *buf, size_t len, uint8_t out[DCK_DIGEST_SIZE]);

/*
 * Byte-plane split. width w in {1, 2, 4, 8}; m = len / w elements.
 * Output: dst[k*m + i] = src[i*w + k] for i < m, k < w; dst[m*w + t] = src[m*w + t] for the len % w tail.
 * Width 1 is a copy. Returns DCK_EINVAL for any other width.
 */
int dck_split_planes(const uint8_t *src, uint8_t *dst, size_t len, int width, int threads);

/*
 * Byte-plane merge, the inverse of dck_split_planes: dst[i*w + k] = src[k*m + i]; the tail is copied.
 * dck_merge_planes(dck_split_planes(x)) == x for every width and length.
 */
int dck_merge_planes(const uint8_t *src, uint8_t *dst, size_t len, int width, int threads);

/*
 * XOR fused with split: dst = split_planes(src XOR base), in one pass and without a temporary buffer.
 * base has len bytes. dst[k*m + i] = src[i*w + k] ^ base[i*w + k]; tail: dst[t] = src[t] ^ base[t].
 */
int dck_xor_split_planes(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width,
                         int threads);

/*
 * Merge fused with XOR: dst = merge_planes(src) XOR base, in one pass and without a temporary buffer.
 * base has len bytes. dst[i*w + k] = src[k*m + i] ^ base[i*w + k]; tail: dst[t] = src[t] ^ base[t].
 * dck_merge_planes_xor(dck_xor_split_planes(x, b), b) == x.
 */
int dck_merge_planes_xor(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width,
                         int threads);

/* ------------------------------------------------------------------------------------------------------------
 * Frame decoding (the load path). Frame layout and codec ids are those of deltackpt/codec.py and docs/format.md.
 * ---------------------------------------------------------------------------------------------------------- */

/* Bytes of a frame header; the payload follows it. Bytes [0, 56) and the payload are covered by the checksum
 * stored little-endian at [56, 64). */
#define DCK_FRAME_HEADER 64
#define DCK_FRAME_CHECKED 56
/* Codec ids. */
#define DCK_CODEC_RAW 0
#define DCK_CODEC_ZSTD 1
#define DCK_CODEC_PLANES_ZSTD 2
#define DCK_CODEC_DELTA 3
#define DCK_CODEC_PREDICTED 4
/* Error codes of dck_decode_frames (besides DCK_EINVAL). */
#define DCK_ECHECKSUM (-2) /* a frame's checksum does not match its bytes */
#define DCK_EPAYLOAD (-3)  /* a payload does not decode to exactly raw_len bytes */
#define DCK_EDIGEST (-4)   /* the decoded bytes do not match the expected digest */
#define DCK_ENOMEM (-5)    /* scratch memory could not be allocated */

/*
 * Decode one chunk by applying n frames in order to dst, then check its digest. Single-threaded; safe to call
 * from many threads at once (each thread keeps its own zstd context and a scratch buffer of raw_len bytes; a
 * scratch buffer over 16 MiB is freed when the call returns).
 *
 * Inputs:  frames[k] points at frame k's bytes (header and payload), frame_lens[k] is its whole length,
 *          DCK_FRAME_HEADER + the payload length S (bytes past the frame would be taken for payload and fail the
 *          checksum); codecs[k] and widths[k] (1, 2, 4 or 8) are the frame's header fields, which the caller
 *          has parsed and validated (magic, version, lengths, identity). raw_len is every frame's raw length and
 *          dst's size. digest: the expected canonical XXH3-128 of the result, or NULL to skip that check.
 * Effect:  frame k, in order k = 0 .. n-1, must first pass its checksum: XXH3-64 over bytes [0, 56) followed by
 *          the payload [64, frame_lens[k]) equals the u64 at [56, 64) (else DCK_ECHECKSUM). Then its payload
 *          P (the decoded bytes, exactly raw_len of them: RAW is the payload itself and its length must be
 *          raw_len; the others are one zstd frame declaring content size raw_len, decoded in one pass into
 *          raw_len bytes, so no window buffer is allocated and the window it declares is not checked; a
 *          PREDICTED payload first holds a u32 little-endian length L and L bytes of prediction record that are
 *          skipped here, L + 4 <= payload length; else DCK_EPAYLOAD) is applied:
 *            RAW, ZSTD:    dst = P
 *            PLANES_ZSTD:  dst = merge_planes(P, width)
 *            DELTA:        dst = merge_planes(P, width) XOR dst   (dst holds the base chunk on entry: the caller
 *                                                                 puts it there, or an earlier frame decoded it)
 *            PREDICTED:    dst = merge_planes(P, width) XOR dst   (dst holds the prediction, which the caller
 *                                                                 computed from the record; only as frame 0)
 *          A chain (keyframe, delta, delta, ...) decodes to the newest chunk this way. Finally, with a digest,
 *          the result must hash to it (else DCK_EDIGEST).
 * Returns: 0; or an error code with *bad set to the index of the failing frame (n for DCK_EDIGEST). On error
 *          dst holds unspecified bytes. DCK_EINVAL (nothing read): n < 1, a NULL pointer, an unknown codec or
 *          width, a PREDICTED frame other than frame 0, or a frame shorter than its header.
 */
int dck_decode_frames(const uint8_t *const *frames, const size_t *frame_lens, const int *codecs, const int *widths,
                      int n, uint8_t *dst, size_t raw_len, const uint8_t *digest, int *bad);

/* A prediction for dck_decode_predicted: dck_predict's arguments but the output. */
struct dck_prediction {
    int predictor;
    const double *c;
    int nc;
    const uint8_t *base;
    const uint8_t *const *refs;
    int nrefs;
};

/*
 * dck_decode_frames with the prediction computed by the kernel: the same result, status and *bad as
 * dck_predict(pred->predictor, pred->c, pred->nc, pred->base, pred->refs, pred->nrefs, dst, raw_len) followed by
 * dck_decode_frames(frames, ..., dst, raw_len, digest, bad), whatever dst held on entry. The prediction is
 * written a few KiB at a time just before the residual is XORed onto them (one pass over dst instead of two),
 * after frame 0's checksum and payload checked out. Requires codecs[0] == DCK_CODEC_PREDICTED, raw_len a whole
 * number of the predictor's elements, pred's fields as dck_predict requires them (the caller checked the
 * coefficients), and dst not overlapping base or a ref; DCK_EINVAL otherwise (nothing written; pred NULL included).
 */
int dck_decode_predicted(const uint8_t *const *frames, const size_t *frame_lens, const int *codecs,
                         const int *widths, int n, const struct dck_prediction *pred, uint8_t *dst, size_t raw_len,
                         const uint8_t *digest, int *bad);

/* ------------------------------------------------------------------------------------------------------------
 * Predictions (predicted frames, codec 4). The arithmetic is part of the on-disk format: docs/format.md, 8a.
 * ---------------------------------------------------------------------------------------------------------- */

#define DCK_PREDICT_ADAM_V 1     /* refs m, m1; base v1; coefficients c0..c3 */
#define DCK_PREDICT_ADAM_PARAM 2 /* refs m, m1, v1; base p1; coefficients c0..c6 */
#define DCK_PREDICT_MOMENTUM_PARAM 3 /* refs b, b1; base p1; coefficients c0..c2 */
/* The first two over bfloat16 elements: DCK_PREDICT_BF16 + the float32 predictor's id. */
#define DCK_PREDICT_BF16 3
#define DCK_PREDICT_ADAM_V_BF16 4
#define DCK_PREDICT_ADAM_PARAM_BF16 5
#define DCK_PREDICT_UPDATE_PARAM 6 /* ref u; base p1; coefficients c0, c1 (a float32 predictor) */

/*
 * Compute a prediction of len bytes (len % 4 == 0, len / 4 little-endian float32 values; for the bfloat16
 * predictors len % 2 == 0, len / 2 little-endian bfloat16 values) into out.
 *
 * Inputs:  predictor (DCK_PREDICT_*), its nc coefficients c (4, 7, 3 or 2; each 0 or of magnitude in
 *          [2^-60, 2^60], which the caller checked), base and refs[0..nrefs) (2, 3, 2 or 1), each len bytes of the
 *          elements.
 * Effect:  for every element i, with every input x read as float32 and widened exactly to double after a
 *          subnormal x is replaced by a zero of the same sign:
 *            adam-v:     g = m - c0*m1; g = g*c1; g = g*g; g = g*c3; w = c2*v1; w = w + g; q = w
 *            adam-param: w as above from (m, m1, v1); d = sqrt(w); d = d + c6; u = m / d; u = u*c5;
 *                        q = c4*p1; q = q - u
 *            momentum-param: q = c0*p1; u = c1*b; q = q - u; u = c2*b1; q = q + u
 *            update-param: q = c0*p1, then q rounded to float32 as a result is (below) and widened back;
 *                        t = c1*u; q = q - t rounded once to float32: the exact difference, not its double
 *                        (a float32 fused multiply-add when c0 and c1 are float32 numbers, as torch computes
 *                        p.mul_(c0).add_(u, alpha=-c1))
 *          each step one correctly rounded double operation in this order (the build passes
 *          -ffp-contract=off: no fused multiply-add; update-param's last step is exact arithmetic, not an FMA
 *          instruction). out[i] = 0x7FC00000 if q is NaN; a zero with q's sign if
 *          |q| < 2^-126; else (float)q, rounded to nearest. Within the coefficient bounds no double
 *          intermediate is subnormal, so the result does not depend on flush-to-zero or denormals-are-zero
 *          modes; rounding must be to nearest (the default).
 *          A bfloat16 predictor (DCK_PREDICT_BF16 + p) widens each input exactly to float32 (16 zero bits
 *          appended), computes float32 predictor p's out[i] from those as above, and rounds it to bfloat16: to
 *          nearest, ties to even, on the 16 bits dropped (0x7FC00000 becomes 0x7FC0).
 * Returns: 0; DCK_EINVAL for an unknown predictor, a wrong nc or nrefs, len not a whole number of elements, or
 *          a NULL pointer with len > 0. Single-threaded (callers decode many chunks in parallel); no allocation.
 */
int dck_predict(int predictor, const double *c, int nc, const uint8_t *base, const uint8_t *const *refs, int nrefs,
                uint8_t *out, size_t len);

/*
 * Vector loops chosen at run time (x86-64: AVX2 for XXH3's long-input and streaming loops, AVX-512 or AVX2 for
 * dck_predict, as the CPU has them). level limits every later call: DCK_SIMD_NONE to the portable loops,
 * DCK_SIMD_AVX2 to those and AVX2, DCK_SIMD_ALL (the default) to any; other values are clamped to that range.
 * Results are the same bits at every level (tests compare them). Returns the previous level. Not to be called
 * while other threads are inside kernel calls.
 */
#define DCK_SIMD_NONE 0
#define DCK_SIMD_AVX2 1
#define DCK_SIMD_ALL 2
int dck_use_simd(int level);

#ifdef __cplusplus
}
#endif

#endif /* DELTACKPT_KERNEL_H */
