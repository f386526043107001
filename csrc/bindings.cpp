// The only file that knows Python: exposes engines, the buffer pool and the
// DIO alignment query as offload._core. Errors become OSError(errno, ...).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "dio_alignment.h"
#include "engine.h"
#include "fork_guard.h"
#include "thread_engine.h"
#ifdef OFFLOAD_HAVE_URING
#include "uring_engine.h"
#endif

namespace py = pybind11;
using namespace offload;

namespace {

/// The one translator from -errno to Python: OSError picks the subclass
/// (FileNotFoundError, PermissionError, ...) from the errno.
[[noreturn]] void raise_os_error(int negative_errno, const std::string& what) {
  errno = -negative_errno;
  PyErr_SetFromErrnoWithFilename(PyExc_OSError, what.c_str());
  throw py::error_already_set();
}

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

/// Engines given up on: kept, never freed, for the life of the process.
std::vector<std::shared_ptr<Engine>>& abandoned() {
  static auto* engines = new std::vector<std::shared_ptr<Engine>>;
  return *engines;
}

/// A Python handle on an engine; close() drains it and frees it. Calls hold
/// their own reference while they run without the GIL, so close() from
/// another thread never frees an engine under a wait(). In a forked child the
/// engine is the parent's: every call raises, and nothing drains or frees it
/// (its threads do not exist there; it is leaked on purpose).
class PyEngine {
 public:
  explicit PyEngine(std::unique_ptr<Engine> engine)
      : engine_(std::move(engine)), generation_(fork_generation()) {
    name_ = engine_->name();
  }
  /// An engine collected unclosed drains as close() does, without the GIL
  /// (but not while the interpreter finalizes, when no other thread may run).
  ~PyEngine() {
    if (inherited()) {
      abandon();
    } else if (engine_ && !interpreter_finalizing()) {
      py::gil_scoped_release release;
      engine_.reset();
    }
  }
  PyEngine(PyEngine&&) = default;
  std::shared_ptr<Engine> get() const {
    if (inherited())
      throw std::runtime_error(
          "offload: this engine belongs to the process that created it; a forked child must "
          "create its own");
    if (!engine_) throw py::value_error("the engine is closed");
    return engine_;
  }
  /// Waits for the I/O in flight, then frees the engine. The wait ends early
  /// only when a signal handler raises (Ctrl-C, a test's timeout): the
  /// engine then asks the kernel to cancel what is in flight and waits up to
  /// a second more; if something is still in flight after that, the engine
  /// is abandoned (kept, with its ring, threads and staging blocks, for the
  /// life of the process, so nothing the kernel may still use is freed), and
  /// the exception propagates. Either way the engine is closed on return.
  void close() {
    if (inherited()) return abandon();
    std::shared_ptr<Engine> engine = std::move(engine_);
    if (!engine) return;
    for (;;) {
      bool drained;
      {
        py::gil_scoped_release release;
        drained = engine->drain_for(kCloseSliceMs);
      }
      if (drained) break;
      if (PyErr_CheckSignals() == 0) continue;
      {
        py::gil_scoped_release release;
        engine->cancel_in_flight(kCancelWaitMs);
        drained = engine->drain_for(kCancelWaitMs);
      }
      if (!drained) abandoned().push_back(std::move(engine));
      {
        py::gil_scoped_release release;
        engine.reset();
      }
      throw py::error_already_set();  // (it takes the error: the GIL held)
    }
    py::gil_scoped_release release;
    engine.reset();  // the last reference's destructor waits for in-flight I/O
  }
  bool is_open() const { return engine_ != nullptr && !inherited(); }
  const std::string& name() const { return name_; }

 private:
  static constexpr int kCloseSliceMs = 100;   // how often close() looks for a signal
  static constexpr int kCancelWaitMs = 1000;  // for what an interrupted close() cancels
  bool inherited() const { return generation_ != fork_generation(); }
  void abandon() {
    if (engine_) abandoned().push_back(std::move(engine_));
  }

