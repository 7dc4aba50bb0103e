/* The platform layer on Windows (src/os.h): Win32 calls behind the same
 * door os_posix.c is on Linux. SRWLOCK and CONDITION_VARIABLE for locks,
 * _beginthreadex for threads, VirtualAlloc for reservations, ReadFile at
 * an OVERLAPPED offset, named file mappings for shared segments, a named
 * mutex for their robust lock (WAIT_ABANDONED is what a dead holder
 * leaves), and a named event per shared word for cross-process waits
 * (WaitOnAddress works only inside one process). Named objects live in the
 * session's "Local\" namespace and go with their last handle; a
 * segment's name stands for its current generation, which unlink moves
 * on. Built only for _WIN32 (the Makefile's check-windows cross-build);
 * elsewhere this file is empty. */
#ifdef _WIN32

#ifndef _WIN32_WINNT
#define _WIN32_WINNT 0x0A00 /* Windows 10: GetSystemTimePreciseAsFileTime */
#endif
#define WIN32_LEAN_AND_MEAN
#define PSAPI_VERSION 2 /* GetMappedFileNameW from kernel32 */
#include <windows.h>
#include <winternl.h>
#include <psapi.h>

#include <errno.h>
#include <io.h>
#include <fcntl.h>
#include <process.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

#include "os.h"

_Static_assert(sizeof(SRWLOCK) <= sizeof(vp__os_mutex_t), "vp__os_mutex_t");
_Static_assert(sizeof(CONDITION_VARIABLE) <= sizeof(vp__os_cond_t),
               "vp__os_cond_t");
_Static_assert(sizeof(INIT_ONCE) <= sizeof(vp__os_once_t), "vp__os_once_t");

/* A Win32 error as the errno value os.h promises. */
static int errno_of(DWORD e) {
  switch (e) {
  case ERROR_SUCCESS:
    return EIO; /* a failure that left no error: still a failure */
  case ERROR_FILE_NOT_FOUND:
  case ERROR_PATH_NOT_FOUND:
  case ERROR_INVALID_NAME:
  case ERROR_MOD_NOT_FOUND:
  case ERROR_BAD_PATHNAME:
    return ENOENT;
  case ERROR_ACCESS_DENIED:
    return EACCES;
  case ERROR_ALREADY_EXISTS:
  case ERROR_FILE_EXISTS:
    return EEXIST;
  case ERROR_NOT_ENOUGH_MEMORY:
  case ERROR_OUTOFMEMORY:
  case ERROR_COMMITMENT_LIMIT:
    return ENOMEM;
  case ERROR_DISK_FULL:
  case ERROR_HANDLE_DISK_FULL:
    return ENOSPC;
  case ERROR_INVALID_PARAMETER:
  case ERROR_INVALID_HANDLE:
  case ERROR_INVALID_ADDRESS:
    return EINVAL;
  case ERROR_TIMEOUT:
  case WAIT_TIMEOUT:
    return ETIMEDOUT;
  case ERROR_SHARING_VIOLATION:
  case ERROR_LOCK_VIOLATION:
  case ERROR_BUSY:
    return EBUSY;
  case ERROR_PROC_NOT_FOUND:
    return ENOSYS;
  default:
    return EIO;
  }
}

static int last_errno(void) { return errno_of(GetLastError()); }

/* UTF-8 to UTF-16 into `out` (of n wide characters): false when it does
 * not fit or is not UTF-8. */
static bool widen(const char *s, wchar_t *out, int n) {
  return MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, s, -1, out, n) > 0;
}

/* --------------------------------------------------- threads and locks */

int vp__os_mutex_init(vp__os_mutex_t *m) {
  memset(m, 0, sizeof *m);
  InitializeSRWLock((SRWLOCK *)m->opaque);
  return 0;
}

void vp__os_mutex_destroy(vp__os_mutex_t *m) { (void)m; }

void vp__os_mutex_lock(vp__os_mutex_t *m) {
  AcquireSRWLockExclusive((SRWLOCK *)m->opaque);
}

void vp__os_mutex_unlock(vp__os_mutex_t *m) {
  ReleaseSRWLockExclusive((SRWLOCK *)m->opaque);
}

int vp__os_cond_init(vp__os_cond_t *c) {
  memset(c, 0, sizeof *c);
  InitializeConditionVariable((CONDITION_VARIABLE *)c->opaque);
  return 0;
}

void vp__os_cond_destroy(vp__os_cond_t *c) { (void)c; }

void vp__os_cond_wait(vp__os_cond_t *c, vp__os_mutex_t *m) {
  SleepConditionVariableSRW((CONDITION_VARIABLE *)c->opaque,
                            (SRWLOCK *)m->opaque, INFINITE, 0);
}

/* Milliseconds for a wait of ns: rounded up (a wait never ends early by
 * rounding), below INFINITE. */
static DWORD wait_ms(uint64_t ns) {
  if (ns == VP__OS_FOREVER) return INFINITE;
  uint64_t ms = ns / 1000000u + (ns % 1000000u != 0);
  return ms >= INFINITE ? INFINITE - 1 : (DWORD)ms;
}

int vp__os_cond_timedwait(vp__os_cond_t *c, vp__os_mutex_t *m,
                          uint64_t timeout_ns) {
  if (SleepConditionVariableSRW((CONDITION_VARIABLE *)c->opaque,
                                (SRWLOCK *)m->opaque, wait_ms(timeout_ns), 0))
    return 0;
  return GetLastError() == ERROR_TIMEOUT ? ETIMEDOUT : 0;
}

void vp__os_cond_signal(vp__os_cond_t *c) {
  WakeConditionVariable((CONDITION_VARIABLE *)c->opaque);
}

void vp__os_cond_broadcast(vp__os_cond_t *c) {
  WakeAllConditionVariable((CONDITION_VARIABLE *)c->opaque);
}

static BOOL CALLBACK once_call(INIT_ONCE *o, void *fn, void **ctx) {
  (void)o;
  (void)ctx;
  (*(void (**)(void))fn)();
  return TRUE;
}

void vp__os_once(vp__os_once_t *o, void (*fn)(void)) {
  InitOnceExecuteOnce((INIT_ONCE *)o->opaque, once_call, (void *)&fn, NULL);
}

/* The thread's storage: its handle, and what it runs (read by the new
 * thread, which the caller's vp__os_thread_t outlives until the join). */
