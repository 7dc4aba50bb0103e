/* The one door to the operating system (DESIGN.md §11): every thread,
 * lock, wait, shared-memory segment, file read, mapping, library load,
 * clock and process question of libvpager goes through here. Two
 * implementations: os_posix.c (Linux; POSIX where it suffices) and
 * os_win32.c. Nothing else in src/ includes an OS header, so this header
 * includes none either: the types that other structs embed are opaque,
 * aligned storage that each implementation proves (_Static_assert) big
 * enough for its real type.
 *
 * Rules for every function here, written once (as mimalloc's prim.h does):
 *   - A result of type int is 0 on success, else a positive errno value
 *     (<errno.h>'s POSIX names: ENOENT, EEXIST, EACCES, ENOMEM, ETIMEDOUT,
 *     ...; Win32 maps its errors onto them). strerror() words it; callers
 *     add what they were doing. Exceptions say so.
 *   - Nothing aborts, prints or logs: the layer above decides what an error
 *     means. Arguments are the caller's to get right (this is the bottom
 *     layer, called only by vpager's own code), except where noted.
 *   - Sizes of mappings and reservations are whole pages
 *     (vp__os_page_size()) unless noted.
 *   - A "file" is an int descriptor: a POSIX fd, or a C-runtime fd on
 *     Windows (_open; _get_osfhandle gives its HANDLE), as the public API's
 *     `int fd` already is. */
#ifndef VPAGER_OS_H
#define VPAGER_OS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define VP__OS_FOREVER UINT64_MAX /* a timeout that never runs out */

/* A printf-like function, for the compiler's format checks. vpager's
 * formats are C99's (%zu, %llu); mingw-w64 takes `printf` to mean
 * Microsoft's, so it checks gnu_printf there (and prints with its ANSI
 * stdio); clang before 15 knows no gnu_printf; MSVC checks nothing. */
#if defined(__MINGW32__)
#define VP__PRINTF(fmt, args) __attribute__((format(gnu_printf, fmt, args)))
#elif defined(__GNUC__)
#define VP__PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define VP__PRINTF(fmt, args)
#endif

/* --------------------------------------------------- threads and locks */

/* pthread_mutex_t (40 bytes on x86-64 glibc, 48 on arm64, 64 on macOS),
 * SRWLOCK (a pointer). All-zero storage is an unlocked mutex on both
 * (PTHREAD_MUTEX_INITIALIZER on glibc and musl; SRWLOCK_INIT), so a static
 * one needs no init: VP__OS_MUTEX_INIT. */
typedef struct vp__os_mutex {
  _Alignas(8) unsigned char opaque[64];
} vp__os_mutex_t;
#define VP__OS_MUTEX_INIT {{0}}
/* pthread_cond_t (48 bytes), CONDITION_VARIABLE (a pointer). */
typedef struct vp__os_cond {
  _Alignas(8) unsigned char opaque[64];
} vp__os_cond_t;
/* pthread_t, or a thread HANDLE with its function and argument. */
typedef struct vp__os_thread {
  _Alignas(8) unsigned char opaque[32];
} vp__os_thread_t;
/* pthread_once_t, INIT_ONCE: all-zero storage is "not run yet". */
typedef struct vp__os_once {
  _Alignas(8) unsigned char opaque[8];
} vp__os_once_t;
#define VP__OS_ONCE_INIT {{0}}

int vp__os_mutex_init(vp__os_mutex_t *m); /* ENOMEM, ... */
void vp__os_mutex_destroy(vp__os_mutex_t *m);
void vp__os_mutex_lock(vp__os_mutex_t *m);
void vp__os_mutex_unlock(vp__os_mutex_t *m);

int vp__os_cond_init(vp__os_cond_t *c);
void vp__os_cond_destroy(vp__os_cond_t *c);
void vp__os_cond_wait(vp__os_cond_t *c, vp__os_mutex_t *m);
/* 0 when signalled (or spuriously woken), ETIMEDOUT after timeout_ns. */
int vp__os_cond_timedwait(vp__os_cond_t *c, vp__os_mutex_t *m,
                          uint64_t timeout_ns);
void vp__os_cond_signal(vp__os_cond_t *c);
void vp__os_cond_broadcast(vp__os_cond_t *c);

void vp__os_once(vp__os_once_t *o, void (*fn)(void));

