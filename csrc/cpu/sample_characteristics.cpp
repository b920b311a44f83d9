// CPU kernels and op schemas of sample_characteristics (sample_characteristics_forward, _backward): the ten per-sample
// training characteristics of CLP (docs/METHODS.md §5.1) from the logits, the labels, the head's input features and
// the head's weight. Contract: docs/KERNELS.md "sample_characteristics"; CUDA kernels:
// csrc/cuda/sample_characteristics.cu. Per row, in the acc dtype: max-subtracted exponentials, log p_c = (z_c - m) -
// log(s) formed directly (never the log of an underflowed probability). The margin's other class k is the first
// index of the largest logit among c != y. Rows whose label == ignore_index: zero output rows, zero gradient rows.
// The weight gradient, a sum over the rows of each class, is made per class by one thread in row order (a counting
// sort of the labels, serial), so results do not depend on the number of threads.
#include <torch/library.h>

#include <vector>

#include "checks/sample_characteristics.h"
#include "kernel_utils.h"

TORCH_LIBRARY_FRAGMENT(cat_fast, m) {
  m.def("sample_characteristics_forward(Tensor logits, Tensor labels, Tensor features, Tensor class_weights, Tensor class_stats, float eps, int ignore_index=-100) -> Tensor");
  m.def("sample_characteristics_backward(Tensor grad, Tensor logits, Tensor labels, Tensor features, Tensor class_weights, float eps, int ignore_index=-100) -> (Tensor, Tensor, Tensor)");
}