typedef struct win_thread {
  HANDLE handle;
  void *(*fn)(void *);
  void *arg;
} win_thread_t;
_Static_assert(sizeof(win_thread_t) <= sizeof(vp__os_thread_t),
               "vp__os_thread_t");

static unsigned __stdcall thread_main(void *p) {
  win_thread_t *t = p;
  t->fn(t->arg);
  return 0;
}

/* Windows has no asynchronous signals to keep from a thread: flags are
 * met as they are. */
int vp__os_thread_start(vp__os_thread_t *t, void *(*fn)(void *), void *arg,
                        unsigned flags) {
  (void)flags;
  win_thread_t *w = (win_thread_t *)t->opaque;
  w->fn = fn;
  w->arg = arg;
  /* _beginthreadex, not CreateThread: the C runtime's per-thread state. */
  uintptr_t h = _beginthreadex(NULL, 0, thread_main, w, 0, NULL);
  if (h == 0) return errno ? errno : EAGAIN;
  w->handle = (HANDLE)h;
  return 0;
}

void vp__os_thread_join(vp__os_thread_t *t) {
  win_thread_t *w = (win_thread_t *)t->opaque;
  WaitForSingleObject(w->handle, INFINITE);
  CloseHandle(w->handle);
  w->handle = NULL;
}

/* ------------------------------------------------------- time and sleep */

uint64_t vp__os_now_ns(void) {
  static LARGE_INTEGER freq; /* fixed at boot; a racy first store is benign */
  LARGE_INTEGER now;
  if (freq.QuadPart == 0) QueryPerformanceFrequency(&freq);
  QueryPerformanceCounter(&now);
  uint64_t f = (uint64_t)freq.QuadPart, t = (uint64_t)now.QuadPart;
  return t / f * 1000000000u + t % f * 1000000000u / f;
}

/* The performance counter is one clock for every process of the machine,
 * and cheap; the tick count would be too coarse (15.6 ms by default) to
 * order pages used a few ms apart by two processes. */
uint64_t vp__os_coarse_ns(void) { return vp__os_now_ns(); }

/* A FILETIME (100 ns since 1601) as ns since 1970. */
static uint64_t filetime_unix_ns(FILETIME ft) {
  uint64_t t = ((uint64_t)ft.dwHighDateTime << 32) | ft.dwLowDateTime;
  const uint64_t epoch = 116444736000000000ull; /* 1601 to 1970, in 100 ns */
  return t < epoch ? 0 : (t - epoch) * 100u;
}

uint64_t vp__os_realtime_ns(void) {
  FILETIME ft;
  GetSystemTimePreciseAsFileTime(&ft);
  return filetime_unix_ns(ft);
}

/* Whole milliseconds, rounded up (a timer tick, 15.6 ms by default, on
 * Windows; 1 ms under Wine): a waitable high-resolution timer per nap
 * costs four calls into Wine's server, and 64 processes napping on the
 * sim's attach lock (ledger_join_leave_many) then outwaited the test. */
void vp__os_sleep_ns(uint64_t ns) { Sleep(wait_ms(ns)); }

/* ------------------------------------------------------- the machine */

size_t vp__os_page_size(void) {
  SYSTEM_INFO si;
  GetSystemInfo(&si);
  return si.dwPageSize;
}

unsigned vp__os_cpu_count(void) {
  DWORD n = GetActiveProcessorCount(ALL_PROCESSOR_GROUPS);
  return n ? (unsigned)n : 1u;
}

static bool memory_status(MEMORYSTATUSEX *ms) {
  memset(ms, 0, sizeof *ms);
  ms->dwLength = sizeof *ms;
  return GlobalMemoryStatusEx(ms) != 0;
}

uint64_t vp__os_ram_total(void) {
  MEMORYSTATUSEX ms;
  return memory_status(&ms) ? ms.ullTotalPhys : 0;
}

uint64_t vp__os_ram_available(void) {
  MEMORYSTATUSEX ms;
  return memory_status(&ms) ? ms.ullAvailPhys : 0;
}

/* The job object's process or job memory limit, the lower one. */
uint64_t vp__os_memory_limit(void) {
  JOBOBJECT_EXTENDED_LIMIT_INFORMATION info;
  memset(&info, 0, sizeof info);
  if (!QueryInformationJobObject(NULL, JobObjectExtendedLimitInformation,
                                 &info, sizeof info, NULL))
    return 0;
  uint64_t limit = 0;
  DWORD f = info.BasicLimitInformation.LimitFlags;
  if (f & JOB_OBJECT_LIMIT_PROCESS_MEMORY) limit = info.ProcessMemoryLimit;
  if ((f & JOB_OBJECT_LIMIT_JOB_MEMORY) &&
      (limit == 0 || info.JobMemoryLimit < limit))
    limit = info.JobMemoryLimit;
  return limit;
}

bool vp__os_cgroup_path(char *out, size_t len) {
  if (len) out[0] = '\0';
  return false;
}

/* Windows drives every GPU through WDDM. */
bool vp__os_gpu_wddm(void) { return true; }

/* ASCII only, whatever the locale: option and unit names. */
int vp__os_strcasecmp(const char *a, const char *b) {
  for (;; a++, b++) {
    int x = (unsigned char)*a, y = (unsigned char)*b;
    if (x >= 'A' && x <= 'Z') x += 'a' - 'A';
    if (y >= 'A' && y <= 'Z') y += 'a' - 'A';
    if (x != y || x == 0) return x - y;
  }
}

/* ----------------------------------------------------------- processes */

int32_t vp__os_pid(void) { return (int32_t)GetCurrentProcessId(); }

uint32_t vp__os_uid(void) { return 0; }

static uint64_t creation_time(HANDLE proc) {
  FILETIME created, exited, kernel, user;
  if (!GetProcessTimes(proc, &created, &exited, &kernel, &user)) return 0;
  return ((uint64_t)created.dwHighDateTime << 32) | created.dwLowDateTime;
}

void vp__os_proc_self(uint64_t *start, uint64_t *pidns) {
  if (start) *start = creation_time(GetCurrentProcess());
  *pidns = 1; /* one pid space per machine */
}

/* A handle to process `pid` to ask whether it runs: with SYNCHRONIZE, else
 * (a process that grants less, as another user's or a service's may: the
 * pid given again to one) with the query right alone, *wait false then.
 * NULL with ERROR_INVALID_PARAMETER: no such pid. */
