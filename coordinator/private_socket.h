// The group's sockets are for its own user only: the socket directory (every process's control
// and job sockets, the manifest, the logs) is 0700 and owned by that user, and the gRPC control
// servers accept a Unix-socket peer only when it runs as the same user (SO_PEERCRED).
#pragma once
#include <sys/types.h>

#include <string>

namespace moraine::group {

// Why `dir` is not a private directory of this process's effective uid (a real directory, not a
// symlink, owned by the uid, no group or other permission bits); empty when it is.
std::string private_dir_problem(const std::string& dir);
// Makes `dir` with mode 0700 (missing parents with the usual mode) or checks an existing one as
// private_dir_problem does. Throws std::runtime_error naming the path and what to do.
void ensure_private_dir(const std::string& dir);
// Why the peer of a connected Unix socket `fd` may not talk to a process running as `uid`;
// empty when it may (the same uid).
std::string peer_problem(int fd, uid_t uid);

}  // namespace moraine::group
