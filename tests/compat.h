/* What the tests use of POSIX, on Windows too. mingw-w64 brings most of
 * it (unistd.h, dirent.h, ftruncate, usleep; winpthreads' pthread.h,
 * clock_gettime and nanosleep); compat_win32.c adds the rest the tests
 * need: setenv and unsetenv, mkdtemp, pipe, pread and pwrite, page size,
 * anonymous private mmap, and dlopen for the CUDA tests' own driver
 * handle. Fork, signals and shared POSIX memory have no such stand-in:
 * tests that need them are TEST_EXCLUDED on Windows (test.h). */
#ifndef VP_TEST_COMPAT_H
#define VP_TEST_COMPAT_H

#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#ifdef _WIN32
#include <io.h>
#include <malloc.h>
#include <sys/utime.h>

#define O_CLOEXEC _O_NOINHERIT
#define mkdir(path, mode) mkdir(path) /* Windows folders have no mode */

int setenv(const char *name, const char *value, int overwrite);
int unsetenv(const char *name);
char *mkdtemp(char *tmpl);
int pipe(int fds[2]);
ssize_t pread(int fd, void *buf, size_t n, off_t off);
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off);

#define _SC_PAGESIZE 30
long sysconf(int name);

#define PROT_NONE 0
#define PROT_READ 1
#define PROT_WRITE 2
#define MAP_SHARED 0x01
#define MAP_PRIVATE 0x02
#define MAP_ANONYMOUS 0x20
#define MAP_FAILED ((void *)-1)
/* Anonymous private memory (VirtualAlloc), or a view of a file (shared, or
 * private: copy on write) at an offset of the allocation granularity. */
void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off);
int munmap(void *addr, size_t len);

#define RTLD_NOW 2
#define RTLD_LOCAL 0
#define RTLD_NODELETE 0x1000
void *dlopen(const char *name, int flags);
void *dlsym(void *lib, const char *symbol);
const char *dlerror(void);

/* The temporary folder ("C:\...\Temp"), without its trailing separator. */
const char *test_tmp_dir(void);

/* The runner's child processes (child_win32.c). The path of this program;
 * the test `full` ("sim/name") run as `self --child full` in a job object,
 * its output in a temporary file, within timeout_s seconds: the file, read
 * from its start, and in why "" when the child exited 0, else why not
 * ("exit 1", "timeout", "exception 0xc0000005"); NULL and why when it could
 * not start. In the child: a crash ends it with the exception's code, with
 * no debugger (Wine's) or error box. */
void test_self_exe(char *path, size_t len);
FILE *test_child_run(const char *self, const char *full, unsigned timeout_s,
                     char *why, size_t len);
void test_child_guard(void);

/* Peers (peer.c): this program's image base, and `self --peer args IN
 * OUT` started with two pipes, the peer's ends' handles in IN and OUT;
 * to and from get ours, pid its process id: 0, else -1. */
uintptr_t test_image_base(void);
int test_spawn_peer(const char *args, int *to, int *from, int *pid);

/* Processes as the tests treat them (child_win32.c): SIGKILL is
 * TerminateProcess, SIGSTOP and SIGCONT suspend and resume every thread;
 * waitpid's status is POSIX's (an exception reads as SIGSEGV), and with
 * WUNTRACED a suspended process reads as stopped at once. */
#define SIGKILL 9
#define SIGBUS 7 /* never: an access violation reads as SIGSEGV */
#define SIGCONT 18
#define SIGSTOP 19
#define WUNTRACED 2
#define WIFEXITED(s) (((s) & 0x7f) == 0)
#define WEXITSTATUS(s) (((s) >> 8) & 0xff)
#define WIFSIGNALED(s) (((s) & 0x7f) != 0 && ((s) & 0x7f) != 0x7f)
#define WTERMSIG(s) ((s) & 0x7f)
#define WIFSTOPPED(s) (((s) & 0xff) == 0x7f)
int kill(int pid, int sig);
int waitpid(int pid, int *status, int options);

/* C11's aligned_alloc, which msvcrt lacks; freed with its own call. */
static inline void *test_aligned_alloc(size_t align, size_t size) {
  return _aligned_malloc(size, align);
}
static inline void test_aligned_free(void *p) { _aligned_free(p); }
#else
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/wait.h>

static inline const char *test_tmp_dir(void) { return "/tmp"; }
static inline void *test_aligned_alloc(size_t align, size_t size) {
  return aligned_alloc(align, size);
}
static inline void test_aligned_free(void *p) { free(p); }
#endif

/* How many descriptors (Windows: handles) and threads this process has,
 * or -1: what a leak check compares before and after. */
int test_fd_count(void);
int test_thread_count(void);
/* The bytes of address space this process has reserved or mapped (Linux:
 * VmSize), or 0. */
uint64_t test_vm_size(void);

#endif /* VP_TEST_COMPAT_H */