static HANDLE open_process(int32_t pid, bool *wait) {
  *wait = true;
  HANDLE h = OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION | SYNCHRONIZE,
                         FALSE, (DWORD)pid);
  if (h || GetLastError() != ERROR_ACCESS_DENIED) return h;
  *wait = false;
  h = OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, (DWORD)pid);
  if (!h) SetLastError(ERROR_ACCESS_DENIED);
  return h;
}

/* Whether the process of handle h runs (an exited one whose handles
 * others still hold is a zombie). */
static bool running(HANDLE h, bool wait) {
  if (wait) return WaitForSingleObject(h, 0) == WAIT_TIMEOUT;
  DWORD code = 0;
  return GetExitCodeProcess(h, &code) && code == STILL_ACTIVE;
}

bool vp__os_proc_alive(int32_t pid, uint64_t start, uint64_t pidns) {
  if (pidns != 0 && pidns != 1) return true;
  bool wait;
  HANDLE h = open_process(pid, &wait);
  /* No such pid: gone. Not even queryable: alive, as far as we know. */
  if (!h) return GetLastError() != ERROR_INVALID_PARAMETER;
  bool alive = running(h, wait);
  if (alive && start != 0) {
    uint64_t t = creation_time(h);
    if (t != 0 && t != start) alive = false; /* the pid was given again */
  }
  CloseHandle(h);
  return alive;
}

/* A process that has exited is gone here, even while handles keep its
 * object (and pid): nobody reaps it as a parent reaps a zombie, and its
 * memory is all given back already. */
bool vp__os_pid_exists(int32_t pid) {
  bool wait;
  HANDLE h = open_process(pid, &wait);
  if (!h) return GetLastError() != ERROR_INVALID_PARAMETER;
  bool is = running(h, wait);
  CloseHandle(h);
  return is;
}

void vp__os_proc_command(char *out, size_t len) {
  if (len == 0) return;
  out[0] = '\0';
  const wchar_t *cmd = GetCommandLineW();
  if (!cmd) return;
  int n = len > INT_MAX ? INT_MAX : (int)len;
  /* Cut to fit: a whole conversion, else as many characters as fit. */
  if (WideCharToMultiByte(CP_UTF8, 0, cmd, -1, out, n, NULL, NULL) > 0)
    return;
  size_t k = wcslen(cmd);
  while (k > 0) {
    k = k * 3 / 4;
    int got = WideCharToMultiByte(CP_UTF8, 0, cmd, (int)k, out, n - 1, NULL,
                                  NULL);
    if (got > 0) {
      out[got] = '\0';
      return;
    }
  }
  out[0] = '\0';
}

/* ------------------------------------------------------ virtual memory */

/* Reservations come at the allocation granularity (64 KiB); a larger
 * alignment reserves more, finds the aligned address inside, and reserves
 * just that (another thread may take it between: try again). */
int vp__os_vm_reserve(size_t size, size_t align, void **p) {
  *p = NULL;
  SYSTEM_INFO si;
  GetSystemInfo(&si);
  if (align <= si.dwAllocationGranularity) {
    *p = VirtualAlloc(NULL, size, MEM_RESERVE, PAGE_NOACCESS);
    return *p ? 0 : last_errno();
  }
  if (size + align < size) return ENOMEM;
  for (int tries = 0; tries < 16; tries++) {
    char *big = VirtualAlloc(NULL, size + align, MEM_RESERVE, PAGE_NOACCESS);
    if (!big) return last_errno();
    uintptr_t at = ((uintptr_t)big + align - 1) & ~(uintptr_t)(align - 1);
    VirtualFree(big, 0, MEM_RELEASE);
    *p = VirtualAlloc((void *)at, size, MEM_RESERVE, PAGE_NOACCESS);
    if (*p) return 0;
  }
  return ENOMEM;
}

int vp__os_vm_commit(void *p, size_t size) {
  return VirtualAlloc(p, size, MEM_COMMIT, PAGE_READWRITE) ? 0 : last_errno();
}

int vp__os_vm_decommit(void *p, size_t size) {
  return VirtualFree(p, size, MEM_DECOMMIT) ? 0 : last_errno();
}

int vp__os_vm_release(void *p, size_t size) {
  (void)size; /* a reservation goes whole, by its base */
  return VirtualFree(p, 0, MEM_RELEASE) ? 0 : last_errno();
}

int vp__os_vm_alloc(size_t size, void **p) {
  *p = VirtualAlloc(NULL, size, MEM_RESERVE | MEM_COMMIT, PAGE_READWRITE);
  return *p ? 0 : last_errno();
}

void vp__os_vm_free(void *p, size_t size) {
  (void)size;
  if (p) VirtualFree(p, 0, MEM_RELEASE);
}

/* Large pages need a privilege and a locked commit: no transparent hint. */
void vp__os_vm_hint_huge(void *p, size_t size) {
  (void)p;
  (void)size;
}

/* An atomic OR of zero: every page faulted in writably, its bytes kept
 * even while other threads write them. */
int vp__os_vm_populate(void *p, size_t size) {
  size_t ps = vp__os_page_size(); /* committed: charged already */
  for (size_t off = 0; off < size; off += ps)
    __atomic_fetch_or((unsigned char *)p + off, 0, __ATOMIC_RELAXED);
  return 0;
}

int vp__os_vm_discard(void *p, size_t size) {
  if (!VirtualFree(p, size, MEM_DECOMMIT)) return last_errno();
  return VirtualAlloc(p, size, MEM_COMMIT, PAGE_READWRITE) ? 0
                                                           : last_errno();
}

/* Placeholders (VirtualAlloc2, MapViewOfFile3) could map a section twice
 * inside a reservation; the simulated device does without. */
int vp__os_vm_share(void *a, void *b, size_t size) {
  (void)a, (void)b, (void)size;
  return ENOSYS;
}

bool vp__os_vm_can_share(void) { return false; }

int vp__os_vm_unshare(void *p, size_t size) {
  return vp__os_vm_decommit(p, size);
}

/* --------------------------------------------------------------- files */

static HANDLE file_handle(int fd) { return (HANDLE)_get_osfhandle(fd); }