/* Thread-local storage is C11's _Thread_local; no call here. */
enum {
  /* The thread gets no asynchronous signals (POSIX: all blocked while it
   * starts, so it inherits the full mask): a service thread that sleeps
   * for the process's lifetime must not take the application's signals. */
  VP__OS_THREAD_NO_SIGNALS = 1u << 0,
};
int vp__os_thread_start(vp__os_thread_t *t, void *(*fn)(void *), void *arg,
                        unsigned flags);
void vp__os_thread_join(vp__os_thread_t *t); /* fn's result is dropped */

/* ------------------------------------------------------- time and sleep */

uint64_t vp__os_now_ns(void);    /* monotonic: for deadlines */
uint64_t vp__os_coarse_ns(void); /* monotonic, ms resolution, cheap: stamps
                                    compared across processes */
uint64_t vp__os_realtime_ns(void); /* since 1970 */
void vp__os_sleep_ns(uint64_t ns);

/* ------------------------------------------------------- the machine */

size_t vp__os_page_size(void);
unsigned vp__os_cpu_count(void); /* online CPUs, at least 1 */
/* Physical RAM in bytes; 0 unknown. */
uint64_t vp__os_ram_total(void);
/* RAM available without swapping (Linux: MemAvailable); 0 unknown. */
uint64_t vp__os_ram_available(void);
/* The lowest memory limit over this process's control group and its
 * ancestors (Linux cgroup v2 memory.max or v1 memory.limit_in_bytes; a
 * Win32 job object's limit), bytes; 0 = none. */
uint64_t vp__os_memory_limit(void);
/* Linux: "/sys/fs/cgroup" + this process's cgroup v2 path; false without
 * one (and always on Windows). NVML's limits are asked per cgroup. */
bool vp__os_cgroup_path(char *out, size_t len);

/* Whether the GPUs are driven through Windows' WDDM, which spills to system
 * memory when a card is full and serves the desktop from it: Windows, and
 * Linux under WSL2 (/dev/dxg). */
bool vp__os_gpu_wddm(void);

/* ASCII case-insensitive comparison (strcasecmp, _stricmp). */
int vp__os_strcasecmp(const char *a, const char *b);

/* ----------------------------------------------------------- processes */

int32_t vp__os_pid(void);
uint32_t vp__os_uid(void); /* effective user id; 0 on Windows */
/* What tells this process apart from a later one with its pid: its start
 * time (Linux: field 22 of /proc/<pid>/stat; Win32: its creation time),
 * 0 when unknown; and its pid namespace (Linux: the inode of
 * /proc/self/ns/pid; 0 unknown; Win32: 1). start may be NULL (the pid
 * namespace alone is cheap). */
void vp__os_proc_self(uint64_t *start, uint64_t *pidns);
/* Whether the process `pid` that started at `start` (0: any start) is
 * alive, as seen from here: false only when it is known gone (no such pid,
 * a zombie, or another start time: a recycled pid). A pid of another pid
 * namespace means nothing here: true (its own namespace reaps it).
 * Unknowable (a hidden /proc): true. */
bool vp__os_proc_alive(int32_t pid, uint64_t start, uint64_t pidns);
/* Only whether some process has that pid (kill(pid, 0) is not ESRCH). */
bool vp__os_pid_exists(int32_t pid);
/* This process's command line, arguments joined by spaces, cut to fit;
 * "" when unknown. */
void vp__os_proc_command(char *out, size_t len);

/* ------------------------------------------------------ virtual memory */

/* Address space with no access and no commit charge, aligned to `align`
 * (a power of two, 0 or a page: any page). Released whole only. */
int vp__os_vm_reserve(size_t size, size_t align, void **p);
/* Make pages of a reservation readable and writable (zero-filled when
 * new). ENOMEM: the commit limit or the kernel's mapping count. */
int vp__os_vm_commit(void *p, size_t size);
/* No access again and the pages' memory dropped (their contents lost;
 * a later commit gives zeros). */
int vp__os_vm_decommit(void *p, size_t size);
int vp__os_vm_release(void *p, size_t size); /* a whole reservation */
/* Reserved and committed at once: page-aligned, zeroed, read-write. */
int vp__os_vm_alloc(size_t size, void **p);
void vp__os_vm_free(void *p, size_t size);
/* Hints, with no result: back [p, p+size) with huge pages where the OS
 * does that (Linux THP); fault in committed pages now, writably, over the
 * calling thread (it writes to each page where the OS has no such call). */
void vp__os_vm_hint_huge(void *p, size_t size);
/* 0, or ENOMEM where the OS says the memory is not there (Linux's
 * MADV_POPULATE_WRITE; writing pages cannot tell). */
