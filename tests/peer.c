/* Forked peers: see peer.h. POSIX only: Windows has no fork, and the tests
 * that use peers are TEST_EXCLUDED there. */
#ifndef _WIN32
#include "peer.h"
#include "compat.h"

void put_u64(int fd, uint64_t v) {
  ASSERT_EQ_INT(write(fd, &v, sizeof v), (int)sizeof v);
}

uint64_t get_u64(int fd) {
  uint64_t v = 0;
  ASSERT_EQ_INT(read(fd, &v, sizeof v), (int)sizeof v);
  return v;
}

peer_t peer_start(test_ctx_t *ctx, peer_main_t run, const void *arg) {
  int down[2], up[2];
  ASSERT_EQ_INT(pipe(down), 0);
  ASSERT_EQ_INT(pipe(up), 0);
  fflush(stdout); /* else the child would write our buffered output too */
  fflush(stderr);
  pid_t pid = fork();
  ASSERT_GE_INT(pid, 0);
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    run(ctx, arg, down[0], up[1]);
    _exit(0); /* run exits; never back into the parent's test */
  }
  close(down[0]);
  close(up[1]);
  peer_t p = {pid, down[1], up[0]};
  ASSERT_EQ_U64(get_u64(p.from), 0);
  return p;
}

uint64_t peer_do(peer_t *p, char cmd) {
  ASSERT_EQ_INT(write(p->to, &cmd, 1), 1);
  return get_u64(p->from);
}

void peer_quit(peer_t *p) {
  char q = 'Q';
  ASSERT_EQ_INT(write(p->to, &q, 1), 1);
  int st = test_wait(p->pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  close(p->to);
  close(p->from);
}

#endif /* !_WIN32 */
