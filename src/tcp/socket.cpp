#include "src/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "src/errors.h"

namespace flatshard::tcp {
namespace {

[[noreturn]] void throw_io(IoError::Kind kind, int peer, std::string detail) {
  throw IoError{kind, peer, std::move(detail)};
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return left > 1000 ? 1000 : static_cast<int>(left);  // wake up at least once a second
}

void set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  set_nonblocking(fd);
}

// Progress of one direction of a transfer.
struct Cursor {
  char* ptr[2];
  std::size_t left[2];
  int part = 0;
  bool done() const { return part == 2; }
  void skip_empty() {
    while (part < 2 && left[part] == 0) ++part;
  }
};

}  // namespace

Socket::Socket(int fd, int peer) : fd_(fd), peer_(peer) {}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

Socket::Socket(Socket&& other) noexcept : fd_(other.fd_), peer_(other.peer_) { other.fd_ = -1; }

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    peer_ = other.peer_;
    other.fd_ = -1;
  }
  return *this;
}

void Socket::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void Socket::keep_alive(int idle_s, int interval_s, int count) const {
  if (fd_ < 0) return;
  int on = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

Socket Socket::connect(const std::string& host, int port, int peer, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  std::string last_error = "no attempt";
  auto pause = std::chrono::milliseconds(10);
  do {
    addrinfo* found = nullptr;
    const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (rc != 0) {
      last_error = fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc));
    } else {
      for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
        // Non-blocking, so that a host that drops the handshake's packets costs this attempt
        // its share of the deadline, not the kernel's minutes of SYN retries.
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        int err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
        if (err == EINPROGRESS) {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
          pollfd p{fd, POLLOUT, 0};
          const int ready = ::poll(&p, 1, static_cast<int>(std::clamp<std::int64_t>(left.count(), 1, 1000)));
          socklen_t len = sizeof(err);
          if (ready <= 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = ETIMEDOUT;
        }
        if (err == 0) {
          freeaddrinfo(found);
          tune(fd);
          return Socket(fd, peer);
        }
        last_error = std::strerror(err);
        ::close(fd);
      }
      freeaddrinfo(found);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  } while (Clock::now() < deadline);
  throw_io(IoError::Kind::Timeout, peer,
           fmt::format("could not connect to rank {} at {}:{}: {}", peer, host, port, last_error));
}

void Socket::send_all(const void* data, std::size_t bytes, Clock::time_point deadline) {
  detail::exchange(this, Parts{data, bytes, nullptr, 0}, nullptr, MutableParts{}, deadline, nullptr, nullptr);
}

void Socket::recv_all(void* data, std::size_t bytes, Clock::time_point deadline) {
  detail::exchange(nullptr, Parts{}, this, MutableParts{data, bytes, nullptr, 0}, deadline, nullptr, nullptr);
}

bool is_loopback(const std::string& host) {
  in_addr a{};
  if (::inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  in6_addr b{};
  if (::inet_pton(AF_INET6, host.c_str(), &b) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&b)) return true;
  return IN6_IS_ADDR_V4MAPPED(&b) && b.s6_addr[12] == 127;
}

namespace {

// `host`'s first address of the family it prefers (IPv4 when it has any: Note [Either
// family]), or nullptr; `owner` frees the list.
const addrinfo* preferred_address(const std::string& host, int port, int socktype,
                                  std::unique_ptr<addrinfo, void (*)(addrinfo*)>& owner) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr)
    return nullptr;
  owner.reset(found);
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next)
    if (a->ai_family == AF_INET) return a;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next)
    if (a->ai_family == AF_INET6) return a;
  return nullptr;
}

// The address in `addr` as text ("" for another family).
std::string address_text(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = "";
  if (addr->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, text, sizeof(text));
  } else if (addr->sa_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, text, sizeof(text));
  }
  return text;
}

}  // namespace

// Note [Either family]
// ~~~~~~~~~~~~~~~~~~~~
// A job's addresses may be IPv4 or IPv6: MASTER_ADDR=::1, a cluster whose host names resolve
// to IPv6 only. Listening "on every interface" is one IPv6 socket with IPV6_V6ONLY off, which
// takes IPv4 connections as mapped addresses too (an IPv4 socket where the kernel has no
// IPv6), so a rank reaches it whichever family its peer's name resolves to. A listener kept
// to loopback binds the loopback address it was given, of its own family. Where a name has
// both, its IPv4 addresses decide (getaddrinfo's own order puts ::1 before 127.0.0.1 for
// "localhost", and a container may list ::1 in /etc/hosts without an IPv6 loopback): the
// choices the engine made before it spoke IPv6 stay as they were.

