// Learnable head mixing on the CPU as ONE autograd node in C++ (issue 13's benchmark target).
//
// Head h outputs y = b_h * P V + a_h * V. Two ways to compute it, both exact to float rounding:
//
// * float32, T <= 1024, AVX2 ("fused"): our own attention kernel with the mixing inside (further down):
//   blocks of query rows against all keys, BLAS sgemm for the products, the softmax, the mixing and
//   the mixing's gradients done on each block while it is in cache. No extra memory pass at all.
// * everything else ("flash"): SDPA's own CPU flash kernel (forward and backward), with the mixing
//   as fused passes over the tensors:
//     forward   one pass:  y = b*out + a*v
//     backward  one pass:  d_out = b*dy, per-row sums of dy*v and dy*out
//               one pass:  dv += a*dy after the flash backward
//
// Per-row sums are vectorised; rows are then added per head in a fixed order in double, so a and b's
// gradients do not depend on the thread count. With create_graph=True the backward uses
// differentiable ATen ops on SDPA's kernel instead (a second derivative then flows as far as SDPA's
// kernel has one). The Python twin of the flash path is lapheads.ops._FlashMix.
//
// Registered as the operator lapheads::flash_mix (Autograd key only: tracers record the operator
// itself, never the raw loops); lapheads::flash_mix_path(q, k, v) says which way a call would go.
// lapheads/kernels.py builds and loads it; lapheads/ops.py calls it only where SDPA itself would run
// its CPU flash kernel (4-d, no mask, no dropout, no GQA, Tq == Tk, not under autocast, compile,
// tracing or export).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace lapheads {
namespace {

using at::Tensor;

// Offsets of row (b, h, t) of a 4-d tensor whose last dim is contiguous.
struct Rows {
  int64_t sb, sh, st;
  explicit Rows(const Tensor& x) : sb(x.stride(0)), sh(x.stride(1)), st(x.stride(2)) {}
  int64_t at(int64_t b, int64_t h, int64_t t) const { return b * sb + h * sh + t * st; }
};

Tensor rows_ready(const Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); }

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && a.device().is_cpu() &&
                  b.device().is_cpu(),
              "lapheads::flash_mix: CPU tensors only (q, k, v, a and b)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "lapheads::flash_mix: q, k, v must be (B, H, T, D)");
  TORCH_CHECK(q.sizes() == k.sizes() && k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2),
              "lapheads::flash_mix: q and k must have the same shape and v the same (B, H, T)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "lapheads::flash_mix: q, k, v must have one dtype");
  TORCH_CHECK(a.dim() == 1 && b.dim() == 1 && a.size(0) == q.size(1) && b.size(0) == q.size(1),
              "lapheads::flash_mix: a and b must have shape (H,)");
  TORCH_CHECK(a.scalar_type() == q.scalar_type() && b.scalar_type() == q.scalar_type(),
              "lapheads::flash_mix: a and b must have the dtype of q");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "lapheads::flash_mix: q, k, v need a contiguous last dim (SDPA's flash kernel does)");
}

// Runs f(row, b, h, t) over every row of a (B, H, T, D) problem, in parallel chunks of rows.
template <typename F>
void for_rows(int64_t B, int64_t H, int64_t T, int64_t D, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1));
  at::parallel_for(0, B * H * T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(i, i / (H * T), (i / T) % H, i % T);
  });
}

// y = b_h * out + a_h * v, in out's layout.
Tensor mix_forward(const Tensor& out, const Tensor& v, const Tensor& a, const Tensor& b) {
  Tensor y = at::empty_like(out);
  const int64_t B = out.size(0), H = out.size(1), T = out.size(2), D = out.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "lapheads_mix_forward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* po = out.const_data_ptr<scalar_t>();
    const scalar_t* pv = v.const_data_ptr<scalar_t>();
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pb = b.const_data_ptr<scalar_t>();
    scalar_t* py = y.mutable_data_ptr<scalar_t>();
    const Rows ro(out), rv(v), ry(y);
    for_rows(B, H, T, D, [&](int64_t, int64_t bi, int64_t h, int64_t t) {
      const opmath_t ah = static_cast<opmath_t>(pa[h]), bh = static_cast<opmath_t>(pb[h]);
      const scalar_t* o = po + ro.at(bi, h, t);
      const scalar_t* vv = pv + rv.at(bi, h, t);
      scalar_t* yy = py + ry.at(bi, h, t);
      _Pragma("omp simd")
      for (int64_t d = 0; d < D; ++d)
        yy[d] = static_cast<scalar_t>(bh * static_cast<opmath_t>(o[d]) + ah * static_cast<opmath_t>(vv[d]));
    });
  });
  return y;
}

