/* The runner's test processes on Windows (compat.h): no fork, so a test
 * runs in this program started again with --child; a job object ends
 * whatever it leaves running, as the process group does on POSIX. Empty
 * elsewhere. */
#ifdef _WIN32

#define WIN32_LEAN_AND_MEAN
#include <windows.h>

#include <errno.h>
#include <io.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "compat.h"
#include "test.h"

void test_self_exe(char *path, size_t len) {
  DWORD n = GetModuleFileNameA(NULL, path, (DWORD)len);
  if (n == 0 || n >= len) snprintf(path, len, "runner.exe");
}

/* A new temporary file that the child inherits as its stdout and stderr,
 * deleted when the runner closes it. */
static HANDLE output_file(void) {
  char dir[MAX_PATH + 1], path[MAX_PATH + 1];
  if (!GetTempPathA(sizeof dir, dir) ||
      !GetTempFileNameA(dir, "vpt", 0, path))
    return INVALID_HANDLE_VALUE;
  SECURITY_ATTRIBUTES sa = {sizeof sa, NULL, TRUE};
  return CreateFileA(path, GENERIC_READ | GENERIC_WRITE,
                     FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                     &sa, CREATE_ALWAYS,
                     FILE_ATTRIBUTE_TEMPORARY | FILE_FLAG_DELETE_ON_CLOSE,
                     NULL);
}

/* A job whose processes die when it is closed. */
static HANDLE kill_on_close_job(void) {
  HANDLE job = CreateJobObjectA(NULL, NULL);
  if (!job) return NULL;
  JOBOBJECT_EXTENDED_LIMIT_INFORMATION li;
  memset(&li, 0, sizeof li);
  li.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE;
  SetInformationJobObject(job, JobObjectExtendedLimitInformation, &li,
                          sizeof li);
  return job;
}

/* CreateProcess with a few tries: Wine has been seen to refuse a start
 * now and then under load (ERROR_INTERNAL_ERROR). 0, else its error. */
static DWORD start_process(const char *self, char *cmd, DWORD flags,
                           STARTUPINFOA *si, PROCESS_INFORMATION *pi) {
  DWORD err = 0;
  for (int tries = 0; tries < 3; tries++) {
    if (tries) Sleep(200);
    if (CreateProcessA(self, cmd, NULL, NULL, TRUE, flags, NULL, NULL, si, pi))
      return 0;
    err = GetLastError();
  }
  return err;
}

/* The child's end: "" for exit 0, else why. */
static void exit_words(HANDLE proc, char *why, size_t len) {
  DWORD code = 1;
  GetExitCodeProcess(proc, &code);
  if (code == 0) why[0] = '\0';
  else if (code >= 0xC0000000u) snprintf(why, len, "exception 0x%08lx",
                                         (unsigned long)code);
  else snprintf(why, len, "exit %lu", (unsigned long)code);
}

FILE *test_child_run(const char *self, const char *full, unsigned timeout_s,
                     char *why, size_t len) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "\"%s\" --child %s", self, full);
  HANDLE out = output_file();
  if (out == INVALID_HANDLE_VALUE) {
    snprintf(why, len, "temporary file: Win32 error %lu",
             (unsigned long)GetLastError());
    return NULL;
  }
  STARTUPINFOA si;
  memset(&si, 0, sizeof si);
  si.cb = sizeof si;
  si.dwFlags = STARTF_USESTDHANDLES;
  si.hStdInput = GetStdHandle(STD_INPUT_HANDLE);
  si.hStdOutput = out;
  si.hStdError = out;
  PROCESS_INFORMATION pi;
  HANDLE job = kill_on_close_job();
  /* Suspended until it is in the job: none of its children escapes. */
  DWORD err = start_process(self, cmd, CREATE_SUSPENDED, &si, &pi);
  if (err) {
    snprintf(why, len, "CreateProcess: Win32 error %lu", (unsigned long)err);
    CloseHandle(out);
    if (job) CloseHandle(job);
    return NULL;
  }
  if (job) AssignProcessToJobObject(job, pi.hProcess);
  ResumeThread(pi.hThread);
  CloseHandle(pi.hThread);
  if (WaitForSingleObject(pi.hProcess, timeout_s * 1000u) == WAIT_TIMEOUT) {
    TerminateProcess(pi.hProcess, 1);
    WaitForSingleObject(pi.hProcess, INFINITE);
    snprintf(why, len, "timeout");
  } else {
    exit_words(pi.hProcess, why, len);
  }
  CloseHandle(pi.hProcess);
  if (job) CloseHandle(job); /* whatever the test left running */
  SetFilePointer(out, 0, NULL, FILE_BEGIN);
  int fd = _open_osfhandle((intptr_t)out, _O_RDONLY | _O_BINARY);
  FILE *f = fd >= 0 ? _fdopen(fd, "rb") : NULL;
  if (!f) {
    snprintf(why, len, "its output cannot be read");
    if (fd >= 0) _close(fd);
    else CloseHandle(out);
  }
  return f;
}