int vp__os_file_open_read(const char *path, int *fd) {
  *fd = -1;
  wchar_t wpath[MAX_PATH * 4];
  if (!widen(path, wpath, (int)(sizeof wpath / sizeof *wpath)))
    return ENAMETOOLONG;
  /* Not inheritable (close-on-exec); others may write, rename or delete
   * the file meanwhile, as on POSIX. BACKUP_SEMANTICS opens a folder too,
   * as open(2) does: the caller's stat then says it is no regular file. */
  HANDLE h = CreateFileW(wpath, GENERIC_READ,
                         FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                         NULL, OPEN_EXISTING,
                         FILE_ATTRIBUTE_NORMAL | FILE_FLAG_BACKUP_SEMANTICS,
                         NULL);
  if (h == INVALID_HANDLE_VALUE) return last_errno();
  int f = _open_osfhandle((intptr_t)h, _O_RDONLY | _O_BINARY);
  if (f < 0) {
    CloseHandle(h);
    return EMFILE;
  }
  *fd = f;
  return 0;
}

int vp__os_file_dup(intptr_t os_handle, int *fd) {
  *fd = -1;
  /* A file's handle only ((HANDLE)-1 is this process's, say). */
  DWORD type = GetFileType((HANDLE)os_handle);
  if (type != FILE_TYPE_DISK && type != FILE_TYPE_PIPE &&
      type != FILE_TYPE_CHAR)
    return EBADF;
  HANDLE d = NULL;
  if (!DuplicateHandle(GetCurrentProcess(), (HANDLE)os_handle,
                       GetCurrentProcess(), &d, 0, FALSE,
                       DUPLICATE_SAME_ACCESS))
    return GetLastError() == ERROR_INVALID_HANDLE ? EBADF : last_errno();
  int f = _open_osfhandle((intptr_t)d, _O_RDONLY | _O_BINARY);
  if (f < 0) {
    CloseHandle(d);
    return EMFILE;
  }
  *fd = f;
  return 0;
}

void vp__os_file_close(int fd) {
  if (fd >= 0) _close(fd);
}

int vp__os_file_stat(int fd, vp__os_file_info_t *info) {
  memset(info, 0, sizeof *info);
  HANDLE h = file_handle(fd);
  if (h == INVALID_HANDLE_VALUE) return EBADF;
  /* A pipe, a console or a device: not a regular file. */
  if (GetFileType(h) != FILE_TYPE_DISK) return 0;
  BY_HANDLE_FILE_INFORMATION fi;
  if (!GetFileInformationByHandle(h, &fi)) return last_errno();
  info->size = ((uint64_t)fi.nFileSizeHigh << 32) | fi.nFileSizeLow;
  info->mtime_ns = filetime_unix_ns(fi.ftLastWriteTime);
  info->regular = !(fi.dwFileAttributes & FILE_ATTRIBUTE_DIRECTORY);
  return 0;
}

/* A read of h at `off` through a handle of its own opened for overlapped
 * I/O: on a synchronous handle (every C runtime fd's) Windows runs reads
 * one at a time whatever their OVERLAPPED says, and moves the handle's
 * file pointer, which pread does not. False when h cannot be reopened so
 * (*rc unset): the caller reads h itself. */
static bool read_reopened(HANDLE h, void *buf, DWORD want, uint64_t off,
                          DWORD *read, int *rc) {
  HANDLE r = ReOpenFile(h, GENERIC_READ,
                        FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                        FILE_FLAG_OVERLAPPED);
  if (r == INVALID_HANDLE_VALUE) return false;
  HANDLE ev = CreateEventW(NULL, TRUE, FALSE, NULL);
  if (!ev) {
    CloseHandle(r);
    return false;
  }
  OVERLAPPED ov;
  memset(&ov, 0, sizeof ov);
  ov.Offset = (DWORD)off;
  ov.OffsetHigh = (DWORD)(off >> 32);
  ov.hEvent = ev;
  *read = 0;
  bool ok = (ReadFile(r, buf, want, NULL, &ov) ||
             GetLastError() == ERROR_IO_PENDING) &&
            GetOverlappedResult(r, &ov, read, TRUE);
  /* (past the end: nothing read, no error, as pread) */
  *rc = ok || GetLastError() == ERROR_HANDLE_EOF ? 0
                                                 : errno_of(GetLastError());
  CloseHandle(ev);
  CloseHandle(r);
  return true;
}

/* ReadFile with the offset in its OVERLAPPED (through read_reopened where
 * it can): threads that read one handle at different offsets do not race
 * on a file pointer, nor run one at a time, nor move the caller's. */
int vp__os_file_read_at(int fd, void *buf, size_t n, uint64_t off,
                        size_t *got) {
  *got = 0;
  HANDLE h = file_handle(fd);
  if (h == INVALID_HANDLE_VALUE) return EBADF;
  /* A pipe has no offsets (pread's ESPIPE); ReadFile would wait on it. */
  if (GetFileType(h) != FILE_TYPE_DISK) return ESPIPE;
  /* At most 64 MiB a call: SMB shares and some filter drivers fail larger
   * reads (ERROR_NO_SYSTEM_RESOURCES); the caller loops. */
  DWORD want = n > (64u << 20) ? (64u << 20) : (DWORD)n, read = 0;
  int rc = 0;
  if (read_reopened(h, buf, want, off, &read, &rc)) {
    *got = rc ? 0 : read;
    return rc;
  }
  OVERLAPPED ov;
  memset(&ov, 0, sizeof ov);
  ov.Offset = (DWORD)off;
  ov.OffsetHigh = (DWORD)(off >> 32);
  if (!ReadFile(h, buf, want, &read, &ov)) {
    DWORD e = GetLastError();
    if (e == ERROR_HANDLE_EOF) return 0;
    return errno_of(e);
  }
  *got = read;
  return 0;
}

int vp__os_file_map(int fd, uint64_t size, const void **p) {
  *p = NULL;
  HANDLE h = file_handle(fd);
  if (h == INVALID_HANDLE_VALUE) return EBADF;
  HANDLE m = CreateFileMappingW(h, NULL, PAGE_READONLY, 0, 0, NULL);
  if (!m) return last_errno();
  *p = MapViewOfFile(m, FILE_MAP_READ, 0, 0, (SIZE_T)size);
  int rc = *p ? 0 : last_errno();
  CloseHandle(m); /* the view keeps the mapping */
  return rc;
}

void vp__os_file_unmap(const void *p, uint64_t size) {
  (void)size;
  if (p) UnmapViewOfFile(p);
}

/* Unlocking pages that are not locked takes them out of the working set
 * (they are read again when touched); Windows has no call that drops a
 * file's cached pages: a hint with nothing to do. */
