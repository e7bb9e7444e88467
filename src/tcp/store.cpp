#include "src/tcp/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "src/logging.h"
#include "src/tcp/auth.h"
#include "src/tcp/socket.h"

namespace flatshard::tcp {
namespace {

using Bytes = std::vector<std::uint8_t>;

constexpr std::uint32_t kStoreMagic = 0x46535354;  // "FSST"
constexpr std::uint32_t kMaxPart = 1u << 30;       // a key or value: at most 1 GiB
constexpr std::uint32_t kMaxParts = 1u << 16;
constexpr auto kHandshake = std::chrono::seconds(10);
// Connections still proving the secret at once: more are refused at the door, so that
// strangers cannot take every descriptor or thread of rank 0.
constexpr int kMaxUnproven = 64;

enum class Op : std::uint32_t { Set = 1, Get, Add, CompareSet, Delete, Check, NumKeys, Wait };
enum class Status : std::uint32_t { Ok = 0, Timeout = 1, Refused = 2 };

// A request or an answer: a head, then `count` parts, each a length and its bytes.
struct Head {
  std::uint32_t magic;
  std::uint32_t code;  // an Op, or a Status
  std::uint32_t count;
  std::uint32_t pad;
  std::int64_t arg;  // a timeout in ms, an add's amount, or an answer's number
};

struct Message {
  std::uint32_t code = 0;
  std::int64_t arg = 0;
  std::vector<Bytes> parts;
};

Clock::time_point far_future() { return Clock::now() + std::chrono::hours(24 * 365); }

void send_message(Socket& s, const Message& m, Clock::time_point deadline) {
  std::vector<std::uint8_t> out(sizeof(Head));
  const Head head{kStoreMagic, m.code, static_cast<std::uint32_t>(m.parts.size()), 0, m.arg};
  std::memcpy(out.data(), &head, sizeof(head));
  for (const auto& p : m.parts) {
    const auto length = static_cast<std::uint32_t>(p.size());
    const auto* l = reinterpret_cast<const std::uint8_t*>(&length);
    out.insert(out.end(), l, l + sizeof(length));
    out.insert(out.end(), p.begin(), p.end());
  }
  s.send_all(out.data(), out.size(), deadline);
}

// Throws IoError for a closed socket, a deadline or a malformed message.
Message recv_message(Socket& s, Clock::time_point deadline) {
  Head head{};
  s.recv_all(&head, sizeof(head), deadline);
  if (head.magic != kStoreMagic || head.count > kMaxParts) {
    throw IoError{IoError::Kind::Closed, s.peer(), "a malformed store message"};
  }
  Message m{head.code, head.arg, std::vector<Bytes>(head.count)};
  for (auto& p : m.parts) {
    std::uint32_t length = 0;
    s.recv_all(&length, sizeof(length), deadline);
    if (length > kMaxPart) throw IoError{IoError::Kind::Closed, s.peer(), "a store message part over 1 GiB"};
    p.resize(length);
    if (length > 0) s.recv_all(p.data(), length, deadline);
  }
  return m;
}

std::string text(const Bytes& b) { return {b.begin(), b.end()}; }
Bytes bytes(const std::string& s) { return {s.begin(), s.end()}; }

// Rank 0's half: the keys and a thread per proven connection (Note [The job's store]).
class Server {
 public:
  // Listens on `loopback` (a loopback address, IPv4 or IPv6), or on every interface of
  // both families when it is "" (Note [Either family]).
  Server(int port, const std::string& loopback, std::string secret) : secret_(std::move(secret)) {
    fd_ = listen_socket(port, loopback, 1024, nullptr);
    if (::pipe2(wake_, O_CLOEXEC) != 0) {
      ::close(fd_);
      throw IoError{IoError::Kind::Closed, -1, "pipe2() failed"};
    }
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~Server() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      for (auto& c : connections_) c.socket.shutdown();
    }
    changed_.notify_all();
    const char byte = 1;
    (void)!::write(wake_[1], &byte, 1);
    acceptor_.join();
    for (auto& c : connections_)
      if (c.thread.joinable()) c.thread.join();
    ::close(fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

 private:
  struct Connection {
    Socket socket;
    std::thread thread;
    std::atomic<bool> finished{false};  // its thread is done: join it and close the socket
  };

  // Joins and forgets the connections whose threads are done (their sockets close).
  void reap_locked() {
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (it->finished.load()) {
        if (it->thread.joinable()) it->thread.join();
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void accept_loop() {
    for (;;) {
      pollfd p[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      ::poll(p, 2, 1000);  // wakes at least once a second to reap finished connections
      if (p[1].revents != 0) return;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        reap_locked();
      }
      if ((p[0].revents & POLLIN) == 0) continue;
      const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors (EMFILE, ENFILE) or a connection gone before it was taken:
        // pause rather than spin on a listener that stays readable.
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) {
        ::close(fd);
        return;
      }
      if (unproven_ >= kMaxUnproven) {
        Socket refused(fd, -1);
        log::at(
            log::Level::Warn,
            "the rendezvous store refused a connection from {}: {} others are still proving the job secret",
            peer_address(refused), unproven_);
        continue;
      }
      connections_.emplace_back();
      Connection& c = connections_.back();
      c.socket = Socket(fd, -1);
      // A rank's connection idles between requests for the whole job: a rank whose machine
      // vanished would keep its serving thread until the job ends without probes.
      c.socket.keep_alive();
      ++unproven_;
      try {
        c.thread = std::thread([this, &c] {
          serve(c.socket);
          c.finished.store(true);
        });
      } catch (const std::system_error& e) {  // no thread to be had: drop this connection
        --unproven_;
        connections_.pop_back();
        log::at(log::Level::Warn, "the rendezvous store dropped a connection: cannot start a thread: {}",
                e.what());
      }
    }
  }

  // One connection: the handshake, then requests until it closes or the server stops.
  void serve(Socket& s) {
    // Socket's transfers poll a non-blocking descriptor.
    const int flags = ::fcntl(s.fd(), F_GETFL, 0);
    ::fcntl(s.fd(), F_SETFL, flags | O_NONBLOCK);
    const auto refused = check_secret(s, secret_, kStorePurpose, Clock::now() + kHandshake);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --unproven_;
    }
    if (refused) {
      log::at(log::Level::Warn, "the rendezvous store refused a connection from {}: {}", peer_address(s),
              *refused);
      s.shutdown();  // the peer sees it closed now; the acceptor closes the descriptor
      return;
    }
    try {
      for (;;) {
        const Message request = recv_message(s, far_future());
        send_message(s, answer(request), far_future());
      }
    } catch (const IoError&) {
      // The client closed its connection, or the server is stopping.
    } catch (const std::exception& e) {  // a malformed request from a proven client
      log::at(log::Level::Warn, "the rendezvous store dropped a connection from {}: {}", peer_address(s),
              e.what());
    }
    s.shutdown();
  }

  Message answer(const Message& r) {
    Message out;
    const auto need = [&](std::size_t n) {
      if (r.parts.size() != n)
        throw IoError{IoError::Kind::Closed, -1, "a store request with the wrong parts"};
    };
    std::unique_lock<std::mutex> lock(mutex_);
    switch (static_cast<Op>(r.code)) {
      case Op::Set:
        need(2);
        data_[text(r.parts[0])] = r.parts[1];
        changed_.notify_all();
        break;
      case Op::Get:
      case Op::Wait: {
        if (r.parts.empty()) throw IoError{IoError::Kind::Closed, -1, "a store request with the wrong parts"};
        const auto all_there = [&] {
          return stop_ || std::all_of(r.parts.begin(), r.parts.end(),
                                      [&](const Bytes& k) { return data_.count(text(k)) != 0; });
        };
        if (!changed_.wait_for(lock, std::chrono::milliseconds(std::max<std::int64_t>(r.arg, 0)),
                               all_there) ||
            stop_) {
          out.code = static_cast<std::uint32_t>(Status::Timeout);
          break;
        }
        if (static_cast<Op>(r.code) == Op::Get) out.parts.push_back(data_.at(text(r.parts[0])));
        break;
      }
      case Op::Add: {
        need(1);
        Bytes& v = data_[text(r.parts[0])];
        std::int64_t now = 0;
        if (__builtin_add_overflow(v.empty() ? std::int64_t{0} : std::stoll(text(v)), r.arg, &now))
          throw IoError{IoError::Kind::Closed, -1, "an add that overflows 64 bits"};
        v = bytes(std::to_string(now));
        out.arg = now;
        changed_.notify_all();
        break;
      }
      case Op::CompareSet: {
        // As TCPStore: set `desired` when the key holds `expected` (or is missing and
        // `expected` is empty); answer what the key holds afterwards, or `expected` when
        // the key is missing and was left so.
        need(3);
        const std::string key = text(r.parts[0]);
        const auto it = data_.find(key);
        if (it == data_.end()) {
          if (r.parts[1].empty()) {
            data_[key] = r.parts[2];
            changed_.notify_all();
            out.parts.push_back(r.parts[2]);
          } else {
            out.parts.push_back(r.parts[1]);
          }
        } else if (it->second == r.parts[1]) {
          it->second = r.parts[2];
          changed_.notify_all();
          out.parts.push_back(r.parts[2]);
        } else {
          out.parts.push_back(it->second);
        }
        break;
      }
      case Op::Delete:
        need(1);
        out.arg = static_cast<std::int64_t>(data_.erase(text(r.parts[0])));
        break;
      case Op::Check:
        out.arg =
            std::all_of(r.parts.begin(), r.parts.end(), [&](const Bytes& k) { return data_.count(text(k)); });
        break;
      case Op::NumKeys: out.arg = static_cast<std::int64_t>(data_.size()); break;
      default: throw IoError{IoError::Kind::Closed, -1, fmt::format("an unknown store request {}", r.code)};
    }
    return out;
  }

  const std::string secret_;
  int fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread acceptor_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, Bytes> data_;  // guarded by mutex_
  std::list<Connection> connections_;  // guarded by mutex_; a list, so that each stays put
  int unproven_ = 0;                   // guarded by mutex_: connections still in the handshake
  bool stop_ = false;                  // guarded by mutex_
};

// A client of the job's store (every rank's, rank 0's too).
class JobStore final : public c10d::Store {
 public:
  JobStore(std::string host, int port, std::string secret, std::chrono::milliseconds timeout,
           std::shared_ptr<Server> server)
      : Store(timeout),
        host_(std::move(host)),
        port_(port),
        secret_(std::move(secret)),
        server_(std::move(server)) {
    const auto deadline = Clock::now() + timeout;
    socket_ = Socket::connect(host_, port_, 0, deadline);
    prove_secret(socket_, secret_, kStorePurpose, deadline);
  }

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<JobStore>(host_, port_, secret_, timeout_, server_);
  }