// Per-head sums over every dim but the head dim, from per-row sums (B*H*T of them) added in row
// order in double, written straight into a new (H,) tensor of like's dtype.
Tensor head_sums(const std::vector<double>& rows, int64_t H, int64_t T, const Tensor& like) {
  std::vector<double> acc(H, 0.0);
  for (size_t i = 0; i < rows.size(); ++i) acc[(static_cast<int64_t>(i) / T) % H] += rows[i];
  Tensor s = at::empty({H}, like.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, s.scalar_type(), "lapheads_head_sums", [&] {
    scalar_t* ps = s.mutable_data_ptr<scalar_t>();
    for (int64_t h = 0; h < H; ++h) ps[h] = static_cast<scalar_t>(acc[h]);
  });
  return s;
}

// (b_h dy or undefined, sum(dy * v) per head or undefined, sum(dy * out) per head or undefined).
std::tuple<Tensor, Tensor, Tensor> mix_backward(const Tensor& dy, const Tensor& out, const Tensor& v,
                                                const Tensor& a, const Tensor& b, bool need_out, bool need_a,
                                                bool need_b) {
  const int64_t B = out.size(0), H = out.size(1), T = out.size(2), D = out.size(3);
  // (B, T, H, D) in memory: the layout the flash backward works in, so it reads d_out without a copy
  Tensor d_out = need_out ? at::empty({B, T, H, D}, out.options()).transpose(1, 2) : Tensor();
  std::vector<double> rows_a(need_a ? B * H * T : 0), rows_b(need_b ? B * H * T : 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "lapheads_mix_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* pg = dy.const_data_ptr<scalar_t>();
    const scalar_t* po = out.const_data_ptr<scalar_t>();
    const scalar_t* pv = v.const_data_ptr<scalar_t>();
    const scalar_t* pb = b.const_data_ptr<scalar_t>();
    scalar_t* pd = need_out ? d_out.mutable_data_ptr<scalar_t>() : nullptr;
    const Rows rg(dy), ro(out), rv(v), rd(need_out ? d_out : out);
    for_rows(B, H, T, D, [&](int64_t i, int64_t bi, int64_t h, int64_t t) {
      const scalar_t* g = pg + rg.at(bi, h, t);
      if (need_a || need_b) {
        const scalar_t* o = po + ro.at(bi, h, t);
        const scalar_t* vv = pv + rv.at(bi, h, t);
        opmath_t sa = 0, sb = 0;
        _Pragma("omp simd reduction(+ : sa, sb)")
        for (int64_t d = 0; d < D; ++d) {
          const opmath_t gd = static_cast<opmath_t>(g[d]);
          sa += gd * static_cast<opmath_t>(vv[d]);
          sb += gd * static_cast<opmath_t>(o[d]);
        }
        if (need_a) rows_a[i] = sa;
        if (need_b) rows_b[i] = sb;
      }
      if (pd != nullptr) {
        const opmath_t bh = static_cast<opmath_t>(pb[h]);
        scalar_t* dd = pd + rd.at(bi, h, t);
        _Pragma("omp simd")
        for (int64_t d = 0; d < D; ++d) dd[d] = static_cast<scalar_t>(bh * static_cast<opmath_t>(g[d]));
      }
    });
  });
  return {d_out, need_a ? head_sums(rows_a, H, T, a) : Tensor(), need_b ? head_sums(rows_b, H, T, b) : Tensor()};
}