namespace cat_fast {
namespace cpu {
namespace {

constexpr int64_t kColumns = 10;

void check_sample_characteristics(const char* op, const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& features, const at::Tensor& class_weights) {
  checks::sample_characteristics(op, at::kCPU, logits, labels, features, class_weights);
}

// First index of the largest z_c among c != y (C >= 2).
template <typename scalar_t, typename A = acc_type<scalar_t>>
inline int64_t other_index(const scalar_t* z, int64_t C, int64_t y) {
  int64_t k = y == 0 ? 1 : 0;
  for (int64_t c = k + 1; c < C; ++c) {
    if (c != y && static_cast<A>(z[c]) > static_cast<A>(z[k])) k = c;
  }
  return k;
}

// dot(f, w), |f|^2, |w|^2 of one row, in the acc dtype.
template <typename scalar_t, typename A>
inline void row_dots(const scalar_t* f, const scalar_t* w, int64_t H, A& dot, A& ff, A& ww) {
  dot = ff = ww = A(0);
  for (int64_t j = 0; j < H; ++j) {
    const A fj = static_cast<A>(f[j]);
    const A wj = static_cast<A>(w[j]);
    dot += fj * wj;
    ff += fj * fj;
    ww += wj * wj;
  }
}

at::Tensor sample_characteristics_forward(const at::Tensor& logits, const at::Tensor& labels,
                                          const at::Tensor& features, const at::Tensor& class_weights,
                                          const at::Tensor& class_stats, double eps, int64_t ignore_index) {
  const char* op = "sample_characteristics_forward";
  check_sample_characteristics(op, logits, labels, features, class_weights);
  const int64_t B = logits.size(0), C = logits.size(1), H = features.size(1);
  const at::ScalarType acc = acc_dtype(logits.scalar_type());
  checks::sample_characteristics_stats(op, at::kCPU, class_stats, logits);
  at::Tensor out = at::empty({B, kColumns}, logits.options().dtype(acc));
  CAT_FAST_DISPATCH_FLOATING(logits.scalar_type(), "sample_characteristics_forward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const int64_t* yp = labels.const_data_ptr<int64_t>();
    const scalar_t* fp = features.const_data_ptr<scalar_t>();
    const scalar_t* wp = class_weights.const_data_ptr<scalar_t>();
    const acc_t* sp = class_stats.const_data_ptr<acc_t>();
    acc_t* op_ = out.mutable_data_ptr<acc_t>();
    const acc_t e = static_cast<acc_t>(eps);
    at::parallel_for(0, B, row_grain(3 * C + 3 * H), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        acc_t* o = op_ + i * kColumns;
        const int64_t y = yp[i];
        if (y == ignore_index) {
          for (int64_t k = 0; k < kColumns; ++k) o[k] = acc_t(0);
          continue;
        }
        TORCH_CHECK(y >= 0 && y < C, checks::label_out_of_range(op, y, C));
        const scalar_t* z = zp + i * C;
        const RowSoftmax<acc_t> rs = row_softmax<scalar_t>(z, C);
        const acc_t log_s = std::log(rs.s);
        const acc_t inv_s = acc_t(1) / rs.s;
        acc_t gap2 = 0, neg_entropy = 0;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t d = static_cast<acc_t>(z[c]) - rs.m;
          const acc_t p = std::exp(d) * inv_s;
          gap2 += (acc_t(1) - p) * (acc_t(1) - p);
          neg_entropy += p * (d - log_s);
        }
        const int64_t k = other_index<scalar_t>(z, C, y);
        const acc_t zy = static_cast<acc_t>(z[y]);
        const acc_t loss = (rs.m - zy) + log_s;
        const acc_t margin = (std::exp(zy - rs.m) - std::exp(static_cast<acc_t>(z[k]) - rs.m)) * inv_s;
        acc_t dot, ff, ww;
        row_dots<scalar_t, acc_t>(fp + i * H, wp + y * H, H, dot, ff, ww);
        const acc_t nf = std::sqrt(ff), nw = std::sqrt(ww);
        const acc_t* st = sp + y * 3;
        o[0] = loss;
        o[1] = margin;
        o[2] = std::sqrt(gap2);
        o[3] = dot / (std::max(nf, e) * std::max(nw, e));
        o[4] = neg_entropy;
        o[5] = st[0];
        o[6] = st[1];
        o[7] = nw;
        o[8] = loss - st[1];
        o[9] = margin - st[2];
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sample_characteristics_backward(
    const at::Tensor& grad_in, const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& features,
    const at::Tensor& class_weights, double eps, int64_t ignore_index) {
  const char* op = "sample_characteristics_backward";
  check_sample_characteristics(op, logits, labels, features, class_weights);
  const int64_t B = logits.size(0), C = logits.size(1), H = features.size(1);
  const at::ScalarType acc = acc_dtype(logits.scalar_type());
  checks::sample_characteristics_grad(op, at::kCPU, grad_in, logits, kColumns);
  const at::Tensor grad = as_contig(grad_in, acc);
  at::Tensor grad_logits = at::empty_like(logits);
  at::Tensor grad_features = at::empty_like(features);
  at::Tensor grad_weights = at::empty_like(class_weights);
  CAT_FAST_DISPATCH_FLOATING(logits.scalar_type(), "sample_characteristics_backward", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* zp = logits.const_data_ptr<scalar_t>();
    const int64_t* yp = labels.const_data_ptr<int64_t>();
    const scalar_t* fp = features.const_data_ptr<scalar_t>();
    const scalar_t* wp = class_weights.const_data_ptr<scalar_t>();
    const acc_t* gp = grad.const_data_ptr<acc_t>();
    scalar_t* glp = grad_logits.mutable_data_ptr<scalar_t>();
    scalar_t* gfp = grad_features.mutable_data_ptr<scalar_t>();
    scalar_t* gwp = grad_weights.mutable_data_ptr<scalar_t>();
    const acc_t e = static_cast<acc_t>(eps);
    // per row: alpha (the coefficient of f_i in grad W_y) and beta (of W_y)
    std::vector<acc_t> coef(static_cast<size_t>(2 * B));
    at::parallel_for(0, B, row_grain(4 * C + 5 * H), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t y = yp[i];
        scalar_t* gz = glp + i * C;
        scalar_t* gf = gfp + i * H;
        if (y == ignore_index) {
          for (int64_t c = 0; c < C; ++c) gz[c] = static_cast<scalar_t>(0);
          for (int64_t j = 0; j < H; ++j) gf[j] = static_cast<scalar_t>(0);
          coef[2 * i] = coef[2 * i + 1] = acc_t(0);
          continue;
        }
        TORCH_CHECK(y >= 0 && y < C, checks::label_out_of_range(op, y, C));
        const acc_t* g = gp + i * kColumns;
        const scalar_t* z = zp + i * C;
        const RowSoftmax<acc_t> rs = row_softmax<scalar_t>(z, C);
        const acc_t log_s = std::log(rs.s);
        const acc_t inv_s = acc_t(1) / rs.s;
        acc_t sq = 0, gap2 = 0, neg_entropy = 0;  // Σ p², Σ (1 - p)², Σ p log p
        for (int64_t c = 0; c < C; ++c) {
          const acc_t d = static_cast<acc_t>(z[c]) - rs.m;
          const acc_t p = std::exp(d) * inv_s;
          sq += p * p;
          gap2 += (acc_t(1) - p) * (acc_t(1) - p);
          neg_entropy += p * (d - log_s);
        }
        const int64_t k = other_index<scalar_t>(z, C, y);
        const acc_t py = std::exp(static_cast<acc_t>(z[y]) - rs.m) * inv_s;
        const acc_t pk = std::exp(static_cast<acc_t>(z[k]) - rs.m) * inv_s;
        const acc_t margin = py - pk;
        const acc_t a = g[0] + g[8];  // the loss's gradient
        const acc_t b = g[1] + g[9];  // the margin's
        const acc_t g2 = g[2] / std::sqrt(gap2);
        // d/dz_c = a (p_c - 1[c=y]) + b (p_y 1[c=y] - p_k 1[c=k] - margin p_c) + g2 p_c (p_c - Σp²)/‖1-p‖
        //          + g4 p_c (log p_c - Σ p log p)
        for (int64_t c = 0; c < C; ++c) {
          const acc_t d = static_cast<acc_t>(z[c]) - rs.m;
          const acc_t p = std::exp(d) * inv_s;
          acc_t v = p * (a - b * margin + g2 * (p - sq) + g[4] * ((d - log_s) - neg_entropy));
          if (c == y) v += b * py - a;
          if (c == k) v -= b * pk;
          gz[c] = static_cast<scalar_t>(v);
        }
        const scalar_t* f = fp + i * H;
        const scalar_t* w = wp + y * H;
        acc_t dot, ff, ww;
        row_dots<scalar_t, acc_t>(f, w, H, dot, ff, ww);
        const acc_t nf = std::sqrt(ff), nw = std::sqrt(ww);
        const acc_t nfc = std::max(nf, e), nwc = std::max(nw, e);
        const acc_t cosine = dot / (nfc * nwc);
        const acc_t alpha = g[3] / (nfc * nwc);
        const acc_t gamma = nf >= e ? -g[3] * cosine / (nfc * nf) : acc_t(0);  // a clamped norm passes no gradient
        const acc_t beta = (nw >= e ? -g[3] * cosine / (nwc * nw) : acc_t(0)) + (nw > acc_t(0) ? g[7] / nw : acc_t(0));
        for (int64_t j = 0; j < H; ++j) {
          gf[j] = static_cast<scalar_t>(alpha * static_cast<acc_t>(w[j]) + gamma * static_cast<acc_t>(f[j]));
        }
        coef[2 * i] = alpha;
        coef[2 * i + 1] = beta;
      }
    });
    // grad W_c = Σ_{i: y_i = c} alpha_i f_i + (Σ beta_i) W_c, rows in increasing i: a counting sort of the labels
    std::vector<int64_t> start(static_cast<size_t>(C + 1), 0);
    for (int64_t i = 0; i < B; ++i) {
      if (yp[i] != ignore_index) ++start[yp[i] + 1];
    }
    for (int64_t c = 0; c < C; ++c) start[c + 1] += start[c];
    std::vector<int64_t> rows(static_cast<size_t>(start[C]));
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < B; ++i) {
      if (yp[i] != ignore_index) rows[next[yp[i]]++] = i;
    }
    at::parallel_for(0, C, row_grain(H * std::max<int64_t>(1, B / C)), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sum(static_cast<size_t>(H));
      for (int64_t c = begin; c < end; ++c) {
        scalar_t* gw = gwp + c * H;
        const scalar_t* w = wp + c * H;
        std::fill(sum.begin(), sum.end(), acc_t(0));
        acc_t beta = 0;
        for (int64_t r = start[c]; r < start[c + 1]; ++r) {
          const int64_t i = rows[r];
          const acc_t alpha = coef[2 * i];
          const scalar_t* f = fp + i * H;
          for (int64_t j = 0; j < H; ++j) sum[j] += alpha * static_cast<acc_t>(f[j]);
          beta += coef[2 * i + 1];
        }
        const bool any = start[c + 1] > start[c];  // a class without rows gets 0 (not 0 * W_c)
        for (int64_t j = 0; j < H; ++j) {
          gw[j] = static_cast<scalar_t>(any ? sum[j] + beta * static_cast<acc_t>(w[j]) : acc_t(0));
        }
      }
    });
  });
  return {grad_logits, grad_features, grad_weights};
}

}  // namespace
}  // namespace cpu
}  // namespace cat_fast

TORCH_LIBRARY_IMPL(cat_fast, CPU, m) {
  m.impl("sample_characteristics_forward", &cat_fast::cpu::sample_characteristics_forward);
  m.impl("sample_characteristics_backward", &cat_fast::cpu::sample_characteristics_backward);
}
