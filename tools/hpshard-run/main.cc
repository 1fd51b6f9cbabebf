// hpshard-run: starts N local ranks of a program, each with HPS_RANK, HPS_WORLD_SIZE,
// HPS_LOCAL_RANK, HPS_STORE, HPS_JOB_ID and HPS_STORE_TOKEN set, prefixes their output lines
// with "[rank K] ", passes its standard input on to rank 0 (the others read /dev/null), and
// stops them all when one fails. A TCP store's listening socket is
// bound here, once, and handed to rank 0 (HPS_STORE_FD): no other process can take the port
// between the launcher choosing it and rank 0 serving it. When the job ends, however it ends,
// its shared-memory segments are removed: when the launcher itself is killed (SIGKILL),
// its ranks get SIGKILL from the kernel (PR_SET_PDEATHSIG) and a small process it left
// behind removes the file store's directory and the segments once they have gone.
//
//   hpshard-run -n N [--store tcp|file] [--timeout SECONDS] [--grace SECONDS] [--] program args...
//
// Exit status: 0 when every rank exits 0; otherwise the first failing rank's exit code
// (128+signal when it was killed by a signal); 124 when --timeout expired; 128+signal when
// the launcher was sent SIGINT, SIGTERM or SIGHUP (the ranks' ends after it forwarded the
// signal are not failures of theirs); 2 for bad usage. ^Z (SIGTSTP) stops the ranks and the
// launcher; SIGCONT continues them.
//
// The launcher's own output (the ranks' lines, its messages) is queued and written by a
// thread per output file, with blocking writes (a terminal or pipe that polls writable may
// still block a write larger than its room, and O_NONBLOCK on the launcher's stdout would
// change a file description it shares with its shell), so a reader that does not read
// never holds up the supervision: the timeout, the signals and a failed rank act on time.
// While at least kOutputQueueBytes wait, the ranks' pipes are not read (the ranks block on
// their own output instead). When the job is over, what waits is written while the reader
// takes some of it: a reader that takes nothing for kOutputWaitEnded (kOutputWaitStopped
// after --timeout or a signal) is given up.
#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/comm/auth.h"
#include "core/comm/shm/shm_group.h"
#include "core/comm/socket.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kUsageError = 2;
constexpr int kTimeoutExit = 124;
// After every rank has exited, how long output still held open (by a rank's own children)
// is read before the launcher gives up on it.
constexpr std::chrono::milliseconds kDrainAfterExit{2000};
// A line of a rank's output longer than this goes out in pieces of this size, each with the
// rank's prefix: the launcher holds at most this much of a stream however the rank writes
// (a binary dump, a progress bar redrawn with carriage returns).
constexpr size_t kMaxLineBytes = 64 * 1024;
// A partial line (a prompt, a progress bar) going to a terminal, or rank 0's while the
// launcher passes a terminal on to it, is written after this long without more output.
constexpr std::chrono::milliseconds kPartialLineIdle{100};
// While this much of the launcher's output waits for its reader, the ranks' pipes are not
// read: a rank writing more blocks on its own pipe, not the launcher.
constexpr size_t kOutputQueueBytes = 1024 * 1024;
// When the job is over, how long the launcher waits for a reader that takes none of what
// waits: after an ordinary end (every rank exited, or one failed), and after --timeout or a
// signal.
constexpr std::chrono::seconds kOutputWaitEnded{10};
constexpr std::chrono::seconds kOutputWaitStopped{2};

int g_signal_pipe[2] = {-1, -1};
// What the launcher handles: the ends it forwards (SIGINT, SIGTERM, SIGHUP), its children's
// ends, and job control (SIGTSTP stops the ranks and then the launcher, SIGCONT continues
// them): the ranks are in process groups of their own, which a terminal's ^Z does not reach.
constexpr int kHandledSignals[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGTSTP, SIGCONT};

void on_signal(int signal) {
  const int saved = errno;
  const auto byte = static_cast<unsigned char>(signal);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

void write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // our own output is gone; keep supervising the ranks regardless
    }
    text.remove_prefix(static_cast<size_t>(n));
  }
}

// One of a rank's output pipes; complete lines go out with the rank's prefix.
struct OutputStream {
  int fd = -1;
  int target = -1;  // STDOUT_FILENO or STDERR_FILENO
  std::string partial;
  size_t scanned = 0;  // bytes at the start of `partial` known to hold no newline
  // Bytes of the current line written already (a partial line written out, its line still
  // open on the output): what follows continues it without a second prefix.
  size_t written = 0;
  bool flush_idle = false;  // its partial line is written after kPartialLineIdle
  Clock::time_point last_read{};
};

// The launcher's standard output and error. Once start() has run, text is queued and a thread
// a file writes it, chunk by chunk in the order queued (lines stay whole, stdout's and
// stderr's too when they are one file; a reader that lags on one does not hold up the
// other); before, it is written at once. An output file (stdout and stderr
// are one when they are the same file) holds at most one open partial line: text of another
// stream (or the launcher's own) ends it with a newline first.
class Output {
 public:
  void init() {
    struct stat out {
    }, err{};
    same_file_ = ::fstat(STDOUT_FILENO, &out) == 0 && ::fstat(STDERR_FILENO, &err) == 0 &&
                 out.st_dev == err.st_dev && out.st_ino == err.st_ino;
    terminal_[0] = ::isatty(STDOUT_FILENO) != 0;
    terminal_[1] = ::isatty(STDERR_FILENO) != 0;
  }

