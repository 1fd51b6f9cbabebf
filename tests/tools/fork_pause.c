// Preloaded into hpshard-run by launcher_test.sh (case killed-after-fork): in the launcher
// only, the parent's side of its second fork (the first rank's; the first is the clean-up
// process) writes the child's pid to $HPS_FORK_PAUSE_MARK and then sleeps 30 s, so the test
// can kill the launcher after a rank exists and before the launcher did anything more.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int is_launcher(void) {
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return 0;
  exe[n] = '\0';
  const char* base = strrchr(exe, '/');
  return strcmp(base ? base + 1 : exe, "hpshard-run") == 0;
}

pid_t fork(void) {
  static int forks;
  pid_t (*real)(void) = (pid_t(*)(void))dlsym(RTLD_NEXT, "fork");
  const pid_t pid = real();
  if (pid > 0 && is_launcher() && ++forks == 2) {
    const char* mark = getenv("HPS_FORK_PAUSE_MARK");
    if (mark != NULL) {
      const int fd = open(mark, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd >= 0) {
        dprintf(fd, "%d\n", (int)pid);
        close(fd);
      }
      sleep(30);
    }
  }
  return pid;
}
