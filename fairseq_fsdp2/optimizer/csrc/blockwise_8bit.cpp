// Block-wise 8-bit quantization of Adam's moments on CPU, one pass per block (blockwise_8bit.py
// holds the format, the tables and the eager reference; kernels.py builds and loads this file).
//
// Each function computes, element for element, what the eager code in blockwise_8bit.py
// computes, with the same float32 operations in the same order (no fused multiply-add: built
// with -ffp-contract=off), so the codes and block maxima are bit for bit the same
// (tests/test_quantize_kernel.py compares them): only the passes over memory are fewer.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t kBlock = 256;

inline int32_t sign_of(float x) {  // -1 where x's sign bit is set, else 0 (blockwise_8bit._negative)
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits >> 31;
}

}  // namespace

// x: (rows, row) float32, contiguous. draws: int64, at least rows * blocks * 256 / 4 of them,
// read as uint16 in the padded layout the eager code uses (row r, element j: r * blocks * 256
// + j). low, after, value, gap: the _Tables. codes: (rows, row) uint8; absmax: (rows, blocks).
void quantize_rows(const torch::Tensor& x, const torch::Tensor& draws, const torch::Tensor& low,
                   const torch::Tensor& after, const torch::Tensor& value,
                   const torch::Tensor& gap, torch::Tensor codes, torch::Tensor absmax) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2);
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.is_contiguous());
  TORCH_CHECK(absmax.dtype() == torch::kFloat32 && absmax.is_contiguous());
  TORCH_CHECK(draws.dtype() == torch::kInt64 && draws.is_contiguous());
  const int64_t rows = x.size(0), row = x.size(1);
  const int64_t blocks = absmax.size(1);
  TORCH_CHECK(absmax.size(0) == rows && blocks * kBlock >= row && codes.numel() == x.numel());
  TORCH_CHECK(draws.numel() * 4 >= rows * blocks * kBlock);
  const float* xs = x.data_ptr<float>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(draws.data_ptr<int64_t>());
  const int32_t* lo = low.data_ptr<int32_t>();
  const float* af = after.data_ptr<float>();
  const float* va = value.data_ptr<float>();
  const float* ga = gap.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  const float tiny = std::numeric_limits<float>::min();
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = k / blocks, b = k % blocks;
      const int64_t j0 = b * kBlock, n = std::min(kBlock, row - j0);
      const float* p = xs + r * row + j0;
      // the eager code reduces the block padded with zeros; loops written to vectorize
      float most = n < kBlock ? 0.0f : p[0], least = most;
      bool nan = false;
      for (int64_t i = 0; i < n; ++i) {
        most = p[i] > most ? p[i] : most;
        least = p[i] < least ? p[i] : least;
        nan |= p[i] != p[i];
      }
      // a NaN in the block: its maximum is NaN, as torch.amax makes it (its bits may differ)
      const float peak =
          nan ? std::numeric_limits<float>::quiet_NaN() : std::max(most, -least) + 0.0f;
      am[k] = peak;
      const float divisor = nan ? peak : (peak < tiny ? tiny : peak);
      float s[kBlock];
      for (int64_t i = 0; i < n; ++i) s[i] = p[i] / divisor;
      const uint16_t* db = d + r * blocks * kBlock + j0;
      uint8_t* ob = out + r * row + j0;
      for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &s[i], sizeof bits);
        const uint32_t prefix = bits >> 16;
        int32_t l = lo[prefix];
        l -= sign_of(af[prefix] - s[i]);  // + 1 where s > after
        const float up = (s[i] - va[l]) / ga[l];
        l -= sign_of(static_cast<float>(db[i]) - up);  // + 1 where d < up x DRAWS
        ob[i] = static_cast<uint8_t>(l);
      }
    }
  });
}

// codes: (rows, row) uint8; absmax: (rows, blocks) float32; qmap: the 256 map values;
// out: (rows, row) float32 = qmap[code] x its block's maximum.
void dequantize_rows(const torch::Tensor& codes, const torch::Tensor& absmax,
                     const torch::Tensor& qmap, torch::Tensor out) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2);
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous());
  TORCH_CHECK(absmax.dtype() == torch::kFloat32 && absmax.is_contiguous());
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
      const float scale = am[k];
      const uint8_t* cb = c + r * row + j0;
      float* ob = o + r * row + j0;
      for (int64_t i = 0; i < n; ++i) ob[i] = q[cb[i]] * scale;
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL released while a kernel runs: other Python threads of the process go on
  m.def("quantize_rows", &quantize_rows, "block-wise 8-bit quantization of rows (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "block-wise 8-bit dequantization of rows (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
