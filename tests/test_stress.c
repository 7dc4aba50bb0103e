/* Multi-threaded stress: 4 threads fault, check, launch readers, unpin and
 * squeeze 3 VBARs of one device (worker streams), for a bounded count.
 * Data integrity: a page holds the pattern of (VBAR, page, generation)
 * from the first time a thread sees that generation; a reader launched on
 * a stream before the unpin (the fence) still sees it intact. Meant to be
 * clean under TSan. */
#include "test.h"

#include <pthread.h>
#include <stdatomic.h>

#define NV 3
#define NP 8
#define NT 4
#define MAXN 3

typedef struct shared {
  vp_device_t dev;
  vp_vbar_t v[NV];
  uint64_t base[NV], ps, seed;
  long iters;
  pthread_mutex_t mu[NV][NP];
  uint32_t written[NV][NP]; /* generation whose pattern the page holds */
  atomic_long faults_ok, misses, checks, launches, launch_bad;
} shared_t;

typedef struct reader {
  shared_t *sh;
  const unsigned char *addr;
  size_t size;
  uint64_t want;
} reader_t;

static uint64_t checksum(const unsigned char *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static uint64_t key(int k, uint64_t p, uint32_t gen) {
  return ((uint64_t)k << 40) ^ (p << 32) ^ gen;
}

/* Runs on a stream's worker thread, after the thread unpinned the page
 * with a fence on that stream: the page must still be there. */
static void reader_fn(void *arg) {
  reader_t *r = arg;
  if (checksum(r->addr, r->size) != r->want)
    atomic_fetch_add(&r->sh->launch_bad, 1);
  free(r);
}

typedef struct worker {
  shared_t *sh;
  int id;
} worker_t;

static void *stress_thread(void *arg) {
  worker_t *w = arg;
  shared_t *sh = w->sh;
  uint64_t ps = sh->ps;
  test_rng_t rng;
  test_rng_seed(&rng, sh->seed * 31 + (uint64_t)w->id);
  vp_stream_t s;
  ASSERT_OK(vp_stream_create(sh->dev, &s));
  unsigned char *buf = malloc(ps), *want = malloc(ps);
  ASSERT_NOT_NULL(buf);
  ASSERT_NOT_NULL(want);
  for (long i = 0; i < sh->iters; i++) {
    int k = (int)test_rand_below(&rng, NV);
    uint64_t r = test_rand_below(&rng, 100);
    if (r < 6) {
      ASSERT_OK(vp_vbar_prioritize(sh->v[k]));
      continue;
    }
    if (r < 9) {
      ASSERT_OK(vp_vbar_deprioritize(sh->v[k]));
      continue;
    }
    if (r < 12) {
      ASSERT_OK(vp_vbar_free_memory(sh->v[k], ps * (1 + r % 3), NULL));
      continue;
    }
    if (r < 14) {
      ASSERT_OK(vp_device_free_memory(sh->dev, ps, NULL));
      continue;
    }
    uint64_t p = test_rand_below(&rng, NP), n = 1 + test_rand_below(&rng, MAXN);
    if (p + n > NP) n = NP - p;
    uint32_t gens[MAXN];
    int rc = vp_fault(sh->v[k], p * ps, n * ps, gens, MAXN);
    if (rc == VP_MISS) {
      atomic_fetch_add(&sh->misses, 1);
      continue;
    }
    ASSERT_OK(rc);
    atomic_fetch_add(&sh->faults_ok, 1);
    for (uint64_t j = 0; j < n; j++) {
      uint64_t pg = p + j, addr = sh->base[k] + pg * ps;
      ASSERT_NE_U64(gens[j], 0);
      test_pattern(want, ps, key(k, pg, gens[j]));
      pthread_mutex_lock(&sh->mu[k][pg]);
      if (sh->written[k][pg] != gens[j]) {
        ASSERT_OK(vp_copy_to_device(sh->dev, addr, want, ps, s));
        ASSERT_OK(vp_stream_synchronize(sh->dev, s));
        sh->written[k][pg] = gens[j];
      } else {
        ASSERT_OK(vp_copy_to_host(sh->dev, buf, addr, ps, s));
        ASSERT_OK(vp_stream_synchronize(sh->dev, s));
        if (memcmp(buf, want, ps) != 0)
          TEST_FAIL("thread %d: vbar %d page %" PRIu64 " generation %u: "
                    "data changed while the generation did not",
                    w->id, k, pg, gens[j]);
        atomic_fetch_add(&sh->checks, 1);
      }
      pthread_mutex_unlock(&sh->mu[k][pg]);
    }
    if (test_rand_below(&rng, 2)) {
      /* A "kernel" reading the first page, queued before the unpin. */
      reader_t *rd = malloc(sizeof *rd);
      ASSERT_NOT_NULL(rd);
      rd->sh = sh;
      rd->addr = (const unsigned char *)(uintptr_t)(sh->base[k] + p * ps);
      rd->size = ps;
      test_pattern(want, ps, key(k, p, gens[0]));
      rd->want = checksum(want, ps);
      ASSERT_OK(vp_sim_launch(sh->dev, s, reader_fn, rd));
      atomic_fetch_add(&sh->launches, 1);
    }
    ASSERT_OK(vp_unpin(sh->v[k], p * ps, n * ps, s));
  }
  ASSERT_OK(vp_stream_synchronize(sh->dev, s));
  ASSERT_OK(vp_stream_destroy(sh->dev, s));
  free(buf);
  free(want);
  return NULL;
}

TEST(stress_threads, TEST_SIM_ONLY) {
  shared_t *sh = calloc(1, sizeof *sh);
  ASSERT_NOT_NULL(sh);
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.sim_streams = VP_SIM_WORKER;
  sh->ps = opts.page_size;
  sh->dev = test_open_cap(ctx, &opts, 10);
  sh->seed = test_seed();
  sh->iters = (long)test_scale(TEST_TSAN ? 1600 : 3000);
  test_note("seed %" PRIu64, sh->seed);
  for (int k = 0; k < NV; k++) {
    sh->v[k] = test_vbar(sh->dev, NP * sh->ps);
    sh->base[k] = test_vbar_base(sh->v[k]);
    if (k == 1) ASSERT_OK(vp_vbar_set_order(sh->v[k], VP_ORDER_INTERLEAVED));
    for (int p = 0; p < NP; p++) pthread_mutex_init(&sh->mu[k][p], NULL);
  }
  pthread_t th[NT];
  worker_t w[NT];
  for (int t = 0; t < NT; t++) {
    w[t] = (worker_t){sh, t};
    ASSERT_EQ_INT(pthread_create(&th[t], NULL, stress_thread, &w[t]), 0);
  }
  for (int t = 0; t < NT; t++) ASSERT_EQ_INT(pthread_join(th[t], NULL), 0);
  vp_stats_t s = test_dev_stats(sh->dev);
  test_log("%ld iterations x %d threads: %ld faults, %ld misses, %ld checks, "
           "%ld launches, %" PRIu64 " evictions (%" PRIu64 " waited)",
           sh->iters, NT, atomic_load(&sh->faults_ok),
           atomic_load(&sh->misses), atomic_load(&sh->checks),
           atomic_load(&sh->launches), s.pages_evicted, s.evict_waits);
  ASSERT_EQ_INT(atomic_load(&sh->launch_bad), 0);
  ASSERT_GT_INT(atomic_load(&sh->faults_ok), 0);
  ASSERT_GT_INT(atomic_load(&sh->checks), 0);
  ASSERT_GT_U64(s.pages_evicted, 0);
  ASSERT_EQ_U64(s.pinned_bytes, 0);
  ASSERT_LE_U64(test_info(sh->dev).committed, 10 * sh->ps);
  uint64_t faults = (uint64_t)atomic_load(&sh->faults_ok) +
                    (uint64_t)atomic_load(&sh->misses);
  ASSERT_EQ_U64(s.faults, faults);
  for (int k = 0; k < NV; k++) ASSERT_OK(vp_vbar_destroy(sh->v[k]));
  ASSERT_OK(vp_device_close(sh->dev));
  for (int k = 0; k < NV; k++)
    for (int p = 0; p < NP; p++) pthread_mutex_destroy(&sh->mu[k][p]);
  free(sh);
}
