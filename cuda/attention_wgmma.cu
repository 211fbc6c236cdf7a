// Prefill attention on Hopper tensor cores (sm_90a): wgmma from shared memory.
//
// One CTA (two warpgroups, 256 threads) takes a (work item, kv head, key
// split) of the plan, like the mma.sync kernel: a tile of up to 128 query
// vectors (query tokens x the query heads of one kv head, GQA), warpgroup g
// owning vectors 64g..64g+63. Q is copied once into shared memory; keys stream
// through in tiles of 128, gathered row by row through the block table with
// cp.async into the 128-byte swizzled layout wgmma reads (wgmma_ops.cuh).
// Per key tile t each warpgroup
//   issues S_t = Q K_t^T        (wgmma m64n128k16, A and B from shared memory),
//   issues O += P_{t-1} V_{t-1} (wgmma m64nHDk16, P from registers),
//   waits for S_t, masks it (diagonal tiles, window, tile end) and runs the
//   online softmax while the P V product is still in the tensor cores,
//   waits for P V, rescales O if the running max moved.
// Meanwhile all threads' cp.async copies bring K_{t+2} and V_{t+1} (three
// buffers each). Scores, softmax and O are float32; P is rounded to the query
// type.
#include "attention_wgmma.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention_merge.cuh"
#include "attention_mma.h"
#include "pagedcore/cuda/kernels.h"
#include "wgmma_ops.cuh"