  std::shared_ptr<Engine> engine_;
  uint64_t generation_;
  std::string name_;
};

void submit(PyEngine& self, const IoRequest* requests, size_t count) {
  std::shared_ptr<Engine> engine = self.get();
  int rc;
  {
    py::gil_scoped_release release;
    rc = engine->submit(requests, count);
  }
  if (rc < 0) raise_os_error(rc, "submit");
}

void* as_pointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

/// Engine::submit_now: the result if the transfer finished within the call
/// (then reap() never reports it), else None.
template <IoKind kKind>
py::object submit_now(PyEngine& self, uint64_t tag, int fd, uintptr_t addr, uint64_t length,
                      uint64_t offset) {
  std::shared_ptr<Engine> engine = self.get();
  IoRequest io{tag, kKind, fd, as_pointer(addr), length, offset};
  int64_t result = 0;
  int rc;
  {
    py::gil_scoped_release release;
    rc = engine->submit_now(io, &result);
  }
  if (rc < 0) raise_os_error(rc, "submit");
  return rc == 1 ? py::object(py::int_(result)) : py::object(py::none());
}

IoRequest read_request(uint64_t tag, int fd, uintptr_t addr, uint64_t length, uint64_t offset,
                       uintptr_t region, uint64_t region_length) {
  IoRequest io{tag, IoKind::kRead, fd, as_pointer(addr), length, offset};
  io.region = as_pointer(region);
  io.region_length = region_length;
  return io;
}

IoRequest write_request(uint64_t tag, int fd, uintptr_t addr, uint64_t length, uint64_t offset,
                        uintptr_t copy_from, uint64_t copy_length, uintptr_t region,
                        uint64_t region_length) {
  return IoRequest{tag,    IoKind::kWrite,        fd,          as_pointer(addr),   length,
                   offset, as_pointer(copy_from), copy_length, as_pointer(region), region_length};
}

/// The requests of one vector call, built field by field from Python (each
/// add is checked and converted once, where it is made) and handed to the
/// engine in one submit.
struct Requests {
  std::vector<IoRequest> items;
};

/// Memory from a BufferPool, exposed through the buffer protocol (writable
/// bytes) so torch.frombuffer can wrap it; returned to the pool when the last
/// Python reference goes.
struct PoolBuffer {
  std::shared_ptr<BufferPool> pool;
  void* data;
  size_t capacity;
  bool fresh;  ///< never used before: its pages fault in on first touch
  ~PoolBuffer() { pool->release(data, capacity); }
  PoolBuffer(const PoolBuffer&) = delete;
  PoolBuffer& operator=(const PoolBuffer&) = delete;
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "offload's torch-free I/O core: io_uring and thread-pool engines, aligned buffers.";
#ifdef OFFLOAD_HAVE_URING
  m.attr("HAVE_URING") = true;
#ifdef OFFLOAD_URING_LINK
  m.attr("URING_LINK") = OFFLOAD_URING_LINK;  // "static": liburing is inside this module
#else
  m.attr("URING_LINK") = "shared";
#endif
#else
  m.attr("HAVE_URING") = false;
  m.attr("URING_LINK") = "";
#endif
  m.attr("KIND_READ") = static_cast<int>(IoKind::kRead);
  m.attr("KIND_WRITE") = static_cast<int>(IoKind::kWrite);
  m.attr("KIND_FSYNC") = static_cast<int>(IoKind::kFsync);