static LONG WINAPI crash_exit(EXCEPTION_POINTERS *e) {
  DWORD code = e->ExceptionRecord->ExceptionCode;
  fflush(stdout);
  fprintf(stderr, "exception 0x%08lx at %p\n", (unsigned long)code,
          e->ExceptionRecord->ExceptionAddress);
  fflush(stderr);
  TerminateProcess(GetCurrentProcess(), code);
  return EXCEPTION_EXECUTE_HANDLER;
}

void test_child_guard(void) {
  SetErrorMode(SEM_FAILCRITICALERRORS | SEM_NOGPFAULTERRORBOX);
  SetUnhandledExceptionFilter(crash_exit);
}

/* ------------------------------------------------------------ peers */

uintptr_t test_image_base(void) { return (uintptr_t)GetModuleHandleA(NULL); }

/* The processes this one started, by pid: their handles keep their exit
 * codes (and their pids from reuse) until waited for. */
typedef struct proc {
  int pid;
  HANDLE handle;
  bool stopped;
} proc_t;
static proc_t g_procs[256]; /* ledger_join_leave_many: one a ledger slot */

static proc_t *proc_of(int pid) {
  for (size_t i = 0; i < sizeof g_procs / sizeof *g_procs; i++)
    if (g_procs[i].handle && g_procs[i].pid == pid) return &g_procs[i];
  return NULL;
}

static proc_t *proc_add(int pid, HANDLE handle) {
  for (size_t i = 0; i < sizeof g_procs / sizeof *g_procs; i++)
    if (!g_procs[i].handle) {
      g_procs[i] = (proc_t){pid, handle, false};
      return &g_procs[i];
    }
  return NULL;
}

/* A pipe whose `theirs` end the peer inherits and whose other end stays
 * here. */
static bool peer_pipe(HANDLE *read, HANDLE *write, bool theirs_reads) {
  SECURITY_ATTRIBUTES sa = {sizeof sa, NULL, TRUE};
  if (!CreatePipe(read, write, &sa, 0)) return false;
  SetHandleInformation(theirs_reads ? *write : *read, HANDLE_FLAG_INHERIT, 0);
  return true;
}

