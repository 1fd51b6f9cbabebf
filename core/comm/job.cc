// Keys of the protocol (in the store's own key space, beside the jobs' key spaces):
//   hpshard/job/ticket              counter: each rank 0 that arrives takes the next ticket
//   hpshard/job/owner/T             ticket T's record: job id, world size, host, pid, and a
//                                   random nonce (a new server of a TCP store counts its
//                                   tickets from 1 again: the nonce tells the records apart)
//   hpshard/job/owner/T/decision    "accepted" or "refused: <why>"
//   hpshard/job/owner/T/closed      set when T's rank 0 closed the store
//   hpshard/job/current             the ticket of the job that holds the store
//   hpshard/job/id/<job id>         the ticket of the last rank 0 of that job id
//   hpshard/run/T-N/...             the keys of the job of ticket T and nonce N (rank/R:
//                                   joins of rank R)
// Rank 0 with ticket T decides after ticket T-1 has decided, so rank 0s arriving together
// are decided one at a time.
#include "core/comm/job.h"

#include <unistd.h>

#include <charconv>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/comm/auth.h"
#include "core/comm/host.h"
#include "core/common/env.h"
#include "core/common/logging.h"

namespace hps {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxJobIdBytes = 256;
constexpr Milliseconds kFirstPoll{2};
constexpr Milliseconds kMaxPoll{50};
// How long a rank whose job's rank 0 was refused and has gone waits for a new rank 0 of
// the same job id before it reports the refusal.
constexpr Milliseconds kRestartGrace{2000};

const std::string kTicket = "hpshard/job/ticket";
const std::string kCurrent = "hpshard/job/current";
std::string owner_key(int64_t t) { return "hpshard/job/owner/" + std::to_string(t); }
std::string decision_key(int64_t t) { return owner_key(t) + "/decision"; }
std::string closed_key(int64_t t) { return owner_key(t) + "/closed"; }
std::string id_key(const std::string& id) { return "hpshard/job/id/" + id; }

// Who holds (or asked for) the store: a job id and size, its rank 0's process, and a nonce
// drawn at random for this record.
struct Owner {
  int64_t ticket = 0;
  std::string id;
  int32_t world_size = 0;
  std::string nonce;
  host::Process process;

  std::string encode() const {
    return "id " + id + "\nworld " + std::to_string(world_size) + "\nnonce " + nonce + "\n" +
           process.encode();
  }

  static std::optional<Owner> parse(int64_t ticket, const std::string& text) {
    Owner o;
    o.ticket = ticket;
    auto process = host::Process::parse(text);
    if (!process) return std::nullopt;
    o.process = std::move(*process);
    std::istringstream in(text);
    std::string line;
    bool has_id = false, has_world = false;
    while (std::getline(in, line)) {
      const size_t space = line.find(' ');
      if (space == std::string::npos) return std::nullopt;
      const std::string name = line.substr(0, space), value = line.substr(space + 1);
      if (name == "id") {
        o.id = value;
        has_id = true;
      } else if (name == "world") {
        auto [end, error] =
            std::from_chars(value.data(), value.data() + value.size(), o.world_size);
        if (error != std::errc() || end != value.data() + value.size()) return std::nullopt;
        has_world = true;
      } else if (name == "nonce") {
        o.nonce = value;
      }
    }
    // A record without a nonce (a store left by an older version) stays readable: its
    // empty nonce matches no record this process joined.
    if (!has_id || !has_world) return std::nullopt;
    return o;
  }

  bool on_this_host() const { return process.on_this_host(); }
  bool ended() const { return process.ended(); }

