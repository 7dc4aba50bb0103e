/* vpager — demand paging of model weights into GPU memory.
 *
 * This header is the whole public C API and its only documentation.
 *
 * Glossary
 *   device   A GPU (CUDA or HIP backend) or the simulated device (host
 *            memory).
 *   VBAR     A reserved range of device virtual addresses, as large as a
 *            model; it costs no device memory until pages are committed.
 *   page     The unit of commit and eviction (default 32 MiB, a power of two
 *            and a multiple of the backend's granularity).
 *   pin      A page is pinned from a successful vp_fault() until the matching
 *            vp_unpin(); pinned pages are never evicted. Pins are counted.
 *   fence    An event recorded on the caller's stream at vp_unpin(); eviction
 *            of that page waits for it (and only for it).
 *   generation  A 32-bit number per page, new every time the page is
 *            committed. Data in a page is valid exactly while its generation
 *            is unchanged since the data was written.
 *   rank     A page's place in its VBAR's eviction order: rank 0 is evicted
 *            last. Evicting the page of rank r lowers the VBAR's watermark to
 *            r; a non-resident page ranked at or above the watermark is a
 *            miss at once, so a squeezed model keeps a stable resident set.
 *   priority VBARs form a list; pressure evicts the lowest-priority VBAR
 *            first. vp_vbar_prioritize() moves a VBAR to the top and lifts
 *            its watermark.
 *
 * Conventions
 *   Every function returns VP_OK (0) or a negative VP_E* code, except where
 *   stated (vp_fault() returns VP_MISS, a positive code, for a normal miss).
 *   After a failure vp_last_error() gives a message for the calling thread.
 *   Handles are values; a freed, never-created or foreign handle gives
 *   VP_EHANDLE, never a crash. Closing a device while another thread is
 *   still calling into it is the one misuse that is not detected.
 *   Addresses and sizes are bytes. Streams are backend stream values: a
 *   CUstream on CUDA, a hipStream_t on HIP, a value from vp_stream_create()
 *   on any backend;
 *   0 is the device's default stream.
 */
#ifndef VPAGER_H
#define VPAGER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(VPAGER_BUILD)
#define VP_API __attribute__((visibility("default")))
#else
#define VP_API
#endif

#define VP_VERSION_MAJOR 0
#define VP_VERSION_MINOR 1
#define VP_VERSION_PATCH 0

/* ---------------------------------------------------------------- errors */

/* One list generates the enum, vp_strerror() and vp_err_name(). */
#define VP_ERRNO_MAP(XX)                                                       \
  XX(EINVAL, -1, "invalid argument")                                           \
  XX(EHANDLE, -2, "invalid, stale or foreign handle")                          \
  XX(ENOMEM, -3, "out of host memory")                                         \
  XX(ERANGE, -4, "range outside the VBAR")                                     \
  XX(EBUSY, -5, "object is in use (pinned pages)")                             \
  XX(ENOTPINNED, -6, "range is not pinned")                                    \
  XX(ENODEV, -7, "no usable device for this backend")                          \
  XX(EDEVICE, -8, "device is broken")                                          \
  XX(EAGAIN, -9, "transient device error, try again")                          \
  XX(EOOM, -10, "out of device memory")                                        \
  XX(EUNSUPPORTED, -11, "not supported by this backend")                       \
  XX(ELIMIT, -12, "internal limit reached")

typedef enum vp_error {
  VP_OK = 0,
  VP_MISS = 1, /* vp_fault(): the range cannot be made resident now */
#define VP__ERR_ENUM(name, code, text) VP_##name = code,
  VP_ERRNO_MAP(VP__ERR_ENUM)
#undef VP__ERR_ENUM
} vp_error_t;

/* A static description of a code ("invalid argument"); never NULL. */
VP_API const char *vp_strerror(int code);
/* The code's name ("VP_EINVAL"); never NULL. */
VP_API const char *vp_err_name(int code);
/* What went wrong in the last failing call of this thread, naming the
 * function and the offending value. Empty string when nothing failed yet. */
VP_API const char *vp_last_error(void);

/* --------------------------------------------------------------- logging */

typedef enum vp_log_level {
  VP_LOG_NONE = 0,
  VP_LOG_ERROR = 1,
  VP_LOG_WARN = 2,
  VP_LOG_INFO = 3,
  VP_LOG_DEBUG = 4,
  VP_LOG_TRACE = 5
} vp_log_level_t;

/* Set the process-wide log level (the only global setting). Messages go to
 * stderr prefixed "vpager[<backend>]". Initially from VPAGER_LOG (a number
 * 0-5 or none/error/warn/info/debug/trace), else VP_LOG_WARN. */
VP_API int vp_set_log_level(int level);
VP_API int vp_get_log_level(void);

/* --------------------------------------------------------------- options */

typedef enum vp_backend_kind {
  VP_BACKEND_AUTO = 0, /* CUDA when a GPU is usable, else HIP, else the
                          simulated device */
  VP_BACKEND_CUDA = 1,
  VP_BACKEND_SIM = 2,
  VP_BACKEND_HIP = 3 /* AMD GPUs through ROCm 5.3 or later (libamdhip64) */
} vp_backend_kind_t;

typedef enum vp_evict_order {
  VP_ORDER_TAIL_FIRST = 0, /* highest offsets go first; resident = a prefix */
  /* Misses spread evenly: bit-reversed page index; once the VBAR has
   * weights, in groups (the pages a weight spans, joined with any weight
   * sharing a page, are ranked together), so eviction takes whole weights.
   * Ranks follow the weights when they are created while no page of the
   * VBAR is resident. Put a page boundary between weights to split groups. */
  VP_ORDER_INTERLEAVED = 1,
  /* The caller's ranking, given page by page (vp_vbar_set_ranks): a
   * scheduler that knows which weights to keep resident ranks their pages
   * first. Not an option value: vp_vbar_set_order() refuses it. */
  VP_ORDER_CUSTOM = 2
} vp_evict_order_t;

typedef enum vp_sim_streams {
  VP_SIM_SYNC = 0,  /* copies and launches run at once, in the caller */
  VP_SIM_WORKER = 1 /* each stream is a worker thread; work runs later */
} vp_sim_streams_t;

/* Options for vp_device_open(). Fill with vp_options_init() (defaults, then
 * VPAGER_* environment variables), then change fields as needed. */
