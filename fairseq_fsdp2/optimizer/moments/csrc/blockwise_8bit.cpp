// Block-wise 8-bit quantization of Adam's moments on CPU, one pass per block (blockwise_8bit.py
// holds the format, the tables and the eager reference; kernels.py builds and loads this file).
//
// Each function computes, element for element, what the eager code in blockwise_8bit.py
// computes, with the same float32 operations in the same order (no fused multiply-add: built
// with -ffp-contract=off), so the codes and block maxima are bit for bit the same
// (tests/test_quantize_kernel.py compares them): only the passes over memory are fewer.
//
// Two versions of quantize's loop, picked at run time by what the CPU has (``isa``): plain C++
// (any CPU, and a row's last, shorter block) and AVX-512 (16 lanes), whose table lookups are
// gather instructions. The lookups are most of the kernel's time: on a 4096 x 4096 tensor
// (AMD Zen 5, one thread, the draws excluded) the AVX-512 loops took 0.6x the plain ones'
// time (scripts/benchmark_moment_storage.py has both, draws included); an AVX2 version (8
// lanes) was no faster than the plain loops and is not kept. IEEE float32 subtraction and
// division round alike in a vector lane and in scalar code, and a block's maximum does not
// depend on the order it is taken in (its -0.0 becomes +0.0), so the versions agree bit for
// bit; the test runs every version the CPU has against the eager code. The tables are read
// as pairs, one 64-bit load for both halves: for each 16-bit prefix (low, after) and for each
// code (value, gap), packed by blockwise_8bit.py. The AVX-512 version is built on x86-64 only
// (FSDP2_X86_64); elsewhere (aarch64, ...) the plain loops are the only ones, and best_isa()
// says so.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(_M_X64)
#define FSDP2_X86_64 1
#include <immintrin.h>
#else
#define FSDP2_X86_64 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t kBlock = 256;
// the versions, by ``isa``
constexpr int kPlain = 0, kAvx512 = 1;

// The most capable version this CPU (and its operating system) runs.
int best_isa() {
#if FSDP2_X86_64
  static const int best = __builtin_cpu_supports("avx512f") ? kAvx512 : kPlain;
  return best;
#else
  return kPlain;
#endif
}

// The version to run: the most capable the CPU has, at most ``wanted`` (-1: the best).
int chosen(int64_t wanted) {
  return wanted < 0 ? best_isa() : std::min<int>(static_cast<int>(wanted), best_isa());
}

inline int32_t sign_of(float x) {  // -1 where x's sign bit is set, else 0 (blockwise_8bit._negative)
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits >> 31;
}

// The two float32 or int32 halves of a packed table entry (low 32 bits first).
template <typename Low, typename High>
inline void unpack(int64_t entry, Low* low, High* high) {
  const uint64_t bits = static_cast<uint64_t>(entry);
  const uint32_t a = static_cast<uint32_t>(bits), b = static_cast<uint32_t>(bits >> 32);
  std::memcpy(low, &a, 4);
  std::memcpy(high, &b, 4);
}

// The block's maximum magnitude (NaN if it holds a NaN) and the divisor of its elements.
inline void finish_peak(float most, float least, bool nan, float* peak, float* divisor) {
  const float tiny = std::numeric_limits<float>::min();
  // a NaN in the block: its maximum is NaN, as torch.amax makes it (its bits may differ)
  *peak = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(most, -least) + 0.0f;
  *divisor = nan ? *peak : (*peak < tiny ? tiny : *peak);
}

