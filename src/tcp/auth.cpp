#include "src/tcp/auth.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "src/tcp/socket.h"

namespace flatshard::tcp {
namespace {

constexpr std::array<unsigned char, 8> kMagic = {'F', 'S', 'J', 'O', 'B', 'v', '1', 0};
constexpr std::size_t kNonce = 32;
constexpr std::size_t kMac = 32;

using Nonce = std::array<unsigned char, kNonce>;
using Mac = std::array<unsigned char, kMac>;

Nonce fresh_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    throw IoError{IoError::Kind::Aborted, -1, "the random source failed (RAND_bytes)"};
  }
  return n;
}

// HMAC-SHA256(secret, side + " " + purpose + client nonce + server nonce).
Mac mac(const std::string& secret, const char* side, const std::string& purpose, const Nonce& client,
        const Nonce& server) {
  std::string message = fmt::format("{} {}", side, purpose);
  message.append(reinterpret_cast<const char*>(client.data()), client.size());
  message.append(reinterpret_cast<const char*>(server.data()), server.size());
  Mac out{};
  unsigned int length = 0;
  // An empty key is passed as a one-byte buffer of length 0 (HMAC wants a valid pointer).
  const unsigned char empty = 0;
  const void* key = secret.empty() ? static_cast<const void*>(&empty) : secret.data();
  if (HMAC(EVP_sha256(), key, static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(),
           &length) == nullptr ||
      length != kMac) {
    throw IoError{IoError::Kind::Aborted, -1, "HMAC-SHA256 failed"};
  }
  return out;
}

bool same(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

struct Challenge {
  std::array<unsigned char, 8> magic;
  Nonce server;
};
struct Answer {
  std::array<unsigned char, 8> magic;
  Nonce client;
  Mac proof;
};

}  // namespace

std::string job_secret() {
  const char* s = std::getenv("FLATSHARD_JOB_SECRET");
  return s == nullptr ? std::string() : std::string(s);
}

bool job_on_one_machine() {
  const auto get = [](const char* name) {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  };
  const auto same = [&](const char* a, const char* b) { return !get(a).empty() && get(a) == get(b); };
  return get("GROUP_WORLD_SIZE") == "1" || same("LOCAL_WORLD_SIZE", "WORLD_SIZE") ||
         same("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE") || get("SLURM_NNODES") == "1" ||
         get("SLURM_JOB_NUM_NODES") == "1";
}

bool job_spans_machines() {
  const auto number = [](const char* name) -> long {
    const char* v = std::getenv(name);
    return v == nullptr || *v == '\0' ? -1 : std::strtol(v, nullptr, 10);
  };
  const auto fewer = [&](const char* local, const char* all) {
    return number(local) > 0 && number(all) > number(local);
  };
  return fewer("LOCAL_WORLD_SIZE", "WORLD_SIZE") || number("GROUP_WORLD_SIZE") > 1 ||
         fewer("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE") || number("SLURM_NNODES") > 1;
}

bool loopback_by_name(const std::string& master) {
  if (master.empty() || is_loopback(master) || master.find("localhost") != std::string::npos) return false;
  in6_addr any{};
  if (::inet_pton(AF_INET, master.c_str(), &any) == 1 || ::inet_pton(AF_INET6, master.c_str(), &any) == 1)
    return false;  // an address, not a name
  return !loopback_address_of(master).empty();
}

std::string make_secret() {
  const Nonce bytes = fresh_nonce();
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

void prove_secret(Socket& s, const std::string& secret, const std::string& purpose,
                  Clock::time_point deadline) {
  Challenge challenge{};
  s.recv_all(&challenge, sizeof(challenge), deadline);
  if (challenge.magic != kMagic) {
    throw IoError{
        IoError::Kind::Closed, s.peer(),
        fmt::format("the {} at {} does not speak FlatShard's handshake (another program on that port?)",
                    purpose, peer_address(s)),
        true};
  }
  Answer answer{kMagic, fresh_nonce(), {}};
  answer.proof = mac(secret, "client", purpose, answer.client, challenge.server);
  s.send_all(&answer, sizeof(answer), deadline);
  Mac theirs{};
  try {
    s.recv_all(&theirs, sizeof(theirs), deadline);
  } catch (const IoError& e) {
    throw IoError{
        e.kind, s.peer(),
        fmt::format("the {} at {} refused this rank's proof of the job secret ({}): give every rank the "
                    "same FLATSHARD_JOB_SECRET",
                    purpose, peer_address(s), e.detail),
        true};
  }
  if (!same(theirs, mac(secret, "server", purpose, answer.client, challenge.server))) {
    throw IoError{IoError::Kind::Closed, s.peer(),
                  fmt::format("the {} at {} could not prove the job secret: it belongs to another job, or "
                              "FLATSHARD_JOB_SECRET differs between ranks",
                              purpose, peer_address(s)),
                  true};
  }
}

std::optional<std::string> check_secret(Socket& s, const std::string& secret, const std::string& purpose,
                                        Clock::time_point deadline) {
  try {
    const Challenge challenge{kMagic, fresh_nonce()};
    s.send_all(&challenge, sizeof(challenge), deadline);
    Answer answer{};
    s.recv_all(&answer, sizeof(answer), deadline);
    if (answer.magic != kMagic) return std::string("it does not speak FlatShard's handshake");
    if (!same(answer.proof, mac(secret, "client", purpose, answer.client, challenge.server))) {
      return std::string("it did not prove the job secret");
    }
    const Mac proof = mac(secret, "server", purpose, answer.client, challenge.server);
    s.send_all(&proof, sizeof(proof), deadline);
    return std::nullopt;
  } catch (const IoError& e) {
    return e.kind == IoError::Kind::Timeout ? std::string("it sent no proof in time")
                                            : fmt::format("the handshake failed: {}", e.detail);
  }
}

std::string peer_address(const Socket& s) {
  sockaddr_storage addr{};
  socklen_t length = sizeof(addr);
  if (s.fd() < 0 || ::getpeername(s.fd(), reinterpret_cast<sockaddr*>(&addr), &length) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return fmt::format("{}:{}", host, port);
}

}  // namespace flatshard::tcp