  py::class_<Requests>(m, "Requests")
      .def(py::init<>())
      .def("read",
           [](Requests& b, uint64_t tag, int fd, uintptr_t addr, uint64_t length, uint64_t offset,
              uintptr_t region, uint64_t region_length) {
             b.items.push_back(read_request(tag, fd, addr, length, offset, region, region_length));
             return b.items.size();
           },
           py::arg("tag"), py::arg("fd"), py::arg("addr"), py::arg("length"), py::arg("offset"),
           py::arg("region") = 0, py::arg("region_length") = 0,
           "Adds a read, as Engine.submit_read; returns how many requests it holds.")
      .def("write",
           [](Requests& b, uint64_t tag, int fd, uintptr_t addr, uint64_t length, uint64_t offset,
              uintptr_t copy_from, uint64_t copy_length, uintptr_t region, uint64_t region_length) {
             b.items.push_back(write_request(tag, fd, addr, length, offset, copy_from, copy_length,
                                             region, region_length));
             return b.items.size();
           },
           py::arg("tag"), py::arg("fd"), py::arg("addr"), py::arg("length"), py::arg("offset"),
           py::arg("copy_from") = 0, py::arg("copy_length") = 0, py::arg("region") = 0,
           py::arg("region_length") = 0,
           "Adds a write, as Engine.submit_write; returns how many requests it holds.")
      .def("__len__", [](const Requests& b) { return b.items.size(); })
      .def("tags",
           [](const Requests& b) {
             std::vector<uint64_t> tags;
             tags.reserve(b.items.size());
             for (const IoRequest& io : b.items) tags.push_back(io.tag);
             return tags;
           },
           "The tags of the requests, in order.");