std::string loopback_address_of(const std::string& host) {
  if (is_loopback(host)) return host;
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owner(nullptr, freeaddrinfo);
  const addrinfo* a = preferred_address(host, 0, SOCK_STREAM, owner);
  if (a == nullptr) return "";
  const std::string text = address_text(a->ai_addr);
  return is_loopback(text) ? text : std::string();
}

int listen_socket(int port, const std::string& address, int backlog, int* bound_port) {
  sockaddr_storage addr{};
  socklen_t length = 0;
  const auto fill6 = [&](const in6_addr& host) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    a->sin6_family = AF_INET6;
    a->sin6_addr = host;
    a->sin6_port = htons(static_cast<std::uint16_t>(port));
    length = sizeof(sockaddr_in6);
  };
  const auto fill4 = [&](std::uint32_t host_order) {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(host_order);
    a->sin_port = htons(static_cast<std::uint16_t>(port));
    length = sizeof(sockaddr_in);
  };
  const auto where = [&] { return port == 0 ? std::string("a free port") : fmt::format("port {}", port); };
  in_addr v4{};
  in6_addr v6{};
  if (address.empty()) {
    fill6(in6addr_any);
  } else if (::inet_pton(AF_INET, address.c_str(), &v4) == 1) {
    fill4(ntohl(v4.s_addr));
  } else if (::inet_pton(AF_INET6, address.c_str(), &v6) == 1) {
    fill6(v6);
  } else {
    throw_io(IoError::Kind::Closed, -1,
             fmt::format("cannot listen on {}: '{}' is not an address", where(), address));
  }
  int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 && address.empty() && (errno == EAFNOSUPPORT || errno == EPROTONOSUPPORT)) {
    fill4(INADDR_ANY);  // a kernel without IPv6
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  }
  if (fd < 0) {  // out of file descriptors (EMFILE), say: an error the caller names, not a crash
    throw_io(IoError::Kind::Closed, -1,
             fmt::format("cannot open a socket to listen on: {} (raise `ulimit -n`?)", std::strerror(errno)));
  }
  int one = 1, zero = 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (addr.ss_family == AF_INET6 && address.empty())
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), length) != 0 || ::listen(fd, backlog) != 0) {
    const int error = errno;
    ::close(fd);
    throw_io(IoError::Kind::Closed, -1,
             fmt::format("cannot listen on {}: {}", where(), std::strerror(error)));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (bound_port != nullptr) {
    *bound_port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                             : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  }
  return fd;
}

Listener::Listener(const std::string& address) : Listener(0, address) {}

Listener::Listener(int port, const std::string& address) {
  fd_ = listen_socket(port, address, 128, &port_);
  set_nonblocking(fd_);
}

Listener::~Listener() {
  if (fd_ >= 0) ::close(fd_);
}

bool Listener::pending() const {
  pollfd p{fd_, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

Socket Listener::accept(Clock::time_point deadline) {
  for (;;) {
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      tune(fd);
      return Socket(fd, -1);
    }
    const int err = errno;
    // A connection that went before it was taken, and the network errors Linux passes on
    // from the new socket, concern that connection only (accept(2)): the next may come.
    // Out of descriptors or memory, the listener stays readable: wait a little and retry
    // until the deadline, which bounds both.
    const bool that_connection = err == ECONNABORTED || err == EPROTO || err == ENETDOWN ||
                                 err == ENOPROTOOPT || err == EHOSTDOWN || err == EHOSTUNREACH ||
                                 err == EOPNOTSUPP || err == ENETUNREACH;
    const bool out_of_room = err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
    if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR && !that_connection && !out_of_room) {
      throw_io(IoError::Kind::Closed, -1, fmt::format("accept failed: {}", std::strerror(err)));
    }
    if (Clock::now() >= deadline) {
      throw_io(IoError::Kind::Timeout, -1,
               out_of_room
                   ? fmt::format("no connection could be taken before the deadline: {}", std::strerror(err))
                   : std::string("no connection arrived before the deadline"));
    }
    if (out_of_room) {
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::min<long long>(100, remaining_ms(deadline))));
      continue;
    }
    pollfd p{fd_, POLLIN, 0};
    ::poll(&p, 1, remaining_ms(deadline));
  }
}