  void set(const std::string& key, const std::vector<std::uint8_t>& value) override {
    call(Op::Set, 0, {bytes(key), value});
  }

  std::vector<std::uint8_t> compareSet(const std::string& key, const std::vector<std::uint8_t>& expected,
                                       const std::vector<std::uint8_t>& desired) override {
    return call(Op::CompareSet, 0, {bytes(key), expected, desired}).parts.at(0);
  }

  std::vector<std::uint8_t> get(const std::string& key) override {
    const Message m = call(Op::Get, timeout_.count(), {bytes(key)}, timeout_);
    if (m.code == static_cast<std::uint32_t>(Status::Timeout)) timed_out("get", {key}, timeout_);
    return m.parts.at(0);
  }

  std::int64_t add(const std::string& key, std::int64_t value) override {
    return call(Op::Add, value, {bytes(key)}).arg;
  }

  bool deleteKey(const std::string& key) override { return call(Op::Delete, 0, {bytes(key)}).arg != 0; }

  bool check(const std::vector<std::string>& keys) override {
    return call(Op::Check, 0, as_parts(keys)).arg != 0;
  }

  std::int64_t getNumKeys() override { return call(Op::NumKeys, 0, {}).arg; }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    if (keys.empty()) return;
    const Message m = call(Op::Wait, timeout.count(), as_parts(keys), timeout);
    if (m.code == static_cast<std::uint32_t>(Status::Timeout)) timed_out("wait", keys, timeout);
  }