// dv += a_h * dy, in place (dv is the flash backward's own fresh gradient of v).
void add_scaled_(Tensor& dv, const Tensor& dy, const Tensor& a) {
  const int64_t B = dv.size(0), H = dv.size(1), T = dv.size(2), D = dv.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dv.scalar_type(), "lapheads_add_scaled", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* pg = dy.const_data_ptr<scalar_t>();
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    scalar_t* pd = dv.mutable_data_ptr<scalar_t>();
    const Rows rg(dy), rd(dv);
    for_rows(B, H, T, D, [&](int64_t, int64_t bi, int64_t h, int64_t t) {
      const opmath_t ah = static_cast<opmath_t>(pa[h]);
      const scalar_t* g = pg + rg.at(bi, h, t);
      scalar_t* dd = pd + rd.at(bi, h, t);
      _Pragma("omp simd")
      for (int64_t d = 0; d < D; ++d)
        dd[d] = static_cast<scalar_t>(static_cast<opmath_t>(dd[d]) + ah * static_cast<opmath_t>(g[d]));
    });
  });
}

// ---------------------------------------------------------------------------------------------------
// float32: our own attention kernel with the mixing inside it (no extra memory passes).
//
// SDPA's CPU flash kernel (above) leaves the mixing three passes over (B, H, T, D) tensors (~0.1 ms
// at T = 256). This kernel computes the attention itself, a block of query rows at a time against all
// (causal: all earlier) keys, with BLAS's sgemm for the products, and mixes each block in cache:
//   forward   S = scale Q K^T; E = exp(S - rowmax); O = (E V) / rowsum(E); y = b O + a V
//   backward  P = exp(S - lse) (recomputed); dO = b dy; D = rowsum(dO * O); dP = dO V^T;
//             dV += P^T dO; dS = P (dP - D); dQ = scale dS K; dK += scale dS^T Q; dV += a dy
// Without the online-softmax rescaling a flash kernel needs (rows see all their keys at once), and
// with the exp vectorised below, it is a little faster than SDPA's kernel up to T ~ 1024; beyond,
// SDPA's kv tiling keeps its backward in cache and the flash path runs. Memory stays linear in T
// (a few rows x T buffers per thread). sgemm is the one torch itself calls (found at run time in
// libtorch_cpu, checked on a tiny product first); without it the flash path runs.
constexpr int64_t kMaxRows = 256;  // query rows per block, at most
constexpr int64_t kMaxT = 1024;    // longer sequences: the flash-kernel path (its kv tiling wins there)

// Rows per block: 256 (fewer, larger products; measured as fast as 128 or faster, and faster than 64,
// from T = 256 to 1024, the rows x T buffers staying <= 1 MiB), 64 when that leaves the forward fewer
// than 4 blocks to share between threads. Never the thread count itself: results are the same bits on
// any number of threads.
int64_t block_rows(int64_t BH, int64_t T) {
  return BH * ((T + kMaxRows - 1) / kMaxRows) < 4 ? 64 : kMaxRows;
}

using sgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);

// Column-major C = alpha op(A) op(B) + beta C, as BLAS defines it. The integers are passed from 64-bit
// storage (values < 2^31, checked by the caller): a BLAS with 32-bit integers reads their low halves
// (little-endian), one with 64-bit integers reads them whole; anything else fails find_sgemm's check.
struct Gemm {
  sgemm_t fn;
  void operator()(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) const {
    const int64_t d[6] = {m, n, k, lda, ldb, ldc};
    const auto i = [&](int j) { return reinterpret_cast<const int*>(d + j); };
    fn(&ta, &tb, i(0), i(1), i(2), &alpha, A, i(3), B, i(4), &beta, C, i(5));
  }
};