int vp__os_vm_populate(void *p, size_t size);
/* Committed pages' memory dropped, the pages left read-write: zeros when
 * next read (Windows: decommitted and committed again). */
int vp__os_vm_discard(void *p, size_t size);
/* [b, +size) shows the memory of [a, +size) too, read-write, a's bytes
 * kept: both committed ranges of reservations, page-aligned. ENOSYS where
 * the OS cannot map memory twice (Windows here). */
int vp__os_vm_share(void *a, void *b, size_t size);
bool vp__os_vm_can_share(void);
/* A range vp__os_vm_share made: no access, its own view dropped (the
 * other one keeps the memory while it lasts). */
int vp__os_vm_unshare(void *p, size_t size);

/* --------------------------------------------------------------- files */

int vp__os_file_open_read(const char *path, int *fd); /* close-on-exec */
void vp__os_file_close(int fd);
/* A new fd of this runtime for an OS file handle (an fd on POSIX, a
 * HANDLE on Windows), duplicated: 0 or an errno. */
int vp__os_file_dup(intptr_t os_handle, int *fd);
typedef struct vp__os_file_info {
  uint64_t size;
  uint64_t mtime_ns; /* last modified, ns since 1970: a change check */
  bool regular;      /* a regular file (not a pipe, device, ...) */
} vp__os_file_info_t;
int vp__os_file_stat(int fd, vp__os_file_info_t *info);
/* One read of up to n bytes at `off` (pread; interrupted reads retried):
 * 0 with *got bytes, *got == 0 at the end of the file. */
int vp__os_file_read_at(int fd, void *buf, size_t n, uint64_t off,
                        size_t *got);
/* The file's first `size` bytes mapped read-only, shared with the page
 * cache. */
int vp__os_file_map(int fd, uint64_t size, const void **p);
void vp__os_file_unmap(const void *p, uint64_t size);
/* Drop a file mapping's resident pages (they are read again when next
 * touched), then the file's cached pages (a hint where the OS has one). */
int vp__os_file_map_drop(const void *p, uint64_t size);
int vp__os_file_drop_cache(int fd);
/* Drop the resident pages of [p, +size) of a read-only file mapping, as
 * vp__os_file_map_drop, unless one of them is no longer the file's (a
 * private mapping's page copied on a write before it was made read-only):
 * EBUSY then, and nothing is dropped. Linux reads /proc/self/pagemap for
 * that; Windows only trims the working set, which loses nothing. */
int vp__os_drop_unwritten(const void *p, uint64_t size);

/* One file mapping of this process: [start, +size) shows the file at path
 * (UTF-8) from file_offset on; file_id tells files apart (Linux: the
 * inode; Windows: the file index). */
typedef struct vp__os_mapping {
  uint64_t start, size, file_offset, file_id;
  bool writable;  /* the process may write to it */
  bool private_;  /* copy on write: what it writes leaves the file alone */
  bool written;   /* private, and some page of it is the process's copy
                     (asked for; unknown counts as written) */
  char path[1024];
} vp__os_mapping_t;
/* fn(m, ctx) for each file mapping of this process, in address order,
 * until it returns false: 0, or an errno (none readable). Linux: the
 * lines of /proc/self/maps with an inode and an absolute path (with
 * `written`, of /proc/self/smaps: its Anonymous bytes). Windows: the
 * views of files (a view's file offset is not told: only views that show
 * the file from its start are given; a written copy-on-write page turns
 * read-write). A path too long for `path` is left out. Without `written`,
 * m->written is unknown (true for a private mapping). */
int vp__os_file_mappings(bool written,
                         bool (*fn)(const vp__os_mapping_t *m, void *ctx),
                         void *ctx);

/* ------------------------------------------------- dynamic libraries */

/* Load a shared library by file name (found the OS's way), resolved now,
 * its symbols kept to itself, never unloaded for good (a driver's atexit
 * handlers must not outlive its code): NULL and the loader's words in
 * `why`. */
void *vp__os_dl_open(const char *name, char *why, size_t len);
void *vp__os_dl_sym(void *lib, const char *symbol); /* NULL: not there */
void vp__os_dl_close(void *lib); /* drops a reference */

/* ------------------------------------------------ named shared memory */

/* Names begin with '/' and hold no other '/' (POSIX's rule; Win32 maps
 * them into its "Local\" namespace). */

