/* Randomized model-based test: thousands of random operations on several
 * VBARs of one simulated device, each checked against a small reference
 * model of the header's rules:
 *   - a fault is a miss at once if a non-resident page of its range ranks
 *     at or above min(watermark, limit);
 *   - else resident pages of the range are pinned, and if the budget
 *     (capacity - headroom) is short, pages are evicted: lower-priority
 *     VBARs first (bottom up, each in its order: highest rank first), then
 *     the faulting VBAR's own pages ranked above every page it needs, never
 *     a pinned page nor a higher-priority VBAR's; if that is not enough,
 *     the fault misses (what was evicted stays evicted: the library's
 *     choice, which the header leaves open);
 *   - the missing pages are committed in page order; a failed commit makes
 *     the fault a miss, pages committed before it stay resident, unpinned;
 *   - every eviction lowers its VBAR's watermark to the page's rank;
 *     prioritize moves to the top and lifts it; new VBARs go on top;
 *   - generations: unchanged while resident, new on every commit;
 *   - data written after a fill reads back while the generation holds.
 * The seed is printed (TEST_SEED reproduces a run); on a divergence the
 * last operations are printed. */
#include "test.h"

#include <stdarg.h>

#define MV 4
#define MAXP 16
#define MAXPINS 64
#define HIST 24

typedef struct mpage {
  bool res;
  uint32_t pins;
  uint32_t gen;      /* current generation, 0 = not seen yet */
  uint32_t last_gen; /* the previous commit's generation, 0 = unknown */
  bool valid;        /* holds our pattern for gen */
} mpage_t;

typedef struct mvbar {
  vp_vbar_t h;
  uint64_t base, uid;
  uint32_t n;
  int order;
  uint32_t rank[MAXP], by_rank[MAXP];
  uint32_t wm, limit; /* limit n = none */
  mpage_t pg[MAXP];
} mvbar_t;

typedef struct pinrec {
  int k;
  uint64_t off, size;
} pinrec_t;

typedef struct model {
  vp_device_t dev;
  uint64_t ps;
  mvbar_t v[MV];
  int prio[MV]; /* top first */
  uint64_t cap;
  int64_t head;
  uint32_t committed; /* pages */
  uint64_t fail_commit;
  pinrec_t pins[MAXPINS];
  int npins;
  uint64_t next_uid;
  test_rng_t rng;
  struct {
    uint64_t faults, hits, fills, misses, wmisses, unpins, commits, evicted,
        released;
  } st;
  char hist[HIST][200];
  long op;
  unsigned char *buf, *want;
} model_t;

/* ------------------------------------------------------------- history */

static void model_dump(model_t *m) {
  fprintf(stderr, "last operations (newest last):\n");
  for (long i = m->op - HIST + 1; i <= m->op; i++)
    if (i >= 0) fprintf(stderr, "  #%ld %s\n", i, m->hist[i % HIST]);
  fprintf(stderr, "model: committed %u pages, capacity %" PRIu64
          " pages, headroom %" PRId64 " bytes\n",
          m->committed, m->cap / m->ps, m->head);
  for (int i = 0; i < MV; i++) {
    mvbar_t *v = &m->v[m->prio[i]];
    char map[MAXP + 1];
    for (uint32_t p = 0; p < v->n; p++)
      map[p] = v->pg[p].pins ? 'P' : v->pg[p].res ? '#' : '.';
    map[v->n] = '\0';
    fprintf(stderr, "  prio %d: vbar %d (%s) %-16s wm %u limit %u | lib %s\n",
            i, m->prio[i], v->order ? "interleaved" : "tail", map, v->wm,
            v->limit, test_map(v->h));
  }
}

VP__PRINTF(2, 3) static void hist(model_t *m, const char *fmt, ...) {
  va_list ap;
  m->op++;
  va_start(ap, fmt);
  vsnprintf(m->hist[m->op % HIST], sizeof m->hist[0], fmt, ap);
  va_end(ap);
  test_note("op #%ld: %s", m->op, m->hist[m->op % HIST]);
}