namespace pagedcore::cuda {

namespace {

constexpr int kRows = kAttentionMmaTileVectors;  // query vectors per CTA
constexpr int kKeys = 128;                       // keys per shared-memory tile
constexpr int kThreads = 256;                    // two warpgroups of 64 rows
constexpr int kStages = 3;                       // K tiles (and V tiles) in shared memory
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kRows == 128, "two warpgroups of 64 rows");

template <int HD>
__host__ __device__ constexpr int tile_bytes(int rows) {
  return rows * HD * 2;
}
// Q, kStages K tiles, kStages V tiles, and room to align the start to 1024
// bytes (head dim 128: 225 KiB of the 227 a CTA may have).
template <int HD>
__host__ __device__ constexpr size_t smem_bytes() {
  return 1024 + tile_bytes<HD>(kRows) + 2 * kStages * tile_bytes<HD>(kKeys);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// SOFTCAP: p.softcap > 0 (its tanh costs registers the common case should not pay).
template <typename T, int HD, bool SOFTCAP>
__global__ void __launch_bounds__(kThreads, 1) wgmma_prefill_kernel(const __grid_constant__ PagedAttentionParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int CH = HD / 8;               // 16-byte chunks of a row
  constexpr int KSTEPS = HD / 16;          // k steps of S = Q K^T
  constexpr int SN = kKeys / 2;            // score registers per thread (64)
  constexpr int ON = HD / 2;               // output registers per thread
  constexpr int PK = kKeys / 16;           // k steps of O += P V (8)
  constexpr int TB = tile_bytes<HD>(kKeys);
  static_assert(HD == 64 || HD == 128, "head dim");

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = wgmma::smem_addr(smem_raw);
  const uint32_t q_s = (raw + 1023u) & ~1023u;  // swizzle atoms sit on 1024-byte boundaries
  const uint32_t k_s = q_s + tile_bytes<HD>(kRows);
  const uint32_t v_s = k_s + kStages * TB;

  const int kv_head = blockIdx.x;
  const int work = blockIdx.y;
  const int split = blockIdx.z;
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int warp = (tid / 32) % 4;  // within the warpgroup
  const int lane = tid % 32;
  const int qd = lane % 4;
  const int group = p.num_heads / p.num_kv_heads;
  const int row = p.work_seq[work];
  const int t0 = p.work_q_start[work];
  const int splits = p.num_splits;
  const int q_begin = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q_begin;
  const int tile_tokens = min(p.tile_tokens, q_len - t0);
  const int ctx = p.seq_lens[row];
  const int num_vectors = tile_tokens * group;
  const int first_pos = ctx - q_len + t0;
  const int last_pos = first_pos + tile_tokens - 1;
  const int window = p.sliding_window;
  const int k_lo = window > 0 ? max(0, first_pos - window + 1) : 0;
  const int k_hi = last_pos + 1;
  const int per_split = (k_hi - k_lo + splits - 1) / splits;
  const int s_lo = k_lo + split * per_split;
  const int s_hi = min(k_hi, s_lo + per_split);
  const int n_tiles = s_hi > s_lo ? (s_hi - s_lo + kKeys - 1) / kKeys : 0;

  // This thread's two accumulator rows (vectors) and their positions.
  const int vr[2] = {64 * wg + 16 * warp + lane / 4, 64 * wg + 16 * warp + lane / 4 + 8};
  bool vvalid[2];
  int key_from[2], key_to[2];  // keys row r sees: [key_from, key_to] (empty for padding rows)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    vvalid[r] = vr[r] < num_vectors;
    const int pos = first_pos + vr[r] / group;
    key_from[r] = window > 0 ? pos - window + 1 : 0;
    key_to[r] = vvalid[r] ? min(pos, s_hi - 1) : -1;
  }

  // Q -> shared memory (zeros for padding vectors).
  {
    const T* query = static_cast<const T*>(p.query);
    for (int i = tid; i < kRows * CH; i += kThreads) {
      const int v = i / CH;
      const int c = i % CH;
      const bool valid = v < num_vectors;
      const T* src = query;
      if (valid) {
        src = query + static_cast<int64_t>(q_begin + t0 + v / group) * p.query_stride +
              static_cast<int64_t>(kv_head * group + v % group) * HD + c * 8;
      }
      wgmma::cp_async16(q_s + wgmma::swizzled<kRows>(v, c), src, valid);
    }
  }

  const T* key_base = static_cast<const T*>(p.key_cache) + kv_head * HD;
  const T* value_base = static_cast<const T*>(p.value_cache) + kv_head * HD;
  const int32_t* table = p.block_tables + static_cast<int64_t>(row) * p.block_tables_stride;
  const int bs = p.block_size;
  const int bs_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
  const int slot_elems = p.num_kv_heads * HD;
  const int64_t block_elems = static_cast<int64_t>(bs) * slot_elems;
  // NOTE: CH consecutive threads copy one key row (whole 128-byte lines per
  // warp instruction); keys at or past s_hi are zero-filled, never read, so
  // their V rows add 0 * 0 to O.
  constexpr int PASS_ROWS = kThreads / CH;
  const int my_chunk = tid % CH;
  const int my_row = tid / CH;
  auto load_tile = [&](uint32_t dst, const T* cache, int kbase) {
#pragma unroll
    for (int pass = 0; pass < kKeys / PASS_ROWS; ++pass) {
      const int j = pass * PASS_ROWS + my_row;
      const int key = kbase + j;
      const bool valid = key < s_hi;
      const T* src = cache;
      if (valid) {
        const int b = bs_shift >= 0 ? key >> bs_shift : key / bs;
        src = cache + static_cast<int64_t>(table[b]) * block_elems + static_cast<int64_t>(key - b * bs) * slot_elems +
              my_chunk * 8;
      }
      wgmma::cp_async16(dst + wgmma::swizzled<kKeys>(j, my_chunk), src, valid);
    }
  };

  // Groups of copies: {Q, K_0}, {K_1, V_0}, then one per tile t: {K_{t+2}, V_{t+1}}
  // (empty past the end); a tile's copies are waited for one tile ahead.
  if (n_tiles > 0) load_tile(k_s, key_base, s_lo);
  wgmma::cp_async_commit();
  if (n_tiles > 1) load_tile(k_s + TB, key_base, s_lo + kKeys);
  if (n_tiles > 0) load_tile(v_s, value_base, s_lo);
  wgmma::cp_async_commit();
  wgmma::cp_async_wait<1>();
  wgmma::fence_proxy_async();
  __syncthreads();

  const float softcap = p.softcap;
  const float score_log2 = p.scale * kLog2e;
  const float softcap_log2 = softcap * kLog2e;
  const float cap_scale = softcap > 0.f ? p.scale / softcap : 0.f;

  float o[ON];
#pragma unroll
  for (int i = 0; i < ON; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max, log2 units
  float l[2] = {0.f, 0.f};              // this thread's share of the running sum
  uint32_t pa[PK][4];                   // P of the previous tile: A fragments of O += P V
#pragma unroll
  for (int k = 0; k < PK; ++k) pa[k][0] = pa[k][1] = pa[k][2] = pa[k][3] = 0u;
  const uint32_t q_wg = q_s + wg * 64 * 128;  // this warpgroup's 64 rows (8 atoms of 8 rows)

#pragma unroll 1
  for (int t = 0; t < n_tiles; ++t) {
    const int kbase = s_lo + t * kKeys;
    // Buffers of K_t, V_t (stage t % kStages) and of the previous tile.
    const int st = t % kStages;
    const int st_prev = st == 0 ? kStages - 1 : st - 1;
    const int st_next = st == kStages - 1 ? 0 : st + 1;
    // K_{t+2} and V_{t+1} into the buffers that S_{t-1} and P_{t-2} V_{t-2}
    // read (stage (t + 2) % 3 = (t - 1) % 3, (t + 1) % 3 = (t - 2) % 3), both
    // retired before the barrier that closed tile t-1.
    static_assert(kStages == 3, "the buffer rotation below");
    if (t + 2 < n_tiles) load_tile(k_s + st_prev * TB, key_base, kbase + 2 * kKeys);
    if (t + 1 < n_tiles) load_tile(v_s + st_next * TB, value_base, kbase + kKeys);
    wgmma::cp_async_commit();

    float s[SN];
    __syncwarp();
    wgmma::pin(o);
    wgmma::pin(pa);
    wgmma::fence();
    const uint32_t kt = k_s + st * TB;
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      const uint32_t qa = q_wg + (k / 4) * (kRows * 128) + (k % 4) * 32;
      const uint32_t kb = kt + (k / 4) * (kKeys * 128) + (k % 4) * 32;
      wgmma::mma_ss_n128<T>(s, wgmma::desc(qa, 16, 1024), wgmma::desc(kb, 16, 1024), k > 0);
    }
    wgmma::commit();
    if (t > 0) {
      const uint32_t vt = v_s + st_prev * TB;
#pragma unroll
      for (int k = 0; k < PK; ++k) wgmma::mma_rs<T, HD>(o, pa[k], wgmma::desc(vt + k * 2048, kKeys * 128, 1024));
      wgmma::commit();
      wgmma::wait<1>();
    } else {
      wgmma::wait<0>();
    }
    wgmma::pin(s);

    // Scale, cap, mask: s[4n + 2r + c] is row r, key kbase + 8n + 2qd + c.
    const bool whole = vvalid[0] && vvalid[1] && kbase + kKeys <= s_hi && kbase + kKeys - 1 <= key_to[0] &&
                       kbase >= key_from[1];
    if constexpr (SOFTCAP) {
#pragma unroll
      for (int i = 0; i < SN; ++i) s[i] = softcap_log2 * tanhf(s[i] * cap_scale);
    } else {
#pragma unroll
      for (int i = 0; i < SN; ++i) s[i] *= score_log2;
    }
    if (!whole) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int key = kbase + 8 * n + 2 * qd + c;
            const bool seen = key >= key_from[r] && key <= key_to[r];
            s[4 * n + 2 * r + c] = seen ? s[4 * n + 2 * r + c] : -INFINITY;
          }
        }
      }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int r = 0; r < 2; ++r) tile_max[r] = fmaxf(tile_max[r], fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
    }
    // NOTE: the running max moves only when a row's max grew by more than
    // kSlack (log2 units) — exponentials stay <= 2^kSlack — so most tiles skip
    // rescaling O.
    constexpr float kSlack = 8.f;
    float corr[2] = {1.f, 1.f};
    bool grow = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      if (tile_max[r] > m[r] + kSlack) {
        corr[r] = fast_exp2(m[r] - tile_max[r]);  // m = -inf: 0 (O and l are still 0)
        m[r] = tile_max[r];
        l[r] *= corr[r];
        grow = true;
      }
    }
    uint32_t pn[PK][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float base = m[r] == -INFINITY ? 0.f : m[r];
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        const float e0 = fast_exp2(s[4 * n + 2 * r] - base);
        const float e1 = fast_exp2(s[4 * n + 2 * r + 1] - base);
        l[r] += e0 + e1;
        // A fragment of k step n / 2: registers 0/1 (rows g / g+8) hold keys
        // 2qd, 2qd+1 of its first 8, registers 2/3 the same of its second 8.
        pn[n / 2][2 * (n % 2) + r] = pack2<T>(e0, e1);
      }
    }

    wgmma::wait<0>();  // P_{t-1} V_{t-1} has landed in O
    wgmma::pin(o);
    wgmma::pin(pa);
    if (grow) {
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        o[4 * n] *= corr[0];
        o[4 * n + 1] *= corr[0];
        o[4 * n + 2] *= corr[1];
        o[4 * n + 3] *= corr[1];
      }
    }
