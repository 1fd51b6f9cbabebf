/* The C tests' checks, for any thread: CHECK(cond) counts a check and reports a failed one
 * with the library's last error message (`cond` is evaluated before the lock is taken: it
 * may be a collective call that blocks); CHECK_OK(call) checks for HPS_STATUS_OK; HAS(text)
 * tells whether the last error message contains `text`; check_summary() prints the counts
 * and returns the program's exit status. Included by one file per program. */
#ifndef HPS_TESTS_CAPI_CHECK_H_
#define HPS_TESTS_CAPI_CHECK_H_

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "hpshard/hpshard.h"

static int g_failures = 0;
static int g_checks = 0;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(cond)                                                                              \
  do {                                                                                           \
    const int ok_ = (cond) ? 1 : 0;                                                              \
    pthread_mutex_lock(&g_lock);                                                                 \
    ++g_checks;                                                                                  \
    if (!ok_) {                                                                                  \
      ++g_failures;                                                                              \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: '%s')\n", __FILE__, __LINE__, #cond, \
              hps_last_error_message());                                                         \
    }                                                                                            \
    pthread_mutex_unlock(&g_lock);                                                               \
  } while (0)
#define CHECK_OK(call) CHECK((call) == HPS_STATUS_OK)
#define HAS(text) (strstr(hps_last_error_message(), (text)) != NULL)

static inline int check_summary(void) {
  printf("%d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

#endif /* HPS_TESTS_CAPI_CHECK_H_ */
