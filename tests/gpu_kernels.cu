/* The CUDA kernel that tests/test_gpu.c runs, as source. The test embeds
 * the PTX text, loads it with cuModuleLoadData (the driver JIT-compiles it
 * for the GPU at hand), so vpager's build needs no CUDA toolkit.
 *
 * Regenerate the string in tests/test_gpu.c (the block between the
 * "BEGIN PTX" and "END PTX" markers) after a change here:
 *
 *   /usr/local/cuda/bin/nvcc -arch=compute_80 -ptx tests/gpu_kernels.cu \
 *       -o - | sed 's/\\/\\\\/g; s/"/\\"/g; s/^/  "/; s/$/\\n"/'
 *
 * compute_80 PTX runs on every GPU from Ampere on (sm_90 on the H200).
 */

/* Spin until `spin_ns` nanoseconds of %globaltimer have passed since the
 * thread started, then add every 64-bit word of data[0, nwords) into
 * out[0] (wrapping). Thread 0 of block 0 stores in out[1] how long it spun
 * (ns). With spin_ns = 0 it is a plain sum. The words are read only after
 * the spin: a page evicted under a running kernel faults here. */
extern "C" __global__ void vp_test_spin_sum(const unsigned long long *data,
                                            unsigned long long nwords,
                                            unsigned long long spin_ns,
                                            unsigned long long *out) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  t = t0;
  while (t - t0 < spin_ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (blockIdx.x == 0 && threadIdx.x == 0) out[1] = t - t0;
  unsigned long long s = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x +
                              threadIdx.x;
       i < nwords; i += (unsigned long long)gridDim.x * blockDim.x)
    s += data[i];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}
