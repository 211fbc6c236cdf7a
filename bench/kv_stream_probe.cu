// How fast a decode launch's K/V tiles stream through shared memory when the
// math is taken away (issue 13: fp8 B=64 L=4k runs at 3.6-3.7 TB/s, bf16 at
// 4.4, whatever the fp8 kernel computes — widened or on wgmma). Each CTA takes
// one (row, kv head) of the benchmark's shape (B=64 rows of 4096 keys, 8 kv
// heads, head dim 128, block size 16, blocks shuffled) and moves its keys
// through STAGES tiles of KT keys as the decode kernels do: by TMA (warp 0,
// one box per cache block and K / V, the stage's mbarrier) or by cp.async (16
// bytes a thread, 8 threads a row). "Math" is a dependent chain of `work` FMAs
// per thread and tile after each tile lands. Extra shared memory sets the CTAs
// an SM. Prints us per launch (median) and the K/V bytes read per second.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icuda -Icuda/include \
//     bench/kv_stream_probe.cu -o /tmp/kv_stream_probe && /tmp/kv_stream_probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "tensor_map.cuh"
#include "wgmma_ops.cuh"

namespace {

using namespace pagedcore::cuda;

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kRows = 64, kKeys = 4096, kKvHeads = 8, kBs = 16;
constexpr int kThreads = 128;

struct Params {
  const uint8_t* k;
  const uint8_t* v;
  const int32_t* tables;  // [rows][keys / bs]
  float* out;             // [rows][kv heads][threads] (keeps the loads alive)
  int row_bytes;          // 128 (fp8 at head dim 128) or 256 (bf16)
  int work;               // FMAs a thread per tile
};

struct Maps {
  CUtensorMap k, v;
};

// TMA (MODE 0; 128-byte rows only) or cp.async (MODE 1).
template <int MODE, int KT, int STAGES>
__global__ void __launch_bounds__(kThreads) stream_kernel(Params p, const __grid_constant__ Maps maps) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (wgmma::smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t base = wgmma::smem_addr(smem);
  const int rb = p.row_bytes;
  const int tile_bytes = KT * rb;
  int32_t* s_table = reinterpret_cast<int32_t*>(smem + STAGES * 2 * tile_bytes);
  const uint32_t bars = wgmma::smem_addr(s_table + kKeys / kBs);
  const int kv_head = blockIdx.x, row = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) wgmma::mbar_init(bars + 8 * s, 1);
    wgmma::mbar_init_fence();
  }
  for (int i = threadIdx.x; i < kKeys / kBs; i += kThreads) s_table[i] = p.tables[row * (kKeys / kBs) + i];
  __syncthreads();
  const int64_t slot = static_cast<int64_t>(kKvHeads) * rb;  // one token, all kv heads
  auto issue = [&](int t) {
    const int st = t % STAGES;
    if constexpr (MODE == 0) {
      if (warp != 0) return;
      const bool load = lane * kBs < KT;
      const uint32_t bar = bars + 8 * st;
      if (lane == 0) {
        wgmma::fence_proxy_async();
        wgmma::mbar_arrive_expect_tx(bar, (KT / kBs) * kBs * rb * 2);
      }
      __syncwarp();
      if (load) {
        const uint32_t dst = base + st * 2 * tile_bytes + lane * kBs * rb;
        const int block = s_table[(t * KT + lane * kBs) / kBs];
        wgmma::tma_load_4d(dst, &maps.k, 0, kv_head, 0, block, bar);
        wgmma::tma_load_4d(dst + tile_bytes, &maps.v, 0, kv_head, 0, block, bar);
      }
    } else {
      const int chunks = rb / 16;  // per row
      for (int i = threadIdx.x; i < KT * chunks; i += kThreads) {
        const int r = i / chunks, c = i % chunks;
        const int key = t * KT + r;
        const int64_t off = static_cast<int64_t>(s_table[key / kBs]) * kBs * slot + (key % kBs) * slot +
                            static_cast<int64_t>(kv_head) * rb + 16 * c;
        const uint32_t dst = base + st * 2 * tile_bytes + r * rb + ((16 * c) ^ ((r & 7) << 4));
        wgmma::cp_async16(dst, p.k + off, true);
        wgmma::cp_async16(dst + tile_bytes, p.v + off, true);
      }
      wgmma::cp_async_commit();
    }
  };
  const int n_tiles = kKeys / KT;
  for (int t = 0; t < STAGES - 1; ++t) issue(t);
  float acc = 0.f;
  uint32_t phase = 0;
  for (int t = 0; t < n_tiles; ++t) {
    const int st = t % STAGES;
    if constexpr (MODE == 0) {
      wgmma::mbar_wait(bars + 8 * st, (phase >> st) & 1u);
      phase ^= 1u << st;
      __syncthreads();
      if (t + STAGES - 1 < n_tiles) issue(t + STAGES - 1);
    } else {
      wgmma::cp_async_wait<STAGES - 2>();
      __syncthreads();
      if (t + STAGES - 1 < n_tiles) {
        issue(t + STAGES - 1);
      } else {
        wgmma::cp_async_commit();  // (an empty group keeps the wait's count)
      }
    }
    const float4 kv = *reinterpret_cast<const float4*>(smem + st * 2 * tile_bytes + (threadIdx.x * 16) % tile_bytes);
    float x = kv.x;
    for (int i = 0; i < p.work; ++i) x = fmaf(x, 1.0001f, kv.y);
    acc += x;
  }
  if constexpr (MODE == 1) wgmma::cp_async_wait<0>();
  p.out[(row * kKvHeads + kv_head) * kThreads + threadIdx.x] = acc;
}