  // Starts the writers (one a file); without them (no thread could be made) writes stay
  // direct.
  void start() {
    if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) return;
    // The writers take no signal: the launcher's handlers run on its main thread, and the
    // writers' writes are not interrupted.
    sigset_t all, previous;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &previous);
    try {
      for (int c = 0; c < (same_file_ ? 1 : 2); ++c) {
        // Detached: one may stay blocked on a reader that never reads until the launcher
        // exits.
        std::thread([this, c] { write_queued(c); }).detach();
        started_ = true;
      }
    } catch (const std::system_error&) {
      same_file_ = true;  // one writer (or none) for both
    }
    ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  }

  bool started() const { return started_; }
  bool is_terminal(int fd) const { return terminal_[fd == STDOUT_FILENO ? 0 : 1]; }
  bool same_file() const { return same_file_; }
  // Readable after each chunk written.
  int wake_fd() const { return wake_[0]; }

  void clear_wakes() {
    char bytes[256];
    while (::read(wake_[0], bytes, sizeof bytes) > 0) {
    }
  }

  // `text` of `from` (nullptr: the launcher's own lines) for fd; `from->written` says
  // whether its line is left open.
  void put(int fd, OutputStream* from, std::string text) {
    const int c = channel(fd);
    if (open_[c] != nullptr && open_[c] != from) {
      OutputStream* other = open_[c];
      other->written = 0;
      enqueue(other->target, "\n");
    }
    open_[c] = from != nullptr && from->written > 0 ? from : nullptr;
    enqueue(fd, std::move(text));
  }

  // The open partial line of fd's file is over without a newline (a terminal's echo of a
  // typed line ended it): what its stream writes next starts a new prefixed line.
  void forget_open_line(int fd) {
    const int c = channel(fd);
    if (open_[c] != nullptr) open_[c]->written = 0;
    open_[c] = nullptr;
  }

  size_t pending() const {
    std::lock_guard lock(mutex_);
    return pending_[0] + pending_[1];
  }
  size_t pending_on(int fd) const {
    std::lock_guard lock(mutex_);
    return pending_[fd == STDOUT_FILENO ? 0 : 1];
  }
  // When a chunk was last written (or queued into an empty queue).
  Clock::time_point last_progress() const {
    std::lock_guard lock(mutex_);
    return progress_;
  }

 private:
  int channel(int fd) const { return fd == STDOUT_FILENO || same_file_ ? 0 : 1; }

  void enqueue(int fd, std::string text) {
    if (text.empty()) return;
    if (!started_) {
      write_all(fd, text);
      return;
    }
    {
      std::lock_guard lock(mutex_);
      if (pending_[0] + pending_[1] == 0) progress_ = Clock::now();
      pending_[fd == STDOUT_FILENO ? 0 : 1] += text.size();
      queue_[channel(fd)].emplace_back(fd, std::move(text));
    }
    ready_[channel(fd)].notify_one();
  }

  // Writes what is queued for one file, in order.
  void write_queued(int c) {
    // Pieces of a chunk at most this large, so progress is seen while a slow reader reads.
    constexpr size_t kPiece = 64 * 1024;
    while (true) {
      std::unique_lock lock(mutex_);
      ready_[c].wait(lock, [this, c] { return !queue_[c].empty(); });
      auto [fd, text] = std::move(queue_[c].front());
      queue_[c].pop_front();
      lock.unlock();
      for (size_t at = 0; at < text.size(); at += kPiece) {
        const size_t n = std::min(kPiece, text.size() - at);
        write_all(fd, std::string_view(text).substr(at, n));
        lock.lock();
        pending_[fd == STDOUT_FILENO ? 0 : 1] -= n;
        progress_ = Clock::now();
        lock.unlock();
        const char byte = 0;
        [[maybe_unused]] ssize_t w = ::write(wake_[1], &byte, 1);
      }
    }
  }

  bool same_file_ = false;
  bool terminal_[2] = {false, false};  // stdout's and stderr's
  bool started_ = false;
  int wake_[2] = {-1, -1};
  OutputStream* open_[2] = {nullptr, nullptr};  // by file; the main thread's alone
  mutable std::mutex mutex_;
  std::condition_variable ready_[2];                  // by file
  std::deque<std::pair<int, std::string>> queue_[2];  // by file: (fd, text)
  size_t pending_[2] = {0, 0};  // bytes queued or being written, stdout's and stderr's
  Clock::time_point progress_{};
};

// Never destroyed: its writer may still be blocked on a reader when the launcher exits.
Output& output() {
  static Output* const out = new Output;
  return *out;
}

void say(const std::string& message) {
  output().put(STDERR_FILENO, nullptr, "hpshard-run: " + message + "\n");
}

// The help: on stdout when asked for (--help), on stderr after a usage error.
void usage(const char* problem) {
  if (problem) say(problem);
  write_all(problem ? STDERR_FILENO : STDOUT_FILENO,
            "usage: hpshard-run -n N [--store tcp|file] [--timeout SECONDS] [--grace SECONDS]\n"
            "                   [--] program [args...]\n"
            "  -n, --nproc N      number of local ranks to start (1-4096)\n"
            "  --store tcp|file   how the ranks meet: a TCP store on 127.0.0.1 served by rank 0\n"
            "                     on a socket bound here (default), or a fresh temp directory\n"
            "                     removed at the end\n"
            "  --timeout SECONDS  stop every rank and exit 124 after this long (default and 0:\n"
            "                     none)\n"
            "  --grace SECONDS    between SIGTERM and SIGKILL when stopping ranks (default 5)\n"
            "  --version          print hpshard-run's version and exit\n"
            "Rank 0 reads hpshard-run's standard input (a terminal's passed on by hpshard-run\n"
            "while it is in the foreground); the other ranks read /dev/null.\n"
            "Each line a rank writes goes out with \"[rank K] \" before it (a line longer than\n"
            "64 KiB in 64 KiB pieces). A partial line (a prompt) goes out after 100 ms without\n"
            "more output when it goes to a terminal or is rank 0's while a terminal is passed\n"
            "on; what the rank writes next continues it, unless another rank's line (or\n"
            "hpshard-run's) came first: that ends it with a newline, and the rest starts a\n"
            "prefixed line of its own. A line the terminal's echo of typed input ended is over.\n"
            "The timeout, the signals and a failed rank act on time while nothing reads\n"
            "hpshard-run's output: once 1 MiB of it waits, the ranks' output waits in their\n"
            "pipes (a rank writing more blocks). When the job is over, what waits is written\n"
            "while the reader takes some of it at least every 10 s (2 s after --timeout or a\n"
            "signal); then hpshard-run exits with the job's code, the rest not written.\n"
            "Each rank's environment gains HPS_RANK, HPS_WORLD_SIZE, HPS_LOCAL_RANK,\n"
            "HPS_STORE, HPS_JOB_ID and HPS_STORE_TOKEN (and, for rank 0 with --store tcp,\n"
            "HPS_STORE_FD: the store's listening socket).\n"
            "Exit status: 0 when every rank exits 0; else the first failing rank's code\n"
            "(128+signal for a rank a signal killed); 124 when --timeout expired; 128+signal\n"
            "when hpshard-run was sent SIGINT, SIGTERM or SIGHUP; 2 for bad usage.\n");
}

