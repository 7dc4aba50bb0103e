/* The one door to the backend: every call from the library to a device goes
 * through a wrapper here. A wrapper passes the backend's code on, and
 * applies the broken-device rule: VP_EDEVICE marks the device broken for
 * good (logged once), whichever layer made the call. This is the only file
 * outside src/backend/ that knows which backends exist. */
#include <stdio.h>

#include "internal.h"

/* The backends, in the order VP_BACKEND_AUTO tries them. */
static const vp__backend_t *const backends[] = {
    &vp__backend_cuda, &vp__backend_hip, &vp__backend_sim};

/* The backend of each vp_backend_kind_t but AUTO, and what messages call
 * its devices. */
static const struct kind {
  int kind;
  const vp__backend_t *be;
  const char *what;
} kinds[] = {{VP_BACKEND_CUDA, &vp__backend_cuda, "CUDA"},
             {VP_BACKEND_HIP, &vp__backend_hip, "HIP"},
             {VP_BACKEND_SIM, &vp__backend_sim, "simulated"}};

static const struct kind *kind_of(int kind) {
  for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++)
    if (kinds[i].kind == kind) return &kinds[i];
  return NULL; /* AUTO */
}

/* CUDA and HIP: vmm.c's operations under a driver of each. */
static bool is_gpu(const vp__backend_t *be) { return be != &vp__backend_sim; }

static int result(vp__device_t *dev, int rc, const char *op) {
  if (rc == VP_EDEVICE && !atomic_exchange(&dev->broken, true))
    vp__log(VP_LOG_ERROR, dev->caps.name, "%s: device is broken", op);
  return rc;
}

static const char *open_reason(const vp__backend_t *be) {
  return is_gpu(be) ? vp__vmm_open_reason() : "";
}

int vp__be_open(vp__device_t *dev) {
  int kind = dev->opts.backend;
  const struct kind *only = kind_of(kind);
  int rc = VP_ENODEV;
  for (size_t i = 0; i < sizeof backends / sizeof *backends; i++) {
    const vp__backend_t *be = backends[i];
    if (only && be != only->be) continue;
    rc = be->open(&dev->opts, &dev->inject, &dev->ctx, &dev->caps);
    if (rc == VP_OK) {
      dev->be = be;
      return VP_OK;
    }
    vp__log(kind == VP_BACKEND_AUTO ? VP_LOG_DEBUG : VP_LOG_WARN, be->name,
            "open: %s%s%s", vp_err_name(rc), *open_reason(be) ? ": " : "",
            open_reason(be));
    if (rc != VP_ENODEV || kind != VP_BACKEND_AUTO) break;
  }
  const char *why = only ? open_reason(only->be) : "";
  return vp__err(rc, "no %s device could be opened%s%s",
                 only ? only->what : "usable", *why ? ": " : "", why);
}

int vp__be_device_count(int kind, int *count) {
  if (kind == VP_BACKEND_CUDA || kind == VP_BACKEND_HIP) {
    int rc = kind == VP_BACKEND_CUDA ? vp__cuda_device_count(count)
                                     : vp__hip_device_count(count);
    if (rc == VP_OK && *count == 0)
      vp__log(VP_LOG_DEBUG, kind_of(kind)->be->name, "no device: %s",
              vp__vmm_open_reason());
    return rc;
  }
  *count = 1; /* the simulated device: one per open, always there */
  return VP_OK;
}

void vp__be_close(vp__device_t *dev) { dev->be->close(dev->ctx); }

const char *vp__be_error_detail(vp__device_t *dev) {
  return is_gpu(dev->be) ? vp__vmm_error_name(dev->ctx) : "";
}

int vp__be_nvml_info(vp__device_t *dev, uint64_t *dev_used,
                     uint64_t *dev_total, uint64_t *proc_used) {
  if (dev->be != &vp__backend_cuda) return VP_EUNSUPPORTED;
  return vp__cuda_nvml_info(dev->ctx, dev_used, dev_total, proc_used);
}

/* HIP has no NVML: no limit known. */
int vp__be_soft_limit(vp__device_t *dev, uint64_t *bytes) {
  if (dev->be == &vp__backend_cuda) return vp__cuda_soft_limit(dev->ctx, bytes);
  if (dev->be == &vp__backend_sim) return vp__sim_soft_limit(dev->ctx, bytes);
  *bytes = 0;
  return VP_OK;
}

/* The ledger is per physical device: the GPU's UUID (not its ordinal,
 * which CUDA_VISIBLE_DEVICES changes), or the simulated device's shared
 * name; an unshared simulated device is no one else's. */