/* Create `name` exclusively: `size` bytes, zeroed, mapped read-write, and
 * init(base, arg) run (when given; its nonzero result undoes it all and is
 * returned) before another process can open it where the OS allows (POSIX:
 * made under a temporary name and linked into place, so no one ever opens
 * a half-made or 0-byte segment, even of a creator killed midway).
 * EEXIST: it exists. ENOSPC/ENOMEM: no room for it (a full /dev/shm fails
 * here, not with SIGBUS at a later touch). */
int vp__os_shm_create(const char *name, size_t size,
                      int (*init)(void *base, void *arg), void *arg,
                      void **base);
typedef struct vp__os_shm_info {
  uint64_t size;  /* its size in bytes */
  uint32_t owner; /* its owner's user id (0 on Windows) */
} vp__os_shm_info_t;
/* Map an existing segment whole: read-only, or read-write (then it must be
 * this user's), if it is `size` bytes. ENOENT: not there; EACCES: not open
 * to us; EPERM: another user's (info->owner); EMSGSIZE: it is info->size
 * bytes, not `size` (0: a segment an older build's killed creator left).
 * info may be NULL. */
int vp__os_shm_open(const char *name, bool writable, size_t size,
                    void **base, vp__os_shm_info_t *info);
void vp__os_shm_unmap(void *base, size_t size);
/* Remove the name: who has it mapped keeps it; the next create makes a new
 * one. Win32: nothing (a segment goes with its last handle). */
void vp__os_shm_unlink(const char *name);
/* Call each(name without its '/', arg) for every segment whose name
 * (without its '/') begins with `prefix`: 0, or ENOSYS where segments
 * cannot be listed. */
int vp__os_shm_list(const char *prefix, void (*each)(const char *name,
                                                     void *arg),
                    void *arg);

/* ----------------------------------- waits on a word of shared memory */

/* Futex-like waits across processes on an _Atomic uint32_t inside a
 * shared segment: `shm` is the segment's name and `base` where this
 * process mapped it, so the word is known machine-wide by (shm, offset)
 * (POSIX: a futex on the shared mapping, both ignored; Win32: a named
 * event per word, opened by each process). */
/* Sleep while *word == seen, up to timeout_ns (VP__OS_FOREVER: no limit),
 * until a vp__os_word_wake. May return early: callers reread the word and
 * their clock. 0, or ETIMEDOUT. */
int vp__os_word_wait(const char *shm, const void *base,
                     _Atomic uint32_t *word, uint32_t seen,
                     uint64_t timeout_ns);
/* Wake every waiter on the word, in every process; change the word
 * first. */
void vp__os_word_wake(const char *shm, const void *base,
                      _Atomic uint32_t *word);

/* ------------------------------- the lock of a shared segment, robust */

/* A lock shared by processes that dies with its holder: the next taker is
 * told, and removes the dead holder's traces. Its shared part lives in the
 * segment (POSIX: a robust, process-shared pthread mutex; Win32: unused,
 * the lock is a named mutex, WAIT_ABANDONED telling of a dead holder);
 * each process opens its own handle from the segment's name. */
typedef struct vp__os_plock_shared {
  _Alignas(8) unsigned char opaque[64];
} vp__os_plock_shared_t;
typedef struct vp__os_plock {
  vp__os_plock_shared_t *shared;
  void *handle; /* POSIX: unused; Win32: the named mutex's HANDLE */
} vp__os_plock_t;

/* Make the shared part, once, in a new segment before anyone opens it. */
int vp__os_plock_init(vp__os_plock_shared_t *s);
/* This process's handle to the lock of segment `shm` (its name, as given
 * to vp__os_shm_create/open), whose shared part is `s`. */
int vp__os_plock_open(vp__os_plock_t *l, const char *shm,
                      vp__os_plock_shared_t *s);
void vp__os_plock_close(vp__os_plock_t *l);
/* Take it, waiting up to timeout_ms (0: only try): 0; EOWNERDEAD: taken,
 * and its previous holder died holding it (the lock is made consistent
 * again; the caller repairs what the holder was changing); ETIMEDOUT (or
 * EBUSY when only trying): someone holds it; EINVAL: the shared part is
 * not a lock of the kind vp__os_plock_init makes (a corrupt segment: it
 * is not touched, as glibc may abort the process on such a word); another
 * errno: it cannot be used. */
int vp__os_plock_lock(vp__os_plock_t *l, uint32_t timeout_ms);
void vp__os_plock_unlock(vp__os_plock_t *l);

#endif /* VPAGER_OS_H */
