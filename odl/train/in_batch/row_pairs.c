/* A step's (table row, record) reads and the per-record row sums, on the CPU
 * (odl/train/in_batch/batch_row_pairs.py and odl/train/in_batch/per_record_adagrad.py state
 * what they compute; their torch code computes the same on other devices).
 *
 * All arrays are C-contiguous; indices are int64, floats float32, flags one byte (0 / 1).
 * Compiled with in_batch_scan.c by odl/train/in_batch/native_kernels.py and called through
 * ctypes.
 */
#include <stdint.h>
#include <string.h>

/* The reads of `b` records through `n_lookups` pooled lookups, lookup after lookup, in the
 * order of each lookup's feature values (a KeyedJaggedTensor: `values` key after key, the
 * key's `lengths` record after record, `key_offsets` [keys + 1] where each key's values
 * start). `lookup_key[l]` is the key lookup `l` reads (-1: none), `lookup_table[l]` its
 * table, `lookup_mean[l]` whether the table pools by mean; `value_weights` the values'
 * weights or NULL. For each read: its lookup, record, row, weight (1, over n for a mean of
 * n values, times the value's weight) and the sort key ((table << 32) + row) * (b + 1) +
 * record. Returns the number of reads written. */
int64_t odl_row_pair_reads(int64_t b, int64_t n_lookups, const int64_t *lookup_key,
                           const int64_t *lookup_table, const uint8_t *lookup_mean,
                           const int64_t *key_offsets, const int64_t *lengths,
                           const int64_t *values, const float *value_weights,
                           int64_t *lookup, int64_t *sample, int64_t *rows, float *weight,
                           int64_t *sort_key) {
    int64_t p = 0;
    for (int64_t l = 0; l < n_lookups; l++) {
        const int64_t k = lookup_key[l];
        if (k < 0) continue;
        const int64_t table_key = lookup_table[l] << 32;
        const int64_t *len = lengths + k * b;
        int64_t v = key_offsets[k];
        for (int64_t r = 0; r < b; r++) {
            const int64_t n = len[r];
            const float each = (lookup_mean[l] && n > 0) ? 1.0f / (float)n : 1.0f;
            for (int64_t j = 0; j < n; j++, v++, p++) {
                lookup[p] = l;
                sample[p] = r;
                rows[p] = values[v];
                weight[p] = value_weights ? each * value_weights[v] : each;
                sort_key[p] = (table_key + values[v]) * (b + 1) + r;
            }
        }
    }
    return p;
}

/* The reads put in `order` (their sort keys ascending), with their run flags: `new_row[p]`
 * / `new_pair[p]` p starts a table row's reads / a (row, record)'s reads, `row_start[p]` /
 * `pair_start[p]` where they start. The `*_in` arrays are the unsorted reads. */
void odl_row_pair_sorted(int64_t n, int64_t b, const int64_t *order,
                         const int64_t *lookup_in, const int64_t *sample_in,
                         const int64_t *rows_in, const float *weight_in,
                         const int64_t *sort_key, int64_t *lookup, int64_t *sample,
                         int64_t *rows, float *weight, uint8_t *new_row, uint8_t *new_pair,
                         int64_t *row_start, int64_t *pair_start) {
    int64_t last_key = 0, last_row = 0, rs = 0, ps = 0;
    for (int64_t p = 0; p < n; p++) {
        const int64_t q = order[p];
        const int64_t key = sort_key[q];
        const int64_t row = key / (b + 1);
        lookup[p] = lookup_in[q];
        sample[p] = sample_in[q];
        rows[p] = rows_in[q];
        weight[p] = weight_in[q];
        const int starts_row = p == 0 || row != last_row;
        const int starts_pair = starts_row || key != last_key;
        if (starts_row) rs = p;
        if (starts_pair) ps = p;
        new_row[p] = (uint8_t)starts_row;
        new_pair[p] = (uint8_t)starts_pair;
        row_start[p] = rs;
        pair_start[p] = ps;
        last_key = key;
        last_row = row;
    }
}

/* Per table row of the sorted reads: the gradient its records put on it and the sum of their
 * squares, each record's gradient being its reads' pooled gradients times the reads' weights
 * times `scale` (summed over the record's reads of the row). `grads` is [records, columns]:
 * the pooled groups side by side, lookup `l`'s `lookup_width[l]` columns from
 * `lookup_first[l]` (the columns of `total`, `squares` and `run` past it stay 0). Writes, per row `r` (in order),
 * `total[r]` ([width]), `squares[r]` ([width], or [1] summed over the columns when
 * `rowwise`), `readers[r]` (its records) and `head[r]` (its first read); returns the rows. */