  py::class_<PyEngine>(m, "Engine")
      .def_property_readonly("name", &PyEngine::name)
      .def_property_readonly("event_fd", [](PyEngine& e) { return e.get()->event_fd(); })
      .def_property_readonly("pending", [](PyEngine& e) { return e.get()->pending(); })
      .def("submit_read",
           [](PyEngine& e, uint64_t tag, int fd, uintptr_t addr, uint64_t length, uint64_t offset,
              uintptr_t region, uint64_t region_length) {
             IoRequest io = read_request(tag, fd, addr, length, offset, region, region_length);
             submit(e, &io, 1);
           },
           py::arg("tag"), py::arg("fd"), py::arg("addr"), py::arg("length"), py::arg("offset"),
           py::arg("region") = 0, py::arg("region_length") = 0,
           "Read [offset, offset+length) into addr. region/region_length: the pool block addr lies "
           "in, registered as an io_uring fixed buffer on first use.")
      .def("submit_write",
           [](PyEngine& e, uint64_t tag, int fd, uintptr_t addr, uint64_t length, uint64_t offset,
              uintptr_t copy_from, uint64_t copy_length, uintptr_t region, uint64_t region_length) {
             IoRequest io = write_request(tag, fd, addr, length, offset, copy_from, copy_length,
                                          region, region_length);
             submit(e, &io, 1);
           },
           py::arg("tag"), py::arg("fd"), py::arg("addr"), py::arg("length"), py::arg("offset"),
           py::arg("copy_from") = 0, py::arg("copy_length") = 0, py::arg("region") = 0,
           py::arg("region_length") = 0,
           "Write [addr, addr+length) at offset. With copy_from (and addr 0): write copy_length "
           "bytes from there, zero-padded to length, staged chunk by chunk through the staging "
           "pool; copy_from must stay valid until the completion is reaped.")
      .def("submit_read_now", &submit_now<IoKind::kRead>, py::arg("tag"), py::arg("fd"),
           py::arg("addr"), py::arg("length"), py::arg("offset"),
           "submit_read on a file opened without O_DIRECT, returning the result (bytes or -errno) "
           "when the read finished within the call (a small one from the page cache): reap() then "
           "never reports it. Else None.")
      .def("submit_write_now", &submit_now<IoKind::kWrite>, py::arg("tag"), py::arg("fd"),
           py::arg("addr"), py::arg("length"), py::arg("offset"),
           "The same for a write (into the page cache).")
      .def("submit_fsync",
           [](PyEngine& e, uint64_t tag, int fd) {
             IoRequest io{tag, IoKind::kFsync, fd};
             submit(e, &io, 1);
           })
      .def("submit",
           [](PyEngine& e, Requests& batch) {
             submit(e, batch.items.data(), batch.items.size());
             batch.items.clear();
           },
           py::arg("requests"),
           "Submit every request of ``requests`` at once, and empty it. On an error nothing was "
           "submitted and the requests stay in it.")
      .def("reap",
           [](PyEngine& e) {
             std::shared_ptr<Engine> engine = e.get();
             std::vector<IoCompletion> done;
             {
               py::gil_scoped_release release;
               engine->reap(&done);
             }
             // Flat ints, no tuples: reaping thousands of completions then makes
             // no objects for Python's cyclic GC to count and scan.
             py::list out(2 * done.size());
             for (size_t i = 0; i < done.size(); ++i) {
               out[2 * i] = py::int_(done[i].tag);
               out[2 * i + 1] = py::int_(done[i].result);
             }
             return out;
           },
           "Completions since the last call as a flat list [tag, result, tag, result, ...], "
           "result = length or -errno. Never blocks.")
      .def("wait",
           [](PyEngine& e, int timeout_ms) {
             if (!e.is_open()) return true;  // closed meanwhile: nothing left to wait for
             std::shared_ptr<Engine> engine = e.get();
             int rc;
             {
               py::gil_scoped_release release;
               rc = engine->wait(timeout_ms);
             }
             if (rc < 0) raise_os_error(rc, "wait");
             return rc > 0;
           },
           py::arg("timeout_ms"),
           "Block (without the GIL) until completions may be ready or the timeout passes; returns at "
           "once on a closed engine.")
      .def("wake",
           [](PyEngine& e) {
             if (e.is_open()) e.get()->wake();
           },
           "Make wait() return and event_fd readable (from any thread); a no-op once closed.")
      .def("add_stripes",
           [](PyEngine& e, const std::vector<int>& fds, uint64_t unit) {
             int rc = e.get()->add_stripes(fds, unit);
             if (rc == -EINVAL) raise_os_error(rc, "add_stripes");
             return rc;
           },
           py::arg("fds"), py::arg("unit"),
           "Makes the files one striped file (RAID-0, `unit` bytes per file in turn); returns the "
           "fd (negative) requests name it by. Chunks never cross a unit; fsync syncs every file.")
      .def("failed_fd", [](PyEngine& e, uint64_t tag) { return e.get()->failed_fd(tag); }, py::arg("tag"),
           "For a failed request on a striped file: the file it failed on (asked once); else -1.")
      .def("set_staging_pool",
           [](PyEngine& e, std::shared_ptr<BufferPool> pool, bool register_blocks) {
             e.get()->set_staging_pool(std::move(pool), register_blocks);
           },
           py::arg("pool"), py::arg("register_blocks") = true,
           "Writes submitted with copy_from and addr 0 stage each chunk through a block of this pool "
           "just before it starts; the source must then stay valid until the completion is reaped.")
      .def_property_readonly("backlog",
                             [](PyEngine& e) -> size_t {
                               if (!e.is_open()) return 0;
                               std::shared_ptr<Engine> engine = e.get();
                               py::gil_scoped_release release;
                               return engine->backlog();
                             },
                             "Chunks queued behind the in-flight limits: they start only as earlier "
                             "ones finish and someone reaps (0 once closed).")
      .def_property_readonly("staged_bytes", [](PyEngine& e) { return e.get()->staged_bytes(); },
                             "Bytes copied into staging blocks so far.")
      .def_property_readonly("merged_writes", [](PyEngine& e) { return e.get()->merged_writes(); },
                             "Write chunks that went to the device inside the staging block of the chunk "
                             "queued before them (side by side in the same file), so far.")
      .def_property_readonly("merged_vectored", [](PyEngine& e) { return e.get()->merged_vectored(); },
                             "Read or write chunks (not staged) that went to the device inside the "
                             "vectored I/O of the chunk queued before them, so far.")
      .def_property_readonly("chunk_bytes", [](PyEngine& e) { return e.get()->options().chunk_bytes; })
      .def_property_readonly("max_in_flight_bytes",
                             [](PyEngine& e) { return e.get()->options().max_in_flight_bytes; },
                             "Bytes of I/O handed to the backend at once.")
      .def_property_readonly("inline_bytes", [](PyEngine& e) { return e.get()->options().inline_bytes; },
                             "Largest transfer on a page-cache file that may run within the call.")
      .def("set_faults",
           [](PyEngine& e, double error_rate, std::vector<int> errnos, double short_rate,
              double delay_rate, int delay_ms, uint64_t seed) {
             e.get()->set_faults(
                 FaultPlan{error_rate, std::move(errnos), short_rate, delay_rate, delay_ms, seed});
           },
           py::arg("error_rate") = 0.0, py::arg("errnos") = std::vector<int>{},
           py::arg("short_rate") = 0.0, py::arg("delay_rate") = 0.0, py::arg("delay_ms") = 0,
           py::arg("seed") = 1,
           "Make finished chunk I/Os fail with one of errnos (rate error_rate), report a short "
           "transfer (rate short_rate) or complete delay_ms late (rate delay_rate). All rates 0 "
           "turns injection off.")
      .def_property_readonly("fixed_buffers",
           [](PyEngine& e) -> std::pair<size_t, int> {
#ifdef OFFLOAD_HAVE_URING
             if (auto* uring = dynamic_cast<UringEngine*>(e.get().get())) return uring->fixed_buffers();
#endif
             (void)e;
             return {0, 0};
           },
           "(regions registered as io_uring fixed buffers, -errno that stopped registration or 0).")
      .def_property_readonly("faults_injected", [](PyEngine& e) { return e.get()->faults_injected(); })
      .def("close", &PyEngine::close,
           "Wait for all in-flight I/O, then free the engine. A signal handler that raises "
           "(Ctrl-C) ends the wait: what is in flight is cancelled, and if anything still is a "
           "second later the engine is kept for good (nothing the kernel may use is freed); "
           "the exception propagates, the engine closed either way. Whoever submitted must "
           "then keep the memory of its requests.");