typedef struct vp_options {
  uint32_t size;           /* sizeof(vp_options_t); set by vp_options_init */
  int backend;             /* vp_backend_kind_t;
                              VPAGER_BACKEND=auto|cuda|hip|sim */
  int device_index;        /* GPU ordinal; VPAGER_DEVICE */
  uint64_t page_size;      /* bytes; VPAGER_PAGE_SIZE (default 32M); a power
                              of two, a multiple of the granularity and at
                              most the device's memory (else vp_device_open
                              gives VP_EINVAL naming page_size) */
  int64_t headroom;        /* bytes kept free; -1 = the backend's default:
                              0 on the simulated device; on a GPU the
                              larger of 512 MiB and 2% of its memory
                              (768 MiB and 4% under WDDM: WSL2), at most a
                              quarter of it; VPAGER_HEADROOM */
  uint32_t poll_interval_us; /* min time between free-memory polls;
                              VPAGER_POLL_US (default 5000) */
  int evict_order;         /* vp_evict_order_t for new VBARs; VPAGER_ORDER=
                              tail|interleaved */
  /* Simulated device only. */
  uint64_t sim_capacity;   /* bytes; VPAGER_SIM_CAPACITY (default 4G) */
  uint64_t sim_granularity; /* bytes; VPAGER_SIM_GRANULARITY (default 2M) */
  int sim_streams;         /* vp_sim_streams_t; VPAGER_SIM_STREAMS=sync|worker */
  char sim_shared[64];     /* non-empty: share the device's used-memory count
                              with every process opening the same name;
                              VPAGER_SIM_SHARED */
  int64_t sim_fail_nth;    /* >0: the Nth backend call or internal allocation
                              of this device fails (tests walk every rung) */
  /* Streaming (vp_acquire). */
  uint64_t staging_size;   /* VRAM staging ring for misses; VPAGER_STAGING
                              (default 512M; charged to the budget) */
  uint64_t lookahead;      /* how far prefetch runs ahead of each acquire:
                              up to this many bytes of the next weights of
                              the VBAR that need a copy are staged or filled
                              ahead, in the order the weights were created
                              (weights that stayed resident are skipped and
                              not counted);
                              VPAGER_LOOKAHEAD (default 256M; 0 = off) */
  uint64_t pin_budget;     /* host bytes vpager may page-lock on this
                              machine, across every process and GPU that
                              shares the pin ledger (see "host buffers");
                              given, it becomes the machine's budget (the
                              last one given wins); 0 = keep the machine's,
                              or when none is set yet half of RAM or of
                              the cgroup's memory limit, whichever is less;
                              VPAGER_PIN_BUDGET */
  uint32_t file_slots;     /* pinned bounce slots of the file reader;
                              VPAGER_FILE_SLOTS (default 3) */
  uint64_t file_slot_size; /* bytes each; VPAGER_FILE_SLOT_SIZE (default 64M) */
  /* The GPU's ledger, shared by processes (see "ledger" below). */
  char ledger[64];         /* "" (default): the GPU's UUID on CUDA, the
                              sim_shared name on the simulated device (none
                              when it is not shared); "off": no ledger; else
                              a name of letters, digits, - and _;
                              VPAGER_LEDGER */
  uint32_t ledger_timeout_us; /* how long a release request waits for each
                              other process; 0 = 50000; VPAGER_LEDGER_TIMEOUT_US */
  int staging_wrap;        /* 1 (default): the staging ring's pages are
                              mapped twice, back to back, where the backend
                              can (CUDA; the simulated device on Linux), so
                              a slot that does not fit before the ring's end
                              runs on into its start and the whole ring
                              holds slots; 0, or where it cannot: such a
                              slot starts at 0 and the tail stays unused
                              (vp_device_info's staging_wraps says which);
                              VPAGER_STAGING_WRAP=0|1 */
} vp_options_t;

/* Fill opts with defaults, then apply VPAGER_* environment variables; a bad
 * value logs a warning and keeps the default. */
VP_API int vp_options_init(vp_options_t *opts);
/* Parse a size: digits with an optional suffix. K/M/G/T and KiB/MiB/GiB/TiB
 * are powers of 1024, KB/MB/GB/TB powers of 1000 ("20GB" is 20e9 bytes,
 * "20G" and "20GiB" are 20 << 30); case does not matter. */
VP_API int vp_parse_size(const char *text, uint64_t *out);

/* ---------------------------------------------------------------- device */

typedef struct vp_device { uint64_t id; } vp_device_t;
typedef struct vp_vbar { uint64_t id; } vp_vbar_t;
typedef uint64_t vp_stream_t;

/* Open a device. opts may be NULL (vp_options_init defaults). On failure
 * nothing is left allocated. */
VP_API int vp_device_open(const vp_options_t *opts, vp_device_t *out);
/* Destroy every VBAR (waiting for the fences of its pages, pinned or not)
 * and close the device. A second close gives VP_EHANDLE. */
VP_API int vp_device_close(vp_device_t dev);
/* The backend's name: "cuda", "hip" or "sim". Static string, NULL on a bad
 * handle. */
VP_API const char *vp_device_backend(vp_device_t dev);

typedef struct vp_device_info {
  uint64_t page_size;
  uint64_t granularity;    /* backend's commit granularity */
  uint64_t total_memory;   /* device memory in bytes */
  uint64_t free_memory;    /* device-wide free memory at the last poll */
  uint64_t committed;      /* bytes this device handle has committed */
  uint64_t budget;         /* bytes it may commit now (at the last poll) */
  int64_t headroom;        /* bytes this handle keeps free */
  int async_copies;        /* copies run apart from the calling thread */
  int64_t shared_headroom; /* what it asks the device's other vpager
                              processes to keep free (-1: its headroom;
                              vp_device_set_shared_headroom) */
  uint64_t kept_free;      /* bytes it keeps free now: the larger of its
                              headroom and the largest shared headroom of
                              the device's other live vpager processes */
  int staging_wraps;       /* the staging ring's slots run past its end into
                              its start (options.staging_wrap, where the
                              backend maps a page twice): all of the ring
                              holds slots, not what first fit leaves */
} vp_device_info_t;
/* Fill *info (polls the device's free memory if the poll interval passed). */
VP_API int vp_device_info(vp_device_t dev, vp_device_info_t *info);
/* How many devices `backend` has, none opened: VP_BACKEND_CUDA, the GPUs
 * the driver sees (0 when libcuda.so.1 cannot be loaded or initialised;
 * the reason is logged at debug); VP_BACKEND_HIP, the same for ROCm's
 * libamdhip64; VP_BACKEND_SIM, 1. For callers that would otherwise ask
 * the driver themselves. */
VP_API int vp_device_count(int backend, int *count);
/* Drop a page-lock registration another library made on host memory at
 * ptr (cuMemHostRegister / cudaHostRegister: a client's own pinned
 * buffer), in this device's context, for callers without a CUDA binding
 * of their own. VP_EINVAL when ptr is not registered. The simulated device
 * registers nothing and answers VP_OK. What vpager pinned itself is
 * vp_hostbuf_free's to drop: VP_EBUSY for memory of a live host buffer. */
VP_API int vp_host_unregister(vp_device_t dev, void *ptr);
/* The platform's soft memory limit for this process on the device, in
 * bytes (0: none): on CUDA, what NVML reports for the process's cgroup
 * (nvmlDeviceGetMemoryLimits_v1: MPS v3 / dmem limits; NVML is loaded at
 * run time and is optional: 0 without it or on an older driver); on the
 * simulated device, what VP_SIM_SET_SOFT_LIMIT set. vpager does not apply
 * it: budgets are the caller's (vp_device_set_limit). */
VP_API int vp_device_soft_limit(vp_device_t dev, uint64_t *bytes);

