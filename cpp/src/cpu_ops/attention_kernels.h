// The paged-attention kernels for one instruction set (internal; not installed).
//
// NOTE: no include guard on purpose: attention.cpp includes this file once per
// instruction set, after simd.h, inside a namespace that defines `constexpr int W` and
// under a `#pragma GCC target` region (see simd.h for why). It uses the shared types of
// attention.cpp (Problem, WorkItem, Scratch, kChunk, ...).
//
// Two kernels, both streaming the keys in chunks of kChunk with an online softmax:
// * decode_item: at most kMaxDecodeQueries query vectors; vectors run along head_dim
//   and the scores of W keys come out of one transpose_sum.
// * lanes_item: up to 4 * W query vectors side by side in the lanes (NV vectors), so
//   Q K^T and P V are outer products: every key / value element is broadcast against
//   all lanes, no horizontal reduction and no transpose of K / V.

// ---- loads and stores by dtype --------------------------------------------------------------

template <int D>
PAGEDCORE_INLINE void load_row(DType dtype, const void* base, int64_t offset, float* dst,
                               float scale) {
  static_assert(D % W == 0, "head_dim must be a multiple of the vector width");
  switch (dtype) {
    case DType::kFloat32: {
      const float* src = static_cast<const float*>(base) + offset;
      for (int c = 0; c < D; c += W) store(dst + c, load(src + c) * scale);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int c = 0; c < D; c += W) store(dst + c, load_bf16(src + c) * scale);
      break;
    }
    case DType::kFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int c = 0; c < D; c += W) store(dst + c, load_fp16(src + c) * scale);
      break;
    }
  }
}

// Writes D fp32 values as dtype (16-bit: round to nearest even).
template <int D>
PAGEDCORE_INLINE void store_row(DType dtype, void* base, int64_t offset, const float* src) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(static_cast<float*>(base) + offset, src, D * sizeof(float));
      break;
    case DType::kBFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int d = 0; d < D; ++d) dst[d] = float_to_bf16(src[d]);
      break;
    }
    case DType::kFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int d = 0; d < D; ++d) dst[d] = float_to_fp16(src[d]);
      break;
    }
  }
}

// Points s.krow / s.vrow at keys / values k0 .. k0 + nk - 1 of one kv head of a row
// (widening 16-bit caches into s.kbuf / s.vbuf), and rows nk .. padded - 1 at zeros.
// NOTE: software prefetching of the next chunk was measured and did not pay (decode
// 32 x 512 and 8 x 2048: no gain; prefill: 10-20% slower), so there is none.
template <int D>
PAGEDCORE_INLINE void gather_chunk(const PagedAttentionArgs& a, const int32_t* table,
                                   int64_t kv_head, int32_t k0, int nk, int padded,
                                   Scratch& s) {
  const int64_t bs = a.block_size;
  int64_t block = k0 / bs, offset = k0 % bs;
  for (int j = 0; j < nk; ++j) {
    const int64_t at = ((int64_t{table[block]} * bs + offset) * a.num_kv_heads + kv_head) * D;
    if (a.dtype == DType::kFloat32) {
      s.krow[j] = static_cast<const float*>(a.key_cache) + at;
      s.vrow[j] = static_cast<const float*>(a.value_cache) + at;
    } else {
      load_row<D>(a.dtype, a.key_cache, at, s.kbuf + j * D, 1.0f);
      load_row<D>(a.dtype, a.value_cache, at, s.vbuf + j * D, 1.0f);
      s.krow[j] = s.kbuf + j * D;
      s.vrow[j] = s.vbuf + j * D;
    }
    if (++offset == bs) {
      offset = 0;
      ++block;
    }
  }
  for (int j = nk; j < padded; ++j) s.krow[j] = s.vrow[j] = s.zero;
}

// ---- decode kernel: few query vectors, vectors along head_dim ----------------------------