  m.def("make_uring_engine",
        [](unsigned entries, uint64_t chunk_bytes, unsigned max_in_flight, uint64_t max_in_flight_bytes,
           uint64_t inline_bytes) {
#ifdef OFFLOAD_HAVE_URING
          std::unique_ptr<UringEngine> engine;
          int rc = UringEngine::create(
              entries, EngineOptions{chunk_bytes, max_in_flight, max_in_flight_bytes, inline_bytes}, &engine);
          if (rc < 0) raise_os_error(rc, "io_uring_queue_init");
          return PyEngine(std::move(engine));
#else
          (void)entries, (void)chunk_bytes, (void)max_in_flight, (void)max_in_flight_bytes, (void)inline_bytes;
          raise_os_error(-ENOSYS, "offload was built without liburing");
#endif
        },
        py::arg("entries"), py::arg("chunk_bytes"), py::arg("max_in_flight"),
        py::arg("max_in_flight_bytes") = uint64_t{128} << 20, py::arg("inline_bytes") = uint64_t{64} << 10,
        "An io_uring engine. Transfers of at most inline_bytes on files opened without O_DIRECT "
        "run in the submitting thread (reads only from the page cache); 0: never.");
  m.def("make_thread_engine",
        [](unsigned threads, uint64_t chunk_bytes, unsigned max_in_flight, uint64_t max_in_flight_bytes,
           uint64_t inline_bytes) {
          std::unique_ptr<ThreadEngine> engine;
          int rc = ThreadEngine::create(
              threads, EngineOptions{chunk_bytes, max_in_flight, max_in_flight_bytes, inline_bytes}, &engine);
          if (rc < 0) raise_os_error(rc, "thread engine");
          return PyEngine(std::move(engine));
        },
        py::arg("threads"), py::arg("chunk_bytes"), py::arg("max_in_flight"),
        py::arg("max_in_flight_bytes") = uint64_t{128} << 20, py::arg("inline_bytes") = uint64_t{64} << 10,
        "A thread-pool engine; inline_bytes as for make_uring_engine.");

