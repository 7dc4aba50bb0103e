/* The table of open devices. Handles are ids, not pointers, so a closed or
 * made-up handle is found missing here instead of being dereferenced. This
 * table and the serial counter are the only process-wide state besides the
 * log level. */
#include <stdatomic.h>

#include "internal.h"

static _Atomic(vp__device_t *) devices[VP__MAX_DEVICES];
static vp__os_mutex_t registry_lock = VP__OS_MUTEX_INIT;
static atomic_uint_fast64_t serial = 1;

uint64_t vp__serial_next(void) { return atomic_fetch_add(&serial, 1); }

/* Give dev a slot and its id. */
int vp__registry_add(vp__device_t *dev) {
  int rc = VP_ELIMIT;
  vp__os_mutex_lock(&registry_lock);
  for (uint64_t slot = 0; slot < VP__MAX_DEVICES && rc != VP_OK; slot++) {
    if (atomic_load(&devices[slot])) continue;
    dev->id = (vp__serial_next() << VP__SERIAL_SHIFT) | slot;
    atomic_store(&devices[slot], dev);
    rc = VP_OK;
  }
  vp__os_mutex_unlock(&registry_lock);
  if (rc != VP_OK)
    return vp__err(rc, "%d devices are open already", VP__MAX_DEVICES);
  return VP_OK;
}

void vp__registry_remove(vp__device_t *dev) {
  vp__os_mutex_lock(&registry_lock);
  uint64_t slot = dev->id & (VP__MAX_DEVICES - 1);
  if (atomic_load(&devices[slot]) == dev) atomic_store(&devices[slot], NULL);
  vp__os_mutex_unlock(&registry_lock);
}

/* The open device whose handle (or a VBAR handle of it) is id, or NULL. */
vp__device_t *vp__registry_get(uint64_t id) {
  vp__device_t *dev = atomic_load_explicit(
      &devices[id & (VP__MAX_DEVICES - 1)], memory_order_acquire);
  return dev;
}
