/* Handle tables: a device's VBARs, weights, host buffers and files are
 * found by id, never by pointer, so a stale or foreign handle is found
 * missing instead of dereferenced. An id is serial | slot | device slot; the
 * serial is unique in the process, so a reused slot never matches an old
 * id. Every object in a table starts with its uint64_t id. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SLOT_MASK ((1u << VP__VBAR_BITS) - 1)

static uint32_t slot_of(uint64_t id) {
  return (uint32_t)(id >> VP__SLOT_BITS) & SLOT_MASK;
}

/* Put obj in a free slot; *id gets its new id (the caller stores it as the
 * object's first member before anyone can look it up). */
int vp__table_add(vp__device_t *dev, vp__table_t *t, void *obj, uint64_t *id) {
  uint32_t s = 0;
  while (s < t->n && t->slots[s]) s++;
  if (s == t->n) {
    uint32_t n = t->n ? t->n * 2 : 16;
    if (n > SLOT_MASK + 1u)
      return vp__err(VP_ELIMIT, "%u handles of one kind exist already", t->n);
    void **grown = NULL;
    if (vp__inject_fail(&dev->inject) ||
        !(grown = realloc(t->slots, n * sizeof *grown)))
      return vp__err(VP_ENOMEM, "no memory for a handle table of %u", n);
    memset(grown + t->n, 0, (n - t->n) * sizeof *grown);
    t->slots = grown;
    t->n = n;
  }
  *id = (vp__serial_next() << VP__SERIAL_SHIFT) |
        ((uint64_t)s << VP__SLOT_BITS) | (dev->id & (VP__MAX_DEVICES - 1));
  *(uint64_t *)obj = *id;
  t->slots[s] = obj;
  return VP_OK;
}

void *vp__table_get(const vp__table_t *t, uint64_t id) {
  uint32_t s = slot_of(id);
  if (s >= t->n || !t->slots[s] || *(const uint64_t *)t->slots[s] != id)
    return NULL;
  return t->slots[s];
}

void vp__table_remove(vp__table_t *t, uint64_t id) {
  uint32_t s = slot_of(id);
  if (s < t->n && t->slots[s] && *(uint64_t *)t->slots[s] == id)
    t->slots[s] = NULL;
}

void vp__table_free(vp__table_t *t) {
  free(t->slots);
  t->slots = NULL;
  t->n = 0;
}

/* Room for one more element in *arr (of *cap elements of `size`). */
int vp__grow(vp__device_t *dev, void **arr, size_t *cap, size_t used,
                size_t size) {
  if (used < *cap) return VP_OK;
  size_t n = *cap ? *cap * 2 : 16;
  void *p = NULL;
  if (vp__inject_fail(&dev->inject) || !(p = realloc(*arr, n * size)))
    return vp__err(VP_ENOMEM, "no memory for a list of %zu", n);
  *arr = p;
  *cap = n;
  return VP_OK;
}