template <int MODE, int KT, int STAGES>
void run(const Params& p0, const Maps& maps, int row_bytes, int ctas_per_sm, int work) {
  Params p = p0;
  p.row_bytes = row_bytes;
  p.work = work;
  auto* kernel = stream_kernel<MODE, KT, STAGES>;
  const size_t need = 1024 + static_cast<size_t>(STAGES) * 2 * KT * row_bytes + (kKeys / kBs) * 4 + 8 * STAGES;
  int device = 0, sm_smem = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  // Pad the CTA's shared memory so that `ctas_per_sm` fit (1 KB reserved per CTA).
  const size_t smem = std::max(need, static_cast<size_t>(sm_smem / ctas_per_sm - 1024) / 1024 * 1024 - 1024);
  if (smem < need || smem > 227 * 1024) {
    std::printf("%-8s KT=%3d stages=%d row=%3dB CTAs/SM=%d: does not fit (%zu bytes)\n", MODE == 0 ? "TMA" : "cp.async",
                KT, STAGES, row_bytes, ctas_per_sm, need);
    return;
  }
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int active = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&active, kernel, kThreads, smem));
  const dim3 grid(kKvHeads, kRows);
  for (int i = 0; i < 3; ++i) kernel<<<grid, kThreads, smem>>>(p, maps);
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> us;
  constexpr int kIters = 20;
  for (int r = 0; r < 7; ++r) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < kIters; ++i) kernel<<<grid, kThreads, smem>>>(p, maps);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(1000.f * ms / kIters);
  }
  std::sort(us.begin(), us.end());
  const double bytes = 2.0 * kRows * kKeys * kKvHeads * row_bytes;
  std::printf("%-8s KT=%3d stages=%d row=%3dB CTAs/SM=%d (occupancy %d) work=%5d: %7.1f us  %5.2f TB/s\n",
              MODE == 0 ? "TMA" : "cp.async", KT, STAGES, row_bytes, ctas_per_sm, active, work, us[us.size() / 2],
              bytes / (us[us.size() / 2] * 1e-6) / 1e12);
}

