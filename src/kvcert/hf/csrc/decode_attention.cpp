// kvcert's compiled decode attention: one call per layer and decode step for every bucket of a CompressedState
// (DecodeOptions.backend; Python side in kvcert/hf/kernel.py). Per (row, KV head) it
//   1. appends the new key / value (offset 0) to the compressed cache, and to the oracle's own part if any;
//   2. computes p = softmax(scale * q K^T + offset) for the g query heads of the group (keys stored (d, slots));
//   3. with the certificate, a = (1 - pi) p^2 on the tail slots;
//   4. o_hat = p V and sum_tail a v in one pass over the values.
// p and a go to the bucket's work rows (3g, capacity) and [o_hat; sum a v] to its work output (2g, d): exactly
// what Bucket._attend_deferred writes, so Bucket.flush_stats reads them unchanged. Plain loops that the compiler
// vectorises (-O3 -march=native -ffast-math: summation order differs from torch's, equal to float rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

constexpr int kMaxRows = 16;   // 2 * group
constexpr int kMaxDim = 256;   // head_dim
constexpr int kBlock = 4;      // key rows (head dims) combined per pass over the logits
constexpr int kChunk = 16;     // floats per cache line: one prefetch per line and row
constexpr int kAhead = 256;    // prefetch distance (floats) in the key rows: the hardware prefetcher alone streams
                               // them late (about 10% of the kernel's time on this machine)
constexpr int kAheadRows = 8;  // prefetch distance (value rows)

// logits p[gi][j] = sum_c q[gi][c] K^T[c][j]: kBlock rows of K^T per pass over j, all G query heads in that pass
// (G a compile-time constant, so the G x kBlock weights stay in registers; G = 0: any group size, one head per pass)
template <int G>
void logits(const float* q, int g, int d, const float* kt, int64_t k_stride, float* rows, int64_t row_stride,
            int64_t L) {
  for (int gi = 0; gi < g; ++gi)
    for (int64_t j = 0; j < L; ++j) rows[gi * row_stride + j] = 0.f;
  int c = 0;
  for (; c + kBlock <= d; c += kBlock) {
    const float* k0 = kt + c * k_stride;
    const float* k1 = k0 + k_stride;
    const float* k2 = k1 + k_stride;
    const float* k3 = k2 + k_stride;
    if constexpr (G > 0) {
      float w[G][kBlock];
      float* p[G];
      for (int gi = 0; gi < G; ++gi) {
        p[gi] = rows + gi * row_stride;
        for (int t = 0; t < kBlock; ++t) w[gi][t] = q[gi * d + c + t];
      }
      for (int64_t j0 = 0; j0 < L; j0 += kChunk) {
        // software prefetch kAhead floats ahead in each of the four key rows (the hardware streams them late)
        __builtin_prefetch(k0 + j0 + kAhead);
        __builtin_prefetch(k1 + j0 + kAhead);
        __builtin_prefetch(k2 + j0 + kAhead);
        __builtin_prefetch(k3 + j0 + kAhead);
        const int64_t j1 = j0 + kChunk < L ? j0 + kChunk : L;
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) {
          const float a0 = k0[j], a1 = k1[j], a2 = k2[j], a3 = k3[j];
          for (int gi = 0; gi < G; ++gi) p[gi][j] += w[gi][0] * a0 + w[gi][1] * a1 + w[gi][2] * a2 + w[gi][3] * a3;
        }
      }
    } else {
      for (int gi = 0; gi < g; ++gi) {
        const float* qg = q + gi * d + c;
        const float q0 = qg[0], q1 = qg[1], q2 = qg[2], q3 = qg[3];
        float* p = rows + gi * row_stride;
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) p[j] += q0 * k0[j] + q1 * k1[j] + q2 * k2[j] + q3 * k3[j];
      }
    }
  }
  for (; c < d; ++c) {
    const float* kr = kt + c * k_stride;
    for (int gi = 0; gi < g; ++gi) {
      const float qc = q[gi * d + c];
      float* p = rows + gi * row_stride;
#pragma omp simd
      for (int64_t j = 0; j < L; ++j) p[j] += qc * kr[j];
    }
  }
}

