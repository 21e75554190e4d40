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

typedef struct GroupedCode GroupedCode;
static void encode_grouped_row(const void *row, int dtype, int64_t numel, int64_t block_size, const GroupedCode *code,
                               uint8_t *data, int64_t data_bytes, uint8_t *params);
static void decode_grouped_row(const uint8_t *data, const uint8_t *params, int64_t numel, int64_t block_size,
                               const GroupedCode *code, void *row, int dtype);

/* A chunk codec's payload rows in one call (zeropp/codes/codec.py, ChunkCodec): each row of `chunks`
 * is a run of segments, each quantized on its own (its codes, then its blocks' fp32 scales) or
 * copied as it is, every segment starting 4-byte aligned with zeros in the gaps. `table` holds
 * five int64 per segment: element offset in the row, elements, byte offset in the payload,
 * bytes before alignment, bits (0: copied).
 * Both codes walk a payload alike: `code` NULL is the plain block code, else the grouped-scale one. */
static void encode_chunks(const void *chunks, int64_t chunk_stride, int dtype, int64_t num_rows, const int64_t *table,
                          int64_t num_segments, int64_t block_size, const GroupedCode *code, uint8_t *out,
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
                if (code)
                    encode_grouped_row(row + offset * itemsize, dtype, numel, block_size, code, payload + byte,
                                       data_bytes, payload + byte + data_bytes);
                else
                    encode_row(row + offset * itemsize, dtype, numel, block_size, bits, payload + byte, data_bytes,
                               (float *)(payload + byte + data_bytes));
            }
            memset(payload + byte + nbytes, 0, (size_t)((4 - nbytes % 4) % 4));
        }
    }
}

static void decode_chunks(const uint8_t *packed, int64_t packed_stride, int64_t num_rows, const int64_t *table,
                          int64_t num_segments, int64_t block_size, const GroupedCode *code, void *out,
                          int64_t out_stride, int dtype) {
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
                if (code)
                    decode_grouped_row(payload + byte, payload + byte + data_bytes, numel, block_size, code,
                                       row + offset * itemsize, dtype);
                else
                    decode_row(payload + byte, (const float *)(payload + byte + data_bytes), numel, block_size, bits,
                               row + offset * itemsize, dtype);
            }
        }
    }
}

void zeropp_encode_chunks(const void *chunks, int64_t chunk_stride, int dtype, int64_t num_rows,
                          const int64_t *table, int64_t num_segments, int64_t block_size, uint8_t *out,
                          int64_t out_stride) {
    encode_chunks(chunks, chunk_stride, dtype, num_rows, table, num_segments, block_size, NULL, out, out_stride);
}

void zeropp_decode_chunks(const uint8_t *packed, int64_t packed_stride, int64_t num_rows, const int64_t *table,
                          int64_t num_segments, int64_t block_size, void *out, int64_t out_stride, int dtype) {
    decode_chunks(packed, packed_stride, num_rows, table, num_segments, block_size, NULL, out, out_stride, dtype);
}

/* qgZ's grouped-scale gradient code (zeropp/codes/gradcode.py, [Note: grouped scales], [Note:
 * normal levels]), rounding to nearest, unrotated: the same bytes and values as the one-pass torch
 * path of zeropp/codes/codec.py. A unit is GROUP blocks sharing one fp32 scale `top`; each block
 * keeps a byte k, its scale top * scale_levels[k]. `levels` (2**bits values in units of the scale)
 * and `midpoints` (2**bits - 1, ascending) are the normal levels, or NULL for evenly spaced ones
 * (scale absmax / qmax). With `search_steps` > 1 a whole block also tries the next scale codes
 * below its first and keeps the one of least squared error (summed in double, as the torch path
 * sums it) while the scale times `reach` still covers the block's own scale. */
#define GROUP 16
#define NUM_SCALE_CODES 256

struct GroupedCode {
    int bits;
    const float *levels, *midpoints, *scale_levels;
    int search_steps;
    float reach;
};

