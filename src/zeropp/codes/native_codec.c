/* quant's symmetric block code on CPU in one pass per block: the same bytes and values as the
 * torch path of zeropp/codes/quant.py ([Note: block code], [Note: non-finite blocks], [Note: packed
 * layout]), at 2, 4 and 8 bits, from and to fp32 or bf16 rows.
 *
 * Compiled on first use by zeropp/codes/native.py (cc -O3 -march=native, no fast-math: every float
 * operation is the IEEE one the torch path performs, in the same order) and called through
 * ctypes. A row is one chunk: `numel` elements, its blocks of `block_size`, the last one
 * zero-padded inside the computation; its codes cover the real elements rounded up to 4 bytes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DTYPE_FP32 = 0, DTYPE_BF16 = 1 };
#define MAX_BLOCK 65536

static float bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static uint16_t fp32_to_bf16(float value) { /* round to nearest even; NaN to 0xFFFF, as torch's vectorised cast */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if (value != value) return 0xFFFF;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* The block's scale: absmax / qmax with quant._block_scales' special cases. The absmax is taken
 * on the bit patterns of |x|: for non-negative floats their order as unsigned integers is the
 * order of the values, with inf above every finite value and NaN above inf. */
static float block_scale(const float *x, int64_t n, int qmax) {
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], 4);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    if (top >= 0x7F800000u) return NAN; /* a NaN or an inf in the block */
    float absmax;
    memcpy(&absmax, &top, 4);
    float scale = absmax / (float)qmax;
    if (scale < 1.17549435e-38f && absmax > 0.0f) scale = nextafterf(scale, INFINITY);
    if (isinf(scale * (float)qmax)) scale = nextafterf(scale, 0.0f);
    return scale;
}

/* Codes of one block, as quant._block_codes: round(x / scale) to nearest even, 0 for a zero or
 * non-finite block, written as int8 into `codes` (n of them, then zeros up to `padded`). */
static void block_codes(const float *x, int64_t n, int64_t padded, float scale, int8_t *codes) {
    float divisor = scale > 0.0f ? scale : INFINITY;
    for (int64_t i = 0; i < n; i++) {
        float code = rintf(x[i] / divisor);
        codes[i] = (int8_t)(code == code ? code : 0.0f);
    }
    for (int64_t i = n; i < padded; i++) codes[i] = 0;
}

static void store_codes(const int8_t *codes, int64_t count, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, codes, (size_t)count);
    } else if (bits == 4) {
        for (int64_t i = 0; i < count / 2; i++)
            out[i] = (uint8_t)((codes[2 * i] + 8) | ((codes[2 * i + 1] + 8) << 4));
    } else { /* 2 bits: four fields per byte, the first in the lowest bits */
        for (int64_t i = 0; i < count / 4; i++)
            out[i] = (uint8_t)((codes[4 * i] + 2) | ((codes[4 * i + 1] + 2) << 2) |
                               ((codes[4 * i + 2] + 2) << 4) | ((codes[4 * i + 3] + 2) << 6));
    }
}

static void encode_row(const void *row, int dtype, int64_t numel, int64_t block_size, int bits,
                       uint8_t *data, int64_t data_bytes, float *scales) {
    static _Thread_local float staged[MAX_BLOCK];
    static _Thread_local int8_t codes[MAX_BLOCK];
    int qmax = (1 << (bits - 1)) - 1;
    int64_t covered = data_bytes * 8 / bits; /* codes stored: the real elements rounded up to 4 bytes */
    for (int64_t start = 0, b = 0; start < numel; start += block_size, b++) {
        int64_t n = numel - start < block_size ? numel - start : block_size;
        const float *x;
        if (dtype == DTYPE_FP32) {
            x = (const float *)row + start;
        } else {
            const uint16_t *h = (const uint16_t *)row + start;
            for (int64_t i = 0; i < n; i++) staged[i] = bf16_to_fp32(h[i]);
            x = staged;
        }
        int64_t stored = covered - start < block_size ? covered - start : block_size;
        scales[b] = block_scale(x, n, qmax);
        if (bits == 8) { /* the int8 codes are the bytes */
            block_codes(x, n, stored, scales[b], (int8_t *)data + start);
        } else {
            block_codes(x, n, stored, scales[b], codes);
            store_codes(codes, stored, bits, data + start * bits / 8);
        }
    }
}

/* code * scale of the block's first n elements, whole bytes at a time, then the fields left. */
static void decode_block(const uint8_t *bytes, int64_t n, int bits, float scale, float *values) {
    if (bits == 8) {
        for (int64_t i = 0; i < n; i++) values[i] = (float)(int8_t)bytes[i] * scale;
        return;
    }
    int per_byte = 8 / bits, mask = (1 << bits) - 1, offset = 1 << (bits - 1);
    int64_t whole = n / per_byte;
    if (bits == 4) {
        for (int64_t i = 0; i < whole; i++) {
            values[2 * i] = (float)((bytes[i] & 0xF) - 8) * scale;
            values[2 * i + 1] = (float)((bytes[i] >> 4) - 8) * scale;
        }
    } else {
        for (int64_t i = 0; i < whole; i++) {
            values[4 * i] = (float)((bytes[i] & 0x3) - 2) * scale;
            values[4 * i + 1] = (float)(((bytes[i] >> 2) & 0x3) - 2) * scale;
            values[4 * i + 2] = (float)(((bytes[i] >> 4) & 0x3) - 2) * scale;
            values[4 * i + 3] = (float)((bytes[i] >> 6) - 2) * scale;
        }
    }
    for (int64_t i = whole * per_byte; i < n; i++)
        values[i] = (float)(((bytes[i / per_byte] >> (bits * (i % per_byte))) & mask) - offset) * scale;
}