  std::string describe() const { return "job '" + id + "' (rank 0 is " + process.describe() + ")"; }
};

// The keys of the job of record `o`: named by its ticket and nonce, so a TCP store's next
// server, which counts its tickets from 1 again, never gives a later job the keys of a job
// whose clients still hold the store (a record without a nonce: by its ticket alone).
std::string run_prefix(const Owner& o) {
  return "hpshard/run/" + std::to_string(o.ticket) + (o.nonce.empty() ? "" : "-" + o.nonce);
}

// `what` names where `id` (or a part of one) came from: "environment variable SLURM_JOB_ID".
Status check_job_id(const std::string& id, const std::string& what) {
  if (id.size() > kMaxJobIdBytes) {
    return invalid_argument(what + " holds " + std::to_string(id.size()) +
                            " bytes; a job id takes at most " + std::to_string(kMaxJobIdBytes));
  }
  for (char ch : id) {
    const auto byte = static_cast<unsigned char>(ch);
    if (byte < 0x20 || byte == 0x7F) {
      return invalid_argument(what + " holds a control character; a job id takes none");
    }
  }
  return Status::Ok();
}

// A job id from `variables` joined by ':' ("name" or "name:count"); empty when the first
// is unset. `none` is a value that counts as unset (torchrun's default run id). Each value
// is checked on its own, so a message names the variable that holds the bad one and that
// value's length; a job id too long only once the prefix and the other values join it
// names them all with their lengths.
StatusOr<JobIdentity> identity_from(const std::string& prefix,
                                    std::initializer_list<const char*> variables,
                                    const char* none = nullptr) {
  JobIdentity identity;
  auto first = env_string(*variables.begin());
  if (!first || first->empty() || (none && *first == none)) return identity;
  identity.id = prefix;
  std::string lengths;
  for (const char* variable : variables) {
    auto value = env_string(variable);
    if (!value) continue;
    HPS_RETURN_IF_ERROR(check_job_id(*value, std::string("environment variable ") + variable));
    if (!identity.source.empty()) {
      identity.id += ":";
      identity.source += ", ";
      lengths += ", ";
    }
    identity.id += *value;
    identity.source += variable;
    lengths += std::string(variable) + " (" + std::to_string(value->size()) + " bytes)";
  }
  if (identity.id.size() > kMaxJobIdBytes) {
    return invalid_argument("the job id made of " +
                            (prefix.empty() ? std::string() : "'" + prefix + "' and ") + lengths +
                            " is " + std::to_string(identity.id.size()) + " bytes; at most " +
                            std::to_string(kMaxJobIdBytes) + " are allowed");
  }
  return identity;
}

// Polls `done` until it is true or `deadline` passes; false at the deadline.
template <typename Done>
StatusOr<bool> poll_until(Clock::time_point deadline, Done done) {
  Milliseconds backoff = kFirstPoll;
  while (true) {
    HPS_ASSIGN_OR_RETURN(bool finished, done());
    if (finished) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_until(std::min(deadline, now + backoff));
    backoff = std::min(backoff * 2, kMaxPoll);
  }
}

StatusOr<int64_t> parse_ticket(const std::string& key, const std::string& text) {
  int64_t t = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), t);
  if (error != std::errc() || end != text.data() + text.size() || t < 1) {
    return backend_error("store key '" + key + "' holds '" + text + "', not a ticket");
  }
  return t;
}

// What a rank of this process did with a take-over record (its nonce): never joined it, joined
// it and holds it open, or joined and closed it. A rank that opens its job's store again after
// closing it waits for the next record (its rank 0's next take-over) instead of joining the one
// it left; one that opens it while it is still open is refused at once.
enum class JoinedHere { kNever, kOpen, kClosed };

// A map kept for the whole process, under a mutex of its own; never destroyed (stores may
// go at exit). `Tag` tells maps of the same types apart.
template <typename Tag, typename Key, typename Value>
struct ProcessMap {
  template <typename F>
  static auto with(F f) {
    Table& t = table();  // one per map, whatever `f` is
    std::lock_guard lock(t.mutex);
    return f(t.map);
  }

 private:
  struct Table {
    std::mutex mutex;
    std::map<Key, Value> map;
  };
  static Table& table() {
    static auto* t = new Table();
    return *t;
  }
};

// Whether each record (its nonce) joined by each rank of this process is open.
using JoinedStores = ProcessMap<struct JoinedTag, std::pair<std::string, int32_t>, bool>;
// How many job stores this process has open, by store URL and rank.
using OpenHere = ProcessMap<struct OpenTag, std::pair<std::string, int32_t>, int>;
// The ids rank 0 made up for jobs without one, by store URL (see join_job in job.h).
using MadeUpIds = ProcessMap<struct MadeUpTag, std::string, std::string>;

JoinedHere joined_here(const std::string& nonce, int32_t rank) {
  if (nonce.empty()) return JoinedHere::kNever;
  return JoinedStores::with([&](auto& joined) {
    auto it = joined.find({nonce, rank});
    if (it == joined.end()) return JoinedHere::kNever;
    return it->second ? JoinedHere::kOpen : JoinedHere::kClosed;
  });
}