  py::class_<BufferPool, std::shared_ptr<BufferPool>>(m, "BufferPool")
      .def(py::init<size_t, size_t>(), py::arg("idle_limit"), py::arg("lazy_limit") = 0)
      .def_static("capacity_for", &BufferPool::capacity_for)
      .def("acquire",
           [](std::shared_ptr<BufferPool> pool, size_t size) {
             bool fresh = false;
             void* data = pool->acquire(size, &fresh);
             if (data == nullptr) raise_os_error(-ENOMEM, "offload buffer pool");
             return std::unique_ptr<PoolBuffer>(new PoolBuffer{pool, data, BufferPool::capacity_for(size), fresh});
           },
           "A page-aligned Buffer of capacity_for(size) bytes, recycled when possible.")
      .def("live_capacity",
           [](BufferPool& pool, uintptr_t address) { return pool.live_capacity(as_pointer(address)); },
           "Capacity of the live block starting at address (0: not a block of this pool).")
      .def("trim", &BufferPool::trim)
      .def("_hold_lock", &BufferPool::hold_lock, py::arg("milliseconds"), py::call_guard<py::gil_scoped_release>(),
           "For tests: holds the pool's lock that long (without the GIL), as a thread inside a call does.")
      .def("set_idle_limit", &BufferPool::set_idle_limit, py::call_guard<py::gil_scoped_release>())
      .def("set_lazy_limit", &BufferPool::set_lazy_limit, py::call_guard<py::gil_scoped_release>())
      .def("set_huge_page_limit", &BufferPool::set_huge_page_limit, py::arg("nbytes"),
           "New blocks come from the system's reserved huge pages (MAP_HUGETLB) while fewer than "
           "nbytes of them are mapped; 0 (the default) never.")
      .def("warm",
           [](BufferPool& pool, const std::vector<size_t>& sizes) {
             int64_t rc;
             {
               py::gil_scoped_release release;
               rc = pool.warm(sizes);
             }
             if (rc < 0) raise_os_error(static_cast<int>(rc), "offload buffer pool");
             return rc;
           },
           py::arg("sizes"),
           "One block of each size made ready: new ones faulted in now (without the GIL), then all "
           "cached as if released. Returns the bytes faulted in.")
      .def("expect", &BufferPool::expect, py::arg("size"), py::arg("count") = 1,
           "count reads of size bytes are expected (written tensors'): provision() readies a block for each.")
      .def(
          "provision",
          [](BufferPool& pool) {
            int64_t rc;
            {
              py::gil_scoped_release release;
              rc = pool.provision();
            }
            if (rc < 0) raise_os_error(static_cast<int>(rc), "offload buffer pool");
            return rc;
          },
          "Faults in (without the GIL) and lazily frees new blocks for the expected reads the caches cannot "
          "serve, within the lazy and idle limits; nothing with a huge-page limit. Returns the bytes faulted in.")
      .def(
          "mark_small_pages", [](BufferPool& pool, uintptr_t address) { pool.mark_small_pages(as_pointer(address)); },
          py::arg("address"),
          "The live block at address (2 MiB or more) was faulted in on 4 KiB pages: once idle, "
          "collapse_one() may put it back on huge pages.")
      .def("collapse_one", &BufferPool::collapse_one, py::call_guard<py::gil_scoped_release>(),
           "Puts one idle marked block back on huge pages (MADV_COLLAPSE, without the GIL). Returns its "
          "bytes, 0 when none is waiting, or -errno (the block stays as it was).")
      .def_property_readonly("small_page_bytes", &BufferPool::small_page_bytes,
                             "Bytes of blocks marked as faulted in on 4 KiB pages, live or idle.")
      .def_property_readonly("small_page_idle_bytes", &BufferPool::small_page_idle_bytes,
                             "Of those, the idle ones: what collapse_one() works on.")
      .def_property_readonly("collapsed_bytes", &BufferPool::collapsed_bytes,
                             "Bytes collapse_one() put back on huge pages.")
      .def_property_readonly("activity", &BufferPool::activity, "Calls of acquire and release so far.")
      .def_property_readonly("provisioned_bytes", &BufferPool::provisioned_bytes,
                             "Bytes faulted in by provision().")
      .def_property_readonly("idle_bytes", &BufferPool::idle_bytes)
      .def_property_readonly("lazy_bytes", &BufferPool::lazy_bytes, "Lazily freed (MADV_FREE) blocks kept.")
      .def_property_readonly("live_bytes", &BufferPool::live_bytes)
      .def_property_readonly("hits", &BufferPool::hits, "Acquires served from the idle cache.")
      .def_property_readonly("lazy_hits", &BufferPool::lazy_hits, "Acquires served from lazily freed blocks.")
      .def_property_readonly("fresh_bytes", &BufferPool::fresh_bytes,
                             "Bytes handed out in blocks never used before (their pages fault in on first touch).")
      .def_property_readonly("huge_page_bytes", &BufferPool::huge_page_bytes,
                             "Bytes of reserved huge pages mapped now, in live or cached blocks.");

