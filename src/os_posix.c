/* os.h on Linux: POSIX calls, and Linux's own where POSIX has none (futex,
 * /proc, cgroups, MADV_POPULATE_WRITE, /dev/shm). The only file of
 * libvpager that includes an OS header. */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "os.h"

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define OS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#include <sanitizer/tsan_interface.h>
#define OS_TSAN 1
#endif
#endif

/* Each opaque type of os.h holds the real one it stands for. */
#define HOLDS(box, real)                                                       \
  _Static_assert(sizeof(real) <= sizeof(box) &&                                \
                     _Alignof(real) <= _Alignof(box),                          \
                 #box " cannot hold a " #real)
HOLDS(vp__os_mutex_t, pthread_mutex_t);
HOLDS(vp__os_cond_t, pthread_cond_t);
HOLDS(vp__os_thread_t, pthread_t);
HOLDS(vp__os_once_t, pthread_once_t);
HOLDS(vp__os_plock_shared_t, pthread_mutex_t);

#define SHM_DIR "/dev/shm" /* where glibc's shm_open keeps its files */
#define CREATOR_WAIT_MS 250 /* an older build's creator between open and
                               sizing its segment */

#define MUTEX(m) ((pthread_mutex_t *)(void *)(m)->opaque)
#define COND(c) ((pthread_cond_t *)(void *)(c)->opaque)
#define THREAD(t) ((pthread_t *)(void *)(t)->opaque)
#define ONCE(o) ((pthread_once_t *)(void *)(o)->opaque)
#define PMUTEX(s) ((pthread_mutex_t *)(void *)(s)->opaque)

/* --------------------------------------------------- threads and locks */

int vp__os_mutex_init(vp__os_mutex_t *m) {
  return pthread_mutex_init(MUTEX(m), NULL);
}
void vp__os_mutex_destroy(vp__os_mutex_t *m) {
  pthread_mutex_destroy(MUTEX(m));
}
void vp__os_mutex_lock(vp__os_mutex_t *m) { pthread_mutex_lock(MUTEX(m)); }
void vp__os_mutex_unlock(vp__os_mutex_t *m) {
  pthread_mutex_unlock(MUTEX(m));
}

int vp__os_cond_init(vp__os_cond_t *c) {
  return pthread_cond_init(COND(c), NULL);
}
void vp__os_cond_destroy(vp__os_cond_t *c) { pthread_cond_destroy(COND(c)); }
void vp__os_cond_wait(vp__os_cond_t *c, vp__os_mutex_t *m) {
  pthread_cond_wait(COND(c), MUTEX(m));
}

/* timespec of CLOCK_REALTIME now + ns: pthread's absolute deadlines. */
static struct timespec realtime_after(uint64_t ns) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t t = (uint64_t)ts.tv_nsec + ns % 1000000000ull;
  ts.tv_sec += (time_t)(ns / 1000000000ull + t / 1000000000ull);
  ts.tv_nsec = (long)(t % 1000000000ull);
  return ts;
}

int vp__os_cond_timedwait(vp__os_cond_t *c, vp__os_mutex_t *m,
                          uint64_t timeout_ns) {
  if (timeout_ns == VP__OS_FOREVER) {
    vp__os_cond_wait(c, m);
    return 0;
  }
  struct timespec ts = realtime_after(timeout_ns);
  int r = pthread_cond_timedwait(COND(c), MUTEX(m), &ts);
  return r == ETIMEDOUT ? ETIMEDOUT : 0;
}
void vp__os_cond_signal(vp__os_cond_t *c) { pthread_cond_signal(COND(c)); }
void vp__os_cond_broadcast(vp__os_cond_t *c) {
  pthread_cond_broadcast(COND(c));
}

void vp__os_once(vp__os_once_t *o, void (*fn)(void)) {
  pthread_once(ONCE(o), fn);
}

int vp__os_thread_start(vp__os_thread_t *t, void *(*fn)(void *), void *arg,
                        unsigned flags) {
  sigset_t all, old;
  if (flags & VP__OS_THREAD_NO_SIGNALS) {
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
  }
  int e = pthread_create(THREAD(t), NULL, fn, arg);
  if (flags & VP__OS_THREAD_NO_SIGNALS) pthread_sigmask(SIG_SETMASK, &old, NULL);
  return e;
}