#pragma unroll
    for (int k = 0; k < PK; ++k) {
#pragma unroll
      for (int i = 0; i < 4; ++i) pa[k][i] = pn[k][i];
    }
    wgmma::cp_async_wait<1>();  // K_{t+1}, V_t (the group of tile t-1)
    wgmma::fence_proxy_async();
    __syncthreads();
  }
  if (n_tiles > 0) {
    const uint32_t vt = v_s + ((n_tiles - 1) % kStages) * TB;
    __syncwarp();
    wgmma::pin(o);
    wgmma::pin(pa);
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < PK; ++k) wgmma::mma_rs<T, HD>(o, pa[k], wgmma::desc(vt + k * 2048, kKeys * 128, 1024));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o);
  }
  wgmma::cp_async_wait<0>();  // (empty groups by now; the merge reuses the buffers)

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  // o[4n + 2r + c] is row r, head dim 8n + 2qd + c.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!vvalid[r]) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const int v = vr[r];
    if (splits == 1) {
      const int64_t tok = q_begin + t0 + v / group;
      const int head = kv_head * group + v % group;
      T* dst = static_cast<T*>(p.out) + (tok * p.num_heads + head) * HD + 2 * qd;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        *reinterpret_cast<uint32_t*>(dst + 8 * n) = pack2<T>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      }
    } else {
      const int64_t slot =
          ((static_cast<int64_t>(work) * p.num_kv_heads + kv_head) * splits + split) * kAttentionPartialVectors + v;
      float* dst = p.partial_out + slot * HD + 2 * qd;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      }
      if (qd == 0) {
        p.partial_lse[2 * slot] = m[r] == -INFINITY ? -FLT_MAX : m[r] * kLn2;
        p.partial_lse[2 * slot + 1] = l[r];
      }
    }
  }
  if (splits > 1 && p.split_counters != nullptr) {
    // The last split of this (item, kv head) to finish merges them all; its
    // scratch is the K/V buffers (every wgmma and copy has retired).
    __syncthreads();
    unsigned char* const scratch = smem_raw + (k_s - raw);
    merge::count_and_merge<T, HD, kThreads, false>(p, work, kv_head, reinterpret_cast<float*>(scratch));
  }