/* Change the headroom at run time; takes effect at the next commit, which
 * asks the device for its free memory again (what moved the headroom,
 * e.g. torch's allocator, moved that too). */
VP_API int vp_device_set_headroom(vp_device_t dev, int64_t bytes);
/* The headroom shared through the GPU's ledger: what this handle asks
 * every vpager process on the device to keep free, -1 (the default) for
 * its headroom. Each process keeps free the larger of its own headroom
 * and the largest shared headroom of the device's other live processes
 * (read again at least every 100 ms while it works, and at once by this
 * call and vp_device_set_headroom), so room one process leaves for the
 * display and other programs is not filled by another. A framework that
 * adds its own growth to the headroom shares only the part meant for
 * others. Without a ledger it changes nothing. VP_EINVAL below -1. */
VP_API int vp_device_set_shared_headroom(vp_device_t dev, int64_t bytes);
/* Cap what this device handle may commit, whatever the device's free
 * memory (UINT64_MAX, the default: no cap); takes effect at the next
 * commit. The budget is the smaller of this and what the headroom leaves. */
VP_API int vp_device_set_limit(vp_device_t dev, uint64_t bytes);
/* Evict unpinned pages, lowest-priority VBAR first, until at least `bytes`
 * are freed or nothing more can be; *freed (may be NULL) gets the count. */
VP_API int vp_device_free_memory(vp_device_t dev, uint64_t bytes,
                                 uint64_t *freed);
/* Bytes that eviction could free now (resident and unpinned). */
VP_API int vp_device_reclaimable(vp_device_t dev, uint64_t *bytes);
/* Set every VBAR's watermark limit back to "no limit". */
VP_API int vp_device_reset_limits(vp_device_t dev);

/* --------------------------------------------------------------- streams */

/* Streams and copies, with the same meaning on every backend. On CUDA a
 * vp_stream_t is a CUstream (on HIP a hipStream_t), and the caller's own
 * streams may be passed. */
VP_API int vp_stream_create(vp_device_t dev, vp_stream_t *out);
VP_API int vp_stream_destroy(vp_device_t dev, vp_stream_t stream);
VP_API int vp_stream_synchronize(vp_device_t dev, vp_stream_t stream);
/* Copy host memory into pinned pages of a VBAR, in stream order. The
 * destination range must lie in one VBAR and be pinned by the caller
 * (VP_ENOTPINNED otherwise): an unpinned page could be evicted first; or
 * in a staging slot of an acquired weight (to fill a VP_ACQUIRED_EMPTY
 * one). The source must stay valid until the stream reaches the copy. */
VP_API int vp_copy_to_device(vp_device_t dev, uint64_t dst_addr,
                             const void *src, uint64_t size,
                             vp_stream_t stream);
/* Copy pinned VBAR memory to the host, in stream order (same rules). */
VP_API int vp_copy_to_host(vp_device_t dev, void *dst, uint64_t src_addr,
                           uint64_t size, vp_stream_t stream);

/* Simulated device only: run fn(arg) on the stream as if it were a kernel
 * (in worker mode it runs later, on the stream's thread). fn may read and
 * write device memory; touching an uncommitted page crashes the process, as
 * an illegal address does on a GPU. VP_EUNSUPPORTED on other backends. */
VP_API int vp_sim_launch(vp_device_t dev, vp_stream_t stream,
                         void (*fn)(void *arg), void *arg);

typedef enum vp_sim_inject_kind {
  VP_SIM_FAIL_COMMIT = 1,   /* n: the nth page commit from now is out of
                               memory (1 = the next one) */
  VP_SIM_TRANSIENT = 2,     /* n: the next n commits fail with VP_EAGAIN */
  VP_SIM_SET_CAPACITY = 3,  /* n: device capacity in bytes, from now */
  VP_SIM_BREAK = 4,         /* the device becomes broken (n ignored) */
  VP_SIM_SET_SOFT_LIMIT = 5, /* n: vp_device_soft_limit's answer (0 = none) */
  VP_SIM_SET_DESKTOP = 6,   /* n: the desktop the simulated GPU serves, for
                               the default headroom (a headroom the user
                               gave stays): 0 none (0 bytes, the sim's
                               default), 1 a Linux one, 2 a Windows one
                               (WDDM): a GPU's figures for the device's
                               memory now */
  VP_SIM_MAP_APART = 7      /* n: 1, a page mapped at a second address gets
                               memory of its own there, as a driver that
                               maps twice but not as one memory would (the
                               staging ring finds it out and does not
                               wrap); 0, one memory again */
} vp_sim_inject_kind_t;
/* Simulated device only: fault injection for tests. */
VP_API int vp_sim_inject(vp_device_t dev, int kind, uint64_t n);

/* ------------------------------------------------------------------ VBAR */

/* Reserve a VBAR of `size` bytes (rounded up to whole pages). Larger than
 * the device is fine: only address space is reserved. At most 2^22 pages
 * (VP_ELIMIT beyond; 128 TiB with 32 MiB pages), since the page table
 * (about 40 bytes of host memory a page) is allocated up front. The
 * new VBAR goes to the top of the priority list with the device's default
 * eviction order. */
VP_API int vp_vbar_create(vp_device_t dev, uint64_t size, vp_vbar_t *out);
/* Free a VBAR: waits for the fences of its pages, then releases them and
 * its address range. VP_EBUSY (nothing changes) while pages are pinned. */
VP_API int vp_vbar_destroy(vp_vbar_t vbar);
/* Device virtual address of offset 0. */
VP_API int vp_vbar_base(vp_vbar_t vbar, uint64_t *addr);
VP_API int vp_vbar_size(vp_vbar_t vbar, uint64_t *size);
VP_API int vp_vbar_page_count(vp_vbar_t vbar, uint64_t *pages);
/* The device a VBAR belongs to. */
VP_API int vp_vbar_device(vp_vbar_t vbar, vp_device_t *dev);

/* Move to the top of the priority list and lift the watermark. */
VP_API int vp_vbar_prioritize(vp_vbar_t vbar);
/* Move to the bottom of the priority list: evicted first. */
VP_API int vp_vbar_deprioritize(vp_vbar_t vbar);
/* Eviction order (vp_evict_order_t); VP_EBUSY unless no page is resident. */
VP_API int vp_vbar_set_order(vp_vbar_t vbar, int order);
/* The caller's eviction order (VP_ORDER_CUSTOM): pages[r] is the page of
 * rank r (pages[0] is evicted last), a permutation of all n pages of the
 * VBAR (n = its page count). The watermark works on these ranks as on any
 * order, so a squeezed VBAR keeps the pages ranked first. It stays until
 * vp_vbar_set_order() (new weights do not change it). Resident pages stay
 * resident (a re-placement keeps what it keeps in place); from now on they
 * are evicted in the new order. VP_EINVAL if pages is not such a
 * permutation. */
VP_API int vp_vbar_set_ranks(vp_vbar_t vbar, const uint32_t *pages, size_t n);

