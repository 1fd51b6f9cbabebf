// hpshard-bench-mpi: the Open MPI side of `hpshard-bench coll`. The bench runs it under
// mpirun (one process per rank, Open MPI's shared-memory transport) on the same cases it
// measured hpshard on, and reads back one JSON object:
//
//   {"mpi_version": "Open MPI v4.1.4", "ranks": 2,
//    "results": [{"op": "all_gather", "count": 131072, "iters": 40, "seconds": 0.0012,
//                 "wrong": false}, ...]}
//
// Each case is checked once on known inputs (as the bench checks hpshard), then timed as
// hpshard is: before every run the ranks meet at a barrier, each times its call, and the
// figure is the median over iterations of the slowest rank. `count` is the call's count
// (per rank for all_gather and reduce_scatter).
//
// Usage: hpshard-bench-mpi --dtype float32|float64 --cases op:count:iters:warmup,... --out FILE
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Case {
  std::string op;
  size_t count = 0;
  int iters = 0;
  int warmup = 0;
};

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "hpshard-bench-mpi: %s\n", message.c_str());
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::exit(2);
}

std::vector<Case> parse_cases(const std::string& text) {
  std::vector<Case> cases;
  std::stringstream items(text);
  for (std::string item; std::getline(items, item, ',');) {
    Case c;
    std::stringstream fields(item);
    std::string count, iters, warmup;
    if (!std::getline(fields, c.op, ':') || !std::getline(fields, count, ':') ||
        !std::getline(fields, iters, ':') || !std::getline(fields, warmup, ':')) {
      fail("--cases: '" + item + "' is not op:count:iters:warmup");
    }
    char* end = nullptr;
    c.count = std::strtoull(count.c_str(), &end, 10);
    const bool count_ok = *end == '\0' && c.count > 0 && c.count < (size_t{1} << 31);
    c.iters = static_cast<int>(std::strtol(iters.c_str(), &end, 10));
    const bool iters_ok = *end == '\0' && c.iters > 0 && c.iters <= 100000;
    c.warmup = static_cast<int>(std::strtol(warmup.c_str(), &end, 10));
    const bool warmup_ok = *end == '\0' && c.warmup >= 0 && c.warmup <= 100000;
    if (!count_ok || !iters_ok || !warmup_ok) fail("--cases: bad numbers in '" + item + "'");
    if (c.op != "all_reduce" && c.op != "all_gather" && c.op != "reduce_scatter" &&
        c.op != "broadcast") {
      fail("--cases: unknown op '" + c.op + "'");
    }
    cases.push_back(c);
  }
  return cases;
}

// The buffers of one rank, as doubles or floats.
struct Buffers {
  bool fp64 = false;
  std::vector<float> send32, recv32;
  std::vector<double> send64, recv64;
  void* send() { return fp64 ? static_cast<void*>(send64.data()) : send32.data(); }
  void* recv() { return fp64 ? static_cast<void*>(recv64.data()) : recv32.data(); }
  void fill_send(size_t n, double v) {
    if (fp64) {
      std::fill_n(send64.begin(), n, v);
    } else {
      std::fill_n(send32.begin(), n, static_cast<float>(v));
    }
  }
  void fill_recv(size_t n, double v) {
    if (fp64) {
      std::fill_n(recv64.begin(), n, v);
    } else {
      std::fill_n(recv32.begin(), n, static_cast<float>(v));
    }
  }
  double recv_at(size_t i) const { return fp64 ? recv64[i] : recv32[i]; }
};

void run(const Case& c, MPI_Datatype type, Buffers& b) {
  const int count = static_cast<int>(c.count);
  int rc = MPI_SUCCESS;
  if (c.op == "all_reduce") {
    rc = MPI_Allreduce(b.send(), b.recv(), count, type, MPI_SUM, MPI_COMM_WORLD);
  } else if (c.op == "all_gather") {
    rc = MPI_Allgather(b.send(), count, type, b.recv(), count, type, MPI_COMM_WORLD);
  } else if (c.op == "reduce_scatter") {
    rc = MPI_Reduce_scatter_block(b.send(), b.recv(), count, type, MPI_SUM, MPI_COMM_WORLD);
  } else {
    rc = MPI_Bcast(b.recv(), count, type, 0, MPI_COMM_WORLD);
  }
  if (rc != MPI_SUCCESS) fail(c.op + " failed with MPI error " + std::to_string(rc));
}

