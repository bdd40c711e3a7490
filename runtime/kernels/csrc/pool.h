// The kernels' parallel regions: chunks any thread takes from one atomic counter, and a guard that
// stops using the workers while they do not pay (a core taken by another process).
//
// Why not at::parallel_for: OpenMP splits a region statically, one share per thread, and waits for
// every share; a decode step is hundreds of regions, so when another process holds one core every
// region waits for the thread queued behind it (gemma3-270m: 3 tok/s at two threads, 45 at one).
// Here a worker that is not running claims nothing and delays nothing; one that is descheduled
// mid-chunk delays only that chunk's region. The pool has its own thread count (set_threads): torch's
// ops between the kernels run on one thread (runtime.api.set_threads), since torch's OpenMP workers
// spin after each op on the core this pool's worker needs.
//
// Invariants (kernels rely on the first, the pool on the rest):
// - A region runs body(c) exactly once for every c in [0, chunks). Which thread runs a chunk, and in
//   what order chunks run, must not change any result: a chunk writes only its own outputs, each
//   summed in an order the kernel fixes (tests/test_threads.py runs every kernel at 1 and 2 threads).
// - ticket_ packs (region epoch << 32 | next chunk). A chunk is claimed by one CAS on the whole word,
//   so a worker descheduled across a region's end can never claim a chunk of a later region.
// - While the caller writes a region's fields, ticket_'s chunk half is kBusy (no claim can pass); a
//   worker that read fields of a later region fails its CAS (a seqlock: the two fences pair).
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
  static constexpr uint64_t kBusy = 0xffffffffu;  // ticket_'s chunk half while a region's fields change
  static constexpr auto kIdleSpin = std::chrono::milliseconds(2);     // a worker spins this long, then sleeps
  static constexpr auto kWaitSpin = std::chrono::microseconds(20);    // the caller spins, then yields, for stragglers

  Pool() : threads_(usable_cores()) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // body(c) for every c in [0, chunks), on up to threads() threads (this one included).
  template <class F>
  void run(int64_t chunks, F&& body) {
    if (chunks <= 1 || in_region()) return alone(chunks, body);  // in_region first: run_mutex_ may be ours
    const int64_t threads = threads_.load(std::memory_order_relaxed);
    std::unique_lock<std::mutex> caller(run_mutex_, std::try_to_lock);
    if (threads <= 1 || !caller.owns_lock()) return alone(chunks, body);
    if (!fallback_.parallel(Clock::now(), [&] { return workers_waited(); })) {
      ++regions_alone_;
      return alone(chunks, body);
    }
    ++regions_parallel_;
    ensure_workers(threads - 1);
    publish(chunks, &call<std::remove_reference_t<F>>, &body);
    in_region() = true;
    take_chunks(epoch_of(ticket_.load(std::memory_order_relaxed)));
    await_finished(chunks);
    in_region() = false;
    rethrow();
  }

  // The threads a region may use (this one included), and whether the fallback may stand the workers
  // down. Keeps what the fallback measured when the setting does not change (a bench sets it before
  // every run).
  void set_threads(int64_t threads, bool adaptive) {
    std::lock_guard<std::mutex> caller(run_mutex_);
    threads_.store(std::max<int64_t>(1, threads), std::memory_order_relaxed);
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

  template <class F>
  static void call(void* body, int64_t chunk) { (*static_cast<F*>(body))(chunk); }

  static uint32_t epoch_of(uint64_t ticket) { return static_cast<uint32_t>(ticket >> 32); }
  static uint64_t next_of(uint64_t ticket) { return ticket & 0xffffffffu; }

  // Whether this thread is inside a region (a worker always is; the caller while it runs chunks).
  static bool& in_region() {
    thread_local bool inside = false;
    return inside;
  }

  template <class F>
  static void alone(int64_t chunks, F& body) {
    for (int64_t c = 0; c < chunks; ++c) body(c);
  }

  // Writes the region's fields between two stores of the ticket (the seqlock's writer side).
  void publish(int64_t chunks, Call fn, void* body) {
    const uint64_t old = ticket_.load(std::memory_order_relaxed);
    ticket_.store(old | kBusy, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    call_.store(fn, std::memory_order_relaxed);
    body_.store(body, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    ticket_.store(static_cast<uint64_t>(epoch_of(old) + 1) << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(sleep_mutex_); }  // a worker between its check and its wait gets the notify
      wake_.notify_all();
    }
  }

  // Claims and runs chunks of region `epoch` until none is left.
  void take_chunks(uint32_t epoch) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if (epoch_of(t) != epoch) return;
      const Call fn = call_.load(std::memory_order_relaxed);
      void* body = body_.load(std::memory_order_relaxed);
      const int64_t chunks = chunks_.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);  // the seqlock's reader side: the CAS re-checks
      if (static_cast<int64_t>(next_of(t)) >= chunks) return;  // kBusy too
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_relaxed)) continue;
      try {
        fn(body, static_cast<int64_t>(next_of(t)));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      finished_.fetch_add(1, std::memory_order_release);
    }
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
    uint32_t seen = epoch_of(ticket_.load(std::memory_order_acquire));
    for (;;) {
      if (index >= helpers_.load(std::memory_order_relaxed)) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        resize_.wait(lock, [&] { return index < helpers_.load(std::memory_order_relaxed); });
      }
      seen = await_region(seen);
      take_chunks(seen);
    }
  }

  // The epoch of the next region after `seen`: spins kIdleSpin, then sleeps until publish() wakes it.
  uint32_t await_region(uint32_t seen) {
    const auto start = Clock::now();
    for (;;) {
      const uint64_t t = ticket_.load(std::memory_order_acquire);
      if (epoch_of(t) != seen) return epoch_of(t);
      if (Clock::now() - start < kIdleSpin) {
        cpu_relax();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return epoch_of(ticket_.load(std::memory_order_seq_cst)) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  alignas(64) std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<int64_t> finished_{0};
  alignas(64) std::atomic<Call> call_{nullptr};
  std::atomic<void*> body_{nullptr};
  std::atomic<int64_t> chunks_{0};
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
