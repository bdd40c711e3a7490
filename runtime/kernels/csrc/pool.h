// The kernels' parallel regions: each thread streams its own contiguous run of chunks and then takes
// what is left of the others' from their ends, and a guard that stops using the workers while they do
// not pay (a core taken by another process).
//
// Why not at::parallel_for: OpenMP splits a region statically, one share per thread, and waits for
// every share; a decode step is hundreds of regions, so when another process holds one core every
// region waits for the thread queued behind it (gemma3-270m: 3 tok/s at two threads, 45 at one).
// Here a worker that is not running claims nothing and delays nothing (the others take its run from
// its end); one that is descheduled mid-chunk delays only that chunk's region. Runs, not one shared
// counter: chunks handed out in turn from one counter interleave the threads through a matrix, so
// neither streams it, and each prefetches rows the other reads (on the Intel Xeon with AMX, a 29 MB
// fp32 matrix read at 1.03x its one-thread speed on two threads, 1.97x in two runs). The pool has its own thread count (set_threads): torch's
// ops between the kernels run on one thread (runtime.api.set_threads), since torch's OpenMP workers
// spin after each op on the core this pool's worker needs.
//
// Invariants (kernels rely on the first, the pool on the rest):
// - A region runs body(c) exactly once for every c in [0, chunks). Which thread runs a chunk, and in
//   what order chunks run, must not change any result: a chunk writes only its own outputs, each
//   summed in an order the kernel fixes (tests/test_threads.py runs every kernel at 1 and 2 threads).
// - Thread k's run is a word packing (region epoch << 32 | next << 16 | end): its unclaimed chunks are
//   next .. end - 1. The owner claims `next`, any other thread `end - 1`, each by one CAS on the whole
//   word, so a chunk is claimed once, and a worker descheduled across a region's end can never claim
//   a chunk of a later region (the epoch differs).
// - A claim succeeds only while its region is open (its chunk is unclaimed, so the region cannot have
//   finished, so the next region's fields are not yet written): the fields a worker read before a
//   successful claim are that region's.
// - run() returns only after every claimed chunk finished: no worker touches the body or the
//   caller's tensors afterwards. Completion never waits for a worker that claimed nothing.
// - One region at a time per pool: a nested run() (from inside a chunk) or one from a second thread
//   while a region is open runs its chunks itself, in order.
#pragma once

#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// Named, not anonymous: the .cpp files of one module share one pool (inline functions, one definition).
namespace sv_pool {

using Clock = std::chrono::steady_clock;

inline double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Decides whether the workers pay, from the time they spend runnable but not running: the run-queue
// wait the kernel keeps per thread (/proc/self/task/TID/schedstat). On a quiet machine a worker that
// is awake gets its core at once; when another process holds a core, the caller, the worker and that
// process share two cores and the worker waits about a third of its time, stalling every region whose
// chunk it holds; a quiet machine's own chatter (kernel threads, a shell) costs a few percent, well
// under kTaken (docs/contention.md has the figures). Over each window of kWindow seconds with the
// workers in use: when they waited more than kTaken of it, regions run on the caller alone for a
// backoff, then a probe window tries the workers again; the backoff doubles after each failed probe
// (a busy machine pays a probe rarely) and resets after a good one (a machine that turns quiet gets
// its second core back within kMaxBackoff).
// A cause, not an effect: comparing a region's time with the caller's alone estimate also condemned
// regions bound by memory bandwidth, and a window of them stood the workers down for every kernel.
class Fallback {
 public:
  static constexpr double kWindow = 0.02;       // seconds of decoding per decision
  static constexpr double kTaken = 0.15;        // the workers' run-queue wait, as a share of the window, that stands them down
  static constexpr double kMinBackoff = 0.05;   // seconds alone after a failed window
  static constexpr double kMaxBackoff = 1.0;

  bool enabled = true;  // false: an explicit thread count, always parallel

