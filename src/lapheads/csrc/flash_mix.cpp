// Learnable head mixing on the CPU as ONE autograd node in C++ (issue 13's benchmark target).
//
// Head h outputs y = b_h * P V + a_h * V, P V from SDPA's own CPU flash kernel. The Python twin is
// lapheads.ops._FlashMix: the same flash forward and backward, with the mixing done by several
// eager ops and the node's bookkeeping in Python. Here the node is C++ and the mixing is fused:
//   forward   one pass:  y = b*out + a*v                        (eager: a multiply, an addcmul_)
//   backward  one pass:  d_out = b*dy, per-row sums of dy*v and dy*out
//                        (eager: two products, two reductions, a multiply)
//             one pass:  dv += a*dy after the flash backward    (eager: a multiply, an add_)
// Each row's sums are vectorised (`omp simd` reductions); rows are then added per head in a fixed
// order in double, so the result does not depend on the thread count. With create_graph=True the
// backward uses differentiable ATen ops instead (a second derivative then flows as far as SDPA's
// kernel has one).
//
// Registered as the operator lapheads::flash_mix (Autograd key only: tracers record the operator
// itself, never the raw loops). lapheads/kernels.py builds and loads it; lapheads/ops.py calls it
// only where SDPA itself would run its CPU flash kernel (4-d, no mask, no dropout, no GQA,
// Tq == Tk, not under autocast, compile, tracing or export).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
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

}  // namespace

// Named outside the anonymous namespace: autograd shows the node as CppNode<lapheads::FlashMix>.
struct FlashMix : public torch::autograd::Function<FlashMix> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& a, const Tensor& b, bool is_causal, std::optional<double> scale) {
    check_inputs(q, k, v, a, b);
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, {}, scale);
    Tensor y = mix_forward(out, v, a.contiguous(), b.contiguous());
    ctx->save_for_backward({q, k, v, out, lse, a, b});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const Tensor a = saved[5].contiguous(), b = saved[6].contiguous();
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    const c10::IValue& sv = ctx->saved_data["scale"];
    const std::optional<double> scale = sv.isNone() ? std::nullopt : std::optional<double>(sv.toDouble());
    const bool nq = ctx->needs_input_grad(0), nk = ctx->needs_input_grad(1), nv = ctx->needs_input_grad(2);
    const bool na = ctx->needs_input_grad(3), nb = ctx->needs_input_grad(4);
    const bool need_out = nq || nk || nv;
    const Tensor dy = rows_ready(grads[0]);
    const int64_t H = a.size(0);
    Tensor dq, dk, dv, da, db;
    if (at::GradMode::is_enabled()) {  // create_graph=True: differentiable ops only
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

}  // namespace lapheads

TORCH_LIBRARY(lapheads, m) {
  m.def("flash_mix(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, bool is_causal, float? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lapheads, Autograd, m) { m.impl("flash_mix", &lapheads::flash_mix); }