#define MCHECK(m, cond, ...)                                                   \
  do {                                                                         \
    if (!(cond)) {                                                             \
      model_dump(m);                                                           \
      TEST_FAIL(__VA_ARGS__);                                                  \
    }                                                                          \
  } while (0)

#define MCHECK_RC(m, got, want, what)                                          \
  MCHECK(m, (got) == (want), "%s returned %s, the model expects %s (%s)",     \
         what, vp_err_name(got), vp_err_name(want), vp_last_error())

/* --------------------------------------------------------------- VBARs */

static uint32_t bitrev(uint32_t v, int bits) {
  uint32_t r = 0;
  for (int i = 0; i < bits; i++, v >>= 1) r = (r << 1) | (v & 1);
  return r;
}

static void model_new_vbar(model_t *m, int k, uint32_t n, int order) {
  mvbar_t *v = &m->v[k];
  memset(v, 0, sizeof *v);
  v->h = test_vbar(m->dev, n * m->ps);
  ASSERT_OK(vp_vbar_set_order(v->h, order));
  v->base = test_vbar_base(v->h);
  v->uid = ++m->next_uid;
  v->n = n;
  v->order = order;
  int bits = 0;
  while ((1u << bits) < n) bits++;
  for (uint32_t p = 0; p < n; p++) {
    v->rank[p] = order == VP_ORDER_TAIL_FIRST ? p : bitrev(p, bits);
    v->by_rank[v->rank[p]] = p;
  }
  v->wm = v->limit = n;
  /* On top. */
  int j = 0;
  for (int i = 0; i < MV; i++)
    if (m->prio[i] == k) j = i;
  for (; j > 0; j--) m->prio[j] = m->prio[j - 1];
  m->prio[0] = k;
}

static void prio_move(model_t *m, int k, bool top) {
  int j = 0;
  for (int i = 0; i < MV; i++)
    if (m->prio[i] == k) j = i;
  if (top) {
    for (; j > 0; j--) m->prio[j] = m->prio[j - 1];
    m->prio[0] = k;
  } else {
    for (; j < MV - 1; j++) m->prio[j] = m->prio[j + 1];
    m->prio[MV - 1] = k;
  }
}

/* ------------------------------------------------------------ eviction */

static void evict_page(model_t *m, int k, uint32_t p) {
  mpage_t *pg = &m->v[k].pg[p];
  pg->res = false;
  pg->last_gen = pg->gen;
  pg->gen = 0;
  pg->valid = false;
  m->committed--;
  m->st.evicted++;
}

/* Evict up to `want` unpinned pages of k ranked >= min_rank, highest rank
 * first; each lowers the watermark. */
static uint64_t vbar_evict(model_t *m, int k, uint64_t want,
                           uint32_t min_rank) {
  mvbar_t *v = &m->v[k];
  uint64_t done = 0;
  for (uint32_t r = v->n; r-- > min_rank && done < want;) {
    uint32_t p = v->by_rank[r];
    if (!v->pg[p].res || v->pg[p].pins) continue;
    evict_page(m, k, p);
    done++;
    if (v->wm > r) v->wm = r;
  }
  return done;
}

/* Lowest priority first, stopping at VBAR `stop` (-1: none). */
static uint64_t evict_below(model_t *m, int stop, uint64_t want) {
  uint64_t done = 0;
  for (int i = MV - 1; i >= 0 && done < want; i--) {
    if (m->prio[i] == stop) break;
    done += vbar_evict(m, m->prio[i], want - done, 0);
  }
  return done;
}

/* Pages a fault of k (needing ranks <= max_rank) may evict: unpinned
 * resident pages of lower-priority VBARs and of k ranked above max_rank. */