sgemm_t find_sgemm() {
  static const sgemm_t found = []() -> sgemm_t {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&at::native::cpublas::could_pack), &info) == 0 || info.dli_fname == nullptr)
      return nullptr;
    void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    auto fn = reinterpret_cast<sgemm_t>(dlsym(lib, "sgemm_"));
    dlclose(lib);  // RTLD_NOLOAD: only drops the reference this call took
    if (fn == nullptr) return nullptr;
    // A 2x3 times 3x2 product with padded leading dims: a BLAS with another convention fails it, and
    // the flash-kernel path is used instead.
    const float A[8] = {1, 2, 0, 3, 4, 0, 5, 6}, B[8] = {1, 2, 3, 0, 4, 5, 6, 0};
    float C[6] = {-1, -1, -1, -1, -1, -1};
    Gemm{fn}('N', 'N', 2, 2, 3, 1.0f, A, 3, B, 4, 0.0f, C, 3);  // A: 2x3 (ld 3), B: 3x2 (ld 4), C: 2x2 (ld 3)
    const float want[6] = {1 * 1 + 3 * 2 + 5 * 3, 2 * 1 + 4 * 2 + 6 * 3, -1, 1 * 4 + 3 * 5 + 5 * 6,
                           2 * 4 + 4 * 5 + 6 * 6, -1};
    for (int i = 0; i < 6; ++i)
      if (C[i] != want[i]) return nullptr;
    return fn;
  }();
  return found;
}

// exp(x) = 2^n p(r) with x = n ln2 + r, |r| <= ln2/2 and p the degree-6 Taylor polynomial (relative
// error < 1.3e-7, about one float ulp, before rounding; SDPA's own CPU kernel uses a degree-5 one).
// NaN stays NaN (the clamps keep x's NaN: max/min return their second operand on NaN). The widest
// variant this build has runs; lapheads::exp_shift_sum lets the tests check every one of them.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kC6 = 1.0f / 720, kC5 = 1.0f / 120, kC4 = 1.0f / 24, kC3 = 1.0f / 6;

// s[j] = exp(s[j] - c) for j < w, one float at a time from `from` on; returns the sum of those.
inline float exp_shift_sum_scalar(float* s, int64_t from, int64_t w, float c) {
  float total = 0.0f;
  for (int64_t j = from; j < w; ++j) {
    s[j] = std::exp(s[j] - c);
    total += s[j];
  }
  return total;
}

