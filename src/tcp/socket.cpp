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
  return ::inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

std::string loopback_address_of(const std::string& host) {
  if (is_loopback(host)) return host;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return "";
  char text[INET_ADDRSTRLEN] = "";
  ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr, text, sizeof(text));
  freeaddrinfo(found);
  return is_loopback(text) ? std::string(text) : std::string();
}

Listener::Listener(bool loopback_only) : Listener(0, loopback_only) {}

Listener::Listener(int port, bool loopback_only) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) {  // out of file descriptors (EMFILE), say: an error the caller names, not a crash
    throw_io(IoError::Kind::Closed, -1,
             fmt::format("cannot open a socket to listen on: {} (raise `ulimit -n`?)", std::strerror(errno)));
  }
  int one = 1;
  setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(loopback_only ? INADDR_LOOPBACK : INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd_, 128) != 0) {
    const int error = errno;
    ::close(fd_);
    fd_ = -1;
    throw_io(IoError::Kind::Closed, -1,
             port == 0 ? fmt::format("cannot listen on a free port: {}", std::strerror(error))
                       : fmt::format("cannot listen on port {}: {}", port, std::strerror(error)));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
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
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      throw_io(IoError::Kind::Closed, -1, fmt::format("accept failed: {}", std::strerror(errno)));
    }
    if (Clock::now() >= deadline) {
      throw_io(IoError::Kind::Timeout, -1, "no connection arrived before the deadline");
    }
    pollfd p{fd_, POLLIN, 0};
    ::poll(&p, 1, remaining_ms(deadline));
  }
}

std::string local_address_toward(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return "127.0.0.1";
  std::string result = "127.0.0.1";
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char text[INET_ADDRSTRLEN];
      if (inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)) != nullptr) result = text;
    }
  }
  if (fd >= 0) ::close(fd);
  freeaddrinfo(found);
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
