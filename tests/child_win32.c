/* The runner's test processes on Windows (compat.h): no fork, so a test
 * runs in this program started again with --child; a job object ends
 * whatever it leaves running, as the process group does on POSIX. Empty
 * elsewhere. */
#ifdef _WIN32

#define WIN32_LEAN_AND_MEAN
#include <windows.h>

#include <io.h>
#include <stdio.h>
#include <string.h>

#include "compat.h"

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
  if (!CreateProcessA(self, cmd, NULL, NULL, TRUE, CREATE_SUSPENDED, NULL,
                      NULL, &si, &pi)) {
    snprintf(why, len, "CreateProcess: Win32 error %lu",
             (unsigned long)GetLastError());
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

#endif /* _WIN32 */