// The vector widths share the reduction, the polynomial and the loop (templates on the vector type,
// a GCC/Clang vector, so +, - and * work on it); each has its own clamps and 2^n (AVX-512 has
// vscalefps, AVX2 builds the exponent bits).
template <typename V>
inline V splat(float x) {
  V v;
  for (size_t i = 0; i < sizeof(V) / sizeof(float); ++i) v[i] = x;  // one broadcast after -O3
  return v;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 vfma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 vfnma(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
#endif
#if defined(__AVX512F__)
inline __m512 vfma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 vfnma(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
#endif

// p(r), r = x - n ln2 (in two parts, so n ln2_hi is exact).
template <typename V>
inline V exp_poly(V x, V n) {
  V r = vfnma(n, splat<V>(kLn2Hi), x);
  r = vfnma(n, splat<V>(kLn2Lo), r);
  V p = vfma(splat<V>(kC6), r, splat<V>(kC5));
  for (float c : {kC4, kC3, 0.5f, 1.0f, 1.0f}) p = vfma(p, r, splat<V>(c));
  return p;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 vexp(__m256 x) {
  const __m256 lo = splat<__m256>(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);  // below the smallest normal: 0
  x = _mm256_min_ps(splat<__m256>(88.3f), _mm256_max_ps(lo, x));
  const __m256 n = _mm256_round_ps(x * kLog2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, exp_poly(x, n) * _mm256_castsi256_ps(e));
}
#endif
#if defined(__AVX512F__)
inline __m512 vexp(__m512 x) {
  x = _mm512_min_ps(splat<__m512>(88.3f), _mm512_max_ps(splat<__m512>(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(x * kLog2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_poly(x, n), n);  // p 2^n; below -104 that is 0
}
#endif

// The vector loop of exp_shift_sum for vector type V; the tail (w not a whole number of vectors) in scalar.
template <typename V>
inline float exp_shift_sum_vec(float* s, int64_t w, float c) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  const V cc = splat<V>(c);
  V acc = splat<V>(0.0f);
  int64_t j = 0;
  for (; j + lanes <= w; j += lanes) {
    V x;
    std::memcpy(&x, s + j, sizeof(V));  // unaligned load
    const V e = vexp(x - cc);
    std::memcpy(s + j, &e, sizeof(V));
    acc += e;
  }
  float total = 0.0f;
  for (int64_t i = 0; i < lanes; ++i) total += acc[i];
  return total + exp_shift_sum_scalar(s, j, w, c);
}

// The widest variant this build has (the widths it has: exp_widths()).
inline float exp_shift_sum(float* s, int64_t w, float c) {
#if defined(__AVX512F__)
  return exp_shift_sum_vec<__m512>(s, w, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return exp_shift_sum_vec<__m256>(s, w, c);
#else
  return exp_shift_sum_scalar(s, 0, w, c);
#endif
}

// Without a vector exp (a build without AVX2) the softmax alone made the float32 kernel 1.4x SDPA at
// T = 256 (measured with a build of -O3 only): such builds keep the flash way.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kVectorExp = true;
#else
constexpr bool kVectorExp = false;
#endif

std::vector<int64_t> exp_widths() {
  std::vector<int64_t> widths{1};
#if defined(__AVX2__) && defined(__FMA__)
  widths.push_back(8);
#endif
#if defined(__AVX512F__)
  widths.push_back(16);
#endif
  return widths;
}

inline int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }  // a whole number of 16-float vectors

// Whether this kernel takes the call: a vector exp built in, float32, sgemm found, every size and
// stride fits BLAS's int,
// and rows that are BLAS matrices: a row stride of at least the row's length (BLAS refuses a smaller
// leading dimension, MKL with a message and NO result; q, k or v expanded along T has stride 0).
bool own_kernel_takes(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (!kVectorExp) return false;
  if (q.scalar_type() != at::kFloat || find_sgemm() == nullptr) return false;
  if (q.size(2) != k.size(2)) return false;
  const int64_t lim = std::numeric_limits<int>::max() / 4;
  for (const Tensor* t : {&q, &k, &v}) {
    for (int64_t i = 0; i < 4; ++i)
      if (t->stride(i) >= lim || t->size(i) >= lim) return false;
    if (t->stride(2) < std::max<int64_t>(1, t->size(3))) return false;
  }
  return q.size(2) > 0 && q.size(2) <= kMaxT && q.size(3) > 0;
}

// Row r's valid keys and the masked tail: s[n, w) = -inf so exp gives 0 there.
inline void mask_tail(float* s, int64_t n, int64_t w) {
  for (int64_t j = n; j < w; ++j) s[j] = -std::numeric_limits<float>::infinity();
}

// (y, out, lse): y = b*out + a*v, out = softmax(scale q k^T) v (both (B, T, H, D) in memory), lse (B, H, T).
std::tuple<Tensor, Tensor, Tensor> own_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& a,
                                               const Tensor& b, bool is_causal, double scale) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  Tensor out = at::empty({B, T, H, D}, q.options()).transpose(1, 2);
  Tensor y = at::empty({B, T, H, D}, q.options()).transpose(1, 2);
  Tensor lse = at::empty({B, H, T}, q.options());
  const Rows Q(q), K(k), V(v), O(out);  // y has out's layout
  const float *pq = q.const_data_ptr<float>(), *pk = k.const_data_ptr<float>(), *pv = v.const_data_ptr<float>();
  const float* pa = a.const_data_ptr<float>();
  const float* pb = b.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  float* py = y.mutable_data_ptr<float>();
  float* pl = lse.mutable_data_ptr<float>();
  const int64_t rows = block_rows(B * H, T), blocks = (T + rows - 1) / rows, ld = padded(T);
  const Gemm gemm{find_sgemm()};
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(rows * ld);
    float* S = buf.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, bi = bh / H, h = bh % H, i0 = (task % blocks) * rows;
      const int64_t i1 = std::min(T, i0 + rows), mq = i1 - i0, kv = is_causal ? i1 : T, w = padded(kv);
      const float *q0 = pq + Q.at(bi, h, i0), *k0 = pk + K.at(bi, h, 0), *v0 = pv + V.at(bi, h, 0);
      gemm('T', 'N', kv, mq, D, sc, k0, K.st, q0, Q.st, 0.0f, S, ld);
      float inv[kMaxRows];
      for (int64_t r = 0; r < mq; ++r) {
        float* s = S + r * ld;
        const int64_t n = is_causal ? i0 + r + 1 : T;
        float m = -std::numeric_limits<float>::infinity();
        _Pragma("omp simd reduction(max : m)")
        for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
        mask_tail(s, n, w);
        const float l = exp_shift_sum(s, w, m);
        inv[r] = 1.0f / l;
        pl[bh * T + i0 + r] = m + std::log(l);
      }
      // O = exp(S - m) V, then each row divided by its sum (Mq x D values, not Mq x T)
      float* o0 = po + O.at(bi, h, i0);
      gemm('N', 'N', D, mq, kv, 1.0f, v0, V.st, S, ld, 0.0f, o0, O.st);
      const float ah = pa[h], bhv = pb[h];
      float* y0 = py + O.at(bi, h, i0);
      for (int64_t r = 0; r < mq; ++r) {
        float* o = o0 + r * O.st;
        const float* vv = v0 + (i0 + r) * V.st;
        float* yy = y0 + r * O.st;
        const float ir = inv[r];
        _Pragma("omp simd")
        for (int64_t d = 0; d < D; ++d) {
          const float od = o[d] * ir;
          o[d] = od;
          yy[d] = bhv * od + ah * vv[d];
        }
      }
    }
  });
  return {y, out, lse};
}

// Gradients of y = b*out + a*v for q, k, v, a, b (undefined where not needed).
std::vector<Tensor> own_backward(const Tensor& dy, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& out, const Tensor& lse, const Tensor& a, const Tensor& b,
                                 bool is_causal, double scale, std::array<bool, 5> need) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const bool nq = need[0], nk = need[1], nv = need[2], na = need[3], nb = need[4], nqk = nq || nk;
  Tensor dq = nq ? at::empty_like(q) : Tensor(), dk = nk ? at::empty_like(k) : Tensor();
  Tensor dv = nv ? at::empty_like(v) : Tensor();
  std::vector<double> rows_a(na ? B * H * T : 0), rows_b(nb ? B * H * T : 0);
  const Rows Q(q), K(k), V(v), O(out), G(dy), DQ(nq ? dq : q), DK(nk ? dk : k), DV(nv ? dv : v);
  const float *pq = q.const_data_ptr<float>(), *pk = k.const_data_ptr<float>(), *pv = v.const_data_ptr<float>();
  const float *po = out.const_data_ptr<float>(), *pg = dy.const_data_ptr<float>();
  float* pdq = nq ? dq.mutable_data_ptr<float>() : nullptr;
  float* pdk = nk ? dk.mutable_data_ptr<float>() : nullptr;
  float* pdv = nv ? dv.mutable_data_ptr<float>() : nullptr;
  const float* pa = a.const_data_ptr<float>();
  const float* pb = b.const_data_ptr<float>();
  const float* pl = lse.const_data_ptr<float>();
  const int64_t rows = block_rows(B * H, T), blocks = (T + rows - 1) / rows, ld = padded(T);
  const Gemm gemm{find_sgemm()};
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf((nqk || nv) ? 2 * rows * ld + rows * D : 0);
    float *S = buf.data(), *dP = S + rows * ld, *dO = dP + rows * ld;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t bi = bh / H, h = bh % H;
      const float *q_ = pq + Q.at(bi, h, 0), *k_ = pk + K.at(bi, h, 0), *v_ = pv + V.at(bi, h, 0);
      const float *o_ = po + O.at(bi, h, 0), *g_ = pg + G.at(bi, h, 0);
      float* dq_ = nq ? pdq + DQ.at(bi, h, 0) : nullptr;
      float* dk_ = nk ? pdk + DK.at(bi, h, 0) : nullptr;
      float* dv_ = nv ? pdv + DV.at(bi, h, 0) : nullptr;
      const int64_t sdq = DQ.st, sdk = DK.st, sdv = DV.st;
      const float ah = pa[h], bhv = pb[h];
      // Last block first: it reaches every key (causal too), so it initialises dK and dV (beta 0).
      for (int64_t blk = blocks - 1; blk >= 0; --blk) {
        const int64_t i0 = blk * rows, i1 = std::min(T, i0 + rows), mq = i1 - i0;
        const int64_t kv = is_causal ? i1 : T, w = padded(kv);
        const float beta = blk == blocks - 1 ? 0.0f : 1.0f;
        // dO = b dy; per-row sums of dy*v (for a) and dy*out (for b, and D = b * that)
        float Drow[kMaxRows];
        for (int64_t r = 0; r < mq; ++r) {
          const float* g = g_ + (i0 + r) * G.st;
          const float* vv = v_ + (i0 + r) * V.st;
          const float* o = o_ + (i0 + r) * O.st;
          float sa = 0, sb = 0;
          _Pragma("omp simd reduction(+ : sa, sb)")
          for (int64_t d = 0; d < D; ++d) {
            sa += g[d] * vv[d];
            sb += g[d] * o[d];
          }
          if (na) rows_a[bh * T + i0 + r] = sa;
          if (nb) rows_b[bh * T + i0 + r] = sb;
          Drow[r] = bhv * sb;
          if (nqk || nv) {
            float* dd = dO + r * D;
            _Pragma("omp simd")
            for (int64_t d = 0; d < D; ++d) dd[d] = bhv * g[d];
          }
        }
        if (!(nqk || nv)) continue;
        const float* q0 = q_ + i0 * Q.st;
        gemm('T', 'N', kv, mq, D, sc, k_, K.st, q0, Q.st, 0.0f, S, ld);
        for (int64_t r = 0; r < mq; ++r) {
          float* s = S + r * ld;
          mask_tail(s, is_causal ? i0 + r + 1 : T, w);
          exp_shift_sum(s, w, pl[bh * T + i0 + r]);
        }
        if (nv) gemm('N', 'T', D, kv, mq, 1.0f, dO, D, S, ld, beta, dv_, sdv);
        if (nqk) {
          gemm('T', 'N', kv, mq, D, 1.0f, v_, V.st, dO, D, 0.0f, dP, ld);
          for (int64_t r = 0; r < mq; ++r) {
            const float* p = S + r * ld;
            float* dp = dP + r * ld;
            const float Dr = Drow[r];
            _Pragma("omp simd")
            for (int64_t j = 0; j < kv; ++j) dp[j] = p[j] * (dp[j] - Dr);
          }
          if (nq) gemm('N', 'N', D, mq, kv, sc, k_, K.st, dP, ld, 0.0f, dq_ + i0 * sdq, sdq);
          if (nk) gemm('N', 'T', D, kv, mq, sc, q0, Q.st, dP, ld, beta, dk_, sdk);
        }
        if (nv) {
          for (int64_t r = 0; r < mq; ++r) {
            const float* g = g_ + (i0 + r) * G.st;
            float* dd = dv_ + (i0 + r) * sdv;
            _Pragma("omp simd")
            for (int64_t d = 0; d < D; ++d) dd[d] += ah * g[d];
          }
        }
      }
    }
  });
  return {dq, dk, dv, na ? head_sums(rows_a, H, T, a) : Tensor(), nb ? head_sums(rows_b, H, T, b) : Tensor()};
}

}  // namespace