  // Whether the region starting `now` should use the workers; `waited()` reads their run-queue wait (seconds).
  template <class Waited>
  bool parallel(Clock::time_point now, Waited&& waited) {
    if (!enabled) return true;
    if (alone_) {
      if (now < alone_until_) return false;
      alone_ = false;  // a probe window
      ++probes_;
      window_open_ = false;
    }
    if (!window_open_) {
      window_open_ = true;
      window_start_ = now;
      waited_at_start_ = waited();
      return true;
    }
    const double span = seconds(now - window_start_);
    if (span < kWindow) return true;
    const double share = (waited() - waited_at_start_) / span;
    window_open_ = false;
    if (share <= kTaken) {
      backoff_ = kMinBackoff;
      return true;
    }
    alone_ = true;
    ++fallbacks_;
    alone_until_ = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(backoff_));
    backoff_ = std::min(kMaxBackoff, 2 * backoff_);
    return false;
  }

  bool alone() const { return enabled && alone_; }
  int64_t fallbacks() const { return fallbacks_; }
  int64_t probes() const { return probes_; }

 private:
  bool alone_ = false, window_open_ = false;
  Clock::time_point alone_until_{}, window_start_{};
  double waited_at_start_ = 0.0, backoff_ = kMinBackoff;
  int64_t fallbacks_ = 0, probes_ = 0;
};

// Seconds thread `tid` of this process has waited on a run queue (0 where the kernel does not say).
inline double run_queue_wait(pid_t tid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/task/%d/schedstat", static_cast<int>(tid));
  std::FILE* f = std::fopen(path, "r");
  if (!f) return 0.0;
  unsigned long long ran = 0, waited = 0;
  const int got = std::fscanf(f, "%llu %llu", &ran, &waited);
  std::fclose(f);
  return got == 2 ? waited * 1e-9 : 0.0;
}

// The cores this process may run on (its affinity mask): the default thread count.
inline int64_t usable_cores() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

class Pool {
 public:
  static constexpr int64_t kMaxChunks = 0xffff;  // chunks of one region (a run word's 16-bit halves); more are grouped
  static constexpr int64_t kMaxThreads = 256;     // threads of one region (its runs' slots); more are not asked for
  static constexpr auto kIdleSpin = std::chrono::milliseconds(2);     // a worker spins this long, then sleeps
  static constexpr auto kWaitSpin = std::chrono::microseconds(20);    // the caller spins, then yields, for stragglers

  Pool() : slots_(new Slot[kMaxThreads]), threads_(std::min(kMaxThreads, usable_cores())) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // body(c) for every c in [0, chunks), on up to threads() threads (this one included).
  template <class F>
  void run(int64_t chunks, F&& body) {
    if (chunks <= 1 || in_region()) return alone(chunks, body);  // in_region first: run_mutex_ may be ours
    if (chunks <= kMaxChunks) return region(chunks, body);
    const int64_t per = (chunks + kMaxChunks - 1) / kMaxChunks;
    region((chunks + per - 1) / per, [&](int64_t group) {
      for (int64_t c = group * per; c < std::min(chunks, (group + 1) * per); ++c) body(c);
    });
  }

  // The threads a region may use (this one included), and whether the fallback may stand the workers
  // down. Keeps what the fallback measured when the setting does not change (a bench sets it before
  // every run).
  void set_threads(int64_t threads, bool adaptive) {
    std::lock_guard<std::mutex> caller(run_mutex_);
    threads_.store(std::clamp<int64_t>(threads, 1, kMaxThreads), std::memory_order_relaxed);
    fallback_.enabled = adaptive;
  }

  int64_t threads() const { return threads_.load(std::memory_order_relaxed); }

