/* The file reader: file regions to device memory through a ring of bounce
 * slots (opts.file_slots of opts.file_slot_size bytes, pinned when the pin
 * budget allows), each with an event. A region is read a slot at a time:
 * pread into the next slot, upload it on the caller's stream, record the
 * slot's event; a slot is overwritten only after its event, so reading
 * chunk k+1 overlaps the upload of chunk k. A device has two rings, each
 * made on first use: the pager's (fills from files, safetensors loads),
 * used with the device lock held, and the public readers' (vp_file_read_
 * to_*), used under the device's reader_lock, the device lock dropped
 * while a slot is read and uploaded: a large read does not stall every
 * other thread's faults on the device. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ULL(x) ((unsigned long long)(x))

typedef struct ring_slot {
  void *buf;          /* NULL until first used */
  bool hostmem;       /* from vp__host_alloc (else vp__os_vm_alloc) */
  bool pinned;
  bool has_event;
  bool in_flight;     /* an upload from buf may still be reading it */
  vp__event_t ev;
} ring_slot_t;

struct vp__file_ring {
  uint32_t n, next;
  uint64_t slot_size;
  ring_slot_t slots[];
};

static int ring_get(vp__device_t *dev, struct vp__file_ring **ring,
                    struct vp__file_ring **out) {
  if (!*ring) {
    uint32_t n = dev->opts.file_slots;
    struct vp__file_ring *r = NULL;
    if (vp__inject_fail(&dev->inject) ||
        !(r = calloc(1, sizeof *r + n * sizeof r->slots[0])))
      return vp__err(VP_ENOMEM, "file reader: no memory for a ring of %u slots",
                     n);
    r->n = n;
    r->slot_size = dev->opts.file_slot_size;
    *ring = r;
  }
  *out = *ring;
  return VP_OK;
}

static void slot_free_buf(vp__device_t *dev, struct vp__file_ring *r,
                          ring_slot_t *s) {
  if (!s->buf) return;
  if (s->hostmem) vp__host_free(dev, s->buf, r->slot_size, s->pinned);
  else vp__os_vm_free(s->buf, (size_t)r->slot_size);
  s->buf = NULL;
}

/* Make slot s usable for a new chunk: allocate it on first use, else wait
 * for its last upload (its memory is about to be overwritten). */
static int slot_ready(vp__device_t *dev, struct vp__file_ring *r,
                      ring_slot_t *s, const char *what) {
  if (s->in_flight) {
    int rc = vp__be_event_synchronize(dev, s->ev);
    if (rc)
      return vp__err(rc, "%s: waiting for an upload of the file reader failed",
                     what);
    s->in_flight = false;
  }
  if (!s->has_event) {
    int rc = vp__be_event_create(dev, &s->ev);
    if (rc)
      return vp__err(rc, "%s: creating an event for the file reader failed",
                     what);
    s->has_event = true;
  }
  if (!s->buf) {
    void *p = NULL;
    bool pinned = false;
    if (vp__host_alloc(dev, r->slot_size, &p, &pinned) == VP_OK && p) {
      s->hostmem = true;
    } else {
      /* No pinned memory to be had (or no allocator): pageable memory
       * uploads more slowly but just as correctly. */
      p = NULL;
      if (vp__inject_fail(&dev->inject) || r->slot_size > SIZE_MAX ||
          vp__os_vm_alloc((size_t)r->slot_size, &p))
        return vp__err(VP_ENOMEM, "%s: no memory for a file reader slot of "
                       "%llu bytes", what, ULL(r->slot_size));
      s->hostmem = false;
      pinned = false;
    }
    s->buf = p;
    s->pinned = pinned;
  }
  return VP_OK;
}

/* Read exactly n bytes at off. Returns 0, an errno, or -1 when the file
 * ends first; *got says how far it came. Callers word the message. */
int vp__pread_exact(int fd, void *buf, uint64_t n, uint64_t off,
                    uint64_t *got) {
  for (*got = 0; *got < n;) {
    uint64_t want = n - *got;
    size_t r = 0;
    int e = vp__os_file_read_at(fd, (char *)buf + *got,
                                want > SIZE_MAX ? SIZE_MAX : (size_t)want,
                                off + *got, &r);
    if (e) return e;
    if (r == 0) return -1;
    *got += r;
  }
  return 0;
}