// Named outside the anonymous namespace: autograd shows the node as CppNode<lapheads::FlashMix>.
struct FlashMix : public torch::autograd::Function<FlashMix> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& a, const Tensor& b, bool is_causal, std::optional<double> scale) {
    check_inputs(q, k, v, a, b);
    const bool own = own_kernel_takes(q, k, v);
    Tensor y, out, lse;
    if (own) {
      std::tie(y, out, lse) = own_forward(q, k, v, a.contiguous(), b.contiguous(), is_causal,
                                          scale.has_value() ? *scale : 1.0 / std::sqrt(double(q.size(3))));
    } else {
      std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, {}, scale);
      y = mix_forward(out, v, a.contiguous(), b.contiguous());
    }
    ctx->save_for_backward({q, k, v, out, lse, a, b});
    ctx->saved_data["own"] = own;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    Tensor out = saved[3], lse = saved[4];
    const Tensor a = saved[5].contiguous(), b = saved[6].contiguous();
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    const c10::IValue& sv = ctx->saved_data["scale"];
    const std::optional<double> scale = sv.isNone() ? std::nullopt : std::optional<double>(sv.toDouble());
    const bool nq = ctx->needs_input_grad(0), nk = ctx->needs_input_grad(1), nv = ctx->needs_input_grad(2);
    const bool na = ctx->needs_input_grad(3), nb = ctx->needs_input_grad(4);
    const bool need_out = nq || nk || nv;
    const Tensor dy = rows_ready(grads[0]);
    const int64_t H = a.size(0);
    const bool own = ctx->saved_data["own"].toBool();
    Tensor dq, dk, dv, da, db;
    if (own && !at::GradMode::is_enabled()) {
      const std::vector<Tensor> g = own_backward(dy, q, k, v, out, lse, a, b, is_causal,
                                                 scale.has_value() ? *scale : 1.0 / std::sqrt(double(q.size(3))),
                                                 {nq, nk, nv, na, nb});
      dq = g[0], dk = g[1], dv = g[2], da = g[3], db = g[4];
    } else if (at::GradMode::is_enabled()) {  // create_graph=True: differentiable ops only
      if (own) {  // SDPA's backward reads its own forward's out and logsumexp
        at::NoGradGuard no_grad;
        std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, {}, scale);
      }
      if (na) da = (dy * v).sum({0, 2, 3});
      if (nb) db = (dy * out).sum({0, 2, 3});
      if (need_out) {
        std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
            dy * b.view({H, 1, 1}), q, k, v, out, lse, 0.0, is_causal, {}, scale);
        if (nv) dv = dv + dy * a.view({H, 1, 1});
      }
    } else {
      Tensor d_out;
      std::tie(d_out, da, db) = mix_backward(dy, out, v, a, b, need_out, na, nb);
      if (need_out) {
        std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, is_causal, {}, scale);
        if (nv) add_scaled_(dv, dy, a);
      }
    }
    return {nq ? dq : Tensor(), nk ? dk : Tensor(), nv ? dv : Tensor(), na ? da : Tensor(), nb ? db : Tensor(),
            Tensor(), Tensor()};
  }
};