// p = softmax(scale * logits + offset) in place (offset: -log pi on kept tokens, 0 after compression; the -inf
// padding lies beyond L), and with the certificate a = (1 - pi) p^2 on the tail slots
void softmax_rows(int g, float scale, const float* offset, const float* omp, int64_t s, bool variance, float* rows,
                  int64_t row_stride, int64_t L) {
  for (int gi = 0; gi < g; ++gi) {
    float* p = rows + gi * row_stride;
    float m = -INFINITY;
    for (int64_t j = 0; j < L; ++j) {
      p[j] = p[j] * scale + offset[j];
      m = p[j] > m ? p[j] : m;
    }
    float z = 0.f;
#pragma omp simd reduction(+ : z)
    for (int64_t j = 0; j < L; ++j) {
      const float e = std::exp(p[j] - m);
      p[j] = e;
      z += e;
    }
    const float inv = 1.f / z;
#pragma omp simd
    for (int64_t j = 0; j < L; ++j) p[j] *= inv;
    if (variance) {
      float* a = rows + (g + gi) * row_stride;
#pragma omp simd
      for (int64_t j = 0; j < s; ++j) a[j] = p[j] * p[j] * omp[j];
    }
  }
}

// [o_hat; sum_tail a v] in one pass over the values: n rows of weights (2g on the tail with the certificate, g
// after it); D > 0 a compile-time head_dim (accumulators in registers), D = 0 any head_dim
template <int D>
void values_pass(int g, int d, const float* v, int64_t v_stride, int64_t tail, bool variance, const float* rows,
                 int64_t row_stride, float* out, int64_t L) {
  constexpr int kDim = D > 0 ? D : kMaxDim;
  const int dd = D > 0 ? D : d;
  float acc[kMaxRows][kDim];
  const int n_rows = variance ? 2 * g : g;
  for (int r = 0; r < n_rows; ++r)
    for (int c = 0; c < dd; ++c) acc[r][c] = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    const float* vj = v + j * v_stride;
    for (int c = 0; c < dd; c += kChunk) __builtin_prefetch(vj + kAheadRows * v_stride + c);
    const int n = j < tail ? n_rows : g;
    for (int r = 0; r < n; ++r) {
      const float w = rows[r * row_stride + j];
#pragma omp simd
      for (int c = 0; c < dd; ++c) acc[r][c] += w * vj[c];
    }
  }
  for (int r = 0; r < n_rows; ++r)
    for (int c = 0; c < dd; ++c) out[r * dd + c] = acc[r][c];
}

void attend_one(const float* q, int g, int d, float scale, const float* kt, int64_t k_stride, const float* v,
                int64_t v_stride, const float* offset, const float* omp, int64_t s, bool variance, float* rows,
                int64_t row_stride, float* out, float* result, int64_t L) {
  switch (g) {
    case 1: logits<1>(q, g, d, kt, k_stride, rows, row_stride, L); break;
    case 2: logits<2>(q, g, d, kt, k_stride, rows, row_stride, L); break;
    case 3: logits<3>(q, g, d, kt, k_stride, rows, row_stride, L); break;
    case 4: logits<4>(q, g, d, kt, k_stride, rows, row_stride, L); break;
    default: logits<0>(q, g, d, kt, k_stride, rows, row_stride, L);
  }
  softmax_rows(g, scale, offset, omp, s, variance, rows, row_stride, L);
  const int64_t tail = variance ? s : 0;
  if (d == 64)
    values_pass<64>(g, d, v, v_stride, tail, variance, rows, row_stride, out, L);
  else
    values_pass<0>(g, d, v, v_stride, tail, variance, rows, row_stride, out, L);
  for (int i = 0; i < g * d; ++i) result[i] = out[i];
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "fused decode attention: ", name,
              " must be a float32 CPU tensor");
}

}  // namespace