/* The message for vp__pread_exact's answer e (0: none) to a read of the
 * part [at, at + n) of the n_all bytes at off_all, which came `got` bytes
 * far; a read that ends early means the file is shorter than expected. */
static int read_said(int e, uint64_t at, uint64_t n, uint64_t got,
                     uint64_t off_all, uint64_t n_all, const char *what) {
  if (e > 0)
    return vp__err(e == ENOMEM ? VP_ENOMEM : VP_EINVAL, "%s: reading %llu "
                   "bytes at offset %llu failed: %s", what, ULL(n - got),
                   ULL(at + got), strerror(e));
  if (e < 0)
    return vp__err(VP_ERANGE, "%s: the file ends at offset %llu, before the "
                   "%llu bytes at offset %llu were read (it is shorter than "
                   "expected)", what, ULL(at + got), ULL(n_all),
                   ULL(off_all));
  return VP_OK;
}

/* vp__pread_exact with messages naming `what`. */
static int read_full(int fd, void *buf, uint64_t n, uint64_t off,
                     const char *what) {
  uint64_t got;
  int e = vp__pread_exact(fd, buf, n, off, &got);
  return read_said(e, off, n, got, off, n, what);
}

/* A piece of a slot read on its own thread. */
typedef struct read_piece {
  int fd;
  char *buf;
  uint64_t n, off, got;
  int err; /* vp__pread_exact's answer */
} read_piece_t;

static void *read_piece_run(void *arg) {
  read_piece_t *p = arg;
  p->err = vp__pread_exact(p->fd, p->buf, p->n, p->off, &p->got);
  return NULL;
}

/* Below this a piece's thread costs more than the parallel read saves. */
#define PIECE_MIN (1ull << 20)

/* read_full over up to `threads` threads, each reading one contiguous
 * piece (page-aligned in the buffer): a single pread stream does not keep
 * a fast NVMe drive (or the page cache's copy) busy. A thread that cannot
 * be started reads its piece on the calling thread. locked: the device
 * lock is held (fault injection's countdown is the pager's: touched only
 * under it). */
static int read_par(vp__device_t *dev, bool locked, int fd, void *buf,
                    uint64_t n, uint64_t off, uint32_t threads,
                    const char *what) {
  uint64_t k = threads < n / PIECE_MIN ? threads : n / PIECE_MIN;
  if (k <= 1) return read_full(fd, buf, n, off, what);
  read_piece_t p[VP_FILE_THREADS_MAX];
  vp__os_thread_t t[VP_FILE_THREADS_MAX];
  bool started[VP_FILE_THREADS_MAX] = {false};
  uint64_t step = (n / k + 4095) & ~4095ull, m = 0;
  for (uint64_t at = 0; at < n; at += step, m++)
    p[m] = (read_piece_t){.fd = fd, .buf = (char *)buf + at,
                          .n = n - at < step ? n - at : step, .off = off + at};
  for (uint64_t i = 1; i < m; i++)
    started[i] = !(locked && vp__inject_fail(&dev->inject)) &&
                 vp__os_thread_start(&t[i], read_piece_run, &p[i], 0) == 0;
  read_piece_run(&p[0]);
  for (uint64_t i = 1; i < m; i++) {
    if (started[i]) vp__os_thread_join(&t[i]);
    else read_piece_run(&p[i]);
  }
  for (uint64_t i = 0; i < m; i++)
    if (p[i].err)
      return read_said(p[i].err, p[i].off, p[i].n, p[i].got, off, n, what);
  return VP_OK;
}

static vp__vbar_t *vbar_of(vp__device_t *dev, uint64_t addr) {
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down)
    if (addr >= vb->va && addr - vb->va < vb->size) return vb;
  return NULL;
}

/* vp__file_read through *ring with each slot read over `threads` threads;
 * unlocked: the device lock is dropped while a slot is read and uploaded
 * (the caller holds reader_lock: the ring is its alone meanwhile). The
 * device lock is held on return. */