struct Options {
  int nproc = 0;
  std::string store = "tcp";
  double timeout_s = 0;
  double grace_s = 5;
  std::vector<std::string> command;
};

// Durations beyond a year are refused: converted to clock ticks they would overflow.
constexpr double kMaxSeconds = 365.0 * 24 * 3600;

// A plain decimal: digits, optionally a point and more digits (no sign, space, exponent or
// hexadecimal, which strtod would take).
bool parse_number(const std::string& text, double* out) {
  const size_t point = text.find('.');
  const auto digits = [](std::string_view s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
  };
  const std::string_view whole(text);
  if (point == std::string::npos
          ? !digits(whole)
          : !digits(whole.substr(0, point)) || !digits(whole.substr(point + 1))) {
    return false;
  }
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno != 0 || !(v >= 0) || !(v <= kMaxSeconds)) {
    return false;
  }
  *out = v;
  return true;
}

// Options, or the exit status when parsing ended the run (usage error or --help).
std::optional<int> parse_options(int argc, char** argv, Options* options) {
  int i = 1;
  std::vector<std::string> seen;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.empty() || arg[0] != '-') break;
    if (arg == "-h" || arg == "--help") {
      usage(nullptr);
      return 0;
    }
    if (arg == "--version") {
      write_all(STDOUT_FILENO, "hpshard-run " HPS_TOOLS_VERSION "\n");
      return 0;
    }
    std::string value;
    std::string name = arg;
    const auto eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else if (arg.size() > 2 && arg.rfind("-n", 0) == 0 && arg[1] == 'n') {
      name = "-n";
      value = arg.substr(2);
    } else {
      if (name != "-n" && name != "--nproc" && name != "--store" && name != "--timeout" &&
          name != "--grace") {
        usage(("unknown option " + arg).c_str());
        return kUsageError;
      }
      if (i + 1 >= argc) {
        usage(("option " + arg + " needs a value").c_str());
        return kUsageError;
      }
      value = argv[++i];
    }
    // One value per option: a second one is a mistake, not an override.
    const std::string canonical = name == "--nproc" ? "-n" : name;
    if (std::find(seen.begin(), seen.end(), canonical) != seen.end()) {
      usage(("option " + name + " given twice").c_str());
      return kUsageError;
    }
    seen.push_back(canonical);
    double number = 0;
    if (name == "-n" || name == "--nproc") {
      if (!parse_number(value, &number) || number < 1 || number > 4096 ||
          number != static_cast<int>(number)) {
        usage(("-n: '" + value + "' is not a rank count (1-4096)").c_str());
        return kUsageError;
      }
      options->nproc = static_cast<int>(number);
    } else if (name == "--store") {
      if (value != "tcp" && value != "file") {
        usage(("--store: '" + value + "' is neither tcp nor file").c_str());
        return kUsageError;
      }
      options->store = value;
    } else if (name == "--timeout" || name == "--grace") {
      if (!parse_number(value, &number)) {
        usage((name + ": '" + value + "' is not a number of seconds (0 to a year)").c_str());
        return kUsageError;
      }
      (name == "--timeout" ? options->timeout_s : options->grace_s) = number;
    } else {
      usage(("unknown option " + arg).c_str());
      return kUsageError;
    }
  }
  for (; i < argc; ++i) options->command.emplace_back(argv[i]);
  if (options->nproc < 1) {
    usage("-n N is required");
    return kUsageError;
  }
  if (options->command.empty()) {
    usage("no program given");
    return kUsageError;
  }
  return std::nullopt;
}

struct RankProcess {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  // Its process group (what it started) may still have members: the rank's own end does
  // not end them, so stopping the job signals the group until it is gone.
  bool group_alive = false;
  OutputStream out;
  OutputStream err;
  std::string prefix() const { return "[rank " + std::to_string(rank) + "] "; }
};

// What emit_lines writes besides the complete lines: nothing more, the partial line too (its
// line left open), or at the stream's end the rest with a newline.
enum class Emit { kLines, kPartial, kEnd };

// Writes the complete lines held, each with the prefix (a continuation of a partial line
// written before has none); a line longer than kMaxLineBytes goes out in pieces of that
// size. Each byte is searched for a newline once.
void emit_lines(const std::string& prefix, OutputStream& s, Emit how) {
  size_t start = 0;
  std::string text;
  while (start < s.partial.size()) {
    const size_t room = kMaxLineBytes - s.written;  // what the current line may still take
    const size_t nl = s.partial.find('\n', std::max(start, s.scanned));
    if (nl != std::string::npos && nl - start <= room) {
      if (s.written == 0) text += prefix;
      text.append(s.partial, start, nl + 1 - start);
      start = nl + 1;
      s.written = 0;
    } else if (s.partial.size() - start > room) {
      if (s.written == 0) text += prefix;
      text.append(s.partial, start, room);
      text += '\n';
      start += room;
      s.written = 0;
    } else {
      break;  // what is left has no newline and fits the current line
    }
  }
  s.partial.erase(0, start);
  s.scanned = s.partial.size();
  if (how == Emit::kEnd && (!s.partial.empty() || s.written > 0)) {
    if (s.written == 0) text += prefix;
    text += s.partial + "\n";
    s.partial.clear();
    s.scanned = 0;
    s.written = 0;
  } else if (how == Emit::kPartial && !s.partial.empty()) {
    if (s.written == 0) text += prefix;
    text += s.partial;
    s.written += s.partial.size();
    s.partial.clear();
    s.scanned = 0;
  }
  if (!text.empty()) output().put(s.target, &s, std::move(text));
}

// Reads what the pipe holds; closes it at end of file.
void pump(const std::string& prefix, OutputStream& s) {
  char buffer[65536];
  const ssize_t n = ::read(s.fd, buffer, sizeof buffer);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {
    emit_lines(prefix, s, Emit::kEnd);
    ::close(s.fd);
    s.fd = -1;
    return;
  }
  s.last_read = Clock::now();
  s.partial.append(buffer, static_cast<size_t>(n));
  emit_lines(prefix, s, Emit::kLines);
}

void close_stream(const std::string& prefix, OutputStream& s) {
  if (s.fd < 0) return;
  emit_lines(prefix, s, Emit::kEnd);
  ::close(s.fd);
  s.fd = -1;
}

// Seconds as a short decimal: "0.5", "12", "3.25".
std::string seconds_text(double seconds) {
  char text[64];
  std::snprintf(text, sizeof text, seconds >= 100 ? "%.0f" : "%.3g", seconds);
  return text;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) {
    return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "exited with code " + std::to_string(exit_code_of(status));
}