// query (B, Hkv, g, d), key / value (B, Hkv, d), result (B, Hkv, g, d): contiguous, rows of the buckets in order.
// Per bucket b: keys (Bb, Hkv, d, cap), values (Bb, Hkv, cap, d), offset (Bb, Hkv, cap), one_minus_pi
// (Bb, Hkv, s), work rows (Bb, Hkv, 3g, cap), work out (Bb, Hkv, 2g, d); lengths[b] = filled slots before this
// token; oracle_keys / oracle_values (Bb, Hkv, ocap, d) with oracle_lengths (empty tensors: no oracle part).
void decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const std::vector<at::Tensor>& offsets, const std::vector<at::Tensor>& one_minus_pi,
                      const std::vector<at::Tensor>& rows, const std::vector<at::Tensor>& outs,
                      const std::vector<at::Tensor>& oracle_keys, const std::vector<at::Tensor>& oracle_values,
                      const std::vector<int64_t>& lengths, const std::vector<int64_t>& tail_slots,
                      const std::vector<int64_t>& oracle_lengths, const std::vector<int64_t>& variance,
                      double scale, at::Tensor& result) {
  for (const at::Tensor* t : {&query, &key, &value, static_cast<const at::Tensor*>(&result)}) {
    check_float(*t, "query / key / value / result");
    TORCH_CHECK(t->is_contiguous(), "fused decode attention: query, key, value and result must be contiguous");
  }
  const int64_t n_kv = query.size(1), g = query.size(2), d = query.size(3);
  TORCH_CHECK(d <= kMaxDim && 2 * g <= kMaxRows, "fused decode attention: head_dim <= ", kMaxDim,
              " and query heads per KV head <= ", kMaxRows / 2);
  const size_t n_buckets = keys.size();
  std::vector<int64_t> first_row(n_buckets + 1, 0);
  for (size_t b = 0; b < n_buckets; ++b) {
    check_float(keys[b], "keys");
    check_float(values[b], "values");
    TORCH_CHECK(lengths[b] < keys[b].size(3), "fused decode attention: KV buffer is full");
    TORCH_CHECK(!oracle_keys[b].numel() || oracle_lengths[b] < oracle_keys[b].size(2),
                "fused decode attention: the oracle's buffer is full");
    TORCH_CHECK(values[b].stride(3) == 1 && keys[b].stride(3) == 1 && rows[b].stride(3) == 1 &&
                    offsets[b].stride(2) == 1 && outs[b].stride(3) == 1 && outs[b].stride(2) == d &&
                    (tail_slots[b] == 0 || one_minus_pi[b].stride(2) == 1),
                "fused decode attention: buffers must be contiguous in their last dimension");
    first_row[b + 1] = first_row[b] + keys[b].size(0);
  }
  TORCH_CHECK(first_row.back() == query.size(0), "fused decode attention: bucket rows do not add up to the batch");
  const float* qp = query.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* res = result.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, first_row.back() * n_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / n_kv, h = item % n_kv;
      size_t b = 0;
      while (first_row[b + 1] <= row) ++b;
      const int64_t r = row - first_row[b];
      const at::Tensor &K = keys[b], &V = values[b], &O = offsets[b], &R = rows[b], &W = outs[b];
      const int64_t lo = lengths[b], s = tail_slots[b];
      const float* new_k = kp + (row * n_kv + h) * d;
      const float* new_v = vp + (row * n_kv + h) * d;
      float* kt = K.data_ptr<float>() + r * K.stride(0) + h * K.stride(1);
      float* vv = V.data_ptr<float>() + r * V.stride(0) + h * V.stride(1);
      float* off = O.data_ptr<float>() + r * O.stride(0) + h * O.stride(1);
      for (int64_t c = 0; c < d; ++c) kt[c * K.stride(2) + lo] = new_k[c];
      for (int64_t c = 0; c < d; ++c) vv[lo * V.stride(2) + c] = new_v[c];
      off[lo] = 0.f;
      if (oracle_keys[b].numel()) {
        const at::Tensor &OK = oracle_keys[b], &OV = oracle_values[b];
        const int64_t at = oracle_lengths[b];
        float* ok = OK.data_ptr<float>() + r * OK.stride(0) + h * OK.stride(1) + at * OK.stride(2);
        float* ov = OV.data_ptr<float>() + r * OV.stride(0) + h * OV.stride(1) + at * OV.stride(2);
        for (int64_t c = 0; c < d; ++c) ok[c * OK.stride(3)] = new_k[c];
        for (int64_t c = 0; c < d; ++c) ov[c * OV.stride(3)] = new_v[c];
      }
      const float* om = s ? one_minus_pi[b].data_ptr<float>() + r * one_minus_pi[b].stride(0) +
                                h * one_minus_pi[b].stride(1)
                          : nullptr;
      attend_one(qp + (row * n_kv + h) * g * d, static_cast<int>(g), static_cast<int>(d), sc, kt, K.stride(2), vv,
                 V.stride(2), off, om, s, variance[b] != 0, R.data_ptr<float>() + r * R.stride(0) + h * R.stride(1),
                 R.stride(2), W.data_ptr<float>() + r * W.stride(0) + h * W.stride(1), res + (row * n_kv + h) * g * d,
                 lo + 1);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "kvcert's fused decode attention over every bucket of one layer");
}
