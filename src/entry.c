/* Entry to the library from a public function: find the handle, lock its
 * device, refuse a broken device. The public function has already named
 * itself (VP__ENTER), so every message below and in the layers it calls
 * starts with the call the user made. Leaving through vp__unlock re-checks
 * the device's page counts in debug builds. */
#include "internal.h"

#define ULL(x) ((unsigned long long)(x))

int vp__dev_lock(vp_device_t h, vp__device_t **out) {
  vp__device_t *dev = vp__registry_get(h.id);
  if (!dev || dev->id != h.id)
    return vp__err(VP_EHANDLE, "device handle 0x%llx is not an open device",
                   ULL(h.id));
  vp__os_mutex_lock(&dev->lock);
  *out = dev;
  return VP_OK;
}

int vp__handle_lock(uint64_t id, size_t table, const char *what,
                    vp__device_t **dev, void **out) {
  vp__device_t *d = vp__registry_get(id);
  if (d) {
    vp__os_mutex_lock(&d->lock);
    if ((*out = vp__table_get((vp__table_t *)((char *)d + table), id))) {
      *dev = d;
      return VP_OK;
    }
    vp__os_mutex_unlock(&d->lock);
  }
  return vp__err(VP_EHANDLE, "%s handle 0x%llx is not live", what, ULL(id));
}

int vp__vbar_lock(vp_vbar_t h, vp__vbar_t **out) {
  vp__device_t *dev;
  return vp__handle_lock(h.id, offsetof(vp__device_t, vbars), "VBAR", &dev,
                         (void **)out);
}

int vp__unlock(vp__device_t *dev, int rc) {
#ifdef VP_DEBUG
  vp__check_invariants(dev);
#endif
  vp__os_mutex_unlock(&dev->lock);
  return rc;
}

int vp__broken(vp__device_t *dev) {
  return vp__err(VP_EDEVICE, "the %s device is broken; close it",
                 dev->caps.name);
}

int vp__dev_enter(vp_device_t h, vp__device_t **out) {
  int rc = vp__dev_lock(h, out);
  if (rc == VP_OK && (*out)->broken) rc = vp__unlock(*out, vp__broken(*out));
  return rc;
}

int vp__vbar_enter(vp_vbar_t h, vp__vbar_t **out) {
  int rc = vp__vbar_lock(h, out);
  if (rc == VP_OK && (*out)->dev->broken)
    rc = vp__unlock((*out)->dev, vp__broken((*out)->dev));
  return rc;
}