  // Counters for the bench's record and the tests.
  std::map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> caller(run_mutex_);
    return {{"threads", threads_.load(std::memory_order_relaxed)}, {"workers", workers_},
            {"regions_parallel", regions_parallel_},
            {"regions_alone", regions_alone_}, {"fallbacks", fallback_.fallbacks()}, {"probes", fallback_.probes()},
            {"adaptive", fallback_.enabled}, {"alone_now", fallback_.alone()}};
  }

 private:
  using Call = void (*)(void*, int64_t);

  // run() of 2 .. kMaxChunks chunks from outside any region.
  template <class F>
  void region(int64_t chunks, F&& body) {
    const int64_t threads = threads_.load(std::memory_order_relaxed);
    std::unique_lock<std::mutex> caller(run_mutex_, std::try_to_lock);
    if (threads <= 1 || !caller.owns_lock()) return alone(chunks, body);
    if (!fallback_.parallel(Clock::now(), [&] { return workers_waited(); })) {
      ++regions_alone_;
      return alone(chunks, body);
    }
    ++regions_parallel_;
    ensure_workers(threads - 1);
    const uint32_t epoch = publish(chunks, threads, &call<std::remove_reference_t<F>>, &body);
    in_region() = true;
    take_chunks(epoch, 0);
    await_finished(chunks);
    in_region() = false;
    rethrow();
  }

  template <class F>
  static void call(void* body, int64_t chunk) { (*static_cast<F*>(body))(chunk); }

  // One thread's run of a region's chunks, on its own cache line (its owner's claims touch no other).
  struct alignas(64) Slot {
    std::atomic<uint64_t> word{0};
  };

  static uint64_t run_word(uint32_t epoch, int64_t next, int64_t end) {
    return static_cast<uint64_t>(epoch) << 32 | static_cast<uint64_t>(next) << 16 | static_cast<uint64_t>(end);
  }
  static uint32_t epoch_of(uint64_t word) { return static_cast<uint32_t>(word >> 32); }

  // Whether this thread is inside a region (a worker always is; the caller while it runs chunks).
  static bool& in_region() {
    thread_local bool inside = false;
    return inside;
  }

  template <class F>
  static void alone(int64_t chunks, F& body) {
    for (int64_t c = 0; c < chunks; ++c) body(c);
  }

  // Writes a region's fields and its runs (thread k: chunks [k chunks / threads, (k + 1) chunks /
  // threads)), then announces its epoch (returned) to the workers. Slots from `threads` on keep an
  // older epoch: no claim there can succeed.
  uint32_t publish(int64_t chunks, int64_t threads, Call fn, void* body) {
    const uint32_t epoch = epoch_.load(std::memory_order_relaxed) + 1;
    call_.store(fn, std::memory_order_relaxed);
    body_.store(body, std::memory_order_relaxed);
    used_.store(threads, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    for (int64_t k = 0; k < threads; ++k)
      slots_[k].word.store(run_word(epoch, k * chunks / threads, (k + 1) * chunks / threads), std::memory_order_release);
    epoch_.store(epoch, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(sleep_mutex_); }  // a worker between its check and its wait gets the notify
      wake_.notify_all();
    }
    return epoch;
  }

  // A chunk of region `epoch` from the run in `slot`: its owner's next (front), anyone else's last
  // (back); -1 when the run is empty or the region is not `epoch`.
  static int64_t claim(Slot& slot, uint32_t epoch, bool front) {
    uint64_t w = slot.word.load(std::memory_order_acquire);
    for (;;) {
      const int64_t next = static_cast<int64_t>(w >> 16 & 0xffff), end = static_cast<int64_t>(w & 0xffff);
      if (epoch_of(w) != epoch || next >= end) return -1;
      if (slot.word.compare_exchange_weak(w, front ? w + (1u << 16) : w - 1, std::memory_order_acq_rel, std::memory_order_acquire))
        return front ? next : end - 1;
    }
  }

  // Runs chunks of region `epoch` until none is left: the run of thread `own` front to back, then the
  // others' from their ends (a descheduled owner's, a slower one's).
  void take_chunks(uint32_t epoch, int64_t own) {
    const Call fn = call_.load(std::memory_order_relaxed);
    void* body = body_.load(std::memory_order_relaxed);
    const int64_t used = std::clamp<int64_t>(used_.load(std::memory_order_relaxed), 1, kMaxThreads);
    int64_t done = 0;
    for (int64_t j = 0; j < used; ++j) {
      const int64_t k = (own + j) % used;
      for (int64_t chunk; (chunk = claim(slots_[k], epoch, k == own)) >= 0; ++done) {
        try {
          fn(body, chunk);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex_);
          if (!error_) error_ = std::current_exception();
        }
      }
    }
    if (done > 0) finished_.fetch_add(done, std::memory_order_release);
  }

  // Waits for the chunks other threads still run: spins, then yields (a straggler may share this core).
  void await_finished(int64_t chunks) {
    const auto start = Clock::now();
    while (finished_.load(std::memory_order_acquire) < chunks) {
      if (Clock::now() - start < kWaitSpin) cpu_relax();
      else sched_yield();
    }
  }

  void rethrow() {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(error_mutex_);
      std::swap(error, error_);
    }
    if (error) std::rethrow_exception(error);
  }

  // Workers 0 .. helpers - 1 take chunks (started here on first need); the others sleep.
  void ensure_workers(int64_t helpers) {
    if (helpers == helpers_.load(std::memory_order_relaxed)) return;
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      helpers_.store(helpers, std::memory_order_relaxed);
    }
    resize_.notify_all();
    for (; workers_ < helpers; ++workers_) {
      const int64_t index = workers_;
      std::thread([this, index] { work(index); }).detach();  // the pool is never destroyed (see instance())
    }
  }

  // Seconds the workers have waited on a run queue (the fallback's measure).
  double workers_waited() {
    std::lock_guard<std::mutex> lock(tids_mutex_);
    double total = 0.0;
    for (const pid_t tid : tids_) total += run_queue_wait(tid);
    return total;
  }

  // A worker: takes chunks of each new region while it is one of the helpers; sleeps while it is not.
  void work(int64_t index) {
    {
      std::lock_guard<std::mutex> lock(tids_mutex_);
      tids_.push_back(static_cast<pid_t>(syscall(SYS_gettid)));
    }
    in_region() = true;
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      if (index >= helpers_.load(std::memory_order_relaxed)) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        resize_.wait(lock, [&] { return index < helpers_.load(std::memory_order_relaxed); });
      }
      seen = await_region(seen);
      take_chunks(seen, index + 1);
    }
  }

  // The epoch of the next region after `seen`: spins kIdleSpin, then sleeps until publish() wakes it.
  uint32_t await_region(uint32_t seen) {
    const auto start = Clock::now();
    for (;;) {
      const uint32_t epoch = epoch_.load(std::memory_order_acquire);
      if (epoch != seen) return epoch;
      if (Clock::now() - start < kIdleSpin) {
        cpu_relax();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return epoch_.load(std::memory_order_seq_cst) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  std::unique_ptr<Slot[]> slots_;          // [kMaxThreads]: thread k's run of the open region
  alignas(64) std::atomic<uint32_t> epoch_{0};  // the last region published
  alignas(64) std::atomic<int64_t> finished_{0};
  alignas(64) std::atomic<Call> call_{nullptr};
  std::atomic<void*> body_{nullptr};
  std::atomic<int64_t> used_{1};           // the threads whose runs the open region split its chunks into
  std::atomic<int64_t> helpers_{0};
  std::atomic<int64_t> threads_;
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_, run_mutex_, error_mutex_, tids_mutex_;
  std::vector<pid_t> tids_;  // the workers' thread ids
  std::condition_variable wake_, resize_;
  std::exception_ptr error_;
  Fallback fallback_;  // this and the fields below: only the caller holding run_mutex_
  int64_t workers_ = 0, regions_parallel_ = 0, regions_alone_ = 0;
};

// The module's pool. Never destroyed (its detached workers may be asleep in it at exit); a forked
// child, which has none of the parent's workers, starts a fresh one.
inline Pool*& instance() {
  static Pool* pool = [] {
    pthread_atfork(nullptr, nullptr, [] { instance() = new Pool(); });
    return new Pool();
  }();
  return pool;
}

// fn(begin, end) over [0, n) in chunks of `grain` (the last may be shorter), on the pool.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  instance()->run((n + grain - 1) / grain, [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

}  // namespace sv_pool