/* The watermark in ranks (pages): non-resident pages ranked at or above
 * min(watermark, limit) are misses. Eviction lowers it; only
 * vp_vbar_prioritize() lifts it back to the whole VBAR, or an explicit
 * vp_vbar_set_watermark(), which sets it up or down to `bytes` (rounded
 * down to pages; VP_ERANGE past the VBAR). The limit caps new commits
 * (bytes, rounded down; UINT64_MAX = none, which reads back as the page
 * count); get_* return pages. Lowering
 * either evicts nothing by itself: resident pages stay hits. */
VP_API int vp_vbar_set_watermark(vp_vbar_t vbar, uint64_t bytes);
VP_API int vp_vbar_get_watermark(vp_vbar_t vbar, uint64_t *pages);
VP_API int vp_vbar_set_watermark_limit(vp_vbar_t vbar, uint64_t bytes);
VP_API int vp_vbar_get_watermark_limit(vp_vbar_t vbar, uint64_t *pages);

/* Make [offset, offset+size) resident and pin its pages.
 *   VP_OK:   every page is resident and pinned (one more pin each);
 *            gens[i] (if gens != NULL) gets the generation of page i of the
 *            range; ngens must be at least the range's page count.
 *   VP_MISS: nothing pinned: a page is not allowed (ranked at or above the
 *            watermark) or memory cannot be had (budget, device out of
 *            memory, transient errors after retries). A normal outcome.
 *   < 0:     bad arguments, or a broken device.
 * Pages committed during a call that ends in a miss stay resident. */
VP_API int vp_fault(vp_vbar_t vbar, uint64_t offset, uint64_t size,
                    uint32_t *gens, size_t ngens);
/* Drop one pin from each page of the range and record a fence on `stream`:
 * the pages are not evicted before the work queued so far on it completes.
 * VP_ENOTPINNED (nothing changes) if any page of the range is not pinned,
 * or is pinned only by acquired weights (vp_release ends those). */
VP_API int vp_unpin(vp_vbar_t vbar, uint64_t offset, uint64_t size,
                    vp_stream_t stream);
/* A range of a VBAR described once, for callers that fault and unpin the
 * same ranges over and over (a binding then passes one pointer per call,
 * not three converted arguments). */
typedef struct vp_range {
  vp_vbar_t vbar;
  uint64_t offset;
  uint64_t size;
} vp_range_t;
/* vp_fault() and vp_unpin() of *range, with the same results and errors.
 * On VP_OK, vp_fault_range also sets gens[i] to 0 for every i from the
 * range's page count up to ngens, so a caller may keep signatures of a
 * fixed length (larger than the page count). VP_EINVAL if range is NULL. */
VP_API int vp_fault_range(const vp_range_t *range, uint32_t *gens,
                          size_t ngens);
VP_API int vp_unpin_range(const vp_range_t *range, vp_stream_t stream);
/* Evict unpinned pages of this VBAR in its eviction order until at least
 * `bytes` are freed; *freed (may be NULL) gets the count. */
VP_API int vp_vbar_free_memory(vp_vbar_t vbar, uint64_t bytes,
                               uint64_t *freed);
/* Bytes resident. */
VP_API int vp_vbar_loaded_size(vp_vbar_t vbar, uint64_t *bytes);

#define VP_PAGE_RESIDENT 0x1u
#define VP_PAGE_PINNED 0x2u
/* flags[i] for page i (0 <= i < n; n at most the page count): bits
 * VP_PAGE_RESIDENT and VP_PAGE_PINNED. */
VP_API int vp_vbar_residency(vp_vbar_t vbar, uint8_t *flags, size_t n);

/* ----------------------------------------------------------- host memory */

/* Host buffers hold weights' host copies. Page-locked ("pinned") memory
 * copies to the device at full link speed; pageable memory at a fraction.
 * What vpager page-locks stays within ONE budget for the machine
 * (vp_options_t.pin_budget): every device handle joins a host-wide pin
 * ledger (/dev/shm/vpager-pins-<name>: "host" on CUDA, spanning GPUs; the
 * sim_shared name on a shared simulated device; the ledger option's name
 * when given; none when the ledger is "off" or the simulated device is not
 * shared: then the device counts alone against its own pin_budget). Each
 * process's pinned bytes are counted there; a process that dies is reaped
 * with its count. A process short of budget asks the others to give pinned
 * memory back: they make the pinned parts of their host buffers pageable
 * (the bytes stay; copies from them stay correct, only slower), after all
 * work queued on their device finished (on CUDA: the context's, every
 * stream's). When pinning fails or the budget is
 * still spent the memory stays pageable — correct, slower, and counted in
 * stats (pin_fallback_bytes) — never an error. stats.machine_pinned_bytes
 * is the machine's total. */
typedef struct vp_hostbuf { uint64_t id; } vp_hostbuf_t;

/* The machine's RAM as the library reads it (the pin budget's default is
 * a share of `total`): bytes in all, bytes available without swapping
 * (Linux: /proc/meminfo's MemAvailable; Windows: GlobalMemoryStatusEx's
 * available physical memory), and the lowest memory limit over this
 * process's cgroup (Linux) or job object (Windows); 0 where unknown (a
 * limit: none). Needs no device. */
typedef struct vp_host_memory {
  uint64_t total;
  uint64_t available;
  uint64_t limit;
} vp_host_memory_t;
VP_API int vp_host_memory(vp_host_memory_t *out);

/* One file mapping of this process (vp_host_mappings): [start, +size)
 * shows the file at `path` (UTF-8) from file_offset on. file_id tells
 * files apart (Linux: the inode; Windows: the file index). */
#define VP_MAPPING_WRITABLE 0x1u /* the process may write to it */
#define VP_MAPPING_PRIVATE 0x2u  /* copy on write: writes leave the file */
#define VP_MAPPING_WRITTEN 0x4u  /* private, and some page of it is the
                                    process's written copy, no longer the
                                    file's bytes (where it cannot be told:
                                    set for a private mapping) */
typedef struct vp_host_mapping {
  uint64_t start;
  uint64_t size;
  uint64_t file_offset;
  uint64_t file_id;
  uint32_t flags;
  char path[1024];
} vp_host_mapping_t;
/* This process's file mappings in address order: the first `cap` in out
 * (out may be NULL when cap is 0) and the count in all in *n (call again
 * with more room when *n > cap). Linux: /proc/self/smaps' mappings with an
 * inode and a path (WRITTEN from their Anonymous bytes); Windows: views of
 * files that show the file from its start (a view's offset is not told;
 * WRITTEN where a copy-on-write page turned read-write). A path of 1024
 * bytes or more is left out. Needs no device; what safetensors'
 * safe_open, numpy.memmap or torch.load(mmap=True) mapped is found here,
 * so a weight's host bytes can be used where they lie. */
VP_API int vp_host_mappings(vp_host_mapping_t *out, size_t cap, size_t *n);
/* Host bytes a copy was made of leave this process's resident set: of n
 * spans [addrs[i], +sizes[i]), each lying whole in one file mapping the
 * process may not write (no VP_MAPPING_WRITABLE; a private one only where
 * no page of the span was written before it was made read-only) has its
 * whole pages dropped (Linux: madvise MADV_DONTNEED; Windows: taken out of
 * the working set); the file's cache keeps them and a later touch reads
 * them back, the same bytes. Any other span is left alone: nothing
 * written is ever lost. *dropped (may be NULL): the bytes dropped. Needs
 * no device. */
