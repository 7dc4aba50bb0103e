/* The fixture of the streaming tests (test_stream.c, test_staging.c,
 * test_weights.c): options, models whose weights have host sources with
 * known bytes, and checks of acquired bytes on either backend. */
#ifndef VP_STREAM_FIXTURE_H
#define VP_STREAM_FIXTURE_H

#include <stdatomic.h>

#include "test.h"

/* A VBAR with n weights whose sources live in one host buffer. */
typedef struct model {
  vp_vbar_t v;
  uint64_t base;
  size_t n;
  uint64_t *off, *size;
  unsigned char *buf; /* sources */
  uint64_t buf_size;
  vp_source_t *srcs;
  vp_weight_t *w;
} model_t;

enum { SRC_CONTIG = 0, SRC_SCATTER = 1 };

/* A kernel: compare the bytes at ptr with src when the stream gets here. */
typedef struct checks {
  atomic_uint_fast64_t fails, runs, launched;
} checks_t;

typedef struct chk {
  const unsigned char *src;
  uint64_t ptr, size;
  checks_t *c;
} chk_t;

/* A slow reader: sleeps, then checksums the bytes at ptr. */
typedef struct slow {
  uint64_t ptr, size;
  unsigned ms;
  const unsigned char *expect;
  atomic_int done;
  atomic_int ok; /* 1 = the bytes matched */
} slow_t;

/* A kernel that writes a pattern (a caller filling an EMPTY weight). */
typedef struct fill {
  uint64_t ptr, size;
  const void *src;
} fill_t;

bool is_sim(test_ctx_t *ctx);
void sopts(test_ctx_t *ctx, vp_options_t *o, uint64_t staging_pages,
           uint64_t lookahead, int sim_streams);
void model_init(model_t *m, vp_device_t dev, uint64_t vbar_size, size_t n,
                const uint64_t *off, const uint64_t *size, int layout,
                uint64_t key);
void model_uniform(model_t *m, vp_device_t dev, uint64_t vbar_size, size_t n,
                   uint64_t size, int layout, uint64_t key);
void model_random(model_t *m, vp_device_t dev, uint64_t vbar_size, uint64_t lo,
                  uint64_t hi, int layout, test_rng_t *rng, uint64_t key);
void model_free(model_t *m);
vp_stats_t dstats(vp_device_t dev);
void chk_fn(void *arg);
void launch_check(vp_device_t dev, vp_stream_t s, uint64_t ptr, const void *src,
                  uint64_t size, checks_t *c);
void checks_expect_clean(vp_device_t dev, vp_stream_t s, checks_t *c);
void verify_resident(vp_device_t dev, vp_stream_t s, uint64_t ptr,
                     const void *src, uint64_t size);
void verify_staged_sim(vp_device_t dev, vp_stream_t s, uint64_t ptr,
                       const void *src, uint64_t size);
void verify_acquired(test_ctx_t *ctx, vp_device_t dev, vp_stream_t s,
                     uint64_t ptr, uint8_t flags, const void *src,
                     uint64_t size);
bool in_vbar(const model_t *m, uint64_t ptr);
bool map_has_pin(vp_vbar_t v);
bool slow_ok(slow_t *k);
bool slow_done(slow_t *k);
void slow_fn(void *arg);
void fill_fn(void *arg);

#endif /* VP_STREAM_FIXTURE_H */
