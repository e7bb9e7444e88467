#include "tests/support/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace flatshard::testing {

RunResult run_command(const std::vector<std::string>& argv, const RunOptions& options) {
  RunResult result;
  int pipe_fd[2];
  if (::pipe2(pipe_fd, O_CLOEXEC) != 0) {
    result.output = "pipe failed";
    return result;
  }
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    // Whatever the test run was started ignoring (`nohup ctest`), the program starts with
    // the default actions, as from a shell.
    ::signal(SIGHUP, SIG_DFL);
    ::signal(SIGINT, SIG_DFL);
    ::dup2(pipe_fd[1], STDOUT_FILENO);
    ::dup2(pipe_fd[1], STDERR_FILENO);
    for (const auto& name : options.unset_env) ::unsetenv(name.c_str());
    for (const auto& [k, v] : options.env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "cannot exec %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(pipe_fd[1]);
  ::fcntl(pipe_fd[0], F_SETFL, O_NONBLOCK);
  bool signalled = options.signal == 0;
  int status = 0;
  bool exited = false;
  bool eof = false;
  char buf[65536];
  while (!exited || !eof) {
    const auto now = std::chrono::steady_clock::now();
    if (!signalled && now - start >= options.signal_after) {
      ::kill(pid, options.signal);
      signalled = true;
    }
    if (!exited && now - start >= options.deadline) {
      result.timed_out = true;
      ::kill(-pid, SIGKILL);  // the whole group: the launcher and its ranks
      ::kill(pid, SIGKILL);
    }
    pollfd p{pipe_fd[0], POLLIN, 0};
    if (!eof) ::poll(&p, 1, 20);
    for (;;) {
      const ssize_t n = eof ? 0 : ::read(pipe_fd[0], buf, sizeof(buf));
      if (n > 0) {
        result.output.append(buf, static_cast<std::size_t>(n));
        continue;
      }
      if (n == 0) eof = true;
      break;
    }
    if (!exited && ::waitpid(pid, &status, WNOHANG) == pid) exited = true;
    if (exited && !eof && result.timed_out) break;  // orphans may hold the pipe open
    if (eof && !exited) ::usleep(10000);
  }
  ::close(pipe_fd[0]);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

}  // namespace flatshard::testing