int vp__os_file_map_drop(const void *p, uint64_t size) {
  VirtualUnlock((void *)p, (SIZE_T)size);
  return 0;
}

int vp__os_file_drop_cache(int fd) {
  (void)fd;
  return 0;
}

int vp__os_drop_unwritten(const void *p, uint64_t size) {
  return vp__os_file_map_drop(p, size); /* a trim loses nothing */
}

/* An NT device path ("\Device\HarddiskVolume3\m\x.safetensors", what
 * GetMappedFileNameW gives) as a Win32 one ("C:\m\x.safetensors"), in
 * place; false where no drive letter or share names it. */
static bool dos_path(wchar_t *p) {
  static const wchar_t mup[] = L"\\Device\\Mup\\", dosd[] = L"\\??\\";
  size_t n = wcslen(p);
  if (!wcsncmp(p, dosd, 4)) { /* "\??\C:\..." */
    memmove(p, p + 4, (n - 3) * sizeof *p);
    return true;
  }
  if (!wcsncmp(p, mup, 12)) { /* a share: "\\server\..." */
    memmove(p + 2, p + 12, (n - 11) * sizeof *p);
    p[0] = p[1] = L'\\';
    return true;
  }
  wchar_t drive[3] = L"A:", dev[MAX_PATH];
  for (DWORD have = GetLogicalDrives(); drive[0] <= L'Z'; drive[0]++) {
    if (!(have & (1u << (drive[0] - L'A'))) ||
        !QueryDosDeviceW(drive, dev, MAX_PATH))
      continue;
    size_t d = wcslen(dev);
    if (d && d < n && !wcsncmp(p, dev, d) && p[d] == L'\\') {
      memmove(p + 2, p + d, (n - d + 1) * sizeof *p);
      p[0] = drive[0], p[1] = L':';
      return true;
    }
  }
  return false;
}

/* The file behind the view at base as m's path and file_id; false unless
 * the view shows the file from its start (a view's offset in its file is
 * not told): the pages at probe (probe_len bytes, readable; the first 16
 * of them) are compared with the file's at probe - base, and one must be
 * the same; all of them, unless the view is private (a written page of
 * it is the process's copy: m->written then). */
static bool view_file(char *base, const char *probe, uint64_t probe_len,
                      vp__os_mapping_t *m) {
  enum { PAGE = 4096, PAGES = 16 };
  wchar_t w[MAX_PATH * 4];
  DWORD n = GetMappedFileNameW(GetCurrentProcess(), base, w,
                               (DWORD)(sizeof w / sizeof *w));
  if (!n || n >= sizeof w / sizeof *w - 1 || !dos_path(w))
    return false;
  if (!WideCharToMultiByte(CP_UTF8, WC_ERR_INVALID_CHARS, w, -1, m->path,
                           (int)sizeof m->path, NULL, NULL))
    return false;
  HANDLE h = CreateFileW(w, GENERIC_READ,
                         FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                         NULL, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, NULL);
  char *file = malloc(PAGE * PAGES);
  if (h == INVALID_HANDLE_VALUE || !file) {
    if (h != INVALID_HANDLE_VALUE) CloseHandle(h);
    free(file);
    return false;
  }
  BY_HANDLE_FILE_INFORMATION fi = {0};
  uint64_t at = (uint64_t)(probe - base);
  DWORD want = probe_len < PAGE * PAGES ? (DWORD)probe_len : PAGE * PAGES;
  DWORD got = 0, same = 0, differ = 0;
  OVERLAPPED ov = {.Offset = (DWORD)at, .OffsetHigh = (DWORD)(at >> 32)};
  if (GetFileInformationByHandle(h, &fi) &&
      ReadFile(h, file, want, &got, &ov))
    for (DWORD o = 0; o < got; o += PAGE) {
      DWORD k = got - o < PAGE ? got - o : PAGE;
      if (memcmp(file + o, probe + o, k)) differ++;
      else same++;
    }
  CloseHandle(h);
  free(file);
  m->file_id = (uint64_t)fi.nFileIndexHigh << 32 | fi.nFileIndexLow;
  m->file_offset = 0;
  m->written |= m->private_ && differ;
  return same && (!differ || m->private_);
}

static bool readable(DWORD protect) {
  return !(protect & (PAGE_NOACCESS | PAGE_GUARD)) && protect != 0;
}

/* The views of files, each the run of regions of one allocation base
 * (VirtualQuery walks the address space a region at a time). */
int vp__os_file_mappings(bool written,
                         bool (*fn)(const vp__os_mapping_t *m, void *ctx),
                         void *ctx) {
  MEMORY_BASIC_INFORMATION r;
  char *at = NULL, *base = NULL, *end = NULL, *probe = NULL;
  uint64_t probe_len = 0;
  DWORD prot = 0;
  bool copied = false; /* a page of the view turned read-write */
  vp__os_mapping_t m;
  (void)written; /* the regions say it at no cost */
  for (;;) {
    bool more = VirtualQuery(at, &r, sizeof r) == sizeof r;
    bool same = more && r.Type == MEM_MAPPED && r.AllocationBase == base;
    if (base && !same) { /* the view at base ended */
      m.start = (uint64_t)(uintptr_t)base;
      m.size = (uint64_t)(end - base);
      m.writable = prot & (PAGE_READWRITE | PAGE_WRITECOPY |
                           PAGE_EXECUTE_READWRITE | PAGE_EXECUTE_WRITECOPY);
      m.private_ = prot & (PAGE_WRITECOPY | PAGE_EXECUTE_WRITECOPY);
      m.written = m.private_ && copied;
      if (probe && view_file(base, probe, probe_len, &m) && !fn(&m, ctx))
        return 0;
      base = NULL;
    }
    if (!more) return 0;
    char *next = (char *)r.BaseAddress + r.RegionSize;
    if (r.Type == MEM_MAPPED && !base && r.BaseAddress == r.AllocationBase) {
      base = r.BaseAddress;
      prot = r.AllocationProtect;
      probe = NULL;
      copied = false;
    }
    if (base && r.State == MEM_COMMIT) {
      /* a private view's written page turns read-write */
      bool copy = (prot & (PAGE_WRITECOPY | PAGE_EXECUTE_WRITECOPY)) &&
                  (r.Protect & (PAGE_READWRITE | PAGE_EXECUTE_READWRITE));
      copied |= copy;
      if (!probe && !copy && readable(r.Protect))
        probe = r.BaseAddress, probe_len = r.RegionSize;
    }
    if (base) end = next;
    if (next <= at) return 0;
    at = next;
  }
}