static uint64_t evictable_for(model_t *m, int k, uint32_t max_rank) {
  uint64_t n = 0;
  for (int i = MV - 1; i >= 0 && m->prio[i] != k; i--) {
    mvbar_t *w = &m->v[m->prio[i]];
    for (uint32_t p = 0; p < w->n; p++) n += w->pg[p].res && !w->pg[p].pins;
  }
  mvbar_t *v = &m->v[k];
  for (uint32_t r = max_rank + 1; r < v->n; r++)
    n += v->pg[v->by_rank[r]].res && !v->pg[v->by_rank[r]].pins;
  return n;
}

static uint64_t allowed_bytes(model_t *m) {
  return m->cap > (uint64_t)m->head ? m->cap - (uint64_t)m->head : 0;
}

/* ---------------------------------------------------------------- data */

static uint64_t data_key(mvbar_t *v, uint32_t p, uint32_t gen) {
  return (v->uid << 40) ^ ((uint64_t)p << 32) ^ gen;
}

static void write_page(model_t *m, int k, uint32_t p) {
  mvbar_t *v = &m->v[k];
  mpage_t *pg = &v->pg[p];
  test_pattern(m->buf, m->ps, data_key(v, p, pg->gen));
  ASSERT_OK(vp_copy_to_device(m->dev, v->base + p * m->ps, m->buf, m->ps, 0));
  ASSERT_OK(vp_stream_synchronize(m->dev, 0));
  pg->valid = true;
}

static void check_page(model_t *m, int k, uint32_t p) {
  mvbar_t *v = &m->v[k];
  mpage_t *pg = &v->pg[p];
  test_pattern(m->want, m->ps, data_key(v, p, pg->gen));
  memset(m->buf, 0, m->ps);
  ASSERT_OK(vp_copy_to_host(m->dev, m->buf, v->base + p * m->ps, m->ps, 0));
  ASSERT_OK(vp_stream_synchronize(m->dev, 0));
  MCHECK(m, memcmp(m->buf, m->want, m->ps) == 0,
         "vbar %d page %u: data written at generation %u is gone while the "
         "generation is unchanged", k, p, pg->gen);
}

/* ---------------------------------------------------------- operations */

static void op_unpin(model_t *m, int k, uint64_t off, uint64_t size);

static void op_fault(model_t *m, int k, uint64_t off, uint64_t size) {
  mvbar_t *v = &m->v[k];
  uint32_t p0 = (uint32_t)(off / m->ps);
  uint32_t p1 = (uint32_t)((off + size - 1) / m->ps + 1);
  hist(m, "fault vbar %d pages %u-%u", k, p0, p1 - 1);
  m->st.faults++;

  /* The model's outcome. */
  int want = VP_OK;
  uint32_t lim = v->wm < v->limit ? v->wm : v->limit;
  uint32_t missing = 0, max_rank = 0;
  bool was_res[MAXP] = {false};
  for (uint32_t p = p0; p < p1; p++) {
    was_res[p] = v->pg[p].res;
    if (v->pg[p].res) continue;
    if (v->rank[p] >= lim) want = VP_MISS;
    missing++;
    if (v->rank[p] > max_rank) max_rank = v->rank[p];
  }
  if (want == VP_MISS) {
    m->st.wmisses++;
    m->st.misses++;
  } else if (missing == 0) {
    for (uint32_t p = p0; p < p1; p++) v->pg[p].pins++;
    m->st.hits++;
  } else {
    for (uint32_t p = p0; p < p1; p++)
      if (v->pg[p].res) v->pg[p].pins++;
    uint64_t need_b = (uint64_t)(m->committed + missing) * m->ps;
    uint64_t allowed = allowed_bytes(m);
    if (need_b > allowed) {
      uint64_t need = (need_b - allowed + m->ps - 1) / m->ps;
      if (evictable_for(m, k, max_rank) < need) {
        want = VP_MISS; /* the pager evicts nothing for a miss */
      } else {
        uint64_t freed = evict_below(m, k, need);
        if (freed < need)
          freed += vbar_evict(m, k, need - freed, max_rank + 1);
      }
    }
    for (uint32_t p = p0; p < p1 && want == VP_OK; p++) {
      mpage_t *pg = &v->pg[p];
      if (pg->res) continue;
      if (m->fail_commit && --m->fail_commit == 0) {
        want = VP_MISS;
        break;
      }
      pg->res = true;
      pg->gen = 0;
      pg->valid = false;
      pg->pins++;
      m->committed++;
      m->st.commits++;
    }
    if (want == VP_MISS) {
      for (uint32_t p = p0; p < p1; p++)
        if (v->pg[p].res) v->pg[p].pins--;
      m->st.misses++;
    } else {
      m->st.fills++;
    }
  }

  uint32_t gens[MAXP];
  memset(gens, 0, sizeof gens);
  int rc = vp_fault(v->h, off, size, gens, MAXP);
  MCHECK_RC(m, rc, want, "vp_fault");
  if (rc != VP_OK) return;
  for (uint32_t p = p0; p < p1; p++) {
    mpage_t *pg = &v->pg[p];
    uint32_t g = gens[p - p0];
    MCHECK(m, g != 0, "page %u: generation 0", p);
    if (was_res[p] && pg->gen) {
      MCHECK(m, g == pg->gen,
             "vbar %d page %u stayed resident but its generation changed "
             "from %u to %u", k, p, pg->gen, g);
    } else {
      MCHECK(m, pg->last_gen == 0 || g != pg->last_gen,
             "vbar %d page %u was committed again but kept generation %u", k,
             p, g);
      pg->gen = g;
    }
    if (pg->valid) check_page(m, k, p);
    else write_page(m, k, p);
  }
  if (test_rand_below(&m->rng, 10) < 6 || m->npins == MAXPINS) {
    op_unpin(m, k, off, size);
  } else {
    m->pins[m->npins++] = (pinrec_t){k, off, size};
  }
}