VP_API int vp_host_drop_resident(size_t n, const uint64_t *addrs,
                                 const uint64_t *sizes, uint64_t *dropped);

/* Host address space that grows and shrinks in place, one set of calls
 * for POSIX (mmap, mprotect, madvise) and Windows (VirtualAlloc,
 * VirtualFree): what comfy_aimdo's host buffers do, on vpager
 * (python/compat). Needs no device. vp_host_reserve takes `size` bytes
 * (rounded up to pages) of address space with no access and no memory,
 * starting at a multiple of `align` (a power of two; 0: the OS's own);
 * vp_host_release gives a whole reservation back (its start and size).
 * Within one, ranges of whole pages (vp_host_page_size) are made
 * read-write (commit: zeros, memory on first touch), faulted in now
 * (populate: VP_ENOMEM where Linux says the memory is not there), given
 * back and left read-write (discard: zeros when next read), or given back
 * with their access (decommit). advise_huge hints transparent huge pages
 * (Linux; nothing elsewhere). A size of 0 does nothing, except for
 * release. */
VP_API int vp_host_page_size(uint64_t *bytes);
VP_API int vp_host_reserve(uint64_t size, uint64_t align, void **addr);
VP_API int vp_host_commit(void *addr, uint64_t size);
VP_API int vp_host_populate(void *addr, uint64_t size);
VP_API int vp_host_discard(void *addr, uint64_t size);
VP_API int vp_host_decommit(void *addr, uint64_t size);
VP_API int vp_host_advise_huge(void *addr, uint64_t size);
VP_API int vp_host_release(void *addr, uint64_t size);
/* The first `size` bytes (at most the file's) of the regular file of fd,
 * an fd of vpager's runtime (vp_file_descriptor), mapped read-only and
 * shared with the OS's file cache; vp_file_unmap(addr, size) undoes it.
 * vp_file_read_at: one read of up to n bytes of fd at `offset` into buf,
 * *got the bytes read (0: the file ends there); Windows' reads of one
 * handle from several threads run at once (overlapped), as pread's do. */
VP_API int vp_file_map(int fd, uint64_t size, const void **addr);
VP_API int vp_file_unmap(const void *addr, uint64_t size);
VP_API int vp_file_read_at(int fd, void *buf, uint64_t n, uint64_t offset,
                           uint64_t *got);

typedef struct vp_hostbuf_info {
  void *ptr;             /* never moves, also across vp_hostbuf_grow */
  uint64_t size;         /* usable bytes now */
  uint64_t max_size;     /* bytes it may grow to */
  uint64_t pinned_bytes; /* how much of size is page-locked (it falls
                            when another process asked for pinned
                            memory back: those bytes stay, pageable) */
} vp_hostbuf_info_t;

/* Allocate `size` bytes (zeroed) with room to grow to `max_size` (address
 * space is reserved now, memory committed as it grows). A buffer of 2 MiB
 * or more starts on a 2 MiB boundary and asks for transparent huge pages.
 * Memory you fill anyway is cheaper to fill first and page-lock after
 * (vp_hostbuf_register): see bench/bench_load.py. */
VP_API int vp_hostbuf_alloc(vp_device_t dev, uint64_t size, uint64_t max_size,
                            vp_hostbuf_t *out);
/* Page-lock existing memory [ptr, ptr+size) (it stays the caller's; free
 * the hostbuf before freeing the memory). Memory that cannot be pinned
 * for writing, such as a read-only file mapping used in place, is pinned
 * read-only where the device allows it (CUDA 11.1+): the device only
 * reads host sources. */
VP_API int vp_hostbuf_register(vp_device_t dev, void *ptr, uint64_t size,
                               vp_hostbuf_t *out);
/* Grow an allocated hostbuf to `size` (<= max_size, else VP_ERANGE) in
 * place; the new bytes are zeroed and pinned on their own, within the
 * budget (pinning costs tens of ms per GiB: grow in large steps). VP_EINVAL
 * to shrink or to grow registered memory. */
VP_API int vp_hostbuf_grow(vp_hostbuf_t hb, uint64_t size);
VP_API int vp_hostbuf_info(vp_hostbuf_t hb, vp_hostbuf_info_t *info);
/* Unpin (and, if allocated, unmap) it; copies from it must be complete.
 * Closing the device frees every hostbuf left. grow and free give VP_EBUSY
 * while another thread is still pinning the same hostbuf. */
VP_API int vp_hostbuf_free(vp_hostbuf_t hb);
/* Change the pin budget (bytes; 0 = pin nothing more): the machine's, for
 * every process on the pin ledger (the last one set wins), or this
 * device's without one. It affects later pinning only: nothing pinned is
 * taken back, but later pinning asks the others to give back. */
VP_API int vp_device_set_pin_budget(vp_device_t dev, uint64_t bytes);

/* --------------------------------------------------- weights and streaming */

/* A weight is a range of a VBAR with a source its bytes come from. */
typedef struct vp_weight { uint64_t id; } vp_weight_t;

typedef enum vp_source_kind {
  VP_SOURCE_NONE = 0, /* the caller fills the bytes (see VP_ACQUIRED_EMPTY) */
  VP_SOURCE_HOST = 1, /* host memory, fastest inside a pinned hostbuf */
  VP_SOURCE_FILE = 2  /* a region of an open file */
} vp_source_kind_t;

typedef struct vp_source {
  int kind;             /* vp_source_kind_t */
  const void *host;     /* HOST: the bytes; must stay valid and unchanged
                           while the weight exists */
  int fd;               /* FILE: open for reading while the weight exists */
  uint64_t file_offset; /* FILE: where the bytes start */
} vp_source_t;

/* Describe n weights of one VBAR: weight i is [offsets[i], +sizes[i]) with
 * source srcs[i] (srcs may be NULL: every source is NONE). Weights may not
 * overlap each other. Create them in the order they are used: prefetch
 * looks ahead in that order, whatever their offsets. All or nothing. */
VP_API int vp_weights_create(vp_vbar_t vbar, size_t n, const uint64_t *offsets,
                             const uint64_t *sizes, const vp_source_t *srcs,
                             vp_weight_t *out);
/* VP_EBUSY while acquired. Destroying a VBAR destroys its weights. */
VP_API int vp_weight_destroy(vp_weight_t w);
/* Re-place n weights of one VBAR: w[i] moves to offsets[i]. A weight whose
 * offset changes loses its fill (its bytes are not moved: it is filled
 * anew at its next acquire; a staged copy is dropped, copies into it are
 * waited for); one whose offset stays keeps its fill, so resident weights
 * left in place cost no copy. Prefetch then looks ahead through the listed
 * weights in the order given, then the VBAR's others in their order so
 * far. The new places may not overlap each other or the weights not
 * listed (the listed ones' old places are free). Pages are neither
 * committed nor evicted. All or nothing: VP_EBUSY while a listed weight is
 * acquired, VP_EINVAL for one listed twice, of another VBAR, or places
 * that overlap, VP_ERANGE for a place outside the VBAR. */