static void decode_row(const uint8_t *data, const float *scales, int64_t numel, int64_t block_size, int bits,
                       void *row, int dtype) {
    static _Thread_local float values[MAX_BLOCK];
    for (int64_t start = 0, b = 0; start < numel; start += block_size, b++) {
        int64_t n = numel - start < block_size ? numel - start : block_size;
        const uint8_t *bytes = data + start * bits / 8;
        if (dtype == DTYPE_FP32) {
            decode_block(bytes, n, bits, scales[b], (float *)row + start);
        } else {
            decode_block(bytes, n, bits, scales[b], values);
            uint16_t *h = (uint16_t *)row + start;
            for (int64_t i = 0; i < n; i++) h[i] = fp32_to_bf16(values[i]);
        }
    }
}

/* Row-major batches: `num_rows` rows, each argument's rows `*_stride` elements of its own type apart. */
void zeropp_encode_rows(const void *rows, int64_t row_stride, int dtype, int64_t num_rows, int64_t numel,
                        int64_t block_size, int bits, uint8_t *data, int64_t data_stride, int64_t data_bytes,
                        float *scales, int64_t scales_stride) {
    int64_t itemsize = dtype == DTYPE_FP32 ? 4 : 2;
    for (int64_t r = 0; r < num_rows; r++)
        encode_row((const char *)rows + r * row_stride * itemsize, dtype, numel, block_size, bits,
                   data + r * data_stride, data_bytes, scales + r * scales_stride);
}

void zeropp_decode_rows(const uint8_t *data, int64_t data_stride, const float *scales, int64_t scales_stride,
                        int64_t num_rows, int64_t numel, int64_t block_size, int bits, void *rows,
                        int64_t row_stride, int dtype) {
    int64_t itemsize = dtype == DTYPE_FP32 ? 4 : 2;
    for (int64_t r = 0; r < num_rows; r++)
        decode_row(data + r * data_stride, scales + r * scales_stride, numel, block_size, bits,
                   (char *)rows + r * row_stride * itemsize, dtype);
}

/* A chunk codec's payload rows in one call (zeropp/codes/codec.py, ChunkCodec): each row of `chunks`
 * is a run of segments, each quantized on its own (its codes, then its blocks' fp32 scales) or
 * copied as it is, every segment starting 4-byte aligned with zeros in the gaps. `table` holds
 * five int64 per segment: element offset in the row, elements, byte offset in the payload,
 * bytes before alignment, bits (0: copied). */
void zeropp_encode_chunks(const void *chunks, int64_t chunk_stride, int dtype, int64_t num_rows,
                          const int64_t *table, int64_t num_segments, int64_t block_size, uint8_t *out,
                          int64_t out_stride) {
    int64_t itemsize = dtype == DTYPE_FP32 ? 4 : 2;
    for (int64_t r = 0; r < num_rows; r++) {
        const char *row = (const char *)chunks + r * chunk_stride * itemsize;
        uint8_t *payload = out + r * out_stride;
        for (int64_t s = 0; s < num_segments; s++) {
            const int64_t *segment = table + 5 * s;
            int64_t offset = segment[0], numel = segment[1], byte = segment[2], nbytes = segment[3];
            int bits = (int)segment[4];
            if (bits == 0) {
                memcpy(payload + byte, row + offset * itemsize, (size_t)nbytes);
            } else if (numel > 0) {
                int64_t data_bytes = (numel * bits + 31) / 32 * 4;
                encode_row(row + offset * itemsize, dtype, numel, block_size, bits, payload + byte, data_bytes,
                           (float *)(payload + byte + data_bytes));
            }
            memset(payload + byte + nbytes, 0, (size_t)((4 - nbytes % 4) % 4));
        }
    }
}

void zeropp_decode_chunks(const uint8_t *packed, int64_t packed_stride, int64_t num_rows, const int64_t *table,
                          int64_t num_segments, int64_t block_size, void *out, int64_t out_stride, int dtype) {
    int64_t itemsize = dtype == DTYPE_FP32 ? 4 : 2;
    for (int64_t r = 0; r < num_rows; r++) {
        const uint8_t *payload = packed + r * packed_stride;
        char *row = (char *)out + r * out_stride * itemsize;
        for (int64_t s = 0; s < num_segments; s++) {
            const int64_t *segment = table + 5 * s;
            int64_t offset = segment[0], numel = segment[1], byte = segment[2], nbytes = segment[3];
            int bits = (int)segment[4];
            if (bits == 0) {
                memcpy(row + offset * itemsize, payload + byte, (size_t)nbytes);
            } else if (numel > 0) {
                int64_t data_bytes = (numel * bits + 31) / 32 * 4;
                decode_row(payload + byte, (const float *)(payload + byte + data_bytes), numel, block_size, bits,
                           row + offset * itemsize, dtype);
            }
        }
    }
}
