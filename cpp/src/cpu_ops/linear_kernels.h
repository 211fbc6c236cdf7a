// The linear kernel's inner loops (internal; not installed).
//
// NOTE: no include guard on purpose: linear.cpp includes this file once per instruction
// set, inside a namespace that defines W and after simd.h, as attention.cpp does with
// attention_kernels.h.
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
// rows, one sum each) measured 1.5x slower on the EPYC this was tuned on. Four sums
// hide the latency of the multiply-adds.

PAGEDCORE_INLINE float dot(const float* x, const float* w, int64_t k_size) {
  vf s0 = vf{}, s1 = vf{}, s2 = vf{}, s3 = vf{};
  int64_t k = 0;
  for (; k + 4 * W <= k_size; k += 4 * W) {
    s0 += load(x + k) * load(w + k);
    s1 += load(x + k + W) * load(w + k + W);
    s2 += load(x + k + 2 * W) * load(w + k + 2 * W);
    s3 += load(x + k + 3 * W) * load(w + k + 3 * W);
  }
  for (; k + W <= k_size; k += W) s0 += load(x + k) * load(w + k);
  float s = hsum((s0 + s1) + (s2 + s3));
  for (; k < k_size; ++k) s += x[k] * w[k];
  return s;
}

// Outputs [begin, end) of every token. A weight row is read from memory once, for the
// first token; the next tokens find it in L1.
inline void linear_rows(const LinearArgs& a, int64_t begin, int64_t end) {
  const int64_t k_size = a.in_features;
  for (int64_t n = begin; n < end; ++n) {
    const float* w = a.weight + n * k_size;
    const float bias = a.bias != nullptr ? a.bias[n] : 0.0f;
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      float s = dot(a.input + t * a.input_stride, w, k_size);
      if (a.bias != nullptr) s += bias;
      a.out[t * a.out_stride + n] = s;
    }
  }
}