void count_open(const std::string& store, int32_t rank, int delta) {
  OpenHere::with([&](auto& counts) {
    if ((counts[{store, rank}] += delta) == 0) counts.erase({store, rank});
  });
}

// The job's key space; rank 0's marks the job closed when it goes.
class JobStore final : public ForwardingStore {
 public:
  JobStore(std::shared_ptr<Store> base, const Owner& job, int32_t rank, std::string store)
      : ForwardingStore(make_prefix_store(base, run_prefix(job))),
        base_(std::move(base)),
        ticket_(job.ticket),
        nonce_(job.nonce),
        rank_(rank),
        store_(std::move(store)) {
    JoinedStores::with([&](auto& joined) { joined[{nonce_, rank_}] = true; });
    count_open(store_, rank_, 1);
  }
  ~JobStore() override {
    if (rank_ == 0) (void)base_->set(closed_key(ticket_), "1");
    JoinedStores::with([&](auto& joined) { joined[{nonce_, rank_}] = false; });
    count_open(store_, rank_, -1);
  }

 private:
  std::shared_ptr<Store> base_;
  int64_t ticket_;
  std::string nonce_;
  int32_t rank_;
  std::string store_;
};

class Joiner {
 public:
  Joiner(Store& store, int32_t rank, const JobOptions& options, Milliseconds timeout)
      : store_(store),
        rank_(rank),
        options_(options),
        timeout_(timeout),
        deadline_(Clock::now() + clamp_store_wait(timeout)) {}

  // Rank 0: takes a ticket, waits for the one before to decide, then takes the store over
  // unless its holder still runs (or cannot be checked).
  StatusOr<Owner> take_over() {
    Owner me;
    HPS_ASSIGN_OR_RETURN(std::string random, auth::new_token());
    me.nonce = random.substr(16, 16);
    me.id = options_.identity.id;
    if (me.id.empty()) me.id = "random-" + random.substr(0, 16);
    me.world_size = options_.world_size;
    me.process = host::Process::self();
    HPS_ASSIGN_OR_RETURN(me.ticket, store_.add(kTicket, 1));
    HPS_RETURN_IF_ERROR(store_.set(owner_key(me.ticket), me.encode()));
    HPS_RETURN_IF_ERROR(store_.set(id_key(me.id), std::to_string(me.ticket)));
    if (me.ticket > 1) HPS_RETURN_IF_ERROR(wait_decided(me.ticket - 1));

    std::string refusal;
    HPS_ASSIGN_OR_RETURN(bool held, store_.check({kCurrent}));
    if (held) {
      HPS_ASSIGN_OR_RETURN(Owner holder, owner_of_pointer(kCurrent));
      const bool this_process = holder.on_this_host() && holder.process.pid == ::getpid();
      bool closed = false;
      if (holder.id == me.id && !this_process) {
        // Rank 0 of this same job in another process (ranks that changed roles between
        // phases): it closes the store soon; wait for that, as the other ranks wait.
        HPS_ASSIGN_OR_RETURN(closed, poll_until(deadline_, [&]() -> StatusOr<bool> {
                               HPS_ASSIGN_OR_RETURN(bool c,
                                                    store_.check({closed_key(holder.ticket)}));
                               return c || holder.ended();
                             }));
        if (closed) {
          HPS_ASSIGN_OR_RETURN(closed, store_.check({closed_key(holder.ticket)}));
        }
      } else {
        HPS_ASSIGN_OR_RETURN(closed, store_.check({closed_key(holder.ticket)}));
      }
      if (closed) {
        HPS_LOG(kDebug) << "store " << options_.where << ": " << holder.describe()
                        << " closed it; job '" << me.id << "' takes it over";
      } else if (holder.ended()) {
        HPS_LOG(kWarn) << "store " << options_.where << ": " << holder.describe()
                       << " ended without closing it (a crashed run?); its keys are ignored "
                          "and job '"
                       << me.id << "' takes the store over";
      } else if (this_process && holder.id == me.id) {
        refusal = "the store " + options_.where + " of job '" + me.id +
                  "' is open in this process already (" + me.process.describe() +
                  ", as rank 0): open the job's store once per process and share it (or close "
                  "it, and the communicators created over it, before opening it again)";
      } else if (holder.id == me.id) {
        refusal = "the store " + options_.where + " is still held by rank 0 of this job ('" +
                  me.id + "', " + holder.process.describe() + "), which did not close it within " +
                  std::to_string(timeout_.count()) + " ms";
      } else if (holder.on_this_host()) {
        refusal = "the store " + options_.where + " is in use by " + holder.describe() +
                  ", which still runs: a second job cannot share a store; give this job "
                  "another one";
      } else {
        refusal = "the store " + options_.where + " is held by " + holder.describe() +
                  ", whose end cannot be checked from here: if that job has ended, remove "
                  "the store (or give this job another one)";
      }
    }
    if (!refusal.empty()) {
      HPS_RETURN_IF_ERROR(store_.set(decision_key(me.ticket), "refused: " + refusal));
      return failed_precondition(refusal);
    }
    HPS_RETURN_IF_ERROR(store_.set(kCurrent, std::to_string(me.ticket)));
    HPS_RETURN_IF_ERROR(store_.set(decision_key(me.ticket), "accepted"));
    HPS_RETURN_IF_ERROR(claim(me));
    return me;
  }