std::string local_address_toward(const std::string& host, int port) {
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owner(nullptr, freeaddrinfo);
  const addrinfo* a = preferred_address(host, port, SOCK_DGRAM, owner);
  if (a == nullptr) return "127.0.0.1";
  std::string result = "127.0.0.1";
  int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const std::string text = address_text(reinterpret_cast<const sockaddr*>(&local));
      if (!text.empty()) result = text;
    }
  }
  if (fd >= 0) ::close(fd);
  return result;
}

namespace detail {

void exchange(Socket* out, const Parts& send, Socket* in, const MutableParts& recv,
              Clock::time_point deadline, void (*check)(void*), void* check_arg) {
  Cursor tx{{const_cast<char*>(static_cast<const char*>(send.head)),
             const_cast<char*>(static_cast<const char*>(send.body))},
            {out ? send.head_bytes : 0, out ? send.body_bytes : 0}};
  Cursor rx{{static_cast<char*>(recv.head), static_cast<char*>(recv.body)},
            {in ? recv.head_bytes : 0, in ? recv.body_bytes : 0}};
  tx.skip_empty();
  // The head check runs when part 0 completes, even for an empty body.
  bool checked = check == nullptr || !in || recv.head_bytes == 0;
  auto advance_rx = [&] {
    if (rx.part == 0 && rx.left[0] == 0) {
      if (!checked) {
        checked = true;
        check(check_arg);
      }
      rx.part = 1;
    }
    if (rx.part == 1 && rx.left[1] == 0) rx.part = 2;
  };
  advance_rx();
  while (!tx.done() || !rx.done()) {
    pollfd fds[2];
    int n = 0;
    int tx_index = -1, rx_index = -1;
    if (!tx.done()) {
      fds[n] = {out->fd(), POLLOUT, 0};
      tx_index = n++;
    }
    if (!rx.done()) {
      fds[n] = {in->fd(), POLLIN, 0};
      rx_index = n++;
    }
    const int ready = ::poll(fds, n, remaining_ms(deadline));
    if (ready < 0 && errno != EINTR) {
      throw_io(IoError::Kind::Closed, in ? in->peer() : out->peer(),
               fmt::format("poll failed: {}", std::strerror(errno)));
    }
    if (ready <= 0) {
      if (Clock::now() >= deadline) {
        const bool waiting_for_recv = !rx.done();
        Socket* s = waiting_for_recv ? in : out;
        throw_io(IoError::Kind::Timeout, s->peer(),
                 waiting_for_recv ? fmt::format("no data from rank {} before the deadline", s->peer())
                                  : fmt::format("rank {} accepted no data before the deadline", s->peer()));
      }
      continue;
    }
    if (tx_index >= 0 && fds[tx_index].revents != 0) {
      const ssize_t sent = ::send(out->fd(), tx.ptr[tx.part], tx.left[tx.part], MSG_NOSIGNAL);
      if (sent > 0) {
        tx.ptr[tx.part] += sent;
        tx.left[tx.part] -= static_cast<std::size_t>(sent);
        tx.skip_empty();
      } else if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        throw_io(IoError::Kind::Closed, out->peer(),
                 fmt::format("sending to rank {} failed: {}", out->peer(), std::strerror(errno)));
      }
    }
    if (rx_index >= 0 && fds[rx_index].revents != 0) {
      const ssize_t got = ::recv(in->fd(), rx.ptr[rx.part], rx.left[rx.part], 0);
      if (got > 0) {
        rx.ptr[rx.part] += got;
        rx.left[rx.part] -= static_cast<std::size_t>(got);
        advance_rx();
      } else if (got == 0) {
        throw_io(IoError::Kind::Closed, in->peer(), fmt::format("rank {} closed its connection", in->peer()));
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        throw_io(IoError::Kind::Closed, in->peer(),
                 fmt::format("receiving from rank {} failed: {}", in->peer(), std::strerror(errno)));
      }
    }
  }
}

}  // namespace detail
}  // namespace flatshard::tcp