template <int D>
PAGEDCORE_INLINE void decode_item(const Problem& p, const WorkItem& w, Scratch& s) {
  constexpr int C = D / W;  // vectors per row
  // Queries per P V group: their accumulators take about half the vector registers.
  constexpr int QG = std::max(1, std::min(4, (W >= 16 ? 16 : 8) / C));
  const PagedAttentionArgs& a = p.a;
  const int32_t q_start = a.query_start_loc[w.row];
  const int32_t pos0 = a.seq_lens[w.row] - (a.query_start_loc[w.row + 1] - q_start);
  const int32_t* table = a.block_tables + w.row * a.block_tables_stride;
  const int G = w.head_count, M = w.q_count * G;
  const int64_t head0 = w.kv_head * p.group;

  float* qs = s.qt;    // [M, D]
  float* acc = s.acc;  // [M, D]
  int32_t pos[kMaxDecodeQueries], lo[kMaxDecodeQueries];
  float m[kMaxDecodeQueries], l[kMaxDecodeQueries], alphas[kMaxDecodeQueries];
  for (int i = 0; i < M; ++i) {
    const int t = i / G, g = i % G;
    load_row<D>(a.dtype, a.query, (q_start + t) * a.query_stride + (head0 + g) * D, qs + i * D,
                p.q_scale);
    pos[i] = pos0 + t;
    lo[i] = first_visible(pos[i], a.sliding_window);
    m[i] = kNegInf;
    l[i] = 0.0f;
  }
  std::fill(acc, acc + M * D, 0.0f);
  const vi lane = iota();

  for (int32_t k0 = w.key_begin; k0 < w.key_end; k0 += kChunk) {
    const int nk = std::min<int32_t>(kChunk, w.key_end - k0);
    const int nkp = (nk + W - 1) / W * W;
    gather_chunk<D>(a, table, w.kv_head, k0, nk, nkp, s);
    for (int i = 0; i < M; ++i) {
      vf q[C];
      for (int c = 0; c < C; ++c) q[c] = load(qs + i * D + c * W);
      float* si = s.scores + i * kChunk;
      const vi lo_i = splat_i(lo[i]);
      const vi hi_i = splat_i(std::min(pos[i], k0 + nk - 1));
      for (int jg = 0; jg < nkp; jg += W) {
        vf part[W];
        for (int jj = 0; jj < W; ++jj) {
          const float* kr = s.krow[jg + jj];
          vf x = q[0] * load(kr);
          for (int c = 1; c < C; ++c) x += q[c] * load(kr + c * W);
          part[jj] = x;
        }
        vf sv = transpose_sum(part);
        if (a.softcap > 0.0f) sv = softcap(sv, a.softcap);
        const vi key = splat_i(k0 + jg) + lane;
        sv = ((key >= lo_i) & (key <= hi_i)) ? sv : splat(kNegInf);
        store(si + jg, sv);
      }
      vf mv = splat(kNegInf);
      for (int jg = 0; jg < nkp; jg += W) mv = vmax(mv, load(si + jg));
      const float mx = std::max(m[i], hmax(mv));
      const float base = mx == kNegInf ? 0.0f : mx;
      const float alpha = std::exp(m[i] - base);
      vf sum = {};
      for (int jg = 0; jg < nkp; jg += W) {
        const vf pj = exp(load(si + jg) - base);
        store(si + jg, pj);
        sum += pj;
      }
      l[i] = l[i] * alpha + hsum(sum);
      m[i] = mx;
      alphas[i] = alpha;
    }
    // P V for QG queries at a time: each value row is loaded once per group, and the
    // QG * C accumulators are independent FMA chains. Queries past M (a partial group)
    // use zero probabilities and are not stored.
    for (int i0 = 0; i0 < M; i0 += QG) {
      vf o[QG][C];
      const float* pr[QG];
      for (int u = 0; u < QG; ++u) {
        const bool real = i0 + u < M;
        pr[u] = real ? s.scores + (i0 + u) * kChunk : s.zero;
        for (int c = 0; c < C; ++c) {
          o[u][c] = real ? load(acc + (i0 + u) * D + c * W) * alphas[i0 + u] : vf{};
        }
      }
      for (int j = 0; j < nk; ++j) {
        const float* vr = s.vrow[j];
        vf v[C];
        for (int c = 0; c < C; ++c) v[c] = load(vr + c * W);
        for (int u = 0; u < QG; ++u) {
          const vf pj = splat(pr[u][j]);
          for (int c = 0; c < C; ++c) o[u][c] += pj * v[c];
        }
      }
      for (int u = 0; u < QG && i0 + u < M; ++u) {
        for (int c = 0; c < C; ++c) store(acc + (i0 + u) * D + c * W, o[u][c]);
      }
    }
  }

  if (w.split < 0) {
    for (int i = 0; i < M; ++i) {
      const int t = i / G, g = i % G;
      const vf inv = splat(1.0f / l[i]);
      for (int c = 0; c < D; c += W) store(s.row + c, load(acc + i * D + c) * inv);
      store_row<D>(a.dtype, a.out, ((q_start + t) * a.num_heads + head0 + g) * D, s.row);
    }
  } else {
    float* part = p.partials + int64_t{w.split} * kPartialStride;
    std::copy(m, m + M, part);
    std::copy(l, l + M, part + M);
    std::copy(acc, acc + M * D, part + 2 * M);
  }
}