void vp__os_thread_join(vp__os_thread_t *t) { pthread_join(*THREAD(t), NULL); }

/* ------------------------------------------------------- time and sleep */

static uint64_t clock_ns(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t vp__os_now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }
uint64_t vp__os_coarse_ns(void) { return clock_ns(CLOCK_MONOTONIC_COARSE); }
uint64_t vp__os_realtime_ns(void) { return clock_ns(CLOCK_REALTIME); }

void vp__os_sleep_ns(uint64_t ns) {
  struct timespec ts = {(time_t)(ns / 1000000000ull),
                        (long)(ns % 1000000000ull)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* ------------------------------------------------------- the machine */

size_t vp__os_page_size(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? (size_t)p : 4096;
}

unsigned vp__os_cpu_count(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (unsigned)n : 1;
}

/* A small file (a /proc or /sys one): its first len - 1 bytes,
 * NUL-terminated, read until its end (a /proc file may come in pieces).
 * The bytes read, or -1. */
static ssize_t read_small(const char *path, char *buf, size_t len) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  ssize_t n = fd < 0 ? -1 : 0;
  while (fd >= 0 && (size_t)n < len - 1) {
    ssize_t got = read(fd, buf + n, len - 1 - (size_t)n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      if (got < 0 && n == 0) n = -1;
      break;
    }
    n += got;
  }
  if (fd >= 0) close(fd);
  buf[n > 0 ? n : 0] = '\0';
  return n;
}

/* "MemTotal:" or "MemAvailable:" of /proc/meminfo in bytes, 0 unknown. */
static uint64_t meminfo(const char *key) {
  char buf[4096];
  char *p = read_small("/proc/meminfo", buf, sizeof buf) > 0
                ? strstr(buf, key)
                : NULL;
  return p ? strtoull(p + strlen(key), NULL, 10) * 1024 : 0;
}

uint64_t vp__os_ram_total(void) {
  uint64_t ram = meminfo("MemTotal:");
  if (ram) return ram;
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  return pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
}

uint64_t vp__os_ram_available(void) { return meminfo("MemAvailable:"); }

/* A number from a file holding one ("max" and unreadable: 0). */
static uint64_t file_u64(const char *path) {
  char buf[64];
  if (read_small(path, buf, sizeof buf) <= 0 || buf[0] < '0' || buf[0] > '9')
    return 0;
  return strtoull(buf, NULL, 10);
}

/* The lowest limit in `file` of the cgroup at `path` under `mount` and of
 * its ancestors (a parent's limit binds its children too); 0 = none. */
static uint64_t cgroup_walk(const char *mount, char *path, const char *file) {
  char full[700];
  uint64_t low = 0;
  for (;;) {
    snprintf(full, sizeof full, "%s%s/%s", mount, path, file);
    uint64_t lim = file_u64(full);
    if (lim && (!low || lim < low)) low = lim;
    char *slash = strrchr(path, '/');
    if (!slash) break;
    *slash = '\0'; /* the parent; "" is the mount itself */
  }
  return low;
}

/* /proc/self/cgroup's room: a v1 host lists a line per controller, each
 * with the container's path (~150 bytes under Kubernetes). */
#define CGROUP_FILE_BYTES 16384

/* From /proc/self/cgroup: v2 ("0::<path>", memory.max) and v1 (a "memory"
 * controller line, memory.limit_in_bytes, which says a huge number for
 * "none": 2^63 rounded down to a page, taken as none from 2^60 up). */
uint64_t vp__os_memory_limit(void) {
  char buf[CGROUP_FILE_BYTES];
  ssize_t n = read_small("/proc/self/cgroup", buf, sizeof buf);
  uint64_t low = 0;
  for (char *line = n > 0 ? buf : NULL, *next; line && *line; line = next) {
    next = strchr(line, '\n');
    if (next) *next++ = '\0';
    char *ctl = strchr(line, ':'), *path = ctl ? strchr(ctl + 1, ':') : NULL;
    if (!path || path[1] != '/') continue;
    *path++ = '\0';
    ctl++;
    uint64_t lim = 0;
    if (strcmp(line, "0") == 0 && !*ctl)
      lim = cgroup_walk("/sys/fs/cgroup", path, "memory.max");
    else if (strstr(ctl, "memory"))
      lim = cgroup_walk("/sys/fs/cgroup/memory", path,
                        "memory.limit_in_bytes");
    if (lim && lim < (1ull << 60) && (!low || lim < low)) low = lim;
  }
  return low;
}

bool vp__os_cgroup_path(char *out, size_t len) {
  char buf[CGROUP_FILE_BYTES];
  ssize_t n = read_small("/proc/self/cgroup", buf, sizeof buf);
  for (char *line = n > 0 ? buf : NULL, *next; line && *line; line = next) {
    next = strchr(line, '\n');
    if (next) *next++ = '\0';
    if (strncmp(line, "0::", 3) != 0) continue;
    int w = snprintf(out, len, "/sys/fs/cgroup%s", line + 3);
    return w > 0 && (size_t)w < len;
  }
  return false;
}

bool vp__os_gpu_wddm(void) { return access("/dev/dxg", F_OK) == 0; }

int vp__os_strcasecmp(const char *a, const char *b) {
  return strcasecmp(a, b);
}

/* ----------------------------------------------------------- processes */

int32_t vp__os_pid(void) { return (int32_t)getpid(); }
uint32_t vp__os_uid(void) { return (uint32_t)geteuid(); }

/* Field 22 of /proc/<pid>/stat: when the process started (clock ticks
 * since boot). 1: found; 0: no such process, or a zombie (dead, not yet
 * waited for); -1: unreadable (hidden /proc). */
static int proc_start(int32_t pid, uint64_t *start) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? 0 : -1;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return n == 0 ? 0 : -1;
  buf[n] = '\0';
  char *p = strrchr(buf, ')'); /* the command may hold spaces and ')' */
  if (!p || p[1] != ' ') return -1;
  p += 2;
  if (*p == 'Z' || *p == 'X') return 0;
  for (int field = 3; field < 22; field++) {
    p = strchr(p, ' ');
    if (!p) return -1;
    p++;
  }
  *start = strtoull(p, NULL, 10);
  return 1;
}

