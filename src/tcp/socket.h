// Non-blocking TCP sockets with deadlines, for the ring transport.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace flatshard::tcp {

using Clock = std::chrono::steady_clock;

// Why a socket operation failed. `peer` is the rank at the other end.
struct IoError {
  enum class Kind { Closed, Timeout, Aborted };
  Kind kind;
  int peer;
  std::string detail;
  // Set by prove_secret when the listener answered and did not accept the proof (or could
  // not prove the secret back): retrying will not help, unlike a connection that broke.
  bool refused = false;
};

class Socket {
 public:
  Socket() = default;
  Socket(int fd, int peer);
  ~Socket();
  Socket(Socket&& other) noexcept;
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  int peer() const { return peer_; }
  void set_peer(int peer) { peer_ = peer; }
  bool valid() const { return fd_ >= 0; }

  // Connects to host:port, retrying refused connections until `deadline`.
  static Socket connect(const std::string& host, int port, int peer, Clock::time_point deadline);

  // Blocking-with-deadline whole-buffer transfers (used for handshakes).
  void send_all(const void* data, std::size_t bytes, Clock::time_point deadline);
  void recv_all(void* data, std::size_t bytes, Clock::time_point deadline);

  // Wakes every thread blocked on this socket; they fail with Closed. Thread-safe.
  void shutdown();

  // For a connection that may sit idle while its peer is still needed (a launcher waiting
  // through a start, the store serving a rank between requests): TCP keepalive probes
  // after idle_s seconds without traffic, every interval_s, and the connection fails after
  // `count` unanswered ones. A machine that lost power or its network is then seen as gone
  // (about 25 s with the defaults) instead of never.
  void keep_alive(int idle_s = 10, int interval_s = 5, int count = 3) const;

 private:
  int fd_ = -1;
  int peer_ = -1;
};

class Listener {
 public:
  // Binds a free port on every interface, IPv4 and IPv6, or on `address` only when it is
  // given: a loopback address (a job on one machine: nothing from outside it can connect).
  explicit Listener(const std::string& address = "");
  // Binds `port` the same way; throws IoError (Closed) naming the port when it cannot
  // (taken, or not ours to bind).
  Listener(int port, const std::string& address);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int port() const { return port_; }
  Socket accept(Clock::time_point deadline);
  // Whether a connection waits to be accepted (never blocks).
  bool pending() const;

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A listening socket's descriptor, on `port` (0: a free one, whose number `bound_port`
// gets) at `address` (an IPv4 or IPv6 address), or, when it is "", on every interface: one
// IPv6 socket that takes IPv4 connections too, or an IPv4 one on a host without IPv6.
// Throws IoError (Closed) naming the port.
int listen_socket(int port, const std::string& address, int backlog, int* bound_port);

// Whether `host` is a loopback address, written as such: 127.0.0.0/8, ::1, or IPv4's
// loopback mapped into IPv6 (::ffff:127.0.0.1).
bool is_loopback(const std::string& host);

// `host`'s address when it is a loopback one ("localhost" -> "127.0.0.1", "::1" -> "::1"),
// else "" (another machine's, or unresolvable). A name with IPv4 addresses is judged by the
// first of them, one with IPv6 addresses only by its first.
std::string loopback_address_of(const std::string& host);

// The local address this host uses to reach `host` (no packet is sent): in `host`'s first
// IPv4 address's family when it has one, else in IPv6's.
std::string local_address_toward(const std::string& host, int port);

// A message in two parts: a fixed-size head, then a body.
struct Parts {
  const void* head = nullptr;
  std::size_t head_bytes = 0;
  const void* body = nullptr;
  std::size_t body_bytes = 0;
};
struct MutableParts {
  void* head = nullptr;
  std::size_t head_bytes = 0;
  void* body = nullptr;
  std::size_t body_bytes = 0;
};

// One step of a ring: sends `send` on `out` while receiving into `recv` from `in`,
// both at once, so that a ring in which every rank sends first cannot deadlock.
// `check_head` runs once the received head is complete and before any body byte is
// read (it throws to refuse a message that does not match). Either socket may be
// null. Throws IoError, or what `check_head` throws.
template <typename CheckHead>
void exchange(Socket* out, const Parts& send, Socket* in, const MutableParts& recv,
              Clock::time_point deadline, CheckHead&& check_head);

namespace detail {
// Type-erased core of exchange().
void exchange(Socket* out, const Parts& send, Socket* in, const MutableParts& recv,
              Clock::time_point deadline, void (*check)(void*), void* check_arg);
}  // namespace detail

template <typename CheckHead>
void exchange(Socket* out, const Parts& send, Socket* in, const MutableParts& recv,
              Clock::time_point deadline, CheckHead&& check_head) {
  detail::exchange(
      out, send, in, recv, deadline,
      [](void* arg) { (*static_cast<std::remove_reference_t<CheckHead>*>(arg))(); }, &check_head);
}

}  // namespace flatshard::tcp
