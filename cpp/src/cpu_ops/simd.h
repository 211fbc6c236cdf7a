// Portable SIMD helpers for the CPU kernels (internal; not installed).
//
// NOTE: no include guard on purpose. per_isa.h includes this file (before a kernels
// header) once per instruction set, each time inside its own namespace that
// defines `constexpr int W` (lanes per vector: 16 for AVX-512, 8 for AVX2, 4 for the
// portable build) and under a `#pragma GCC target` region, so every function here is
// compiled for that instruction set. The helpers must be compiled in the target region
// themselves: GCC lowers a generic-vector helper compiled for the default target badly
// even after inlining it into an AVX-512 function (a broadcast became 16 masked
// broadcasts, 4x slower kernels).
//
// Vectors are GCC/Clang generic vectors of W floats (vector_size). No vector type crosses
// a call that is not inlined: kernels take and return pointers only.
//
// Needs <cstdint>, <cstring>, <limits>, <utility> and PAGEDCORE_INLINE (always_inline)
// defined before the namespace opens.

typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

PAGEDCORE_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
PAGEDCORE_INLINE void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// x - 0 is exactly x for every float (0 + x is not: -0), so this is one broadcast.
PAGEDCORE_INLINE vf splat(float x) { return x - vf{}; }
PAGEDCORE_INLINE vi splat_i(int32_t x) { return vi{} + x; }
PAGEDCORE_INLINE vi iota() {
  vi v;
  for (int l = 0; l < W; ++l) v[l] = l;
  return v;
}
PAGEDCORE_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }

// Horizontal reductions: log2(W) rotate-and-combine steps; every lane ends with the total.
template <int h, int... I>
PAGEDCORE_INLINE vf rotate(vf v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, ((I + h) % W)...);
}
PAGEDCORE_INLINE float hsum(vf v) {
  constexpr auto seq = std::make_integer_sequence<int, W>{};
  if constexpr (W >= 16) v += rotate<8>(v, seq);
  if constexpr (W >= 8) v += rotate<4>(v, seq);
  v += rotate<2>(v, seq);
  v += rotate<1>(v, seq);
  return v[0];
}
PAGEDCORE_INLINE float hmax(vf v) {
  constexpr auto seq = std::make_integer_sequence<int, W>{};
  if constexpr (W >= 16) v = vmax(v, rotate<8>(v, seq));
  if constexpr (W >= 8) v = vmax(v, rotate<4>(v, seq));
  v = vmax(v, rotate<2>(v, seq));
  v = vmax(v, rotate<1>(v, seq));
  return v[0];
}

// ---- transpose-sum: W vectors of W partial sums -> one vector of W totals ----------------
// Lane j of the result is the sum of all lanes of p[j]. log2(W) levels; each level halves
// the partial lanes per key and doubles the keys per vector with two shuffles and an add:
// W - 1 combines in all, much cheaper than W separate horizontal sums.
constexpr int combine_index(int o, int w) {
  // Inputs hold W / w keys with w partial lanes each; output lane o is partial r of key k.
  const int n = W / w, half = w / 2, k = o / half, r = o % half;
  return k < n ? k * w + r : W + (k - n) * w + r;
}
template <int w, int... I>
PAGEDCORE_INLINE vf combine(vf a, vf b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, combine_index(I, w)...) +
         __builtin_shufflevector(a, b, (combine_index(I, w) + w / 2)...);
}
PAGEDCORE_INLINE vf transpose_sum(vf* p) {
  constexpr auto seq = std::make_integer_sequence<int, W>{};
  static_assert(W >= 4 && W <= 16, "transpose_sum supports 4 to 16 lanes");
  for (int j = 0; j < W / 2; ++j) p[j] = combine<W>(p[2 * j], p[2 * j + 1], seq);
  for (int j = 0; j < W / 4; ++j) p[j] = combine<W / 2>(p[2 * j], p[2 * j + 1], seq);
  if constexpr (W >= 8) {
    for (int j = 0; j < W / 8; ++j) p[j] = combine<W / 4>(p[2 * j], p[2 * j + 1], seq);
  }
  if constexpr (W >= 16) {
    for (int j = 0; j < W / 16; ++j) p[j] = combine<W / 8>(p[2 * j], p[2 * j + 1], seq);
  }
  return p[0];
}

