/* Weights rewritten in place while work queued before their release may
 * still read them (tests/test_refill.c): one scenario per trigger, run on
 * the simulated device (test_refill.c) and on CUDA (test_gpu.c), each
 * with its own slow reader. */
#ifndef VP_REFILL_H
#define VP_REFILL_H

#include "test.h"

enum {
  REFILL_OTHER_STREAM, /* set_source, then acquire on another stream */
  REFILL_SAME_STREAM,  /* set_source, then acquire on the reader's stream */
  REFILL_PREFETCH,     /* set_source, then prefetch fills it in place */
  REFILL_RECREATE,     /* destroy + create over the same range */
  REFILL_EMPTY,        /* made anew without a source: the caller writes */
  REFILL_VARIANTS
};

extern const char *const refill_names[REFILL_VARIANTS];

/* A reader queued on `stream` that waits long (~200 ms), then reads `size`
 * bytes at `ptr`; done() says whether it ended and saw `expect`. */
typedef struct refill_reader {
  void (*launch)(struct refill_reader *r, vp_device_t dev, vp_stream_t stream,
                 uint64_t ptr, uint64_t size, const void *expect);
  bool (*running)(struct refill_reader *r);
  bool (*saw_expected)(struct refill_reader *r); /* after a sync */
  void *state;
} refill_reader_t;

/* One trigger on a device opened with `o` (two weights, one page each,
 * resident): the reader sees the old bytes, the acquire after the rewrite
 * the new ones. */
void refill_run(test_ctx_t *ctx, vp_options_t *o, int variant,
                refill_reader_t *reader);

#endif /* VP_REFILL_H */