// Runs `c` once on known inputs (rank r sends r + 1; the broadcast root 7) and samples the
// output: whether it is right.
bool checked_run(const Case& c, MPI_Datatype type, Buffers& b, int rank, int size) {
  const size_t n = c.count, ranks = static_cast<size_t>(size);
  b.fill_send(c.op == "reduce_scatter" ? n * ranks : n, rank + 1);
  b.fill_recv(c.op == "all_gather" ? n * ranks : n, c.op == "broadcast" && rank == 0 ? 7.0 : 0.0);
  run(c, type, b);
  const double sum = static_cast<double>(size) * (size + 1) / 2;
  for (size_t i : {size_t{0}, n / 2, n - 1}) {
    if (c.op == "all_gather") {
      for (size_t r = 0; r < ranks; ++r) {
        if (b.recv_at(r * n + i) != static_cast<double>(r + 1)) return false;
      }
    } else if (b.recv_at(i) != (c.op == "broadcast" ? 7.0 : sum)) {
      return false;
    }
  }
  return true;
}

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string v(text, static_cast<size_t>(std::max(length, 0)));
  const size_t cut = v.find_first_of(",\n");
  return cut == std::string::npos ? v : v.substr(0, cut);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string dtype = "float32", cases_text, out_path;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) fail(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--dtype") {
      dtype = value;
    } else if (flag == "--cases") {
      cases_text = value;
    } else if (flag == "--out") {
      out_path = value;
    } else {
      fail("unknown option '" + flag + "'");
    }
  }
  if (dtype != "float32" && dtype != "float64") fail("--dtype: float32 or float64");
  if (cases_text.empty() || out_path.empty()) fail("--cases and --out are required");
  const std::vector<Case> cases = parse_cases(cases_text);
  const MPI_Datatype type = dtype == "float64" ? MPI_DOUBLE : MPI_FLOAT;

  size_t largest = 0;
  for (const Case& c : cases) largest = std::max(largest, c.count * static_cast<size_t>(size));
  Buffers b;
  b.fp64 = dtype == "float64";
  if (b.fp64) {
    b.send64.assign(largest, 0.0);
    b.recv64.assign(largest, 0.0);
  } else {
    b.send32.assign(largest, 0.0f);
    b.recv32.assign(largest, 0.0f);
  }

  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const Case& c : cases) {
    const bool right = checked_run(c, type, b, rank, size);
    int all_right = right ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &all_right, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    for (int i = 0; i < c.warmup; ++i) run(c, type, b);
    std::vector<double> times(static_cast<size_t>(c.iters)), slowest(times.size());
    for (int i = 0; i < c.iters; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      run(c, type, b);
      times[static_cast<size_t>(i)] = MPI_Wtime() - start;
    }
    MPI_Reduce(times.data(), slowest.data(), c.iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      std::sort(slowest.begin(), slowest.end());
      const size_t m = slowest.size() / 2;
      const double median = slowest.size() % 2 ? slowest[m] : (slowest[m - 1] + slowest[m]) / 2;
      results.push_back({{"op", c.op},
                         {"count", c.count},
                         {"iters", c.iters},
                         {"seconds", median},
                         {"wrong", all_right == 0}});
    }
  }
  if (rank == 0) {
    nlohmann::ordered_json doc = {
        {"mpi_version", library_version()}, {"ranks", size}, {"results", results}};
    std::ofstream out(out_path);
    out << doc.dump(1) << "\n";
    if (!out.flush()) fail("cannot write " + out_path);
  }
  MPI_Finalize();
  return 0;
}