  py::class_<PoolBuffer>(m, "Buffer", py::buffer_protocol())
      .def_buffer([](PoolBuffer& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.capacity)}, {1}, /*readonly=*/false);
      })
      .def_property_readonly("address", [](PoolBuffer& b) { return reinterpret_cast<uintptr_t>(b.data); })
      .def_property_readonly("capacity", [](PoolBuffer& b) { return b.capacity; })
      .def_property_readonly("fresh", [](PoolBuffer& b) { return b.fresh; },
                             "Never used before: its pages fault in on first touch.");

  m.def("prefault",
        [](uintptr_t address, uint64_t length, bool small_pages) {
          int rc;
          {
            py::gil_scoped_release release;
            rc = prefault(as_pointer(address), length, small_pages);
          }
          if (rc < 0) raise_os_error(rc, "madvise");
        },
        py::arg("address"), py::arg("length"), py::arg("small_pages"),
        "Fault in a page-aligned range now (small_pages: MADV_NOHUGEPAGE first), without the GIL.");
  m.def("discard_pages",
        [](uintptr_t address, uint64_t length) {
          int64_t rc;
          {
            py::gil_scoped_release release;
            rc = discard_pages(as_pointer(address), length);
          }
          if (rc < 0) raise_os_error(static_cast<int>(rc), "madvise(MADV_DONTNEED)");
          return rc;
        },
        py::arg("address"), py::arg("length"),
        "Gives back the pages wholly inside the range (MADV_DONTNEED), without the GIL: they read "
        "as zeros after. Returns the bytes given back. Only for memory whose owner frees it next.");
  m.def("copy_memory",
        [](uintptr_t destination, uintptr_t source, uint64_t length) {
          py::gil_scoped_release release;
          std::memcpy(as_pointer(destination), as_pointer(source), length);
        },
        py::arg("destination"), py::arg("source"), py::arg("length"),
        "memcpy on the calling thread alone, without the GIL. The caller keeps both ranges alive "
        "and apart. (torch's copy_ spreads a large copy over every core, taking the one the I/O "
        "path needs on a small machine.)");
  m.def("abandoned_engines", [] { return abandoned().size(); },
        "Engines an interrupted close() gave up on (kept for good), and those forked children inherited.");

  m.def("dio_alignment", [](int fd) {
    DioAlignment a;
    int rc = dio_alignment(fd, &a);
    if (rc < 0) raise_os_error(rc, "statx");
    return py::make_tuple(a.memory, a.offset);
  }, "(memory, offset) O_DIRECT alignment of an open file from statx; (0, 0) if unknown.");
}