class Launcher {
 public:
  explicit Launcher(Options options) : options_(std::move(options)) {}

  int run() {
    // One malloc arena: the output's thread frees what the main thread allocated, and an
    // arena of its own would reserve 64 MiB of address space (a launcher under `ulimit -v`).
    ::mallopt(M_ARENA_MAX, 1);
    output().init();
    if (!install_signal_handlers()) return 1;
    // The job's name (HPS_JOB_ID: its store and shared-memory segments carry it) and, where
    // this build can check one, the secret its TCP store asks every client for.
    auto random = hps::auth::new_token();
    if (!random.ok()) {
      say("cannot name the job: " + random.status().message());
      return 1;
    }
    job_id_ = "hpshard-run-" + random->substr(0, 24);
    if (hps::auth::hmac_available()) {
      auto token = hps::auth::new_token();
      if (!token.ok()) {
        say("cannot make the store's token: " + token.status().message());
        return 1;
      }
      token_ = *token;
    }
    std::string store_url;
    if (options_.store == "tcp") {
      // Bound once and handed to rank 0, never released in between.
      auto listener = hps::net::listen_on("127.0.0.1", 0, 1024);
      if (!listener.ok()) {
        say("cannot listen for the TCP store: " + listener.status().message());
        return 1;
      }
      store_fd_ = listener->fd;
      store_url = "tcp://127.0.0.1:" + std::to_string(listener->port);
    } else {
      const char* tmp = std::getenv("TMPDIR");
      // Absolute: a file:// store URL needs an absolute path.
      std::error_code ignored;
      const auto base = std::filesystem::absolute(tmp && *tmp ? tmp : "/tmp", ignored);
      // Named here and made once the clean-up process knows it (as mkdtemp would: a random
      // name, made by this process alone, only its owner's).
      auto unique = hps::auth::new_token();
      if (!unique.ok()) {
        say("cannot name the store directory: " + unique.status().message());
        return 1;
      }
      store_url = "file://" + (base / ("hpshard-run." + unique->substr(0, 16))).string();
    }
    // Before the store's directory and any rank: a launcher killed once either exists always
    // leaves the clean-up behind.
    if (!store_url.empty() && store_url.rfind("file://", 0) == 0) store_dir_ = store_url.substr(7);
    start_janitor();
    if (!store_dir_.empty() && ::mkdir(store_dir_.c_str(), 0700) != 0) {
      say("cannot create the store directory " + store_dir_ + ": " + std::strerror(errno));
      store_dir_.clear();  // not this job's
      stop_janitor();
      return 1;
    }
    int code = 1;
    const bool started = start_ranks(store_url);
    // Rank 0 holds the socket now: once it is gone, clients must be refused, not queued.
    hps::net::close_fd(store_fd_);
    store_fd_ = -1;
    if (started) code = supervise();
    // A failed or stopped job leaves nothing its ranks started (a failed rank's children
    // were signalled with the others; what ignored that is killed now); after a job that
    // succeeded, what a rank left running in its process group (a worker it did not wait
    // for) gets SIGTERM, and SIGKILL after the grace period, as torchrun ends its workers.
    if (code != 0) {
      stop_all(SIGKILL);
    } else {
      end_what_the_ranks_left();
    }
    stop_janitor();
    if (!store_dir_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(store_dir_, ignored);
    }
    // Segments whose names a killed rank left (a rank removes its own on every other path).
    if (const int removed = hps::shm::remove_job_segments(job_id_); removed > 0) {
      say("removed " + std::to_string(removed) + " shared-memory segment(s) the job left");
    }
    return finish_output(code);
  }