VP_API int vp_weights_move(vp_vbar_t vbar, size_t n, const vp_weight_t *w,
                           const uint64_t *offsets);
/* Weight w takes its bytes from src from now on (the rules of
 * vp_weights_create; copies from the old source are waited for, so it may
 * be freed after this returns): its resident pages are filled anew at its
 * next acquire, a staged copy is dropped, and it keeps its place in the
 * VBAR and in the order prefetch looks ahead in. VP_EBUSY while acquired. */
VP_API int vp_weight_set_source(vp_weight_t w, const vp_source_t *src);
/* Weight w takes the same bytes from src from now on: src holds what its
 * last acquire used (its bytes as the caller left them: rewritten after a
 * copy, say), so its resident pages and a staged copy an acquire used stay
 * valid and cost no copy; bytes copied ahead of an acquire (prefetch) are
 * dropped and filled from src when next acquired. Copies from the old
 * source are waited for (it may be freed after this returns). VP_EBUSY
 * while acquired; the rules of src as in vp_weight_set_source. */
VP_API int vp_weight_swap_source(vp_weight_t w, const vp_source_t *src);
/* vp_weight_set_lookahead: the weight uses the device's lookahead. */
#define VP_LOOKAHEAD_DEVICE UINT64_MAX
/* Weight w's prefetch window: the prefetch that follows an acquire whose
 * last weight is w (and vp_prefetch after w, and the top-up of a release
 * after it) runs up to `bytes` ahead (0 = none) instead of the device's
 * lookahead; VP_LOOKAHEAD_DEVICE (what a new weight has) goes back to the
 * device's. Models sharing a device each keep their own windows this way,
 * without writing the device's setting. Allowed while w is acquired (the
 * next prefetch after it uses the new window). */
VP_API int vp_weight_set_lookahead(vp_weight_t w, uint64_t bytes);
/* Weight w's window as set (VP_LOOKAHEAD_DEVICE: none of its own). */
VP_API int vp_weight_get_lookahead(vp_weight_t w, uint64_t *bytes);

/* flags[i] after vp_acquire: */
#define VP_ACQUIRED_RESIDENT 0x1u /* ptrs[i] is the weight's VBAR address */
#define VP_ACQUIRED_STAGED 0x2u   /* ptrs[i] is in the staging ring, valid
                                     until the weight is released */
#define VP_ACQUIRED_COPIED 0x4u   /* its bytes were copied from the source
                                     for this acquire (now or by prefetch) */
#define VP_ACQUIRED_EMPTY 0x8u    /* source NONE and the bytes are not valid:
                                     the caller fills them on `stream` */

/* Make n weights (of one or more VBARs of dev) usable by work queued on
 * `stream` and give their device addresses in ptrs (flags may be NULL).
 * A weight whose pages are resident is used in place, filled from its
 * source first if its pages were recommitted since its last fill; a miss
 * is copied into the staging ring. Copies run on the device's copy stream
 * and `stream` waits for them on the device: the CPU does not wait. Then
 * the next weights of the VBAR that need a copy, up to the last weight's
 * window (vp_weight_set_lookahead; by default the device's lookahead)
 * bytes, are prefetched (filled in place or staged).
 * Pass each VBAR's weights in execution order, a layer per call. Errors:
 * VP_ELIMIT when a missed weight does not fit in the staging ring (raise
 * staging_size); nothing stays acquired after an error. */
VP_API int vp_acquire(vp_device_t dev, const vp_weight_t *w, size_t n,
                      vp_stream_t stream, uint64_t *ptrs, uint8_t *flags);
/* vp_acquire whose prefetch runs up to `lookahead` bytes (0 = none: an
 * acquire that covers its own, e.g. layers held for a whole forward)
 * instead of the last weight's window; a release top-up after it uses the
 * same. Nothing device-wide changes. */
VP_API int vp_acquire_ahead(vp_device_t dev, const vp_weight_t *w, size_t n,
                            vp_stream_t stream, uint64_t *ptrs,
                            uint8_t *flags, uint64_t lookahead);
/* The prefetch that ends vp_acquire, as if `after` had just been acquired
 * resident: start the weights that follow it in its VBAR's order of use,
 * up to its window bytes (a window already queued that holds `after` is
 * left as it is). Nothing is acquired. For a caller that holds some
 * layers' weights across several of its steps and skips their acquires.
 * A no-op with lookahead 0. */
VP_API int vp_prefetch(vp_device_t dev, vp_weight_t after);
/* vp_prefetch with the window given (bytes; 0: none), as vp_acquire_ahead
 * gives its acquire's prefetch one: the prefetch that acquire would run. */
VP_API int vp_prefetch_ahead(vp_device_t dev, vp_weight_t after,
                             uint64_t lookahead);
/* vp_prefetch_ahead (lookahead 0: the weight's own window, as vp_prefetch)
 * whose copies from page-locked host memory are read by `programs` (1 to
 * VP_SM_PROGRAMS_MAX) thread blocks of a kernel, the device's SMs pulling
 * the bytes over the link, instead of by its copy engine: a copy engine
 * takes copies in the order they were queued, whatever their stream, so a
 * prefetch queued while the GPU waits for its host (between two forwards)
 * holds up the application's own copies of its inputs until it ends; read
 * by SMs it shares the link with them instead. The same bytes, ordering
 * and fences as any prefetch; copies the backend cannot make so (the
 * simulated device's and a GPU's from memory not page-locked or not
 * 16-byte aligned, HIP's, a driver without the kernel's entry points)
 * are the copy engine's. vp_device_stats' sm_copy_bytes counts those
 * made by SMs. Its blocks take SM room from the application's kernels
 * while they copy: it is for the time the GPU waits for its host, not
 * for under a forward's kernels. */
#define VP_SM_PROGRAMS_MAX 1024
VP_API int vp_prefetch_sm(vp_device_t dev, vp_weight_t after,
                          uint64_t lookahead, uint32_t programs);
/* End the use of n acquired weights: work queued on `stream` so far may
 * still read them; their pages and staging slots are reused only after it
 * completes. Release on the stream the weight was acquired on. Close a
 * device only after the streams that use its acquired weights are done.
 * When the staging ring had cut the prefetch short and a release gives an
 * eighth of the lookahead back, the prefetch goes on from the last
 * acquired weight into that room (its copies wait for this release's
 * work on the device), so the copy engine does not wait for the next
 * acquire. */
VP_API int vp_release(vp_device_t dev, const vp_weight_t *w, size_t n,
                      vp_stream_t stream);
/* Change the prefetch lookahead (bytes; 0 = off) of weights without a
 * window of their own (vp_weight_set_lookahead). */
VP_API int vp_device_set_lookahead(vp_device_t dev, uint64_t bytes);
/* Change the staging ring's size (bytes, > 0; charged to the budget): the
 * ring is freed, once the copies and the work reading it are done (this
 * waits for them), and the next miss opens it at the new size. VP_EBUSY
 * while a staged weight is acquired. */
