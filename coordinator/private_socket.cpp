#include "coordinator/private_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace moraine::group {

namespace fs = std::filesystem;

std::string private_dir_problem(const std::string& dir) {
  struct stat st{};
  // lstat: a symlink could point the group's sockets at a directory someone else controls.
  if (::lstat(dir.c_str(), &st) != 0) return "cannot stat it (" + std::string(std::strerror(errno)) + ")";
  if (S_ISLNK(st.st_mode)) return "it is a symbolic link";
  if (!S_ISDIR(st.st_mode)) return "it is not a directory";
  if (st.st_uid != ::geteuid())
    return "it is owned by uid " + std::to_string(st.st_uid) + ", not by this process's uid " + std::to_string(::geteuid());
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return std::string("its mode is ") + mode + ": group or other users may enter it";
  }
  return {};
}

void ensure_private_dir(const std::string& dir) {
  if (dir.empty()) throw std::runtime_error("the socket directory is not set");
  const fs::path p(dir);
  if (p.has_parent_path()) {
    std::error_code ec;
    fs::create_directories(p.parent_path(), ec);   // the parent may be shared (/tmp); only `dir` is the group's
  }
  // mkdir with 0700 from the start: a directory made with the umask's mode and tightened after
  // would leave a window in which another user could enter it.
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw std::runtime_error("cannot make the socket directory " + dir + ": " + std::strerror(errno));
  const std::string why = private_dir_problem(dir);
  if (!why.empty())
    throw std::runtime_error("refusing the socket directory " + dir + ": " + why +
                             " (it must be a directory of this user with mode 0700: chmod 700 it, or name another)");
}

std::string peer_problem(int fd, uid_t uid) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred)
    return "no peer credentials (" + std::string(std::strerror(errno)) + ")";
  if (cred.uid != uid)
    return "the peer (pid " + std::to_string(cred.pid) + ") runs as uid " + std::to_string(cred.uid) + ", not " + std::to_string(uid);
  return {};
}

}  // namespace moraine::group