 private:
  bool install_signal_handlers() {
    if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      say(std::string("pipe: ") + std::strerror(errno));
      return false;
    }
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (int s : kHandledSignals) ::sigaction(s, &action, nullptr);
    std::signal(SIGPIPE, SIG_IGN);
    return true;
  }

  // The environment of a rank: ours without any HPS_* rendezvous variable, plus the rank's.
  std::vector<std::string> rank_environment(int rank, const std::string& store_url) const {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view entry(*e);
      bool ours = false;
      for (const char* name : {"HPS_RANK=", "HPS_WORLD_SIZE=", "HPS_LOCAL_RANK=", "HPS_STORE=",
                               "HPS_JOB_ID=", "HPS_STORE_TOKEN=", "HPS_STORE_FD="}) {
        if (entry.rfind(name, 0) == 0) ours = true;
      }
      if (!ours) env.emplace_back(entry);
    }
    env.push_back("HPS_RANK=" + std::to_string(rank));
    env.push_back("HPS_WORLD_SIZE=" + std::to_string(options_.nproc));
    env.push_back("HPS_LOCAL_RANK=" + std::to_string(rank));
    env.push_back("HPS_STORE=" + store_url);
    env.push_back("HPS_JOB_ID=" + job_id_);
    if (!token_.empty()) env.push_back("HPS_STORE_TOKEN=" + token_);
    if (rank == 0 && store_fd_ >= 0) env.push_back("HPS_STORE_FD=" + std::to_string(store_fd_));
    return env;
  }

  // A process that outlives a launcher killed with SIGKILL (which runs no code of its own):
  // it learns of the death from its pipe's end of file, kills what is left of the ranks'
  // process groups, and removes the file store's directory and the job's shared-memory
  // segments once the ranks have gone. Started before the ranks, in a session of its own
  // before any rank exists; the launcher tells it of each rank it starts and reaps (so a
  // reused pid is never signalled) and, at a normal end, that there is nothing to do.
  void start_janitor() {
    int link[2];
    if (::pipe2(link, O_CLOEXEC) != 0) {
      say(std::string("pipe: ") + std::strerror(errno) + " (no clean-up if killed)");
      return;
    }
    // Signals wait while the child still has the launcher's handlers (which write to the
    // launcher's signal pipe).
    sigset_t all, previous;
    sigfillset(&all);
    ::sigprocmask(SIG_SETMASK, &all, &previous);
    const pid_t pid = ::fork();
    if (pid == 0) {
      // A session of its own: a signal to the launcher's whole process group (`timeout -s
      // KILL`, a terminal's hangup or ^Z) must not reach the process that cleans up after it.
      ::setsid();
      // Interrupts meant for the job are the launcher's to handle; this process waits for
      // its end.
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) std::signal(sig, SIG_IGN);
      for (int sig : {SIGCHLD, SIGTSTP, SIGCONT}) std::signal(sig, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &previous, nullptr);
      ::close(link[1]);
      janitor(link[0]);  // never returns
    }
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    if (pid < 0) {
      say(std::string("fork: ") + std::strerror(errno) + " (no clean-up if killed)");
      ::close(link[0]);
      ::close(link[1]);
      return;
    }
    ::close(link[0]);
    janitor_pid_ = pid;
    janitor_fd_ = link[1];
    // No rank starts before the clean-up has left the launcher's session: a SIGKILL of the
    // launcher's group in between would end both.
    for (int i = 0; i < 5000 && ::getsid(pid) != pid; ++i) ::usleep(200);
  }

  [[noreturn]] void janitor(int from_launcher) {
    // The ranks' output pipes and the rest: listed first (the listing has a descriptor of
    // its own), then closed.
    std::vector<int> inherited;
    std::error_code ignored;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ignored)) {
      const int fd = std::atoi(entry.path().filename().c_str());
      if (fd > STDERR_FILENO && fd != from_launcher) inherited.push_back(fd);
    }
    for (int fd : inherited) ::close(fd);
    const size_t nproc = static_cast<size_t>(options_.nproc);
    std::vector<pid_t> pids(nproc, -1);
    std::vector<bool> reaped(nproc, false);
    std::string pending;
    bool done = false;
    char buffer[4096];
    while (true) {
      const ssize_t n = ::read(from_launcher, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      pending.append(buffer, static_cast<size_t>(n));
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos; pending.erase(0, nl + 1)) {
        const std::string line = pending.substr(0, nl);
        if (line == "done") {
          done = true;
        } else if (line.rfind("reaped ", 0) == 0) {
          const size_t r = static_cast<size_t>(std::atol(line.c_str() + 7));
          if (r < reaped.size()) reaped[r] = true;
        } else if (long r = 0, pid = 0;
                   std::sscanf(line.c_str(), "started %ld %ld", &r, &pid) == 2) {
          if (r >= 0 && static_cast<size_t>(r) < pids.size() && pid > 0) {
            pids[static_cast<size_t>(r)] = static_cast<pid_t>(pid);
          }
        }
      }
    }
    if (done) ::_exit(0);
    // The launcher died without cleaning up. Its ranks got SIGKILL (PR_SET_PDEATHSIG); what
    // they started gets it here.
    for (size_t r = 0; r < nproc; ++r) {
      if (!reaped[r] && pids[r] > 0) ::kill(-pids[r], SIGKILL);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (size_t r = 0; r < nproc; ++r) {
      while (!reaped[r] && pids[r] > 0 && ::kill(pids[r], 0) == 0 && Clock::now() < deadline) {
        ::usleep(20'000);
      }
    }
    if (!store_dir_.empty()) std::filesystem::remove_all(store_dir_, ignored);
    (void)hps::shm::remove_job_segments(job_id_);
    ::_exit(0);
  }

  void tell_janitor(const std::string& line) {
    if (janitor_fd_ >= 0) write_all(janitor_fd_, line + "\n");
  }

  void stop_janitor() {
    if (janitor_fd_ < 0) return;
    tell_janitor("done");
    ::close(janitor_fd_);
    janitor_fd_ = -1;
    int status = 0;
    while (::waitpid(janitor_pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }

  bool start_ranks(const std::string& store_url) {
    std::vector<char*> argv;
    for (auto& a : options_.command) argv.push_back(a.data());
    argv.push_back(nullptr);
    ranks_.resize(static_cast<size_t>(options_.nproc));
    const pid_t launcher = ::getpid();
    // Input: rank 0 reads the launcher's, the other ranks /dev/null (as mpirun's ranks). A
    // rank is in a process group of its own, never the terminal's foreground group: reading
    // a terminal directly it would be stopped (SIGTTIN), so the launcher's controlling
    // terminal reaches rank 0 through a pipe the launcher writes on.
    struct RankInputs {  // the ends the ranks' stdin are made from, closed here after fork
      int no_input = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      int terminal_pipe = -1;
      ~RankInputs() {
        for (int fd : {no_input, terminal_pipe}) {
          if (fd >= 0) ::close(fd);
        }
      }
    } inputs;
    if (::isatty(STDIN_FILENO) && ::tcgetpgrp(STDIN_FILENO) >= 0) {
      int input[2];
      if (::pipe2(input, O_CLOEXEC) != 0) {
        say(std::string("pipe: ") + std::strerror(errno));
        return false;
      }
      ::fcntl(input[1], F_SETFL, O_NONBLOCK);
      inputs.terminal_pipe = input[0];
      input_fd_ = input[1];
    }
    for (int r = 0; r < options_.nproc; ++r) {
      RankProcess& p = ranks_[static_cast<size_t>(r)];
      p.rank = r;
      // Everything the child needs is prepared before fork: it only calls
      // async-signal-safe functions until exec.
      std::vector<std::string> env = rank_environment(r, store_url);
      std::vector<char*> envp;
      for (auto& e : env) envp.push_back(e.data());
      envp.push_back(nullptr);
      int out[2] = {-1, -1};  // a failed pipe2 leaves its array as it was
      int err[2] = {-1, -1};
      // The rank runs its command once the clean-up process knows its pid (a byte on `go`):
      // a launcher killed in between leaves a rank that ends at the pipe's end of file,
      // never one whose children nothing would kill.
      int go[2] = {-1, -1};
      if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 ||
          ::pipe2(go, O_CLOEXEC) != 0) {
        say(std::string("pipe: ") + std::strerror(errno));
        for (int fd : {out[0], out[1], err[0], err[1]}) {
          if (fd >= 0) ::close(fd);
        }
        abandon_started();
        return false;
      }
      // Signals wait while the child still has the launcher's handlers: it resets them,
      // then unblocks, so a signal sent to it before its exec acts on it.
      sigset_t all, previous;
      sigfillset(&all);
      ::sigprocmask(SIG_SETMASK, &all, &previous);
      const pid_t pid = ::fork();
      if (pid != 0) ::sigprocmask(SIG_SETMASK, &previous, nullptr);
      if (pid < 0) {
        say(std::string("fork: ") + std::strerror(errno));
        for (int fd : {out[0], out[1], err[0], err[1], go[0], go[1]}) ::close(fd);
        abandon_started();
        return false;
      }
      if (pid == 0) {
        // Killed with the launcher, whatever ends it (SIGKILL included); when it has died
        // already, at once.
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != launcher) ::_exit(137);
        // Own process group: stopping a rank also stops what it started.
        ::setpgid(0, 0);
        if (r != 0 && inputs.no_input >= 0) {
          ::dup2(inputs.no_input, STDIN_FILENO);
        } else if (r == 0 && inputs.terminal_pipe >= 0) {
          ::dup2(inputs.terminal_pipe, STDIN_FILENO);
        }
        ::dup2(out[1], STDOUT_FILENO);
        ::dup2(err[1], STDERR_FILENO);
        std::signal(SIGPIPE, SIG_DFL);
        // The launcher's handlers are not the rank's: a signal before the exec (the launcher
        // stopping the ranks) must act on this process, not write to the launcher's pipe.
        for (int s : kHandledSignals) std::signal(s, SIG_DFL);
        // Rank 0 inherits the store's listening socket (HPS_STORE_FD); the others do not.
        if (r == 0 && store_fd_ >= 0) ::fcntl(store_fd_, F_SETFD, 0);
        sigset_t none;
        sigemptyset(&none);
        ::sigprocmask(SIG_SETMASK, &none, nullptr);
        ::close(go[1]);
        char started = 0;
        ssize_t got;
        while ((got = ::read(go[0], &started, 1)) < 0 && errno == EINTR) {
        }
        if (got != 1) ::_exit(137);  // the launcher died before it told the clean-up
        environ = envp.data();
        ::execvp(argv[0], argv.data());
        const char* why = std::strerror(errno);
        write_all(STDERR_FILENO,
                  std::string("hpshard-run: cannot run '") + argv[0] + "': " + why + "\n");
        ::_exit(127);
      }
      ::setpgid(pid, pid);  // also here, so the group exists before any kill(-pid)
      tell_janitor("started " + std::to_string(r) + " " + std::to_string(pid));
      write_all(go[1], "g");
      ::close(go[0]);
      ::close(go[1]);
      ::close(out[1]);
      ::close(err[1]);
      ::fcntl(out[0], F_SETFL, O_NONBLOCK);
      ::fcntl(err[0], F_SETFL, O_NONBLOCK);
      p.pid = pid;
      p.running = true;
      p.group_alive = true;
      p.out.fd = out[0];
      p.out.target = STDOUT_FILENO;
      p.err.fd = err[0];
      p.err.target = STDERR_FILENO;
      // Partial lines a person waits for: on a terminal, and rank 0's prompts for the
      // terminal the launcher passes on.
      for (OutputStream* s : {&p.out, &p.err}) {
        s->flush_idle = output().is_terminal(s->target) || (r == 0 && input_fd_ >= 0);
      }
      ++running_;
    }
    return true;
  }

  // After a failure to start every rank: the ranks started so far are killed and reaped,
  // their output written and their pipes closed, so the clean-up after them (the store's
  // directory, the shared-memory listing) has the descriptors it needs.
  void abandon_started() {
    stop_all(SIGKILL);
    for (auto& p : ranks_) {
      if (!p.running) continue;
      int status = 0;
      while (::waitpid(p.pid, &status, 0) < 0 && errno == EINTR) {
      }
      p.running = false;
      --running_;
      close_stream(p.prefix(), p.out);
      close_stream(p.prefix(), p.err);
    }
  }

  void stop_all(int signal) {
    sent_.insert(signal);
    for (auto& p : ranks_) {
      if (p.group_alive && ::kill(-p.pid, signal) != 0 && errno == ESRCH) p.group_alive = false;
    }
  }

  bool sent_by_us(int signal) const { return sent_.count(signal) != 0; }

  // Every rank has exited 0: the processes left in their groups are stopped.
  void end_what_the_ranks_left() {
    std::string left;
    for (auto& p : ranks_) {
      if (!p.group_alive) continue;
      if (::kill(-p.pid, 0) != 0 && errno == ESRCH) {
        p.group_alive = false;
      } else {
        left += (left.empty() ? "" : ", ") + std::to_string(p.rank);
      }
    }
    if (left.empty()) return;
    say("the job succeeded; stopping what rank" +
        std::string(left.find(',') == std::string::npos ? " " : "s ") + left +
        " left running (SIGTERM, then SIGKILL after " + seconds_text(options_.grace_s) + " s)");
    stop_all(SIGTERM);
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options_.grace_s));
    while (Clock::now() < deadline) {
      bool alive = false;
      for (auto& p : ranks_) {
        if (p.group_alive && ::kill(-p.pid, 0) != 0 && errno == ESRCH) p.group_alive = false;
        alive = alive || p.group_alive;
      }
      if (!alive) return;
      ::usleep(20'000);
    }
    stop_all(SIGKILL);
  }

  // Sends SIGTERM now and SIGKILL after the grace period to every rank still running.
  void begin_stop() {
    if (kill_deadline_) return;
    stop_all(SIGTERM);
    kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(options_.grace_s));
  }

  void reap() {
    while (true) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      for (auto& p : ranks_) {
        if (p.pid != pid || !p.running) continue;
        p.running = false;
        --running_;
        if (p.rank == 0) stop_forwarding_input();
        tell_janitor("reaped " + std::to_string(p.rank));
        if (running_ == 0) {
          ranks_ended_ = Clock::now();
          drain_deadline_ = *ranks_ended_ + kDrainAfterExit;
        }
        const int code = exit_code_of(status);
        if (code == 0 && running_ > 0 && !failure_ && interrupted_ == 0 && !kill_deadline_) {
          early_exits_.push_back({p.rank, seconds_since(started_)});
        }
        // An end the launcher caused (its own SIGTERM or SIGKILL, or the signal it forwarded
        // and the rank's answer to it) is not a rank's failure.
        const bool caused_here =
            (WIFSIGNALED(status) && sent_by_us(WTERMSIG(status))) || interrupted_ != 0;
        if (code != 0 && !failure_ && caused_here) {
          say("rank " + std::to_string(p.rank) + " " + describe(status) +
              (interrupted_ != 0 ? " after the signal hpshard-run forwarded"
                                 : " when hpshard-run stopped it"));
        } else if (code != 0 && !failure_) {
          failure_ = code;
          say("rank " + std::to_string(p.rank) + " " + describe(status) +
              (running_ > 0 ? "; stopping the other ranks" : "") + early_exits_note());
          begin_stop();
        } else if (code != 0 && WIFSIGNALED(status) && !sent_by_us(WTERMSIG(status))) {
          // Also named: a rank killed from outside (the OOM killer, a user) whose end was
          // reaped after a peer's, which its death may have caused.
          say("rank " + std::to_string(p.rank) + " also " + describe(status) +
              ", a signal hpshard-run did not send");
        }
      }
    }
  }

  // The moment after which the job's end no longer waits for the launcher's reader: that
  // reader has taken none of what waits for kOutputWaitEnded (kOutputWaitStopped after
  // --timeout or a signal) since the ranks ended.
  Clock::time_point output_give_up() const {
    const auto since = std::max(*ranks_ended_, output().last_progress());
    return since + (interrupted_ != 0 || timed_out_
                        ? std::chrono::duration_cast<Clock::duration>(kOutputWaitStopped)
                        : std::chrono::duration_cast<Clock::duration>(kOutputWaitEnded));
  }

  // Rank 0's streams before the launcher passes it input: a prompt it wrote goes out first.
  // A typed line, echoed by the terminal, ended the line open there.
  void before_input(bool typed_line) {
    RankProcess& p = ranks_.front();
    for (OutputStream* s : {&p.out, &p.err}) {
      if (typed_line && output().is_terminal(s->target)) output().forget_open_line(s->target);
    }
    for (OutputStream* s : {&p.out, &p.err}) emit_lines(p.prefix(), *s, Emit::kPartial);
  }

  int supervise() {
    const auto job_deadline =
        options_.timeout_s > 0
            ? std::optional(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(options_.timeout_s)))
            : std::nullopt;
    Output& out = output();
    out.start();
    while (true) {
      std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
      if (out.started()) fds.push_back({out.wake_fd(), POLLIN, 0});
      const size_t first_stream = fds.size();
      // While the launcher's reader lags, the ranks' output waits in their pipes.
      const bool held = out.pending() >= kOutputQueueBytes;
      std::vector<std::pair<RankProcess*, OutputStream*>> streams;
      bool open_streams = false;
      for (auto& p : ranks_) {
        for (OutputStream* s : {&p.out, &p.err}) {
          if (s->fd < 0) continue;
          open_streams = true;
          if (held) continue;
          fds.push_back({s->fd, POLLIN, 0});
          streams.emplace_back(&p, s);
        }
      }
      if (running_ == 0 && !open_streams) break;
      // Rank 0's input from the terminal: read while the launcher is in the terminal's
      // foreground (in the background a read would stop it, SIGTTIN), written on as rank 0
      // takes it.
      std::optional<size_t> input_at;
      bool input_waits_for_foreground = false;
      if (input_fd_ >= 0 && running_ > 0) {
        if (!input_pending_.empty()) {
          input_at = fds.size();
          fds.push_back({input_fd_, POLLOUT, 0});
        } else if (::tcgetpgrp(STDIN_FILENO) == ::getpgrp()) {
          input_at = fds.size();
          fds.push_back({STDIN_FILENO, POLLIN, 0});
        } else {
          input_waits_for_foreground = true;
        }
      }

      std::optional<Clock::time_point> wake;
      auto earliest = [&](std::optional<Clock::time_point> t) {
        if (t && (!wake || *t < *wake)) wake = t;
      };
      if (running_ > 0) {
        earliest(kill_deadline_);
        earliest(job_deadline);
      } else if (held) {
        earliest(output_give_up());
      } else {
        earliest(drain_deadline_);
      }
      for (auto& p : ranks_) {
        for (OutputStream* s : {&p.out, &p.err}) {
          if (s->flush_idle && !s->partial.empty()) earliest(s->last_read + kPartialLineIdle);
        }
      }
      int timeout_ms = -1;
      if (wake) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(*wake - Clock::now());
        timeout_ms = static_cast<int>(std::clamp<int64_t>(left.count() + 1, 0, 60'000));
      }
      // A job in the background looks again now and then whether it has been brought back.
      if (input_waits_for_foreground && (timeout_ms < 0 || timeout_ms > 250)) timeout_ms = 250;
      const int n = ::poll(fds.data(), fds.size(), timeout_ms);
      if (n < 0 && errno != EINTR) {
        say(std::string("poll: ") + std::strerror(errno));
        stop_all(SIGKILL);
        return 1;
      }
      if (n > 0 && fds[0].revents != 0) handle_signals();
      if (n > 0 && first_stream > 1 && fds[1].revents != 0) out.clear_wakes();
      if (n > 0 && input_at && fds[*input_at].revents != 0) forward_input();
      for (size_t i = 0; n > 0 && i < streams.size(); ++i) {
        if (fds[first_stream + i].revents == 0) continue;
        auto [p, s] = streams[i];
        pump(p->prefix(), *s);
      }
      reap();
      const auto now = Clock::now();
      for (auto& p : ranks_) {
        for (OutputStream* s : {&p.out, &p.err}) {
          if (s->flush_idle && !s->partial.empty() && now >= s->last_read + kPartialLineIdle) {
            emit_lines(p.prefix(), *s, Emit::kPartial);
          }
        }
      }
      if (running_ > 0 && job_deadline && now >= *job_deadline && !timed_out_) {
        timed_out_ = true;
        say("timeout of " + seconds_text(options_.timeout_s) + " s expired; stopping the ranks" +
            early_exits_note());
        if (!failure_) failure_ = kTimeoutExit;
        begin_stop();
      }
      if (running_ > 0 && kill_deadline_ && now >= *kill_deadline_) {
        say("ranks still running after the grace period; sending SIGKILL");
        stop_all(SIGKILL);
        kill_deadline_ = now + std::chrono::hours(24);  // SIGKILL cannot be ignored
      }
      if (running_ == 0 && held && drain_deadline_) {
        // Output still held open is read for kDrainAfterExit once the reader takes more.
        drain_deadline_ = std::max(*drain_deadline_, now + kDrainAfterExit);
      }
      if (running_ == 0 && drain_deadline_ &&
          (now >= *drain_deadline_ || (held && now >= output_give_up()))) {
        for (auto& p : ranks_) {
          close_stream(p.prefix(), p.out);
          close_stream(p.prefix(), p.err);
        }
      }
    }
    if (failure_) return *failure_;
    if (interrupted_) return 128 + interrupted_;
    return 0;
  }

  // Waits until the launcher's own output is written, or its reader is given up on (a
  // signal then changes an exit code of 0 as it does while the ranks run).
  int finish_output(int code) {
    Output& out = output();
    if (!out.started()) return code;
    if (!ranks_ended_) ranks_ended_ = Clock::now();
    while (out.pending() > 0) {
      const auto give_up = output_give_up();
      const auto now = Clock::now();
      if (now >= give_up) {
        const size_t left = out.pending();
        // Said only where it cannot land inside a line waiting for the same reader.
        if (!out.same_file() && out.pending_on(STDERR_FILENO) == 0) {
          pollfd writable{STDERR_FILENO, POLLOUT, 0};
          if (::poll(&writable, 1, 0) == 1 && (writable.revents & POLLOUT) != 0) {
            write_all(STDERR_FILENO,
                      "hpshard-run: " + std::to_string(left) +
                          " bytes of the ranks' output not written: its reader took none for " +
                          seconds_text(std::chrono::duration<double>(interrupted_ != 0 || timed_out_
                                                                         ? kOutputWaitStopped
                                                                         : kOutputWaitEnded)
                                           .count()) +
                          " s\n");
          }
        }
        break;
      }
      pollfd fds[2] = {{g_signal_pipe[0], POLLIN, 0}, {out.wake_fd(), POLLIN, 0}};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - now);
      const int n =
          ::poll(fds, 2, static_cast<int>(std::clamp<int64_t>(left.count() + 1, 0, 60'000)));
      if (n > 0 && fds[0].revents != 0) handle_signals();
      if (n > 0 && fds[1].revents != 0) out.clear_wakes();
    }
    if (code == 0 && interrupted_ != 0) return 128 + interrupted_;
    return code;
  }

  // Reads what the terminal has for rank 0 or writes on what rank 0's pipe did not take.
  // The terminal's end of file (^D), its hangup or rank 0 closing its input ends it: rank 0
  // then reads end of file.
  void forward_input() {
    if (input_pending_.empty()) {
      char buffer[4096];
      const ssize_t n = ::read(STDIN_FILENO, buffer, sizeof buffer);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
      if (n <= 0) {
        stop_forwarding_input();
        return;
      }
      input_pending_.assign(buffer, static_cast<size_t>(n));
      before_input(input_pending_.find('\n') != std::string::npos);
    }
    const ssize_t n = ::write(input_fd_, input_pending_.data(), input_pending_.size());
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n < 0) {
      stop_forwarding_input();  // rank 0 closed its input (EPIPE)
      return;
    }
    input_pending_.erase(0, static_cast<size_t>(n));
  }

  void stop_forwarding_input() {
    if (input_fd_ < 0) return;
    ::close(input_fd_);
    input_fd_ = -1;
    input_pending_.clear();
  }

  void handle_signals() {
    unsigned char signals[64];
    ssize_t n = 0;
    while ((n = ::read(g_signal_pipe[0], signals, sizeof signals)) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        const int s = signals[i];
        if (s == SIGCHLD) continue;  // reap() runs after every wake-up
        if (s == SIGTSTP || s == SIGCONT) {
          job_control(s);
          continue;
        }
        // Forward, and stop the ranks that do not exit on it within the grace period.
        if (!interrupted_) {
          interrupted_ = s;
          say(std::string("received ") + strsignal(s) + "; forwarding it to the ranks");
        }
        stop_all(s);
        if (!kill_deadline_) {
          kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(options_.grace_s));
        }
      }
    }
  }

  // ^Z (SIGTSTP) stops the ranks' groups, then the launcher; SIGCONT (a shell's `fg` or
  // `bg`) continues them. A rank that handles SIGTSTP itself decides what it does.
  void job_control(int signal) {
    for (auto& p : ranks_) {
      if (p.group_alive && ::kill(-p.pid, signal) != 0 && errno == ESRCH) p.group_alive = false;
    }
    // SIGSTOP, which a process group no terminal controls (a job started with setsid or
    // nohup) does not discard as it discards an unhandled SIGTSTP.
    if (signal == SIGTSTP) ::raise(SIGSTOP);
  }

  static double seconds_since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  }

  // A job that fails or times out after some ranks ended with code 0 while the others ran
  // names them: the failure is the peers' to report (their collectives with a rank that left
  // fail once its connections end; a rendezvous waits until its timeout).
  std::string early_exits_note() const {
    if (early_exits_.empty()) return "";
    std::string text = "; ";
    for (size_t i = 0; i < early_exits_.size() && i < 8; ++i) {
      text += (i > 0 ? ", " : "") + std::string("rank ") + std::to_string(early_exits_[i].first) +
              " had exited with code 0 after " + seconds_text(early_exits_[i].second) + " s";
    }
    if (early_exits_.size() > 8) {
      text += " and " + std::to_string(early_exits_.size() - 8) + " more ranks too";
    }
    return text +
           " while the others ran (a collective with a rank that left fails once its connections"
           " end, at once where its process exits; a rendezvous waits until its timeout)";
  }

  Options options_;
  std::set<int> sent_;  // the signals stop_all() has sent to the ranks
  Clock::time_point started_ = Clock::now();
  std::vector<std::pair<int, double>> early_exits_;  // (rank, seconds after the start)
  std::vector<RankProcess> ranks_;
  int running_ = 0;
  std::optional<int> failure_;
  int interrupted_ = 0;
  bool timed_out_ = false;
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> drain_deadline_;
  std::optional<Clock::time_point> ranks_ended_;  // when the last rank was reaped
  std::string store_dir_;
  std::string job_id_;
  std::string token_;
  int store_fd_ = -1;
  pid_t janitor_pid_ = -1;
  int janitor_fd_ = -1;
  // The write end of rank 0's input pipe while the launcher passes its terminal on, and
  // what rank 0 has not taken yet.
  int input_fd_ = -1;
  std::string input_pending_;
};

}  // namespace

int main(int argc, char** argv) {
  // A standard descriptor the launcher was started without is /dev/null: otherwise the next
  // descriptor opened (the signal pipe) would take its number, and output meant for it would
  // be read as signals.
  for (int fd = STDIN_FILENO; fd <= STDERR_FILENO; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF &&
        ::open("/dev/null", fd == STDIN_FILENO ? O_RDONLY : O_WRONLY) != fd) {
      return 1;
    }
  }
  Options options;
  if (auto exit_now = parse_options(argc, argv, &options)) return *exit_now;
  return Launcher(std::move(options)).run();
}