int test_spawn_peer(const char *args, int *to, int *from, int *pid) {
  HANDLE down_r, down_w, up_r, up_w;
  if (!peer_pipe(&down_r, &down_w, true)) {
    fprintf(stderr, "CreatePipe: Win32 error %lu\n", GetLastError());
    return -1;
  }
  if (!peer_pipe(&up_r, &up_w, false)) {
    fprintf(stderr, "CreatePipe: Win32 error %lu\n", GetLastError());
    CloseHandle(down_r);
    CloseHandle(down_w);
    return -1;
  }
  const char *self = test_self_path();
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "\"%s\" --peer %s %llu %llu", self, args,
           (unsigned long long)(uintptr_t)down_r,
           (unsigned long long)(uintptr_t)up_w);
  STARTUPINFOA si;
  memset(&si, 0, sizeof si);
  si.cb = sizeof si;
  si.dwFlags = STARTF_USESTDHANDLES; /* the test's output file */
  si.hStdInput = GetStdHandle(STD_INPUT_HANDLE);
  si.hStdOutput = GetStdHandle(STD_OUTPUT_HANDLE);
  si.hStdError = GetStdHandle(STD_ERROR_HANDLE);
  PROCESS_INFORMATION pi;
  /* It joins this test's job: it dies with the test. */
  DWORD err = start_process(self, cmd, 0, &si, &pi);
  bool ok = err == 0;
  CloseHandle(down_r);
  CloseHandle(up_w);
  proc_t *slot = ok ? proc_add((int)pi.dwProcessId, pi.hProcess) : NULL;
  if (!ok)
    fprintf(stderr, "CreateProcess(%s): Win32 error %lu\n", cmd,
            (unsigned long)err);
  else if (!slot)
    fprintf(stderr, "more than %zu peers\n", sizeof g_procs / sizeof *g_procs);
  if (!slot) {
    if (ok) {
      TerminateProcess(pi.hProcess, 1);
      CloseHandle(pi.hProcess);
      CloseHandle(pi.hThread);
    }
    CloseHandle(down_w);
    CloseHandle(up_r);
    return -1;
  }
  CloseHandle(pi.hThread);
  *pid = (int)pi.dwProcessId;
  *to = _open_osfhandle((intptr_t)down_w, _O_WRONLY | _O_BINARY);
  *from = _open_osfhandle((intptr_t)up_r, _O_RDONLY | _O_BINARY);
  if (*to < 0 || *from < 0) fprintf(stderr, "no descriptor for a pipe\n");
  return *to >= 0 && *from >= 0 ? 0 : -1;
}

/* ntdll's process-wide suspend and resume (every thread at once). */
typedef LONG(NTAPI *nt_process_fn)(HANDLE);

static bool nt_process(const char *name, HANDLE h) {
  FARPROC f = GetProcAddress(GetModuleHandleA("ntdll.dll"), name);
  if (!f) return false;
  nt_process_fn fn;
  memcpy(&fn, &f, sizeof fn);
  return fn(h) >= 0;
}

/* The exit code a SIGKILLed process ends with: told apart from exit(n). */
#define KILLED_CODE(sig) (0xDEAD0000u | (unsigned)(sig))

int kill(int pid, int sig) {
  if (pid == (int)GetCurrentProcessId() && sig == SIGKILL)
    TerminateProcess(GetCurrentProcess(), KILLED_CODE(sig)); /* no return */
  proc_t *p = proc_of(pid);
  if (!p) {
    errno = ESRCH;
    return -1;
  }
  bool ok = true;
  if (sig == SIGKILL) ok = TerminateProcess(p->handle, KILLED_CODE(sig));
  else if (sig == SIGSTOP) ok = p->stopped = nt_process("NtSuspendProcess",
                                                         p->handle);
  else if (sig == SIGCONT) {
    ok = nt_process("NtResumeProcess", p->handle);
    if (ok) p->stopped = false;
  } else if (sig != 0) ok = false;
  if (!ok) errno = EINVAL;
  return ok ? 0 : -1;
}

int waitpid(int pid, int *status, int options) {
  proc_t *p = proc_of(pid);
  if (!p) {
    errno = ECHILD;
    return -1;
  }
  int st = 0;
  if ((options & WUNTRACED) && p->stopped) {
    st = 0x7f | (SIGSTOP << 8);
  } else {
    WaitForSingleObject(p->handle, INFINITE);
    DWORD code = 1;
    GetExitCodeProcess(p->handle, &code);
    if ((code & 0xffff0000u) == KILLED_CODE(0)) st = (int)(code & 0x7f);
    else if (code >= 0xC0000000u) st = SIGSEGV;
    else st = (int)(code & 0xff) << 8;
    CloseHandle(p->handle);
    p->handle = NULL;
  }
  if (status) *status = st;
  return pid;
}

#endif /* _WIN32 */