int64_t odl_row_gradient_sums(int64_t n_pairs, int64_t width, int64_t columns, int32_t rowwise,
                              double scale, const int64_t *sample, const int64_t *lookup,
                              const float *weight, const uint8_t *new_row,
                              const uint8_t *new_pair, const int64_t *lookup_first,
                              const int64_t *lookup_width, const float *grads, double *run, float *total, float *squares,
                              int64_t *readers, int64_t *head) {
    const int64_t qw = rowwise ? 1 : width;
    int64_t r = -1;
    int have_run = 0;
    for (int64_t p = 0; p <= n_pairs; p++) {
        if (have_run && (p == n_pairs || new_pair[p])) { /* the last record's squares */
            float *sq = squares + r * qw;
            if (rowwise) {
                double s = 0.0;
                for (int64_t c = 0; c < width; c++) s += run[c] * run[c];
                sq[0] += (float)s;
            } else {
                for (int64_t c = 0; c < width; c++) sq[c] += (float)(run[c] * run[c]);
            }
            have_run = 0;
        }
        if (p == n_pairs) break;
        if (new_row[p]) {
            r++;
            memset(total + r * width, 0, (size_t)width * sizeof(float));
            memset(squares + r * qw, 0, (size_t)qw * sizeof(float));
            readers[r] = 0;
            head[r] = p;
        }
        if (new_pair[p]) {
            memset(run, 0, (size_t)width * sizeof(double));
            readers[r]++;
            have_run = 1;
        }
        const float *g = grads + sample[p] * columns + lookup_first[lookup[p]];
        const int64_t dim = lookup_width[lookup[p]];
        const double w = (double)weight[p] * scale;
        float *t = total + r * width;
        for (int64_t c = 0; c < dim; c++) {
            const double x = (double)g[c] * w;
            run[c] += x;
            t[c] += (float)x;
        }
    }
    return r + 1;
}

/* The reads of table rows that two or more records read, of `n` reads sorted by (row, record)
 * (`row_key[p]` the read's table row as one int64, `sample[p]` its record). Writes the kept
 * reads' positions to `keep`, and per kept read its row numbered from 0 (`slot`) and whether
 * it starts its row's / its (row, record)'s kept reads (`new_row`, `new_pair`); returns the
 * number kept. */
int64_t odl_shared_reads(int64_t n, const int64_t *row_key, const int64_t *sample,
                         int64_t *keep, int64_t *slot, uint8_t *new_row, uint8_t *new_pair) {
    int64_t kept = 0, slots = 0, start = 0;
    while (start < n) {
        int64_t end = start + 1, readers = 1;
        while (end < n && row_key[end] == row_key[start]) {
            if (sample[end] != sample[end - 1]) readers++;
            end++;
        }
        if (readers > 1) {
            for (int64_t p = start; p < end; p++, kept++) {
                keep[kept] = p;
                slot[kept] = slots;
                new_row[kept] = (uint8_t)(p == start);
                new_pair[kept] = (uint8_t)(p == start || sample[p] != sample[p - 1]);
            }
            slots++;
        }
        start = end;
    }
    return kept;
}

/* The sequential pass's reads: `k` reads sorted by (row, record) put in (record, row) order
 * (a counting sort over the `records` records; `count` is [records + 1] int64 scratch, zeroed
 * by the caller), with each read's columns of its record's `jac` ([records, columns], the
 * pooled groups side by side; lookup `l`'s `lookup_width[l]` columns from `lookup_first[l]`,
 * zero after them up to `width`). */
void odl_scan_reads(int64_t k, int64_t records, int64_t width, int64_t columns,
                    const int64_t *sample, const int64_t *lookup, const float *weight,
                    const int64_t *slot, const int64_t *lookup_first,
                    const int64_t *lookup_width, const float *jac,
                    int64_t *count, int64_t *sample_out, int64_t *slot_out, float *weight_out,
                    float *jrow_out) {
    for (int64_t p = 0; p < k; p++) count[sample[p] + 1]++;
    for (int64_t r = 0; r < records; r++) count[r + 1] += count[r];
    for (int64_t p = 0; p < k; p++) {
        const int64_t q = count[sample[p]]++;
        sample_out[q] = sample[p];
        slot_out[q] = slot[p];
        weight_out[q] = weight[p];
        const float *j = jac + sample[p] * columns + lookup_first[lookup[p]];
        const int64_t dim = lookup_width[lookup[p]];
        float *out = jrow_out + q * width;
        int64_t c = 0;
        for (; c < dim; c++) out[c] = j[c];
        for (; c < width; c++) out[c] = 0.0f;
    }
}

/* Table rows read and written in place in the fused kernel's float32 buffers (a rank holding
 * whole tables). Lookup `l`'s row `r` starts at float address `origin[l]` + r * `row_stride[l]`
 * and has `cols[l]` columns (1 for a row-wise accumulator). */
void odl_rows_read(int64_t n, int64_t width, const int64_t *lookup, const int64_t *rows,
                   const int64_t *origin, const int64_t *row_stride, const int64_t *cols,
                   float *out) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t l = lookup[i];
        const float *src = (const float *)(intptr_t)origin[l] + rows[i] * row_stride[l];
        float *dst = out + i * width;
        int64_t c = 0;
        for (; c < cols[l] && c < width; c++) dst[c] = src[c];
        for (; c < width; c++) dst[c] = 0.0f;
    }
}

/* Adds (`add`) or writes `values` ([n, width], the first `cols[l]` columns of each) at the
 * rows, addressed as in odl_rows_read; the rows must be distinct. */
void odl_rows_write(int64_t n, int64_t width, const int64_t *lookup, const int64_t *rows,
                    const int64_t *origin, const int64_t *row_stride, const int64_t *cols,
                    const float *values, int32_t add) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t l = lookup[i];
        float *dst = (float *)(intptr_t)origin[l] + rows[i] * row_stride[l];
        const float *src = values + i * width;
        const int64_t c_end = cols[l] < width ? cols[l] : width;
        if (add) {
            for (int64_t c = 0; c < c_end; c++) dst[c] += src[c];
        } else {
            for (int64_t c = 0; c < c_end; c++) dst[c] = src[c];
        }
    }
}