// Any block (n <= kBlock), one element at a time: the eager code reduces the block padded with
// zeros. by_prefix[prefix] = (low, after); by_code[code] = (value, gap).
float quantize_plain(const float* p, int64_t n, const uint16_t* d, const int64_t* by_prefix,
                     const int64_t* by_code, uint8_t* out) {
  float most = n < kBlock ? 0.0f : p[0], least = most;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    most = p[i] > most ? p[i] : most;
    least = p[i] < least ? p[i] : least;
    nan |= p[i] != p[i];
  }
  float peak, divisor;
  finish_peak(most, least, nan, &peak, &divisor);
  float s[kBlock];
  for (int64_t i = 0; i < n; ++i) s[i] = p[i] / divisor;  // vectorized by the compiler
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &s[i], sizeof bits);
    int32_t l;
    float after, value, gap;
    unpack(by_prefix[bits >> 16], &l, &after);
    l -= sign_of(after - s[i]);  // + 1 where s > after
    unpack(by_code[l], &value, &gap);
    const float up = (s[i] - value) / gap;
    l -= sign_of(static_cast<float>(d[i]) - up);  // + 1 where d < up x DRAWS
    out[i] = static_cast<uint8_t>(l);
  }
  return peak;
}

#if FSDP2_X86_64
// The 16 entries of ``table`` at ``index`` (16 int32), split into their low and high halves.
__attribute__((target("avx512f"))) inline void gather_pairs(const int64_t* table, __m512i index,
                                                            __m512i* low, __m512i* high) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                         28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i first = _mm512_i32gather_epi64(_mm512_castsi512_si256(index), table, 8);
  const __m512i second = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(index, 1), table, 8);
  *low = _mm512_permutex2var_epi32(first, even, second);
  *high = _mm512_permutex2var_epi32(first, odd, second);
}

// -1 in the lanes where ``x`` is negative (its sign bit set), else 0.
__attribute__((target("avx512f"))) inline __m512i negative(__m512 x) {
  return _mm512_srai_epi32(_mm512_castps_si512(x), 31);
}

// A whole block, 16 lanes at a time: the plain loop's operations, lane by lane.
__attribute__((target("avx512f"))) float quantize_avx512(const float* p, const uint16_t* d,
                                                         const int64_t* by_prefix,
                                                         const int64_t* by_code, uint8_t* out) {
  __m512 most = _mm512_loadu_ps(p), least = most;
  __mmask16 nan = _mm512_cmp_ps_mask(most, most, _CMP_UNORD_Q);
  for (int64_t i = 16; i < kBlock; i += 16) {
    const __m512 x = _mm512_loadu_ps(p + i);
    most = _mm512_max_ps(most, x);
    least = _mm512_min_ps(least, x);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  }
  float peak, divisor;
  finish_peak(_mm512_reduce_max_ps(most), _mm512_reduce_min_ps(least), nan != 0, &peak,
              &divisor);
  const __m512 by = _mm512_set1_ps(divisor);
  for (int64_t i = 0; i < kBlock; i += 16) {
    const __m512 s = _mm512_div_ps(_mm512_loadu_ps(p + i), by);
    __m512i l, after, value, gap;
    gather_pairs(by_prefix, _mm512_srli_epi32(_mm512_castps_si512(s), 16), &l, &after);
    l = _mm512_sub_epi32(l, negative(_mm512_sub_ps(_mm512_castsi512_ps(after), s)));
    gather_pairs(by_code, l, &value, &gap);
    const __m512 up = _mm512_div_ps(_mm512_sub_ps(s, _mm512_castsi512_ps(value)),
                                    _mm512_castsi512_ps(gap));
    const __m512 draw = _mm512_cvtepi32_ps(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + i))));
    l = _mm512_sub_epi32(l, negative(_mm512_sub_ps(draw, up)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(l));
  }
  return peak;
}
#endif  // FSDP2_X86_64

}  // namespace