/* gradcode.group_scales for one block scale: the code of the level at or just above it. */
static int scale_code(float scale, float top, const float *scale_levels) {
    float steps = log2f(scale / top) * -32.0f;
    if (steps != steps) steps = 0.0f;
    else if (isinf(steps)) steps = steps > 0 ? 254.0f : 0.0f;
    steps = floorf(steps);
    int code = steps < 0.0f ? 0 : steps > 254.0f ? 254 : (int)steps;
    if (code < 254 && top * scale_levels[code + 1] >= scale) code += 1; /* fp32 logs can miss a level */
    for (int i = 0; i < 2; i++)
        if (top * scale_levels[code] < scale) code = code > 0 ? code - 1 : 0;
    if (top * scale_levels[code] < scale) code = 0; /* underflow: the group's scale */
    return scale == 0.0f ? 255 : code;
}

/* gradcode.block_codes at normal levels, rounding to nearest, for NUM_MID midpoints: each code is
 * the number of midpoints strictly below x / scale (NaN counting as 0), minus the offset; and the
 * squared error of the coding, summed in double (exact, so the order of the eight partial sums
 * does not matter: gradcode._squared_error). Each midpoint is one pass over the block, which
 * counts the field and selects the value levels[field] * scale, as the torch path computes it;
 * simple loops over the block, so they vectorise. */
#define MAX_GROUPED_BLOCK (MAX_BLOCK / GROUP)
#define NORMAL_CODE_BLOCK(NUM_MID)                                                                           \
    static double normal_code_block_##NUM_MID(const float *restrict x, int64_t n, float scale,               \
                                              const float *restrict levels, const float *restrict midpoints, \
                                              int8_t *restrict codes) {                                      \
        float units[MAX_GROUPED_BLOCK], values[MAX_GROUPED_BLOCK];                                           \
        int32_t fields[MAX_GROUPED_BLOCK];                                                                   \
        float divisor = scale > 0.0f ? scale : INFINITY, value_of[NUM_MID + 1];                              \
        for (int k = 0; k <= NUM_MID; k++) value_of[k] = levels[k] * scale;                                  \
        for (int64_t i = 0; i < n; i++) {                                                                    \
            float unit = x[i] / divisor;                                                                     \
            units[i] = unit == unit ? unit : 0.0f;                                                           \
            fields[i] = 0;                                                                                   \
            values[i] = value_of[0];                                                                         \
        }                                                                                                    \
        for (int k = 0; k < NUM_MID; k++) {                                                                  \
            float mid = midpoints[k], next = value_of[k + 1];                                                \
            for (int64_t i = 0; i < n; i++) {                                                                \
                int above = units[i] > mid;                                                                  \
                fields[i] += above;                                                                          \
                values[i] = above ? next : values[i];                                                        \
            }                                                                                                \
        }                                                                                                    \
        for (int64_t i = 0; i < n; i++) codes[i] = (int8_t)(fields[i] - (NUM_MID + 1) / 2);                  \
        double sums[8] = {0};                                                                                \
        int64_t whole = n / 8 * 8;                                                                           \
        for (int64_t i = 0; i < whole; i += 8)                                                               \
            for (int j = 0; j < 8; j++) {                                                                    \
                float diff = values[i + j] - x[i + j];                                                       \
                sums[j] += (double)(diff * diff);                                                            \
            }                                                                                                \
        for (int64_t i = whole; i < n; i++) {                                                                \
            float diff = values[i] - x[i];                                                                   \
            sums[i - whole] += (double)(diff * diff);                                                        \
        }                                                                                                    \
        double sum = 0.0;                                                                                    \
        for (int j = 0; j < 8; j++) sum += sums[j];                                                          \
        return sum;                                                                                          \
    }
NORMAL_CODE_BLOCK(3)
NORMAL_CODE_BLOCK(15)

/* gradcode.block_codes at evenly spaced levels, rounding to nearest: round(x / scale) clamped to
 * +-qmax (NaN counting as 0; clamping before rounding gives the same codes); and, with
 * `want_error`, the squared error as above. */