  // Ranks 1..: follow their job's pointer (its id's, or the store's current job when the
  // id is made up by rank 0) past records of jobs that have ended, to an accepted one.
  StatusOr<Owner> join() {
    const bool named = !options_.identity.id.empty();
    const std::string pointer = named ? id_key(options_.identity.id) : kCurrent;
    Owner skipped;  // a record found stale (ticket 0: none): wait for the pointer to leave it
    std::string stale_reason;
    while (true) {
      std::string text;
      HPS_ASSIGN_OR_RETURN(bool found, poll_until(deadline_, [&]() -> StatusOr<bool> {
                             return pointer_moved(pointer, skipped, &text);
                           }));
      if (!found) {
        return timeout_error(
            "store " + options_.where + ": rank " + std::to_string(rank_) + " waited " +
            std::to_string(timeout_.count()) + " ms for rank 0 of " + job_name() +
            (skipped.ticket != 0
                 ? " to take the store over from the job that ended there (" + stale_reason + ")"
                 : " to open the store" + held_by_another()));
      }
      HPS_ASSIGN_OR_RETURN(int64_t ticket, parse_ticket(pointer, text));
      HPS_ASSIGN_OR_RETURN(Owner owner, owner_of(ticket));
      // This process's rank joined this record before: it is open here still (a second open),
      // or this rank closed it and opens the store again, so it waits for rank 0 to take the
      // store over anew (rank 0 may not have closed it yet).
      const JoinedHere here = joined_here(owner.nonce, rank_);
      if (here == JoinedHere::kOpen) {
        return failed_precondition("the store " + options_.where + " of " + owner.describe() +
                                   " is open in this process already as rank " +
                                   std::to_string(rank_) +
                                   ": open the job's store once per process and share it (or "
                                   "close it, and the communicators created over it, before "
                                   "opening it again)");
      }
      if (here == JoinedHere::kClosed) {
        skipped = owner;
        stale_reason = "this process's rank " + std::to_string(rank_) + " closed its store of " +
                       owner.describe();
        continue;
      }
      // A refusal stands even after its rank 0 has gone: this rank's job was refused. (Unless
      // a rank 0 of the same id arrives at once: a job started again after a refusal.)
      HPS_ASSIGN_OR_RETURN(bool has_decision, store_.check({decision_key(ticket)}));
      if (has_decision) {
        HPS_ASSIGN_OR_RETURN(std::string decision, store_.get(decision_key(ticket), timeout_));
        if (decision != "accepted") {
          HPS_ASSIGN_OR_RETURN(bool moved, pointer_moves_past(pointer, ticket, owner));
          if (!moved) return refused(owner, decision);
          skipped = owner;
          stale_reason = owner.describe() + " was refused";
          continue;
        }
      }
      HPS_ASSIGN_OR_RETURN(bool closed, store_.check({closed_key(ticket)}));
      if (closed || owner.ended()) {
        skipped = owner;
        stale_reason = owner.describe() + (closed ? " closed it" : " has ended");
        continue;
      }
      std::string decision;
      HPS_ASSIGN_OR_RETURN(bool decided, poll_until(deadline_, [&]() -> StatusOr<bool> {
                             HPS_ASSIGN_OR_RETURN(bool set, store_.check({decision_key(ticket)}));
                             if (!set) return owner.ended();
                             HPS_ASSIGN_OR_RETURN(decision,
                                                  store_.get(decision_key(ticket), timeout_));
                             return true;
                           }));
      if (!decided) {
        return timeout_error("store " + options_.where + ": rank " + std::to_string(rank_) +
                             " waited " + std::to_string(timeout_.count()) + " ms for rank 0 of " +
                             owner.describe() + " to take the store over");
      }
      if (decision.empty()) {  // rank 0 died before deciding
        skipped = owner;
        stale_reason = owner.describe() + " has ended";
        continue;
      }
      if (decision != "accepted") return refused(owner, decision);
      if (owner.world_size > 0 && options_.world_size > 0 &&
          owner.world_size != options_.world_size) {
        return failed_precondition("store " + options_.where + " is held by " + owner.describe() +
                                   " of " + std::to_string(owner.world_size) +
                                   " ranks, but this rank " + std::to_string(rank_) +
                                   " belongs to a job of " + std::to_string(options_.world_size) +
                                   ": is another job using the store?");
      }
      HPS_RETURN_IF_ERROR(claim(owner));
      return owner;
    }
  }

