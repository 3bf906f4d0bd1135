/* Check helpers shared by the C examples: CHECK counts a failed condition, OK exits on a failed
 * call (printing uniop's message), expect_error checks a call's code and message. */
#ifndef UNIOP_EXAMPLES_CHECK_H
#define UNIOP_EXAMPLES_CHECK_H

#include "uniop.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      failures++;                                          \
    }                                                      \
  } while (0)

#define OK(call)                                                                      \
  do {                                                                                \
    uniopStatus s_ = (call);                                                          \
    if (s_ != UNIOP_SUCCESS) {                                                        \
      fprintf(stderr, "FAIL %s:%d: %s -> %d: %s\n", __FILE__, __LINE__, #call, s_, \
              uniopGetRecentErrMsg());                                                \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

/* Each bad input returns its code and a message naming what was wrong. */
static void expect_error(const char *what, uniopStatus got, uniopStatus want, const char *fragment) {
  const char *msg = uniopGetRecentErrMsg();
  int good = got == want && strstr(msg, fragment) != NULL;
  CHECK(good, "%s: got %d (%s), want %d with \"%s\"", what, got, msg, want, fragment);
  printf("%-28s %d  %s\n", what, got, good ? "PASS" : "FAIL");
}

#endif