static void op_unpin(model_t *m, int k, uint64_t off, uint64_t size) {
  mvbar_t *v = &m->v[k];
  uint32_t p0 = (uint32_t)(off / m->ps);
  uint32_t p1 = (uint32_t)((off + size - 1) / m->ps + 1);
  hist(m, "unpin vbar %d pages %u-%u", k, p0, p1 - 1);
  int want = VP_OK;
  for (uint32_t p = p0; p < p1; p++)
    if (!v->pg[p].pins) want = VP_ENOTPINNED;
  if (want == VP_OK) {
    for (uint32_t p = p0; p < p1; p++) v->pg[p].pins--;
    m->st.unpins++;
  }
  MCHECK_RC(m, vp_unpin(v->h, off, size, 0), want, "vp_unpin");
}

static void unpin_record(model_t *m, int i) {
  pinrec_t r = m->pins[i];
  m->pins[i] = m->pins[--m->npins];
  op_unpin(m, r.k, r.off, r.size);
}

static void op_free_vbar(model_t *m, int k, uint64_t bytes) {
  hist(m, "vbar_free_memory vbar %d %" PRIu64 " bytes", k, bytes);
  uint64_t want = vbar_evict(m, k, (bytes + m->ps - 1) / m->ps, 0), freed = 0;
  ASSERT_OK(vp_vbar_free_memory(m->v[k].h, bytes, &freed));
  MCHECK(m, freed == want * m->ps, "vbar_free_memory freed %" PRIu64
         ", the model %" PRIu64, freed, want * m->ps);
}

static void op_free_device(model_t *m, uint64_t bytes) {
  hist(m, "device_free_memory %" PRIu64 " bytes", bytes);
  uint64_t want = evict_below(m, -1, (bytes + m->ps - 1) / m->ps), freed = 0;
  ASSERT_OK(vp_device_free_memory(m->dev, bytes, &freed));
  MCHECK(m, freed == want * m->ps, "device_free_memory freed %" PRIu64
         ", the model %" PRIu64, freed, want * m->ps);
}