int vp__be_ledger_key(vp__device_t *dev, char *out, size_t len) {
  int n;
  if (is_gpu(dev->be)) {
    char uuid[48];
    vp__vmm_uuid_text(dev->ctx, "GPU-", uuid);
    n = snprintf(out, len, "%s", uuid);
  } else if (dev->opts.sim_shared[0]) {
    n = snprintf(out, len, "sim-%s", dev->opts.sim_shared);
  } else {
    return VP_EUNSUPPORTED;
  }
  return n > 0 && (size_t)n < len ? VP_OK : VP_ELIMIT;
}

/* A wrapper per operation: the backend call and the broken-device rule. */
#define DOOR(op, params, args)                                                 \
  int vp__be_##op params {                                                     \
    return result(dev, dev->be->op args, #op);                                 \
  }

DOOR(mem_info, (vp__device_t *dev, uint64_t *free_bytes, uint64_t *total),
     (dev->ctx, free_bytes, total))
DOOR(va_reserve, (vp__device_t *dev, uint64_t size, uint64_t *va),
     (dev->ctx, size, va))
DOOR(va_free, (vp__device_t *dev, uint64_t va, uint64_t size),
     (dev->ctx, va, size))
DOOR(phys_create, (vp__device_t *dev, uint64_t size, vp__phys_t *phys),
     (dev->ctx, size, phys))
DOOR(phys_release, (vp__device_t *dev, vp__phys_t phys, uint64_t size),
     (dev->ctx, phys, size))
DOOR(map, (vp__device_t *dev, uint64_t va, uint64_t size, vp__phys_t phys),
     (dev->ctx, va, size, phys))
DOOR(unmap, (vp__device_t *dev, uint64_t va, uint64_t size),
     (dev->ctx, va, size))
DOOR(set_access, (vp__device_t *dev, uint64_t va, uint64_t size),
     (dev->ctx, va, size))
DOOR(stream_create, (vp__device_t *dev, vp_stream_t *stream),
     (dev->ctx, stream))
DOOR(stream_destroy, (vp__device_t *dev, vp_stream_t stream),
     (dev->ctx, stream))
DOOR(synchronize, (vp__device_t *dev), (dev->ctx))
DOOR(stream_synchronize, (vp__device_t *dev, vp_stream_t stream),
     (dev->ctx, stream))
DOOR(stream_wait_event, (vp__device_t *dev, vp_stream_t s, vp__event_t ev),
     (dev->ctx, s, ev))
DOOR(event_create, (vp__device_t *dev, vp__event_t *ev), (dev->ctx, ev))
DOOR(event_destroy, (vp__device_t *dev, vp__event_t ev), (dev->ctx, ev))
DOOR(event_record, (vp__device_t *dev, vp__event_t ev, vp_stream_t stream),
     (dev->ctx, ev, stream))
DOOR(event_query, (vp__device_t *dev, vp__event_t ev), (dev->ctx, ev))
DOOR(event_synchronize, (vp__device_t *dev, vp__event_t ev), (dev->ctx, ev))
DOOR(copy_htod, (vp__device_t *dev, uint64_t dst, const void *src,
                 uint64_t size, vp_stream_t stream),
     (dev->ctx, dst, src, size, stream))
DOOR(copy_dtoh, (vp__device_t *dev, void *dst, uint64_t src, uint64_t size,
                 vp_stream_t stream),
     (dev->ctx, dst, src, size, stream))
DOOR(host_register, (vp__device_t *dev, void *ptr, uint64_t size),
     (dev->ctx, ptr, size))
DOOR(host_unregister, (vp__device_t *dev, void *ptr), (dev->ctx, ptr))

int vp__be_copy_htod_sm(vp__device_t *dev, uint64_t dst, const void *src,
                        uint64_t size, vp_stream_t stream, uint32_t programs) {
  if (!dev->be->copy_htod_sm) return VP_EUNSUPPORTED;
  return result(dev, dev->be->copy_htod_sm(dev->ctx, dst, src, size, stream,
                                           programs),
                "copy_htod_sm");
}

/* The simulated device's extras: VP_EUNSUPPORTED elsewhere. */
int vp__be_launch(vp__device_t *dev, vp_stream_t stream, void (*fn)(void *),
                  void *arg) {
  if (!dev->be->launch) return VP_EUNSUPPORTED;
  return result(dev, dev->be->launch(dev->ctx, stream, fn, arg), "launch");
}

int vp__be_inject(vp__device_t *dev, int kind, uint64_t n) {
  if (!dev->be->inject) return VP_EUNSUPPORTED;
  return result(dev, dev->be->inject(dev->ctx, kind, n), "inject");
}