/* ------------------------------------------------- dynamic libraries */

static void error_words(DWORD e, char *why, size_t len) {
  if (!why || len == 0) return;
  char msg[256];
  DWORD n = FormatMessageA(FORMAT_MESSAGE_FROM_SYSTEM |
                               FORMAT_MESSAGE_IGNORE_INSERTS,
                           NULL, e, 0, msg, sizeof msg, NULL);
  while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r' ||
                   msg[n - 1] == ' ' || msg[n - 1] == '.'))
    n--;
  msg[n] = '\0';
  snprintf(why, len, "%s (Win32 error %lu)", n ? msg : "LoadLibrary failed",
           (unsigned long)e);
}

void *vp__os_dl_open(const char *name, char *why, size_t len) {
  wchar_t wname[MAX_PATH];
  if (!widen(name, wname, MAX_PATH)) {
    if (why && len) snprintf(why, len, "%s: name too long", name);
    return NULL;
  }
  HMODULE lib = LoadLibraryW(wname);
  if (!lib) {
    error_words(GetLastError(), why, len);
    return NULL;
  }
  /* Pinned: FreeLibrary never unloads it (a driver's exit handlers must
   * not outlive its code); our reference still counts for dl_close. */
  HMODULE pinned;
  GetModuleHandleExW(GET_MODULE_HANDLE_EX_FLAG_PIN, wname, &pinned);
  return (void *)lib;
}

void *vp__os_dl_sym(void *lib, const char *symbol) {
  FARPROC f = GetProcAddress((HMODULE)lib, symbol);
  void *p;
  _Static_assert(sizeof f == sizeof p, "function and data pointers");
  memcpy(&p, &f, sizeof p);
  return p;
}

void vp__os_dl_close(void *lib) {
  if (lib) FreeLibrary((HMODULE)lib);
}

/* ------------------------------------------------ named shared memory */

/* "/name" as the kernel object name "Local\name" plus a suffix: false
 * when it does not fit. */
static bool object_name(const char *shm, const char *suffix, wchar_t *out,
                        size_t n) {
  char name[300];
  int len = snprintf(name, sizeof name, "Local\\%s%s",
                     shm[0] == '/' ? shm + 1 : shm, suffix);
  if (len < 0 || (size_t)len >= sizeof name) return false;
  return widen(name, out, (int)n);
}

enum { NAME_MAX_W = 320, SEG_NAME_MAX = 280 };

/* Generations. POSIX unlinks a segment's name while processes keep it
 * mapped, and the next creator makes a new segment; a Windows section
 * keeps its name as long as anyone maps it. So the name "/x" stands for
 * the section "x.<gen>", gen read from the name's generation section
 * "x.gen" (made zero by its first user), and unlink bumps gen. Every view
 * keeps the generation section mapped too: while any generation of the
 * name is mapped, the count stays; once none is, every generation's
 * section has gone and counting from 0 again is safe. The segment's lock
 * and word events are named after its generation ("x.<gen>.lock"), as
 * POSIX keeps them in the segment itself. */
typedef struct gen_map {
  HANDLE section;
  _Atomic uint64_t *gen;
} gen_map_t;

static int gen_open(const char *shm, bool create, gen_map_t *g) {
  wchar_t wname[NAME_MAX_W];
  if (!object_name(shm, ".gen", wname, NAME_MAX_W)) return ENAMETOOLONG;
  g->section = create ? CreateFileMappingW(INVALID_HANDLE_VALUE, NULL,
                                           PAGE_READWRITE, 0,
                                           sizeof *g->gen, wname)
                      : OpenFileMappingW(FILE_MAP_ALL_ACCESS, FALSE, wname);
  if (!g->section) return last_errno();
  g->gen = MapViewOfFile(g->section, FILE_MAP_ALL_ACCESS, 0, 0,
                         sizeof *g->gen);
  if (g->gen) return 0;
  int rc = last_errno();
  CloseHandle(g->section);
  return rc;
}

static void gen_close(gen_map_t *g) {
  UnmapViewOfFile((void *)g->gen);
  CloseHandle(g->section);
}

/* The generation's name: "/x" and 3 as "x.3". */
static void seg_name(const char *shm, uint64_t gen, char *out, size_t n) {
  snprintf(out, n, "%s.%llu", shm[0] == '/' ? shm + 1 : shm,
           (unsigned long long)gen);
}

/* What each mapped segment keeps until its unmap: its section handle (a
 * view alone does not keep a section's name: Wine drops it with the last
 * handle, and joiners open it by name), its generation's, and the name of
 * its generation (for its lock and events). */
typedef struct shm_view {
  void *base;
  uint64_t size;
  HANDLE section;
  gen_map_t gen;
  char name[SEG_NAME_MAX];
  struct shm_view *next;
} shm_view_t;
static shm_view_t *g_views;
static vp__os_mutex_t g_views_mu = VP__OS_MUTEX_INIT;

/* A view's size as the memory manager keeps it: its pages. */
static uint64_t view_size(const void *p) {
  MEMORY_BASIC_INFORMATION mbi;
  if (VirtualQuery(p, &mbi, sizeof mbi) != sizeof mbi) return 0;
  return mbi.RegionSize;
}

static void view_drop(void *base) {
  shm_view_t *v = NULL;
  vp__os_mutex_lock(&g_views_mu);
  for (shm_view_t **at = &g_views; *at; at = &(*at)->next) {
    if ((*at)->base == base) {
      v = *at;
      *at = v->next;
      break;
    }
  }
  vp__os_mutex_unlock(&g_views_mu);
  UnmapViewOfFile(base);
  if (v) {
    CloseHandle(v->section);
    gen_close(&v->gen);
    free(v);
  }
}

/* The generation name of the segment mapped around `addr` (a lock or a
 * word inside it): false when no segment of ours holds it. */
static bool view_name(const void *addr, char *out, size_t n) {
  bool found = false;
  vp__os_mutex_lock(&g_views_mu);
  for (shm_view_t *v = g_views; v && !found; v = v->next) {
    uintptr_t at = (uintptr_t)addr, lo = (uintptr_t)v->base;
    if (at >= lo && at - lo < v->size) {
      snprintf(out, n, "%s", v->name);
      found = true;
    }
  }
  vp__os_mutex_unlock(&g_views_mu);
  return found;
}

