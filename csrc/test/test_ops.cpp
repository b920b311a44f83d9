// C++ test of the cat_fast kernel ops, called through the dispatcher (as any C++ user of the
// cat_fast_ops library would) and checked against direct ATen formulas. Exits non-zero on mismatch.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>

#include "../checks/common.h"

namespace {

using at::Tensor;
using T2 = std::tuple<Tensor, Tensor>;

int g_failures = 0;
int g_checks = 0;

double tol_for(at::ScalarType dt) {
  switch (dt) {
    case at::kDouble: return 1e-10;
    case at::kFloat: return 1e-5;
    case at::kHalf: return 2e-3;
    default: return 2e-2;  // bfloat16
  }
}

void check(const std::string& name, const Tensor& got, const Tensor& want, at::ScalarType dt) {
  ++g_checks;
  const double tol = tol_for(dt);
  if (got.sizes() != want.sizes()) {
    std::printf("FAIL %s [%s]: shape mismatch\n", name.c_str(), c10::toString(dt));
    ++g_failures;
    return;
  }
  if (got.scalar_type() != want.scalar_type()) {
    std::printf("FAIL %s [%s]: dtype %s, want %s\n", name.c_str(), c10::toString(dt), c10::toString(got.scalar_type()),
                c10::toString(want.scalar_type()));
    ++g_failures;
    return;
  }
  const Tensor a = got.to(at::kDouble), b = want.to(at::kDouble);
  if (!at::allclose(a, b, tol, tol)) {
    const double err = a.numel() ? (a - b).abs().max().item<double>() : 0.0;
    std::printf("FAIL %s [%s]: max abs err %g (tol %g)\n", name.c_str(), c10::toString(dt), err, tol);
    ++g_failures;
  }
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

at::ScalarType acc_of(at::ScalarType dt) { return dt == at::kDouble ? at::kDouble : at::kFloat; }

Tensor onehot(const Tensor& idx, int64_t C, at::ScalarType dt) {
  return at::zeros({idx.size(0), C}, at::TensorOptions().dtype(dt)).scatter_(1, idx.unsqueeze(1), 1.0);
}

void test_cmix(at::ScalarType dt) {
  auto fwd = op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("cat_fast::cmix_forward");
  auto bwd = op<T2(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("cat_fast::cmix_backward");
  const auto A = acc_of(dt);
  const int64_t B = 3, T = 4, D = 9;
  const Tensor partner = at::tensor(std::vector<int64_t>{0, 0, 2});  // repeats on purpose
  for (bool per_token : {false, true}) {
    const Tensor h = at::randn({B, T, D}).to(dt);
    const Tensor lam = per_token ? at::rand({B, T}).to(A) : at::rand({B}).to(A);
    const Tensor lt = (per_token ? lam : lam.unsqueeze(1).expand({B, T})).unsqueeze(2);
    const Tensor ha = h.to(A), hp = ha.index_select(0, partner);
    check("cmix_forward", fwd.call(h, lam, partner), (lt * hp + (1 - lt) * ha).to(dt), dt);

    const Tensor g = at::randn({B, T, D}).to(dt), ga = g.to(A);
    // grad_h = (1 - lam) * g + scatter_add over partner of lam * g
    const Tensor want_h = ((1 - lt) * ga).index_add(0, partner, lt * ga).to(dt);
    const Tensor want_lam = ((hp - ha) * ga).sum(2);
    Tensor gh, gl;
    std::tie(gh, gl) = bwd.call(g, h, lam, partner);
    check("cmix_backward grad_h", gh, want_h, dt);
    check("cmix_backward grad_lam", gl, want_lam, dt);
  }
}

void test_cal_objective(at::ScalarType dt) {
  auto fwd = op<Tensor(const Tensor&, const Tensor&, double, double, int64_t)>("cat_fast::cal_objective_forward");
  auto bwd = op<Tensor(const Tensor&, const Tensor&, const Tensor&, double, double, int64_t)>(
      "cat_fast::cal_objective_backward");
  const auto A = acc_of(dt);
  const int64_t B = 5, C = 7;
  const double gamma = 0.7, eta = 1.3;
  const Tensor z = (at::randn({B, C}) * 2).to(dt), za = z.to(A);
  const Tensor y = at::randint(0, C, {B}, at::TensorOptions().dtype(at::kLong));
  const int64_t ignore_index = -100;
  Tensor y_in = y.clone();
  y_in[1] = ignore_index;  // an ignored row: 0 and a zero gradient row
  const Tensor keep = (y_in != ignore_index).to(A);
  const Tensor p = at::softmax(za, 1);
  const Tensor pmax = std::get<0>(p.max(1));
  const Tensor want = keep * (gamma * (at::logsumexp(za, {1}) - za.gather(1, y.unsqueeze(1)).squeeze(1)) + eta * pmax);
  check("cal_objective_forward", fwd.call(z, y_in, gamma, eta, ignore_index), want, dt);

  const Tensor g = at::randn({B}).to(A);
  const Tensor am = za.argmax(1);
  const Tensor want_g = (keep * g).unsqueeze(1) *
                        (gamma * (p - onehot(y, C, A)) + eta * pmax.unsqueeze(1) * (onehot(am, C, A) - p));
  check("cal_objective_backward", bwd.call(g, z, y_in, gamma, eta, ignore_index), want_g.to(dt), dt);
}

void test_cal_step(at::ScalarType dt) {
  auto step = op<void(Tensor&, const Tensor&, double, double, double, double)>("cat_fast::cal_step_");
  const double lr = 0.1, lo = -0.3, hi = 0.8;
  for (double p : {1.0, 2.0, 3.0}) {
    for (bool per_token : {false, true}) {
      Tensor lam = per_token ? at::randn({3, 5}).to(dt) : at::randn({4}).to(dt);
      lam[0].zero_();  // a zero row (per token) / zero element (per sample)
      const Tensor g = at::randn(lam.sizes()).to(dt);
      Tensor dnorm;
      if (!per_token || p == 1.0) {
        dnorm = lam.sign();
      } else {
        const Tensor n = lam.abs().pow(p).sum(1, true).pow(1.0 / p);
        dnorm = at::where((lam == 0).logical_or(n == 0), at::zeros_like(lam), lam.sign() * (lam.abs() / n).pow(p - 1));
      }
      const Tensor want = (lam + lr * (g - dnorm)).clamp(lo, hi);
      step.call(lam, g, lr, p, lo, hi);
      check("cal_step_ p=" + std::to_string(p) + (per_token ? " [B,T]" : " [B]"), lam, want, dt);
    }
  }
}

void test_crm(at::ScalarType dt) {
  auto fwd = op<T2(const Tensor&, const Tensor&, const Tensor&, double, double, int64_t, bool, int64_t)>(
      "cat_fast::crm_loss_forward");
  auto bwd = op<T2(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double, int64_t,
                   bool, int64_t)>("cat_fast::crm_loss_backward");
  const int64_t ignore_index = -100;
  const auto A = acc_of(dt);
  const int64_t B = 6, C = 5;
  const double a1 = 0.5, a2 = 1.5;
  for (int64_t red : {0, 1, 2}) {
    for (bool detach : {false, true}) {
      const Tensor z = (at::randn({B, C}) * 2).to(dt), zc = (at::randn({B, C}) * 2).to(dt);
      const Tensor za = z.to(A), zca = zc.to(A);
      const Tensor y = at::randint(0, C, {B}, at::TensorOptions().dtype(at::kLong));
      Tensor y_in = y.clone();
      y_in[2] = ignore_index;  // an ignored row: loss 0, zero gradients, not counted by the mean
      const Tensor keep = (y_in != ignore_index).to(A);
      const Tensor p = at::softmax(za, 1), pc = at::softmax(zca, 1);
      const Tensor phi = std::get<0>(p.max(1)), phic = std::get<0>(pc.max(1));
      const Tensor r = phi / phic, w = r.clamp(a1, a2);
      const Tensor ce = keep * (at::logsumexp(za, {1}) - za.gather(1, y.unsqueeze(1)).squeeze(1));
      const Tensor l = w * ce;
      const Tensor want_loss = red == 0 ? l : (red == 1 ? l.sum() / keep.sum() : l.sum());
      Tensor loss, stats;
      std::tie(loss, stats) = fwd.call(z, zc, y_in, a1, a2, red, detach, ignore_index);
      check("crm_loss_forward loss red=" + std::to_string(red), loss, want_loss, dt);
      check("crm_loss_forward stats", stats, at::stack({w, ce, phi, phic}, 1), dt);

      const Tensor g = red == 0 ? at::randn({B}).to(A) : at::randn({}).to(A);
      const Tensor go = keep * (red == 0 ? g : (red == 1 ? g.expand({B}) / keep.sum() : g.expand({B})));
      const Tensor active = (r > a1).logical_and(r < a2).logical_and(at::scalar_tensor(!detach)).to(A);
      const Tensor dphi = phi.unsqueeze(1) * (onehot(za.argmax(1), C, A) - p);
      const Tensor dphic = phic.unsqueeze(1) * (onehot(zca.argmax(1), C, A) - pc);
      const Tensor want_gz = (go * w).unsqueeze(1) * (p - onehot(y, C, A)) +
                             (active * go * ce / phic).unsqueeze(1) * dphi;
      const Tensor want_gzc = -(active * go * ce * phi / (phic * phic)).unsqueeze(1) * dphic;
      Tensor gz, gzc;
      std::tie(gz, gzc) = bwd.call(g, z, zc, y_in, stats, a1, a2, red, detach, ignore_index);
      const std::string tag = " red=" + std::to_string(red) + (detach ? " detach" : "");
      check("crm_loss_backward grad_logits" + tag, gz, want_gz.to(dt), dt);
      check("crm_loss_backward grad_cf_logits" + tag, gzc, want_gzc.to(dt), dt);
    }
  }
}

void test_gs(at::ScalarType dt) {
  auto dots = op<Tensor(const Tensor&, const Tensor&)>("cat_fast::gs_row_dots");
  auto comb = op<T2(const Tensor&, const Tensor&, const Tensor&)>("cat_fast::gs_row_combine");
  const auto A = acc_of(dt);
  const int64_t N = 6, K = 37;
  const Tensor x = at::randn({N, K}).to(dt), y = at::randn({N, K}).to(dt);
  const Tensor xa = x.to(A), ya = y.to(A);
  check("gs_row_dots", dots.call(x, y), at::stack({(xa * ya).sum(1), (xa * xa).sum(1), (ya * ya).sum(1)}, 1), dt);
  const Tensor c = at::randn({N, 4}).to(A);
  Tensor u, v;
  std::tie(u, v) = comb.call(x, y, c);
  check("gs_row_combine u", u, (c.select(1, 0).unsqueeze(1) * xa + c.select(1, 1).unsqueeze(1) * ya).to(dt), dt);
  check("gs_row_combine v", v, (c.select(1, 2).unsqueeze(1) * xa + c.select(1, 3).unsqueeze(1) * ya).to(dt), dt);
}

}  // namespace

// The argument checks' messages are built by checks::message without iostreams; each part reads as operator<< writes
// it (here, in the test, streaming is fine).
template <typename V>
void check_text(const V& v) {
  ++g_checks;
  std::ostringstream want;
  want << v;
  const std::string got = cat_fast::checks::text(v);
  if (got != want.str()) {
    std::printf("FAIL checks::text: '%s', operator<< writes '%s'\n", got.c_str(), want.str().c_str());
    ++g_failures;
  }
}

void test_message_text() {
  for (int64_t v : {int64_t(0), int64_t(-7), int64_t(INT32_MAX), std::numeric_limits<int64_t>::min()}) check_text(v);
  check_text(42);
  check_text(size_t(3));
  for (double v : {0.0, -0.0, 0.1, -2.5, 1e-8, 123456789.0, 1.5e300, 1.0 / 3.0, std::numeric_limits<double>::infinity(),
                   std::nan("")}) {
    check_text(v);
  }
  check_text(at::IntArrayRef{});
  check_text(at::IntArrayRef{3});
  check_text(at::IntArrayRef{4, -1, 1LL << 40});
  check_text(at::kBFloat16);
  check_text(c10::Device(c10::DeviceType::CPU));
  check_text(c10::Device(c10::DeviceType::CUDA, 1));
  ++g_checks;
  const std::string msg = cat_fast::checks::message("op", ": x: expected shape ", at::IntArrayRef{2, 3}, " (", "[N, ",
                                                    std::string("K]"), "), got ", int64_t(7), ", ", 0.5);
  if (msg != "op: x: expected shape [2, 3] ([N, K]), got 7, 0.5") {
    std::printf("FAIL checks::message: '%s'\n", msg.c_str());
    ++g_failures;
  }
}

int main() {
  at::manual_seed(0);
  try {
    test_message_text();
    for (auto dt : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
      test_cmix(dt);
      test_cal_objective(dt);
      test_crm(dt);
      test_gs(dt);
    }
    for (auto dt : {at::kDouble, at::kFloat}) test_cal_step(dt);
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    return 1;
  }
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
