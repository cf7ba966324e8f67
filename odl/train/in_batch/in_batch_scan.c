/* The sequential pass of in-batch learning (odl/train/in_batch/in_batch_scan.py states the contract).
 *
 * Inputs are the step's (table row, record) pairs (odl/train/in_batch/batch_row_pairs.py), visited in
 * (record, row slot) order through `order`. `cols`, `rate`, `acc` and `stored` are per row
 * slot: the table's width (the columns of `jrow`, `acc`, `sums` and `squares` beyond it are
 * not read), its rate, the row's accumulator, the table's stored columns. All arrays are
 * C-contiguous; floats are float32, indices int64; `sums` and `squares` are float64 scratch
 * of [slots, width], zeroed by the caller; `scratch` is float64 of [2 * width]. `shift`
 * ([records]) is written for every record that has a pair; the caller zeroes it. Compiled
 * by odl/train/in_batch/native_kernels.py with the system C compiler and called through ctypes;
 * the Python pass of in_batch_scan.py computes the same thing one record at a time.
 */
#include <math.h>
#include <stdint.h>

#define KIND_SGD 0
#define KIND_ADAGRAD 1
#define KIND_ROWWISE 2

void odl_in_batch_scan(int64_t n_pairs, int64_t width, int64_t acc_width,
                       const int64_t *order, const int64_t *sample, const int64_t *slot,
                       const int64_t *cols,
                       const float *jrow, const float *weight, const float *rate,
                       const float *acc, const float *stored,
                       int32_t kind, int32_t per_record, double gain, double eps,
                       const float *base, const float *err_sig, const float *err_const,
                       const float *err_lin, double *sums, double *squares, double *scratch,
                       float *shift) {
    const double inv_gain2 = 1.0 / (gain * gain);
    const double eps2 = eps * eps > 1e-30 ? eps * eps : 1e-30;
    int64_t pos = 0;
    while (pos < n_pairs) {
        const int64_t rec = sample[order[pos]];
        int64_t end = pos;
        while (end < n_pairs && sample[order[end]] == rec) end++;
        /* read: the change of each row from the records before this one */
        double s = 0.0;
        for (int64_t k = pos; k < end; k++) {
            const int64_t p = order[k];
            const int64_t u = slot[p];
            const double *S = sums + u * width;
            const double *Q = squares + u * width;
            const float *J = jrow + p * width;
            const int64_t n = cols[u];  /* the table's own columns (the rest are zero) */
            double dot = 0.0;
            if (kind == KIND_SGD) {
                for (int64_t c = 0; c < n; c++) dot += J[c] * S[c];
            } else if (kind == KIND_ROWWISE) {
                double s2 = 0.0;
                for (int64_t c = 0; c < n; c++) s2 += S[c] * S[c];
                if (s2 == 0.0) continue;
                double grow = s2 * (per_record ? inv_gain2 : 1.0);
                if (per_record && Q[0] > grow) grow = Q[0];
                const double den = 1.0 / sqrt(acc[u] + grow / stored[u] + eps2);
                for (int64_t c = 0; c < n; c++) dot += J[c] * S[c];
                dot *= den;
            } else {
                /* element-wise into `part`, then summed: the first loops vectorise */
                const float *G = acc + u * acc_width;
                double *part = scratch + width;
                if (per_record) {
                    for (int64_t c = 0; c < n; c++) {
                        const double s2 = S[c] * S[c] * inv_gain2;
                        const double grow = Q[c] > s2 ? Q[c] : s2;
                        part[c] = J[c] * S[c] / sqrt(G[c] + grow + eps2);
                    }
                } else {
                    for (int64_t c = 0; c < n; c++)
                        part[c] = J[c] * S[c] / sqrt(G[c] + S[c] * S[c] + eps2);
                }
                for (int64_t c = 0; c < n; c++) dot += part[c];
            }
            s -= rate[u] * weight[p] * dot;
        }
        shift[rec] = (float)s;
        /* the record's error at its shifted logit l: the caller's model of its loss's slope,
         * err_sig * sigmoid(l) + err_const + err_lin * l */
        const double l = base[rec] + s;
        const double e = err_sig[rec] / (1.0 + exp(-l)) + err_const[rec] + err_lin[rec] * l;
        /* write: the record's gradient of each row it reads (all its reads of the row) */
        int64_t k = pos;
        while (k < end) {
            const int64_t u = slot[order[k]];
            const int64_t n = cols[u];
            for (int64_t c = 0; c < n; c++) scratch[c] = 0.0;
            while (k < end && slot[order[k]] == u) {
                const int64_t p = order[k];
                const float *J = jrow + p * width;
                for (int64_t c = 0; c < n; c++) scratch[c] += weight[p] * J[c];
                k++;
            }
            double *S = sums + u * width;
            double *Q = squares + u * width;
            double q = 0.0;
            for (int64_t c = 0; c < n; c++) {
                const double g = e * scratch[c];
                S[c] += g;
                if (kind == KIND_ROWWISE) q += g * g; else Q[c] += g * g;
            }
            if (kind == KIND_ROWWISE) Q[0] += q;
        }
        pos = end;
    }
}