/* Map section `m` (of generation `name`) whole and keep it, with its
 * generation's map, until unmapped; both are closed when that fails. */
static int map_section(HANDLE m, gen_map_t *g, const char *name,
                       DWORD access, size_t size, void **base) {
  shm_view_t *v = malloc(sizeof *v);
  void *p = v ? MapViewOfFile(m, access, 0, 0, size) : NULL;
  int rc = !v ? ENOMEM : p ? 0 : last_errno();
  if (rc != 0) {
    free(v);
    CloseHandle(m);
    gen_close(g);
    return rc;
  }
  *v = (shm_view_t){p, view_size(p), m, *g, "", NULL};
  snprintf(v->name, sizeof v->name, "%s", name);
  vp__os_mutex_lock(&g_views_mu);
  v->next = g_views;
  g_views = v;
  vp__os_mutex_unlock(&g_views_mu);
  *base = p;
  return 0;
}

int vp__os_shm_create(const char *name, size_t size,
                      int (*init)(void *base, void *arg), void *arg,
                      void **base) {
  *base = NULL;
  gen_map_t g;
  int rc = gen_open(name, true, &g);
  if (rc != 0) return rc;
  char seg[SEG_NAME_MAX];
  wchar_t wname[NAME_MAX_W];
  seg_name(name, atomic_load(g.gen), seg, sizeof seg);
  if (!object_name(seg, "", wname, NAME_MAX_W)) {
    gen_close(&g);
    return ENAMETOOLONG;
  }
  /* Backed by the paging file, committed whole now (SEC_COMMIT): no room
   * fails here, not at a later touch. */
  HANDLE m = CreateFileMappingW(INVALID_HANDLE_VALUE, NULL,
                                PAGE_READWRITE | SEC_COMMIT,
                                (DWORD)((uint64_t)size >> 32), (DWORD)size,
                                wname);
  rc = !m ? last_errno() : GetLastError() == ERROR_ALREADY_EXISTS ? EEXIST : 0;
  if (rc != 0) {
    if (m) CloseHandle(m);
    gen_close(&g);
    return rc;
  }
  void *p = NULL;
  rc = map_section(m, &g, seg, FILE_MAP_ALL_ACCESS, size, &p);
  if (rc != 0) return rc;
  if (init) rc = init(p, arg); /* new sections are zeroed */
  if (rc != 0) {
    view_drop(p);
    return rc;
  }
  *base = p;
  return 0;
}

int vp__os_shm_open(const char *name, bool writable, size_t size,
                    void **base, vp__os_shm_info_t *info) {
  *base = NULL;
  if (info) memset(info, 0, sizeof *info);
  gen_map_t g;
  int rc = gen_open(name, false, &g);
  if (rc != 0) return rc; /* ENOENT: no generation, no segment */
  char seg[SEG_NAME_MAX];
  wchar_t wname[NAME_MAX_W];
  seg_name(name, atomic_load(g.gen), seg, sizeof seg);
  DWORD access = writable ? FILE_MAP_ALL_ACCESS : FILE_MAP_READ;
  HANDLE m = object_name(seg, "", wname, NAME_MAX_W)
                 ? OpenFileMappingW(access, FALSE, wname)
                 : NULL;
  if (!m) {
    rc = last_errno();
    gen_close(&g);
    return rc;
  }
  void *p = NULL;
  rc = map_section(m, &g, seg, access, 0, &p);
  if (rc != 0) return rc;
  /* Sections have no size call; the view's pages stand for it, so sizes
   * compare rounded up to pages. */
  uint64_t have = view_size(p), ps = vp__os_page_size();
  uint64_t want = ((uint64_t)size + ps - 1) / ps * ps;
  if (info) info->size = have;
  if (have != want) {
    view_drop(p);
    return EMSGSIZE;
  }
  *base = p;
  return 0;
}

void vp__os_shm_unmap(void *base, size_t size) {
  (void)size;
  if (base) view_drop(base);
}

/* The next create makes a new generation; who maps this one keeps it. */
void vp__os_shm_unlink(const char *name) {
  gen_map_t g;
  if (gen_open(name, false, &g) != 0) return; /* nobody maps it */
  atomic_fetch_add(g.gen, 1);
  gen_close(&g);
}

/* The session's object folder (where "Local\\" names live), listed with
 * ntdll's directory calls (Windows documents no other way); a name
 * counts while its generation section exists, as POSIX's does until its
 * unlink. */
typedef LONG(NTAPI *nt_open_dir_fn)(HANDLE *, ACCESS_MASK, OBJECT_ATTRIBUTES *);
typedef LONG(NTAPI *nt_query_dir_fn)(HANDLE, void *, ULONG, BOOLEAN, BOOLEAN,
                                     ULONG *, ULONG *);
typedef struct object_dir_info {
  UNICODE_STRING name, type;
} object_dir_info_t;

/* ntdll's function `name` into *fn (a function pointer of its type). */
static bool ntdll_fn(const char *name, void *fn, size_t size) {
  FARPROC f = GetProcAddress(GetModuleHandleW(L"ntdll.dll"), name);
  if (!f || size != sizeof f) return false;
  memcpy(fn, &f, sizeof f);
  return true;
}

static HANDLE session_objects(void) {
  nt_open_dir_fn open_dir;
  DWORD session = 0;
  if (!ntdll_fn("NtOpenDirectoryObject", &open_dir, sizeof open_dir) ||
      !ProcessIdToSessionId(GetCurrentProcessId(), &session))
    return NULL;
  wchar_t path[64];
  swprintf(path, sizeof path / sizeof *path,
           L"\\Sessions\\%lu\\BaseNamedObjects", (unsigned long)session);
  UNICODE_STRING u = {(USHORT)(wcslen(path) * sizeof *path),
                      (USHORT)(sizeof path), path};
  OBJECT_ATTRIBUTES oa;
  InitializeObjectAttributes(&oa, &u, 0, NULL, NULL);
  HANDLE dir = NULL;
  return open_dir(&dir, 0x0001 /* DIRECTORY_QUERY */, &oa) >= 0 ? dir : NULL;
}

