/* Peers of the cross-process tests (test_ledger.c, test_pins.c,
 * test_shared_headroom.c): a child process that runs `run` and obeys
 * one-byte commands read from `in`, answering each with a number written
 * to `out`; it writes 0 once ready. On POSIX the child is forked; on
 * Windows it is the runner started again (--peer), which calls `run` with
 * a copy of the `size` bytes at `arg`: an arg holds no pointers.
 * Start peers before the test opens a device of its own: a device with a
 * ledger has a thread, and TSan lets no child of a threaded process start
 * threads. */
#ifndef VP_PEER_H
#define VP_PEER_H

#include <sys/types.h>

#include "test.h"

typedef struct peer {
  pid_t pid;
  int to, from;
} peer_t;

/* Runs in the child; `arg` is peer_start's (the child's copy). Exits. */
typedef void (*peer_main_t)(test_ctx_t *ctx, const void *arg, int in,
                            int out);

void put_u64(int fd, uint64_t v);
uint64_t get_u64(int fd);
/* Starts the peer and waits until it is ready. */
peer_t peer_start(test_ctx_t *ctx, peer_main_t run, const void *arg,
                  size_t size);
/* Sends a command; returns its answer. */
uint64_t peer_do(peer_t *p, char cmd);
/* Waits until it has ended (quit, exited or killed) and closes our ends
 * of its pipes; returns its wait status. */
int peer_wait(peer_t *p);
/* Tells it to quit ('Q') and checks that it exited with 0. */
void peer_quit(peer_t *p);

#ifdef _WIN32
/* The peer's side, in the runner started with --peer: reads the arg from
 * `in` and runs the function at `offset` in this program's image. */
_Noreturn void peer_serve(test_ctx_t *ctx, uintptr_t offset, int in, int out);
#endif

#endif /* VP_PEER_H */
