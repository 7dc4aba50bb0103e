/* Peers: see peer.h. Forked on POSIX; on Windows, the runner started again
 * (compat.h's test_spawn_peer) and sent the arg's bytes. */
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

#ifdef _WIN32
peer_t peer_start(test_ctx_t *ctx, peer_main_t run, const void *arg,
                  size_t size) {
  /* `run` as an offset in the image: the same function in the peer, where
   * the image may sit elsewhere (ASLR). */
  uintptr_t offset = (uintptr_t)run - test_image_base();
  char args[300];
  snprintf(args, sizeof args, "%s/%s %llx", ctx->backend_name, ctx->name,
           (unsigned long long)offset);
  fflush(stdout);
  fflush(stderr);
  peer_t p;
  int pid = 0;
  ASSERT_EQ_INT(test_spawn_peer(args, &p.to, &p.from, &pid), 0);
  p.pid = pid;
  put_u64(p.to, size);
  if (size) ASSERT_EQ_INT(write(p.to, arg, (unsigned)size), (int)size);
  ASSERT_EQ_U64(get_u64(p.from), 0);
  return p;
}

void peer_serve(test_ctx_t *ctx, uintptr_t offset, int in, int out) {
  uint64_t size = get_u64(in);
  unsigned char *arg = malloc(size ? size : 1);
  ASSERT_NOT_NULL(arg);
  for (uint64_t got = 0; got < size;) {
    int n = read(in, arg + got, (unsigned)(size - got));
    ASSERT_GT_INT(n, 0);
    got += (uint64_t)n;
  }
  uintptr_t at = test_image_base() + offset;
  peer_main_t run;
  memcpy(&run, &at, sizeof run);
  run(ctx, arg, in, out);
  _exit(0); /* run exits */
}
#else
peer_t peer_start(test_ctx_t *ctx, peer_main_t run, const void *arg,
                  size_t size) {
  (void)size; /* the child has the parent's memory */
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
#endif

uint64_t peer_do(peer_t *p, char cmd) {
  ASSERT_EQ_INT(write(p->to, &cmd, 1), 1);
  return get_u64(p->from);
}

int peer_wait(peer_t *p) {
  int st = test_wait(p->pid);
  close(p->to);
  close(p->from);
  return st;
}

void peer_quit(peer_t *p) {
  char q = 'Q';
  ASSERT_EQ_INT(write(p->to, &q, 1), 1);
  int st = peer_wait(p);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