int vp__os_shm_list(const char *prefix,
                    void (*each)(const char *name, void *arg), void *arg) {
  nt_query_dir_fn query;
  if (!ntdll_fn("NtQueryDirectoryObject", &query, sizeof query)) return ENOSYS;
  HANDLE dir = session_objects();
  if (!dir) return ENOSYS;
  union {
    object_dir_info_t info;
    unsigned char bytes[2048];
  } buf;
  ULONG ctx = 0, got = 0;
  size_t plen = strlen(prefix);
  while (query(dir, &buf, sizeof buf, TRUE, ctx == 0, &ctx, &got) >= 0) {
    const object_dir_info_t *e = &buf.info;
    if (e->type.Length != 7 * sizeof(wchar_t) ||
        wcsncmp(e->type.Buffer, L"Section", 7) != 0)
      continue;
    char name[SEG_NAME_MAX];
    int n = WideCharToMultiByte(CP_UTF8, 0, e->name.Buffer,
                                e->name.Length / (int)sizeof(wchar_t), name,
                                sizeof name - 1, NULL, NULL);
    if (n <= 4) continue;
    name[n] = '\0';
    if (strcmp(name + n - 4, ".gen") != 0 || strncmp(name, prefix, plen) != 0)
      continue;
    name[n - 4] = '\0'; /* the name, not its generation count */
    each(name, arg);
  }
  CloseHandle(dir);
  return 0;
}

/* ----------------------------------- waits on a word of shared memory */

/* One manual-reset event per word, named after the segment and the word's
 * offset in it. A waiter opens (or makes) the event before it compares
 * the word, and a waker changes the word before it sets the event, so a
 * wake between the compare and the wait is not lost. A set event stays
 * set: a waiter that finds it set but the word unchanged resets it, and a
 * waiter whose wake that reset took sleeps no longer than SLICE_MS (its
 * caller rereads the word anyway). A wait with no deadline (a service
 * thread's, its word's one waiter: no other resets its wake) sleeps
 * IDLE_SLICE_MS at a time, so idle threads do not wake 50 times a second.
 * The event goes with its last handle. */
enum { SLICE_MS = 20, IDLE_SLICE_MS = 1000 };

static HANDLE word_event(const char *shm, const void *base,
                         _Atomic uint32_t *word, bool create) {
  char suffix[32], seg[SEG_NAME_MAX];
  snprintf(suffix, sizeof suffix, ".w%llx",
           (unsigned long long)((uintptr_t)word - (uintptr_t)base));
  if (!view_name(base, seg, sizeof seg)) snprintf(seg, sizeof seg, "%s", shm);
  wchar_t wname[NAME_MAX_W];
  if (!object_name(seg, suffix, wname, NAME_MAX_W)) return NULL;
  if (create) return CreateEventW(NULL, TRUE, FALSE, wname);
  return OpenEventW(EVENT_MODIFY_STATE, FALSE, wname);
}

int vp__os_word_wait(const char *shm, const void *base,
                     _Atomic uint32_t *word, uint32_t seen,
                     uint64_t timeout_ns) {
  HANDLE ev = word_event(shm, base, word, true);
  uint64_t deadline = timeout_ns == VP__OS_FOREVER
                          ? VP__OS_FOREVER
                          : vp__os_now_ns() + timeout_ns;
  int rc = 0;
  for (;;) {
    if (atomic_load(word) != seen) break;
    uint64_t now = vp__os_now_ns();
    if (deadline != VP__OS_FOREVER && now >= deadline) {
      rc = ETIMEDOUT;
      break;
    }
    DWORD ms = SLICE_MS;
    if (deadline != VP__OS_FOREVER && wait_ms(deadline - now) < ms)
      ms = wait_ms(deadline - now);
    if (!ev) { /* no event to be had: a bounded poll */
      Sleep(ms);
      continue;
    }
    if (deadline == VP__OS_FOREVER) ms = IDLE_SLICE_MS;
    DWORD w = WaitForSingleObject(ev, ms);
    if (w == WAIT_TIMEOUT) continue; /* a slice's end: reread the word */
    if (w != WAIT_OBJECT_0) break;
    if (atomic_load(word) != seen) break;
    ResetEvent(ev); /* an earlier wake's: the word is as it was */
  }
  if (ev) CloseHandle(ev);
  return rc;
}

void vp__os_word_wake(const char *shm, const void *base,
                      _Atomic uint32_t *word) {
  HANDLE ev = word_event(shm, base, word, false);
  if (!ev) return; /* no waiter has it open: none is waiting */
  SetEvent(ev);
  CloseHandle(ev);
}

/* ------------------------------- the lock of a shared segment, robust */

/* The shared part only marks the segment's lock as made (a corrupt
 * segment's lock is refused); the lock is the named mutex "<gen>.lock" of
 * the segment's generation. */
static const char plock_magic[8] = "vpWin32M";

int vp__os_plock_init(vp__os_plock_shared_t *s) {
  memset(s, 0, sizeof *s);
  memcpy(s->opaque, plock_magic, sizeof plock_magic);
  return 0;
}

int vp__os_plock_open(vp__os_plock_t *l, const char *shm,
                      vp__os_plock_shared_t *s) {
  l->shared = s;
  l->handle = NULL;
  char seg[SEG_NAME_MAX];
  if (!view_name(s, seg, sizeof seg)) snprintf(seg, sizeof seg, "%s", shm);
  wchar_t wname[NAME_MAX_W];
  if (!object_name(seg, ".lock", wname, NAME_MAX_W)) return ENAMETOOLONG;
  HANDLE h = CreateMutexW(NULL, FALSE, wname);
  if (!h) return last_errno();
  l->handle = h;
  return 0;
}

void vp__os_plock_close(vp__os_plock_t *l) {
  if (l->handle) CloseHandle(l->handle);
  l->handle = NULL;
}

int vp__os_plock_lock(vp__os_plock_t *l, uint32_t timeout_ms) {
  if (memcmp(l->shared->opaque, plock_magic, sizeof plock_magic) != 0)
    return EINVAL;
  if (!l->handle) return EBADF;
  DWORD ms = timeout_ms >= INFINITE ? INFINITE - 1 : timeout_ms;
  switch (WaitForSingleObject(l->handle, ms)) {
  case WAIT_OBJECT_0:
    return 0;
  case WAIT_ABANDONED: /* its holder's thread ended holding it */
    return EOWNERDEAD;
  case WAIT_TIMEOUT:
    return timeout_ms == 0 ? EBUSY : ETIMEDOUT;
  default:
    return last_errno();
  }
}

void vp__os_plock_unlock(vp__os_plock_t *l) { ReleaseMutex(l->handle); }

#endif /* _WIN32 */
