// The linear kernel's inner loops (internal; not installed).
//
// NOTE: no include guard on purpose: linear.cpp includes this file once per instruction
// set, inside a namespace that defines W and after simd.h (per_isa.h), as attention.cpp
// does with attention_kernels.h.
//
// Every output is the same sum whatever the thread or the number of tokens: four
// lane-wise partial sums over the whole vectors of k (vector v of the row into sum
// v % 4 while whole groups of four remain, the rest into sum 0; each step a fused
// multiply-add where the target has one), combined as (s0 + s1) + (s2 + s3), summed
// across lanes (hsum), then the K % W tail in order, then the bias. So a token's output
// does not depend on which other tokens share the call (decode rows give the same
// logits at batch 1 and batch 8).
//
// NOTE: one weight row at a time, read front to back, is what keeps the hardware
// prefetchers streaming at the memory's bandwidth; interleaving the rows of a tile (8
// rows, one sum each) measured 1.2-1.8x slower on the EPYC this was tuned on. Four sums
// hide the latency of the multiply-adds.

// The dot products of T token rows x[t] with one weight row w, into out[t]: each weight
// vector is loaded once for the T rows (x stays in L1). Per token the sums are exactly
// those of T = 1.
template <int T>
PAGEDCORE_INLINE void dots(const float* const* x, const float* w, int64_t k_size, float* out) {
  vf s[T][4];
  for (int t = 0; t < T; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = vf{};
  int64_t k = 0;
  for (; k + 4 * W <= k_size; k += 4 * W) {
    for (int j = 0; j < 4; ++j) {
      const vf wv = load(w + k + j * W);
      for (int t = 0; t < T; ++t) s[t][j] += load(x[t] + k + j * W) * wv;
    }
  }
  for (; k + W <= k_size; k += W) {
    const vf wv = load(w + k);
    for (int t = 0; t < T; ++t) s[t][0] += load(x[t] + k) * wv;
  }
  for (int t = 0; t < T; ++t) {
    float sum = hsum((s[t][0] + s[t][1]) + (s[t][2] + s[t][3]));
    for (int64_t i = k; i < k_size; ++i) sum += x[t][i] * w[i];
    out[t] = sum;
  }
}

// Outputs [begin, end) of every token, tokens four at a time. A weight row is read from
// memory once, for the first tokens; the next ones find it in L1.
inline void linear_rows(const LinearArgs& a, int64_t begin, int64_t end) {
  constexpr int kTokens = 4;
  const int64_t k_size = a.in_features;
  for (int64_t n = begin; n < end; ++n) {
    const float* w = a.weight + n * k_size;
    const float bias = a.bias != nullptr ? a.bias[n] : 0.0f;
    for (int64_t t0 = 0; t0 < a.num_tokens; t0 += kTokens) {
      const int count = static_cast<int>(std::min<int64_t>(kTokens, a.num_tokens - t0));
      const float* x[kTokens];
      float y[kTokens];
      for (int t = 0; t < count; ++t) x[t] = a.input + (t0 + t) * a.input_stride;
      if (count == kTokens) {
        dots<kTokens>(x, w, k_size, y);
      } else {
        for (int t = 0; t < count; ++t) dots<1>(x + t, w, k_size, y + t);
      }
      for (int t = 0; t < count; ++t) {
        if (a.bias != nullptr) y[t] += bias;
        a.out[(t0 + t) * a.out_stride + n] = y[t];
      }
    }
  }
}