static int file_read(vp__device_t *dev, struct vp__file_ring **ring,
                     bool unlocked, int fd, uint64_t offset, uint64_t size,
                     uint64_t dst, vp_stream_t stream, uint32_t threads,
                     const char *what) {
  if (size == 0) return VP_OK;
  vp__os_file_info_t sb;
  int e = vp__os_file_stat(fd, &sb);
  if (e) return vp__err(VP_EINVAL, "%s: fstat failed: %s", what, strerror(e));
  if (offset > UINT64_MAX - size ||
      (sb.regular && offset + size > sb.size))
    return vp__err(VP_ERANGE, "%s: [%llu, +%llu) runs past the end of the file "
                   "(%llu bytes)", what, ULL(offset), ULL(size),
                   ULL(sb.size));
  if (offset + size > (uint64_t)INT64_MAX)
    return vp__err(VP_ERANGE, "%s: offset %llu + %llu is too large for a file",
                   what, ULL(offset), ULL(size));
  struct vp__file_ring *r = NULL;
  int rc = ring_get(dev, ring, &r);
  if (rc) return rc;
  for (uint64_t done = 0; done < size;) {
    ring_slot_t *s = &r->slots[r->next];
    r->next = (r->next + 1) % r->n;
    if (unlocked && s->in_flight) {
      /* Its last upload may sit behind all the work queued on the
       * caller's stream (a busy GPU): wait for it without the device
       * lock. */
      vp__os_mutex_unlock(&dev->lock);
      rc = vp__be_event_synchronize(dev, s->ev);
      vp__os_mutex_lock(&dev->lock);
      if (rc)
        return vp__err(rc, "%s: waiting for an upload of the file reader "
                       "failed", what);
      s->in_flight = false;
    }
    rc = slot_ready(dev, r, s, what);
    if (rc) return rc;
    uint64_t n = size - done < r->slot_size ? size - done : r->slot_size;
    if (unlocked) vp__os_mutex_unlock(&dev->lock);
    rc = read_par(dev, !unlocked, fd, s->buf, n, offset + done, threads,
                  what);
    if (rc == VP_OK) { /* (a copy needs no device lock: backend.h) */
      rc = vp__be_copy_htod(dev, dst + done, s->buf, n, stream);
      if (rc)
        rc = vp__err(rc, "%s: uploading %llu bytes to 0x%llx on stream "
                     "0x%llx failed", what, ULL(n), ULL(dst + done),
                     ULL(stream));
    }
    if (unlocked) vp__os_mutex_lock(&dev->lock);
    if (rc) return rc;
    rc = vp__be_event_record(dev, s->ev, stream);
    if (rc) {
      /* Without the event the slot is safe again only once the stream has
       * drained. */
      vp__be_stream_synchronize(dev, stream);
      return vp__err(rc, "%s: recording an event on stream 0x%llx failed",
                     what, ULL(stream));
    }
    s->in_flight = true;
    done += n;
    dev->stats.file_bytes_read += n;
    vp__vbar_t *vb = vbar_of(dev, dst); /* (looked up under the lock) */
    if (vb) vb->stats.file_bytes_read += n;
  }
  return VP_OK;
}

int vp__file_read(vp__device_t *dev, int fd, uint64_t offset, uint64_t size,
                  uint64_t dst, vp_stream_t stream, const char *what) {
  return file_read(dev, &dev->file_ring, false, fd, offset, size, dst, stream,
                   1, what);
}

/* Wait for a ring's uploads, free it (device lock held). */
static void ring_close(vp__device_t *dev, struct vp__file_ring **ring) {
  struct vp__file_ring *r = *ring;
  if (!r) return;
  for (uint32_t i = 0; i < r->n; i++) {
    ring_slot_t *s = &r->slots[i];
    if (s->in_flight) vp__be_event_synchronize(dev, s->ev);
    if (s->has_event) vp__be_event_destroy(dev, s->ev);
    slot_free_buf(dev, r, s);
  }
  free(r);
  *ring = NULL;
}

void vp__fileio_close(vp__device_t *dev) {
  ring_close(dev, &dev->file_ring);
  ring_close(dev, &dev->reader_ring);
}

/* A public reader's entry: the device's reader_lock, then the device lock
 * (in that order, as file_read takes the device lock back while holding
 * the reader lock). */