Tensor flash_mix(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b, bool is_causal,
                 std::optional<double> scale) {
  return FlashMix::apply(q, k, v, a, b, is_causal, scale);
}

// For the tests: exp(x - c) by the variant of the given width (1, 8 or 16 lanes; exp_widths() lists
// what this build has), and the variant's sum appended as a last element.
Tensor exp_shift_sum_op(const Tensor& x, double c, int64_t width) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "lapheads::exp_shift_sum: a 1-d float32 CPU tensor");
  const std::vector<int64_t> widths = exp_widths();
  TORCH_CHECK(std::find(widths.begin(), widths.end(), width) != widths.end(),
              "lapheads::exp_shift_sum: this build has no variant of width ", width);
  Tensor out = at::empty({x.size(0) + 1}, x.options());
  out.narrow(0, 0, x.size(0)).copy_(x);
  float* p = out.mutable_data_ptr<float>();
  const float cf = static_cast<float>(c);
  float total = 0.0f;
  if (width == 1) total = exp_shift_sum_scalar(p, 0, x.size(0), cf);
#if defined(__AVX2__) && defined(__FMA__)
  if (width == 8) total = exp_shift_sum_vec<__m256>(p, x.size(0), cf);
#endif
#if defined(__AVX512F__)
  if (width == 16) total = exp_shift_sum_vec<__m512>(p, x.size(0), cf);
#endif
  p[x.size(0)] = total;
  return out;
}

std::string flash_mix_path(const Tensor& q, const Tensor& k, const Tensor& v) {
  return q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && own_kernel_takes(q, k, v) ? "fused" : "flash";
}

}  // namespace lapheads

TORCH_LIBRARY(lapheads, m) {
  m.def("flash_mix(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, bool is_causal, float? scale) -> Tensor");
  m.def("flash_mix_path(Tensor q, Tensor k, Tensor v) -> str", &lapheads::flash_mix_path);
  m.def("exp_shift_sum(Tensor x, float c, int width) -> Tensor", &lapheads::exp_shift_sum_op);
  m.def("exp_widths() -> int[]", &lapheads::exp_widths);
}

TORCH_LIBRARY_IMPL(lapheads, Autograd, m) { m.impl("flash_mix", &lapheads::flash_mix); }