// ---- lane kernel: query vectors side by side in the lanes -------------------------------

template <int D, int NV>
PAGEDCORE_INLINE void lanes_item(const Problem& p, const WorkItem& w, Scratch& s) {
  constexpr int MP = NV * W;
  constexpr int JB = W >= 16 ? 4 : 2;  // keys per score micro-tile (JB * NV accumulators)
  constexpr int DB = W >= 16 ? 4 : 2;  // dims per P V micro-tile (DB * NV accumulators)
  static_assert(kChunk % JB == 0 && D % DB == 0, "micro-tiles must divide the chunk");
  const PagedAttentionArgs& a = p.a;
  const int32_t q_start = a.query_start_loc[w.row];
  const int32_t q_len = a.query_start_loc[w.row + 1] - q_start;
  const int32_t pos0 = a.seq_lens[w.row] - q_len + w.q_begin;  // the tile's first query
  const int32_t* table = a.block_tables + w.row * a.block_tables_stride;
  const int ng = w.head_count, M = w.q_count * ng;
  const int64_t head0 = w.kv_head * p.group + w.head_begin;
  const float cap = a.softcap;

  // Q tile transposed: qt[d * MP + i] for lane i = t * ng + g. Padding lanes repeat the
  // last query, so that every lane sees at least one key and stays finite.
  float* qt = s.qt;
  float* acc = s.acc;
  float* st = s.scores;
  vi pos_v[NV], lo_v[NV];
  for (int i = 0; i < MP; ++i) {
    const int ii = i < M ? i : M - 1;
    const int t = ii / ng, g = ii % ng;
    load_row<D>(a.dtype, a.query, (q_start + w.q_begin + t) * a.query_stride + (head0 + g) * D,
                s.row, p.q_scale);
    for (int d = 0; d < D; ++d) qt[d * MP + i] = s.row[d];
    pos_v[i / W][i % W] = pos0 + t;
    lo_v[i / W][i % W] = first_visible(pos0 + t, a.sliding_window);
  }
  std::fill(acc, acc + D * MP, 0.0f);
  vf m[NV], l[NV];
  for (int v = 0; v < NV; ++v) {
    m[v] = splat(kNegInf);
    l[v] = vf{};
  }
  const int32_t lo_last = first_visible(pos0 + w.q_count - 1, a.sliding_window);

  for (int32_t k0 = w.key_begin; k0 < w.key_end; k0 += kChunk) {
    const int nk = std::min<int32_t>(kChunk, w.key_end - k0);
    const int nkp = (nk + JB - 1) / JB * JB;
    gather_chunk<D>(a, table, w.kv_head, k0, nk, nkp, s);

    // 1. scores, keys-major: st[j * MP + i] = q_i . k_j
    for (int jb = 0; jb < nkp; jb += JB) {
      vf sc[JB][NV] = {};
      const float* kr[JB];
      for (int jj = 0; jj < JB; ++jj) kr[jj] = s.krow[jb + jj];
      for (int d = 0; d < D; ++d) {
        vf q[NV];
        for (int v = 0; v < NV; ++v) q[v] = load(qt + d * MP + v * W);
        for (int jj = 0; jj < JB; ++jj) {
          const vf kb = splat(kr[jj][d]);
          for (int v = 0; v < NV; ++v) sc[jj][v] += kb * q[v];
        }
      }
      for (int jj = 0; jj < JB; ++jj) {
        for (int v = 0; v < NV; ++v) store(st + (jb + jj) * MP + v * W, sc[jj][v]);
      }
    }

    // 2. softcap, then the causal / sliding-window mask where the chunk needs one
    const bool need_mask = k0 < lo_last || k0 + nk - 1 > pos0;
    if (cap > 0.0f || need_mask) {
      for (int j = 0; j < nk; ++j) {
        const vi key = splat_i(k0 + j);
        for (int v = 0; v < NV; ++v) {
          vf x = load(st + j * MP + v * W);
          if (cap > 0.0f) x = softcap(x, cap);
          if (need_mask) x = ((key >= lo_v[v]) & (key <= pos_v[v])) ? x : splat(kNegInf);
          store(st + j * MP + v * W, x);
        }
      }
    }

    // 3. online softmax: st becomes the probabilities relative to the running max
    vf alpha[NV];
    for (int v = 0; v < NV; ++v) {
      vf mx = m[v];
      for (int j = 0; j < nk; ++j) mx = vmax(mx, load(st + j * MP + v * W));
      const vf base = mx == splat(kNegInf) ? vf{} : mx;
      alpha[v] = exp(m[v] - base);
      vf sum = {};
      for (int j = 0; j < nk; ++j) {
        const vf pj = exp(load(st + j * MP + v * W) - base);
        store(st + j * MP + v * W, pj);
        sum += pj;
      }
      l[v] = l[v] * alpha[v] + sum;
      m[v] = mx;
    }

    // 4. acc = acc * alpha + P V, DB dims at a time
    for (int d0 = 0; d0 < D; d0 += DB) {
      vf o[DB][NV];
      for (int dd = 0; dd < DB; ++dd) {
        for (int v = 0; v < NV; ++v) o[dd][v] = load(acc + (d0 + dd) * MP + v * W) * alpha[v];
      }
      for (int j = 0; j < nk; ++j) {
        vf pj[NV];
        for (int v = 0; v < NV; ++v) pj[v] = load(st + j * MP + v * W);
        const float* vr = s.vrow[j] + d0;
        for (int dd = 0; dd < DB; ++dd) {
          const vf vb = splat(vr[dd]);
          for (int v = 0; v < NV; ++v) o[dd][v] += vb * pj[v];
        }
      }
      for (int dd = 0; dd < DB; ++dd) {
        for (int v = 0; v < NV; ++v) store(acc + (d0 + dd) * MP + v * W, o[dd][v]);
      }
    }
  }

  // 5. out = acc / l, transposed back W x W blocks at a time into rows (the Q tile's
  // space is free now), then written out
  float inv[MP];
  for (int v = 0; v < NV; ++v) store(inv + v * W, 1.0f / l[v]);
  float* rows = s.qt;  // [MP, D]
  for (int v = 0; v < NV; ++v) {
    for (int d0 = 0; d0 < D; d0 += W) {
      vf block[W];
      for (int r = 0; r < W; ++r) block[r] = load(acc + (d0 + r) * MP + v * W);
      transpose(block);
      for (int k = 0; k < W; ++k) store(rows + (v * W + k) * D + d0, block[k] * inv[v * W + k]);
    }
  }
  for (int i = 0; i < M; ++i) {
    const int t = i / ng, g = i % ng;
    store_row<D>(a.dtype, a.out, ((q_start + w.q_begin + t) * a.num_heads + head0 + g) * D,
                 rows + i * D);
  }
}

// The entry point of this instruction set: one work item.
template <int D>
void run_item(const Problem& p, const WorkItem& w) {
  Scratch& s = thread_scratch();
  switch (w.nv) {
    case 0: decode_item<D>(p, w, s); break;
    case 1: lanes_item<D, 1>(p, w, s); break;
    case 2: lanes_item<D, 2>(p, w, s); break;
    default: lanes_item<D, 4>(p, w, s); break;
  }
}