bool encode(CUtensorMap* map, const void* base, int num_blocks,
            CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  const EncodeTiledFn fn = tensor_map_encoder();
  if (fn == nullptr) return false;
  const cuuint64_t dims[4] = {128, kKvHeads, kBs, static_cast<cuuint64_t>(num_blocks)};
  const cuuint64_t strides[3] = {128, 128 * kKvHeads, 128 * kKvHeads * kBs};
  const cuuint32_t box[4] = {128, 1, kBs, 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

int main() {
  const int per_row = kKeys / kBs;
  const int num_blocks = kRows * per_row + 1;
  std::vector<int32_t> tables(kRows * per_row);
  std::iota(tables.begin(), tables.end(), 1);
  std::shuffle(tables.begin(), tables.end(), std::mt19937(0));
  // The caches sized for 256-byte rows (bf16); 128-byte rows use their first half's layout.
  const size_t cache_bytes = static_cast<size_t>(num_blocks) * kBs * kKvHeads * 256;
  uint8_t *k = nullptr, *v = nullptr;
  int32_t* t = nullptr;
  float* out = nullptr;
  CHECK(cudaMalloc(&k, cache_bytes));
  CHECK(cudaMalloc(&v, cache_bytes));
  CHECK(cudaMemset(k, 0x11, cache_bytes));
  CHECK(cudaMemset(v, 0x22, cache_bytes));
  CHECK(cudaMalloc(&t, tables.size() * 4));
  CHECK(cudaMemcpy(t, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&out, static_cast<size_t>(kRows) * kKvHeads * kThreads * 4));
  Maps maps;
  if (!encode(&maps.k, k, num_blocks) || !encode(&maps.v, v, num_blocks)) {
    std::fprintf(stderr, "no tensor maps\n");
    return 1;
  }
  const Params p{k, v, t, out, 128, 0};
  std::printf("B=%d L=%d, %d kv heads, block size %d, shuffled blocks\n", kRows, kKeys, kKvHeads, kBs);
  // fp8 rows (128 bytes): the decode kernels' shapes, copy only, then with math.
  run<0, 128, 3>(p, maps, 128, 2, 0);
  run<1, 128, 3>(p, maps, 128, 2, 0);
  run<0, 128, 3>(p, maps, 128, 1, 0);
  run<0, 128, 4>(p, maps, 128, 1, 0);
  run<0, 128, 6>(p, maps, 128, 1, 0);
  run<0, 64, 4>(p, maps, 128, 3, 0);
  run<0, 64, 6>(p, maps, 128, 2, 0);
  run<0, 32, 8>(p, maps, 128, 3, 0);
  for (int work : {64, 256, 1024}) run<0, 128, 3>(p, maps, 128, 2, work);
  // The boxes' L2 promotion (256 bytes above: a 128-byte row and the next kv
  // head's, as the kernels asked until 9623a34; the mma.sync decode now asks
  // for 128), then cp.async deeper or at three CTAs an SM.
  const struct {
    CUtensorMapL2promotion value;
    const char* name;
  } promotions[] = {{CU_TENSOR_MAP_L2_PROMOTION_NONE, "none"},
                    {CU_TENSOR_MAP_L2_PROMOTION_L2_64B, "64B"},
                    {CU_TENSOR_MAP_L2_PROMOTION_L2_128B, "128B"}};
  for (const auto& promo : promotions) {
    Maps other;
    if (!encode(&other.k, k, num_blocks, promo.value) || !encode(&other.v, v, num_blocks, promo.value)) return 1;
    std::printf("L2 promotion %s:\n", promo.name);
    run<0, 128, 3>(p, other, 128, 2, 0);
    run<0, 128, 4>(p, other, 128, 1, 0);
    run<0, 128, 3>(p, other, 128, 2, 256);
  }
  run<1, 128, 4>(p, maps, 128, 2, 0);
  run<1, 128, 3>(p, maps, 128, 3, 0);
  run<1, 64, 4>(p, maps, 128, 3, 0);
  run<1, 128, 3>(p, maps, 128, 2, 256);
  // bf16 rows (256 bytes) by cp.async: the 16-bit decode kernel's shape (64-key tiles, 3 stages).
  run<1, 64, 3>(p, maps, 256, 2, 0);
  run<1, 64, 3>(p, maps, 256, 2, 256);
  return 0;
}
