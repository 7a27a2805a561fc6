/* Prints the native stack of a crashing process (SIGSEGV, SIGBUS, SIGABRT) to stderr, for
 * machines without gdb (the GPU image). Python's faulthandler shows only Python frames.
 *
 *   gcc -shared -fPIC -o /tmp/segv_backtrace.so tests/native/segv_backtrace.c
 *   LD_PRELOAD=/tmp/segv_backtrace.so python3 ...
 * (bash benchmarks/device_run.sh badinput does this for the CUDA bad-input matrix.)
 */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void print_stack(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  const char* head = "\n*** native stack at signal ***\n";
  write(STDERR_FILENO, head, strlen(head));
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  void* warm[1];
  backtrace(warm, 1); /* loads libgcc's unwinder now, not inside the handler */
  signal(SIGSEGV, print_stack);
  signal(SIGBUS, print_stack);
  signal(SIGABRT, print_stack);
}