static void op_recreate(model_t *m, int k) {
  mvbar_t *v = &m->v[k];
  bool pinned = false;
  for (uint32_t p = 0; p < v->n; p++) pinned |= v->pg[p].pins != 0;
  int order = (int)test_rand_below(&m->rng, 2);
  uint32_t n = order == VP_ORDER_INTERLEAVED
                   ? (test_rand_below(&m->rng, 2) ? 8 : 4)
                   : 3 + (uint32_t)test_rand_below(&m->rng, 10);
  hist(m, "destroy vbar %d%s; new %s of %u pages", k,
       pinned ? " (pinned: EBUSY)" : "", order ? "interleaved" : "tail", n);
  if (pinned) {
    MCHECK_RC(m, vp_vbar_destroy(v->h), VP_EBUSY, "vp_vbar_destroy");
    return;
  }
  for (uint32_t p = 0; p < v->n; p++)
    if (v->pg[p].res) {
      m->committed--;
      m->st.released++;
    }
  ASSERT_OK(vp_vbar_destroy(v->h));
  /* Records of pins that random unpins took already. */
  for (int j = m->npins - 1; j >= 0; j--)
    if (m->pins[j].k == k) m->pins[j] = m->pins[--m->npins];
  model_new_vbar(m, k, n, order);
}

/* -------------------------------------------------------------- checks */

static void model_check(model_t *m) {
  uint64_t reclaim = 0;
  for (int k = 0; k < MV; k++) {
    mvbar_t *v = &m->v[k];
    uint8_t flags[MAXP];
    ASSERT_OK(vp_vbar_residency(v->h, flags, v->n));
    for (uint32_t p = 0; p < v->n; p++) {
      mpage_t *pg = &v->pg[p];
      bool res = flags[p] & VP_PAGE_RESIDENT, pin = flags[p] & VP_PAGE_PINNED;
      MCHECK(m, res == pg->res && pin == (pg->pins != 0),
             "vbar %d page %u: library %s%s, model %s%s", k, p,
             res ? "resident" : "absent", pin ? " pinned" : "",
             pg->res ? "resident" : "absent", pg->pins ? " pinned" : "");
      if (pg->res && !pg->pins) reclaim++;
    }
    uint64_t wm = 0, lim = 0;
    ASSERT_OK(vp_vbar_get_watermark(v->h, &wm));
    MCHECK(m, wm == v->wm, "vbar %d: watermark %" PRIu64 ", model %u", k, wm,
           v->wm);
    ASSERT_OK(vp_vbar_get_watermark_limit(v->h, &lim));
    if (lim > v->n) lim = v->n;
    MCHECK(m, lim == v->limit, "vbar %d: limit %" PRIu64 ", model %u", k, lim,
           v->limit);
  }
  vp_device_info_t info = test_info(m->dev);
  MCHECK(m, info.committed == (uint64_t)m->committed * m->ps,
         "committed %" PRIu64 " pages, model %u", info.committed / m->ps,
         m->committed);
  uint64_t r = 0;
  ASSERT_OK(vp_device_reclaimable(m->dev, &r));
  MCHECK(m, r == reclaim * m->ps, "reclaimable %" PRIu64 " pages, model %"
         PRIu64, r / m->ps, reclaim);
}

static char g_budget_bad[200];

static void model_check_stats(model_t *m) {
  vp_stats_t s = test_dev_stats(m->dev);
  ASSERT_EQ_U64(s.faults, m->st.faults);
  ASSERT_EQ_U64(s.hits, m->st.hits);
  ASSERT_EQ_U64(s.fills, m->st.fills);
  ASSERT_EQ_U64(s.misses, m->st.misses);
  ASSERT_EQ_U64(s.watermark_misses, m->st.wmisses);
  ASSERT_EQ_U64(s.unpins, m->st.unpins);
  ASSERT_EQ_U64(s.pages_committed, m->st.commits);
  ASSERT_TRUE(s.pages_evicted == m->st.evicted ||
              s.pages_evicted == m->st.evicted + m->st.released);
  ASSERT_EQ_U64(s.committed_bytes, (uint64_t)m->committed * m->ps);
  /* Misses caused by the budget (commit failures included) are the misses
   * that the watermark did not cause. Checked after every seed ran. */
  if (s.budget_misses != m->st.misses - m->st.wmisses && !g_budget_bad[0])
    snprintf(g_budget_bad, sizeof g_budget_bad,
             "budget_misses %" PRIu64 ", but %" PRIu64 " misses of which %"
             PRIu64 " at the watermark", s.budget_misses, m->st.misses,
             m->st.wmisses);
}