 private:
  std::string job_name() const {
    return options_.identity.id.empty()
               ? std::string("this job")
               : "job '" + options_.identity.id + "' (" + options_.identity.source + ")";
  }

  Status refused(const Owner& owner, const std::string& decision) const {
    return failed_precondition("rank 0 of " + owner.describe() + " could not take the store " +
                               "over, so rank " + std::to_string(rank_) +
                               " cannot join: " + decision.substr(decision.find(' ') + 1));
  }

  // Whether `pointer` is set and names another record than `skipped` (ticket 0: any record);
  // *text receives its value. While it names `skipped`, whose rank 0 closed the store or
  // ended, the server of a TCP store may be going or gone: this rank keeps no connection
  // open between polls (the old server serves until its clients have gone), and a server
  // that cannot be reached counts as not moved yet (a new one takes its port).
  StatusOr<bool> pointer_moved(const std::string& pointer, const Owner& skipped,
                               std::string* text) {
    auto moved = [&]() -> StatusOr<bool> {
      HPS_ASSIGN_OR_RETURN(bool set, store_.check({pointer}));
      if (!set) return false;
      HPS_ASSIGN_OR_RETURN(*text, store_.get(pointer, timeout_));
      if (skipped.ticket == 0 || *text != std::to_string(skipped.ticket)) return true;
      HPS_ASSIGN_OR_RETURN(int64_t ticket, parse_ticket(pointer, *text));
      HPS_ASSIGN_OR_RETURN(Owner owner, owner_of(ticket));
      return owner.nonce != skipped.nonce;  // a new server counts its tickets from 1 again
    }();
    if (skipped.ticket == 0) return moved;
    if (moved.ok() ? *moved : moved.status().code() != StatusCode::kAborted) return moved;
    store_.drop_idle_connections();
    return false;
  }

  // Whether `pointer` moves past the refused `ticket` within kRestartGrace (a rank 0 of the
  // same job id started again); never while the refused rank 0 still runs.
  StatusOr<bool> pointer_moves_past(const std::string& pointer, int64_t ticket,
                                    const Owner& owner) {
    if (!owner.ended()) return false;
    return poll_until(std::min(deadline_, Clock::now() + kRestartGrace), [&]() -> StatusOr<bool> {
      HPS_ASSIGN_OR_RETURN(std::string text, store_.get(pointer, timeout_));
      return text != std::to_string(ticket);
    });
  }

  // Each rank joins a job once: a second one of the same rank belongs to another job.
  Status claim(const Owner& owner) {
    const std::string key = run_prefix(owner) + "/rank/" + std::to_string(rank_);
    HPS_ASSIGN_OR_RETURN(int64_t joins, store_.add(key, 1));
    if (joins == 1) return Status::Ok();
    return failed_precondition("rank " + std::to_string(rank_) + " of " + owner.describe() +
                               " has joined the store " + options_.where +
                               " already: is a second job using it, or did this process open "
                               "the job's store a second time (open it once and share it)?");
  }

  StatusOr<Owner> owner_of(int64_t ticket) {
    HPS_ASSIGN_OR_RETURN(std::string text, store_.get(owner_key(ticket), timeout_));
    auto owner = Owner::parse(ticket, text);
    if (!owner) {
      return backend_error("store " + options_.where + ": the record of ticket " +
                           std::to_string(ticket) + " is malformed");
    }
    return *owner;
  }

