/* Reports: a text report for people and JSON for programs, with a
 * residency map of every VBAR. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"


static char page_char(const vp__page_t *pg) {
  return pg->pins ? 'P' : pg->resident ? '#' : '.';
}

static const char *order_name(int kind) {
  return kind == VP_ORDER_INTERLEAVED ? "interleaved"
         : kind == VP_ORDER_CUSTOM    ? "custom"
                                      : "tail-first";
}

/* One counter's line, left out when it is zero; byte counts read as sizes
 * (vp__size), other counts as numbers. Returns 1 when shown. */
static int put_counter(vp__out_t *o, const char *name, uint64_t v,
                       const char *doc) {
  if (!v) return 0;
  char num[24];
  snprintf(num, sizeof num, "%llu", (unsigned long long)v);
  vp__put(o, "  %-22s %10s  %s\n", name,
          strstr(name, "bytes") ? vp__size(v).s : num, doc);
  return 1;
}

static void report_text(vp__device_t *dev, vp__out_t *o) {
  const vp_stats_t *s = &dev->stats;
  vp__put(o, "vpager device [%s]: page %s, memory %s, committed %s, "
      "headroom %s\n", dev->caps.name, vp__size(dev->page_size).s,
      vp__size(dev->budget.total).s, vp__size(dev->committed).s,
      vp__size(dev->budget.headroom > 0 ? (uint64_t)dev->budget.headroom
                                        : 0).s);
  vp__put(o, "counters (those not shown are 0):\n");
  int shown = 0;
#define VP__STAT_TEXT(name, doc) shown += put_counter(o, #name, s->name, doc);
  VP_STAT_FIELDS(VP__STAT_TEXT)
#undef VP__STAT_TEXT
  if (!shown) vp__put(o, "  (all 0)\n");
  int rank = 0;
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down, rank++) {
    vp__put(o, "vbar #%d (priority %d): %u pages, %u resident, %u pinned, "
        "watermark %u, limit %u, %s\n  ", rank, rank, vb->npages, vb->resident,
        vb->pinned, vb->watermark, vb->limit, order_name(vb->order_kind));
    for (uint32_t p = 0; p < vb->npages; p++)
      vp__put(o, "%c%s", page_char(&vb->pages[p]),
          (p + 1) % 64 == 0 && p + 1 < vb->npages ? "\n  " : "");
    vp__put(o, "\n");
  }
}

static void report_json(vp__device_t *dev, vp__out_t *o) {
  const vp_stats_t *s = &dev->stats;
  vp__put(o, "{\"backend\":\"%s\",\"page_size\":%llu,\"total_memory\":%llu,"
      "\"committed\":%llu,\"headroom\":%lld,\"stats\":{", dev->caps.name,
      (unsigned long long)dev->page_size,
      (unsigned long long)dev->budget.total,
      (unsigned long long)dev->committed, (long long)dev->budget.headroom);
  const char *sep = "";
#define VP__STAT_JSON(name, doc) vp__put(o, "%s\"%s\":%llu", sep, #name, \
                                     (unsigned long long)s->name), sep = ",";
  VP_STAT_FIELDS(VP__STAT_JSON)
#undef VP__STAT_JSON
  vp__put(o, "},\"vbars\":[");
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down) {
    vp__put(o, "%s{\"id\":%llu,\"pages\":%u,\"resident\":%u,\"pinned\":%u,"
        "\"watermark\":%u,\"limit\":%u,\"order\":\"%s\",\"map\":\"",
        vb == dev->top ? "" : ",", (unsigned long long)vb->id, vb->npages,
        vb->resident, vb->pinned, vb->watermark, vb->limit,
        order_name(vb->order_kind));
    for (uint32_t p = 0; p < vb->npages; p++)
      vp__put(o, "%c", page_char(&vb->pages[p]));
    vp__put(o, "\"}");
  }
  vp__put(o, "]}");
}

int vp__report(vp__device_t *dev, int json, char *buf, size_t len,
               size_t *needed) {
  vp__out_t o = {buf, len, 0};
  if (json) report_json(dev, &o); else report_text(dev, &o);
  if (needed) *needed = o.pos;
  if (o.pos < len) return VP_OK;
  if (len) buf[len - 1] = '\0';
  return vp__err(VP_ERANGE, "the report needs %zu bytes, the buffer has %zu",
                 o.pos + 1, len);
}