static double uniform_code_block(const float *restrict x, int64_t n, float scale, int qmax, int8_t *restrict codes,
                                 int want_error) {
    float divisor = scale > 0.0f ? scale : INFINITY, limit = (float)qmax;
    for (int64_t i = 0; i < n; i++) {
        float unit = x[i] / divisor;
        unit = unit == unit ? unit : 0.0f;
        codes[i] = (int8_t)rintf(unit < -limit ? -limit : unit > limit ? limit : unit);
    }
    double sum = 0.0;
    for (int64_t i = 0; want_error && i < n; i++) {
        float diff = (float)codes[i] * scale - x[i];
        sum += (double)(diff * diff);
    }
    return sum;
}

/* One coding of a block at `scale`: its codes, and the squared error where the search needs it. */
static double code_block(const float *x, int64_t n, float scale, const GroupedCode *code, int8_t *codes,
                         int want_error) {
    if (!code->levels) return uniform_code_block(x, n, scale, (1 << (code->bits - 1)) - 1, codes, want_error);
    if (code->bits == 2) return normal_code_block_3(x, n, scale, code->levels, code->midpoints, codes);
    return normal_code_block_15(x, n, scale, code->levels, code->midpoints, codes);
}

static void encode_grouped_row(const void *row, int dtype, int64_t numel, int64_t block_size, const GroupedCode *code,
                               uint8_t *data, int64_t data_bytes, uint8_t *params) {
    static _Thread_local float staged[MAX_BLOCK];
    static _Thread_local int8_t codes[MAX_BLOCK], trial[MAX_BLOCK];
    int bits = code->bits, scale_qmax = code->levels ? 1 : (1 << (bits - 1)) - 1;
    int64_t covered = data_bytes * 8 / bits, unit = block_size * GROUP;
    for (int64_t unit_start = 0, u = 0; unit_start < numel; unit_start += unit, u++) {
        float scales[GROUP], top = 0.0f;
        for (int j = 0; j < GROUP; j++) { /* stage the unit's blocks, zero-padded, and take their scales */
            int64_t start = unit_start + j * block_size;
            int64_t n = numel - start < 0 ? 0 : numel - start < block_size ? numel - start : block_size;
            float *x = staged + j * block_size;
            if (dtype == DTYPE_FP32) memcpy(x, (const float *)row + start, (size_t)n * 4);
            else for (int64_t i = 0; i < n; i++) x[i] = bf16_to_fp32(((const uint16_t *)row)[start + i]);
            memset(x + n, 0, (size_t)(block_size - n) * 4);
            scales[j] = block_scale(x, block_size, scale_qmax);
            top = (scales[j] != scales[j] || top != top) ? NAN : scales[j] > top ? scales[j] : top;
        }
        memcpy(params + u * (4 + GROUP), &top, 4);
        uint8_t *scale_codes = params + u * (4 + GROUP) + 4;
        for (int j = 0; j < GROUP; j++) {
            int64_t start = unit_start + j * block_size;
            const float *x = staged + j * block_size;
            int first = scale_code(scales[j], top, code->scale_levels), chosen = first;
            float decoded = top * code->scale_levels[first];
            int search = code->search_steps > 1 && start + block_size <= numel;
            double error = code_block(x, block_size, decoded, code, codes, search);
            if (search) {
                for (int step = 1; step < code->search_steps; step++) {
                    int candidate = first < 255 ? (first + step > 254 ? 254 : first + step) : 255;
                    float candidate_scale = top * code->scale_levels[candidate];
                    double candidate_error = code_block(x, block_size, candidate_scale, code, trial, 1);
                    if (candidate_error < error && candidate_scale * code->reach >= scales[j]) {
                        error = candidate_error;
                        chosen = candidate;
                        memcpy(codes, trial, (size_t)block_size);
                    }
                }
            }
            scale_codes[j] = (uint8_t)chosen;
            int64_t stored = covered - start < 0 ? 0 : covered - start < block_size ? covered - start : block_size;
            if (stored > 0) store_codes(codes, stored, bits, data + start * bits / 8);
        }
    }
}