VP_API int vp_device_set_staging_size(vp_device_t dev, uint64_t bytes);
/* Lend the staging ring device memory of the caller's, [addr, +size)
 * (256-byte aligned; up to VP_LENT_RANGES ranges at once, each its own
 * call; a range that starts where one lent ends lengthens that one),
 * until vp_device_reclaim_staging: e.g. blocks of a framework's
 * allocator cache, idle between two forwards. Not charged to the budget.
 * While the loan is open a prefetch stages the next weights there first,
 * then in the ring, its window larger by the bytes lent. Copies into
 * the range wait for the work queued on `stream` so far (its last users).
 * The first acquire that takes a weight staged there closes the loan to
 * new slots (a loan bridges a forward's start: lent before a prefetch
 * that goes on past what the ring holds, the next weights go there and
 * are used first). With no ring open (nothing streamed yet) nothing is
 * lent. */
#define VP_LENT_RANGES 8
VP_API int vp_device_lend_staging(vp_device_t dev, uint64_t addr,
                                  uint64_t size, vp_stream_t stream);
/* End the loan: no new slot goes there. VP_EBUSY while an acquire holds a
 * weight staged there, or (force 0) a weight staged there waits for its
 * acquire: call again later. Otherwise the weights staged there and not
 * acquired are dropped (staged again when needed), `stream` waits on the
 * device for every copy into the ranges and every reader of them (not for
 * the ring's copies queued since), and the ranges are the caller's again
 * for work queued on `stream` after the call. VP_OK with nothing lent. */
VP_API int vp_device_reclaim_staging(vp_device_t dev, vp_stream_t stream,
                                     int force);

/* ----------------------------------------------------------------- files */

/* Copy [offset, offset+size) of an open file into pinned VBAR memory at
 * dst_addr (rules of vp_copy_to_device), through the device's ring of
 * pinned bounce slots: each slot's upload overlaps the next read. */
VP_API int vp_file_read_to_device(vp_device_t dev, int fd, uint64_t offset,
                                  uint64_t size, uint64_t dst_addr,
                                  vp_stream_t stream);
/* The most threads vp_file_read_to_address reads a slot over. */
#define VP_FILE_THREADS_MAX 64
/* vp_file_read_to_device for any device memory of this device: a range
 * inside a VBAR keeps its rules (pinned, one VBAR); a range outside every
 * VBAR is memory another allocator made (a torch tensor; on the simulated
 * device, host memory), which vpager cannot check: the caller keeps it
 * allocated until the stream reaches the copies. Each slot is read over
 * `threads` threads (1..VP_FILE_THREADS_MAX; pieces of at least 1 MiB). */
VP_API int vp_file_read_to_address(vp_device_t dev, int fd, uint64_t offset,
                                   uint64_t size, uint64_t dst_addr,
                                   vp_stream_t stream, uint32_t threads);
/* Free the file reader's bounce slots, waiting for their uploads; the next
 * read makes them again. */
VP_API int vp_file_reader_release(vp_device_t dev);
/* A file descriptor of vpager's own C runtime for an OS file handle. The
 * calls that take an fd (above; file sources) take one of vpager's
 * runtime, and on Windows a process holds several runtimes, each with its
 * own table of fds (Python's are not vpager.dll's): pass the fd's HANDLE
 * (_get_osfhandle; in Python msvcrt.get_osfhandle) and use the fd this
 * gives. The handle is duplicated: the caller keeps and closes its own,
 * vp_file_descriptor_close this one. Elsewhere os_handle is an fd, and
 * the result its duplicate (close-on-exec). */
VP_API int vp_file_descriptor(intptr_t os_handle, int *fd);
VP_API int vp_file_descriptor_close(int fd);

/* safetensors files: an 8-byte little-endian header length, a JSON header
 * {"name": {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]},
 * "__metadata__": {..}}, then the data. Validated strictly on open: JSON
 * syntax, known dtypes, shape product x dtype size == data size, offsets
 * inside the file, no overlaps, header at most 100 MiB. Errors name the
 * file and the tensor. */
typedef struct vp_st { uint64_t id; } vp_st_t;

typedef struct vp_st_tensor {
  const char *name;  /* valid until vp_st_close */
  char dtype[16];    /* "F32", "BF16", "F8_E4M3FNUZ", ... */
  uint32_t ndim;
  uint64_t shape[8];
  uint64_t offset;   /* absolute file offset of the data */
  uint64_t size;     /* bytes */
} vp_st_tensor_t;

/* Open and validate a safetensors file; the handle keeps it open. */
VP_API int vp_st_open(vp_device_t dev, const char *path, vp_st_t *out);
/* Close it (and its mapping); a second close gives VP_EHANDLE. */
VP_API int vp_st_close(vp_st_t st);
/* The number of tensors. */
VP_API int vp_st_count(vp_st_t st, size_t *n);
/* Tensors in file order (of their data offsets). */
VP_API int vp_st_tensor(vp_st_t st, size_t index, vp_st_tensor_t *t);
/* The index of the tensor called `name` (VP_EINVAL naming it if none). */
VP_API int vp_st_find(vp_st_t st, const char *name, size_t *index);
/* A VP_SOURCE_FILE source for tensor `index` (the fd stays open until
 * vp_st_close). */
VP_API int vp_st_source(vp_st_t st, size_t index, vp_source_t *src);
/* Load n tensors straight into VBAR offsets (each range is faulted, read
 * through the file reader, unpinned on `stream`). All or nothing: on any
 * failure the pages written so far are evicted, so no weight is left half
 * loaded. VP_MISS when the ranges cannot all be made resident. */
VP_API int vp_st_load(vp_st_t st, size_t n, const size_t *indices,
                      vp_vbar_t vbar, const uint64_t *offsets,
                      vp_stream_t stream);
/* Map the whole file read-only (once; later calls return the same). */
VP_API int vp_st_mmap(vp_st_t st, const void **base, uint64_t *size);
/* Drop the file's pages from memory (the mapping's and the page cache's). */
VP_API int vp_st_drop_pages(vp_st_t st);

/* ---------------------------------------------------------------- ledger */

/* Every device handle on a GPU joins that GPU's ledger: a shared-memory
 * segment (/dev/shm/vpager-ledger-v3-<name>, v3 its layout version,
 * <name> "GPU-<uuid>" on CUDA and "sim-<sim_shared>" on a shared
 * simulated device; vp_options_t.ledger overrides it). Each participant
 * publishes its process (pid, start time, command), committed bytes, its
 * framework allocator's reservation, and per VBAR the label, size,
 * resident, pinned and reclaimable bytes, priority rank, last use and hit
 * and miss counts.
 *
 * One order across processes: when vp_fault finds no room, it first asks
 * other participants to release pages of VBARs used less recently than
 * its own candidates (least recently used first; never a VBAR with pinned
 * pages), re-measuring device free memory between steps and asking each
 * only for what is still missing; then it evicts its own pages as it would
 * without a ledger. vp_acquire asks other participants after the call when
 * its own pages could not make room. Each participant runs a service
 * thread that answers requests by evicting its own pages (waiting for its
 * own fences); one that does not answer within ledger_timeout_us is
 * skipped for a second, with a warning. Pages released so lower their
 * VBAR's watermark as any eviction under pressure does (vp_vbar_prioritize
 * lifts it when the model is used again). Participants that died are
 * reaped by pid and start time.
 *
 * A segment of another layout version, a truncated or corrupt one, or one
 * this user may not open is not joined: the device works alone and says
 * why (a warning, and "reason" in vp_ledger_snapshot). */