#endif
}

template <typename T, int HD, bool SOFTCAP>
int launch(const PagedAttentionParams& p, cudaStream_t stream) {
  constexpr size_t smem = smem_bytes<HD>();
  static_assert(smem - 1024 - tile_bytes<HD>(kRows) >= merge::kScratchFloats * 4, "split merge space");
  static bool configured = false;  // NOTE: per instantiation; raising the limit is idempotent
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(wgmma_prefill_kernel<T, HD, SOFTCAP>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    configured = true;
  }
  if (p.num_work > 65535) return cudaErrorInvalidConfiguration;
  wgmma_prefill_kernel<T, HD, SOFTCAP><<<dim3(p.num_kv_heads, p.num_work, p.num_splits), kThreads, smem, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || p.num_splits == 1 || p.split_counters != nullptr) return e;
  return merge_attention_splits(p, false, stream);
}

template <typename T>
int dispatch_head_dim(const PagedAttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return p.softcap > 0.f ? launch<T, 64, true>(p, stream) : launch<T, 64, false>(p, stream);
    case 128: return p.softcap > 0.f ? launch<T, 128, true>(p, stream) : launch<T, 128, false>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Compute capability 9.0 (what sm_90a code runs on), per device, asked once.
bool device_is_sm90() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    return false;
  }
  if (cached[dev] == 0) {
    int major = 0, minor = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
    if (!ok) cudaGetLastError();
    cached[dev] = ok && major == 9 && minor == 0 ? 1 : 2;
  }
  return cached[dev] == 1;
}

}  // namespace

bool wgmma_prefill_available() { return device_is_sm90(); }

bool wgmma_prefill_serves(const PagedAttentionParams& p) {
  // NOTE: read on every call (a getenv per layer is noise) so that a process
  // can switch kernels, as the tests and benchmarks do.
  const char* choice = std::getenv("PAGEDCORE_PREFILL_KERNEL");
  if (choice == nullptr || std::strcmp(choice, "wgmma") != 0) return false;
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (p.kv_dtype != p.dtype || (p.head_dim != 64 && p.head_dim != 128)) return false;
  if (p.tile_tokens * (p.num_heads / p.num_kv_heads) > kRows) return false;
  if (!aligned16(p.query) || !aligned16(p.key_cache) || !aligned16(p.value_cache) || !aligned16(p.out) ||
      p.query_stride % 8 != 0) {
    return false;
  }
  return device_is_sm90();
}

int paged_attention_wgmma(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_work == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return dispatch_head_dim<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedcore::cuda