/* The block's first n values from its fields: a table of the 2**bits values (levels[field] * scale,
 * or (field - offset) * scale for evenly spaced levels) looked up per field; 8-bit codes are
 * evenly spaced, code * scale. */
static void decode_grouped_block(const uint8_t *bytes, int64_t n, float scale, const GroupedCode *code,
                                 float *restrict values) {
    int bits = code->bits, offset = 1 << (bits - 1);
    if (bits == 8) {
        for (int64_t i = 0; i < n; i++) values[i] = (float)(int8_t)bytes[i] * scale;
        return;
    }
    float value_of[16];
    for (int f = 0; f < 2 * offset; f++) value_of[f] = (code->levels ? code->levels[f] : (float)(f - offset)) * scale;
    int per_byte = 8 / bits, mask = (1 << bits) - 1;
    int64_t whole = n / per_byte;
    if (bits == 4) {
        for (int64_t i = 0; i < whole; i++) {
            values[2 * i] = value_of[bytes[i] & 0xF];
            values[2 * i + 1] = value_of[bytes[i] >> 4];
        }
    } else {
        for (int64_t i = 0; i < whole; i++)
            for (int j = 0; j < 4; j++) values[4 * i + j] = value_of[(bytes[i] >> (2 * j)) & 0x3];
    }
    for (int64_t i = whole * per_byte; i < n; i++)
        values[i] = value_of[(bytes[i / per_byte] >> (bits * (i % per_byte))) & mask];
}

static void decode_grouped_row(const uint8_t *data, const uint8_t *params, int64_t numel, int64_t block_size,
                               const GroupedCode *code, void *row, int dtype) {
    static _Thread_local float values[MAX_BLOCK];
    int64_t unit = block_size * GROUP;
    for (int64_t start = 0, b = 0; start < numel; start += block_size, b++) {
        int64_t n = numel - start < block_size ? numel - start : block_size;
        const uint8_t *unit_params = params + (start / unit) * (4 + GROUP);
        float top;
        memcpy(&top, unit_params, 4);
        float scale = top * code->scale_levels[unit_params[4 + b % GROUP]];
        const uint8_t *bytes = data + start * code->bits / 8;
        if (dtype == DTYPE_FP32) {
            decode_grouped_block(bytes, n, scale, code, (float *)row + start);
        } else {
            decode_grouped_block(bytes, n, scale, code, values);
            for (int64_t i = 0; i < n; i++) ((uint16_t *)row)[start + i] = fp32_to_bf16(values[i]);
        }
    }
}

/* zeropp_encode_chunks / zeropp_decode_chunks for the grouped-scale code: a segment's payload is its
 * codes (the real elements rounded up to 4 bytes), then per unit its fp32 `top` and GROUP scale codes. */
void zeropp_encode_grouped_chunks(const void *chunks, int64_t chunk_stride, int dtype, int64_t num_rows,
                                  const int64_t *table, int64_t num_segments, int64_t block_size, int bits,
                                  const float *levels, const float *midpoints, const float *scale_levels,
                                  int search_steps, float reach, uint8_t *out, int64_t out_stride) {
    GroupedCode code = {bits, levels, midpoints, scale_levels, search_steps, reach};
    encode_chunks(chunks, chunk_stride, dtype, num_rows, table, num_segments, block_size, &code, out, out_stride);
}

void zeropp_decode_grouped_chunks(const uint8_t *packed, int64_t packed_stride, int64_t num_rows,
                                  const int64_t *table, int64_t num_segments, int64_t block_size, int bits,
                                  const float *levels, const float *scale_levels, void *out, int64_t out_stride,
                                  int dtype) {
    GroupedCode code = {bits, levels, NULL, scale_levels, 1, 1.0f};
    decode_chunks(packed, packed_stride, num_rows, table, num_segments, block_size, &code, out, out_stride, dtype);
}