// ---- transpose: W x W block in place, rows[r][c] -> rows[c][r] --------------------------
// One stage per bit h of the lane index swaps that bit between row and column: W log2(W)
// two-source shuffles in all.
constexpr int swap_index(int c, int h, bool upper) {
  return (c & h) == 0 ? (upper ? c + h : c) : (upper ? W + c : W + c - h);
}
template <int h, int... I>
PAGEDCORE_INLINE void transpose_stage(vf* rows, std::integer_sequence<int, I...>) {
  for (int r = 0; r < W; ++r) {
    if ((r & h) != 0) continue;
    const vf a = rows[r], b = rows[r + h];
    rows[r] = __builtin_shufflevector(a, b, swap_index(I, h, false)...);
    rows[r + h] = __builtin_shufflevector(a, b, swap_index(I, h, true)...);
  }
}
PAGEDCORE_INLINE void transpose(vf* rows) {
  constexpr auto seq = std::make_integer_sequence<int, W>{};
  transpose_stage<1>(rows, seq);
  transpose_stage<2>(rows, seq);
  if constexpr (W >= 8) transpose_stage<4>(rows, seq);
  if constexpr (W >= 16) transpose_stage<8>(rows, seq);
}

// ---- exp and tanh ---------------------------------------------------------------------------
// exp: Cephes' polynomial after reduction by ln 2 (about 1 ulp); exactly 0 below -87.3 (so
// exp(-inf) == 0, which masked scores rely on); NaN stays NaN.
PAGEDCORE_INLINE vf exp(vf x) {
  const vf hi = splat(88.0f), lo = splat(-87.3f);
  const vf xc = x > hi ? hi : (x < lo ? lo : x);
  // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick (no rounding-mode
  // dependence, vectorizes everywhere).
  const vf magic = splat(12582912.0f);
  const vf t = xc * 1.44269504088896341f + magic;
  const vf n = t - magic;
  const vi ni = (vi)t - (vi)magic;
  vf r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const vf scale = (vf)((ni + 127) << 23);
  return x < lo ? vf{} : y * scale;
}

// cap * tanh(x), via tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|).
PAGEDCORE_INLINE vf softcap(vf x, float cap) {
  const vf ax = x < 0 ? -x : x;
  const vf e = exp(-2.0f * ax);
  const vf t = (1.0f - e) / (1.0f + e);
  return (x < 0 ? -t : t) * cap;
}

// ---- 16-bit floats ------------------------------------------------------------------------
PAGEDCORE_INLINE vf load_bf16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

// IEEE half -> float, exact, including subnormals, inf and NaN (F. Giesen's method).
PAGEDCORE_INLINE vf load_fp16(const uint16_t* p) {
  vh h16;
  std::memcpy(&h16, p, sizeof h16);
  const vu h = __builtin_convertvector(h16, vu);
  const vu e = h & 0x7c00u;
  const vu o = ((h & 0x7fffu) << 13) + (112u << 23);
  const vf normal = (vf)o;
  const vf infnan = (vf)(o + (112u << 23));                    // exponent 255
  const vf sub = (vf)(o + (1u << 23)) - 6.103515625e-05f;      // renormalize: - 2^-14
  const vf f = (vi)e == 0x7c00 ? infnan : ((vi)e == 0 ? sub : normal);
  return (vf)((vu)f | ((h & 0x8000u) << 16));
}

// float -> bfloat16, round to nearest even; NaN stays NaN (quiet).
PAGEDCORE_INLINE uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// float -> IEEE half, round to nearest even; overflow -> inf; NaN stays NaN.
PAGEDCORE_INLINE uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t h;
  if (x >= 0x7f800000u) {
    h = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (x >= 0x477ff000u) {  // >= 65520 rounds to inf
    h = 0x7c00u;
  } else if (x < 0x38800000u) {  // < 2^-14: subnormal or zero; the FPU adds and rounds
    float a;
    std::memcpy(&a, &x, sizeof a);
    a += 0.5f;
    uint32_t u;
    std::memcpy(&u, &a, sizeof u);
    h = u - 0x3f000000u;
  } else {
    const uint32_t odd = (x >> 13) & 1u;
    x += (uint32_t(15 - 127) << 23) + 0xfffu + odd;
    h = x >> 13;
  }
  return static_cast<uint16_t>(h | sign);
}
