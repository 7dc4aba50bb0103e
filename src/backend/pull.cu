/* The CUDA backend's copy by SMs (cuda.c, copy_htod_sm), as source.
 * cuda.c embeds the PTX text (pull_ptx.h) and loads it with
 * cuModuleLoadData: the driver JIT-compiles it for the GPU at hand, so
 * vpager's build needs no CUDA toolkit. Regenerate pull_ptx.h after a
 * change here (`make pull-ptx`, which runs):
 *
 *   /usr/local/cuda/bin/nvcc -arch=compute_75 -ptx src/backend/pull.cu
 *
 * and writes its output as a C string, its .version line set to 7.0.
 * compute_75 PTX runs on every GPU from Turing on (sm_90 on the H200);
 * declared PTX ISA 7.0, drivers from CUDA 11.0 on JIT it.
 *
 * Why a kernel: a GPU's copy engine takes host-to-device copies in the
 * order they were queued, whatever their stream (bench/
 * copy_queue_probe.py), so a fill queued in the pause between two
 * forwards holds up the client's own copies of its inputs until it ends.
 * Read by a few SMs from pinned host memory mapped into the device's
 * address space, the fill shares the link with those copies instead.
 */

/* n bytes from src (host memory the device can read) to dst (device
 * memory), both 16-byte aligned. Each block moves tiles of 4 x blockDim
 * 16-byte vectors: a thread's four loads are in flight together (each
 * crosses the link: its latency, not the link's rate, bounds one load),
 * and each of a warp's loads is 512 contiguous bytes. Block 0 copies the
 * last n % 16 bytes. */
extern "C" __global__ void vp_pull(uint4 *__restrict__ dst,
                                   const uint4 *__restrict__ src,
                                   unsigned long long n) {
  const unsigned long long n16 = n >> 4, step = blockDim.x,
                           tile = 4 * step;
  for (unsigned long long at = blockIdx.x * tile + threadIdx.x; at < n16;
       at += gridDim.x * tile) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; k++)
      if (at + k * step < n16) v[k] = src[at + k * step];
#pragma unroll
    for (int k = 0; k < 4; k++)
      if (at + k * step < n16) dst[at + k * step] = v[k];
  }
  if (blockIdx.x == 0 && threadIdx.x < (n & 15)) {
    const unsigned long long i = (n16 << 4) + threadIdx.x;
    ((unsigned char *)dst)[i] = ((const unsigned char *)src)[i];
  }
}