 private:
  static std::vector<Bytes> as_parts(const std::vector<std::string>& keys) {
    std::vector<Bytes> parts;
    for (const auto& k : keys) parts.push_back(bytes(k));
    return parts;
  }

  [[noreturn]] void timed_out(const char* what, const std::vector<std::string>& keys,
                              std::chrono::milliseconds timeout) const {
    C10_THROW_ERROR(DistStoreError,
                    fmt::format("flatshard's store: {} of '{}' timed out after {} ms", what,
                                keys.empty() ? std::string() : keys.front(), timeout.count()));
  }

  // One request and its answer; `waits` is how long the server may hold the answer back.
  Message call(Op op, std::int64_t arg, std::vector<Bytes> parts,
               std::chrono::milliseconds waits = std::chrono::milliseconds(0)) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_.empty()) C10_THROW_ERROR(DistNetworkError, broken_);
    const auto deadline = Clock::now() + timeout_ + waits;
    try {
      send_message(socket_, Message{static_cast<std::uint32_t>(op), arg, std::move(parts)}, deadline);
      return recv_message(socket_, deadline);
    } catch (const IoError& e) {
      // A late answer would be read as the next request's: this connection is done.
      socket_.shutdown();
      broken_ = fmt::format("flatshard's store at {}:{}: {} (has rank 0 stopped?)", host_, port_, e.detail);
      C10_THROW_ERROR(DistNetworkError, broken_);
    }
  }

  const std::string host_;
  const int port_;
  const std::string secret_;
  std::shared_ptr<Server> server_;  // rank 0's: outlives every store object of this process
  std::mutex mutex_;
  Socket socket_;       // guarded by mutex_
  std::string broken_;  // guarded by mutex_: why the connection failed, once it has
};

}  // namespace

c10::intrusive_ptr<c10d::Store> make_job_store(const std::string& host, int port, bool serve,
                                               const std::string& secret, std::chrono::milliseconds timeout) {
  std::shared_ptr<Server> server;
  if (serve) server = std::make_shared<Server>(port, loopback_address_of(host), secret);
  return c10::make_intrusive<JobStore>(host, port, secret, timeout, std::move(server));
}

}  // namespace flatshard::tcp