// x: (rows, row) float32, contiguous. draws: int64, at least rows * blocks * 256 / 4 of them,
// read as uint16 in the padded layout the eager code uses (row r, element j: r * blocks * 256
// + j). by_prefix (65536) and by_code (256): the _Tables' pairs, int64. codes: (rows, row)
// uint8; absmax: (rows, blocks). isa: the most capable version to run (0 plain, 1 AVX-512;
// -1: the best the CPU has).
void quantize_rows(const torch::Tensor& x, const torch::Tensor& draws,
                   const torch::Tensor& by_prefix, const torch::Tensor& by_code,
                   torch::Tensor codes, torch::Tensor absmax, int64_t isa) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2);
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.is_contiguous());
  TORCH_CHECK(absmax.dtype() == torch::kFloat32 && absmax.is_contiguous());
  TORCH_CHECK(draws.dtype() == torch::kInt64 && draws.is_contiguous());
  TORCH_CHECK(by_prefix.dtype() == torch::kInt64 && by_prefix.numel() == 1 << 16);
  TORCH_CHECK(by_code.dtype() == torch::kInt64 && by_code.numel() == 256);
  const int64_t rows = x.size(0), row = x.size(1);
  const int64_t blocks = absmax.size(1);
  TORCH_CHECK(absmax.size(0) == rows && blocks * kBlock >= row && codes.numel() == x.numel());
  TORCH_CHECK(draws.numel() * 4 >= rows * blocks * kBlock);
  const float* xs = x.data_ptr<float>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(draws.data_ptr<int64_t>());
  const int64_t* bp = by_prefix.data_ptr<int64_t>();
  const int64_t* bc = by_code.data_ptr<int64_t>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  const int level = chosen(isa);
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = k / blocks, j0 = (k % blocks) * kBlock;
      const int64_t n = std::min(kBlock, row - j0);
      const float* p = xs + r * row + j0;
      const uint16_t* db = d + r * blocks * kBlock + j0;
      uint8_t* ob = out + r * row + j0;
#if FSDP2_X86_64
      am[k] = n < kBlock || level == kPlain ? quantize_plain(p, n, db, bp, bc, ob)
                                            : quantize_avx512(p, db, bp, bc, ob);
#else
      (void)level;  // kPlain: best_isa() is
      am[k] = quantize_plain(p, n, db, bp, bc, ob);
#endif
    }
  });
}

// codes: (rows, row) uint8; absmax: (rows, blocks) float32; qmap: the 256 map values;
// out: (rows, row) float32 = qmap[code] x its block's maximum. One version: gathers of 16
// lanes were no faster than this loop (AMD Zen 5).
void dequantize_rows(const torch::Tensor& codes, const torch::Tensor& absmax,
                     const torch::Tensor& qmap, torch::Tensor out) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2);
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous());
  TORCH_CHECK(absmax.dtype() == torch::kFloat32 && absmax.is_contiguous());
  TORCH_CHECK(qmap.dtype() == torch::kFloat32 && qmap.numel() == 256);
  const int64_t rows = codes.size(0), row = codes.size(1), blocks = absmax.size(1);
  TORCH_CHECK(absmax.size(0) == rows && blocks * kBlock >= row && out.numel() == codes.numel());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* am = absmax.data_ptr<float>();
  const float* q = qmap.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = k / blocks, j0 = (k % blocks) * kBlock;
      const int64_t n = std::min(kBlock, row - j0);
      const uint8_t* cb = c + r * row + j0;
      float* ob = o + r * row + j0;
      const float scale = am[k];
      for (int64_t i = 0; i < n; ++i) ob[i] = q[cb[i]] * scale;
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL released while a kernel runs: other Python threads of the process go on
  m.def("quantize_rows", &quantize_rows, "block-wise 8-bit quantization of rows (CPU)",
        py::arg("x"), py::arg("draws"), py::arg("by_prefix"), py::arg("by_code"),
        py::arg("codes"), py::arg("absmax"), py::arg("isa") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "block-wise 8-bit dequantization of rows (CPU)",
        py::arg("codes"), py::arg("absmax"), py::arg("qmap"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("best_isa", &best_isa, "the most capable version this CPU runs: 0 plain, 1 AVX-512");
}