/* ---------------------------------------------------------------- run */

static void random_range(model_t *m, int k, uint64_t *off, uint64_t *size) {
  mvbar_t *v = &m->v[k];
  uint32_t n = 1 + (uint32_t)test_rand_below(&m->rng, 3);
  uint32_t p = (uint32_t)test_rand_below(&m->rng, v->n);
  if (p + n > v->n) n = v->n - p;
  uint64_t a = test_rand_below(&m->rng, m->ps / 2);
  uint64_t b = m->ps / 2 + 1 + test_rand_below(&m->rng, m->ps / 2);
  *off = p * m->ps + a;
  *size = (uint64_t)(p + n - 1) * m->ps + b - *off;
}

static void run_model(test_ctx_t *ctx, uint64_t seed, long nops) {
  model_t *m = calloc(1, sizeof *m);
  ASSERT_NOT_NULL(m);
  test_rng_seed(&m->rng, seed);
  vp_options_t opts;
  test_options(ctx, &opts);
  m->ps = opts.page_size;
  m->cap = 12 * m->ps;
  m->head = 0;
  m->op = -1;
  m->dev = test_open_cap(ctx, &opts, 12);
  m->buf = malloc(m->ps);
  m->want = malloc(m->ps);
  ASSERT_NOT_NULL(m->buf);
  ASSERT_NOT_NULL(m->want);
  for (int k = 0; k < MV; k++) m->prio[k] = k;
  static const uint32_t sizes[MV] = {6, 8, 5, 4};
  static const int orders[MV] = {VP_ORDER_TAIL_FIRST, VP_ORDER_INTERLEAVED,
                                 VP_ORDER_TAIL_FIRST, VP_ORDER_INTERLEAVED};
  for (int k = 0; k < MV; k++) model_new_vbar(m, k, sizes[k], orders[k]);
  model_check(m);

  for (long i = 0; i < nops; i++) {
    int k = (int)test_rand_below(&m->rng, MV);
    mvbar_t *v = &m->v[k];
    uint64_t r = test_rand_below(&m->rng, 100), off, size;
    if (r < 45) {
      if (test_rand_below(&m->rng, 4) == 0) { /* as a model about to run */
        hist(m, "prioritize vbar %d", k);
        prio_move(m, k, true);
        v->wm = v->n;
        ASSERT_OK(vp_vbar_prioritize(v->h));
        model_check(m);
      }
      random_range(m, k, &off, &size);
      op_fault(m, k, off, size);
    } else if (r < 60) {
      if (m->npins)
        unpin_record(m, (int)test_rand_below(&m->rng, (uint64_t)m->npins));
    } else if (r < 63) {
      random_range(m, k, &off, &size);
      op_unpin(m, k, off, size);
    } else if (r < 71) {
      hist(m, "prioritize vbar %d", k);
      prio_move(m, k, true);
      v->wm = v->n;
      ASSERT_OK(vp_vbar_prioritize(v->h));
    } else if (r < 73) {
      hist(m, "deprioritize vbar %d", k);
      prio_move(m, k, false);
      ASSERT_OK(vp_vbar_deprioritize(v->h));
    } else if (r < 76) {
      op_free_vbar(m, k, test_rand_below(&m->rng, 4 * m->ps));
    } else if (r < 77) {
      op_free_device(m, test_rand_below(&m->rng, 5 * m->ps));
    } else if (r < 79) {
      /* Lower the watermark (raising is prioritize's job). */
      uint64_t b = test_rand_below(&m->rng, (uint64_t)v->wm * m->ps + 1);
      hist(m, "set_watermark vbar %d %" PRIu64 " pages", k, b / m->ps);
      v->wm = (uint32_t)(b / m->ps);
      ASSERT_OK(vp_vbar_set_watermark(v->h, b));
    } else if (r < 81) {
      uint64_t b = test_rand_below(&m->rng, 4) == 0
                       ? UINT64_MAX
                       : test_rand_below(&m->rng, (v->n + 2) * m->ps);
      uint64_t pages = b == UINT64_MAX ? v->n : b / m->ps;
      hist(m, "set_watermark_limit vbar %d %" PRIu64 " pages", k, pages);
      v->limit = pages < v->n ? (uint32_t)pages : v->n;
      ASSERT_OK(vp_vbar_set_watermark_limit(v->h, b));
    } else if (r < 82) {
      hist(m, "reset_limits");
      for (int j = 0; j < MV; j++) m->v[j].limit = m->v[j].n;
      ASSERT_OK(vp_device_reset_limits(m->dev));
    } else if (r < 85) {
      m->cap = (4 + test_rand_below(&m->rng, 13)) * m->ps;
      hist(m, "capacity %" PRIu64 " pages", m->cap / m->ps);
      ASSERT_OK(vp_sim_inject(m->dev, VP_SIM_SET_CAPACITY, m->cap));
    } else if (r < 87) {
      m->head = (int64_t)test_rand_below(&m->rng, 3 * m->ps);
      if (test_rand_below(&m->rng, 2)) m->head -= m->head % (int64_t)m->ps;
      hist(m, "headroom %" PRId64 " bytes", m->head);
      ASSERT_OK(vp_device_set_headroom(m->dev, m->head));
    } else if (r < 92) {
      /* Read back a pinned page that holds our data. */
      for (int tries = 0; tries < 8; tries++) {
        uint32_t p = (uint32_t)test_rand_below(&m->rng, v->n);
        if (v->pg[p].pins && v->pg[p].valid) {
          hist(m, "check data vbar %d page %u", k, p);
          check_page(m, k, p);
          break;
        }
      }
    } else if (r < 93) {
      m->fail_commit = 1 + test_rand_below(&m->rng, 3);
      hist(m, "inject: commit %" PRIu64 " from now fails", m->fail_commit);
      ASSERT_OK(vp_sim_inject(m->dev, VP_SIM_FAIL_COMMIT, m->fail_commit));
    } else if (r < 94) {
      op_recreate(m, k);
    } else {
      /* Unpin everything this VBAR holds. */
      for (int j = m->npins - 1; j >= 0; j--)
        if (m->pins[j].k == k) unpin_record(m, j);
    }
    model_check(m);
  }
  while (m->npins) unpin_record(m, m->npins - 1);
  model_check(m);
  model_check_stats(m);
  test_log("seed %" PRIu64 ": %ld ops, %" PRIu64 " faults (%" PRIu64
           " hits, %" PRIu64 " fills, %" PRIu64 " misses, %" PRIu64
           " at the watermark), %" PRIu64 " evictions",
           seed, nops, m->st.faults, m->st.hits, m->st.fills, m->st.misses,
           m->st.wmisses, m->st.evicted);
  ASSERT_GT_U64(m->st.fills, 0);
  ASSERT_GT_U64(m->st.hits, 0);
  ASSERT_GT_U64(m->st.evicted, 0);
  ASSERT_GT_U64(m->st.wmisses, 0);
  ASSERT_GT_U64(m->st.misses - m->st.wmisses, 0);
  ASSERT_OK(vp_device_close(m->dev));
  free(m->buf);
  free(m->want);
  free(m);
}

TEST(model_random, TEST_SIM_ONLY) {
  uint64_t seed = test_seed();
  long nops = (long)test_scale(4000);
  for (uint64_t s = seed; s < seed + 4; s++) {
    test_log("model: seed %" PRIu64 " (TEST_SEED=%" PRIu64
             " reproduces it first)", s, s);
    run_model(ctx, s, nops);
  }
  test_note("%s", "");
  if (g_budget_bad[0]) TEST_FAIL("%s", g_budget_bad);
}