/* Read once: every liveness check compares with it. */
static uint64_t own_pidns(void) {
  static _Atomic uint64_t ns;
  uint64_t v = atomic_load_explicit(&ns, memory_order_relaxed);
  if (v) return v;
  struct stat st;
  v = stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
  atomic_store_explicit(&ns, v, memory_order_relaxed);
  return v;
}

void vp__os_proc_self(uint64_t *start, uint64_t *pidns) {
  if (start && proc_start((int32_t)getpid(), start) != 1) *start = 0;
  *pidns = own_pidns();
}

bool vp__os_pid_exists(int32_t pid) {
  return pid > 0 && !(kill(pid, 0) != 0 && errno == ESRCH);
}

/* Where /proc is hidden, kill(2) decides. */
bool vp__os_proc_alive(int32_t pid, uint64_t start, uint64_t pidns) {
  uint64_t now = 0;
  if (pidns != own_pidns()) return true;
  if (!vp__os_pid_exists(pid)) return false;
  int found = proc_start(pid, &now);
  if (found < 0) return true;
  return found && (start == 0 || now == start);
}

void vp__os_proc_command(char *out, size_t len) {
  if (!len) return;
  int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
  ssize_t n = fd < 0 ? -1 : read(fd, out, len - 1);
  if (fd >= 0) close(fd);
  if (n <= 0) n = 0;
  out[n] = '\0';
  for (ssize_t i = 0; i < n; i++) /* NULs between the arguments */
    if (out[i] == '\0') out[i] = i + 1 < n ? ' ' : '\0';
}

/* ------------------------------------------------------ virtual memory */

