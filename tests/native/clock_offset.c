/* An LD_PRELOAD shim for tests: the process's wall clock (gettimeofday, CLOCK_REALTIME)
 * runs KVS_CLOCK_OFFSET_S seconds ahead (negative: behind) of the machine's. A Redis node
 * started with it answers TIME (and its scripts read the time) on a skewed clock. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
static long offset_s(void) {
  static long o = 0; static int read = 0;
  if (!read) { const char *s = getenv("KVS_CLOCK_OFFSET_S"); o = s ? atol(s) : 0; read = 1; }
  return o;
}
int gettimeofday(struct timeval *tv, void *tz) {
  static int (*real)(struct timeval *, void *) = 0;
  if (!real) real = dlsym(RTLD_NEXT, "gettimeofday");
  int r = real(tv, tz);
  if (r == 0 && tv) tv->tv_sec += offset_s();
  return r;
}
int clock_gettime(clockid_t c, struct timespec *ts) {
  static int (*real)(clockid_t, struct timespec *) = 0;
  if (!real) real = dlsym(RTLD_NEXT, "clock_gettime");
  int r = real(c, ts);
  if (r == 0 && ts && c == CLOCK_REALTIME) ts->tv_sec += offset_s();
  return r;
}