static int reader_enter(vp_device_t h, vp__device_t **out) {
  vp__device_t *dev = vp__registry_get(h.id);
  if (!dev || dev->id != h.id)
    return vp__err(VP_EHANDLE, "device handle 0x%llx is not an open device",
                   ULL(h.id));
  vp__os_mutex_lock(&dev->reader_lock);
  int rc = vp__dev_enter(h, out);
  if (rc) vp__os_mutex_unlock(&dev->reader_lock);
  return rc;
}

static int reader_leave(vp__device_t *dev, int rc) {
  rc = vp__unlock(dev, rc);
  vp__os_mutex_unlock(&dev->reader_lock);
  return rc;
}

/* Arguments both public readers check the same way. */
static int check_read_args(int fd, uint64_t offset, uint64_t size) {
  if (fd < 0) return vp__err(VP_EINVAL, "fd %d is negative", fd);
  if (size == 0) return vp__err(VP_EINVAL, "size is 0");
  if (offset > UINT64_MAX - size)
    return vp__err(VP_ERANGE, "offset %llu + size %llu overflows", ULL(offset),
                   ULL(size));
  return VP_OK;
}

int vp_file_read_to_device(vp_device_t h, int fd, uint64_t offset,
                           uint64_t size, uint64_t dst_addr,
                           vp_stream_t stream) {
  VP__ENTER();
  int rc = check_read_args(fd, offset, size);
  if (rc) return rc;
  vp__device_t *dev = NULL;
  rc = reader_enter(h, &dev);
  if (rc) return rc;
  rc = vp__pinned_range(dev, dst_addr, size);
  if (rc == VP_OK) {
    char what[64];
    snprintf(what, sizeof what, "fd %d", fd);
    rc = file_read(dev, &dev->reader_ring, true, fd, offset, size, dst_addr,
                   stream, 1, what);
  }
  return reader_leave(dev, rc);
}

int vp_file_read_to_address(vp_device_t h, int fd, uint64_t offset,
                            uint64_t size, uint64_t dst_addr,
                            vp_stream_t stream, uint32_t threads) {
  VP__ENTER();
  int rc = check_read_args(fd, offset, size);
  if (rc) return rc;
  if (!dst_addr) return vp__err(VP_EINVAL, "dst_addr is 0");
  if (dst_addr > UINT64_MAX - size)
    return vp__err(VP_ERANGE, "dst_addr 0x%llx + size %llu overflows",
                   ULL(dst_addr), ULL(size));
  if (threads < 1 || threads > VP_FILE_THREADS_MAX)
    return vp__err(VP_EINVAL, "threads %u is not in 1..%d", threads,
                   VP_FILE_THREADS_MAX);
  vp__device_t *dev = NULL;
  rc = reader_enter(h, &dev);
  if (rc) return rc;
  /* Memory of a VBAR keeps vp_file_read_to_device's rules; any other
   * memory is the caller's, and vpager cannot check it. */
  for (vp__vbar_t *vb = dev->top; vb && !rc; vb = vb->down)
    if (dst_addr < vb->va + vb->size && dst_addr + size > vb->va)
      rc = vp__pinned_range(dev, dst_addr, size);
  if (rc == VP_OK) {
    char what[64];
    snprintf(what, sizeof what, "fd %d", fd);
    rc = file_read(dev, &dev->reader_ring, true, fd, offset, size, dst_addr,
                   stream, threads, what);
  }
  return reader_leave(dev, rc);
}

int vp_file_descriptor(intptr_t os_handle, int *fd) {
  VP__ENTER();
  VP__NEED(fd, "fd is NULL");
  *fd = -1;
  int e = vp__os_file_dup(os_handle, fd);
  if (e)
    return vp__err(VP_EINVAL, "os_handle %lld is no open file: %s",
                   (long long)os_handle, strerror(e));
  return VP_OK;
}

int vp_file_descriptor_close(int fd) {
  VP__ENTER();
  if (fd < 0) return vp__err(VP_EINVAL, "fd %d is no file descriptor", fd);
  vp__os_file_close(fd);
  return VP_OK;
}

int vp_file_reader_release(vp_device_t h) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = reader_enter(h, &dev);
  if (rc) return rc;
  vp__fileio_close(dev);
  return reader_leave(dev, VP_OK);
}
