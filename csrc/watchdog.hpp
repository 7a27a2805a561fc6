// A group's watchdog (NCCL's, in small): it watches the GPU works the group
// issued, and when one has not finished within the group's timeout (a peer
// died, or made another call, and a kernel waits for it), it calls the
// group's overrun handler once (which sets the abort word: the kernels' waits
// give up and later calls raise; it returns the whole error) and fails every
// watched work with that error, so that their wait() raises. abort() fails
// them the same way (failAll).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/intrusive_ptr.h>

namespace tdist {

class TDistWork;

class Watchdog {
 public:
  // Gets the op of the work that overran (its name) and its timeout; returns
  // the error to fail the works with.
  using OnOverrun =
      std::function<std::string(const char* op, std::chrono::milliseconds timeout)>;

  explicit Watchdog(OnOverrun onOverrun);
  ~Watchdog(); // stops the thread; nothing is aborted
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Watches `work` (issued on a GPU stream that is not capturing a graph)
  // until it finishes. `op`: a name that lives as long as the program.
  void watch(
      c10::intrusive_ptr<TDistWork> work,
      std::chrono::milliseconds timeout,
      const char* op);

  // Fails every watched work that has not finished with the error
  // `abortGroup()` returns; abortGroup aborts the group (which lets the device
  // finish them) and runs while their wait() holds. Once: it returns false,
  // doing nothing, when the works were failed already (an overrun, or an
  // earlier call). Works watched later (calls that passed the group's abort
  // check just before) fail with the same error.
  bool failAll(const std::function<std::string()>& abortGroup);

 private:
  struct Watched {
    c10::intrusive_ptr<TDistWork> work;
    std::chrono::steady_clock::time_point deadline;
    std::chrono::milliseconds timeout;
    const char* op;
  };

  void run();

  OnOverrun onOverrun_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::list<Watched> watched_;
  bool scanning_ = false; // run() holds the works, without the lock
  std::condition_variable scanned_;
  bool stop_ = false;
  bool failed_ = false; // failAll() ran
  std::string failure_; // the error failAll() failed the works with, once known
  std::vector<c10::intrusive_ptr<TDistWork>> late_; // watched while it worked it out
  std::thread thread_; // last: starts after the members above exist
};

} // namespace tdist
