// CMIX tile-plan tuning (CAT_FAST_CMIX_PLAN) and the device queries of the tile launches; host code only.
// Shared declarations: cmix_common.cuh.
#include "cmix_common.cuh"

namespace cat_fast {
namespace cuda {
namespace cmix_impl {

int64_t sm_count() {
  return at::cuda::getDeviceProperties(c10::cuda::current_device())->multiProcessorCount;
}

// ================================================================ tuning overrides
// CAT_FAST_CMIX_PLAN="key=value,key=value,..." (',' or ';' between items; any subset), read once per
// process, for tuning the tile plan without rebuilding (benchmarks/tools/cmix_sweep.py). Keys:
//   fwd_w, bwd_w          W, lanes per row chunk: 1, 2, 4, 8, 16, 32. Used when B * W <= rows * 256,
//                         else the heuristic W (for the rows per thread in use) is kept.
//   fwd_rows, bwd_rows    P, the rows per thread the kernel is compiled for: 2, 4, 8.
//   fwd_packs, bwd_packs  K, 16-byte pack columns per thread and row (a chunk is W * K packs): 1, 2.
//   bwd_minb              min blocks per SM of the backward's __launch_bounds__ (register cap): 1, 2, 3
//                         where instantiated for (P, K) (see backward_tile_kernel_for), else the default
//                         (2 for P * K <= 4, 1 for P * K = 8).
//   fwd_bps, bwd_bps      at most this many resident blocks per SM (grid cap): 1..64.
//   bwd_split             S, d-splits per token (capped to the chunks), instead of the fill rule.
//   fill                  the fill threshold of the split rule: [0, 1].
//   fwd_async, bwd_async  1: the cp.async double-buffered tile kernels (ASYNC of the tile kernels; sm_80+, float /
//                         bfloat16 / half, K = 1, P = 4 or 8): twice the shared memory of the tile
//                         (forward 2 x B * W * 16 bytes, backward 4 x B * W * 16 bytes), no register
//                         prefetch. bwd_minb: 2, or 3 at P = 4. 0: the register-prefetch kernels (default).
//   verbose               1: print the plan of each (op, dtype, shape) once to stderr.
// float / bfloat16 / half have every (P, K) variant; double only the default kernels. Malformed or
// out-of-range items are ignored (one note on stderr); an override that does not fit a launch
// (variant not instantiated, shared memory over the device limit, no resident block) falls back to
// the default plan for that launch. Unset or empty: the default plan, unchanged.
namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

bool parse_int(const std::string& v, long lo, long hi, int& out) {
  if (v.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (errno != 0 || end == v.c_str() || *end != '\0' || x < lo || x > hi) return false;
  out = static_cast<int>(x);
  return true;
}

bool parse_one_of(const std::string& v, std::initializer_list<int> allowed, int& out) {
  int x = 0;
  if (!parse_int(v, INT32_MIN, INT32_MAX, x)) return false;
  for (int a : allowed) {
    if (x == a) {
      out = x;
      return true;
    }
  }
  return false;
}

bool parse_unit(const std::string& v, double& out) {
  if (v.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v.c_str(), &end);
  if (errno != 0 || end == v.c_str() || *end != '\0' || !std::isfinite(x) || x < 0.0 || x > 1.0) return false;
  out = x;
  return true;
}

}  // namespace

PlanOverride parse_plan(const char* env) {
  PlanOverride o;
  if (env == nullptr) return o;
  const std::string spec(env);
  std::string bad;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t end = spec.find_first_of(",;", pos);
    if (end == std::string::npos) end = spec.size();
    const std::string item = trim(spec.substr(pos, end - pos));
    pos = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = trim(item.substr(0, eq));
    const std::string val = eq == std::string::npos ? "" : trim(item.substr(eq + 1));
    bool ok = false;
    int flag = 0;
    if (key == "fwd_w") ok = parse_one_of(val, {1, 2, 4, 8, 16, 32}, o.fwd_w);
    else if (key == "bwd_w") ok = parse_one_of(val, {1, 2, 4, 8, 16, 32}, o.bwd_w);
    else if (key == "fwd_rows") ok = parse_one_of(val, {2, 4, 8}, o.fwd_rows);
    else if (key == "bwd_rows") ok = parse_one_of(val, {2, 4, 8}, o.bwd_rows);
    else if (key == "fwd_packs") ok = parse_one_of(val, {1, 2}, o.fwd_packs);
    else if (key == "bwd_packs") ok = parse_one_of(val, {1, 2}, o.bwd_packs);
    else if (key == "bwd_minb") ok = parse_one_of(val, {1, 2, 3}, o.bwd_minb);
    else if (key == "fwd_bps") ok = parse_int(val, 1, 64, o.fwd_bps);
    else if (key == "bwd_bps") ok = parse_int(val, 1, 64, o.bwd_bps);
    else if (key == "bwd_split") ok = parse_int(val, 1, 1 << 20, o.bwd_split);
    else if (key == "fill") ok = parse_unit(val, o.fill);
    else if (key == "fwd_async") ok = parse_one_of(val, {0, 1}, o.fwd_async);
    else if (key == "bwd_async") ok = parse_one_of(val, {0, 1}, o.bwd_async);
    else if (key == "verbose") {
      ok = parse_one_of(val, {0, 1}, flag);
      if (ok) o.verbose = flag == 1;
    }
    if (!ok) bad += (bad.empty() ? "" : ", ") + item;
  }
  if (!bad.empty()) std::fprintf(stderr, "cat_fast: CAT_FAST_CMIX_PLAN: ignored %s\n", bad.c_str());
  return o;
}

const PlanOverride& plan_override() {
  static const PlanOverride o = parse_plan(std::getenv("CAT_FAST_CMIX_PLAN"));
  return o;
}

// One line per distinct plan description (verbose=1).
void print_plan_once(const std::string& line) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(line).second) {
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
}

// Whether the current device runs cp.async (compute capability 8.0+).
bool device_has_cp_async() {
  return at::cuda::getDeviceProperties(c10::cuda::current_device())->major >= 8;
}

// The source of an override's plan line: "override", async, `notes`, and a forced W that plan_tiles did not take.
std::string override_source(const TileOverride& t, const TilePlan& plan, const std::string& notes) {
  std::string source = t.async ? "override, async" : "override";
  source += notes;
  if (t.w && (1 << plan.w_log2) != t.w) source += std::string(", ") + t.key + "_w ignored: B * W > rows * 256";
  return source;
}

}  // namespace cmix_impl
}  // namespace cuda
}  // namespace cat_fast
