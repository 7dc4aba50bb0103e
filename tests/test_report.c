/* The text report (vp_device_report) is for people: sizes in one rule
 * (vp__size: "32 MiB", not "32768 KiB" beside "32 MiB"), counters that are
 * 0 left out, each counter with what it counts (issue 27). The JSON report
 * keeps every counter and every size in bytes. */
#include "test.h"
#include "internal.h" /* vp__size */

#define KiB 1024ull
#define MiB (1024ull * 1024)
#define GiB (1024ull * MiB)

TEST(size_text, TEST_SIM_ONLY) {
  static const struct {
    uint64_t bytes;
    const char *text;
  } cases[] = {
      {0, "0 B"},
      {1, "1 B"},
      {1023, "1023 B"},
      {1024, "1 KiB"},
      {1536, "1.5 KiB"},
      {64 * KiB, "64 KiB"},
      {MiB - 1, "1.0 MiB"}, /* not "1024.0 KiB" */
      {32 * MiB, "32 MiB"},
      {512 * MiB, "512 MiB"},
      {GiB, "1 GiB"},
      {1536 * MiB, "1.5 GiB"},
      {3825205248ull, "3.6 GiB"},
      {1024 * GiB, "1 TiB"},
      {UINT64_MAX, "16777216.0 TiB"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    test_note("vp__size(%llu)", (unsigned long long)cases[i].bytes);
    ASSERT_EQ_STR(vp__size(cases[i].bytes).s, cases[i].text);
  }
}

static char *report(vp_device_t dev, int json) {
  size_t need = 0;
  ASSERT_RC2(vp_device_report(dev, json, NULL, 0, &need), VP_OK, VP_ERANGE);
  char *buf = malloc(need + 1);
  ASSERT_NOT_NULL(buf);
  ASSERT_OK(vp_device_report(dev, json, buf, need + 1, NULL));
  return buf;
}

/* The counter's line, "  name  value  what it counts", without its newline
 * (static buffer); NULL when the report has none. */
static const char *counter_line(const char *rep, const char *name) {
  static char line[256];
  char key[64];
  snprintf(key, sizeof key, "\n  %s ", name);
  const char *p = strstr(rep, key);
  if (!p) return NULL;
  p++;
  size_t n = strcspn(p, "\n");
  if (n >= sizeof line) n = sizeof line - 1;
  memcpy(line, p, n);
  line[n] = '\0';
  return line;
}

TEST(report_text_format, TEST_SIM_ONLY) {
  vp_options_t o;
  test_options(ctx, &o);
  o.page_size = 32 * MiB; /* the "page 32768 KiB" */
  o.sim_granularity = 2 * MiB;
  o.sim_capacity = GiB;
  vp_device_t dev = test_open(ctx, &o);

  /* A fresh device: every counter is 0, and the report says so. */
  char *rep = report(dev, 0);
  ASSERT_EQ_STR(rep, "vpager device [sim]: page 32 MiB, memory 1 GiB, "
                     "committed 0 B, headroom 0 B\n"
                     "counters (those not shown are 0):\n"
                     "  (all 0)\n");
  free(rep);

  vp_vbar_t v = test_vbar(dev, 4 * 32 * MiB);
  ASSERT_OK(vp_fault(v, 0, 32 * MiB, NULL, 0));
  char bytes[3 * KiB] = {1};
  ASSERT_OK(vp_copy_to_device(dev, test_vbar_base(v), bytes, sizeof bytes, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_OK(vp_unpin(v, 0, 32 * MiB, 0));
  ASSERT_OK(vp_fault(v, 0, 1, NULL, 0)); /* a hit */
  ASSERT_OK(vp_unpin(v, 0, 1, 0));

  rep = report(dev, 0);
  test_note("report:\n%s", rep);
  const char *head = "vpager device [sim]: page 32 MiB, memory 1 GiB, "
                     "committed 32 MiB, headroom 0 B\n"
                     "counters (those not shown are 0):\n";
  ASSERT_TRUE(strncmp(rep, head, strlen(head)) == 0);
  ASSERT_NULL(strstr(rep, "32768 KiB"));
  ASSERT_NULL(strstr(rep, "33554432"));
  /* Counts as numbers, byte counts as sizes, each with what it counts. */
  ASSERT_EQ_STR(counter_line(rep, "faults"),
                "  faults                          2  fault calls");
  ASSERT_EQ_STR(counter_line(rep, "hits"),
                "  hits                            1  "
                "faults with every page resident");
  ASSERT_EQ_STR(counter_line(rep, "fills"),
                "  fills                           1  "
                "faults that committed pages");
  ASSERT_EQ_STR(counter_line(rep, "pages_committed"),
                "  pages_committed                 1  pages committed");
  ASSERT_EQ_STR(counter_line(rep, "bytes_copied"),
                "  bytes_copied                3 KiB  "
                "bytes copied by vp_copy_*");
  /* Zeros are left out. */
  ASSERT_NULL(counter_line(rep, "misses"));
  ASSERT_NULL(counter_line(rep, "evict_waits"));
  ASSERT_NULL(counter_line(rep, "pages_evicted"));
  ASSERT_NULL(counter_line(rep, "file_bytes_read"));
  ASSERT_NULL(strstr(rep, "(all 0)"));
  /* The residency map is still there. */
  ASSERT_STR_CONTAINS(rep, "4 pages, 1 resident, 0 pinned");
  ASSERT_STR_CONTAINS(rep, "\n  #...\n");
  free(rep);

  /* The JSON keeps every counter, zeros too, and sizes in bytes. */
  rep = report(dev, 1);
  ASSERT_STR_CONTAINS(rep, "\"page_size\":33554432");
  ASSERT_STR_CONTAINS(rep, "\"faults\":2,");
  ASSERT_STR_CONTAINS(rep, "\"misses\":0,");
  ASSERT_STR_CONTAINS(rep, "\"evict_waits\":0,");
  ASSERT_STR_CONTAINS(rep, "\"bytes_copied\":3072,");
  ASSERT_STR_CONTAINS(rep, "\"file_bytes_read\":0}");
  free(rep);
  ASSERT_OK(vp_device_close(dev));
}

/* A small page reads in KiB, the same rule. */
TEST(report_text_small_page, TEST_SIM_ONLY) {
  vp_device_t dev = test_open(ctx, NULL); /* 64 KiB pages, 16 of them */
  char *rep = report(dev, 0);
  const char *head = "vpager device [sim]: page 64 KiB, memory 1 MiB, "
                     "committed 0 B, headroom 0 B\n";
  ASSERT_TRUE(strncmp(rep, head, strlen(head)) == 0);
  free(rep);
  ASSERT_OK(vp_device_close(dev));
}