#define VP_LABEL_MAX 64 /* bytes of a VBAR label, the NUL included */

/* Name a VBAR in the ledger and in reports: printable ASCII without
 * double quotes or backslashes (reports show labels as they are), at most
 * VP_LABEL_MAX - 1 bytes ("" clears it); VP_EINVAL names the first byte
 * refused. */
VP_API int vp_vbar_set_label(vp_vbar_t vbar, const char *label);
/* The VBAR's label, NUL-terminated, in buf (VP_ERANGE when len is too
 * small; VP_LABEL_MAX bytes always suffice). */
VP_API int vp_vbar_label(vp_vbar_t vbar, char *buf, size_t len);
/* Publish how much device memory the framework's own allocator holds now
 * (e.g. torch's reserved bytes: the instantaneous value, not the peak). */
VP_API int vp_device_set_external_reserved(vp_device_t dev, uint64_t bytes);
/* And the least it holds once warmed up (measured once, after the first
 * forward): what it cannot give back. */
VP_API int vp_device_set_external_floor(vp_device_t dev, uint64_t bytes);
/* The device's ledger as one JSON object (every participant, their VBARs,
 * pending requests; {"joined": false, "reason": ...} without one), into buf
 * as vp_device_report does (*needed, VP_ERANGE). */
VP_API int vp_ledger_snapshot(vp_device_t dev, char *buf, size_t len,
                              size_t *needed);
/* Free `bytes` of device memory over every participant, this one
 * included: least recently used VBAR first, never one with pinned pages,
 * re-measuring device free memory between steps and stopping once it grew
 * by `bytes`. *freed (may be NULL) gets the bytes the participants
 * evicted; less than `bytes` means the rest could not be freed. Without a
 * ledger it is vp_device_free_memory. */
VP_API int vp_ledger_free_memory(vp_device_t dev, uint64_t bytes,
                                 uint64_t *freed);
/* vp_ledger_free_memory leaving the `nkeep` VBARs of `keep` (handles of
 * this process, of any device) alone. */
VP_API int vp_ledger_free_memory_keep(vp_device_t dev, uint64_t bytes,
                                      const vp_vbar_t *keep, size_t nkeep,
                                      uint64_t *freed);
/* No device needed, nothing joined or changed: the names of this machine's
 * ledgers as a JSON array of strings, and one ledger (by name) as
 * vp_ledger_snapshot gives it. */
VP_API int vp_ledger_list(char *buf, size_t len, size_t *needed);
VP_API int vp_ledger_read(const char *name, char *buf, size_t len,
                          size_t *needed);

/* ----------------------------------------------------------------- stats */

/* Counters, declared once. A hit is a fault whose pages were all resident,
 * a fill one that committed at least one page (its data must be refilled),
 * a miss one that declined. */
#define VP_STAT_FIELDS(X)                                                      \
  X(faults, "fault calls")                                                     \
  X(hits, "faults with every page resident")                                   \
  X(fills, "faults that committed pages")                                      \
  X(misses, "faults declined")                                                 \
  X(unpins, "unpin calls")                                                     \
  X(pages_committed, "pages committed")                                        \
  X(pages_evicted, "pages evicted")                                            \
  X(evict_waits, "evictions that waited for a fence")                          \
  X(commit_failures, "commits refused by the device")                          \
  X(commit_retries, "commits retried after a transient error")                 \
  X(watermark_misses, "misses caused by the watermark")                        \
  X(budget_misses, "misses caused by the budget")                              \
  X(budget_polls, "device free-memory polls")                                  \
  X(bytes_copied, "bytes copied by vp_copy_*")                                 \
  X(acquires, "weights acquired")                                              \
  X(weight_fills, "weights filled in place by an acquire")                     \
  X(weight_staged, "weights staged by an acquire")                             \
  X(fill_bytes, "bytes an acquire copied into VBAR pages")                     \
  X(staged_bytes, "bytes an acquire copied into the staging ring")             \
  X(copies, "host-to-device copies issued (after merging)")                    \
  X(stream_waits, "caller streams made to wait for the copy stream")           \
  X(prefetch_bytes, "bytes prefetched ahead of need")                          \
  X(prefetch_used_bytes, "prefetched bytes later acquired")                    \
  X(prefetch_dropped_bytes, "prefetched bytes dropped unused")                 \
  X(ring_waits, "staging reuses that waited for a release fence")              \
  X(host_pinned_bytes, "host bytes page-locked (now)")                         \
  X(pin_fallback_bytes, "host bytes left pageable: pinning failed or over "    \
                        "budget")                                              \
  X(file_bytes_read, "bytes read from files")

typedef struct vp_stats {
  uint32_t size;    /* caller sets sizeof(vp_stats_t) */
  uint32_t version; /* 1 */
#define VP__STAT_MEMBER(name, doc) uint64_t name;
  VP_STAT_FIELDS(VP__STAT_MEMBER)
#undef VP__STAT_MEMBER
  uint64_t committed_bytes; /* now: bytes resident */
  uint64_t pinned_bytes;    /* now: bytes pinned */
  uint64_t machine_pinned_bytes; /* now, device stats only: host bytes
                                    page-locked by every vpager process on
                                    the machine (this device's alone when
                                    it has no pin ledger) */
  uint64_t sm_copy_bytes; /* device stats only: bytes vp_prefetch_sm's
                             copies had read by SMs, not the copy engine */
  uint64_t reserved[6];
} vp_stats_t;

/* Device totals (sum over its VBARs, live and destroyed). */
VP_API int vp_device_stats(vp_device_t dev, vp_stats_t *stats);
VP_API int vp_vbar_stats(vp_vbar_t vbar, vp_stats_t *stats);
/* Write a report of the device, its counters and a residency map of each
 * VBAR ('#' resident, 'P' pinned, '.' not resident) into buf, as text or
 * (json != 0) as one JSON object. The text is for people: sizes in one
 * rule ("32 MiB", "1 GiB", "3.6 GiB": the largest binary unit, one decimal
 * when not whole), counters that are 0 left out, each with what it counts;
 * the JSON has every counter and every size in bytes. *needed (may be
 * NULL) gets the length without the NUL; VP_ERANGE when buf is too small
 * (then buf holds a truncated, NUL-terminated report). */
VP_API int vp_device_report(vp_device_t dev, int json, char *buf, size_t len,
                            size_t *needed);

#ifdef __cplusplus
}
#endif
#endif /* VPAGER_H */
