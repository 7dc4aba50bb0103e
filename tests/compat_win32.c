/* The POSIX calls of compat.h on Windows; empty elsewhere. */
#ifdef _WIN32

#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#include <tlhelp32.h>

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compat.h"

int setenv(const char *name, const char *value, int overwrite) {
  if (!overwrite && getenv(name)) return 0;
  return _putenv_s(name, value) == 0 ? 0 : -1;
}

/* An empty value removes the variable (_putenv_s's rule). */
int unsetenv(const char *name) { return _putenv_s(name, "") == 0 ? 0 : -1; }

char *mkdtemp(char *tmpl) {
  size_t n = strlen(tmpl);
  if (n < 6 || strcmp(tmpl + n - 6, "XXXXXX") != 0) {
    errno = EINVAL;
    return NULL;
  }
  static const char digits[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  unsigned x = (unsigned)GetTickCount() ^ (unsigned)GetCurrentProcessId() << 12;
  for (int tries = 0; tries < 100; tries++) {
    for (size_t i = n - 6; i < n; i++) {
      x = x * 1103515245u + 12345u;
      tmpl[i] = digits[(x >> 16) % (sizeof digits - 1)];
    }
    if (CreateDirectoryA(tmpl, NULL)) return tmpl;
    if (GetLastError() != ERROR_ALREADY_EXISTS) break;
  }
  errno = EEXIST;
  return NULL;
}

int pipe(int fds[2]) { return _pipe(fds, 1 << 16, _O_BINARY); }

static ssize_t at_offset(int fd, void *buf, size_t n, off_t off, int write) {
  HANDLE h = (HANDLE)_get_osfhandle(fd);
  if (h == INVALID_HANDLE_VALUE) {
    errno = EBADF;
    return -1;
  }
  OVERLAPPED ov;
  memset(&ov, 0, sizeof ov);
  ov.Offset = (DWORD)(uint64_t)off;
  ov.OffsetHigh = (DWORD)((uint64_t)off >> 32);
  DWORD done = 0, want = n > (1u << 30) ? (1u << 30) : (DWORD)n;
  BOOL ok = write ? WriteFile(h, buf, want, &done, &ov)
                  : ReadFile(h, buf, want, &done, &ov);
  if (!ok) {
    if (!write && GetLastError() == ERROR_HANDLE_EOF) return 0;
    errno = EIO;
    return -1;
  }
  return (ssize_t)done;
}

ssize_t pread(int fd, void *buf, size_t n, off_t off) {
  return at_offset(fd, buf, n, off, 0);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
  return at_offset(fd, (void *)buf, n, off, 1);
}

long sysconf(int name) {
  if (name != _SC_PAGESIZE) {
    errno = EINVAL;
    return -1;
  }
  SYSTEM_INFO si;
  GetSystemInfo(&si);
  return (long)si.dwPageSize;
}

static void *map_file(size_t len, int prot, int flags, int fd, off_t off) {
  bool write = prot & PROT_WRITE, priv = flags == MAP_PRIVATE;
  HANDLE m = CreateFileMappingW((HANDLE)_get_osfhandle(fd), NULL,
                                priv ? PAGE_WRITECOPY
                                : write ? PAGE_READWRITE : PAGE_READONLY,
                                0, 0, NULL);
  if (!m) {
    errno = EACCES;
    return MAP_FAILED;
  }
  void *p = MapViewOfFile(m, priv ? FILE_MAP_COPY
                          : write ? FILE_MAP_WRITE : FILE_MAP_READ,
                          (DWORD)((uint64_t)off >> 32), (DWORD)off, len);
  CloseHandle(m); /* the view keeps the mapping */
  if (!p) errno = EINVAL;
  return p ? p : MAP_FAILED;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
  if (!addr && fd != -1 && (flags == MAP_SHARED || flags == MAP_PRIVATE))
    return map_file(len, prot, flags, fd, off);
  if (addr || fd != -1 || flags != (MAP_PRIVATE | MAP_ANONYMOUS)) {
    errno = ENOSYS;
    return MAP_FAILED;
  }
  DWORD protect = (prot & PROT_WRITE)  ? PAGE_READWRITE
                  : (prot & PROT_READ) ? PAGE_READONLY
                                       : PAGE_NOACCESS;
  void *p = VirtualAlloc(NULL, len, MEM_RESERVE | MEM_COMMIT, protect);
  if (!p) {
    errno = ENOMEM;
    return MAP_FAILED;
  }
  return p;
}

int munmap(void *addr, size_t len) {
  (void)len;
  MEMORY_BASIC_INFORMATION r;
  if (VirtualQuery(addr, &r, sizeof r) == sizeof r && r.Type == MEM_MAPPED)
    return UnmapViewOfFile(addr) ? 0 : -1;
  return VirtualFree(addr, 0, MEM_RELEASE) ? 0 : -1;
}

static char g_dlerror[256];

void *dlopen(const char *name, int flags) {
  (void)flags;
  HMODULE lib = LoadLibraryA(name);
  if (!lib)
    snprintf(g_dlerror, sizeof g_dlerror, "LoadLibrary(%s): Win32 error %lu",
             name, (unsigned long)GetLastError());
  return (void *)lib;
}

void *dlsym(void *lib, const char *symbol) {
  FARPROC f = GetProcAddress((HMODULE)lib, symbol);
  void *p;
  memcpy(&p, &f, sizeof p);
  return p;
}

const char *dlerror(void) { return g_dlerror; }

int test_fd_count(void) {
  DWORD n = 0;
  return GetProcessHandleCount(GetCurrentProcess(), &n) ? (int)n : -1;
}

/* Every region that is not free, reserved or committed. */
uint64_t test_vm_size(void) {
  uint64_t n = 0;
  MEMORY_BASIC_INFORMATION mbi;
  for (char *p = NULL; VirtualQuery(p, &mbi, sizeof mbi) == sizeof mbi;
       p = (char *)mbi.BaseAddress + mbi.RegionSize) {
    if (mbi.State != MEM_FREE) n += mbi.RegionSize;
    if ((uintptr_t)mbi.BaseAddress + mbi.RegionSize < (uintptr_t)p) break;
  }
  return n;
}

int test_thread_count(void) {
  HANDLE snap = CreateToolhelp32Snapshot(TH32CS_SNAPTHREAD, 0);
  if (snap == INVALID_HANDLE_VALUE) return -1;
  THREADENTRY32 te;
  te.dwSize = sizeof te;
  int n = 0;
  DWORD me = GetCurrentProcessId();
  for (BOOL ok = Thread32First(snap, &te); ok; ok = Thread32Next(snap, &te))
    n += te.th32OwnerProcessID == me;
  CloseHandle(snap);
  return n;
}

const char *test_tmp_dir(void) {
  static char dir[MAX_PATH + 1];
  if (!dir[0]) {
    DWORD n = GetTempPathA(sizeof dir, dir);
    if (n == 0 || n >= sizeof dir)
      snprintf(dir, sizeof dir, "C:\\Windows\\Temp");
    else if (dir[n - 1] == '\\' || dir[n - 1] == '/') dir[n - 1] = '\0';
  }
  return dir;
}

#endif /* _WIN32 */