  // For a rank that waited in vain for its job's rank 0: "; meanwhile job 'B' (...) holds the
  // store: ..." when the store's current job is another job that still runs (a second job
  // given this job's store, whose rank 0 then took it); empty otherwise, or where the store
  // cannot say (a message only: nothing waits here).
  std::string held_by_another() {
    auto set = store_.check({kCurrent});
    if (!set.ok() || !*set) return {};
    auto owner = owner_of_pointer(kCurrent);
    if (!owner.ok() || owner->id == options_.identity.id || owner->ended()) return {};
    return "; meanwhile " + owner->describe() +
           ", which still runs, holds the store: is another job using this job's store?";
  }

  StatusOr<Owner> owner_of_pointer(const std::string& pointer) {
    HPS_ASSIGN_OR_RETURN(std::string text, store_.get(pointer, timeout_));
    HPS_ASSIGN_OR_RETURN(int64_t ticket, parse_ticket(pointer, text));
    return owner_of(ticket);
  }

  // Ticket t's rank 0 has decided, or has provably ended without deciding.
  Status wait_decided(int64_t t) {
    HPS_ASSIGN_OR_RETURN(bool done, poll_until(deadline_, [&]() -> StatusOr<bool> {
                           HPS_ASSIGN_OR_RETURN(bool decided, store_.check({decision_key(t)}));
                           if (decided) return true;
                           HPS_ASSIGN_OR_RETURN(bool recorded, store_.check({owner_key(t)}));
                           if (!recorded) return false;
                           HPS_ASSIGN_OR_RETURN(Owner o, owner_of(t));
                           return o.ended();
                         }));
    if (!done) {
      return timeout_error("store " + options_.where + ": rank 0 waited " +
                           std::to_string(timeout_.count()) +
                           " ms for the rank 0 that opened the store just before it (ticket " +
                           std::to_string(t) + ") to finish");
    }
    return Status::Ok();
  }

  Store& store_;
  int32_t rank_;
  const JobOptions& options_;
  Milliseconds timeout_;
  Clock::time_point deadline_;
};

}  // namespace

bool job_store_open_here(const std::string& store, int32_t rank) {
  return OpenHere::with([&](auto& counts) { return counts.count({store, rank}) > 0; });
}

StatusOr<JobIdentity> job_identity_from_env() {
  HPS_ASSIGN_OR_RETURN(JobIdentity identity, identity_from("", {"HPS_JOB_ID"}));
  if (!identity.id.empty()) return identity;
  HPS_ASSIGN_OR_RETURN(
      identity,
      identity_from("torchrun:", {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"}, "none"));
  if (!identity.id.empty()) return identity;
  HPS_ASSIGN_OR_RETURN(identity, identity_from("openmpi:", {"PMIX_NAMESPACE"}));
  if (!identity.id.empty()) return identity;
  HPS_ASSIGN_OR_RETURN(identity, identity_from("openmpi:", {"OMPI_MCA_ess_base_jobid"}));
  if (!identity.id.empty()) return identity;
  return identity_from("slurm:", {"SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"});
}

StatusOr<std::shared_ptr<Store>> join_job(std::shared_ptr<Store> store, int32_t rank,
                                          const JobOptions& options, Milliseconds timeout) {
  if (!store) return invalid_argument("join_job: the store is null");
  if (rank < 0) return invalid_argument("join_job: rank " + std::to_string(rank) + " < 0");
  if (!options.identity.id.empty()) {
    HPS_RETURN_IF_ERROR(
        check_job_id(options.identity.id, options.identity.source.empty()
                                              ? std::string("the job id")
                                              : "the job id from " + options.identity.source));
  }
  JobOptions effective = options;
  const std::string& key = options.store.empty() ? options.where : options.store;
  if (effective.identity.id.empty()) {
    effective.identity.id = MadeUpIds::with([&](auto& ids) {
      auto it = ids.find(key);
      return it == ids.end() ? std::string() : it->second;
    });
    if (!effective.identity.id.empty()) {
      effective.identity.source = "made up by its rank 0 when this process first opened the store";
    }
  }
  Joiner joiner(*store, rank, effective, timeout);
  HPS_ASSIGN_OR_RETURN(Owner job, rank == 0 ? joiner.take_over() : joiner.join());
  if (options.identity.id.empty()) MadeUpIds::with([&](auto& ids) { ids[key] = job.id; });
  return std::shared_ptr<Store>(std::make_shared<JobStore>(std::move(store), job, rank, key));
}

}  // namespace hps
