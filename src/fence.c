/* Fences: events recorded at unpin, shared by every page of the unpinned
 * range and counted, kept in a per-device pool so the hot path creates no
 * events. */
#include <stdlib.h>

#include "internal.h"

/* A fence recorded now on stream, holding one reference. */
int vp__fence_get(vp__device_t *dev, vp_stream_t stream, vp__fence_t **out) {
  vp__fence_t *f = dev->free_fences;
  if (f) {
    dev->free_fences = f->next;
  } else {
    if (vp__inject_fail(&dev->inject) || !(f = calloc(1, sizeof *f)))
      return vp__err(VP_ENOMEM, "no memory for a fence");
    int rc = vp__be_event_create(dev, &f->event);
    if (rc) {
      free(f);
      return vp__err(rc, "creating an event failed");
    }
  }
  int rc = vp__be_event_record(dev, f->event, stream);
  if (rc) {
    f->next = dev->free_fences;
    dev->free_fences = f;
    return vp__err(rc, "recording an event on stream 0x%llx failed",
                   (unsigned long long)stream);
  }
  f->stream = stream;
  f->seq = ++dev->fence_seq;
  f->refs = 1;
  *out = f;
  return VP_OK;
}

void vp__fence_put(vp__device_t *dev, vp__fence_t *f) {
  if (--f->refs) return;
  f->next = dev->free_fences;
  dev->free_fences = f;
}

int vp__fence_wait(vp__device_t *dev, vp__fence_t *f) {
  return vp__be_event_synchronize(dev, f->event);
}

void vp__fence_pool_free(vp__device_t *dev) {
  while (dev->free_fences) {
    vp__fence_t *f = dev->free_fences;
    dev->free_fences = f->next;
    vp__be_event_destroy(dev, f->event);
    free(f);
  }
}