int vp__os_vm_reserve(size_t size, size_t align, void **p) {
  size_t page = vp__os_page_size();
  size_t slack = align > page ? align : 0;
  if (!size || size + slack < size) return ENOMEM;
  char *m = mmap(NULL, size + slack, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return errno;
  if (slack) { /* trim to an aligned [a, a+size) */
    char *a = (char *)(((uintptr_t)m + slack - 1) & ~(uintptr_t)(slack - 1));
    if (a > m) munmap(m, (size_t)(a - m));
    if (a + size < m + size + slack)
      munmap(a + size, (size_t)(m + size + slack - (a + size)));
    m = a;
  }
  *p = m;
  return 0;
}

int vp__os_vm_commit(void *p, size_t size) {
  return mprotect(p, size, PROT_READ | PROT_WRITE) ? errno : 0;
}

/* Access goes first, so a racing touch faults rather than reading dropped
 * (zeroed) data. */
int vp__os_vm_decommit(void *p, size_t size) {
  int e = mprotect(p, size, PROT_NONE) ? errno : 0;
  if (madvise(p, size, MADV_DONTNEED) && !e) e = errno;
  return e;
}

int vp__os_vm_release(void *p, size_t size) {
  return munmap(p, size) ? errno : 0;
}

int vp__os_vm_alloc(size_t size, void **p) {
  void *m = mmap(NULL, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return errno;
  *p = m;
  return 0;
}

void vp__os_vm_free(void *p, size_t size) { munmap(p, size); }

void vp__os_vm_hint_huge(void *p, size_t size) {
  (void)madvise(p, size, MADV_HUGEPAGE); /* THP may be off */
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

int vp__os_vm_populate(void *p, size_t size) {
  while (madvise(p, size, MADV_POPULATE_WRITE) != 0) {
    if (errno == EINTR || errno == EAGAIN) continue;
    if (errno != EINVAL) return errno; /* ENOMEM: no memory to have */
    size_t pg = vp__os_page_size(); /* older kernels: a write per page */
    for (size_t o = 0; o < size; o += pg) ((volatile char *)p)[o] = 0;
    break;
  }
  return 0;
}

int vp__os_vm_discard(void *p, size_t size) {
  return madvise(p, size, MADV_DONTNEED) ? errno : 0; /* private: zeros */
}

/* Both views become one shared mapping's: a's bytes are copied into it,
 * then it is mapped over a and over b (mremap of a shared mapping with
 * old size 0 maps the same pages again). */
int vp__os_vm_share(void *a, void *b, size_t size) {
  char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                 -1, 0);
  if (m == MAP_FAILED) return errno;
  memcpy(m, a, size);
  int e = 0;
  if (mremap(m, 0, size, MREMAP_MAYMOVE | MREMAP_FIXED, a) != a) {
    e = errno;
  } else if (mremap(m, 0, size, MREMAP_MAYMOVE | MREMAP_FIXED, b) != b) {
    e = errno; /* a back to memory of its own, as it was */
    if (mmap(a, size, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == a)
      memcpy(a, m, size);
  }
  munmap(m, size);
  return e;
}

bool vp__os_vm_can_share(void) { return true; }

int vp__os_vm_unshare(void *p, size_t size) {
  void *m = mmap(p, size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return m == p ? 0 : errno;
}

/* --------------------------------------------------------------- files */

int vp__os_file_open_read(const char *path, int *fd) {
  int f = open(path, O_RDONLY | O_CLOEXEC);
  if (f < 0) return errno;
  *fd = f;
  return 0;
}

int vp__os_file_dup(intptr_t os_handle, int *fd) {
  *fd = -1;
  if (os_handle < 0 || os_handle > INT_MAX) return EBADF;
  int f = fcntl((int)os_handle, F_DUPFD_CLOEXEC, 0);
  if (f < 0) return errno;
  *fd = f;
  return 0;
}

void vp__os_file_close(int fd) { close(fd); }

int vp__os_file_stat(int fd, vp__os_file_info_t *info) {
  struct stat sb;
  if (fstat(fd, &sb) != 0) return errno;
  info->size = (uint64_t)sb.st_size;
  info->mtime_ns = (uint64_t)sb.st_mtim.tv_sec * 1000000000ull +
                   (uint64_t)sb.st_mtim.tv_nsec;
  info->regular = S_ISREG(sb.st_mode);
  return 0;
}

int vp__os_file_read_at(int fd, void *buf, size_t n, uint64_t off,
                        size_t *got) {
  for (;;) {
    ssize_t r = pread(fd, buf, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    *got = (size_t)r;
    return 0;
  }
}

int vp__os_file_map(int fd, uint64_t size, const void **p) {
  if (size > SIZE_MAX) return ENOMEM;
  void *m = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return errno;
  *p = m;
  return 0;
}

void vp__os_file_unmap(const void *p, uint64_t size) {
  munmap((void *)(uintptr_t)p, (size_t)size);
}

int vp__os_file_map_drop(const void *p, uint64_t size) {
  return madvise((void *)(uintptr_t)p, (size_t)size, MADV_DONTNEED) ? errno
                                                                    : 0;
}

int vp__os_file_drop_cache(int fd) {
  return posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
}

/* /proc/self/pagemap: a u64 a page; bit 63 present, 62 swapped, 61 a file
 * page (or shared anonymous). A present page that is no file page, or a
 * swapped one, is a copy the process wrote. */
#define PM_PRESENT (1ull << 63)
#define PM_SWAPPED (1ull << 62)
#define PM_FILE (1ull << 61)

int vp__os_drop_unwritten(const void *p, uint64_t size) {
  int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  uint64_t page = vp__os_page_size(), first = (uintptr_t)p / page;
  uint64_t n = size / page, ent[512];
  int rc = 0;
  for (uint64_t i = 0; i < n && !rc;) {
    size_t want = (size_t)(n - i < 512 ? n - i : 512) * sizeof *ent;
    ssize_t got = pread(fd, ent, want, (off_t)((first + i) * sizeof *ent));
    if (got <= 0) {
      rc = got < 0 ? errno : EIO;
      break;
    }
    for (size_t k = 0; k < (size_t)got / sizeof *ent; k++)
      if ((ent[k] & PM_SWAPPED) ||
          ((ent[k] & PM_PRESENT) && !(ent[k] & PM_FILE)))
        rc = EBUSY;
    i += (uint64_t)got / sizeof *ent;
  }
  close(fd);
  return rc ? rc : vp__os_file_map_drop(p, size);
}

/* One line of /proc/self/maps ("lo-hi perms offset dev inode path") as a
 * file mapping; false for anonymous memory, pseudo-files ("[heap]") and a
 * path too long. */
static bool mapping_of_line(const char *line, vp__os_mapping_t *m) {
  unsigned long long lo, hi, off, ino;
  char perms[8];
  int at = 0;
  if (sscanf(line, "%llx-%llx %7s %llx %*s %llu %n", &lo, &hi, perms, &off,
             &ino, &at) < 5 || at == 0 || ino == 0 || line[at] != '/')
    return false;
  size_t n = strcspn(line + at, "\n");
  if (n >= sizeof m->path || strlen(perms) < 4) return false;
  memcpy(m->path, line + at, n);
  m->path[n] = '\0';
  m->start = lo;
  m->size = hi - lo;
  m->file_offset = off;
  m->file_id = ino;
  m->writable = perms[1] == 'w';
  m->private_ = perms[3] == 'p';
  return true;
}

int vp__os_file_mappings(bool written,
                         bool (*fn)(const vp__os_mapping_t *m, void *ctx),
                         void *ctx) {
  FILE *f = written ? fopen("/proc/self/smaps", "re") : NULL;
  if (!f) f = fopen("/proc/self/maps", "re"), written = false;
  if (!f) return errno;
  char line[sizeof ((vp__os_mapping_t *)0)->path + 256];
  vp__os_mapping_t m;
  bool whole = true;  /* the buffer holds a line from its start */
  bool have = false;  /* m is a file mapping not given yet */
  bool go = true;
  unsigned long long lo, hi, kb;
  while (go && fgets(line, sizeof line, f)) {
    bool start = whole;
    whole = strchr(line, '\n') != NULL;
    if (!start) continue;
    if (sscanf(line, "%llx-%llx ", &lo, &hi) == 2) { /* a mapping's line */
      if (have) go = fn(&m, ctx);
      have = mapping_of_line(line, &m) && whole;
      if (have) m.written = m.private_ && !written; /* unknown: written */
      if (have && !written) go = fn(&m, ctx), have = false;
    } else if (have && sscanf(line, "Anonymous: %llu", &kb) == 1) {
      m.written = m.private_ && kb > 0;
    }
  }
  if (go && have) fn(&m, ctx);
  fclose(f);
  return 0;
}

/* ------------------------------------------------- dynamic libraries */

/* RTLD_NODELETE: a driver registers atexit handlers and threads; dlclose
 * only drops a reference. */
void *vp__os_dl_open(const char *name, char *why, size_t len) {
  void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!lib && len) {
    const char *e = dlerror();
    snprintf(why, len, "%s", e ? e : "dlopen failed");
  }
  return lib;
}

void *vp__os_dl_sym(void *lib, const char *symbol) {
  return dlsym(lib, symbol);
}

void vp__os_dl_close(void *lib) { dlclose(lib); }

/* ------------------------------------------------ named shared memory */

/* The file behind a shm_open name. */
static void shm_path(char *out, size_t len, const char *name) {
  snprintf(out, len, SHM_DIR "%s", name);
}

/* Create `name` exclusively, sized (posix_fallocate, not ftruncate: a
 * full /dev/shm fails here, not with SIGBUS at a later touch), mapped and
 * initialised; removed again on failure. */
static int shm_make(const char *name, size_t size,
                    int (*init)(void *, void *), void *arg, void **base) {
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  void *p = MAP_FAILED;
  int e = posix_fallocate(fd, 0, (off_t)size);
  if (!e) p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (!e && p == MAP_FAILED) e = errno;
  close(fd);
  if (!e && init) e = init(p, arg);
  if (e) {
    if (p != MAP_FAILED) munmap(p, size);
    shm_unlink(name);
    return e;
  }
  *base = p;
  return 0;
}

#define TMP_TRIES 64 /* temporary names a killed creator left behind */

/* Made whole under a name nobody opens, then linked to its name: link(2)
 * fails if the name exists, so creation stays exclusive, and the name never
 * shows a half-made segment (a creator killed midway leaves only its
 * temporary file, which nothing reads). Where /dev/shm takes no hard
 * links, it is made in place, as before. */
int vp__os_shm_create(const char *name, size_t size,
                      int (*init)(void *base, void *arg), void *arg,
                      void **base) {
  static _Atomic unsigned serial;
  char tmp[64], from[96], to[320];
  void *p = NULL;
  int e = EEXIST;
  for (int i = 0; e == EEXIST && i < TMP_TRIES; i++) {
    snprintf(tmp, sizeof tmp, "/.vpager-new-%d-%u", (int)getpid(),
             atomic_fetch_add(&serial, 1));
    e = shm_make(tmp, size, init, arg, &p);
  }
  if (e) return e == EEXIST ? EAGAIN : e;
  shm_path(from, sizeof from, tmp);
  shm_path(to, sizeof to, name);
  e = link(from, to) ? errno : 0;
  shm_unlink(tmp);
  if (!e) *base = p;
  else munmap(p, size);
  if (e == EPERM || e == EOPNOTSUPP || e == EXDEV || e == ENOSYS)
    e = shm_make(name, size, init, arg, base);
  return e;
}

/* The file's stat once its creator has sized it: an older build's creator
 * sized it after the name appeared. */
static int stat_sized(int fd, struct stat *st) {
  for (int i = 0;; i++) {
    if (fstat(fd, st)) return errno;
    if (st->st_size != 0 || i == CREATOR_WAIT_MS) return 0;
    vp__os_sleep_ns(1000000);
  }
}

int vp__os_shm_open(const char *name, bool writable, size_t size,
                    void **base, vp__os_shm_info_t *info) {
  int fd = shm_open(name, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0);
  if (fd < 0) return errno;
  struct stat st;
  int e = stat_sized(fd, &st);
  void *p = MAP_FAILED;
  if (!e && info) *info = (vp__os_shm_info_t){(uint64_t)st.st_size,
                                              (uint32_t)st.st_uid};
  if (!e && writable && st.st_uid != geteuid()) e = EPERM;
  else if (!e && st.st_size != (off_t)size) e = EMSGSIZE;
  if (!e) {
    p = mmap(NULL, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED,
             fd, 0);
    if (p == MAP_FAILED) e = errno;
  }
  close(fd);
  if (!e) *base = p;
  return e;
}

void vp__os_shm_unmap(void *base, size_t size) { munmap(base, size); }

void vp__os_shm_unlink(const char *name) { shm_unlink(name); }

int vp__os_shm_list(const char *prefix, void (*each)(const char *name,
                                                     void *arg),
                    void *arg) {
  DIR *d = opendir(SHM_DIR);
  if (!d) return errno;
  size_t plen = strlen(prefix);
  for (struct dirent *e; (e = readdir(d));)
    if (strncmp(e->d_name, prefix, plen) == 0) each(e->d_name, arg);
  closedir(d);
  return 0;
}

/* ----------------------------------- waits on a word of shared memory */

/* Not FUTEX_PRIVATE: the waker may be another process. */
int vp__os_word_wait(const char *shm, const void *base,
                     _Atomic uint32_t *word, uint32_t seen,
                     uint64_t timeout_ns) {
  (void)shm;
  (void)base;
  struct timespec ts = {(time_t)(timeout_ns / 1000000000ull),
                        (long)(timeout_ns % 1000000000ull)};
  long r = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen,
                   timeout_ns == VP__OS_FOREVER ? NULL : &ts, NULL, 0);
  return r != 0 && errno == ETIMEDOUT ? ETIMEDOUT : 0;
}

void vp__os_word_wake(const char *shm, const void *base,
                      _Atomic uint32_t *word) {
  (void)shm;
  (void)base;
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* ------------------------------- the lock of a shared segment, robust */

int vp__os_plock_init(vp__os_plock_shared_t *s) {
  pthread_mutexattr_t a;
  int r = pthread_mutexattr_init(&a);
  if (r) return r;
  r = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  if (!r) r = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  if (!r) r = pthread_mutex_init(PMUTEX(s), &a);
  pthread_mutexattr_destroy(&a);
  return r;
}

int vp__os_plock_open(vp__os_plock_t *l, const char *shm,
                      vp__os_plock_shared_t *s) {
  (void)shm;
  *l = (vp__os_plock_t){s, NULL};
  return 0;
}

void vp__os_plock_close(vp__os_plock_t *l) { l->shared = NULL; }

/* Whether the lock word's kind (glibc: type, robust, shared and protocol
 * bits) is the one vp__os_plock_init makes. Another (a priority protocol
 * with a bogus ceiling, in a corrupt segment) has glibc abort the process
 * inside pthread_mutex_trylock, so such a lock is never used. Not checked
 * with other C libraries. */
static bool plock_kind_ok(pthread_mutex_t *m) {
#ifdef __GLIBC__
  static _Atomic int want; /* 0 until made once */
  int k = atomic_load_explicit(&want, memory_order_relaxed);
  if (!k) {
    vp__os_plock_shared_t made;
    if (vp__os_plock_init(&made)) return true; /* cannot tell */
    k = PMUTEX(&made)->__data.__kind;
    pthread_mutex_destroy(PMUTEX(&made));
    atomic_store_explicit(&want, k, memory_order_relaxed);
  }
  return __atomic_load_n(&m->__data.__kind, __ATOMIC_RELAXED) == k;
#else
  (void)m;
  return true;
#endif
}

int vp__os_plock_lock(vp__os_plock_t *l, uint32_t timeout_ms) {
  pthread_mutex_t *m = PMUTEX(l->shared);
  if (!plock_kind_ok(m)) return EINVAL;
  int r;
  if (!timeout_ms) {
    r = pthread_mutex_trylock(m);
  } else {
    struct timespec ts = realtime_after((uint64_t)timeout_ms * 1000000ull);
    r = pthread_mutex_timedlock(m, &ts);
  }
  if (r == EOWNERDEAD) {
    pthread_mutex_consistent(m); /* still ours */
#ifdef OS_TSAN
    /* ThreadSanitizer's timedlock records a lock only when it returns 0:
     * told of this one, it does not call our unlock a wrong thread's. */
    if (timeout_ms) {
      __tsan_mutex_pre_lock(m, __tsan_mutex_try_lock);
      __tsan_mutex_post_lock(m, __tsan_mutex_try_lock, 0);
    }
#endif
  }
  return r;
}

void vp__os_plock_unlock(vp__os_plock_t *l) {
  pthread_mutex_unlock(PMUTEX(l->shared));
}
